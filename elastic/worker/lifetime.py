"""A worker process never outlives its coordinator.

A local worker is not the coordinator's child: the :class:`~elastic.launch.launchers.LocalLauncher`
forks it from a multiprocessing *forkserver*, which is the coordinator's child. When the
coordinator is killed (SIGKILL, OOM killer) nothing tells the workers: the forkserver is
reparented and stays up as long as any worker holds its "alive" pipe, and the workers go on
decoding. :func:`watch_coordinator`, started from
:func:`elastic.worker.process.worker_main`, closes that gap:

- **A watcher thread** waits on a *pidfd* of the coordinator (Linux 5.3+), opened while the
  coordinator is still an ancestor of this process, so it names the right process however pids
  are reused later; the pidfd turns readable the moment the coordinator exits, and the worker
  exits with :data:`ORPHAN_EXIT_CODE`. Without pidfds it checks every ``interval_s`` that the
  coordinator's pid is still an ancestor (``/proc/<pid>/stat``, parent by parent). This covers
  every worker that descends from the coordinator: forkserver workers, command-launcher workers
  started here (``ip netns exec``, a plain ``python``), and Ray actors of a cluster that
  ``ray.init`` started from the coordinator.
- **No parent-death signal.** A worker's parent is the forkserver, and the forkserver can die
  while the coordinator lives: a launch that fails half-way (``EMFILE`` between its connect and
  its send) makes it exit. A parent-death signal, or a watch of the ancestry, then took every
  worker with it, and nothing was left to recover from. With the pidfd watch the workers outlive
  the forkserver, and the launcher's next launch starts a new one.

A worker on another host (ssh) or in a Ray actor on a cluster started apart (``ray start``) does
not descend from the coordinator. Its watch is the store's (:mod:`elastic.launch.remote_worker`: it
exits once the coordinator's store has been unreachable for ``orphan_timeout_s``, 60 s by
default); Ray kills an actor whose owner, the coordinator's driver, died before that (0.1 s
measured on a local cluster).
"""

from __future__ import annotations

import ctypes
import logging
import multiprocessing
import os
import select
import signal
import sys
import threading

log = logging.getLogger("elastic.worker.lifetime")

#: exit code of a worker that left because its coordinator is gone (as elastic.launch.remote_worker's)
ORPHAN_EXIT_CODE = 4
PR_SET_PDEATHSIG = 1  # <linux/prctl.h>


def parent_of(pid: int) -> int | None:
    """The parent pid of ``pid`` from ``/proc`` (None: no such process, or no ``/proc``)."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read()
    except OSError:
        return None
    # "pid (comm) state ppid ...": comm may hold spaces and parentheses, so split after the last ")"
    fields = stat[stat.rfind(b")") + 2:].split()
    return int(fields[1]) if len(fields) > 1 else None


def ancestors(pid: int | None = None) -> list[int]:
    """The pids above ``pid`` (default: this process), nearest first, up to the namespace's init.

    Init (pid 1) is included: a coordinator that is a container's pid 1 is an ancestor too.
    """
    chain: list[int] = []
    current = os.getpid() if pid is None else pid
    while len(chain) < 256:  # a bound, in case /proc changes under us
        parent = parent_of(current)
        if parent is None or parent <= 0 or parent in chain:  # init's parent is 0
            break
        chain.append(parent)
        current = parent
    return chain


def set_parent_death_signal(sig: int = signal.SIGKILL) -> bool:
    """Ask the kernel to send ``sig`` to this process when its parent ends. Linux only."""
    if not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        return libc.prctl(PR_SET_PDEATHSIG, int(sig), 0, 0, 0) == 0
    except (OSError, AttributeError):
        return False


class CoordinatorWatch:
    """The watcher thread of one worker process; :meth:`stop` ends it (a normal worker exit)."""

    def __init__(self, coordinator_pid: int, interval_s: float):
        self.coordinator_pid = coordinator_pid
        self.interval_s = interval_s
        self.pidfd: int | None = None
        self._stop = threading.Event()
        self.thread = threading.Thread(target=self._run, name="coordinator-watch", daemon=True)

    def coordinator_alive(self) -> bool:
        if self.pidfd is not None:
            return not select.select([self.pidfd], [], [], 0)[0]
        return self.coordinator_pid in ancestors()

    def open_pidfd(self) -> None:
        """Hold a pidfd of the coordinator (call while it is known to be an ancestor)."""
        try:
            self.pidfd = os.pidfd_open(self.coordinator_pid)
        except (AttributeError, OSError):
            self.pidfd = None  # an older kernel: the ancestry is checked instead

    def _run(self) -> None:
        while not self._stop.is_set():
            if self.pidfd is not None:
                gone = bool(select.select([self.pidfd], [], [], self.interval_s)[0])
            else:
                gone = self._stop.wait(self.interval_s) is False and not self.coordinator_alive()
            if gone and not self._stop.is_set():
                log.warning("worker %d: coordinator %d is gone, exiting", os.getpid(), self.coordinator_pid)
                logging.shutdown()
                os._exit(ORPHAN_EXIT_CODE)  # nothing to hand back: the group's store died with the coordinator

    def stop(self) -> None:
        self._stop.set()


def watch_coordinator(coordinator_pid: int | None, *, interval_s: float = 0.25) -> CoordinatorWatch | None:
    """Bound this process's life by the coordinator's (see the module docstring).

    Returns the running watch, or None when there is nothing to watch here: no pid given, no
    ``/proc``, or the coordinator is not an ancestor (a worker on another host or placed by Ray,
    whose store watch covers it). Exits at once when this process was started by the
    coordinator's forkserver but the coordinator is already gone.
    """
    if not coordinator_pid:
        return None
    parent = multiprocessing.parent_process()  # the process that called Process.start(), if any
    from_forkserver = parent is not None and parent.pid == coordinator_pid and os.getppid() != coordinator_pid
    if not os.path.exists(f"/proc/{os.getpid()}/stat"):
        return None
    watch = CoordinatorWatch(coordinator_pid, interval_s)
    if not watch.coordinator_alive():
        if from_forkserver:  # started by it, yet it is gone already (killed while we started)
            log.warning("worker %d: coordinator %d died before the worker started", os.getpid(), coordinator_pid)
            os._exit(ORPHAN_EXIT_CODE)
        return None  # not a descendant: another host, or Ray placed us
    watch.open_pidfd()
    if watch.coordinator_pid not in ancestors():  # it died between the check and the pidfd: the pid may be reused
        watch.stop()
        if from_forkserver:
            os._exit(ORPHAN_EXIT_CODE)
        return None
    watch.thread.start()
    return watch
