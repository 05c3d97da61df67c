"""Replaying a scenario on real worker processes, recording what happened, checking expectations.

:func:`replay` is the Python API; ``elastic-ep replay`` (``elastic/cli.py``) wraps it with a
progress bar and the end-of-run tables. The replayer drives the timeline through the public
coordinator API (``scale``, ``recover``, ``rebalance``, ``verify``, ``snapshot``) and records
everything from the coordinator's subscription: worker heartbeats become per-step samples
(balancedness of that step's global tokens, step time), transitions and operations become the
timeline, worker events become the rebalances. :mod:`elastic.replay.report` turns the recording into
``report.json``, ``report.png`` and the tables.
"""

from __future__ import annotations

import asyncio
import logging
import os
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from elastic.core.clock import Clock, RealClock
from elastic.core.errors import ElasticError
from elastic.core.phases import Phase as P
from elastic.faults import fires_once
from elastic.replay.scenario import (
    FAULT_EVENTS,
    AutoscalerEvent,
    KillEvent,
    RebalanceEvent,
    RecoverEvent,
    ScaleEvent,
    Scenario,
    StallEvent,
    load_scenario,
)

__all__ = ["ReplayResult", "Recorder", "Replayer", "replay"]

log = logging.getLogger("elastic.replay.runner")


# ---------------------------------------------------------------------------------------------
# recording

class Recorder:
    """Subscriber of the coordinator: files heartbeats, transitions, operations and worker events.

    Called on the coordinator's threads, so every method is quick and takes one lock. Times are
    the control plane's clock (the state machine's), reported relative to ``t0``.
    """

    def __init__(self, t0: float, on_transition: Callable[[dict[str, Any]], None] | None = None,
                 on_worker_error: Callable[[dict[str, Any]], None] | None = None, clock: Clock | None = None):
        self.t0 = t0
        self.clock = clock or RealClock()
        self.on_worker_error = on_worker_error
        self.lock = threading.Lock()
        self.coordinator: Any = None
        self.steps: dict[int, dict[str, Any]] = {}
        self.max_step = 0
        self.last_balancedness: float | None = None
        self.transitions: list[dict[str, Any]] = []
        self.operations: dict[str, dict[str, Any]] = {}
        self.worker_events: list[dict[str, Any]] = []
        self.worker_errors: list[dict[str, Any]] = []
        self.open_rebalance: set[int] = set()  # ranks with a rebalance in flight
        self.on_transition = on_transition

    def attach(self, coordinator: Any) -> None:
        self.coordinator = coordinator
        coordinator.subscribe(self)

    def __call__(self, kind: str, data: dict[str, Any]) -> None:
        now = self.clock.monotonic()
        if kind == "heartbeat":
            self._heartbeat(now, data)
        elif kind == "transition":
            with self.lock:
                entry = {**data, "t": data["at"] - self.t0, "step": self.max_step}
                self.transitions.append(entry)
                if data["dest"] in (P.RESCALING, P.FAILED):
                    self.open_rebalance.clear()  # nothing from the old group's EPLB survives
            if self.on_transition is not None:
                self.on_transition(entry)
        elif kind == "operation":
            with self.lock:
                self.operations[data["id"]] = dict(data)
        elif kind == "worker_event":
            with self.lock:
                self.worker_events.append({**data, "t": now - self.t0, "at": now})
                if data.get("kind") == "rebalance_started":
                    self.open_rebalance.add(data["rank"])
                elif data.get("kind") in ("rebalance_finished", "rebalance_failed"):
                    self.open_rebalance.discard(data["rank"])
        elif kind == "worker_error":
            entry = {**data, "t": now - self.t0}
            with self.lock:
                self.worker_errors.append(entry)
            if self.on_worker_error is not None:
                self.on_worker_error(entry)

    def _heartbeat(self, now: float, beat: dict[str, Any]) -> None:
        step = int(beat["step"])
        if step <= 0 or beat.get("state") == "broken":
            return
        coordinator = self.coordinator
        state = coordinator.machine.state.value if coordinator is not None else P.RUNNING
        size = coordinator.size if coordinator is not None else None
        with self.lock:
            sample = self.steps.get(step)
            if sample is None:
                self.steps[step] = {"step": step, "time": now - self.t0, "balancedness": float(beat["balancedness"]),
                                    "step_time": float(beat["step_seconds"]), "state": state, "ep_size": size,
                                    "ranks": 1, "generation": beat["generation"]}
            else:
                sample["step_time"] = max(sample["step_time"], float(beat["step_seconds"]))
                sample["ranks"] += 1
            self.max_step = max(self.max_step, step)
            self.last_balancedness = float(beat["balancedness"])

    # -- reads --------------------------------------------------------------------------------
    def samples(self) -> list[dict[str, Any]]:
        with self.lock:
            return [dict(self.steps[k]) for k in sorted(self.steps)]

    def rebalance_in_flight(self, ranks: int = 1) -> bool:
        """Whether at least ``ranks`` ranks have a rebalance started and not finished."""
        with self.lock:
            return len(self.open_rebalance) >= max(1, ranks)


