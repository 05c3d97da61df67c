"""Property-based stateful test of the controller (issue 7).

Hypothesis drives a real :class:`~elastic.control.coordinator.Coordinator` and its real state machine on
the in-process fake transport (:mod:`tests.fake_transport`) with random sequences of scale
requests (valid and invalid sizes, stale generations), rebalances, worker kills (also in the
middle of a scale) and recoveries. After every step:

- every request was answered: a typed error that changed nothing, or an operation that ended
  succeeded, failed or noop within a bound;
- when running: every logical expert has a replica, all live ranks agree on the placement
  digest and the generation, no slot holds the wrong expert;
- the fake transport saw no rank suppressed or rescaled with a transfer in flight (or its EPLB
  thread running) and no rescale whose survivors disagreed on the placement;
- the machine's history is a chain (each transition starts where the previous ended).
"""

from __future__ import annotations

import time

import pytest
from hypothesis import HealthCheck, event, settings
from hypothesis import Phase as Stage
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from elastic.control.coordinator import Coordinator, OperationStatus
from elastic.core.errors import InvalidScaleRequest, InvalidTransition, ScaleConflict, StaleGeneration
from elastic.core.machine import Phase
from tests.conftest import small_config
from tests.fake_transport import FakeLauncher

TYPED = (InvalidScaleRequest, ScaleConflict, StaleGeneration, InvalidTransition)
FAST = dict(draining=5, suppressed=5, rescaling=10, resuming=5, worker_start=10, collective=2, heartbeat=3)
OP_TIMEOUT = 30.0
FAIL_BOUND = 5.0


def wait_until(predicate, timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.01)
    return predicate()


class ControllerMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        # 12 slots over 3 ranks (4 per rank) for 8 experts: sizes 2..5 are valid, so a kill
        # from 3 ranks still leaves a recoverable group, and 1 or 6+ are invalid requests
        self.config = small_config(timeouts=FAST, ep_size=3, max_ep_size=5)
        self.launcher = FakeLauncher(capacity=self.config.max_ep_size)
        self.coordinator = Coordinator(self.config, launcher=self.launcher).start()
        self.steps: list[str] = []  # what happened, for failure messages (timing makes replays diverge)

    def _note(self, text: str) -> None:
        self.steps.append(text)
        event(text.split(" ->")[0] if " ->" in text else text)

    def teardown(self) -> None:
        self.coordinator.shutdown(timeout=5)

    # -- helpers ---------------------------------------------------------------------------------
    def _idle(self) -> bool:
        current = self.coordinator._current
        return current is None or current.terminal

    def _killable(self) -> list:
        """Fake workers the coordinator counts on (not retiring, not already written off)."""
        records = self.coordinator.workers
        return [w for w in self.launcher.live() if (r := records.get(w.pid)) is not None
                and not r.expected_exit and r.lost_reason is None]

    def _view(self) -> tuple:
        c = self.coordinator
        return (c.machine.state, c.machine.generation, c.size, len(c.machine.history()), len(c.operations))

    def _check_answered(self, op, before_state: Phase) -> None:
        assert op.done.wait(OP_TIMEOUT), f"operation {op.id} unanswered after {OP_TIMEOUT}s (phase {op.phase})"
        assert op.terminal and op.status in (OperationStatus.SUCCEEDED, OperationStatus.FAILED, OperationStatus.NOOP)
        state = self.coordinator.machine.state
        if op.status == OperationStatus.SUCCEEDED:
            assert state == Phase.RUNNING and self.coordinator.size == op.target_size
        elif op.status == OperationStatus.FAILED:
            assert op.error, "a failed operation says why"
            assert state == Phase.FAILED or (op.phase == "failed" and state == before_state)
        else:
            assert op.target_size == op.from_size

    # -- rules -----------------------------------------------------------------------------------
    @rule(n=st.integers(-1, 7), stale=st.sampled_from([None, "current", "stale"]))
    def scale(self, n: int, stale: str | None) -> None:
        c = self.coordinator
        before = self._view()
        expected = {None: None, "current": c.machine.generation, "stale": c.machine.generation - 1}[stale]
        try:
            op = c.scale(n, expected_generation=expected, wait=True, timeout=OP_TIMEOUT)
        except TYPED as exc:
            self._note(f"scale({n}, {stale}) refused: {type(exc).__name__}")
            assert self._view() == before, "a refused request changed nothing"
            return
        self._note(f"scale({n}, {stale}) -> {op.status} {op.error or ''}")
        valid = self.config.size_problem(n) is None
        assert valid and stale != "stale", f"scale({n}, stale={stale}) was accepted"
        self._check_answered(op, before[0])
        if before[0] == Phase.RUNNING and n != before[2]:
            # nothing went wrong on the fake transport: a valid scale of a healthy group succeeds
            assert op.status == OperationStatus.SUCCEEDED, f"scale {before[2]} -> {n} failed: {op.error}"

    @precondition(lambda self: self.coordinator.machine.state == Phase.RUNNING)
    @rule(n=st.integers(2, 5), victim=st.integers(0, 7), delay=st.sampled_from([0.0, 0.002, 0.01, 0.03, 0.1]))
    def scale_with_fault(self, n: int, victim: int, delay: float) -> None:
        """A rank dies while a scale runs: the scale is answered and the machine ends failed."""
        c = self.coordinator
        before = self._view()
        try:
            op = c.scale(n, wait=False)
        except TYPED:
            assert self._view() == before
            return
        time.sleep(delay)
        live = self._killable()
        if not live:
            return
        worker = self.launcher.kill(worker=live[victim % len(live)])
        self._check_answered(op, before[0])
        self._note(f"scale_with_fault({n}, kill rank {worker.rank} gen {worker.generation} after {delay}s) -> {op.status} {op.error or ''}")
        if not wait_until(lambda: c.machine.state == Phase.FAILED, FAIL_BOUND):
            # only a rank that was retiring anyway may die without failing the machine
            assert c.workers[worker.pid].expected_exit and op.status == OperationStatus.SUCCEEDED, (
                f"a rank died but the machine is {c.machine.state} (op {op.status}: {op.error})")

    @precondition(lambda self: self.coordinator.machine.state == Phase.RUNNING)
    @rule()
    def rebalance(self) -> None:
        self._note("rebalance")
        assert self.coordinator.rebalance(timeout=10) is True

    @precondition(lambda self: bool(self._killable()))
    @rule(victim=st.integers(0, 7))
    def kill(self, victim: int) -> None:
        live = self._killable()
        worker = self.launcher.kill(worker=live[victim % len(live)])
        self._note(f"kill rank {worker.rank} gen {worker.generation}")
        record = self.coordinator.workers.get(worker.pid)
        assert wait_until(lambda: self.coordinator.machine.state == Phase.FAILED, FAIL_BOUND), (
            f"rank {worker.rank} (generation {worker.generation}, broken={worker.broken}) killed, machine still "
            f"{self.coordinator.machine.state} at generation {self.coordinator.machine.generation}; its record: "
            f"expected_exit={record and record.expected_exit} lost_reason={record and record.lost_reason}")

    @precondition(lambda self: self.coordinator.machine.state == Phase.FAILED)
    @rule()
    def recover(self) -> None:
        c = self.coordinator
        assert wait_until(self._idle, OP_TIMEOUT)
        # Let ranks that passed a failed rescale's barrier finish adopting and report first:
        # recover() picks survivors by the generation of their last report, so a rank still
        # adopting the new generation would be sent a recovery for the old one (a known race,
        # see the report of issue 7; this test does not exercise it).
        assert wait_until(lambda: not any(w.mode == "rescaling" and not w.broken for w in self.launcher.live()), 5)
        time.sleep(0.1)
        before = self._view()
        survivors = [w for w in c.live_workers() if w.generation == c.machine.generation]
        try:
            op = c.recover(wait=True, timeout=OP_TIMEOUT)
        except TYPED as exc:
            self._note(f"recover refused: {type(exc).__name__}")
            assert self._view() == before, "a refused recovery changed nothing"
            assert c.config.size_problem(len(survivors)) is not None or not survivors, "recovery refused needlessly"
            return
        self._check_answered(op, before[0])
        self._note(f"recover -> {op.status} {op.error or ''}")
        assert op.status == OperationStatus.SUCCEEDED, f"recovery with {len(survivors)} survivors failed: {op.error}"
        # the recovery keeps the generation with the most living workers: never fewer than the
        # last consistent generation's survivors (more when ranks had adopted a failed attempt)
        assert c.size == op.target_size >= len(survivors)

    # -- invariants ------------------------------------------------------------------------------
    @invariant()
    def no_transport_violation(self) -> None:
        assert self.launcher.violations == [], self.launcher.violations

    @invariant()
    def history_is_a_chain(self) -> None:
        history = self.coordinator.machine.history()
        for previous, current in zip(history, history[1:]):
            assert current.source == previous.dest, f"{previous.sentence()} then {current.sentence()}"
            assert current.seq == previous.seq + 1

    @invariant()
    def every_request_answered(self) -> None:
        ops = list(self.coordinator.operations.values())
        assert all(op.terminal for op in ops), [op.to_dict() for op in ops if not op.terminal]

    @invariant()
    def consistent_when_running(self) -> None:
        c = self.coordinator
        if c.machine.state != Phase.RUNNING:
            return
        verdicts = c.verify(timeout=10)
        steps = "; ".join(self.steps[-8:])
        assert sorted(verdicts) == list(range(c.size)), f"ranks {sorted(verdicts)} for a group of {c.size}"
        assert len({v["digest"] for v in verdicts.values()}) == 1, f"ranks disagree on the placement after {steps}"
        assert {v["generation"] for v in verdicts.values()} == {c.machine.generation}
        for rank, v in verdicts.items():
            assert v["replica_min"] >= 1, f"rank {rank}: an expert has no replica"
            assert v["mismatched"] == [], f"rank {rank}: slots {v['mismatched']} hold the wrong expert after {steps}"
            assert v["size"] == c.size and v["num_physical"] == c.num_physical


