"""Decode throughput of Hugging Face MoE architectures: one process against EP over gloo (issue 14).

    python -m bench.bench_hf [--archs deepseek_v3,gpt_oss] [--ranks 1,2] [--batch 8] [--steps 32]
                             [--config '{"hidden_size": 64}'] [--json bench-hf.json]

For each architecture (a tiny random model, ``--config`` laid over its tiny config) and each EP
size, that many processes (spawned, one intra-op thread each, gloo on loopback) serve the model
with :class:`eplb.models.hf.HFMoE` (2 redundant slots per rank): a seeded batch of ``--batch``
prompts of ``--prompt`` tokens is prefilled, then decoded greedily for ``--steps`` steps with
the model's KV cache. Reported: decode tokens/s (batch x steps / the slowest rank's decode
time) and whether the probe digest equals the single-process one (it must, bitwise).
Attention is replicated on every rank, so on one CPU host EP adds the combine's all_gather per
MoE layer and buys no compute: the figure is the cost of serving under EP, not a speed-up.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from typing import Any

from rich.console import Console
from rich.table import Table

from bench.common import machine_info, write_json


def _rank_main(rank: int, size: int, port: int, settings: dict[str, Any], results: Any) -> None:
    import os
    from datetime import timedelta

    import torch
    import torch.distributed as dist

    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    torch.set_num_threads(1)
    try:
        from eplb.models.hf import HFMoE, describe
        from eplb.placement import Placement

        store = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=timedelta(seconds=60))
        dist.init_process_group("gloo", store=store, rank=rank, world_size=size, timeout=timedelta(seconds=60))
        spec = {"kind": "hf", "architecture": settings["arch"], "config": settings["config"], "seed": 0}
        info = describe(spec)
        slots = info.num_logical_experts + 2 * size if size > 1 else info.num_logical_experts
        model = HFMoE(spec, Placement.static(info.num_moe_layers, info.num_logical_experts, slots), rank, size,
                      timeout=60.0)
        digest = model.probe().digest
        ids = torch.randint(0, model.vocab_size, (settings["batch"], settings["prompt"]),
                            generator=torch.Generator().manual_seed(5))
        dist.barrier()
        state = model.prefill(ids)
        started = time.perf_counter()
        for _ in range(settings["steps"]):
            model.decode_step(state)
        seconds = time.perf_counter() - started
        results.put((rank, {"seconds": seconds, "digest": digest}))
        dist.barrier()
        dist.destroy_process_group()
    except BaseException as exc:  # noqa: BLE001 - reported to the parent
        results.put((rank, {"error": f"{type(exc).__name__}: {exc}"}))


def run_one(arch: str, size: int, settings: dict[str, Any], timeout: float) -> dict[str, Any]:
    import multiprocessing as mp

    import torch.distributed as dist

    ctx = mp.get_context("spawn")
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, use_libuv=True)
    results = ctx.Queue()
    procs = [ctx.Process(target=_rank_main, args=(r, size, store.port, {**settings, "arch": arch}, results), daemon=True)
             for r in range(size)]
    for proc in procs:
        proc.start()
    per_rank: dict[int, dict[str, Any]] = {}
    try:
        deadline = time.monotonic() + timeout
        while len(per_rank) < size:
            rank, result = results.get(timeout=max(1.0, deadline - time.monotonic()))
            per_rank[rank] = result
    finally:
        for proc in procs:
            proc.join(30)
            if proc.is_alive():
                proc.kill()
    errors = [r["error"] for r in per_rank.values() if "error" in r]
    if errors:
        raise RuntimeError(f"{arch} on {size} ranks: {errors[0]}")
    seconds = max(r["seconds"] for r in per_rank.values())
    return {"seconds": seconds, "tokens_per_second": settings["batch"] * settings["steps"] / seconds,
            "digests": sorted({r["digest"] for r in per_rank.values()})}


def main(argv: list[str] | None = None) -> int:
    from eplb.models.config import ARCHITECTURES

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--archs", default=",".join(ARCHITECTURES))
    parser.add_argument("--ranks", default="1,2", help="EP sizes; 1 is the unsharded model in one process")
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--prompt", type=int, default=16)
    parser.add_argument("--steps", type=int, default=32)
    parser.add_argument("--config", default="{}", help="JSON laid over every architecture's tiny config")
    parser.add_argument("--timeout", type=float, default=300.0)
    parser.add_argument("--json", default=None)
    args = parser.parse_args(argv)
    settings = {"batch": args.batch, "prompt": args.prompt, "steps": args.steps, "config": json.loads(args.config)}
    sizes = [int(s) for s in args.ranks.split(",")]
    console = Console()
    table = Table(title=f"greedy decode, batch {args.batch}, {args.steps} steps (tokens/s, CPU, gloo)")
    table.add_column("architecture")
    for size in sizes:
        table.add_column("1 process" if size == 1 else f"EP {size}", justify="right")
    table.add_column("probe identical", justify="right")
    out: dict[str, Any] = {"settings": {**settings, "ranks": sizes}, "machine": machine_info(), "results": {}}
    ok = True
    for arch in args.archs.split(","):
        rows = {size: run_one(arch, size, settings, args.timeout) for size in sizes}
        digests = {d for r in rows.values() for d in r["digests"]}
        ok &= len(digests) == 1
        out["results"][arch] = {str(size): r for size, r in rows.items()} | {"identical": len(digests) == 1}
        table.add_row(arch, *(f"{rows[s]['tokens_per_second']:.0f}" for s in sizes), "yes" if len(digests) == 1 else "NO")
    console.print(table)
    write_json(args.json, out)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
