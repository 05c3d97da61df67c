"""Scale up and down (2 -> 4 -> 2 ranks by default) on real worker processes (issue 4).

    python -m bench.bench_scale [--json bench-scale.json]

Per operation: the time in each phase (``Operation.phases``), how many decode steps the
workers completed in each phase (only ``rescaling`` should pause decoding), the pause seen
by the workers (``Operation.paused_seconds``: the longest per-rank rescale; and the longest
gap between two decode steps on any rank), the group rebuild time (destroy + rendezvous of the
new generation, ``group_seconds`` in the workers' Rescale report), and the bytes moved
(``Operation.bytes_moved``) against the minimum: for each new rank, the distinct experts it
holds that it did not hold before (a fresh rank holds nothing), times the expert's bytes.

A separate gloo send/recv between two fresh processes measures the loopback bandwidth.
Target: pause <= 2 * (bytes moved / bandwidth) + group rebuild time (+ ``--bookkeeping-ms``,
1 ms by default: when nothing moves, the formula leaves no room for the rescale's own
bookkeeping; the JSON also carries the strict verdict and ``pause - limit`` per operation).
``--communicator`` picks the transfer path (default ``auto``: NIXL when installed).
"""

from __future__ import annotations

import argparse
import logging
import math
import os
import statistics
import sys
import time
from typing import Any

from rich.console import Console
from rich.table import Table

from bench.common import BENCH_TIMEOUTS, MiB, RecordingCoordinator, fmt_bytes, fmt_s, loopback_bandwidth, machine_info, verdict, write_json
from elastic.control.coordinator import Operation
from elastic.core.mapping import RankMapping
from elastic.core.phases import OPERATION_PHASES
from elastic.deployment import DeploymentConfig, TracePhase
from eplb.config import EPLBConfig
from eplb.model import ModelShape
from eplb.trace import TraceConfig

PHASES = tuple(str(phase) for phase in OPERATION_PHASES)


def deployment(args: argparse.Namespace) -> DeploymentConfig:
    shape: Any = ModelShape(num_layers=args.layers, num_experts=args.experts, hidden_size=args.hidden,
                            intermediate_size=args.intermediate)
    if args.architecture:  # a real MoE (a tiny random one of that architecture): its own layers and experts
        shape = {"kind": "hf", "architecture": args.architecture, "seed": args.seed}
    eplb = EPLBConfig(use_async=True, num_redundant_experts=args.redundant, window_size=args.window,
                      step_interval=args.interval, communicator=args.communicator)
    trace = [TracePhase(trace=TraceConfig(kind="drift", drift_period=args.interval, tokens_per_step=args.tokens))]
    return DeploymentConfig(model=shape, eplb=eplb, trace=trace, ep_size=args.start, max_ep_size=max(args.sizes),
                            seed=args.seed, timeouts=BENCH_TIMEOUTS)


def minimum_bytes(before: list[list[int]], after: list[list[int]], old_size: int, new_size: int,
                  expert_bytes: int) -> dict[str, int]:
    """Bytes no redistribution can avoid: per new rank, distinct experts it did not hold before.

    Slots are rank-major with the same number per rank before and after. Also returns the
    bytes of a naive redistribution (every slot of the new placement copied).
    """
    mapping = RankMapping.for_resize(old_size, new_size).old_to_new
    slots = len(before[0]) // old_size
    assert len(after[0]) == slots * new_size, "slots per rank changed"
    needed = 0
    for old_row, new_row in zip(before, after):
        held: dict[int, set[int]] = {n: set() for n in range(new_size)}
        for old, new in enumerate(mapping):
            if new >= 0:
                held[new] |= set(old_row[old * slots:(old + 1) * slots])
        for new in range(new_size):
            needed += len(set(new_row[new * slots:(new + 1) * slots]) - held[new])
    return {"min_bytes": needed * expert_bytes, "experts": needed,
            "naive_bytes": len(after) * len(after[0]) * expert_bytes}


