"""The scale state machine: table invariants, refusals, history, deadlines, threads, subscribers."""

from __future__ import annotations

import inspect
import logging
import math
import pickle
import threading
from collections import deque

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from pydantic import ValidationError

from elastic.core.config import TimeoutsConfig
from elastic.core.errors import (
    ElasticError,
    InvalidRankMapping,
    InvalidScaleRequest,
    InvalidTransition,
    PhaseTimeout,
    ScaleConflict,
    ScaleNoop,
    StaleGeneration,
    WorkerLost,
)
from elastic.core.machine import (
    EDGES,
    TRIGGERS,
    Phase,
    ScaleMachine,
    Transition,
    allowed_triggers,
    reachable_from,
    transitions_of,
)


class FakeClock:
    def __init__(self, t: float = 100.0) -> None:
        self.t = t

    def __call__(self) -> float:
        return self.t

    def advance(self, dt: float) -> None:
        self.t += dt


# Valid keyword arguments for each trigger (a generation is filled in by `fire`).
def fire(m: ScaleMachine, trigger: str) -> Transition:
    if trigger == "request_scale":
        return m.request_scale(operation_id="op-1", reason="test")
    if trigger == "rescaled":
        return m.rescaled(generation=m.generation + 1)
    if trigger in ("fail", "recover"):
        return getattr(m, trigger)(reason=f"test {trigger}")
    return getattr(m, trigger)()


HAPPY_PATH = ["request_scale", "drained", "suppressed", "rescaled", "resumed"]


def path_to(target: Phase) -> list[str]:
    """Shortest trigger sequence from `running` to `target`, by BFS over the table."""
    prev: dict[Phase, tuple[Phase, str] | None] = {Phase.RUNNING: None}
    todo = deque([Phase.RUNNING])
    while todo:
        cur = todo.popleft()
        for e in EDGES:
            if e.source is cur and e.dest not in prev:
                prev[e.dest] = (cur, e.trigger)
                todo.append(e.dest)
    out: list[str] = []
    node = target
    while prev[node] is not None:
        node, trig = prev[node]  # type: ignore[misc]
        out.append(trig)
    return out[::-1]


def machine_in(state: Phase, clock: FakeClock | None = None, **kw) -> ScaleMachine:
    m = ScaleMachine(clock=clock or FakeClock(), **kw)
    for trig in path_to(state):
        fire(m, trig)
    assert m.state is state
    return m


# ---------------------------------------------------------------------------------- the table


def test_every_phase_is_in_the_table_and_reachable_from_running():
    in_table = {e.source for e in EDGES} | {e.dest for e in EDGES}
    assert in_table == set(Phase)
    assert reachable_from(Phase.RUNNING) == frozenset(Phase)


@pytest.mark.parametrize("state", list(Phase))
def test_every_state_reaches_running_or_failed(state):
    reach = reachable_from(state)
    assert Phase.RUNNING in reach or Phase.FAILED in reach
    # stronger: recovery goes through rescaling, so every state can get back to serving
    assert Phase.RUNNING in reach


def test_table_has_one_edge_per_trigger_and_source():
    keys = [(e.trigger, e.source) for e in EDGES]
    assert len(keys) == len(set(keys))
    assert all(isinstance(e.source, Phase) and isinstance(e.dest, Phase) for e in EDGES)


def test_fail_is_accepted_everywhere_but_failed():
    for p in Phase:
        assert ("fail" in allowed_triggers(p)) == (p is not Phase.FAILED)


def test_transitions_machine_has_exactly_the_table_edges():
    m = ScaleMachine(clock=FakeClock())
    assert transitions_of(m) == {(e.trigger, e.source, e.dest) for e in EDGES}


def test_no_auto_transitions_exist():
    m = ScaleMachine(clock=FakeClock())
    for obj in (m, m._model):
        assert not [a for a in dir(obj) if a.startswith("to_")]
    assert m._machine.auto_transitions is False
    assert m._machine.ignore_invalid_triggers is False
    assert "suppressed" in TRIGGERS  # same name as a state: transitions binds both (is_suppressed, suppressed)
    assert m._model.is_suppressed() is False


