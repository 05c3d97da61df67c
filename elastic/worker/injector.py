"""The worker's side of fault injection: one object that knows this worker's faults and fires
them at the points the worker calls it from. Nothing here runs unless a test or scenario put a
fault in the worker's spec (:mod:`elastic.faults` holds the records)."""

from __future__ import annotations

import os
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


class FaultInjector:
    """Fires the faults of ``faults`` that name the worker's current rank and generation
    (``where()`` returns them: a worker changes both on a rescale)."""

    def __init__(self, faults: tuple[Any, ...], where: Callable[[], tuple[int, int]]):
        self.faults = faults
        self._where = where
        self._stalled: set[Any] = set()
        self._corrupted = 0
        self._delayed: dict[Any, int] = {}  # DelayTransfer fault -> layers delayed so far

    def active(self, kind: type[_F]) -> list[_F]:
        rank, generation = self._where()
        return [x for x in self.faults if isinstance(x, kind) and x.rank == rank
                and (x.generation is None or x.generation == generation)]

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
        for kill in self.active(f.KillRank):
            if kill.at_step is not None and step >= kill.at_step and steady:
                os._exit(17)
        for stall in self.active(f.StallRank):
            if step >= stall.at_step and stall not in self._stalled:
                self._stalled.add(stall)
                time.sleep(stall.seconds)

    def at_command(self, command: Any) -> None:
        phase = _PHASE_OF_COMMAND.get(type(command).__name__)
        for fault in self.active(f.KillRank):
            if phase is not None and fault.in_phase == phase and fault.after_layers is None:
                os._exit(17)

    def mid_rescale(self, layers_moved: int) -> None:
        if any(k.in_phase == "rescaling" and k.after_layers == layers_moved for k in self.active(f.KillRank)):
            os._exit(17)  # die mid-redistribution (the switch of a prepared scale)

    def mid_prestage(self, layers_moved: int) -> None:
        if any(k.in_phase == "draining" and k.after_layers == layers_moved for k in self.active(f.KillRank)):
            os._exit(17)  # die mid-pre-transfer (the prepare sub-phase of draining)

    def torn_commit(self, next_commit: int) -> bool:
        """Whether this rank's all-reduce "breaks" just before its ``next_commit``-th commit."""
        return any(fault.at_commit == next_commit for fault in self.active(f.TornCommit))

    def drops_heartbeat(self, step: int) -> bool:
        return any(step >= fault.from_step for fault in self.active(f.DropHeartbeats))

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