# ---------------------------------------------------------------------------------------------
# result

@dataclass
class ReplayResult:
    scenario: Scenario
    report: dict[str, Any]
    report_dir: Path | None = None
    report_path: Path | None = None
    plot_path: Path | None = None
    source: str | None = None
    replayer: Replayer | None = field(default=None, repr=False)  # the run's coordinator, stopped, for inspection

    @property
    def expectations(self) -> list[dict[str, Any]]:
        return self.report["expectations"]

    @property
    def passed(self) -> bool:
        return all(e["passed"] for e in self.expectations)

    @property
    def failed(self) -> list[dict[str, Any]]:
        return [e for e in self.expectations if not e["passed"]]

    @property
    def final(self) -> dict[str, Any]:
        return self.report["final"]

    @property
    def duration_s(self) -> float:
        return self.report["duration_s"]


# ---------------------------------------------------------------------------------------------
# the replayer

@dataclass
class _Outcome:
    ok: bool
    detail: str = ""
    extra: dict[str, Any] = field(default_factory=dict)


class Replayer:
    """Runs one scenario: start the coordinator, play the timeline, verify, stop, report."""

    def __init__(self, scenario: Scenario, *, on_transition: Callable[[dict[str, Any]], None] | None = None,
                 on_event: Callable[[dict[str, Any]], None] | None = None,
                 on_progress: Callable[[dict[str, Any]], None] | None = None,
                 on_worker_error: Callable[[dict[str, Any]], None] | None = None, clock: Clock | None = None):
        self.scenario = scenario
        self.on_event = on_event
        self.on_progress = on_progress
        self.clock = clock or RealClock()  # the coordinator it starts reads the same one
        self.t0 = self.clock.monotonic()
        self.recorder = Recorder(self.t0, on_transition=on_transition, on_worker_error=on_worker_error,
                                 clock=self.clock)
        self.coordinator: Any = None
        self.events: list[dict[str, Any]] = []
        self.verifications: list[dict[str, Any]] = []
        self.errors: list[str] = []
        self.autoscaler: Any = None
        self.traffic: TrafficRun | None = None
        self._deadline = self.t0 + scenario.run_timeout_s
        self._stop_progress = threading.Event()
        self._verified_ops: set[str] = set()
        self._claimed: set[int] = set()  # seq of the failures a timeline fault was found to have caused
        self.fired: dict[Any, Any] | None = None  # Coordinator.fired_faults() at the end (or {"error": ...})

    # -- helpers ------------------------------------------------------------------------------
    def _now(self) -> float:
        return self.clock.monotonic() - self.t0

    def _snapshot(self) -> dict[str, Any]:
        return self.coordinator.snapshot()

    def _state(self) -> str:
        return self.coordinator.machine.state.value

    def _op_running(self) -> bool:
        op = self._snapshot().get("operation")
        return op is not None and op["status"] in ("pending", "running")

    def _progress_loop(self) -> None:
        while not self._stop_progress.wait(0.1):
            if self.on_progress is None or self.coordinator is None:
                continue
            try:
                snap = self._snapshot()
            except Exception:  # noqa: BLE001 - a display never breaks the run
                continue
            self.on_progress({"step": max(snap["step"], 0), "total": self.scenario.steps, "state": snap["state"],
                              "ep_size": snap["ep_size"], "generation": snap["generation"],
                              "balancedness": self.recorder.last_balancedness, "rebalances": snap["rebalances"]})

    def _phase_budget(self) -> float:
        t = self.scenario.deployment.timeouts
        return t.draining + t.suppressed + t.rescaling + t.resuming + t.worker_start + 5.0

    def _wait_until(self, predicate: Callable[[], bool], timeout: float, poll: float = 0.02) -> bool:
        deadline = min(self.clock.monotonic() + timeout, self._deadline)
        while self.clock.monotonic() < deadline:
            if predicate():
                return True
            self.clock.sleep(poll)
        return predicate()

    def _verify_unplanned(self, snap: dict[str, Any]) -> None:
        """Verify after every operation the timeline did not start (the autoscaler's, an auto-recovery)."""
        op = snap.get("operation")
        if op is None or op["status"] != "succeeded" or op["id"] in self._verified_ops or snap["state"] != P.RUNNING:
            return
        self._verified_ops.add(op["id"])
        if op["id"] in {e.get("operation_id") for e in self.events}:
            return
        after = f"{op['kind']} {op['from_size']} -> {op['target_size']} ({op['id']})"
        generation = snap["generation"]
        due = self._fault_due(generation)
        if due is not None:  # the group is about to lose a rank to the timeline: its recovery is verified
            self.verifications.append({"after": after, "t": self._now(), "step": snap["step"], "ok": False, "ranks": {},
                                       "excused": f"skipped, {due} is due in this generation"})
            return
        entry = self._verify(after=after)
        due = self._fault_due(generation) if not entry["ok"] else None
        if due is not None:  # e.g. replace_lost's scale back, verified as the timeline's next kill fires
            entry["excused"] = f"{due} broke the group while it ran ({entry.get('error', 'not ok')})"

    def _wait_step(self, step: int) -> str:
        """Until the slowest rank passed ``step``: "ok", "failed" (stuck in failed) or "timeout"."""
        failed_since: float | None = None
        while self.clock.monotonic() < self._deadline:
            snap = self._snapshot()
            self._verify_unplanned(snap)
            stuck = snap["state"] == P.FAILED and not self._op_running()
            failed_since = (failed_since or self.clock.monotonic()) if stuck else None
            if failed_since is not None and (not self._recovering() or self.clock.monotonic() - failed_since > 10.0):
                return "failed"  # nothing is going to recover it (auto-recovery gave up or was refused)
            if snap["step"] >= step and snap["state"] != P.FAILED:
                return "ok"
            self.clock.sleep(0.02)
        return "timeout"

    def _recovering(self) -> bool:
        """Whether a failure will be recovered without the timeline (auto_recover)."""
        if not self.scenario.deployment.auto_recover:
            return False
        if "auto_recover" in type(self.coordinator.config).model_fields:
            return True
        # a coordinator without auto-recovery: the replayer recovers for it
        if self._state() == P.FAILED and not self._op_running():
            self._recover_now(auto=True)
        return True

    def _verify(self, after: str) -> dict[str, Any]:
        entry: dict[str, Any] = {"after": after, "t": self._now(), "step": self._snapshot()["step"]}
        try:
            ranks = self.coordinator.verify(timeout=max(30.0, self.scenario.deployment.timeouts.collective))
        except Exception as exc:  # noqa: BLE001 - a verification that cannot run is a failed one
            entry.update(ok=False, error=f"{type(exc).__name__}: {exc}", ranks={})
        else:
            ranks = {int(r): {"mismatched": [list(x) for x in v["mismatched"]], "digest": v["digest"],
                              "replica_min": v["replica_min"], "num_physical": v["num_physical"],
                              "size": v["size"], "generation": v["generation"], "step": v["step"]}
                     for r, v in sorted(ranks.items())}
            size = self.coordinator.size
            digests = {v["digest"] for v in ranks.values()}
            entry.update(
                ranks=ranks, ep_size=size,
                mismatched=sum(len(v["mismatched"]) for v in ranks.values()),
                replica_min=min((v["replica_min"] for v in ranks.values()), default=0),
                digests_agree=len(digests) == 1, all_ranks=sorted(ranks) == list(range(size)),
            )
            entry["ok"] = entry["mismatched"] == 0 and entry["digests_agree"] and entry["all_ranks"] \
                and entry["replica_min"] >= 1
            if self.coordinator.output_check["enabled"]:  # a real model: its output must not have changed
                try:
                    probe = self.coordinator.probe(timeout=max(30.0, self.scenario.deployment.timeouts.collective))
                except Exception as exc:  # noqa: BLE001 - a probe that cannot run is a failed one
                    entry.update(output_identical=False, output_error=f"{type(exc).__name__}: {exc}")
                else:
                    entry.update(output_identical=probe["identical"], output_digests=probe["digests"],
                                 reference_digest=probe["reference"])
                entry["ok"] = entry["ok"] and entry["output_identical"]
        self.verifications.append(entry)
        return entry

    # -- events -------------------------------------------------------------------------------
    def _record_op(self, op: Any) -> dict[str, Any]:
        d = op.to_dict()
        return {"operation_id": d["id"], "operation_status": d["status"], "error": d["error"],
                "paused_seconds": d["paused_seconds"], "from_size": d["from_size"], "target_size": d["target_size"]}

    def _scale(self, event: ScaleEvent, kill: KillEvent | None = None) -> _Outcome:
        extra: dict[str, Any] = {}
        started = self._now()
        if event.wait_for_transfer:
            # every rank of the group has the rebalance open: a layer is on its way everywhere
            # (and a layer is really moving: a rebalance that changes no layer opens and closes at once)
            waited = self._wait_until(lambda: self.recorder.rebalance_in_flight(self.coordinator.size)
                                      and self._snapshot()["in_flight_layer"] is not None,
                                      event.transfer_wait_s, poll=0.005)
            extra["waited_for_transfer"] = waited
        extra["transfer_in_flight"] = self.recorder.rebalance_in_flight() or self._snapshot()["in_flight_layer"] is not None
        try:
            op = self.coordinator.scale(event.to, wait=True, timeout=self._phase_budget())
        except ElasticError as exc:
            return _Outcome(False, f"refused: {exc}", extra)
        extra.update(self._record_op(op))
        if kill is not None:  # the timeline armed a kill in one of this scale's phases
            out = self._kill(kill, started, what=f"rank {kill.rank} was to die in {kill.in_phase}")
            out.extra.update(extra)
            out.detail = f"scale to {event.to} {op.status.value}; {out.detail}"
            return out
        if op.status.value == "noop":
            return _Outcome(True, f"already at {event.to} ranks", extra)
        if op.status.value != "succeeded":
            return _Outcome(False, f"scale to {event.to} {op.status.value}: {op.error}", extra)
        self._verified_ops.add(op.id)
        generation = self.coordinator.machine.generation
        due = self._fault_due(generation)
        if due is None:
            entry = self._verify(after=f"scale to {event.to} ({op.id})")
            due = self._fault_due(generation) if not entry["ok"] else None
            if due is not None:  # the planned fault fired while it ran: the recovery's verification covers it
                self.verifications.remove(entry)
                extra["verification"] = f"dropped: {due} fired while it ran ({entry.get('error', 'not ok')})"
        else:  # the new generation is about to lose a rank: the recovery's verification covers it
            extra["verification"] = f"skipped: {due} is already due in this generation"
        return _Outcome(True, f"{op.from_size} -> {op.target_size} ranks, paused {1000 * (op.paused_seconds or 0):.0f} ms", extra)

    def _fault_due(self, generation: int) -> str | None:
        """A step-pinned fault of the timeline, not played yet, that ``generation`` fires at once (its
        step has passed while an operation or a verification ran): a verification of it races the
        fault. A fault the timeline pinned to its predicted generation fires in that one or a later
        one (a recovery or a failed attempt can take more generations than the plan predicts)."""
        s, snap = self.scenario, self._snapshot()
        played = {e["index"] for e in self.events}
        fired = self._fired_now()
        record = len(s.faults) - 1  # the event's position in the workers' faults (Scenario.fault_records)
        for index, (event, planned) in enumerate(zip(s.timeline, s.planned())):
            record += isinstance(event, FAULT_EVENTS)
            if index in played or not isinstance(event, FAULT_EVENTS) or getattr(event, "in_phase", None) is not None \
                    or event.at_step > snap["step"] or event.rank >= snap["ep_size"]:
                continue
            if fired.get(record) is not None and fired[record] != generation:
                continue  # it fired already, in an earlier generation (the event being played, say): not again
            if (event.generation == generation) if event.generation is not None else planned["generation"] <= generation:
                return f"{event.label()} at step {event.at_step}"
        return None

    def _recover_now(self, auto: bool = False) -> _Outcome:
        try:
            op = self.coordinator.recover(wait=True, timeout=self._phase_budget())
        except ElasticError as exc:
            return _Outcome(False, f"refused: {exc}")
        extra = self._record_op(op)
        if op.status.value != "succeeded":
            return _Outcome(False, f"recovery {op.status.value}: {op.error}", extra)
        self._verified_ops.add(op.id)
        self._verify(after=f"{'auto-' if auto else ''}recover ({op.id})")
        return _Outcome(True, f"recovered with {op.target_size} ranks", extra)

    def _failure_budget(self) -> float:
        t = self.scenario.deployment.timeouts
        return t.heartbeat + t.collective + 10.0

    def _below_step_until(self, step: int) -> float:
        """The last time a heartbeat showed the group below ``step`` (0 if none did): a fault at
        ``step`` cannot have fired before. Bounding it from below, not from when ``step`` was first
        reported, holds whatever the heartbeats lag: a rank killed at its step sends no heartbeat of
        it, and its peers' last ones may be a few steps older."""
        with self.recorder.lock:
            times = [sample["time"] for k, sample in self.recorder.steps.items() if k < step]
        return max(times, default=0.0)

    def _claim_failure(self, since: float) -> dict[str, Any] | None:
        """The first failure at or after ``since`` that no timeline fault has claimed yet, now claimed.

        Failures are matched to faults in order, by time: a fault that landed inside an earlier
        operation (a scale that failed and was recovered before this event was played) still finds
        the failure it caused, rather than waiting for a new one."""
        with self.recorder.lock:
            for t in self.recorder.transitions:
                if t["dest"] == P.FAILED and t["seq"] not in self._claimed and t["t"] >= since:
                    self._claimed.add(t["seq"])
                    return dict(t)
        return None

    def _kill(self, event: Any, since: float, what: str) -> _Outcome:
        """A fault that loses a rank (kill, long stall, dropped heartbeats): find the failure it caused
        (``since``: a time before it could have fired), then the recovery."""
        found: list[dict[str, Any]] = []

        def failed() -> bool:
            if not found:
                failure = self._claim_failure(since)
                if failure is not None:
                    found.append(failure)
            return bool(found)

        # an operation running now (the autoscaler's, a recovery) may hold the generation the fault fires in
        budget = self._failure_budget() + (self._phase_budget() if self._op_running() else 0.0)
        if not self._wait_until(failed, budget):
            return _Outcome(False, f"{what} but the deployment did not fail")
        failure = found[0]
        extra: dict[str, Any] = {"failure": {"t": failure["t"], "step": failure["step"], "seq": failure["seq"],
                                             "reason": failure["reason"], "in_phase": failure["source"],
                                             "operation_id": failure["operation_id"]}}
        reason = failure["reason"]
        during = self._absorbed_by(failure, event)
        if during:
            extra["failure"]["during"] = during
            reason = f"{reason}; {during}"
        if self.scenario.deployment.auto_recover:
            self._recovering()
            recovered = self._wait_until(lambda: self._state() == P.RUNNING and not self._op_running(), self._phase_budget())
            if not recovered:
                return _Outcome(False, f"failed ({reason}) and did not recover by itself", extra)
            self._await_replacement()
            self._verify_unplanned(self._snapshot())
            return _Outcome(True, f"failed ({reason}); recovered by itself", extra)
        return _Outcome(True, f"failed: {reason}", extra)

    def _absorbed_by(self, failure: dict[str, Any], fault: Any) -> str:
        """If ``failure`` happened inside an operation, which one (and the timeline's event for it,
        which is told why it failed): "" when the deployment was running."""
        op_id = failure.get("operation_id")
        if failure["source"] == P.RUNNING or op_id is None:
            return ""
        with self.recorder.lock:
            op = dict(self.recorder.operations.get(op_id) or {})
        what = f"{op.get('kind', 'operation')} {op.get('from_size')} -> {op.get('target_size')}" if op else "an operation"
        text = f"the rank was lost during the {what} ({op_id}, in {failure['source']}), which failed"
        for entry in self.events:
            if entry.get("operation_id") == op_id and entry.get("ok") is False:
                # the timeline's own fault landed inside it: the scale did fail, for the reason the scenario gave
                entry.update(ok=True, status="done", absorbed_fault=fault.label(),
                             detail=f"{entry.get('detail', '')}; it absorbed the timeline's {fault.label()} "
                                    f"(at step {fault.at_step}), which failed it (see that event)")
        return text

    def _await_replacement(self) -> None:
        """``replace_lost``: a recovery that shrank the group is followed by a scale back; the
        verification waits for it (one started in between would refuse the probe)."""
        if not self.scenario.deployment.replace_lost:
            return
        recovery = next((o for o in self.coordinator.list_operations() if o["kind"] == "recover"), None)
        if recovery is None or recovery["status"] != "succeeded" or recovery["target_size"] >= recovery["from_size"]:
            return
        self._wait_until(lambda: self._state() == P.RUNNING and not self._op_running()
                         and self.coordinator.size >= recovery["from_size"], self._phase_budget())

    def _rebalance(self, event: RebalanceEvent) -> _Outcome:
        try:
            started = self.coordinator.rebalance()
        except ElasticError as exc:
            return _Outcome(False, f"refused: {exc}")
        return _Outcome(bool(started), "started" if started else "did not start (draining or suppressed)")

    def _autoscaler(self, event: AutoscalerEvent) -> _Outcome:
        if self.autoscaler is None:
            return _Outcome(False, "the scenario has no autoscaler: section")
        if event.enabled:
            self.autoscaler.enable()
        else:
            self.autoscaler.disable()
        return _Outcome(True, f"autoscaler {'on' if event.enabled else 'off'} "
                        f"({self.autoscaler.config.metric}, {self.autoscaler.min_size}..{self.autoscaler.max_size} ranks)")

    def _play(self) -> None:
        s = self.scenario
        plan = s.planned()
        for index, event in enumerate(s.timeline):
            entry: dict[str, Any] = {"index": index, "action": event.action, "label": event.label(), "at_step": event.at_step,
                     "event": event.model_dump(), "planned": plan[index]}
            if isinstance(event, RecoverEvent):
                reached = "ok" if self._wait_until(lambda: self._state() == P.FAILED, self._failure_budget()) else "timeout"
            elif isinstance(event, KillEvent) and event.in_phase is not None:
                reached = self._wait_step(event.at_step)  # armed: it fires in the next scale
            elif isinstance(event, FAULT_EVENTS):
                reached = self._wait_step(event.at_step)
                reached = "ok" if reached in ("ok", "failed") else reached
            else:
                reached = self._wait_step(event.at_step)
                if reached == "ok" and not self._wait_until(lambda: not self._op_running(), self._phase_budget()):
                    reached = "timeout"
            entry.update(t=self._now(), step=self._snapshot()["step"], state_before=self._state())
            if reached != "ok":
                why = {"failed": f"the deployment is failed ({self.coordinator.machine.failure_reason})",
                       "timeout": "the run deadline passed or the state never allowed it"}[reached]
                entry.update(status="skipped", ok=False, detail=f"not run: {why}")
            else:
                if isinstance(event, ScaleEvent):
                    armed = plan[index].get("phase_kill")
                    out = self._scale(event, kill=None if armed is None else s.timeline[armed])
                elif isinstance(event, KillEvent) and event.in_phase is not None:
                    out = _Outcome(True, f"armed: rank {event.rank} dies in the {event.in_phase} phase of the next scale"
                                   f" (generation {plan[index]['generation']})")
                elif isinstance(event, FAULT_EVENTS) and plan[index].get("loses_rank", True):
                    generation = (f"generation {event.generation}" if event.generation is not None
                                  else f"generation {plan[index]['generation']} or later")
                    out = self._kill(event, self._below_step_until(event.at_step),
                                     what=f"{event.label()} at step {event.at_step} ({generation}) was to lose the rank")
                elif isinstance(event, StallEvent):
                    out = _Outcome(True, f"a {event.seconds:g}s stall, shorter than the deadlines: no failure expected")
                elif isinstance(event, RecoverEvent):
                    out = self._recover_now()
                elif isinstance(event, RebalanceEvent):
                    out = self._rebalance(event)
                else:
                    assert isinstance(event, AutoscalerEvent)  # only a stall may keep its rank (loses_rank False)
                    out = self._autoscaler(event)
                entry.update(status="done" if out.ok else "failed", ok=out.ok, detail=out.detail, **out.extra)
            entry["t_end"] = self._now()
            self.events.append(entry)
            if self.on_event is not None:
                self.on_event(entry)

    # -- the run ------------------------------------------------------------------------------
    def run(self) -> dict[str, Any]:
        from elastic.control.coordinator import Coordinator
        from elastic.replay.report import build_report

        os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
        s = self.scenario
        started_wall = self.clock.wall()
        self.coordinator = Coordinator(s.deployment_config(), faults=s.fault_records(), clock=self.clock)
        self.recorder.attach(self.coordinator)
        progress = threading.Thread(target=self._progress_loop, name="replay-progress", daemon=True)
        final: dict[str, Any] = {}
        try:
            self.coordinator.start()
            if s.autoscaler is not None:
                from elastic.service.autoscaler import Autoscaler

                self.autoscaler = Autoscaler(self.coordinator, s.autoscaler).start()
            progress.start()
            if s.traffic is not None:
                self.traffic = TrafficRun(self.coordinator, s).start()
            self._play()
            end = self._wait_step(s.steps)
            if end == "timeout":
                self.errors.append(f"the run did not reach step {s.steps} within run_timeout_s={s.run_timeout_s}")
            self._wait_until(lambda: not self._op_running(), self._phase_budget())
            if self.traffic is not None:
                self.traffic.stop(timeout=self._phase_budget())
            if self._state() != P.FAILED:
                self._verify(after="end of run")
            final = self._final()
            self._read_fired_faults()
            if self.on_progress is not None:
                self.on_progress({"step": final["step"], "total": s.steps, "state": final["state"],
                                  "ep_size": final["ep_size"], "generation": final["generation"],
                                  "balancedness": self.recorder.last_balancedness, "rebalances": final["rebalances"]})
        except Exception as exc:  # noqa: BLE001 - a crashed replay still reports what it saw
            log.exception("replay crashed")
            self.errors.append(f"{type(exc).__name__}: {exc}")
            if self.coordinator is not None and not final:
                try:
                    final = self._final()
                except Exception:  # noqa: BLE001
                    final = {}
            if self.coordinator is not None and self.fired is None:
                self._read_fired_faults()
        finally:
            self._stop_progress.set()
            if self.autoscaler is not None:
                self.autoscaler.stop()
            if self.traffic is not None:
                self.traffic.close()
            if self.coordinator is not None:
                self.coordinator.shutdown()
        report = build_report(self, final=final, started_wall=started_wall, duration_s=self.clock.monotonic() - self.t0)
        report["faults_fired"] = self.fired
        _fault_expectations(s, report)
        if self.traffic is not None:
            _traffic_expectations(s, report, self.traffic)
        return report

    def _fired_now(self) -> dict[int, int | None]:
        """``Coordinator.fired_faults()`` now; {} if it cannot be read (every fault counts as not fired)."""
        try:
            return dict(self.coordinator.fired_faults())
        except Exception:  # noqa: BLE001 - a fake or stopped coordinator: no binding is known
            return {}

    def _read_fired_faults(self) -> None:
        """Which of the scenario's once-faults fired (``Coordinator.fired_faults``), while its store lives."""
        try:
            self.fired = self.coordinator.fired_faults()
        except Exception as exc:  # noqa: BLE001 - reported as not known, never a crash of the replay
            self.fired = {"error": f"{type(exc).__name__}: {exc}"}

    def _final(self) -> dict[str, Any]:
        snap = self._snapshot()
        return {"state": snap["state"], "ep_size": snap["ep_size"], "generation": snap["generation"],
                "step": snap["step"], "num_physical": snap["num_physical"], "failure_reason": snap["failure_reason"],
                "rebalances": snap["rebalances"], "layers_committed": snap["layers_committed"],
                "bytes_moved": snap["bytes_moved"], "watchdog_stalls": snap["watchdog_stalls"],
                "history": [t.to_dict() for t in self.coordinator.machine.history()]}


