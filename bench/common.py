"""Shared pieces of the benchmarks: a coordinator that keeps every report, stats, memory, output.

Run benchmarks from the repository root (``python -m bench.bench_decode``): the worker
processes come from a forkserver, so a benchmark's entry point must sit under
``if __name__ == "__main__"``.
"""

from __future__ import annotations

import json
import math
import os
import platform
import threading
import time
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

import torch

from elastic.control.coordinator import Coordinator
from elastic.core import protocol as p
from elastic.core.config import TimeoutsConfig

MiB = 1024 * 1024

#: explicit deadlines (valid whatever the defaults are): a stuck bench fails instead of hanging
BENCH_TIMEOUTS = TimeoutsConfig(collective=30.0, heartbeat=45.0)


class RecordingCoordinator(Coordinator):
    """A :class:`Coordinator` that also keeps every heartbeat and ``PhaseDone`` it files.

    ``Coordinator`` keeps only the last heartbeat per worker; the benchmarks need every
    per-step timing sample (``Heartbeat.step_timings``) and every phase report's detail.
    """

    def __init__(self, *args: Any, **kwargs: Any):
        super().__init__(*args, **kwargs)
        self._bench_lock = threading.Lock()
        self.beats: list[p.Heartbeat] = []
        self.phase_reports: list[p.PhaseDone] = []

    def _file(self, report: p.Report) -> None:
        if isinstance(report, p.Heartbeat):
            with self._bench_lock:
                self.beats.append(report)
        elif isinstance(report, p.PhaseDone):
            with self._bench_lock:
                self.phase_reports.append(report)
        super()._file(report)

    def step_samples(self) -> list[dict[str, Any]]:
        """Every per-step sample of every worker: rank, generation, step, t, eplb_s, eplb_cpu_s, busy."""
        with self._bench_lock:
            beats = list(self.beats)
        out = []
        for b in beats:
            for step, t, eplb_s, eplb_cpu_s, busy in b.step_timings:
                out.append({"rank": b.rank, "generation": b.generation, "pid": b.pid, "step": step, "t": t,
                            "eplb_s": eplb_s, "eplb_cpu_s": eplb_cpu_s, "busy": bool(busy)})
        return out

    def last_beat_by_pid(self, before_step: int | None = None) -> dict[int, p.Heartbeat]:
        """Each worker's latest heartbeat (with ``before_step``: the latest of a step below it)."""
        with self._bench_lock:
            beats = list(self.beats)
        last: dict[int, p.Heartbeat] = {}
        for b in beats:
            if before_step is None or b.step < before_step:
                last[b.pid] = b
        return last

    def worker_pids(self) -> list[int]:
        return [w.handle.pid for w in self.live_workers()]


# -- statistics --------------------------------------------------------------------------------

def percentile(values: Sequence[float], q: float) -> float:
    """Linear-interpolated percentile (``q`` in [0, 100]); NaN for no values."""
    if not values:
        return math.nan
    xs = sorted(values)
    if len(xs) == 1:
        return xs[0]
    pos = (len(xs) - 1) * q / 100.0
    lo, hi = math.floor(pos), math.ceil(pos)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


def summary(values: Sequence[float]) -> dict[str, float]:
    values = list(values)
    return {"n": len(values), "p50": percentile(values, 50), "p99": percentile(values, 99),
            "max": max(values) if values else math.nan, "mean": sum(values) / len(values) if values else math.nan}


# -- processes (Linux /proc) ---------------------------------------------------------------------

def stat_fields(pid: int) -> list[str] | None:
    """The fields of ``/proc/<pid>/stat`` after "pid (comm) " (the state is field 0); None if gone."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            text = f.read()
    except OSError:  # gone
        return None
    return text[text.rindex(")") + 2:].split()


def parent_of() -> dict[int, int]:
    """Every live process's parent pid, by pid."""
    out = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            fields = stat_fields(int(entry))
            if fields is not None:
                out[int(entry)] = int(fields[1])
    return out


def descendants(root: int) -> list[int]:
    """``root`` and every process below it (children of children: forkserver workers too)."""
    parents = parent_of()
    tree, frontier = {root} if root in parents else set(), [root]
    while frontier:
        parent = frontier.pop()
        for pid, ppid in parents.items():
            if ppid == parent and pid not in tree:
                tree.add(pid)
                frontier.append(pid)
    return sorted(tree)


# -- memory ------------------------------------------------------------------------------------

def proc_memory(pid: int) -> dict[str, int]:
    """Peak (VmHWM) and current (VmRSS) resident memory of a process, in bytes (Linux)."""
    out = {"peak_rss": 0, "rss": 0}
    try:
        with open(f"/proc/{pid}/status") as status:
            for line in status:
                if line.startswith("VmHWM:"):
                    out["peak_rss"] = int(line.split()[1]) * 1024
                elif line.startswith("VmRSS:"):
                    out["rss"] = int(line.split()[1]) * 1024
    except OSError:
        pass
    return out


# -- loopback bandwidth ------------------------------------------------------------------------