def test_facade_has_one_keyword_only_method_per_trigger():
    for trig in TRIGGERS:
        method = getattr(ScaleMachine, trig)
        params = list(inspect.signature(method).parameters.values())[1:]
        assert all(p.kind is inspect.Parameter.KEYWORD_ONLY for p in params), trig
        assert method.__doc__, trig


@pytest.mark.parametrize("edge", EDGES, ids=lambda e: f"{e.trigger}:{e.source}")
def test_every_table_edge_is_accepted(edge):
    m = machine_in(edge.source)
    rec = fire(m, edge.trigger)
    assert m.state is edge.dest
    assert (rec.source, rec.dest, rec.trigger) == (edge.source, edge.dest, edge.trigger)


@pytest.mark.parametrize("state", list(Phase))
def test_every_invalid_trigger_is_refused_and_changes_nothing(state):
    invalid = [t for t in TRIGGERS if t not in allowed_triggers(state)]
    assert invalid
    for trig in invalid:
        m = machine_in(state)
        before = (m.state, m.history(), m.generation, m.operation_id, m.entered_at, m.failure_reason)
        with pytest.raises(InvalidTransition) as info:
            fire(m, trig)
        err = info.value
        assert err.state == state.value and err.trigger == trig
        assert err.allowed == tuple(sorted(allowed_triggers(state)))
        assert trig in str(err) and state.value in str(err)
        assert (m.state, m.history(), m.generation, m.operation_id, m.entered_at, m.failure_reason) == before


def test_request_scale_while_busy_is_a_conflict_naming_the_operation():
    m = machine_in(Phase.DRAINING)
    with pytest.raises(ScaleConflict) as info:
        m.request_scale(operation_id="op-2")
    assert info.value.operation_id == "op-1"
    assert info.value.to_dict()["error"] == "scale_conflict"
    m = machine_in(Phase.FAILED)
    with pytest.raises(ScaleConflict, match="recover first"):
        m.request_scale(operation_id="op-2")


@pytest.mark.parametrize(
    "call",
    [
        lambda m: m.request_scale(operation_id=""),
        lambda m: m.request_scale(operation_id="   "),
        lambda m: m.request_scale(operation_id=7),
        lambda m: m.request_scale(operation_id="op", reason=None),
        lambda m: m.fail(reason=""),
        lambda m: m.fail(reason=None),
    ],
)
def test_bad_arguments_are_refused_before_the_state_changes(call):
    m = ScaleMachine(clock=FakeClock())
    with pytest.raises(InvalidScaleRequest):
        call(m)
    assert m.state is Phase.RUNNING and m.history() == []


# ---------------------------------------------------------------------------------- generation


def test_generation_changes_only_on_rescaled_and_must_grow():
    m = machine_in(Phase.RESCALING, generation=4)
    assert m.generation == 4
    for stale in (4, 3, 0):
        with pytest.raises(StaleGeneration) as info:
            m.rescaled(generation=stale)
        assert (info.value.expected, info.value.actual) == (5, stale)
        assert m.state is Phase.RESCALING and m.generation == 4
    with pytest.raises(InvalidScaleRequest):
        m.rescaled(generation=True)
    rec = m.rescaled(generation=7)  # may skip numbers (a failed attempt used 5 and 6)
    assert rec.generation == 7 and m.generation == 7
    m.resumed()
    assert m.generation == 7 and m.operation_id is None


def test_bad_initial_generation_is_refused():
    with pytest.raises(InvalidScaleRequest):
        ScaleMachine(generation=-1)


# ---------------------------------------------------------------------------------- history


