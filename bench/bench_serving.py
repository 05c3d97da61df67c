"""Completion requests through scale operations and rank kills (issue 15): nothing lost, nothing changed.

    python -m bench.bench_serving [--arch qwen3_moe] [--scales 10] [--kills 2] [--rate 6]
                                  [--concurrency 6] [--out out/bench-serving] [--json FILE]

A real architecture (a tiny random model, no download) is served on 2 ranks by the coordinator
and its HTTP app, in this process. ``elastic-ep loadgen``'s client (:mod:`elastic.service.loadgen`)
streams greedy requests at ``--rate`` (Poisson, at most ``--concurrency`` in flight) while this
script scales the group ``--scales`` times (2 -> 3 -> 4 -> 3 -> 2 -> ...) and SIGKILLs a rank
``--kills`` times (the deployment auto-recovers). When the schedule is done the load stops.

Reported, against the issue's targets:

- requests ok / failed / retried (a 429 or 503 retried by the client counts as retried);
- TTFT and inter-token latency p50/p99, steady and during a scale, a rebalance, a recovery
  (from the server's ``GET /timeline``); the target is ITL p99 during a scale <= the largest
  scale pause + 2 x the steady ITL p99;
- every request's tokens against the unsharded model's greedy output for its prompt (bitwise
  decoding, so they must be identical).

The load generator's JSON and PNG (latency over time, phases shaded) go to ``--out``.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import signal
import sys
import threading
import time
from pathlib import Path
from typing import Any

from bench.common import machine_info, write_json


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--arch", default="qwen3_moe")
    ap.add_argument("--scales", type=int, default=10)
    ap.add_argument("--kills", type=int, default=2)
    ap.add_argument("--rate", type=float, default=6.0, help="requests per second (Poisson)")
    ap.add_argument("--concurrency", type=int, default=6)
    ap.add_argument("--max-tokens", default="24:48")
    ap.add_argument("--settle", type=float, default=2.0, help="seconds of steady load between operations")
    ap.add_argument("--out", type=Path, default=Path("out/bench-serving"))
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)

    import torch

    from elastic.control.coordinator import Coordinator
    from elastic.deployment import DeploymentConfig
    from elastic.service.api import create_app
    from elastic.service.loadgen import LoadConfig, check_tokens, format_summary, run_load, write_report
    from elastic.service.server import BackgroundServer

    torch.set_num_threads(1)
    model = {"kind": "hf", "architecture": args.arch, "seed": 0}
    config = DeploymentConfig.model_validate({
        "model": model, "ep_size": 2, "max_ep_size": 4, "auto_recover": True, "max_auto_recoveries": args.kills + 2,
        "replace_lost": False, "heartbeat_s": 0.05,
        "eplb": {"num_redundant_experts": 4, "use_async": True, "window_size": 16, "step_interval": 16},
        "timeouts": {"collective": 6, "heartbeat": 8, "worker_start": 120},
        "serving": {"background_load": False, "max_batch": 8, "max_queue": 32},
    })
    lo, _, hi = args.max_tokens.partition(":")
    ops: list[dict[str, Any]] = []
    with Coordinator(config) as c, BackgroundServer(create_app(c)) as server:
        c.wait_for_step(3, timeout=120)
        load = LoadConfig(url=server.url, rate=args.rate, concurrency=args.concurrency, duration_s=24 * 3600.0,
                          prompt_len=(4, 12), max_tokens=(int(lo), int(hi or lo)), seed=0)
        stop = threading.Event()  # the load runs until the schedule is done
        result: dict[str, Any] = {}
        thread = threading.Thread(target=lambda: result.update(out=asyncio.run(run_load(load, stop))), daemon=True)
        started = time.time()
        thread.start()
        time.sleep(args.settle)
        _run_schedule(c, args, ops)
        stop.set()
        thread.join(300)
        records, timeline, t_start, t_end = result["out"]
        final = {"state": c.machine.state.value, "ep_size": c.size, "engine": c.requests.stats() if c.requests else None}
    check = check_tokens(records, config.model)
    summary = write_report(records, timeline, t_start, t_end, args.out, {"check": check})
    print(format_summary(summary))
    targets = _targets(summary, ops, check)
    print(f"targets: {targets}")
    write_json(args.json, {"machine": machine_info(), "args": vars(args) | {"out": str(args.out)}, "operations": ops,
                           "summary": summary, "targets": targets, "final": final, "elapsed_s": time.time() - started})
    return 0 if all(v for k, v in targets.items() if isinstance(v, bool)) else 1


def _run_schedule(c: Any, args: argparse.Namespace, ops: list[dict[str, Any]]) -> None:
    """``--scales`` scales through the size cycle, with ``--kills`` rank kills spread among them."""
    sizes = [3, 4, 3, 2]
    kills_at = {round((i + 1) * args.scales / (args.kills + 1)) for i in range(args.kills)}
    cycle = 0
    for i in range(args.scales):
        while sizes[cycle % len(sizes)] == c.size:  # after a kill the size may already be the next one
            cycle += 1
        target = sizes[cycle % len(sizes)]
        cycle += 1
        op = c.scale(target, timeout=180)
        ops.append({"kind": "scale", "to": target, "status": op.status.value, "paused_s": op.paused_seconds,
                    "error": op.error})
        print(f"scale to {target}: {op.status.value}, pause {1e3 * (op.paused_seconds or 0):.0f} ms", file=sys.stderr)
        time.sleep(args.settle)
        if i + 1 in kills_at:
            ops.append(_kill_highest_rank(c))
            time.sleep(args.settle)


def _kill_highest_rank(c: Any) -> dict[str, Any]:
    """SIGKILL the highest rank and wait (at most 120 s) for the automatic recovery to bring the group back."""
    victim = max(c.live_workers(), key=lambda w: w.rank)
    recoveries = c.auto_recoveries
    os.kill(victim.handle.pid, signal.SIGKILL)
    t0 = time.monotonic()
    while not (c.auto_recoveries > recoveries and c.machine.state.value == "running") and time.monotonic() - t0 < 120:
        time.sleep(0.05)
    print(f"killed rank {victim.rank}: {c.machine.state.value} at {c.size} ranks after "
          f"{time.monotonic() - t0:.1f}s", file=sys.stderr)
    return {"kind": "kill", "rank": victim.rank, "recovered_s": time.monotonic() - t0,
            "state": c.machine.state.value, "size": c.size}


def _targets(summary: dict[str, Any], ops: list[dict[str, Any]], check: dict[str, Any]) -> dict[str, Any]:
    """No failed request, identical tokens, and the inter-token p99 during scales within the pause plus 2x steady p99."""
    pauses = [o["paused_s"] for o in ops if o["kind"] == "scale" and o["paused_s"] is not None]
    steady = summary["itl"].get("steady", {}).get("p99_ms", 0.0)
    in_scale = summary["itl"].get("scale", {}).get("p99_ms", 0.0)
    limit = 1e3 * max(pauses, default=0.0) + 2 * steady
    return {
        "no_failed_requests": summary["failed"] == 0,
        "itl_p99_during_scale_ms": in_scale, "itl_p99_limit_ms": limit, "itl_within_limit": in_scale <= limit,
        "identical_tokens": not check["mismatched"] and check["checked"] == summary["ok"],
    }


if __name__ == "__main__":
    raise SystemExit(main())
