"""Expert transfers over gloo and over NIXL on the same plan, in one run (issue 9).

    python -m bench.bench_transfer [--ranks 4] [--layers 8] [--json bench-transfer.json]

``--ranks`` processes (spawned, one intra-op thread each) hold ``--layers`` layers of
``--slots`` expert slots each, ``[w13 [S, 2I, H], w2 [S, H, I]]`` in bf16. One seeded
rebalance moves every layer (a random permutation of the slots, so most experts change rank).
For each communicator, on the same weights and the same plans:

- **one layer**: ``execute_layer`` of layer 0 into the staging buffer, ``--repeats`` times
  (the median is reported; NIXL's first call, which creates the agent, registers the weights
  and exchanges the metadata, is reported apart as ``first_seconds``);
- **full rebalance**: every layer transferred and committed in place, then every slot checked.

``--progress-thread`` adds a run of NIXL with its own UCX progress thread (the communicator's
default drives progress from the layer's waits instead; see :mod:`eplb.communicator`).
``--migration-batching on|both`` runs each communicator with ``enable_migration_batching``
(batches follow the plan's migration rounds: one peer per direction per rank and batch) instead
of, or as well as, the plain chunks (``off``, the default); the batched runs are named
``<communicator>+rounds``.

A time is the slowest rank's (a layer is done when every rank is); bytes are summed over the
receiving ranks; effective bandwidth = bytes / time.
"""

from __future__ import annotations

import argparse
import os
import random
import sys
import time
from datetime import timedelta
from typing import Any

from rich.console import Console
from rich.table import Table

from bench.common import MiB, fmt_bytes, fmt_s, machine_info, percentile, write_json


def _rows(num_layers: int, num_experts: int, num_slots: int, seed: int) -> tuple[list[list[int]], list[list[int]]]:
    """Old and new placement rows per layer: every expert once, the rest random replicas, shuffled."""
    rng = random.Random(seed)
    old, new = [], []
    for _ in range(num_layers):
        base = list(range(num_experts)) + [rng.randrange(num_experts) for _ in range(num_slots - num_experts)]
        a, b = base[:], base[:]
        rng.shuffle(a)
        rng.shuffle(b)
        old.append(a)
        new.append(b)
    return old, new


def _rank_main(rank: int, args: dict[str, Any], port: int, results: Any) -> None:
    import torch
    import torch.distributed as dist

    from eplb.communicator import nixl_available

    torch.set_num_threads(1)
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    store = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=timedelta(seconds=120), use_libuv=True)
    dist.init_process_group("gloo", store=dist.PrefixStore("bench-transfer/", store), rank=rank,
                            world_size=args["ranks"], timeout=timedelta(seconds=120))
    bench = _RankBench(rank, args)
    kinds = ["gloo"] + (["nixl"] if nixl_available() and not args["gloo_only"] else [])
    if args["progress_thread"] and "nixl" in kinds:
        kinds.append("nixl+thread")  # NIXL with its own (polling) UCX progress thread
    modes = {"off": [False], "on": [True], "both": [False, True]}[args["migration_batching"]]
    candidates = [kind + ("+rounds" if batching else "") for kind in kinds for batching in modes]
    # warm the gloo connections (lazy pair set-up) so neither side pays it in the timings
    dist.all_reduce(torch.zeros(1))
    out = {name: bench.measure(name, store) for name in candidates}
    gathered: list[Any] = [None] * args["ranks"]
    dist.all_gather_object(gathered, out)
    if rank == 0:
        results.put(gathered)
    dist.barrier()
    dist.destroy_process_group()