class TrafficRun:
    """A scenario's traffic: the HTTP app over the replay's coordinator and the load generator's
    client on its own thread, until :meth:`stop`; then the summary and the per-request check."""

    def __init__(self, coordinator: Any, scenario: Scenario):
        self.coordinator = coordinator
        self.scenario = scenario
        self._stop = threading.Event()
        self._result: dict[str, Any] = {}
        self.summary: dict[str, Any] | None = None
        self.error: str | None = None

    def start(self) -> TrafficRun:
        from elastic.service.api import create_app
        from elastic.service.loadgen import LoadConfig, run_load
        from elastic.service.server import BackgroundServer

        assert self.scenario.traffic is not None  # built only for a scenario with traffic
        t = self.scenario.traffic
        self.server = BackgroundServer(create_app(self.coordinator)).start()
        config = LoadConfig(url=self.server.url, rate=t.rate, concurrency=t.concurrency, duration_s=self.scenario.run_timeout_s,
                            prompt_len=t.prompt_len, max_tokens=t.max_tokens, seed=t.seed)

        def run() -> None:
            try:
                self._result["out"] = asyncio.run(run_load(config, self._stop))
            except Exception as exc:  # noqa: BLE001 - reported as the traffic's error
                self.error = f"{type(exc).__name__}: {exc}"

        self.thread = threading.Thread(target=run, name="replay-traffic", daemon=True)
        self.thread.start()
        return self

    def stop(self, timeout: float) -> None:
        """No new request; the ones in flight finish (bounded); then summarize and check the tokens."""
        from elastic.service.loadgen import check_tokens, summarize

        self._stop.set()
        self.thread.join(timeout)
        if self.thread.is_alive():
            self.error = f"requests still in flight {timeout:.0f}s after the run ended"
            return
        if "out" not in self._result:
            return
        records, timeline, started, ended = self._result["out"]
        self.summary = summarize(records, timeline, started, ended)
        if self.scenario.expect.identical_output:
            self.summary["check"] = check_tokens(records, self.scenario.deployment.model)

    def close(self) -> None:
        self._stop.set()
        self.server.stop()


