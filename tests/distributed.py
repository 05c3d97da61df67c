"""Run a function on N real processes joined in a gloo group, for tests.

    from tests.distributed import run_distributed

    def body(rank, world_size, scale):          # module level: it is pickled by reference
        t = torch.full((2,), float(rank))
        dist.all_reduce(t)
        return t.tolist()

    results = run_distributed(body, 4, args=(2,), timeout=30)   # [result of rank 0, ..., rank 3]

How it works:

- The test process hosts a ``TCPStore`` on 127.0.0.1, port 0 (the OS picks a free port), so
  parallel test runs never collide. Each call uses a fresh store prefix.
- Workers are started with the ``forkserver`` context (default). The fork server preloads
  ``torch`` and ``torch.distributed`` once per test session, so every later launch forks a
  process that already has torch imported (tens of ms instead of seconds). ``"spawn"`` works too.
- Each worker joins a gloo group (``torch.distributed.init_process_group``) with the given
  ``pg_timeout``, runs ``fn(rank, world_size, *args)`` and sends back its return value or
  its exception (the exception object when it pickles, else a :class:`RemoteError`
  carrying the traceback text).
- The call waits at most ``timeout`` seconds in all. Workers still running then are
  terminated (SIGTERM, then SIGKILL) and :class:`DistributedTimeout` is raised, naming them.
- With ``return_exceptions=False`` (default) the first failing rank's error is raised as
  :class:`DistributedTestError` (the worker's traceback is in the message; the original
  exception is ``__cause__`` and in ``.errors``). With ``return_exceptions=True`` exceptions
  come back in the result list in place of the rank's result.

Workers use one intra-op thread (the test machine is small and shared) and talk over the
loopback interface (``GLOO_SOCKET_IFNAME=lo`` unless the caller set it).
"""

from __future__ import annotations

import multiprocessing as mp
import os
import pickle
import queue as queue_mod
import time
import traceback
import uuid
from collections.abc import Callable, Sequence
from datetime import timedelta
from typing import Any

__all__ = [
    "DistributedTestError",
    "DistributedTimeout",
    "RemoteError",
    "run_distributed",
]

_PRELOAD = ["torch", "torch.distributed"]


class RemoteError(Exception):
    """An exception raised in a worker that could not be pickled back as itself."""

    def __init__(self, rank: int, type_name: str, message: str, tb: str):
        super().__init__(f"rank {rank}: {type_name}: {message}")
        self.rank = rank
        self.type_name = type_name
        self.message = message
        self.traceback = tb

    def __reduce__(self):
        return (RemoteError, (self.rank, self.type_name, self.message, self.traceback))


class DistributedTestError(AssertionError):
    """A worker raised; ``errors`` maps rank -> exception, ``tracebacks`` rank -> text."""

    def __init__(self, errors: dict[int, BaseException], tracebacks: dict[int, str]):
        self.errors = errors
        self.tracebacks = tracebacks
        parts = [f"{len(errors)} of the worker(s) failed: ranks {sorted(errors)}"]
        for rank in sorted(errors):
            parts.append(f"--- rank {rank} ---\n{tracebacks.get(rank, repr(errors[rank]))}")
        super().__init__("\n".join(parts))


class DistributedTimeout(AssertionError):
    """The workers did not all finish within the timeout; the stragglers were killed."""

    def __init__(self, timeout: float, unfinished: Sequence[int], finished: dict[int, Any]):
        self.timeout = timeout
        self.unfinished = list(unfinished)
        self.finished = finished
        super().__init__(
            f"ranks {self.unfinished} did not finish within {timeout:.1f}s and were killed "
            f"(ranks {sorted(finished)} finished)"
        )


