"""Soak: many scale cycles on one coordinator; what it holds must stay flat.

    python -m bench.bench_soak [--cycles 50] [--back-to-back] [--communicator auto] [--json out/soak.json]

A small local deployment (2 ranks, the communicator ``auto`` picks: NIXL when installed) scales
2 -> 3 -> 2 ``--cycles`` times while it decodes (the trace's tokens every step: the traffic;
each cycle checks that steps went on). After each cycle (and a moment for retired workers to be
forgotten) it samples, in the coordinator's process: open file descriptors, threads, resident
memory, the ``TCPStore``'s keys, the worker records, the launcher's handles, the operations
kept, and this process's child processes (workers, the forkserver); and in each of the two
long-lived workers (ranks 0 and 1, which survive every cycle): their open file descriptors,
threads and resident memory (``worker_fds`` etc.: the most of the two). A leak per group
generation shows there (NIXL's UCX sockets did: 2-3 per cycle), not in the coordinator.
``--communicator gloo`` or ``nixl`` picks one. It prints the first sample after warm-up, the
last one, and the least-squares slope per cycle over the cycles after warm-up; ``flat`` means the slope
is below one unit per 10 cycles (RSS: below 256 KiB per cycle). ``--back-to-back`` leaves no
pause between cycles, as an autoscaler's scales may come: the coordinator then has to forget
retired workers while operations run (before that was fixed, its fds rose 4 and its threads 1 per
cycle this way, and the paused soak showed nothing).
"""

from __future__ import annotations

import argparse
import os
import sys
import threading
import time
from typing import Any

from rich.console import Console
from rich.table import Table

from bench.common import BENCH_TIMEOUTS, parent_of, write_json
from elastic.control.coordinator import Coordinator, OperationStatus
from elastic.deployment import DeploymentConfig
from eplb.communicator import resolve_communicator

WARMUP = 3
#: a slope (units per cycle) below this is flat
FLAT = {"rss_bytes": 256 * 1024, "worker_rss_bytes": 256 * 1024}


def _children() -> int:
    me = os.getpid()
    return sum(ppid == me for ppid in parent_of().values())


def _rss() -> int:
    with open("/proc/self/statm") as statm:
        return int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def _process(pid: int) -> dict[str, int]:
    """Open fds, threads and RSS of process ``pid`` (zeros if it is gone)."""
    try:
        fds = len(os.listdir(f"/proc/{pid}/fd"))
        with open(f"/proc/{pid}/status") as status:
            threads = next(int(line.split()[1]) for line in status if line.startswith("Threads:"))
        with open(f"/proc/{pid}/statm") as statm:
            rss = int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, StopIteration):
        return {"fds": 0, "threads": 0, "rss_bytes": 0}
    return {"fds": fds, "threads": threads, "rss_bytes": rss}


def sample(c: Coordinator, workers: list[int]) -> dict[str, int]:
    assert c._store is not None
    seen = [_process(pid) for pid in workers]
    return {"fds": len(os.listdir("/proc/self/fd")), "threads": threading.active_count(), "rss_bytes": _rss(),
            **{f"worker_{key}": max(s[key] for s in seen) for key in ("fds", "threads", "rss_bytes")},
            "store_keys": c._store.num_keys(), "worker_records": len(c.workers),
            "launcher_handles": len(getattr(c.launcher, "_workers", [])), "operations": len(c.operations),
            "child_processes": _children()}


def slope(values: list[float]) -> float:
    n = len(values)
    if n < 2:
        return 0.0
    mean_x, mean_y = (n - 1) / 2, sum(values) / n
    return sum((i - mean_x) * (v - mean_y) for i, v in enumerate(values)) / sum((i - mean_x) ** 2 for i in range(n))


def run(cycles: int, pause_s: float = 2.5, communicator: str = "auto") -> dict[str, Any]:
    config = DeploymentConfig.model_validate({
        "ep_size": 2, "max_ep_size": 3, "operation_history": 10, "heartbeat_s": 0.05,
        "model": {"num_layers": 2, "num_experts": 8, "hidden_size": 32, "intermediate_size": 64},
        "eplb": {"num_redundant_experts": 4, "use_async": True, "window_size": 8, "step_interval": 8,
                 "communicator": communicator},
        "timeouts": BENCH_TIMEOUTS.model_dump()})
    samples: list[dict[str, int]] = []
    started = time.monotonic()
    communicator = resolve_communicator(config.eplb.communicator, config.backend)  # what auto picks here
    with Coordinator(config) as c:
        c.wait_for_step(3)
        workers = [w.handle.pid for w in c.live_workers()]  # ranks 0 and 1 survive every cycle
        for i in range(cycles):
            step = c.snapshot()["step"]
            for size in (3, 2):
                op = c.scale(size, timeout=120)
                if op.status != OperationStatus.SUCCEEDED:
                    raise SystemExit(f"cycle {i}: scale to {size} {op.status}: {op.error}")
            c.wait_for_step(step + 3, timeout=60)  # decoding went on through the cycle
            time.sleep(pause_s)  # retired workers are forgotten a moment after they exit
            samples.append(sample(c, workers))
            print(f"cycle {i + 1}/{cycles}: {samples[-1]}", file=sys.stderr)
    steady = samples[WARMUP:] or samples
    rows = {}
    for key in samples[0]:
        values = [s[key] for s in steady]
        k = slope(values)
        rows[key] = {"first": values[0], "last": values[-1], "slope_per_cycle": k,
                     "flat": abs(k) < FLAT.get(key, 0.1)}
    return {"cycles": cycles, "seconds": time.monotonic() - started, "communicator": communicator,
            "metrics": rows, "samples": samples}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cycles", type=int, default=50)
    parser.add_argument("--back-to-back", action="store_true", help="no pause between cycles")
    parser.add_argument("--communicator", default="auto", help="auto (NIXL when installed), gloo or nixl")
    parser.add_argument("--json", default=None)
    args = parser.parse_args(argv)
    result = run(args.cycles, pause_s=0.0 if args.back_to_back else 2.5, communicator=args.communicator)
    how = "back to back" if args.back_to_back else "2.5 s apart"
    table = Table(title=f"soak: {args.cycles} scale cycles 2 -> 3 -> 2 on {result['communicator']}, {how}, in "
                        f"{result['seconds']:.0f} s (after {WARMUP} warm-up cycles)")
    for col in ("what", "first", "last", "slope / cycle", "flat"):
        table.add_column(col, justify="left" if col == "what" else "right")
    for key, row in result["metrics"].items():
        table.add_row(key, str(row["first"]), str(row["last"]), f"{row['slope_per_cycle']:+.3g}",
                      "yes" if row["flat"] else "NO")
    Console().print(table)
    write_json(args.json, result)
    return 0 if all(row["flat"] for row in result["metrics"].values()) else 1


if __name__ == "__main__":
    sys.exit(main())