def test_history_records_time_edges_generation_reason_and_operation():
    clock = FakeClock(10.0)
    m = ScaleMachine(clock=clock, generation=1)
    m.request_scale(operation_id="scale-3", reason="scale 4 -> 3")
    clock.advance(1.5)
    m.drained()
    clock.advance(0.5)
    m.suppressed(reason="threads joined")
    clock.advance(2.0)
    m.rescaled(generation=2)
    clock.advance(1.0)
    m.resumed()
    h = m.history()
    assert [(t.at, t.source, t.dest, t.trigger, t.generation, t.operation_id) for t in h] == [
        (10.0, Phase.RUNNING, Phase.DRAINING, "request_scale", 1, "scale-3"),
        (11.5, Phase.DRAINING, Phase.SUPPRESSED, "drained", 1, "scale-3"),
        (12.0, Phase.SUPPRESSED, Phase.RESCALING, "suppressed", 1, "scale-3"),
        (14.0, Phase.RESCALING, Phase.RESUMING, "rescaled", 2, "scale-3"),
        (15.0, Phase.RESUMING, Phase.RUNNING, "resumed", 2, "scale-3"),
    ]
    assert h[0].reason == "scale 4 -> 3" and h[2].reason == "threads joined"
    assert [t.seq for t in h] == [1, 2, 3, 4, 5]
    assert m.entered_at == 15.0
    d = h[0].to_dict()
    assert d["source"] == "running" and d["dest"] == "draining" and d["at"] == 10.0
    with pytest.raises(AttributeError):
        h[0].reason = "changed"  # type: ignore[misc]
    h.clear()  # a copy
    assert len(m.history()) == 5


def test_history_is_bounded_but_seq_keeps_counting():
    m = ScaleMachine(clock=FakeClock(), history_limit=3)
    for _ in range(2):
        for trig in HAPPY_PATH:
            fire(m, trig)
    h = m.history()
    assert len(h) == 3
    assert [t.seq for t in h] == [8, 9, 10]


def test_each_transition_is_logged_as_one_sentence(caplog):
    m = ScaleMachine(clock=FakeClock(3.0))
    with caplog.at_level(logging.INFO, logger="elastic.core.machine"):
        m.request_scale(operation_id="op-9", reason="rank 2 lost")
    records = [r for r in caplog.records if r.name == "elastic.core.machine"]
    assert len(records) == 1
    msg = records[0].getMessage()
    assert "\n" not in msg
    for part in ("running -> draining", "request_scale", "op-9", "rank 2 lost", "generation 0"):
        assert part in msg


def test_fail_records_reason_and_recover_reuses_the_rescale_path():
    m = machine_in(Phase.SUPPRESSED)
    m.fail(reason="rank 1 did not join its EPLB thread")
    assert m.state is Phase.FAILED and m.failure_reason == "rank 1 did not join its EPLB thread"
    assert m.operation_id == "op-1"
    rec = m.recover(reason="roll back to survivors")
    assert rec.dest is Phase.RESCALING and rec.operation_id == "op-1"
    m.rescaled(generation=1)
    m.resumed()
    assert m.state is Phase.RUNNING and m.operation_id is None


def test_recover_after_a_failure_outside_any_operation_gets_an_id():
    m = ScaleMachine(clock=FakeClock())
    m.fail(reason="heartbeat lost")
    assert m.operation_id is None
    rec = m.recover(reason="rebuild")
    assert rec.operation_id and rec.operation_id.startswith("recover-")
    rec2 = machine_in(Phase.FAILED).recover(operation_id="rec-7", reason="x")
    assert rec2.operation_id == "rec-7"


def test_snapshot_is_json_ready():
    m = machine_in(Phase.DRAINING)
    snap = m.snapshot()
    assert snap["state"] == "draining" and snap["operation_id"] == "op-1"
    assert snap["deadline_s"] == m.timeouts.draining
    assert snap["allowed"] == list(allowed_triggers(Phase.DRAINING))


# ---------------------------------------------------------------------------------- deadlines

TIMED = [Phase.DRAINING, Phase.SUPPRESSED, Phase.RESCALING, Phase.RESUMING]


@pytest.mark.parametrize("phase", TIMED)
def test_an_overrunning_phase_fails_with_a_timeout_reason(phase):
    clock = FakeClock(0.0)
    timeouts = TimeoutsConfig(draining=1.0, suppressed=2.0, rescaling=3.0, resuming=4.0)
    m = machine_in(phase, clock=clock, timeouts=timeouts)
    deadline = timeouts.for_phase(phase)
    clock.advance(deadline)  # exactly at the deadline: not overdue
    assert m.check_deadline() is None
    assert m.fail_if_overdue() is None
    assert m.state is phase
    clock.advance(0.25)
    timeout = m.check_deadline()
    assert isinstance(timeout, PhaseTimeout)
    assert (timeout.phase, timeout.deadline_s) == (phase.value, deadline)
    assert timeout.elapsed_s == pytest.approx(deadline + 0.25)
    rec = m.fail_if_overdue()
    assert rec is not None and rec.trigger == "fail" and rec.source is phase
    assert m.state is Phase.FAILED
    assert phase.value in m.failure_reason and "deadline" in m.failure_reason
    assert m.fail_if_overdue() is None  # failed has no deadline; nothing fires twice


