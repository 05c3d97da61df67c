"""The timeline: scales, recoveries and failures as windows of wall-clock time, and rebalances apart.

A load generator shades these windows on its plots (``GET /timeline``). Rebalances are kept in
their own bounded list, so an idle deployment's frequent rebalances never push the operations out.
"""

from __future__ import annotations

from collections import deque
from typing import Any

from elastic.control.operations import Operation, OperationStatus
from elastic.core import protocol as p
from elastic.core.clock import Clock
from elastic.core.machine import Transition
from elastic.core.phases import Phase

__all__ = ["Timeline"]

#: a rebalance that never finished (its group broke) is dropped after this many newer ones started
OPEN_REBALANCES = 16


class Timeline:
    """Windows of operations, failures (``timeline``) and rank 0's rebalances (``rebalance_windows``)."""

    def __init__(self, clock: Clock, history: int):
        self.clock = clock
        self.timeline: deque[dict[str, Any]] = deque(maxlen=10 * history)
        self.rebalance_windows: deque[dict[str, Any]] = deque(maxlen=1000)
        self._rebalance_open: dict[Any, dict[str, Any]] = {}

    def on_transition(self, transition: Transition) -> None:
        """A failure opens a window; the recovery that brings the group back closes it."""
        if transition.dest == Phase.FAILED and not any(w["kind"] == "failure" and w["ended_at"] is None
                                                       for w in self.timeline):
            self.timeline.append({"kind": "failure", "id": f"failure-{transition.seq}", "started_at": self.clock.wall(),
                                  "ended_at": None, "reason": transition.reason})
        elif transition.dest == Phase.RUNNING:
            for window in self.timeline:
                if window["kind"] == "failure" and window["ended_at"] is None:
                    window["ended_at"] = self.clock.wall()

    def on_operation(self, op: Operation) -> None:
        """A finished scale or recovery as a window, with its pause (``rescaling``) in wall time."""
        if op.status == OperationStatus.NOOP:
            return
        offset = self.clock.wall() - self.clock.monotonic()
        window: dict[str, Any] = {"kind": op.kind, "id": op.id, "status": op.status.value,
                                  "started_at": op.created_at, "ended_at": op.finished_at}
        rescaling = op.phases.get(Phase.RESCALING.value)
        if rescaling and "ended" in rescaling:
            window["pause"] = [rescaling["started"] + offset, rescaling["ended"] + offset]
        self.timeline.append(window)

    def on_rebalance(self, report: p.WorkerEvent) -> None:
        """Rank 0's rebalance events as windows (wall clock, the worker's)."""
        key = report.data.get("id")
        fresh: dict[str, Any] = {"kind": "rebalance", "id": f"rebalance-{report.generation}-{key}",
                                 "started_at": report.at, "ended_at": None}
        if report.kind == "rebalance_started":
            while len(self._rebalance_open) >= OPEN_REBALANCES:
                self._rebalance_open.pop(next(iter(self._rebalance_open)))
            self._rebalance_open[(report.generation, key)] = fresh
            self.rebalance_windows.append(fresh)
        elif report.kind in ("rebalance_finished", "rebalance_failed"):
            window = self._rebalance_open.pop((report.generation, key), None)
            if window is None:  # a sync rebalance: started and finished within one step
                window = fresh
                self.rebalance_windows.append(window)
            window["ended_at"] = report.at
            window["outcome"] = "failed" if report.kind == "rebalance_failed" else "finished"

    def windows(self) -> list[dict[str, Any]]:
        """Every window, operations and failures first, then rebalances."""
        return [*self.timeline, *self.rebalance_windows]
