"""What the control plane tells its subscribers, as typed events.

``Coordinator.subscribe_events(callback)`` receives these values. The older
``Coordinator.subscribe(callback)`` keeps its ``callback(kind, data)`` signature: each event
is passed as its :attr:`Event.kind` and :meth:`Event.data` (the same strings and dicts as before).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from enum import StrEnum
from typing import Any

from elastic.core import protocol as p
from elastic.core.machine import Transition

__all__ = ["Event", "EventHub", "EventKind", "HeartbeatSeen", "OperationChanged", "OutputChecked", "Transitioned",
           "WorkerErrorSeen", "WorkerEventSeen"]

log = logging.getLogger("elastic.control.events")


class EventKind(StrEnum):
    TRANSITION = "transition"
    OPERATION = "operation"
    WORKER_EVENT = "worker_event"
    WORKER_ERROR = "worker_error"
    HEARTBEAT = "heartbeat"
    OUTPUT_CHECK = "output_check"


@dataclass(frozen=True)
class Transitioned:
    transition: Transition
    kind = EventKind.TRANSITION

    def data(self) -> dict[str, Any]:
        return self.transition.to_dict()


@dataclass(frozen=True)
class OperationChanged:
    """An operation entered a phase or ended (``operation`` is its ``Operation.to_dict()``)."""

    operation: dict[str, Any]
    kind = EventKind.OPERATION

    def data(self) -> dict[str, Any]:
        return self.operation


@dataclass(frozen=True)
class WorkerEventSeen:
    report: p.WorkerEvent
    kind = EventKind.WORKER_EVENT

    def data(self) -> dict[str, Any]:
        r = self.report
        return {"rank": r.rank, "step": r.step, "kind": r.kind, **r.data}


@dataclass(frozen=True)
class WorkerErrorSeen:
    report: p.WorkerError
    kind = EventKind.WORKER_ERROR

    def data(self) -> dict[str, Any]:
        r = self.report
        return {"rank": r.rank, "step": r.step, "error": f"{r.error_type}: {r.message}"}


@dataclass(frozen=True)
class HeartbeatSeen:
    report: p.Heartbeat
    received: float  # the control plane's monotonic clock
    kind = EventKind.HEARTBEAT

    def data(self) -> dict[str, Any]:
        r = self.report
        return {"rank": r.rank, "generation": r.generation, "pid": r.pid, "step": r.step,
                "step_seconds": r.step_seconds, "balancedness": r.balancedness, "state": r.state,
                "in_flight_layer": r.in_flight_layer, "rank_load": r.rank_load, "progress": r.progress,
                "received": self.received}


@dataclass(frozen=True)
class OutputChecked:
    result: dict[str, Any]
    kind = EventKind.OUTPUT_CHECK

    def data(self) -> dict[str, Any]:
        return self.result


Event = Transitioned | OperationChanged | WorkerEventSeen | WorkerErrorSeen | HeartbeatSeen | OutputChecked


class EventHub:
    """The subscribers, typed and ``(kind, data)``; a subscriber that raises never breaks the control plane."""

    def __init__(self) -> None:
        self._typed: list[Callable[[Event], None]] = []
        self._legacy: list[Callable[[str, dict[str, Any]], None]] = []

    def subscribe(self, callback: Callable[[str, dict[str, Any]], None]) -> None:
        self._legacy.append(callback)

    def subscribe_events(self, callback: Callable[[Event], None]) -> None:
        self._typed.append(callback)

    @property
    def active(self) -> bool:
        return bool(self._typed or self._legacy)

    def emit(self, event: Event) -> None:
        for typed in list(self._typed):
            try:
                typed(event)
            except Exception:  # noqa: BLE001 - a subscriber never breaks the control plane
                log.exception("subscriber failed on %s", event.kind)
        if not self._legacy:
            return
        data = event.data()
        for legacy in list(self._legacy):
            try:
                legacy(event.kind.value, data)
            except Exception:  # noqa: BLE001
                log.exception("subscriber failed on %s", event.kind)