class _RankBench:
    """One rank's weights, staging buffer and plans: slot ``j`` of layer ``l`` holds its expert id (+ ``l``)."""

    def __init__(self, rank: int, args: dict[str, Any]):
        import torch

        from eplb.plan import plan_layer

        self.rank, self.args = rank, args
        S, L = args["slots"], args["layers"]
        H, I = args["hidden"], args["intermediate"]  # noqa: E741 - the model's usual names
        self.old_rows, self.new_rows = _rows(L, args["experts"], args["ranks"] * S, args["seed"])
        self.weights = [[torch.empty(S, 2 * I, H, dtype=torch.bfloat16), torch.empty(S, H, I, dtype=torch.bfloat16)]
                        for _ in range(L)]
        self.staging = [torch.empty_like(t) for t in self.weights[0]]
        self.plans = [plan_layer(self.old_rows[layer], self.new_rows[layer], S) for layer in range(L)]

    def _fill(self, rows: Any, check: bool) -> int:
        """Set every slot to the old placement's value, or count the slots not holding the new one's."""
        wrong, S = 0, self.args["slots"]
        for layer, tensors in enumerate(self.weights):
            for j in range(S):
                value = float(rows[layer][self.rank * S + j] + layer)
                for t in tensors:
                    if check:
                        wrong += int(not bool((t[j] == value).all()))
                    else:
                        t[j].fill_(value)
        return wrong

    def measure(self, name: str, store: Any) -> dict[str, Any]:
        """One communicator: layer 0 ``repeats`` times (a first NIXL call apart), then every layer once, checked."""
        import torch.distributed as dist

        from eplb.communicator import NixlCommunicator, TorchCommunicator
        from eplb.transfer import commit_layer, execute_layer, op_batches

        kind, batching = name.removesuffix("+rounds"), name.endswith("+rounds")
        comm = TorchCommunicator("gloo") if kind == "gloo" else NixlCommunicator(progress_thread=kind == "nixl+thread")
        comm.bind(0, dist.PrefixStore(f"bench-{name}/", store))
        comm.set_weights(self.weights)
        comm.add_buffer(self.staging)
        self._fill(self.old_rows, check=False)
        run = {"timeout": 120.0, "communicator": comm, "max_ops_per_batch": self.args["max_ops"],
               "migration_batching": batching}
        times, first, received = [], None, 0
        for repeat in range(self.args["repeats"] + (1 if kind != "gloo" else 0)):
            dist.barrier()
            start = time.perf_counter()
            stats = execute_layer(self.plans[0], self.rank, self.weights[0], self.staging, layer=0, **run)
            elapsed = time.perf_counter() - start
            received = stats.bytes_received
            if kind != "gloo" and repeat == 0:
                first = elapsed  # agent, registrations, metadata exchange, then the reads
            else:
                times.append(elapsed)
        dist.barrier()
        start = time.perf_counter()
        total = 0
        for layer, plan in enumerate(self.plans):
            stats = execute_layer(plan, self.rank, self.weights[layer], self.staging, layer=layer, **run)
            commit_layer(plan.for_rank(self.rank), self.staging, self.weights[layer])
            total += stats.bytes_received
        full = time.perf_counter() - start
        dist.barrier()
        batches = [op_batches(plan.for_rank(self.rank), 2, self.args["max_ops"], batching)[1] for plan in self.plans]
        comm.close()
        return {"layer_times": times, "layer_first": first, "layer_bytes": received, "full_seconds": full,
                "full_bytes": total, "wrong_slots": self._fill(self.new_rows, check=True), "comm": comm.stats(),
                "batches_per_layer": sum(batches) / len(batches)}

