"""Scale up and down (2 -> 4 -> 2 ranks by default) on real worker processes (issues 4, 16).

    python -m bench.bench_scale [--json bench-scale.json]                 # 128, 512 and 2048 MiB per rank
    python -m bench.bench_scale --mib-per-rank 512 --no-prepare            # everything in the pause (before issue 16)

Each size in ``--mib-per-rank`` is one deployment whose expert weights per rank are about that
many MiB (the intermediate size is chosen for it), running the ``--sizes`` sequence.

The pause (issue 16). A scale prepares in ``draining``: the standby group is formed and the
experts move ahead of the pause (``Operation.prepare``), so the pause is the switch. Target per
operation: pause <= 50 ms + (bytes still moved inside the pause / loopback bandwidth) + (bytes
the busiest rank copies locally in the pause / memcpy bandwidth of one thread, as the workers
run), both bandwidths measured here; and decode
throughput while the pre-transfer runs >= 90% of the steady throughput just before the
operation (decode steps per second of the old ranks in each window). The pause is fitted
against the bytes the operation moved (ahead of the pause or in it), per direction: the slope
says how much the pause grows with the bytes (flat: about 0 ms per GiB). The limit of issue 4
(below) stays in the table for comparison.

Per operation: the time in each phase (``Operation.phases``), how many decode steps the
workers completed in each phase (only ``rescaling`` should pause decoding), the pause seen
by the workers (``Operation.paused_seconds``: the longest per-rank rescale; and the longest
gap between two decode steps on any rank), the group rebuild time (destroy + rendezvous of the
new generation, ``group_seconds`` in the workers' Rescale report), and the bytes moved
(``Operation.bytes_moved``) against the minimum: for each new rank, the distinct experts it
holds that it did not hold before (a fresh rank holds nothing), times the expert's bytes.

A separate gloo send/recv between two fresh processes measures the loopback bandwidth.
Limit of issue 4: pause <= 2 * (bytes moved / bandwidth) + group rebuild time (+ ``--bookkeeping-ms``,
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

import torch
from pydantic import ByteSize
from rich.console import Console
from rich.table import Table

from bench.common import BENCH_TIMEOUTS, MiB, RecordingCoordinator, fmt_bytes, fmt_s, loopback_bandwidth, machine_info, verdict, write_json
from elastic.control.coordinator import Operation
from elastic.core.config import ScalingConfig
from elastic.core.mapping import RankMapping
from elastic.core.phases import OPERATION_PHASES
from elastic.deployment import DeploymentConfig, TracePhase
from eplb.config import EPLBConfig
from eplb.model import ModelShape
from eplb.trace import TraceConfig

PHASES = tuple(str(phase) for phase in OPERATION_PHASES)


def deployment(args: argparse.Namespace, intermediate: int | None = None) -> DeploymentConfig:
    shape: Any = ModelShape(num_layers=args.layers, num_experts=args.experts, hidden_size=args.hidden,
                            intermediate_size=intermediate or args.intermediate)
    if args.architecture:  # a real MoE (a tiny random one of that architecture): its own layers and experts
        shape = {"kind": "hf", "architecture": args.architecture, "seed": args.seed}
    eplb = EPLBConfig(use_async=True, num_redundant_experts=args.redundant, window_size=args.window,
                      step_interval=args.interval, communicator=args.communicator)
    trace = [TracePhase(trace=TraceConfig(kind="drift", drift_period=args.interval, tokens_per_step=args.tokens))]
    scaling = ScalingConfig(prepare=not args.no_prepare, prestage_share=args.prestage_share,
                            prestage_max_bytes=ByteSize(int(args.prestage_max_mib * MiB)) if args.prestage_max_mib is not None
                            else ByteSize(4 * 1024 * MiB))
    # the pre-transfer of the largest size takes a while at its share of the wall time
    timeouts = BENCH_TIMEOUTS.model_copy(update={"draining": 600.0, "rescaling": 600.0})
    return DeploymentConfig(model=shape, eplb=eplb, trace=trace, ep_size=args.start, max_ep_size=max(args.sizes),
                            seed=args.seed, timeouts=timeouts, scaling=scaling,
                            serving={"background_load": True})  # a real model decodes synthetic batches


def intermediate_for(args: argparse.Namespace, mib_per_rank: float) -> int:
    """The intermediate size that gives about ``mib_per_rank`` MiB of expert weights per rank."""
    probe = deployment(args, intermediate=64)
    per_rank_at_64 = probe.sizes.expert_bytes * probe.slots_per_rank * probe.sizes.num_moe_layers
    return max(1, round(64 * mib_per_rank * MiB / per_rank_at_64))


def memcpy_bandwidth(nbytes: int = 256 * MiB, repeats: int = 5, threads: int = 1) -> float:
    """Bytes/s of one local tensor copy (what the pause's slot copies cost), median of ``repeats``,
    with ``threads`` torch threads: 1 by default, as the workers run (``torch.set_num_threads(1)``)."""
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        src = torch.ones(nbytes // 4, dtype=torch.float32)
        dst = torch.empty_like(src)
        dst.copy_(src)  # fault the pages in
        times = []
        for _ in range(repeats):
            mark = time.perf_counter()
            dst.copy_(src)
            times.append(time.perf_counter() - mark)
    finally:
        torch.set_num_threads(before)
    return nbytes / statistics.median(times)


def fit_slope(points: list[tuple[float, float]]) -> tuple[float, float] | None:
    """Least squares ``y = a + b x``: ``(a, b)``, or None with fewer than two distinct x."""
    if len({x for x, _ in points}) < 2:
        return None
    mx = statistics.fmean(x for x, _ in points)
    my = statistics.fmean(y for _, y in points)
    b = sum((x - mx) * (y - my) for x, y in points) / sum((x - mx) ** 2 for x, _ in points)
    return my - b * mx, b


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
            step_seconds: float, wall_to_monotonic: float, steady_steps: int) -> dict[str, Any]:
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
    steps_in = {name: _steps_between(samples, ph.get("started"), ph.get("ended")) for name, ph in phases.items()}
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
    # decode throughput of the old ranks while the pre-transfer ran, against the steady steps
    # just before the operation (the same ranks, the same run)
    prepare = dict(op.prepare)
    ratios = _prepare_throughput(prepare, by_pid, lo, steady_steps) if prepare else []
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
        "bytes_moved": op.bytes_moved,  # inside the pause
        "bytes_prestaged": prepare.get("bytes_received", 0),  # ahead of the pause
        "copy_bytes": max((r.detail.get("copy_bytes", 0) for r in reports), default=0),  # the busiest rank's
        "prepare": prepare,
        "prepare_throughput": ratios,
        "prepare_throughput_ratio": min((x["ratio"] for x in ratios), default=math.nan),
        **minimum,
    }


def _steps_between(samples: list[dict[str, Any]], lo: float | None, hi: float | None) -> dict[str, int]:
    """Decode steps the workers completed in ``[lo, hi)``: the most of one rank, and how many ranks stepped."""
    per_pid: dict[int, int] = {}
    for s in samples:
        if lo is not None and hi is not None and lo <= s["t"] < hi:
            per_pid[s["pid"]] = per_pid.get(s["pid"], 0) + 1
    return {"max_per_rank": max(per_pid.values(), default=0), "ranks_stepping": len(per_pid)}


def _prepare_throughput(prepare: dict[str, Any], by_pid: dict[int, list[dict[str, Any]]], started: float,
                        steady_steps: int) -> list[dict[str, Any]]:
    """Each rank's decode rate while the pre-transfer ran, against its steady steps just before ``started``."""
    ratios = []
    lo_p, hi_p = prepare["started_at"], prepare["ended_at"]
    for pid, ss in by_pid.items():
        before = [x["t"] for x in ss if x["t"] < started][-steady_steps:]
        during = [x["t"] for x in ss if lo_p <= x["t"] <= hi_p]
        if len(before) >= 5 and hi_p - lo_p > 0 and len(during) >= 2:
            steady = (len(before) - 1) / (before[-1] - before[0])
            ratios.append({"pid": pid, "steady_steps_per_s": steady, "prepare_steps_per_s": len(during) / (hi_p - lo_p),
                           "ratio": len(during) / (hi_p - lo_p) / steady})
    return ratios


def run_size(args: argparse.Namespace, mib: float | None, console: Console) -> dict[str, Any]:
    """One deployment (about ``mib`` MiB of experts per rank) through the ``--sizes`` sequence."""
    cfg = deployment(args, intermediate_for(args, mib) if mib is not None and not args.architecture else None)
    expert_bytes = cfg.sizes.expert_bytes
    per_rank = expert_bytes * cfg.slots_per_rank * cfg.sizes.num_moe_layers
    what = f"{args.architecture} (Hugging Face, tiny random)" if args.architecture else "the reference model"
    console.print(f"[bold]bench_scale[/bold] on {what}: sizes {' -> '.join(map(str, args.sizes))} x{args.cycles}, "
                  f"{cfg.sizes.num_moe_layers} layers, {cfg.sizes.num_logical_experts} experts + {args.redundant} "
                  f"redundant ({cfg.slots_per_rank} slots per rank), expert {fmt_bytes(expert_bytes)}, "
                  f"{fmt_bytes(per_rank)} of experts per rank, prepare {'on' if cfg.scaling.prepare else 'off'}")
    load_before = os.getloadavg()[0]
    coordinator = RecordingCoordinator(cfg)
    ops: list[Operation] = []
    try:
        coordinator.start()
        # start the first operation while a rebalance is (likely) in flight, so draining has work
        coordinator.wait_for_step(args.interval + 3, timeout=300)
        coordinator.wait_for_step(coordinator.snapshot()["step"] + args.steps_between, timeout=300)
        for _ in range(args.cycles):
            for size in args.sizes[1:] + ([args.sizes[0]] if args.sizes[-1] != args.sizes[0] and args.cycles > 1 else []):
                op = coordinator.scale(size, timeout=900)
                ops.append(op)
                console.print(f"  scale {op.from_size} -> {op.target_size}: {op.status.value}"
                              + (f" ({op.error})" if op.error else "") + f" in {time.time() - op.created_at:.2f}s")
                if op.status.value != "succeeded":
                    raise SystemExit(f"scale {op.from_size} -> {op.target_size} failed: {op.error}")
                coordinator.wait_for_step(coordinator.snapshot()["step"] + args.steps_between, timeout=300)
        verdicts = coordinator.verify(timeout=300)
        samples = coordinator.step_samples()
    finally:
        coordinator.shutdown()
    by_pid: dict[int, list[float]] = {}
    for sample in sorted(samples, key=lambda x: x["t"]):
        by_pid.setdefault(sample["pid"], []).append(sample["t"])
    step_seconds = statistics.median([b - a for ts in by_pid.values() for a, b in zip(ts, ts[1:])] or [math.nan])
    wall_to_monotonic = time.time() - time.monotonic()
    results = [analyse(op, coordinator, samples, expert_bytes, step_seconds, wall_to_monotonic,
                       max(5, args.steps_between - 5)) for op in ops]
    for r in results:
        r["mib_per_rank"] = per_rank / MiB
    return {"mib_per_rank": per_rank / MiB, "expert_bytes": expert_bytes, "loadavg_1min_before": load_before,
            "median_step_seconds": step_seconds, "operations": results,
            "verify_mismatched": sum(len(v.get("mismatched", [])) for v in verdicts.values())}


def _parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="python -m bench.bench_scale", description=__doc__.split("\n\n")[0])
    ap.add_argument("--sizes", default="2,4,2", help="EP sizes in order: the first is the start")
    ap.add_argument("--cycles", type=int, default=1, help="how many times to run the whole sequence")
    ap.add_argument("--mib-per-rank", default="128,512,2048",
                    help="expert weights per rank, MiB (one deployment each; 'none': --intermediate as given)")
    ap.add_argument("--layers", type=int, default=16)
    ap.add_argument("--experts", type=int, default=32)
    ap.add_argument("--redundant", type=int, default=8)
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--intermediate", type=int, default=512)
    ap.add_argument("--tokens", type=int, default=16, help="tokens each rank routes per step")
    ap.add_argument("--interval", type=int, default=20, help="EPLB step_interval (async)")
    ap.add_argument("--window", type=int, default=10)
    ap.add_argument("--steps-between", type=int, default=40, help="decode steps between two operations")
    ap.add_argument("--bw-mib", type=int, default=128, help="tensor size of the bandwidth measurement")
    ap.add_argument("--communicator", default="auto", choices=["auto", "gloo", "nccl", "nixl"],
                    help="transfer communicator (auto: NIXL when installed, else gloo on CPU)")
    ap.add_argument("--no-prepare", action="store_true", help="scaling.prepare: false (everything in the pause)")
    ap.add_argument("--prestage-share", type=float, default=0.1, help="scaling.prestage_share")
    ap.add_argument("--prestage-max-mib", type=float, default=None,
                    help="scaling.prestage_max_bytes in MiB (default 4096: a scale down of these sizes fits)")
    ap.add_argument("--bookkeeping-ms", type=float, default=1.0,
                    help="allowance over the issue-4 limit for a rescale's fixed bookkeeping (that formula has no "
                         "term for it)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--architecture", default=None, help="a Hugging Face MoE architecture (deepseek_v3, gpt_oss, ...) "
                    "instead of the reference model; --layers/--experts/--hidden/--intermediate then do not apply")
    ap.add_argument("--json", dest="json_path", default=None, help="write the results as JSON here")
    return ap


