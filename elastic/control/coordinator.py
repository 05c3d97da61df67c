"""The coordinator: a thin facade over the control plane's parts.

- :class:`~elastic.control.registry.WorkerRegistry`: the workers, their reports and liveness,
  the command bus;
- :class:`~elastic.control.executor.OperationExecutor`: carries out the plans of
  :mod:`elastic.control.plans` (scale, recovery), one operation thread at a time;
- :class:`~elastic.control.operations.OperationBook`: the operations and idempotency keys;
- :class:`~elastic.control.outputs.OutputCheck`: the output never changes when experts move;
- :class:`~elastic.control.requests.RequestEngine`: completion requests (a real model);
- :class:`~elastic.control.timeline.Timeline`: operations, failures and rebalances in wall time.

None of them imports this module. The coordinator owns the threads that feed them: the
*report reader* files worker reports; the *watchdog* fails an overdue phase, notices dead or
silent workers and fails the machine with the reason (never a wait forever). Every part reads
the one injected :class:`~elastic.core.clock.Clock`. What the coordinator remembers is bounded
by ``DeploymentConfig.operation_history``.
"""

from __future__ import annotations

import logging
import math
import queue
import threading
import uuid
from collections.abc import Callable
from typing import Any

import torch.distributed as dist

from elastic.control.budget import RecoveryBudget
from elastic.control.events import (
    Event,
    EventHub,
    HeartbeatSeen,
    OperationChanged,
    Transitioned,
    WorkerErrorSeen,
    WorkerEventSeen,
)
from elastic.control.executor import OperationExecutor
from elastic.control.inspect import BrokenGroupWatch, snapshot_of
from elastic.control.operations import GroupLayout, Operation, OperationBook, OperationStatus
from elastic.control.outputs import OutputCheck
from elastic.control.plans import Attempt, LiveWorker, RecoveryPlan, plan_recovery
from elastic.control.registry import OperationFailed, WorkerRecord, WorkerRegistry
from elastic.control.requests import Completion, RequestEngine
from elastic.control.spawn import worker_spec
from elastic.control.timeline import Timeline
from elastic.core import protocol as p
from elastic.core.clock import Clock, as_clock
from elastic.core.errors import (
    ElasticError,
    IdempotencyKeyReused,
    InvalidScaleRequest,
    InvalidTransition,
    LifecycleError,
    RebalanceFailed,
    ScaleConflict,
    StaleGeneration,
)
from elastic.core.machine import ScaleMachine, Trigger
from elastic.core.phases import SERVING_PHASES, OperationKind, OperationStage, Phase
from elastic.deployment import DeploymentConfig
from elastic.faults import _Fault, fires_once
from elastic.launch.factory import make_launcher
from elastic.launch.launchers import Launcher, note_lost_worker, plan_mapping
from elastic.worker.groups import open_store
from elastic.worker.injector import BOUND_KEY
from eplb.algorithm import warm_up
from eplb.models.config import HFModelConfig
from eplb.placement_file import placement_document

__all__ = ["Coordinator", "Operation", "OperationFailed", "OperationStatus", "WorkerRecord"]

log = logging.getLogger("elastic.control.coordinator")