def analyse(op: Operation, coordinator: RecordingCoordinator, samples: list[dict[str, Any]], expert_bytes: int,
            step_seconds: float, wall_to_monotonic: float) -> dict[str, Any]:
    reports = [r for r in coordinator.phase_reports if r.phase == "Rescale" and r.operation_id == op.id]
    # decode steps a worker completed while its own rescale ran (must be 0): the report's
    # time.time() moved to the monotonic clock of the step samples
    during_own_rescale = 0
    for r in reports:
        end = r.at - wall_to_monotonic
        begin = end - r.detail.get("seconds", 0.0)
        during_own_rescale = max(during_own_rescale, sum(1 for s in samples if s["pid"] == r.pid and begin < s["t"] < end))
    kept = [r for r in reports if not r.detail.get("retired")]
    phases = {name: op.phases.get(name, {}) for name in PHASES}
    # decode steps the workers completed inside each phase's window (coordinator clock = the
    # workers' time.monotonic, one machine)
    steps_in = {}
    for name, ph in phases.items():
        lo, hi = ph.get("started"), ph.get("ended")
        per_pid: dict[int, int] = {}
        for s in samples:
            if lo is not None and hi is not None and lo <= s["t"] < hi:
                per_pid[s["pid"]] = per_pid.get(s["pid"], 0) + 1
        steps_in[name] = {"max_per_rank": max(per_pid.values(), default=0), "ranks_stepping": len(per_pid)}
    # the longest gap between two consecutive decode steps of one worker around the operation
    lo = phases["draining"].get("started", 0.0)
    hi = phases["resuming"].get("ended", math.inf) + 5.0
    gaps = []
    by_pid: dict[int, list[dict[str, Any]]] = {}
    for s in samples:
        if lo - 5.0 <= s["t"] <= hi:
            by_pid.setdefault(s["pid"], []).append(s)
    for ss in by_pid.values():
        ss.sort(key=lambda s: s["t"])
        gaps += [b["t"] - a["t"] for a, b in zip(ss, ss[1:])]
    minimum = minimum_bytes(kept[0].detail["placement_before"], kept[0].detail["placement_after"], op.from_size,
                            op.target_size, expert_bytes) if kept else {}
    return {
        "id": op.id, "from": op.from_size, "to": op.target_size, "status": op.status.value, "error": op.error,
        "phases": {name: ph.get("seconds") for name, ph in phases.items()},
        "steps_in_phase": steps_in,
        "paused_seconds": op.paused_seconds,
        "max_step_gap_seconds": max(gaps, default=math.nan),
        "median_step_seconds": step_seconds,
        "group_seconds": max((r.detail.get("group_seconds", 0.0) for r in reports), default=math.nan),
        "transfer_seconds": max((r.detail.get("transfer_seconds", 0.0) for r in reports), default=math.nan),
        "transfer_cpu_seconds_all_ranks": sum(r.detail.get("transfer_cpu_seconds", 0.0) for r in reports),
        "steps_during_own_rescale": during_own_rescale,
        "per_rank": [{"rank": r.rank, "generation": r.generation, "retired": bool(r.detail.get("retired")),
                      "bytes_received": r.detail.get("bytes_received"),
                      **{k: v for k, v in r.detail.items() if k.endswith("seconds")}}
                     for r in sorted(reports, key=lambda r: r.rank)],
        "bytes_moved": op.bytes_moved,
        **minimum,
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.bench_scale", description=__doc__.split("\n\n")[0])
    ap.add_argument("--sizes", default="2,4,2", help="EP sizes in order: the first is the start")
    ap.add_argument("--cycles", type=int, default=2, help="how many times to run the whole sequence")
    ap.add_argument("--layers", type=int, default=16)
    ap.add_argument("--experts", type=int, default=16)
    ap.add_argument("--redundant", type=int, default=16)
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--intermediate", type=int, default=512)
    ap.add_argument("--tokens", type=int, default=16, help="tokens each rank routes per step")
    ap.add_argument("--interval", type=int, default=20, help="EPLB step_interval (async)")
    ap.add_argument("--window", type=int, default=10)
    ap.add_argument("--steps-between", type=int, default=25, help="decode steps between two operations")
    ap.add_argument("--bw-mib", type=int, default=128, help="tensor size of the bandwidth measurement")
    ap.add_argument("--communicator", default="auto", choices=["auto", "gloo", "nccl", "nixl"],
                    help="transfer communicator (auto: NIXL when installed, else gloo on CPU)")
    ap.add_argument("--bookkeeping-ms", type=float, default=1.0,
                    help="allowance over the limit for a rescale's fixed bookkeeping, which the formula has no term "
                         "for (checking the announced plan, installing the maps: about 0.1-0.3 ms); it decides only "
                         "when almost nothing moves, e.g. a scale down whose survivors already hold every expert")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--architecture", default=None, help="a Hugging Face MoE architecture (deepseek_v3, gpt_oss, ...) "
                    "instead of the reference model; --layers/--experts/--hidden/--intermediate then do not apply")
    ap.add_argument("--json", dest="json_path", default=None, help="write the results as JSON here")
    args = ap.parse_args(argv)
    args.sizes = [int(x) for x in args.sizes.split(",")]
    if len(args.sizes) < 2:
        ap.error("--sizes needs at least two sizes")
    args.start = args.sizes[0]
    logging.basicConfig(level=logging.WARNING)
    console = Console() if sys.stdout.isatty() else Console(width=170)

    cfg = deployment(args)
    expert_bytes = cfg.sizes.expert_bytes
    what = f"{args.architecture} (Hugging Face, tiny random)" if args.architecture else "the reference model"
    console.print(f"[bold]bench_scale[/bold] on {what}: sizes {' -> '.join(map(str, args.sizes))} x{args.cycles}, "
                  f"{cfg.sizes.num_moe_layers} layers, "
                  f"{cfg.sizes.num_logical_experts} experts + {args.redundant} redundant ({cfg.slots_per_rank} slots per rank), expert "
                  f"{fmt_bytes(expert_bytes)}, async EPLB every {args.interval} steps")
    load_before = os.getloadavg()[0]
    t0 = time.monotonic()
    coordinator = RecordingCoordinator(cfg)
    ops: list[Operation] = []
    try:
        coordinator.start()
        # start the first operation while a rebalance is (likely) in flight, so draining has work
        coordinator.wait_for_step(args.interval + 3, timeout=120)
        for _ in range(args.cycles):
            for size in args.sizes[1:] + ([args.sizes[0]] if args.sizes[-1] != args.sizes[0] and args.cycles > 1 else []):
                op = coordinator.scale(size, timeout=300)
                ops.append(op)
                console.print(f"  scale {op.from_size} -> {op.target_size}: {op.status.value}"
                              + (f" ({op.error})" if op.error else "") + f" in {time.time() - op.created_at:.2f}s")
                if op.status.value != "succeeded":
                    raise SystemExit(f"scale {op.from_size} -> {op.target_size} failed: {op.error}")
                coordinator.wait_for_step(coordinator.snapshot()["step"] + args.steps_between, timeout=120)
        verdicts = coordinator.verify(timeout=120)
        samples = coordinator.step_samples()
    finally:
        coordinator.shutdown()
    deployment_seconds = time.monotonic() - t0
    console.print(f"  deployment done in {deployment_seconds:.1f}s; measuring loopback bandwidth ...")
    bw = loopback_bandwidth(args.bw_mib * MiB)
    bandwidth = bw["bytes_per_second"]

    by_pid: dict[int, list[float]] = {}
    for s in sorted(samples, key=lambda s: s["t"]):
        by_pid.setdefault(s["pid"], []).append(s["t"])
    step_seconds = statistics.median([b - a for ts in by_pid.values() for a, b in zip(ts, ts[1:])] or [math.nan])
    wall_to_monotonic = time.time() - time.monotonic()
    results = [analyse(op, coordinator, samples, expert_bytes, step_seconds, wall_to_monotonic) for op in ops]
    cpus = os.cpu_count() or 1
    for r in results:
        r["transfer_bound_seconds"] = r["bytes_moved"] / bandwidth
        r["pause_limit_seconds"] = 2 * r["transfer_bound_seconds"] + r["group_seconds"]
        r["pause_over_limit_seconds"] = r["paused_seconds"] - r["pause_limit_seconds"]
        r["pause_pass_strict"] = r["pause_over_limit_seconds"] <= 0
        r["pause_pass"] = r["pause_over_limit_seconds"] <= args.bookkeeping_ms / 1e3
        r["cpu_floor_seconds"] = r["transfer_cpu_seconds_all_ranks"] / cpus
        r["rescaling_only_pauses"] = (r["steps_during_own_rescale"] == 0 and
                                      all(r["steps_in_phase"][name]["max_per_rank"] > 0 for name in ("draining", "suppressed")))

    table = Table(title="Phases (coordinator) and decode steps completed in each (max over ranks)")
    table.add_column("operation")
    for name in PHASES:
        table.add_column(name, justify="right")
    table.add_column("total", justify="right")
    for r in results:
        cells = [f"{fmt_s(r['phases'][n])} / {r['steps_in_phase'][n]['max_per_rank']} steps" for n in PHASES]
        table.add_row(f"{r['from']} -> {r['to']}", *cells, fmt_s(sum(v or 0 for v in r["phases"].values())))
    console.print(table)

    table = Table(title=f"Pause and transfers (loopback gloo bandwidth {bandwidth / MiB:.0f} MiB/s one tensor, "
                        f"{bw['message_bytes_per_second'] / MiB:.0f} MiB/s as {fmt_bytes(bw['message_bytes'])} messages; "
                        f"median decode step {fmt_s(step_seconds)})")
    for col in ("operation", "paused (max rank rescale)", "steps in own rescale", "longest step gap", "group rebuild",
                "transfer", "transfer CPU (all ranks)", "bytes moved", "minimum", "moved / min", "naive (all slots)",
                "bytes / bandwidth", "limit: 2*b/bw + group", "pause - limit",
                f"verdict (+{args.bookkeeping_ms:g} ms)"):
        table.add_column(col, justify="right")
    for r in results:
        table.add_row(f"{r['from']} -> {r['to']}", fmt_s(r["paused_seconds"]), str(r["steps_during_own_rescale"]),
                      fmt_s(r["max_step_gap_seconds"]), fmt_s(r["group_seconds"]), fmt_s(r["transfer_seconds"]),
                      fmt_s(r["transfer_cpu_seconds_all_ranks"]), fmt_bytes(r["bytes_moved"]),
                      fmt_bytes(r.get("min_bytes")),
                      f"{r['bytes_moved'] / r['min_bytes']:.2f}" if r.get("min_bytes") else "-",
                      fmt_bytes(r.get("naive_bytes")), fmt_s(r["transfer_bound_seconds"]),
                      fmt_s(r["pause_limit_seconds"]),
                      ("+" if r["pause_over_limit_seconds"] > 0 else "-") + fmt_s(abs(r["pause_over_limit_seconds"])),
                      verdict(r["pause_pass"]))
    console.print(table)

    table = Table(title="Per rank (Rescale reports)")
    for col in ("operation", "rank", "gen", "retired", "rescale", "group rebuild", "transfer", "transfer CPU",
                "received"):
        table.add_column(col, justify="right")
    for r in results:
        for x in r["per_rank"]:
            table.add_row(f"{r['from']} -> {r['to']}", str(x["rank"]), str(x["generation"]), "yes" if x["retired"] else "",
                          fmt_s(x["seconds"]), fmt_s(x["group_seconds"]), fmt_s(x["transfer_seconds"]),
                          fmt_s(x["transfer_cpu_seconds"]), fmt_bytes(x["bytes_received"]))
    console.print(table)

    mismatched = sum(len(v.get("mismatched", [])) for v in verdicts.values())
    all_pass = all(r["pause_pass"] for r in results)
    only_rescaling = all(r["rescaling_only_pauses"] for r in results)
    console.print(f"pause target: {verdict(all_pass)}; decoding went on in draining and suppressed: "
                  f"{verdict(only_rescaling)}; weights after the last operation: "
                  + ("[green]bit-exact[/green]" if mismatched == 0 else f"[red]{mismatched} bad slots[/red]")
                  + f"; 1-min load average before start {load_before:.1f} ({os.cpu_count()} CPUs)")
    notes = []
    if load_before > 0.5 * cpus:
        notes.append(f"the machine was busy before the run (1-min load average {load_before:.1f} on {cpus} CPUs): "
                     "other processes competed with the workers, so the timings are noisier and slower than on an idle machine")
    for r in results:
        if not r["pause_pass"]:
            cpu = r["transfer_cpu_seconds_all_ranks"]
            share = cpu / (r["transfer_seconds"] * cpus) if r["transfer_seconds"] else math.nan
            notes.append(
                f"{r['from']} -> {r['to']}: pause {fmt_s(r['paused_seconds'])} > limit {fmt_s(r['pause_limit_seconds'])}. "
                f"The redistribution took {fmt_s(r['transfer_seconds'])} for {fmt_bytes(r['bytes_moved'])} over the "
                f"network; the rest is work the target's formula has no term for (ranks that join allocate and fault "
                f"in their weights, survivors plan every layer and rewrite moved slots in place, the communicator "
                f"registers memory). The ranks used {fmt_s(cpu)} of CPU "
                f"(at least {fmt_s(cpu / cpus)} on {cpus} CPUs) and got {share:.0%} of the machine while they ran"
                + (f" (the rest went to other processes: load average {load_before:.1f})." if share < 0.6 else "."))
    for note in notes:
        console.print(f"[yellow]note[/yellow]: {note}")
    write_json(args.json_path, {"bench": "scale", "notes": notes, "args": vars(args), "machine": machine_info(),
                                "loadavg_1min_before": load_before, "expert_bytes": expert_bytes,
                                "bandwidth": bw, "median_step_seconds": step_seconds, "operations": results,
                                "verify_mismatched": mismatched, "pause_target_pass": all_pass,
                                "pause_target_pass_strict": all(r["pause_pass_strict"] for r in results),
                                "decoding_outside_rescaling_pass": only_rescaling})
    if args.json_path:
        console.print(f"wrote {args.json_path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