ControllerMachine.TestCase.settings = settings(
    max_examples=7, stateful_step_count=12, deadline=None,  # 7 x 12 steps of real workers: about half a minute on 2 cores
    # timing decides some outcomes (a kill before or after a scale finished), so a replay may
    # take another path: report the failure as found instead of shrinking it
    phases=(Stage.explicit, Stage.reuse, Stage.generate),
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much],
)


@pytest.mark.timeout(180)
def test_controller_state_machine():
    ControllerMachine.TestCase().runTest()


@pytest.mark.timeout(60)
def test_recovery_stops_the_workers_it_retires():
    """A scale-up fails mid-rescale (an old rank dies); the recovery keeps the old generation's
    survivors. The fresh workers of the failed attempt must not outlive the recovery."""
    config = small_config(timeouts=FAST, ep_size=3, max_ep_size=5)
    launcher = FakeLauncher(capacity=5)
    coordinator = Coordinator(config, launcher=launcher).start()
    try:
        op = coordinator.scale(5, wait=False)
        assert wait_until(lambda: len(launcher.workers) == 5, 10)
        launcher.kill(worker=launcher.workers[0])
        assert op.done.wait(OP_TIMEOUT) and op.status == OperationStatus.FAILED
        assert wait_until(lambda: coordinator.machine.state == Phase.FAILED, FAIL_BOUND)
        recovery = coordinator.recover(timeout=OP_TIMEOUT)
        assert recovery.status == OperationStatus.SUCCEEDED, recovery.error
        counted = {w.handle.pid for w in coordinator.live_workers()}
        assert wait_until(lambda: {w.pid for w in launcher.live()} == counted, 5), (
            f"workers left running outside the group: {[(w.rank, w.generation) for w in launcher.live() if w.pid not in counted]}")
    finally:
        coordinator.shutdown(timeout=5)