def _traffic_expectations(s: Scenario, report: dict[str, Any], traffic: TrafficRun) -> None:
    """The request expectations (``no_failed_requests``, and ``identical_output`` per request)."""
    x = s.expect
    out = report["expectations"]
    summary = traffic.summary or {}
    report["traffic"] = {**summary, "error": traffic.error}
    if x.no_failed_requests:
        ok = traffic.error is None and bool(summary) and summary["failed"] == 0 and summary["requests"] > 0
        out.append({"name": "no_failed_requests", "expected": 0, "measured": summary.get("failed", traffic.error),
                    "passed": ok, "detail": traffic.error or (f"{summary['ok']}/{summary['requests']} ok, "
                                                             f"{summary['retried']} retried, {summary['replayed']} replayed; "
                                                             + "; ".join(summary.get("errors", [])))})
    if x.identical_output:
        check = summary.get("check") or {"checked": 0, "identical": 0, "mismatched": []}
        out.append({"name": "identical_output (requests)", "expected": "every request",
                    "measured": f"{check['identical']}/{check['checked']}",
                    "passed": traffic.error is None and check["checked"] > 0 and not check["mismatched"],
                    "detail": f"mismatched requests: {check['mismatched'][:10]}" if check["mismatched"] else
                              "every request's tokens equal the unsharded model's greedy output"})
    report["passed"] = all(e["passed"] for e in out)