def _bandwidth_peer(rank: int, port: int, nbytes: int, repeats: int, message_bytes: int, batch: int,
                    result: Any) -> None:
    from datetime import timedelta

    import torch.distributed as dist

    torch.set_num_threads(1)
    store = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=timedelta(seconds=60), use_libuv=True)
    dist.init_process_group("gloo", store=dist.PrefixStore("bw/", store), rank=rank, world_size=2,
                            timeout=timedelta(seconds=60))
    tensor = torch.ones(nbytes // 4, dtype=torch.float32) if rank == 0 else torch.empty(nbytes // 4, dtype=torch.float32)
    peer = 1 - rank
    # warm-up (connection set-up, first touch of the receive buffer)
    (dist.send if rank == 0 else dist.recv)(tensor, peer)
    dist.barrier()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        (dist.send if rank == 0 else dist.recv)(tensor, peer)
        if rank == 1:
            times.append(time.perf_counter() - start)
        dist.barrier()
    # the same bytes as expert-sized messages, posted like the transfer executor does
    # (batch_isend_irecv of ``batch`` ops, wait for all, next batch)
    pieces = list(tensor.view(-1, message_bytes // 4))
    op = dist.isend if rank == 0 else dist.irecv
    message_times = []
    for _ in range(repeats):
        start = time.perf_counter()
        for i in range(0, len(pieces), batch):
            for work in dist.batch_isend_irecv([dist.P2POp(op, t, peer) for t in pieces[i:i + batch]]):
                work.wait()
        if rank == 1:
            message_times.append(time.perf_counter() - start)
        dist.barrier()
    if rank == 1:
        result.put((times, message_times))
    dist.destroy_process_group()


def loopback_bandwidth(nbytes: int = 128 * MiB, repeats: int = 5, message_bytes: int = MiB // 2,
                       batch: int = 64) -> dict[str, float]:
    """Bytes/s of gloo send/recv between two fresh local processes.

    ``bytes_per_second``: one ``nbytes`` tensor (median of ``repeats``);
    ``message_bytes_per_second``: the same bytes as ``message_bytes`` messages, ``batch`` per
    ``batch_isend_irecv`` (how the transfer executor posts expert tensors).
    """
    import multiprocessing as mp

    import torch.distributed as dist

    # spawn, not forkserver: the launcher's forkserver (with torch preloaded) must stay its own
    ctx = mp.get_context("spawn")
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, use_libuv=True)
    result = ctx.Queue()
    procs = [ctx.Process(target=_bandwidth_peer, args=(r, store.port, nbytes, repeats, message_bytes, batch, result),
                         daemon=True) for r in range(2)]
    for proc in procs:
        proc.start()
    try:
        times, message_times = result.get(timeout=120)
    finally:
        for proc in procs:
            proc.join(30)
            if proc.is_alive():
                proc.kill()
    median, message_median = percentile(times, 50), percentile(message_times, 50)
    return {"bytes": nbytes, "repeats": repeats, "median_seconds": median, "best_seconds": min(times),
            "bytes_per_second": nbytes / median, "best_bytes_per_second": nbytes / min(times),
            "message_bytes": message_bytes, "batch": batch, "message_median_seconds": message_median,
            "message_bytes_per_second": nbytes / message_median}


# -- output ------------------------------------------------------------------------------------

def machine_info() -> dict[str, Any]:
    return {"python": platform.python_version(), "torch": torch.__version__, "cpus": os.cpu_count(),
            "platform": platform.platform()}


def fmt_s(seconds: float | None) -> str:
    if seconds is None or (isinstance(seconds, float) and math.isnan(seconds)):
        return "-"
    if seconds < 1e-3:
        return f"{seconds * 1e6:.0f} us"
    if seconds < 1.0:
        return f"{seconds * 1e3:.1f} ms"
    return f"{seconds:.2f} s"


def fmt_bytes(n: float | None) -> str:
    if n is None:
        return "-"
    if n >= 1024 * MiB:
        return f"{n / (1024 * MiB):.2f} GiB"
    return f"{n / MiB:.1f} MiB"


def verdict(ok: bool) -> str:
    return "[green]PASS[/green]" if ok else "[red]FAIL[/red]"


def _clean(value: Any) -> Any:
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {str(k): _clean(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_clean(v) for v in value]
    return value


def write_json(path: str | None, payload: dict[str, Any]) -> None:
    if not path:
        return
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    Path(path).write_text(json.dumps(_clean(payload), indent=2, sort_keys=False))


def consecutive_durations(samples: Iterable[dict[str, Any]]) -> list[tuple[dict[str, Any], float]]:
    """For one rank's samples sorted by step: (sample, seconds since the previous step ended)."""
    ordered = sorted(samples, key=lambda s: s["step"])
    out = []
    for prev, cur in zip(ordered, ordered[1:]):
        if cur["step"] == prev["step"] + 1 and cur["generation"] == prev["generation"]:
            out.append((cur, cur["t"] - prev["t"]))
    return out
