"""The one executor of operation plans (:mod:`elastic.control.plans`).

For each step of a plan it enters the phase, sends the step's command on the bus, waits (the
phase's deadline) for every recipient's typed result, turns the results into outcomes with
the step's pure interpretation, applies them (:meth:`OperationExecutor.apply`), and fires the
step's trigger. Any error, loss or deadline fails the operation and the machine.

The executor never imports the coordinator: it is given the registry, the state machine, the
operation book, the group's layout and the few callbacks it needs.
"""

from __future__ import annotations

import itertools
import logging
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch.distributed as dist

from elastic.control.events import Event, OperationChanged
from elastic.control.operations import GroupLayout, Operation, OperationBook, OperationStatus
from elastic.control.plans import (
    AdmitJoiners,
    AdoptSize,
    JoinerWait,
    MeasurePause,
    OnFailure,
    OperationPlan,
    Outcome,
    Prepared,
    Reason,
    Recipients,
    RecordAttempt,
    RecoveryPlan,
    Refuse,
    Retire,
    ScaleSnapshot,
    Step,
    plan_scale,
)
from elastic.control.registry import OperationFailed, WorkerRecord, WorkerRegistry
from elastic.core import protocol as p
from elastic.core.clock import Clock
from elastic.core.errors import ElasticError
from elastic.core.machine import ScaleMachine
from elastic.core.mapping import RankMapping
from elastic.core.phases import OperationStage, Phase, Trigger
from elastic.deployment import DeploymentConfig
from elastic.worker.groups import abort_generation

__all__ = ["OperationExecutor", "OperationRun", "retire_standby"]

log = logging.getLogger("elastic.control.executor")


@dataclass
class OperationRun:
    """What the executor carries through one operation's steps."""

    op: Operation
    plan: OperationPlan
    old: list[WorkerRecord]  # the ranks of the serving group that take part (a recovery: the survivors)
    standby_seq: int  # the seq the joining ranks' "ready" reports carry
    joining: list[WorkerRecord] = field(default_factory=list)


def retire_standby(joining: list[WorkerRecord]) -> None:
    """The scale failed before these ranks were sent their Rescale: they never joined anything.
    Never raises: the caller goes on to fail the operation (a raise here once left an operation
    holding the machine for good)."""
    for w in joining:
        if w.standby:
            w.expected_exit = True
            try:
                w.handle.kill()
            except Exception:  # noqa: BLE001 - a worker gone on its own is retired all the same
                log.exception("retiring standby rank %d", w.rank)