def test_deadline_uses_the_phase_entry_time_and_an_explicit_now():
    clock = FakeClock(0.0)
    m = ScaleMachine(clock=clock, timeouts=TimeoutsConfig(draining=5.0, suppressed=5.0))
    m.request_scale(operation_id="op")
    clock.advance(4.0)
    m.drained()  # a new phase restarts the clock
    assert m.check_deadline(now=8.0) is None
    assert m.check_deadline(now=9.5) is not None
    rec = m.fail_if_overdue(now=9.5)
    assert rec is not None and rec.at == 9.5


@pytest.mark.parametrize("phase", [Phase.RUNNING, Phase.FAILED])
def test_running_and_failed_have_no_deadline(phase):
    clock = FakeClock(0.0)
    m = machine_in(phase, clock=clock)
    clock.advance(1e9)
    assert m.check_deadline() is None and m.fail_if_overdue() is None
    assert m.state is phase


# ---------------------------------------------------------------------------------- threads


def test_concurrent_scale_requests_exactly_one_wins():
    m = ScaleMachine(clock=FakeClock())
    n = 16
    barrier = threading.Barrier(n)
    wins: list[str] = []
    refusals: list[Exception] = []
    lock = threading.Lock()

    def worker(i: int) -> None:
        barrier.wait()
        try:
            m.request_scale(operation_id=f"op-{i}")
            with lock:
                wins.append(f"op-{i}")
        except InvalidTransition as exc:
            with lock:
                refusals.append(exc)

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=10)
    assert len(wins) == 1 and len(refusals) == n - 1
    assert all(isinstance(e, ScaleConflict) and e.operation_id == wins[0] for e in refusals)
    assert m.operation_id == wins[0] and len(m.history()) == 1


def test_concurrent_watchdog_and_progress_fire_one_transition_each_phase():
    clock = FakeClock(0.0)
    m = machine_in(Phase.DRAINING, clock=clock, timeouts=TimeoutsConfig(draining=1.0))
    clock.advance(2.0)
    barrier = threading.Barrier(2)
    results: list[object] = []

    def watchdog():
        barrier.wait()
        results.append(m.fail_if_overdue())

    def progress():
        barrier.wait()
        try:
            results.append(m.drained())
        except InvalidTransition as exc:
            results.append(exc)

    ts = [threading.Thread(target=watchdog), threading.Thread(target=progress)]
    for t in ts:
        t.start()
    for t in ts:
        t.join(timeout=10)
    # Either the watchdog failed draining (drained is then refused), or drained won
    # (suppressed just started, so nothing was overdue).
    assert len(m.history()) == 2
    assert m.state in (Phase.FAILED, Phase.SUPPRESSED)


# ---------------------------------------------------------------------------------- subscribers


def test_subscribers_see_every_transition_and_exceptions_never_break_the_machine():
    m = ScaleMachine(clock=FakeClock())
    seen: list[Transition] = []

    def broken(t: Transition) -> None:
        raise RuntimeError("boom")

    m.subscribe(broken)
    m.subscribe(seen.append)
    for trig in HAPPY_PATH:
        fire(m, trig)
    assert m.state is Phase.RUNNING
    assert seen == m.history()
    errors = m.subscriber_errors()
    assert len(errors) == 5
    assert errors[0].error == "RuntimeError: boom" and "broken" in errors[0].subscriber
    assert errors[0].transition == seen[0]


def test_unsubscribe_stops_delivery():
    m = ScaleMachine(clock=FakeClock())
    seen: list[Transition] = []
    unsubscribe = m.subscribe(seen.append)
    m.request_scale(operation_id="a")
    unsubscribe()
    unsubscribe()  # idempotent
    m.drained()
    assert len(seen) == 1