def _fault_expectations(s: Scenario, report: dict[str, Any]) -> None:
    """The fault expectations (``min_refused_layers``, ``min_failures``), added to the report's verdicts."""
    x = s.expect
    out = report["expectations"]
    if x.min_refused_layers is not None:
        refused = [e for e in report["worker_events"] if e.get("kind") == "rebalance_failed" and e.get("local")]
        detail = "; ".join(f"rank {e.get('rank')} refused layer {e.get('layer')}: {e.get('error')}" for e in refused)
        out.append({"name": "min_refused_layers", "expected": x.min_refused_layers, "measured": len(refused),
                    "passed": len(refused) >= x.min_refused_layers, "detail": detail or "no rank refused a layer"})
    if x.faults_fired:
        _faults_fired(s, report.get("faults_fired"), out)
    if x.min_failures is not None:
        fails = [t for t in report["transitions"] if t["dest"] == P.FAILED]
        out.append({"name": "min_failures", "expected": x.min_failures, "measured": len(fails),
                    "passed": len(fails) >= x.min_failures, "detail": "; ".join(str(t.get("reason")) for t in fails)})
    report["passed"] = all(e["passed"] for e in out)


def _fault_label(fault: Any) -> str:
    when = (f"at step {fault.at_step}" if getattr(fault, "at_step", None) is not None else
            f"in {fault.in_phase}" if getattr(fault, "in_phase", None) is not None else f"from step {fault.from_step}")
    return f"{fault.kind} rank {fault.rank} {when}"