def main(argv: list[str] | None = None) -> int:
    ap = _parser()
    args = ap.parse_args(argv)
    args.sizes = [int(x) for x in args.sizes.split(",")]
    if len(args.sizes) < 2:
        ap.error("--sizes needs at least two sizes")
    args.start = args.sizes[0]
    sizes_mib: list[float | None] = [None] if args.mib_per_rank == "none" or args.architecture else \
        [float(x) for x in args.mib_per_rank.split(",")]
    logging.basicConfig(level=logging.WARNING)
    console = Console() if sys.stdout.isatty() else Console(width=200)

    runs = [run_size(args, mib, console) for mib in sizes_mib]
    console.print("  measuring loopback and memcpy bandwidth ...")
    bw = loopback_bandwidth(args.bw_mib * MiB)
    bandwidth = bw["bytes_per_second"]
    memcpy = memcpy_bandwidth()  # one thread, as a worker copies
    memcpy_all_threads = memcpy_bandwidth(threads=torch.get_num_threads())
    cpus = os.cpu_count() or 1
    results = [r for run in runs for r in run["operations"]]
    _judge(results, args, bandwidth, memcpy, cpus)
    _print_tables(console, results, bandwidth, memcpy, memcpy_all_threads)
    slopes = _slopes(console, results)
    mismatched = sum(run["verify_mismatched"] for run in runs)
    all_pass = all(r["pause_target_pass"] for r in results)
    throughput_pass = all(r["prepare_throughput_pass"] for r in results)
    only_rescaling = all(r["rescaling_only_pauses"] for r in results)
    load = max(run["loadavg_1min_before"] for run in runs)
    console.print(f"pause target: {verdict(all_pass)}; decode throughput in prepare >= 0.9 of steady: "
                  f"{verdict(throughput_pass)}; decoding went on in draining and suppressed: {verdict(only_rescaling)}; "
                  "weights after the last operation: "
                  + ("[green]bit-exact[/green]" if mismatched == 0 else f"[red]{mismatched} bad slots[/red]")
                  + f"; 1-min load average before each run at most {load:.1f} ({cpus} CPUs)")
    notes = []
    if load > 0.5 * cpus:
        notes.append(f"the machine was busy before a run (1-min load average {load:.1f} on {cpus} CPUs): other "
                     "processes competed with the workers, so the timings are noisier and slower than on an idle machine")
    for note in notes:
        console.print(f"[yellow]note[/yellow]: {note}")
    write_json(args.json_path, {"bench": "scale", "notes": notes, "args": vars(args), "machine": machine_info(),
                                "bandwidth": bw, "memcpy_bytes_per_second": memcpy,
                                "memcpy_bytes_per_second_all_threads": memcpy_all_threads, "runs": runs,
                                "operations": results, "slopes": slopes,
                                "verify_mismatched": mismatched, "pause_target_pass": all_pass,
                                "prepare_throughput_pass": throughput_pass,
                                "issue4_limit_pass": all(r["pause_pass"] for r in results),
                                "decoding_outside_rescaling_pass": only_rescaling})
    if args.json_path:
        console.print(f"wrote {args.json_path}")
    return 0



