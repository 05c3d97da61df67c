"""The worker's side of fault injection: one object that knows this worker's faults and fires
them at the points the worker calls it from. Nothing here runs unless a test or scenario put a
fault in the worker's spec (:mod:`elastic.faults` holds the records)."""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Callable
from typing import Any, TypeVar

import torch

from elastic import faults as f
from elastic.core.phases import Phase

#: the command class name -> the phase a KillRank(in_phase=...) names
_PHASE_OF_COMMAND = {"Drain": Phase.DRAINING, "Suppress": Phase.SUPPRESSED, "Rescale": Phase.RESCALING,
                     "Resume": Phase.RESUMING}

_F = TypeVar("_F", bound=f._Fault)

log = logging.getLogger("elastic.worker.injector")

#: the store key that records the generation a once-fault (``faults.fires_once``) fired in: the
#: fault's position in the spec's faults, the same tuple in every worker of a deployment
BOUND_KEY = "elastic/faults/{index}"


class FaultInjector:
    """Fires the faults of ``faults`` that name the worker's current rank and generation
    (``where()`` returns them: a worker changes both on a rescale).

    A fault without a generation that happens once (``faults.fires_once``) is bound to the first
    generation it fires in: the first rank to fire it writes that generation under
    :data:`BOUND_KEY` in ``store`` (``compare_set``: the first writer wins), and every process
    fires it only in that generation. Without a store (unit tests) the binding is this process's."""

    def __init__(self, faults: tuple[Any, ...], where: Callable[[], tuple[int, int]], store: Any = None):
        self.faults = faults
        self._where = where
        self._store = store
        self._stalled: set[int] = set()
        self._corrupted = 0
        self._delayed: dict[Any, int] = {}  # DelayTransfer fault -> layers delayed so far
        self._bound: dict[int, int] = {}  # index of a once-fault -> the generation it fired (fires) in
        self._lock = threading.Lock()

    def _active(self, kind: type[_F]) -> list[tuple[int, _F]]:
        """(position, fault) of the faults of ``kind`` that may apply to this rank now (a once-fault
        still needs :meth:`_fires` at the moment it would fire)."""
        rank, generation = self._where()
        return [(i, x) for i, x in enumerate(self.faults) if isinstance(x, kind) and x.rank == rank
                and x.in_generation(generation)]

    def active(self, kind: type[_F]) -> list[_F]:
        return [x for _, x in self._active(kind)]

    def _fires(self, index: int) -> bool:
        """At the moment fault ``index`` would fire: whether it fires (a once-fault: only in the
        generation it is bound to, binding it to the current one if it is the first to fire)."""
        if not f.fires_once(self.faults[index]):
            return True
        generation = self._where()[1]
        with self._lock:
            if index not in self._bound:
                if self._store is None:
                    self._bound[index] = generation
                else:
                    try:
                        raw = self._store.compare_set(BOUND_KEY.format(index=index), "", str(generation))
                        self._bound[index] = int(raw)
                    except Exception as exc:  # noqa: BLE001 - no store, no coordinator: nothing to break for
                        log.warning("fault %d not fired: its binding could not be read: %s", index, exc)
                        return False
            return self._bound[index] == generation

    # -- the points the worker calls ----------------------------------------------------------
    def hang_before_start(self) -> None:
        if self.active(f.HangBeforeStart):
            while True:  # hung before the first report; the coordinator gives up at worker_start
                time.sleep(1.0)

    def slow_prepare(self, progress: Callable[[tuple[str, int, int] | None], None]) -> None:
        """A preparation that takes longer (a slow checkpoint load), reporting progress each second."""
        for fault in self.active(f.SlowPrepare):
            total = max(1, int(fault.seconds))
            for done in range(total):
                progress(("loading weights (slow_prepare fault)", done, total))
                time.sleep(fault.seconds / total)
            progress(None)

    def at_step(self, step: int, steady: bool = True) -> None:
        """``steady``: the rank decodes outside any operation. A step-pinned kill waits for that: a
        generation that starts past its step is killed once it serves, not in its ``resuming``
        (a kill inside an operation is ``in_phase``'s)."""
        for i, kill in self._active(f.KillRank):
            if kill.at_step is not None and step >= kill.at_step and steady and self._fires(i):
                os._exit(17)
        for i, stall in self._active(f.StallRank):
            if step >= stall.at_step and i not in self._stalled and self._fires(i):
                self._stalled.add(i)
                time.sleep(stall.seconds)

    def at_command(self, command: Any) -> None:
        phase = _PHASE_OF_COMMAND.get(type(command).__name__)
        for i, fault in self._active(f.KillRank):
            if phase is not None and fault.in_phase == phase and fault.after_layers is None and self._fires(i):
                os._exit(17)

    def mid_rescale(self, layers_moved: int) -> None:
        if any(k.in_phase == "rescaling" and k.after_layers == layers_moved and self._fires(i)
               for i, k in self._active(f.KillRank)):
            os._exit(17)  # die mid-redistribution (the switch of a prepared scale)

    def mid_prestage(self, layers_moved: int) -> None:
        if any(k.in_phase == "draining" and k.after_layers == layers_moved and self._fires(i)
               for i, k in self._active(f.KillRank)):
            os._exit(17)  # die mid-pre-transfer (the prepare sub-phase of draining)

    def torn_commit(self, next_commit: int) -> bool:
        """Whether this rank's all-reduce "breaks" just before its ``next_commit``-th commit."""
        return any(fault.at_commit == next_commit for fault in self.active(f.TornCommit))

    def drops_heartbeat(self, step: int) -> bool:
        return any(step >= fault.from_step and self._fires(i) for i, fault in self._active(f.DropHeartbeats))

    def before_layer(self, layer: int) -> None:
        for fault in self.active(f.DelayTransfer):
            if fault.times is None or self._delayed.get(fault, 0) < fault.times:
                self._delayed[fault] = self._delayed.get(fault, 0) + 1
                time.sleep(fault.seconds)

    def after_fill(self, layer: int, rank_plan: Any, staging: list[torch.Tensor]) -> None:
        for fault in self.active(f.CorruptBuffer):
            if self._corrupted < fault.times and rank_plan.changed_slots:
                self._corrupted += 1
                staging[0][rank_plan.changed_slots[0]].add_(1.0)
