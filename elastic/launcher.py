"""Launchers start and retire worker processes; the coordinator only sees this interface.

:class:`LocalLauncher` runs workers as local processes from a ``forkserver`` that has
imported torch and the worker module once, so a new worker starts in well under a second
instead of paying the torch import each time.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import signal
from dataclasses import dataclass
from typing import Any, Protocol

from elastic.worker import WorkerSpec, worker_main


class WorkerHandle(Protocol):
    rank: int
    inbox: Any

    @property
    def pid(self) -> int | None: ...

    def is_alive(self) -> bool: ...

    def join(self, timeout: float) -> bool: ...

    def kill(self) -> None: ...


class Launcher(Protocol):
    """What the coordinator needs from a way of running workers."""

    capacity: int  # most workers it can run at once

    def reports(self) -> Any:
        """The queue every worker's reports arrive on."""

    def launch(self, spec: WorkerSpec) -> WorkerHandle: ...

    def shutdown(self) -> None: ...


@dataclass
class LocalWorker:
    rank: int
    inbox: Any
    process: mp.process.BaseProcess

    @property
    def pid(self) -> int | None:
        return self.process.pid

    def is_alive(self) -> bool:
        return self.process.is_alive()

    def join(self, timeout: float) -> bool:
        self.process.join(timeout)
        return not self.process.is_alive()

    def kill(self) -> None:
        if self.process.is_alive():
            os.kill(self.process.pid, signal.SIGKILL)
            self.process.join(5)

    def stall(self) -> None:
        """Freeze the process (SIGSTOP): alive but not answering. For fault injection."""
        os.kill(self.process.pid, signal.SIGSTOP)


class LocalLauncher:
    """Workers as processes on this machine."""

    def __init__(self, capacity: int | None = None):
        self.capacity = capacity if capacity is not None else max(8, os.cpu_count() or 1)
        self._ctx = mp.get_context("forkserver")
        self._ctx.set_forkserver_preload(["torch", "elastic.worker"])
        self._reports = self._ctx.Queue()
        self._workers: list[LocalWorker] = []

    def reports(self) -> Any:
        return self._reports

    def launch(self, spec: WorkerSpec) -> LocalWorker:
        inbox = self._ctx.Queue()
        process = self._ctx.Process(target=worker_main, args=(spec, inbox, self._reports),
                                    name=f"ep-worker-g{spec.generation}-r{spec.rank}", daemon=True)
        process.start()
        worker = LocalWorker(spec.rank, inbox, process)
        self._workers.append(worker)
        return worker

    def shutdown(self) -> None:
        for worker in self._workers:
            worker.kill()
        self._workers.clear()
