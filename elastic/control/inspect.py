"""Reading the deployment: the ``GET /state`` snapshot, and the watch on a group that broke with no one lost."""

from __future__ import annotations

from typing import Any

from elastic.control.operations import GroupLayout, Operation
from elastic.control.registry import WorkerRegistry
from elastic.core import protocol as p
from elastic.core.clock import Clock
from elastic.core.machine import ScaleMachine
from elastic.core.phases import Phase
from elastic.worker.liveness import WATCH_MARGIN_S

__all__ = ["BrokenGroupWatch", "eplb_health", "snapshot_of"]


class BrokenGroupWatch:
    """A worker's group broke (a decode collective failed) while no operation runs and, one
    heartbeat deadline (plus the step watch's margin and 0.5 s) later, no worker is lost or
    silent (a collective failed, nobody died or hung): the deployment no longer decodes, so it
    is ``failed``; broken ranks keep beating, so silence never comes. The wait lets a dead or
    stuck peer be found first, so the reason names the culprit and recovery leaves it out. An
    operation in flight sees the report in its own wait."""

    def __init__(self, registry: WorkerRegistry, machine: ScaleMachine, clock: Clock):
        self.registry = registry
        self.machine = machine
        self.clock = clock
        self._first: tuple[float, p.WorkerError] | None = None  # the first report, while unexplained

    def note(self, report: p.WorkerError) -> None:
        with self.registry.lock:
            if self._first is None:
                self._first = (self.clock.monotonic(), report)

    def reason(self, *, busy: bool) -> str | None:
        """The reason to fail the machine with, once the wait is over (then the watch is reset)."""
        with self.registry.lock:
            if self._first is None:
                return None
            since, report = self._first
            record = self.registry.workers.get(report.pid)
            if (record is None or record.expected_exit or report.generation != self.machine.generation
                    or self.machine.state == Phase.FAILED):
                self._first = None  # superseded: retired, recovered, or already failed
                return None
            # a culprit stuck inside its step is reported for by its step watch up to WATCH_MARGIN_S
            # past the collective timeout its victims waited out: it falls silent that much later
            wait = self.registry.timeouts.heartbeat + WATCH_MARGIN_S + 0.5
            if busy or self.clock.monotonic() - since < wait:
                return None
            self._first = None
        return f"rank {report.rank} group broken, no worker lost: {report.error_type}: {report.message}"


def eplb_health(eplb: list[dict[str, Any]]) -> dict[str, Any]:
    """The async EPLB's health over the ranks: degraded when any rank's is, with its last error."""
    degraded = [e for e in eplb if e.get("health") == "degraded"]
    last = next((e.get("last_error") for e in degraded or eplb if e.get("last_error")), None)
    return {"status": "degraded" if degraded else "healthy", "last_error": last,
            "restarts": max((e.get("restarts", 0) for e in eplb), default=0),
            "rebalances_failed": max((e.get("rebalances_failed", 0) for e in eplb), default=0)}


def snapshot_of(machine: ScaleMachine, registry: WorkerRegistry, layout: GroupLayout, current: Operation | None,
                output_check: dict[str, Any], requests: dict[str, Any] | None) -> dict[str, Any]:
    """State, generation, size, balancedness, in-flight layer, per-rank status, history tail.
    Caller holds the registry's lock."""
    live = registry.live_workers()
    beats = [w.heartbeat for w in live if w.heartbeat is not None]
    eplb = [b.eplb.as_dict() for b in beats if b.eplb is not None]  # busy and waiting heartbeats carry none
    return {
        "state": machine.state.value,
        "generation": machine.generation,
        "ep_size": layout.size,
        "num_physical": layout.num_physical,
        "serving": registry.serving(),
        "balancedness": min((b.balancedness for b in beats), default=None),
        "step": min((b.step for b in beats), default=0),
        "in_flight_layer": next((b.in_flight_layer for b in beats if b.in_flight_layer is not None), None),
        "operation": current.to_dict() if current is not None else None,
        "failure_reason": machine.failure_reason,
        "eplb_health": eplb_health(eplb),
        # every rank records the same all-reduced counts: any rank's summary of its last step
        "eplb_layer_balancedness": next((e["layer_balancedness"] for e in eplb if e.get("layer_balancedness")), None),
        "output_check": dict(output_check),
        "ranks": [_rank(w) for w in live],
        "rebalances": max((e.get("rebalances_finished", 0) for e in eplb), default=0),
        "layers_committed": max((e.get("layers_committed", 0) for e in eplb), default=0),
        "bytes_moved": sum(e.get("bytes_moved", 0) for e in eplb),
        "watchdog_stalls": sum(e.get("watchdog_stalls", 0) for e in eplb),
        "history": [t.to_dict() for t in machine.history()[-20:]],
        "requests": requests,
    }


def _rank(w: Any) -> dict[str, Any]:
    beat = w.heartbeat
    return {"rank": w.rank, "pid": w.pid, "generation": w.generation, "step": beat.step if beat else 0,
            "state": str(beat.state) if beat else p.WorkerMode.STARTING.value,
            "requests": beat.requests if beat else 0,
            "idle": bool(beat.idle) if beat else False,  # the group is idle: this rank sleeps on its inbox
            "progress": list(beat.progress) if beat and beat.progress else None}