def _faults_fired(s: Scenario, fired: dict[Any, Any] | None, out: list[dict[str, Any]]) -> None:
    """``faults_fired``: every kill, stall or drop_heartbeats of ``faults:`` without a generation fired
    (``fired``: ``Coordinator.fired_faults()``; the raw records come first in the workers' faults)."""
    tracked = [(i, fault) for i, fault in enumerate(s.faults) if fires_once(fault)]
    if not tracked:
        return
    if fired is None or "error" in fired:
        why = (fired or {}).get("error", "the run ended before it could be read")
        out.append({"name": "faults_fired", "expected": True, "measured": None, "passed": False,
                    "detail": f"not known which faults fired: {why}"})
        return
    missed = [(i, fault) for i, fault in tracked if fired.get(i) is None]
    detail = "; ".join(f"faults[{i}] ({_fault_label(fault)}) never fired: no rank {fault.rank} reached it in any "
                       f"generation from {fault.from_generation or 0} on" for i, fault in missed)
    out.append({"name": "faults_fired", "expected": True, "measured": f"{len(tracked) - len(missed)}/{len(tracked)} fired",
                "passed": not missed, "detail": detail or "; ".join(f"faults[{i}] fired in generation {fired[i]}"
                                                                     for i, _ in tracked)})


# ---------------------------------------------------------------------------------------------
# the API