def _judge(results: list[dict[str, Any]], args: argparse.Namespace, bandwidth: float, memcpy: float, cpus: int) -> None:
    """Each operation's targets and verdicts, added to its record."""
    for r in results:
        # issue 16: the switch, what still moves in it, and its local copies
        r["pause_target_seconds"] = 0.050 + r["bytes_moved"] / bandwidth + r["copy_bytes"] / memcpy
        r["pause_target_pass"] = r["paused_seconds"] <= r["pause_target_seconds"]
        r["prepare_throughput_pass"] = (not r["prepare"]) or r["prepare_throughput_ratio"] >= 0.9
        # issue 4's limit, kept for comparison: every byte the operation moved, ahead of the pause or in it
        moved = r["bytes_moved"] + r["bytes_prestaged"]
        rebuild = r["prepare"].get("group_seconds", r["group_seconds"]) if r["prepare"] else r["group_seconds"]
        r["transfer_bound_seconds"] = moved / bandwidth
        r["pause_limit_seconds"] = 2 * r["transfer_bound_seconds"] + rebuild
        r["pause_over_limit_seconds"] = r["paused_seconds"] - r["pause_limit_seconds"]
        r["pause_pass"] = r["pause_over_limit_seconds"] <= args.bookkeeping_ms / 1e3
        r["cpu_floor_seconds"] = r["transfer_cpu_seconds_all_ranks"] / cpus
        r["rescaling_only_pauses"] = (r["steps_during_own_rescale"] == 0 and
                                      all(r["steps_in_phase"][name]["max_per_rank"] > 0 for name in ("draining", "suppressed")))