def test_a_subscriber_may_fire_the_next_trigger_and_order_is_kept():
    m = ScaleMachine(clock=FakeClock())
    order_a: list[str] = []
    order_b: list[str] = []

    def driver(t: Transition) -> None:
        order_a.append(t.dest.value)
        if t.dest is Phase.DRAINING:
            m.drained()  # re-entrant: delivered after this transition finishes delivering

    m.subscribe(driver)
    m.subscribe(lambda t: order_b.append(t.dest.value))
    m.request_scale(operation_id="a")
    assert m.state is Phase.SUPPRESSED
    assert order_a == order_b == ["draining", "suppressed"]


# ---------------------------------------------------------------------------------- hypothesis


@settings(max_examples=60, deadline=None)
@given(st.lists(st.sampled_from(TRIGGERS), max_size=30))
def test_random_trigger_sequences_follow_the_table(triggers):
    m = ScaleMachine(clock=FakeClock())
    expected = Phase.RUNNING
    accepted = 0
    for trig in triggers:
        dest = next((e.dest for e in EDGES if e.trigger == trig and e.source is expected), None)
        if dest is None:
            with pytest.raises(InvalidTransition):
                fire(m, trig)
        else:
            fire(m, trig)
            expected = dest
            accepted += 1
        assert m.state is expected
    assert len(m.history()) == accepted
    h = m.history()
    assert all(a.dest is b.source for a, b in zip(h, h[1:]))


# ---------------------------------------------------------------------------------- config


def test_timeouts_defaults_and_for_phase():
    t = TimeoutsConfig()
    for p in TIMED:
        assert t.for_phase(p) == getattr(t, p.value) > 0
    assert t.for_phase(Phase.RUNNING) is None and t.for_phase("failed") is None
    assert t.worker_start > 0 and t.collective > 0 and t.heartbeat > 0


@pytest.mark.parametrize(
    ("kwargs", "needle"),
    [
        ({"draining": 0}, "draining"),
        ({"heartbeat": -1.0}, "heartbeat"),
        ({"collective": "soon"}, "collective"),
        ({"rescaling": math.inf}, "rescaling"),
        ({"resuming": math.nan}, "resuming"),
        ({"drain": 5.0}, "drain"),  # extra="forbid": a typo is an error, not ignored
    ],
)
def test_timeouts_validation_errors_name_the_field(kwargs, needle):
    with pytest.raises(ValidationError) as info:
        TimeoutsConfig(**kwargs)
    assert needle in str(info.value)
    assert info.value.errors()[0]["loc"][0] == needle


def test_timeouts_are_frozen():
    t = TimeoutsConfig()
    with pytest.raises(ValidationError):
        t.draining = 1.0  # type: ignore[misc]


# ---------------------------------------------------------------------------------- errors


@pytest.mark.parametrize(
    "err",
    [
        InvalidTransition(Phase.DRAINING, "resumed", ["drained", "fail"]),
        ScaleConflict("op-1", Phase.RESCALING, ["fail", "rescaled"]),
        InvalidScaleRequest("size", "must be at least 1", value=0),
        InvalidRankMapping("old rank 3 maps to 9", old_rank=3),
        StaleGeneration(expected=5, actual=4),
        PhaseTimeout(Phase.RESUMING, 4.0, elapsed_s=4.5),
        WorkerLost(2, "process exited with code -9"),
        ScaleNoop(4),
    ],
)
def test_errors_are_typed_readable_serialisable_and_picklable(err):
    assert isinstance(err, ElasticError)
    text = str(err)
    assert text and "\n" not in text and "Phase." not in text
    d = err.to_dict()
    assert d["error"] == err.code and d["message"] == text
    import json

    json.dumps(d)
    back = pickle.loads(pickle.dumps(err))
    assert type(back) is type(err) and back.to_dict() == d


def test_error_fields_and_flags():
    assert InvalidTransition("running", "drained", ["request_scale", "fail"]).allowed == ("fail", "request_scale")
    assert PhaseTimeout("draining", 2.0).phase == "draining"
    assert WorkerLost(3, "gone").rank == 3
    assert ScaleNoop(2).is_failure is False and StaleGeneration(2, 1).is_failure is True
    assert isinstance(InvalidScaleRequest("size", "x"), ValueError)
    assert issubclass(ScaleConflict, InvalidTransition)