def replay(scenario_path_or_model: str | Path | Scenario, report_dir: str | Path | None = None, progress: bool = False,
           *, source: str | None = None, on_transition: Callable[[dict[str, Any]], None] | None = None,
           on_event: Callable[[dict[str, Any]], None] | None = None,
           on_progress: Callable[[dict[str, Any]], None] | None = None,
           on_worker_error: Callable[[dict[str, Any]], None] | None = None) -> ReplayResult:
    """Replay a scenario on real worker processes; returns the report and whether every expectation held.

    ``scenario_path_or_model`` is a YAML file or a :class:`~elastic.replay.scenario.Scenario`; an invalid
    file raises :class:`~elastic.replay.scenario.ScenarioError` before anything starts. With
    ``report_dir`` the JSON report and the PNG plot are written there. ``progress=True`` prints
    the transitions and a progress bar to the terminal (the command's display); the ``on_*``
    callbacks receive the same information for a caller's own display; ``source`` names the
    file a given :class:`Scenario` came from, for the report.
    """
    from elastic.replay.report import plot_report, write_report

    if isinstance(scenario_path_or_model, Scenario):
        scenario = scenario_path_or_model
    else:
        source = str(scenario_path_or_model)
        scenario = load_scenario(scenario_path_or_model)
    display = None
    if progress and on_transition is None and on_progress is None:
        from elastic.replay.report import LiveDisplay

        display = LiveDisplay(scenario)
        on_transition, on_event, on_progress = display.transition, display.event, display.progress
        on_worker_error = display.worker_error
    replayer = Replayer(scenario, on_transition=on_transition, on_event=on_event, on_progress=on_progress,
                        on_worker_error=on_worker_error)
    if display is not None:
        with display:
            report = replayer.run()
    else:
        report = replayer.run()
    report["scenario"]["file"] = source
    result = ReplayResult(scenario=scenario, report=report, source=source, replayer=replayer)
    if report_dir is not None:
        result.report_dir = Path(report_dir)
        result.report_dir.mkdir(parents=True, exist_ok=True)
        result.report_path = write_report(report, result.report_dir / "report.json")
        result.plot_path = plot_report(report, result.report_dir / "report.png")
    return result