def _print_tables(console: Console, results: list[dict[str, Any]], bandwidth: float, memcpy: float,
                  memcpy_all_threads: float) -> None:
    table = Table(title="Phases (coordinator) and decode steps completed in each (max over ranks)")
    table.add_column("MiB/rank", justify="right")
    table.add_column("operation")
    for name in PHASES:
        table.add_column(name, justify="right")
    for r in results:
        cells = [f"{fmt_s(r['phases'][n])} / {r['steps_in_phase'][n]['max_per_rank']} steps" for n in PHASES]
        table.add_row(f"{r['mib_per_rank']:.0f}", f"{r['from']} -> {r['to']}", *cells)
    console.print(table)

    table = Table(title=f"The pause (loopback gloo {bandwidth / MiB:.0f} MiB/s one tensor; memcpy {memcpy / MiB:.0f} MiB/s on one "
                        f"thread, as a worker copies; {memcpy_all_threads / MiB:.0f} MiB/s on {torch.get_num_threads()})")
    for col in ("MiB/rank", "operation", "pause", "moved ahead", "moved in pause", "copied in pause",
                "target: 50 ms + b/bw + c/memcpy", "verdict", "prepare", "decode in prepare / steady", "verdict",
                "longest step gap", "issue-4 limit: 2*all/bw + group", "verdict"):
        table.add_column(col, justify="right")
    for r in results:
        table.add_row(f"{r['mib_per_rank']:.0f}", f"{r['from']} -> {r['to']}", fmt_s(r["paused_seconds"]),
                      fmt_bytes(r["bytes_prestaged"]), fmt_bytes(r["bytes_moved"]), fmt_bytes(r["copy_bytes"]),
                      fmt_s(r["pause_target_seconds"]), verdict(r["pause_target_pass"]),
                      fmt_s(r["prepare"].get("seconds")) if r["prepare"] else "-",
                      f"{r['prepare_throughput_ratio']:.2f}" if r["prepare"] and not math.isnan(r["prepare_throughput_ratio"])
                      else "-", verdict(r["prepare_throughput_pass"]),
                      fmt_s(r["max_step_gap_seconds"]), fmt_s(r["pause_limit_seconds"]), verdict(r["pause_pass"]))
    console.print(table)

    table = Table(title="Per rank (Rescale reports)")
    for col in ("MiB/rank", "operation", "rank", "gen", "retired", "rescale", "group", "transfer", "transfer CPU",
                "received in pause"):
        table.add_column(col, justify="right")
    for r in results:
        for x in r["per_rank"]:
            table.add_row(f"{r['mib_per_rank']:.0f}", f"{r['from']} -> {r['to']}", str(x["rank"]), str(x["generation"]),
                          "yes" if x["retired"] else "", fmt_s(x["seconds"]), fmt_s(x["group_seconds"]),
                          fmt_s(x["transfer_seconds"]), fmt_s(x["transfer_cpu_seconds"]), fmt_bytes(x["bytes_received"]))
    console.print(table)


def _slopes(console: Console, results: list[dict[str, Any]]) -> dict[str, Any]:
    """The pause against the bytes moved, a line fitted per direction."""
    slopes = {}
    for direction, pick in (("up", lambda r: r["to"] > r["from"]), ("down", lambda r: r["to"] < r["from"])):
        points = [((r["bytes_moved"] + r["bytes_prestaged"]) / (1024 * MiB), r["paused_seconds"] * 1e3)
                  for r in results if pick(r)]
        fit = fit_slope(points)
        slopes[direction] = None if fit is None else {"intercept_ms": fit[0], "ms_per_gib": fit[1], "points": points}
        if fit is not None:
            console.print(f"pause against bytes moved, scale {direction}: {fit[0]:.1f} ms + {fit[1]:.2f} ms per GiB "
                          f"({len(points)} operations, {min(x for x, _ in points):.2f}-{max(x for x, _ in points):.2f} GiB)")
    return slopes

if __name__ == "__main__":
    raise SystemExit(main())