class Coordinator:
    """Runs a deployment of EP workers and scales it through the state machine."""

    def __init__(self, config: DeploymentConfig, *, launcher: Launcher | None = None,
                 clock: Clock | Callable[[], float] | None = None, faults: tuple[Any, ...] = ()):
        self.config = config
        self.launcher = launcher or make_launcher(config)  # config.launcher: local, command or ray
        self.clock = as_clock(clock)
        for i, fault in enumerate(faults):  # anything else was silently never fired by the workers
            if not isinstance(fault, _Fault):
                raise InvalidScaleRequest(f"faults[{i}]", "expected a record of elastic.faults (KillRank(rank=1, "
                                          f"at_step=50), StallRank, DelayTransfer, ...), got {type(fault).__name__}",
                                          value=fault)
        self.faults = tuple(faults)
        self.machine = ScaleMachine(timeouts=config.timeouts, clock=self.clock)
        self._stop = threading.Event()
        history = config.operation_history
        self.registry = WorkerRegistry(self.machine, config.timeouts, self.clock, history, self._stop)
        self._lock, self._reports = self.registry.lock, self.registry.reports
        self.layout = GroupLayout(config.ep_size, config.num_physical)
        self.book = OperationBook(self.clock, self._lock, history, config.idempotency_ttl_s)
        self.hub = EventHub()
        self.timelines = Timeline(self.clock, history)
        self._broken = BrokenGroupWatch(self.registry, self.machine, self.clock)
        #: Called with the operation on its thread before a scale touches the machine; raising vetoes
        #: the scale (the operation fails with the error, the machine stays ``running``). See elastic.service.hooks.
        self.before_scale: list[Callable[[Operation], None]] = []
        self.outputs = OutputCheck(config.model, self.registry, self.machine, self.book.busy, self.hub.emit,
                                   probe_timeout_s=config.timeouts.collective * 2)
        self._store: dist.TCPStore | None = None
        self.executor = OperationExecutor(
            config, machine=self.machine, registry=self.registry, book=self.book, layout=self.layout,
            clock=self.clock, launch_joining=self._launch_joining, store=lambda: self._store, emit=self.hub.emit,
            layout_for=lambda old, size, target: plan_mapping(self.launcher, [w.handle for w in old], size, target),
            on_finished=self._on_finished, after_success=self._maybe_replace_lost, before_scale=self.before_scale)
        self.recovery_budget = RecoveryBudget(config.max_auto_recoveries)  # per incident (elastic.control.budget)
        self._auto_recovering = False
        self._threads: list[threading.Thread] = []
        self._lifecycle = "new"  # "started" once start() begins, "shut down" once shutdown() begins (for good)
        self._initial_rows: tuple[tuple[int, ...], ...] | None = None  # eplb.initial_placement's, set at start
        self.machine.subscribe(lambda t: self.hub.emit(Transitioned(t)))
        self.machine.subscribe(self.timelines.on_transition)
        #: completion requests (a real model): queue, admission into the group's batch, tokens
        self.requests: RequestEngine | None = None
        if isinstance(config.model, HFModelConfig):
            self.requests = RequestEngine(self, config.serving, clock=self.clock, on_mismatch=self._request_mismatch)

    # -- the parts' state, under the names the API, tests and tools read ---------------------------
    size = property(lambda self: self.layout.size, lambda self, v: setattr(self.layout, "size", v))
    num_physical = property(lambda self: self.layout.num_physical,
                            lambda self, v: setattr(self.layout, "num_physical", v))
    workers = property(lambda self: self.registry.workers)
    events = property(lambda self: self.registry.events)
    operations = property(lambda self: self.book.operations)
    output_check = property(lambda self: self.outputs.state)
    timeline = property(lambda self: self.timelines.timeline)
    rebalance_windows = property(lambda self: self.timelines.rebalance_windows)
    _current = property(lambda self: self.book.current)
    _errors = property(lambda self: self.registry.errors)
    _done = property(lambda self: self.registry.done)
    _attempted = property(lambda self: self.executor.attempts)

    # -- lifecycle -------------------------------------------------------------------------
    def start(self) -> Coordinator:
        """Open the store, launch the first group and wait for every worker's first report. Once
        only: a second start (or one after :meth:`shutdown`) raises :class:`LifecycleError` and
        launches nothing. A start that raises leaves what it started to :meth:`shutdown`
        (``with Coordinator(...)`` calls it)."""
        with self._lock:
            if self._lifecycle != "new":
                raise LifecycleError("start", self._lifecycle)
            self._lifecycle = "started"
        initial = self.config.initial_placement  # checked at config load: a bad file never gets here
        self._initial_rows = None if initial is None else \
            tuple(tuple(row) for row in initial[0].physical_to_logical.tolist())
        if initial is not None:
            log.info("starting from the placement in %s, %s", self.config.eplb.initial_placement, initial[1])
        self._store = open_store(self.config.store_bind_host, self.config.launcher.store_port)
        # the placement kernels are compiled once, here, into numba's on-disk cache: local workers
        # then load them (0.3 s) instead of each compiling them (about 10 s of CPU on a machine's
        # first start, in the thread beside their heartbeats)
        warm_up()
        for rank in range(self.size):
            self._launch(rank, self.size, generation=0)
        self._threads = [threading.Thread(target=self._read_reports, name="coordinator-reports", daemon=True),
                         threading.Thread(target=self._watchdog, name="coordinator-watchdog", daemon=True)]
        if self.outputs.enabled:
            self._threads.append(threading.Thread(target=self.outputs.run, args=(self._stop,),
                                                  name="coordinator-output-check", daemon=True))
            self.outputs.wanted.set()  # a first check once the group serves
        if self.requests is not None:
            self.requests.start()
        for thread in self._threads:
            thread.start()
        # the watchdog finds a worker that never reported at worker_start and names it; this wait
        # ends a moment later so that the reason it raises is the named one
        self.registry.await_done(0, set(self.workers), "Started", self.config.timeouts.worker_start + 1.0,
                                 fail_machine=False)
        return self

    def __enter__(self) -> Coordinator:
        if self._lifecycle != "new":
            raise LifecycleError("start", self._lifecycle)  # before the try: a refused start stops nothing
        try:
            return self.start()
        except BaseException:
            self.shutdown()  # a with statement does not call __exit__ when __enter__ raises: nothing outlives it
            raise

    def _require_started(self, action: str, timeout: Any = 1.0) -> None:
        if self._lifecycle != "started":
            raise LifecycleError(action, self._lifecycle)
        if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or not 0 < timeout < math.inf:
            # before anything is sent: a rebalance asked with timeout=-1 started on every rank and was reported
            # failed ("did not finish within -1.0s"); a NaN one never timed out
            raise InvalidScaleRequest("timeout", f"{action}: expected a finite number of seconds > 0", value=timeout)

    def __exit__(self, *exc: Any) -> None:
        self.shutdown()

    def shutdown(self, timeout: float = 10.0) -> None:
        """Retire every worker (a Shutdown, then a kill past ``timeout``), stop the threads, join
        the operation threads (bounded) and close the store. Safe to call more than once, and
        before :meth:`start`; the coordinator cannot be started again."""
        with self._lock:
            self._lifecycle = "shut down"
        deadline = self.clock.monotonic() + timeout
        if self.requests is not None:
            self.requests.stop()  # every request still queued or decoding gets a 503 to retry elsewhere
        with self._lock:
            live = [w for w in self.workers.values() if w.handle.is_alive()]
            for w in live:
                w.expected_exit = True
        if live:
            try:
                self.registry.bus.send(lambda seq: p.Shutdown(seq=seq), live)
            except Exception:  # noqa: BLE001 - a queue to a dead process; we kill below anyway
                pass
            for w in live:
                w.handle.join(max(0.0, deadline - self.clock.monotonic()))
        self._stop.set()
        with self._reports:
            self._reports.notify_all()  # operation threads waiting on reports see the stop at once
        for thread in self._threads:
            thread.join(2)
        self.launcher.shutdown()  # kills whatever did not leave on its Shutdown
        for thread in list(self.executor.threads):
            thread.join(max(0.5, deadline - self.clock.monotonic()))
        if self._store is not None:
            store, self._store = self._store, None
            del store  # the TCPStore's server closes with its last reference

    def subscribe(self, callback: Callable[[str, dict[str, Any]], None]) -> None:
        """``callback(kind, data)`` for transitions, worker events and errors, operation updates,
        heartbeats and output checks (:mod:`elastic.control.events` names the kinds)."""
        self.hub.subscribe(callback)

    def subscribe_events(self, callback: Callable[[Event], None]) -> None:
        """``callback(event)`` with the typed events of :mod:`elastic.control.events`."""
        self.hub.subscribe_events(callback)

    def _launch(self, rank: int, size: int, generation: int, *, joining: bool = False,
                standby_seq: int = 0) -> WorkerRecord:
        """Start one worker: a rank of the first group, or (``joining``) one that stands by for
        the scale-up to ``size`` that will form ``generation``."""
        assert self._store is not None
        initial = self._initial_rows if generation == 0 and not joining else None
        spec = worker_spec(self.config, rank, size, generation, store_port=self._store.port, joining=joining,
                           standby_seq=standby_seq, faults=tuple(self.faults), initial_placement=initial)
        return self.registry.add(self.launcher.launch(spec), rank, generation, standby=joining)

    def _launch_joining(self, rank: int, size: int, generation: int, standby_seq: int) -> WorkerRecord:
        return self._launch(rank, size, generation, joining=True, standby_seq=standby_seq)

    # -- reports and the watchdog ------------------------------------------------------------
    def _read_reports(self) -> None:
        source = self.launcher.reports()
        while not self._stop.is_set():
            try:
                report = source.get(timeout=0.1)
            except queue.Empty:
                continue
            except (EOFError, OSError, ValueError):  # ValueError: the queue was closed at shutdown
                return
            self._file(report)

    def _file(self, report: p.Report) -> None:
        if isinstance(report, (p.TokensOut, p.RequestsHeld)):
            # tokens and the held list go to the request engine (only rank 0 of a group sends them); a
            # retired or replaced rank's last tokens are still good: the engine checks them by position
            if self.requests is not None:
                self.requests.on_tokens(report) if isinstance(report, p.TokensOut) else self.requests.on_held(report)
            return
        self.registry.file_report(report)
        if isinstance(report, p.Heartbeat) and report.waiting:
            return
        if isinstance(report, p.WorkerError) and report.where == "decode":
            self._broken.note(report)
        if isinstance(report, p.WorkerEvent):
            if report.kind == "rebalance_finished":
                self.outputs.wanted.set()  # experts moved: the output must not have changed
            if report.rank == 0:
                self.timelines.on_rebalance(report)
            self.hub.emit(WorkerEventSeen(report))
        elif isinstance(report, p.WorkerError):
            self.hub.emit(WorkerErrorSeen(report))
        elif isinstance(report, p.Heartbeat) and self.hub.active:
            self.hub.emit(HeartbeatSeen(report, self.clock.monotonic()))

    def _watchdog(self) -> None:
        while not self._stop.wait(0.05):
            try:
                self.watch_once()
            except Exception:  # noqa: BLE001 - the watchdog must outlive anything it looks at
                log.exception("watchdog iteration failed")

    def watch_once(self) -> None:
        """One look of the watchdog: an overdue phase, lost workers, a broken group, auto-recovery,
        retired workers to forget. Reads the injected clock only (a test calls it with a driven one)."""
        self.machine.fail_if_overdue()
        lost = self.registry.find_lost()
        for w in lost:  # logged in every state: one lost while failed is left out of the recovery
            log.warning("worker rank %d (pid %d, generation %d) lost in %s: %s", w.rank, w.pid,
                        w.generation, self.machine.state.value, w.lost_reason)
            note_lost_worker(self.launcher, w.handle)  # its host is left out until seen again
        if lost and self.machine.state != Phase.FAILED:
            reason = "; ".join(f"rank {w.rank} (pid {w.pid}) {w.lost_reason}" for w in lost)
            self._fail_machine(f"worker lost: {reason}")
        broken = self._broken.reason(busy=self.book.busy() is not None)
        if broken is not None:
            self._fail_machine(broken)
        self._maybe_auto_recover()
        current = self.book.busy()
        for record in self.registry.forget_exited(current.started_monotonic if current else None):
            forget = getattr(self.launcher, "forget", None)  # the local launcher's; others keep nothing
            if forget is not None:
                forget(record.handle)
        with self._reports:
            self._reports.notify_all()

    def _fail_machine(self, reason: str) -> None:
        try:
            self.machine.fail(reason=reason)
        except ElasticError:
            pass  # the state changed meanwhile

    def _maybe_auto_recover(self) -> None:
        if not self.config.auto_recover or self.machine.state != Phase.FAILED:
            return
        with self._lock:
            if self.book.busy() is not None:
                return
            if self._auto_recovering or not self.recovery_budget.spend():
                return
            self._auto_recovering = True

        def attempt() -> None:
            try:
                if self.recover(wait=True).status == OperationStatus.SUCCEEDED:
                    self.recovery_budget.recovered()
            except ElasticError as exc:
                log.warning("auto-recovery refused: %s", exc)
            finally:
                self._auto_recovering = False

        # off the watchdog thread: a recovery first waits for the workers to settle
        threading.Thread(target=attempt, name="coordinator-auto-recover", daemon=True).start()

    # -- serving requests (the request engine's gate) -----------------------------------------
    def send_serving(self, command: type[p.Command], **fields: Any) -> bool:
        """Send an Admit or Cancel to the serving group; False while it cannot decode (an
        operation replaces it, or it failed). Whatever the bus order against an operation's
        commands, every rank that will decode the request receives it (see docs/design.md)."""
        with self._lock:
            if self.machine.state not in SERVING_PHASES or self._stop.is_set():
                return False
            if any(spec.owner >= self.layout.size for spec in fields.get("requests", ())):
                return False  # owners chosen for a group the last rescale replaced: chosen again
            self.registry.broadcast(command, **fields)
        return True

    def group_size(self) -> int:
        with self._lock:
            return self.layout.size

    @property
    def auto_recoveries(self) -> int:
        """Automatic recoveries tried over the deployment's life (the budget is per incident)."""
        return self.recovery_budget.total

    def serving_health(self) -> str:
        state = self.machine.state
        if state in SERVING_PHASES:
            return "ok"
        if state != Phase.FAILED or self.book.busy() is not None:
            return "paused"  # a scale or a recovery is replacing the group
        if self._auto_recovering or (self.config.auto_recover and self.recovery_budget.left()):
            return "failed"  # a recovery is coming
        return "down"

    def _request_mismatch(self, completion: Completion, position: int, expected: int, got: int) -> None:
        self.outputs.request_mismatch(completion.id, position, expected, got)

    # -- scale and recovery ------------------------------------------------------------------
    def validate_size(self, ep_size: Any) -> int:
        if isinstance(ep_size, bool) or not isinstance(ep_size, int):
            raise InvalidScaleRequest("ep_size", "must be an integer", value=ep_size)
        problem = self.config.size_problem(ep_size)
        if problem:
            raise InvalidScaleRequest("ep_size", problem, value=ep_size)
        return ep_size

    def scale(self, ep_size: int, *, expected_generation: int | None = None, idempotency_key: str | None = None,
              wait: bool = True, timeout: float | None = None) -> Operation:
        """Scale to ``ep_size`` ranks. Raises a typed error (and changes nothing) when it cannot start.

        Returns the operation; with ``wait`` it has finished (succeeded, failed or no-op).
        """
        with self._lock:
            self.book.forget_old()
            earlier = self.book.by_idempotency_key(idempotency_key)
            if earlier is not None:
                if earlier.kind != OperationKind.SCALE or earlier.target_size != ep_size:
                    raise IdempotencyKeyReused(str(idempotency_key), earlier.id, f"{earlier.kind} to {earlier.target_size}")
                return earlier
            op = self._begin_scale(self.validate_size(ep_size), expected_generation, idempotency_key)
        if not op.terminal:
            self.executor.start(self.executor.run_scale, op)
        if wait:
            op.done.wait(timeout)
        return op

    def _begin_scale(self, ep_size: int, expected_generation: int | None, key: str | None) -> Operation:
        """Check a scale may start, and start it (a no-op is finished at once). Caller holds the lock."""
        m = self.machine
        if expected_generation is not None and expected_generation != m.generation:
            raise StaleGeneration(expected=expected_generation, actual=m.generation)
        current = self.book.busy()
        if current is not None:
            raise ScaleConflict(current.id, m.state, m.allowed())
        if ep_size == self.size and m.state == Phase.FAILED:  # not a no-op: the group is broken
            raise ScaleConflict(m.operation_id, m.state, m.allowed())
        if ep_size != self.size:  # a no-op needs no worker
            self._require_started(f"scale to {ep_size}")
        op = self.book.new(f"op-{uuid.uuid4().hex[:12]}", OperationKind.SCALE, ep_size, self.size, m.generation, key)
        if ep_size == self.size:
            op.status, op.phase, op.finished_at = OperationStatus.NOOP, OperationStage.NOOP.value, self.clock.wall()
            op.generation_after = m.generation
            op.done.set()
        elif self.before_scale:  # hooks first, on the operation thread; the machine moves only if they pass
            if m.state != Phase.RUNNING:
                raise ScaleConflict(m.operation_id, m.state, m.allowed())
            op.phase = OperationStage.BEFORE_HOOKS.value
        else:
            m.request_scale(operation_id=op.id, reason=f"scale {self.size} -> {ep_size}")
            op.status, op.phase = OperationStatus.RUNNING, Phase.DRAINING.value
        self.book.add(op, current=not op.terminal)
        return op

    def recover(self, *, wait: bool = True, timeout: float | None = None) -> Operation:
        """From ``failed``: rebuild a consistent group from the living workers (a new generation).

        Survivors are chosen only once no worker is still in the middle of a rescale (a failed
        attempt settles within about one collective timeout), so none is picked by a generation
        it is about to leave. The plan (:func:`~elastic.control.plans.plan_recovery`) names the
        survivors and every worker it retires; both are read from it once.
        """
        self._require_started("recover")
        self._check_recoverable()  # refused at once, before any wait
        self.registry.await_settled(self.config.timeouts.collective + 5.0)
        with self._lock:
            self._check_recoverable()
            self.book.forget_old()
            choice = self._recovery_choice()
            # too few survivors to hold every expert: fresh workers join the recovery, as few as needed
            target = self._recovery_size(choice.new_size)
            problem = self.config.size_problem(target)
            if problem:
                raise InvalidScaleRequest("ep_size", f"cannot recover with {len(choice.survivors)} living workers: {problem}")
            survivors = [self.workers[pid] for pid in choice.survivors]
            op = self.book.new(f"op-{uuid.uuid4().hex[:12]}", OperationKind.RECOVER, target, self.size,
                               self.machine.generation)
            for pid in choice.retire:
                self.workers[pid].expected_exit = True  # retired by this recovery: its death is no new failure
            if choice.generation != self.machine.generation:  # recover from the adopted attempt's layout
                self.size = choice.base_size
                self.num_physical = self.config.slots_per_rank * choice.base_size
            self.machine.recover(operation_id=op.id, reason=f"recover with {len(survivors)} living workers")
            op.status, op.phase = OperationStatus.RUNNING, Phase.RESCALING.value
            self.book.add(op, current=True)
        self.executor.start(self.executor.run_recovery, op, choice, survivors)
        if wait:
            op.done.wait(timeout)
        return op

    def _recovery_choice(self) -> RecoveryPlan:
        """The pure decision of who survives, over the registry's records. Caller holds the lock."""
        live = self.registry.live_workers()
        live_pids = {w.pid for w in live}
        attempts = {g: Attempt(n, frozenset(pid for pid, r in self._done.get(seq, {}).items()
                                            if isinstance(r.result, p.RescaleDone) and not r.result.retired))
                    for g, (n, seq) in self.executor.attempts.items()}
        # it refuses before the state changes when no one survives
        return plan_recovery([LiveWorker(w.pid, w.rank, w.generation) for w in live], attempts,
                             self.machine.generation, self.size, others=[pid for pid in self.workers if pid not in live_pids])

    def _recovery_size(self, survivors: int) -> int:
        """The survivors, or the fewest ranks at least as many that hold every logical expert (the
        slots per rank are fixed), when the launcher has room for the fresh ones."""
        size = survivors
        while self.config.size_problem(size) and size < self.config.max_ep_size:
            size += 1
        return size if not self.config.size_problem(size) else survivors

    def _check_recoverable(self) -> None:
        with self._lock:
            current = self.book.busy()
            if current is not None:
                raise ScaleConflict(current.id, self.machine.state, self.machine.allowed())
            if self.machine.state != Phase.FAILED:
                raise InvalidTransition(self.machine.state, Trigger.RECOVER, self.machine.allowed())

    def _on_finished(self, op: Operation) -> None:
        """An operation ended: the timeline shows it; a changed group's output is checked."""
        self.timelines.on_operation(op)
        if op.status == OperationStatus.SUCCEEDED:
            self.outputs.wanted.set()

    def _maybe_replace_lost(self, recovery: Operation) -> None:
        """``replace_lost``: a recovery that shrank the group is followed by a scale back to the
        size it had, with fresh workers in place of the lost ones, when the launcher has room."""
        if (recovery.kind != OperationKind.RECOVER or not self.config.replace_lost
                or recovery.target_size >= recovery.from_size):
            return
        try:
            op = self.scale(recovery.from_size, wait=False)
        except ElasticError as exc:  # no capacity, or another operation came first
            log.warning("not replacing the workers lost before %s: %s", recovery.id, exc)
            return
        with self._lock:
            op.cause = f"replace_lost after {recovery.id}"
        self.hub.emit(OperationChanged(op.to_dict()))
        log.info("replacing lost workers: %s scales %d -> %d", op.id, recovery.target_size, recovery.from_size)

    def get_operation(self, operation_id: str) -> dict[str, Any] | None:
        """A consistent copy of one operation (``Operation.to_dict``), or None for an unknown id."""
        return self.book.get(operation_id)

    def fired_faults(self) -> dict[int, int | None]:
        """Per fault that fires once (``faults.fires_once``: a kill, stall or drop_heartbeats without
        ``generation``), by its position in ``faults``: the generation it fired in, or None if no
        rank has fired it (the first rank to fire one binds it in the store). Call it before
        :meth:`shutdown`; a fault pinned to a generation is not tracked."""
        store = self._store
        if store is None:
            raise LifecycleError("read the fired faults", "shut down" if self._lifecycle == "shut down" else "new")
        out: dict[int, int | None] = {}
        for index, fault in enumerate(self.faults):
            if fires_once(fault):
                key = BOUND_KEY.format(index=index)
                out[index] = int(store.get(key)) if store.check([key]) else None
        return out

    def list_operations(self, limit: int | None = None) -> list[dict[str, Any]]:
        """Copies of the operations, newest first (at most ``limit``)."""
        return self.book.listing(limit)

    # -- other operations ------------------------------------------------------------------
    def _require_running(self, what: str) -> None:
        if self.machine.state != Phase.RUNNING:
            current = self.book.current
            raise ScaleConflict(current.id if current else None, self.machine.state, self.machine.allowed(),
                                trigger=what)

    def rebalance(self, timeout: float = 30.0) -> bool:
        """Ask every rank to start a rebalance at the next step boundary; True if one is under way on
        every rank then (this one, or one that was already running)."""
        self._require_started("rebalance", timeout)
        self._require_running("rebalance")
        seq, pids = self.registry.broadcast(p.RebalanceNow)
        try:
            reports = self.registry.await_done(seq, pids, "rebalance", timeout, fail_machine=False)
        except OperationFailed as exc:
            if "did not finish" in exc.reason:
                raise  # only the confirmation is missing: the command is on its way
            raise RebalanceFailed(exc.reason) from exc
        return all(isinstance(r.result, p.RebalanceAck) and r.result.started for r in reports.values())

    def verify(self, timeout: float = 60.0) -> dict[int, dict[str, Any]]:
        """Every rank checks every local slot bit-exactly; returns rank -> its verdict."""
        self._require_started("verify", timeout)
        seq, pids = self.registry.broadcast(p.Verify)
        reports = self.registry.await_done(seq, pids, "verify", timeout, fail_machine=False)
        return {r.rank: {**r.detail, "generation": r.generation, "step": r.step} for r in reports.values()}

    def reference_digest(self) -> str:
        return self.outputs.reference_digest()

    def probe(self, timeout: float = 60.0) -> dict[str, Any]:
        """Every rank decodes the fixed probe batch; the digests must equal the unsharded model's
        (:meth:`elastic.control.outputs.OutputCheck.probe`)."""
        self._require_started("probe", timeout)
        return self.outputs.probe(timeout)

    def export_placement(self, timeout: float = 30.0) -> dict[str, Any]:
        """The current placement and the load window as a placement file's content
        (:func:`eplb.placement_file.placement_document`), read at one agreed step on every rank.

        Only while ``running`` (during an operation the placement is about to change): else
        :class:`ScaleConflict`. Ranks that disagree (they never should) raise ``OperationFailed``.
        """
        self._require_started("export the placement", timeout)
        self._require_running("export the placement")
        seq, pids = self.registry.broadcast(p.ExportPlacement)
        reports = self.registry.await_done(seq, pids, "export placement", timeout, fail_machine=False)
        results = [r.result for r in sorted(reports.values(), key=lambda r: r.rank) if isinstance(r.result, p.PlacementExport)]
        if not results or len(results) != len(reports):
            raise OperationFailed("export placement", "no rank answered with its placement")
        first, step = results[0], max(r.step for r in reports.values())
        if any((r.digest, r.logical_load, r.window_steps) != (first.digest, first.logical_load, first.window_steps)
               for r in results):
            raise OperationFailed("export placement", "ranks disagree on the placement or the load window: digests "
                                                      f"{sorted({r.digest for r in results})}")
        return placement_document([list(row) for row in first.physical_to_logical],
                                  [list(row) for row in first.logical_load], ep_size=first.size,
                                  window_steps=first.window_steps, generation=self.machine.generation, step=step,
                                  digest=first.digest, exported_at=self.clock.wall())

    def wait_for_step(self, step: int, timeout: float = 60.0) -> int:
        """Block until every live worker has passed ``step``, or sleeps in an idle group (a real
        model with no request and no background load: no step comes until a request or a
        command); returns the slowest worker's step."""
        self._require_started(f"wait for step {step}", timeout)
        deadline = self.clock.monotonic() + timeout
        with self._reports:
            while True:
                beats = [w.heartbeat for w in self.live_workers()]
                steps = [b.step if b else 0 for b in beats]
                if steps and (min(steps) >= step or all(b is not None and b.idle for b in beats)):
                    return min(steps)
                if (self.machine.state == Phase.FAILED and self.book.busy() is None
                        and not self.registry.serving()):  # failed and not decoding: no step comes
                    raise OperationFailed(Phase.RUNNING.value, self.machine.failure_reason or "failed")
                if self.clock.monotonic() > deadline:
                    raise TimeoutError(f"workers at steps {steps} did not reach step {step} within {timeout}s")
                self._reports.wait(0.1)

    def live_workers(self) -> list[WorkerRecord]:
        return self.registry.live_workers()

    def timeline_windows(self) -> list[dict[str, Any]]:
        """Operations, failures and rebalances as wall-clock windows (``GET /timeline``)."""
        return self.timelines.windows()

    def snapshot(self) -> dict[str, Any]:
        """State, generation, size, balancedness, in-flight layer, per-rank status, history tail."""
        with self._lock:
            return snapshot_of(self.machine, self.registry, self.layout, self.book.current, self.outputs.state,
                               self.requests.stats() if self.requests is not None else None)