def _worker(
    rank: int,
    world_size: int,
    host: str,
    port: int,
    prefix: str,
    pg_timeout: float,
    fn: Callable[..., Any],
    args: tuple,
    results: Any,
) -> None:
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    status: str
    payload: Any
    tb = ""
    try:
        import torch
        import torch.distributed as dist

        torch.set_num_threads(1)
        store = dist.TCPStore(host, port, is_master=False, timeout=timedelta(seconds=pg_timeout))
        dist.init_process_group(
            "gloo",
            store=dist.PrefixStore(prefix, store),
            rank=rank,
            world_size=world_size,
            timeout=timedelta(seconds=pg_timeout),
        )
        status, payload = "ok", fn(rank, world_size, *args)
    except BaseException as exc:  # noqa: BLE001 - everything goes back to the test process
        status, payload, tb = "error", exc, traceback.format_exc()
    try:
        pickle.dumps(payload)
    except Exception as exc:  # noqa: BLE001
        if status == "ok":
            status, tb = "error", traceback.format_exc()
            payload = RemoteError(rank, type(exc).__name__, f"result does not pickle: {exc}", tb)
        else:
            payload = RemoteError(rank, type(payload).__name__, str(payload), tb)
    results.put((rank, status, payload, tb))
    results.close()
    results.join_thread()
    # Skip interpreter teardown: a process group with work still pending (after a test of a
    # timeout, say) can block in its destructor. Everything the test needs was sent above.
    os._exit(0)


def _context(name: str):
    ctx = mp.get_context(name)
    if name == "forkserver":
        ctx.set_forkserver_preload(_PRELOAD)
    return ctx


def run_distributed(
    fn: Callable[..., Any],
    world_size: int,
    *,
    args: tuple = (),
    timeout: float = 60.0,
    pg_timeout: float | None = None,
    return_exceptions: bool = False,
    context: str = "forkserver",
) -> list[Any]:
    """Run ``fn(rank, world_size, *args)`` on ``world_size`` gloo processes; return results by rank.

    ``fn`` and ``args`` must pickle (a module-level function of an importable module).
    ``timeout`` bounds the whole call (start, run, join); ``pg_timeout`` (default: ``timeout``)
    is the process group's own timeout for collectives and the store.
    """
    import torch.distributed as dist

    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}")
    pg_timeout = float(timeout if pg_timeout is None else pg_timeout)
    deadline = time.monotonic() + timeout
    host = "127.0.0.1"
    store = dist.TCPStore(
        host, 0, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=pg_timeout)
    )
    prefix = f"run-{uuid.uuid4().hex}"
    ctx = _context(context)
    results = ctx.Queue()
    procs = [
        ctx.Process(
            target=_worker,
            args=(rank, world_size, host, store.port, prefix, pg_timeout, fn, args, results),
            name=f"dist-test-rank{rank}",
            daemon=True,
        )
        for rank in range(world_size)
    ]
    try:
        for p in procs:
            p.start()
        outcome = _collect(procs, results, deadline)
        for p in procs:
            p.join(timeout=max(0.0, min(5.0, deadline - time.monotonic())))
    finally:
        _stop(procs)
        results.close()
        del store

    unfinished = [r for r in range(world_size) if r not in outcome]
    if unfinished:
        raise DistributedTimeout(timeout, unfinished, {r: o[1] for r, o in outcome.items()})
    errors = {r: o[1] for r, o in outcome.items() if o[0] == "error"}
    if errors and not return_exceptions:
        first = min(errors)
        raise DistributedTestError(errors, {r: outcome[r][2] for r in errors}) from errors[first]
    return [outcome[r][1] for r in range(world_size)]


def _collect(procs: list[Any], results: Any, deadline: float) -> dict[int, tuple[str, Any, str]]:
    """Each rank's ``(status, payload, traceback)`` until all reported or ``deadline``; a rank that
    died without reporting counts as a ``ProcessDied`` error."""
    outcome: dict[int, tuple[str, Any, str]] = {}
    while len(outcome) < len(procs):
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            break
        try:
            rank, status, payload, tb = results.get(timeout=min(remaining, 0.5))
        except queue_mod.Empty:
            # A worker that died without reporting (killed, segfault) never will.
            dead = [r for r, p in enumerate(procs) if r not in outcome and p.exitcode is not None]
            for r in dead:
                try:  # it may have reported just before exiting
                    rank, status, payload, tb = results.get(timeout=0.2)
                    outcome[rank] = (status, payload, tb)
                except queue_mod.Empty:
                    err = RemoteError(r, "ProcessDied", f"exit code {procs[r].exitcode}", "")
                    outcome[r] = ("error", err, f"rank {r} died with exit code {procs[r].exitcode}")
            continue
        outcome[rank] = (status, payload, tb)
    return outcome


def _stop(procs: list[Any]) -> None:
    """Terminate, then kill, every rank still alive; each join bounded."""
    for p in procs:
        if p.is_alive():
            p.terminate()
    for p in procs:
        p.join(timeout=2.0)
        if p.is_alive():
            p.kill()
            p.join(timeout=2.0)
