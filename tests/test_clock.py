"""The one clock: liveness, waits and the machine's deadlines move with a driven clock, with no sleep."""

from __future__ import annotations

import queue
import threading

import pytest

from elastic.control.registry import OperationFailed, WorkerRegistry
from elastic.core import protocol as p
from elastic.core.clock import FuncClock, ManualClock, RealClock, as_clock
from elastic.core.config import TimeoutsConfig
from elastic.core.machine import ScaleMachine
from elastic.core.phases import Phase


class Handle:
    """A worker's handle as the registry sees it (liveness is the clock's and the reports')."""

    def __init__(self, pid: int, alive: bool = True):
        self.pid, self.alive, self.inbox = pid, alive, queue.Queue()

    def is_alive(self) -> bool:
        return self.alive


def registry(clock: ManualClock, **timeouts: float) -> WorkerRegistry:
    machine = ScaleMachine(clock=clock, timeouts=TimeoutsConfig(**timeouts))
    return WorkerRegistry(machine, machine.timeouts, clock, history=16, stop=threading.Event())


def beat(pid: int, rank: int = 0) -> p.Heartbeat:
    return p.Heartbeat(rank=rank, generation=0, pid=pid, at=0.0, step=1)


def test_a_silent_worker_is_lost_when_the_driven_clock_passes_its_deadlines():
    clock = ManualClock()
    reg = registry(clock, worker_start=20.0, heartbeat=5.0)
    starting, beating = reg.add(Handle(1), 0, 0), reg.add(Handle(2), 1, 0)
    clock.advance(19.0)
    reg.file_report(beat(2, rank=1))
    assert reg.find_lost() == []
    clock.advance(1.5)  # 20.5 s without a first report; 1.5 s since the other's beat
    assert reg.find_lost() == [starting] and "within worker_start (20s)" in (starting.lost_reason or "")
    clock.advance(3.0)
    assert reg.find_lost() == []  # 4.5 s of silence: not yet
    clock.advance(1.0)
    assert reg.find_lost() == [beating] and beating.lost_reason == "silent for 5.5s (heartbeat timeout 5s)"


def test_a_dead_worker_gets_the_exit_grace_on_the_driven_clock():
    clock = ManualClock()
    reg = registry(clock)
    record = reg.add(Handle(1, alive=False), 0, 0)
    assert reg.find_lost() == []  # its last reports may still be on their way
    clock.advance(0.31)
    assert reg.find_lost() == [record] and record.lost_reason == "exited unexpectedly"


def test_a_wait_for_results_ends_at_its_deadline_on_the_driven_clock():
    clock = ManualClock()
    reg = registry(clock)
    reg.add(Handle(1), 0, 0)
    failure: list[BaseException] = []

    def wait() -> None:
        try:
            reg.await_done(3, {1}, "draining", 60.0)
        except OperationFailed as exc:
            failure.append(exc)

    waiter = threading.Thread(target=wait)
    waiter.start()
    clock.advance(61.0)  # the waiter re-reads the clock after its next slice
    waiter.join(5.0)
    assert not waiter.is_alive() and "did not finish draining within 60.0s" in str(failure[0])


def test_the_machine_and_the_registry_read_the_same_clock():
    clock = ManualClock()
    reg = registry(clock, draining=2.0)
    reg.machine.request_scale(operation_id="op-1")
    clock.advance(2.5)
    assert reg.machine.fail_if_overdue() is not None and reg.machine.state == Phase.FAILED


def test_as_clock_wraps_a_function_and_keeps_a_clock():
    manual = ManualClock(start=5.0, wall_start=100.0)
    assert as_clock(manual) is manual and manual.wall() == 100.0
    manual.sleep(2.0)  # a driven clock's sleep advances it
    assert manual.monotonic() == 7.0 and manual() == 7.0
    driven = as_clock(lambda: 42.0)
    assert isinstance(driven, FuncClock) and driven.monotonic() == 42.0
    assert isinstance(as_clock(None), RealClock)
    with pytest.raises(ValueError):
        manual.advance(-1.0)


def test_the_coordinator_is_a_control_plane_and_reads_the_clock_it_is_given():
    from elastic.control.coordinator import Coordinator
    from elastic.control.plane import ControlPlane
    from elastic.deployment import DeploymentConfig

    clock = ManualClock()
    coordinator: ControlPlane = Coordinator(DeploymentConfig(), clock=clock)  # no start: no process
    assert coordinator.clock is clock and coordinator.machine.entered_at == clock.monotonic()
    op = coordinator.scale(DeploymentConfig().ep_size)  # a no-op: finished at once, at the clock's wall time
    assert op.status == "noop" and op.created_at == clock.wall() == op.finished_at


def test_one_executor_applies_a_steps_outcomes_without_a_process():
    """The rescale row's outcomes, applied: the retired rank's exit is expected (killed when it does not
    leave), the layout adopts the new size, the pause is recorded; a refusal applies nothing."""
    from elastic.control.executor import OperationExecutor, OperationRun
    from elastic.control.operations import GroupLayout, OperationBook
    from elastic.control.plans import AdoptSize, MeasurePause, Reason, Refuse, Retire, ScaleSnapshot, plan_scale
    from elastic.core.phases import OperationKind
    from elastic.deployment import DeploymentConfig

    class Stuck(Handle):
        killed = False

        def join(self, timeout: float) -> bool:
            return False

        def kill(self) -> None:
            self.killed = True

    clock = ManualClock()
    reg = registry(clock)
    book = OperationBook(clock, reg.lock, history=8, idempotency_ttl_s=60.0)
    layout = GroupLayout(size=3, num_physical=12)
    executor = OperationExecutor(
        DeploymentConfig(), machine=reg.machine, registry=reg, book=book, layout=layout, clock=clock,
        launch_joining=lambda *a: None, layout_for=lambda *a: None, store=lambda: None, emit=lambda e: None,  # type: ignore[arg-type, return-value]
        on_finished=lambda op: None, after_success=lambda op: None, before_scale=[])
    leaving = reg.add(Stuck(12), 2, 0)
    plan = plan_scale(ScaleSnapshot("op-1", size=3, generation=1), 2)
    op = book.new("op-1", OperationKind.SCALE, 2, 3, 0)
    run = OperationRun(op, plan, old=reg.live_workers(), standby_seq=-1)
    rescale = plan.steps[2]
    with pytest.raises(OperationFailed, match="disagree"):
        executor.apply(run, rescale, (AdoptSize(2, 8), Refuse("ranks disagree")))
    assert layout.size == 3 and not leaving.expected_exit  # nothing applied
    reason = executor.apply(run, rescale, (MeasurePause(0.25, 100, (3,)), Retire((12,), (2,), 0.1), AdoptSize(2, 8),
                                           Reason("group of 2 formed")))
    assert reason == "group of 2 formed" and (layout.size, layout.num_physical) == (2, 8)
    assert leaving.expected_exit and leaving.handle.killed and op.released_ranks == [2]  # type: ignore[attr-defined]
    assert (op.paused_seconds, op.bytes_moved, op.diverged_layers) == (0.25, 100, [3])