class OperationExecutor:
    """Runs scales and recoveries (one at a time, each on its own thread) from their plans."""

    def __init__(self, config: DeploymentConfig, *, machine: ScaleMachine, registry: WorkerRegistry,
                 book: OperationBook, layout: GroupLayout, clock: Clock,
                 launch_joining: Callable[[int, int, int, int], WorkerRecord],
                 layout_for: Callable[[list[WorkerRecord], int, int], RankMapping],
                 store: Callable[[], dist.TCPStore | None], emit: Callable[[Event], None],
                 on_finished: Callable[[Operation], None], after_success: Callable[[Operation], None],
                 before_scale: list[Callable[[Operation], None]]):
        self.config = config
        self.machine = machine
        self.registry = registry
        self.book = book
        self.layout = layout
        self.clock = clock
        self.launch_joining = launch_joining  # (rank, new size, generation, standby seq) -> its record
        self.layout_for = layout_for  # (old group, size, target) -> the launcher's layout
        self.store = store
        self.emit = emit
        self.on_finished = on_finished  # every end, before the operation's waiters wake
        self.after_success = after_success  # a success, once the old generations' keys are gone
        self.before_scale = before_scale
        self.attempts: dict[int, tuple[int, int]] = {}  # generation -> (size, command seq) of every rescale attempt
        self._last_generation = 0
        self._standby_ids = itertools.count(-1, -1)
        self.threads: list[threading.Thread] = []

    def start(self, target: Callable[..., None], op: Operation, *args: Any) -> None:
        thread = threading.Thread(target=target, args=(op, *args), name=f"operation-{op.id}", daemon=True)
        with self.registry.lock:
            self.threads = [t for t in self.threads if t.is_alive()] + [thread]
        thread.start()

    # -- the operations ---------------------------------------------------------------------------
    def run_scale(self, op: Operation) -> None:
        """A scale's thread: the before-scale hooks, the plan, its steps."""
        if op.status == OperationStatus.PENDING and not self._run_before_hooks(op):
            return
        with self.registry.lock:
            op.phases.setdefault(Phase.DRAINING.value, {"started": self.clock.monotonic()})
        old = self.registry.live_workers()
        timeouts, scaling = self.config.timeouts, self.config.scaling
        snapshot = ScaleSnapshot(
            operation_id=op.id, size=self.layout.size, generation=self.reserve_generation(),
            # the new group's layout is fixed now (hosts contiguous), and its joining ranks start
            # at once: process start and weight allocation overlap draining, not the pause
            layout=self.layout_for(old, self.layout.size, op.target_size), prepare=scaling.prepare,
            prestage_max_bytes=int(scaling.prestage_max_bytes), prestage_share=scaling.prestage_share,
            draining_s=timeouts.draining, retire_grace_s=max(1.0, timeouts.collective))
        self._guarded(op, lambda: plan_scale(snapshot, op.target_size), old)

    def run_recovery(self, op: Operation, choice: RecoveryPlan, survivors: list[WorkerRecord]) -> None:
        """A recovery's thread: retire every worker that is not a survivor, then the plan's steps."""
        retire = set(choice.retire)
        for w in list(self.registry.workers.values()):
            if w.pid in retire and w.handle.is_alive():
                w.handle.kill()  # retired: a fresh rank of a failed attempt, or a lost one
        grace = max(1.0, self.config.timeouts.collective)
        self._guarded(op, lambda: choice.operation(op.id, self.reserve_generation(), op.target_size,
                                                   retire_grace_s=grace), survivors)

    def _guarded(self, op: Operation, make_plan: Callable[[], OperationPlan], old: list[WorkerRecord]) -> None:
        run: OperationRun | None = None
        try:
            plan = make_plan()
            run = OperationRun(op, plan, old, standby_seq=next(self._standby_ids))
            self.execute(run)
            self.finish(op, OperationStatus.SUCCEEDED)
            self._delete_retired_generations()
            self.after_success(op)
        except (OperationFailed, ElasticError) as exc:
            retire_standby(run.joining if run else [])
            self.fail(op, str(exc))
        except Exception as exc:  # noqa: BLE001 - an operation thread reports, never raises across threads
            log.exception("operation %s crashed", op.id)
            retire_standby(run.joining if run else [])
            self.fail(op, f"{type(exc).__name__}: {exc}")

    def execute(self, run: OperationRun) -> None:
        """Launch the plan's joining ranks (standing by), then run its steps in order."""
        plan = run.plan
        for rank in plan.joining:  # one by one: a launch that fails leaves the others retirable
            run.joining.append(self.launch_joining(rank, plan.mapping.new_size, plan.generation, run.standby_seq))
        for step in plan.steps:
            self._run_step(step, run)

    def _run_step(self, step: Step, run: OperationRun) -> None:
        op = run.op
        if op.phase != step.phase.value:
            self.emit(OperationChanged(self.book.enter(op, step.phase.value)))
        if step.joiners is JoinerWait.BEFORE_SEND:
            self._await_joiners(run)
        seq, pids = self._send(step, run)
        if step.joiners is JoinerWait.AFTER_SEND:
            self._await_joiners(run)
        try:
            deadline = self.config.timeouts.for_phase(step.phase)
            reports = self.registry.await_done(seq, pids, step.phase.value, deadline or 60.0)
        except OperationFailed as exc:
            if step.on_failure is OnFailure.ABANDON_GENERATION:
                self._abandon_generation(run.plan.generation, exc)
            raise
        reason = self.apply(run, step, step.interpret(reports))
        if step.trigger is not None:
            generation = run.plan.generation if step.trigger is Trigger.RESCALED else None
            self.machine.fire(step.trigger, reason=reason, generation=generation)

    def _recipients(self, step: Step, run: OperationRun) -> Callable[[], list[WorkerRecord]] | list[WorkerRecord]:
        if step.recipients is Recipients.GROUP:
            return list(run.old)
        if step.recipients is Recipients.GROUP_AND_JOINING:
            return list(run.old) + list(run.joining)
        if step.recipients is Recipients.KEPT_AND_JOINING:
            return [w for w in run.old if w.rank not in run.plan.lost] + list(run.joining)
        return self.registry.live_workers  # chosen under the bus lock

    def _send(self, step: Step, run: OperationRun) -> tuple[int, set[int]]:
        in_phase = self.clock.monotonic() - run.op.phases.get(step.phase.value, {}).get("started", self.clock.monotonic())

        def make(seq: int) -> p.Command:
            for effect in step.at_send:  # under the bus lock: before any recipient can answer
                if isinstance(effect, RecordAttempt):
                    self.attempts[effect.generation] = (effect.size, seq)
                elif isinstance(effect, AdmitJoiners):
                    for w in run.joining:
                        w.standby = False  # in the new group from here on (a failed attempt's recovery retires it)
            return step.build(seq, in_phase)

        seq, sent = self.registry.bus.send(make, self._recipients(step, run))
        if step.at_send:
            self._forget_attempts()
        if step.command is p.Prepare:
            self.book.mark(run.op, step.phase.value, "prepare_started")
        return seq, {w.pid for w in sent}

    def apply(self, run: OperationRun, step: Step, outcomes: tuple[Outcome, ...]) -> str:
        """Apply a step's outcomes; returns the reason its trigger fires with. A :class:`Refuse`
        fails the step before anything else is applied."""
        op = run.op
        for outcome in outcomes:
            if isinstance(outcome, Refuse):
                raise OperationFailed(step.phase.value, outcome.reason)
        reason = f"{step.phase.value} done"
        for outcome in outcomes:
            if isinstance(outcome, Reason):
                reason = outcome.text
            elif isinstance(outcome, Retire):
                self._retire(outcome)
                op.released_ranks = list(outcome.ranks)
            elif isinstance(outcome, AdoptSize):
                with self.registry.lock:
                    self.layout.size = outcome.size
                    self.layout.num_physical = outcome.num_physical or self.layout.num_physical
                log.info("rescaled to %d ranks (generation %d)", outcome.size, run.plan.generation)
            elif isinstance(outcome, MeasurePause):
                op.paused_seconds, op.bytes_moved = outcome.paused_seconds, outcome.bytes_moved
                op.diverged_layers = list(outcome.diverged_layers)
            elif isinstance(outcome, Prepared):
                with self.registry.lock:
                    op.prepare = dict(outcome.summary)
                self.book.mark(op, step.phase.value, "prepare_ended")
        return reason

    def _retire(self, retire: Retire) -> None:
        """The retired ranks left the group: their exit is expected; each gets a moment, then is killed."""
        for pid in retire.pids:
            record = self.registry.workers.get(pid)
            if record is None:
                continue
            record.expected_exit = True
            if not record.handle.join(retire.grace_s):
                record.handle.kill()

    def _await_joiners(self, run: OperationRun) -> None:
        """The pause starts only once the joining ranks are ready: the old group decodes meanwhile."""
        if run.joining:
            self.registry.await_done(run.standby_seq, {w.pid for w in run.joining}, run.op.phase,
                                     self.config.timeouts.worker_start)

    def _abandon_generation(self, generation: int, exc: OperationFailed) -> None:
        """Ranks still waiting to join the attempted generation give up now, not at their deadline."""
        store = self.store()
        if store is not None:
            abort_generation(store, generation, f"rescale attempt abandoned: {exc}")

    # -- before, after ----------------------------------------------------------------------------
    def _run_before_hooks(self, op: Operation) -> bool:
        """Run the before-scale hooks; True when the scale may go on (the machine is then ``draining``)."""
        self.emit(OperationChanged(self.book.enter(op, OperationStage.BEFORE_HOOKS.value)))
        for hook in list(self.before_scale):
            try:
                hook(op)
            except Exception as exc:  # noqa: BLE001 - a veto: the operation fails, the machine is untouched
                reason = str(exc) if isinstance(exc, ElasticError) else f"before-scale hook failed: {type(exc).__name__}: {exc}"
                self.finish(op, OperationStatus.FAILED, reason)
                return False
        with self.registry.lock:
            try:
                self.machine.request_scale(operation_id=op.id, reason=f"scale {self.layout.size} -> {op.target_size}")
            except ElasticError as exc:  # e.g. a worker was lost while the hooks ran
                self.finish(op, OperationStatus.FAILED, str(exc))
                return False
            op.status = OperationStatus.RUNNING
        self.emit(OperationChanged(self.book.enter(op, Phase.DRAINING.value)))
        return True

    def finish(self, op: Operation, status: OperationStatus, error: str | None = None) -> None:
        self.emit(OperationChanged(self.book.enter(op, status.value)))
        data = self.book.finish(op, status, error, self.machine.generation)
        self.on_finished(op)
        self.emit(OperationChanged(data))
        op.done.set()

    def fail(self, op: Operation, reason: str) -> None:
        """The operation failed: the machine goes to ``failed``. If the group was not being
        replaced (the failure came before ``rescaling``: a phase overran, joining ranks were not
        ready, a launch failed), the old group is still whole and decoding: its EPLB is stopped
        on every live rank (bounded), so nothing moves experts while the deployment is failed and
        a recovery finds every rank ready to rescale at its first attempt."""
        healthy_group = op.phase in (Phase.DRAINING.value, Phase.SUPPRESSED.value, OperationStage.BEFORE_HOOKS.value,
                                     OperationStage.PENDING.value)
        if self.machine.state != Phase.FAILED:
            try:
                self.machine.fail(reason=reason)
            except ElasticError:
                pass
        if healthy_group and not self.registry.stop.is_set():
            self._stop_eplb_everywhere()
        self.finish(op, OperationStatus.FAILED, reason)

    def _stop_eplb_everywhere(self) -> None:
        try:
            seq, pids = self.registry.broadcast(p.StopEPLB)
            self.registry.await_done(seq, pids, Phase.FAILED.value, self.config.timeouts.suppressed,
                                     fail_machine=False)
        except OperationFailed as exc:  # a rank broke or died meanwhile: recovery leaves it out
            log.warning("stopping the EPLB after a failure: %s", exc)

    # -- generations ------------------------------------------------------------------------------
    def reserve_generation(self) -> int:
        """The next generation number. One is never reused, even after a failed attempt: its
        store keys may linger."""
        with self.registry.lock:
            self._last_generation = max(self._last_generation, self.machine.generation) + 1
            return self._last_generation

    def _forget_attempts(self) -> None:
        """Rescale attempts older than the serving generation can no longer be recovered from."""
        with self.registry.lock:
            for g in [g for g in self.attempts if g <= self.machine.generation]:
                del self.attempts[g]

    def _delete_retired_generations(self) -> None:
        """Delete the store keys of generations older than the serving one (after a Resume: no
        worker is in them, and a recovery starts from the serving one or a newer attempt)."""
        self._forget_attempts()
        store = self.store()
        if store is None:
            return
        keep_from = self.machine.generation
        try:
            keys = store.list_keys()
        except Exception:  # noqa: BLE001 - an old store without list_keys: the keys stay
            return
        for key in keys:
            if key.startswith("elastic/gen"):
                number = key[len("elastic/gen"):].split("/", 1)[0]
                if number.isdigit() and int(number) < keep_from:
                    store.delete_key(key)