def run(args: argparse.Namespace) -> dict[str, Any]:
    import multiprocessing as mp

    import torch.distributed as dist

    settings = {k: getattr(args, k) for k in ("ranks", "layers", "slots", "experts", "hidden", "intermediate",
                                              "repeats", "seed", "max_ops", "gloo_only", "progress_thread",
                                              "migration_batching")}
    ctx = mp.get_context("spawn")
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, use_libuv=True)
    results = ctx.Queue()
    procs = [ctx.Process(target=_rank_main, args=(r, settings, store.port, results), daemon=True)
             for r in range(args.ranks)]
    for proc in procs:
        proc.start()
    try:
        per_rank = results.get(timeout=args.timeout)
    finally:
        for proc in procs:
            proc.join(30)
            if proc.is_alive():
                proc.kill()
    expert_bytes = 3 * args.hidden * args.intermediate * 2
    out: dict[str, Any] = {"settings": settings, "machine": machine_info(), "expert_bytes": expert_bytes,
                           "ucx_tls": os.environ.get("UCX_TLS", "(auto)"), "communicators": {}}
    for name in per_rank[0]:
        ranks = [r[name] for r in per_rank]
        # the layer is done when the slowest rank is: per repeat, the max over ranks
        layer = [max(r["layer_times"][i] for r in ranks) for i in range(len(ranks[0]["layer_times"]))]
        layer_bytes = sum(r["layer_bytes"] for r in ranks)
        full = max(r["full_seconds"] for r in ranks)
        full_bytes = sum(r["full_bytes"] for r in ranks)
        median = percentile(layer, 50)
        first = [r["layer_first"] for r in ranks if r["layer_first"] is not None]
        out["communicators"][name] = {
            "layer_seconds": median, "layer_best_seconds": min(layer), "layer_bytes": layer_bytes,
            "layer_bytes_per_second": layer_bytes / median if median else None,
            "first_seconds": max(first) if first else None,
            "full_seconds": full, "full_bytes": full_bytes, "full_bytes_per_second": full_bytes / full if full else None,
            "wrong_slots": sum(r["wrong_slots"] for r in ranks),
            "batches_per_layer": ranks[0]["batches_per_layer"],
            "comm": ranks[0]["comm"],
        }
    comms = out["communicators"]
    if "gloo" in comms and "nixl" in comms:
        out["nixl_speedup_layer"] = comms["gloo"]["layer_seconds"] / comms["nixl"]["layer_seconds"]
        out["nixl_speedup_full"] = comms["gloo"]["full_seconds"] / comms["nixl"]["full_seconds"]
    for name in list(comms):
        if name + "+rounds" in comms:  # > 1: migration batching faster
            out.setdefault("rounds_speedup_full", {})[name] = comms[name]["full_seconds"] / comms[name + "+rounds"]["full_seconds"]
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--ranks", type=int, default=4)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--slots", type=int, default=8, help="expert slots per rank")
    parser.add_argument("--experts", type=int, default=24, help="logical experts (<= ranks * slots)")
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--intermediate", type=int, default=512)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--max-ops", dest="max_ops", type=int, default=64)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--gloo-only", dest="gloo_only", action="store_true")
    parser.add_argument("--progress-thread", dest="progress_thread", action="store_true",
                        help="also run NIXL with its own UCX progress thread (polls all the time)")
    parser.add_argument("--migration-batching", dest="migration_batching", choices=("off", "on", "both"),
                        default="off", help="batches by migration round (enable_migration_batching), or both ways")
    parser.add_argument("--timeout", type=float, default=600.0)
    parser.add_argument("--json", default=None)
    args = parser.parse_args(argv)
    if args.experts > args.ranks * args.slots:
        parser.error("--experts must be <= ranks * slots")
    console = Console()
    console.print(f"{args.ranks} ranks, {args.layers} layers x {args.slots} slots per rank, expert "
                  f"{fmt_bytes(3 * args.hidden * args.intermediate * 2)} (bf16), same seeded plan per communicator")
    result = run(args)
    table = Table(title="expert transfers: gloo vs NIXL (CPU, one host)")
    for column in ("communicator", "batches/layer", "one layer", "bytes", "bandwidth", "NIXL first layer",
                   "full rebalance", "bytes", "bandwidth", "wrong slots"):
        table.add_column(column, justify="right")
    for name, r in result["communicators"].items():
        table.add_row(name, f"{r['batches_per_layer']:.1f}", fmt_s(r["layer_seconds"]), fmt_bytes(r["layer_bytes"]),
                      f"{r['layer_bytes_per_second'] / MiB:.0f} MiB/s", fmt_s(r["first_seconds"]),
                      fmt_s(r["full_seconds"]), fmt_bytes(r["full_bytes"]),
                      f"{r['full_bytes_per_second'] / MiB:.0f} MiB/s", str(r["wrong_slots"]))
    console.print(table)
    if "nixl_speedup_full" in result:
        console.print(f"NIXL vs gloo: one layer x{result['nixl_speedup_layer']:.2f}, "
                      f"full rebalance x{result['nixl_speedup_full']:.2f} (> 1: NIXL faster)")
    else:
        console.print("NIXL is not installed: gloo only (pip install '.[nixl]')")
    for name, speedup in result.get("rounds_speedup_full", {}).items():
        console.print(f"{name}: migration batching vs plain chunks, full rebalance x{speedup:.2f} (> 1: rounds faster)")
    write_json(args.json, result)
    return 0 if all(r["wrong_slots"] == 0 for r in result["communicators"].values()) else 1


if __name__ == "__main__":
    sys.exit(main())
