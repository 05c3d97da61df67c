"""The coordinator: owns the state machine, the worker processes and the scale operations.

Threads, each with one job:

- the *report reader* takes worker reports off the launcher's queue and files them;
- the *watchdog* fails an overdue phase, notices dead or silent workers, and fails the
  machine with the reason (never a wait forever);
- one *operation* thread at a time runs a scale or a recovery phase by phase: it fires the
  trigger, sends the phase's command on the :class:`CommandBus`, and waits (with the phase
  deadline) for every worker's ``PhaseDone``.

Commands reach every worker in the order of their sequence numbers, without gaps: the bus
takes the number and enqueues under one lock. A worker error is attributed to a command by
the sequence number the worker had taken up, never by comparing clocks across processes.
What the coordinator remembers (operations, idempotency keys, reports, events, retired workers,
retired generations' store keys) is bounded by ``DeploymentConfig.operation_history``.
"""

from __future__ import annotations

import functools
import itertools
import logging
import queue
import threading
import time
import uuid
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any, Literal

import torch.distributed as dist

from elastic.control.budget import RecoveryBudget
from elastic.control.plans import Attempt, LiveWorker, plan_recovery
from elastic.core import protocol as p
from elastic.core.errors import (
    ElasticError,
    IdempotencyKeyReused,
    InvalidScaleRequest,
    InvalidTransition,
    RebalanceFailed,
    ScaleConflict,
    StaleGeneration,
)
from elastic.core.machine import Phase, ScaleMachine
from elastic.core.mapping import RankMapping
from elastic.core.phases import SERVING_PHASES
from elastic.core.worker_spec import WorkerSpec
from elastic.deployment import DeploymentConfig
from elastic.launch.factory import make_launcher
from elastic.launch.launchers import Launcher, WorkerHandle, note_lost_worker, plan_mapping
from elastic.serving.engine import Completion, RequestEngine
from elastic.worker.groups import abort_generation, open_store
from elastic.worker.liveness import WATCH_MARGIN_S
from eplb.algorithm import warm_up
from eplb.models.config import HFModelConfig
from eplb.placement_file import placement_document

log = logging.getLogger("elastic.control.coordinator")


EXIT_GRACE_S = 0.3  # how long a dead worker's last reports get to arrive before it counts as lost


class OperationStatus(StrEnum):
    PENDING = "pending"
    RUNNING = "running"
    SUCCEEDED = "succeeded"
    FAILED = "failed"
    NOOP = "noop"


@dataclass
class Operation:
    """A scale or recovery, as the API shows it."""

    id: str
    kind: str  # scale | recover
    target_size: int
    from_size: int
    generation_before: int
    status: OperationStatus = OperationStatus.PENDING
    phase: str = "pending"
    created_at: float = field(default_factory=time.time)
    started_monotonic: float = field(default_factory=time.monotonic)  # not reported: for this process's bookkeeping
    finished_at: float | None = None
    phases: dict[str, dict[str, float]] = field(default_factory=dict)
    error: str | None = None
    released_ranks: list[int] = field(default_factory=list)
    generation_after: int | None = None
    idempotency_key: str | None = None
    bytes_moved: int = 0
    paused_seconds: float | None = None
    #: layers whose maps differed between survivors when a recovery began (a torn commit)
    diverged_layers: list[int] = field(default_factory=list)
    cause: str | None = None  # why the control plane started it itself (replace_lost: the recovery it follows)
    #: the prepare sub-phase of draining (a scale with ``scaling.prepare``): standby group, pre-transfer
    prepare: dict[str, Any] = field(default_factory=dict)
    done: threading.Event = field(default_factory=threading.Event, repr=False)

    @property
    def terminal(self) -> bool:
        return self.status in (OperationStatus.SUCCEEDED, OperationStatus.FAILED, OperationStatus.NOOP)

    @property
    def effective_size(self) -> int:
        return self.target_size if self.status == OperationStatus.SUCCEEDED else self.from_size

    def to_dict(self) -> dict[str, Any]:
        return {
            "id": self.id, "kind": self.kind, "status": self.status.value, "phase": self.phase,
            "target_size": self.target_size, "from_size": self.from_size,
            "effective_size": self.effective_size,
            "pending_size": None if self.terminal else self.target_size,
            "generation_before": self.generation_before, "generation_after": self.generation_after,
            "phases": {name: dict(timing) for name, timing in self.phases.items()},  # a copy: safe to serialize later
            "error": self.error, "released_ranks": list(self.released_ranks),
            "created_at": self.created_at, "finished_at": self.finished_at,
            "idempotency_key": self.idempotency_key, "bytes_moved": self.bytes_moved,
            "paused_seconds": self.paused_seconds, "diverged_layers": list(self.diverged_layers),
            "cause": self.cause, "prepare": dict(self.prepare),
        }


class OperationFailed(ElasticError):
    def __init__(self, phase: str, reason: str):
        self.phase, self.reason = phase, reason
        super().__init__(f"{phase}: {reason}")


@dataclass
class WorkerRecord:
    handle: WorkerHandle
    rank: int
    generation: int
    launched_at: float = field(default_factory=time.monotonic)
    #: when its last report arrived; None until the first one (only ``worker_start`` applies then)
    last_report: float | None = None
    heartbeat: p.Heartbeat | None = None
    expected_exit: bool = False
    lost_reason: str | None = None
    dead_since: float | None = None  # first seen gone: a lost one gets EXIT_GRACE_S, a retired one is then forgotten
    standby: bool = False  # launched ahead of a scale-up, not yet sent its Rescale: in no group


@dataclass
class OperationRun:
    """What the executor carries through one operation's steps."""

    op: Operation
    mapping: RankMapping
    old: list[WorkerRecord]  # the ranks of the serving group that take part (a recovery: the survivors)
    lost: tuple[int, ...]  # old ranks whose weights are gone
    generation: int  # the generation the rescale forms
    standby_seq: int = 0  # the seq the joining ranks' "ready" reports carry
    joining: list[WorkerRecord] = field(default_factory=list)
    rescale_started: float = 0.0
    prepared: bool = False  # every rank reported its Prepare done: the rescale only switches


@dataclass(frozen=True)
class Step:
    """One row of an operation's table: in ``phase``, send a command to the ranks (``send``
    returns its seq and recipients), wait at most the ``deadline`` timeout for every rank's
    result, ``take`` what the operation needs from the results (returns the transition's
    reason), then fire ``trigger`` on the machine."""

    phase: Phase
    deadline: str  # the TimeoutsConfig field
    trigger: str | None  # the ScaleMachine method (None: the phase goes on with the next row)
    send: Callable[[Coordinator, OperationRun], tuple[int, set[int]]]
    take: Callable[[Coordinator, OperationRun, dict[int, p.PhaseDone]], str]
    wait_first: Callable[[Coordinator, OperationRun], None] | None = None  # another wait inside the phase
    on_failure: Callable[[Coordinator, OperationRun, OperationFailed], None] | None = None
    #: the row runs only when this says so (None: always); a skipped row still fires its trigger
    when: Callable[[Coordinator, OperationRun], bool] | None = None


class CommandBus:
    """Gap-free, ordered delivery of commands to the workers.

    Taking the sequence number, choosing the recipients and putting the command in each inbox
    are one atomic step, so every inbox receives its commands in sequence order. A worker
    waits (with a deadline) for exactly the next number it lacks and never skips one: the
    step-boundary agreement on the highest number received then never names a missing one.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._seq = itertools.count(1)

    def send(self, make: Callable[[int], p.Command],
             recipients: Callable[[], list[WorkerRecord]] | list[WorkerRecord]) -> tuple[int, list[WorkerRecord]]:
        """``make(seq)`` builds the command; ``recipients`` (or the callable's answer, taken under
        the lock) receive it. Returns the seq and the recipients."""
        with self._lock:
            seq = next(self._seq)
            command = make(seq)
            records = recipients() if callable(recipients) else list(recipients)
            for record in records:
                record.handle.inbox.put(command)
        return seq, records


class Coordinator:
    """Runs a deployment of EP workers and scales it through the state machine."""

    def __init__(self, config: DeploymentConfig, *, launcher: Launcher | None = None,
                 clock: Callable[[], float] = time.monotonic, faults: tuple[Any, ...] = ()):
        self.config = config
        self.launcher = launcher or make_launcher(config)  # config.launcher: local, command or ray
        self.clock = clock
        self.faults = faults
        self.machine = ScaleMachine(timeouts=config.timeouts, clock=clock)
        self.size = config.ep_size
        self.num_physical = config.num_physical
        self.workers: dict[int, WorkerRecord] = {}  # by pid
        self.operations: dict[str, Operation] = {}
        self._by_key: dict[str, tuple[str, float]] = {}  # idempotency key -> (operation id, when made)
        self._current: Operation | None = None
        self._lock = threading.RLock()
        self._reports = threading.Condition(self._lock)
        history = config.operation_history
        self._done: dict[int, dict[int, p.PhaseDone]] = {}  # seq -> pid -> report (the newest seqs only)
        self._errors: deque[p.WorkerError] = deque(maxlen=history)
        self._broken_group: tuple[float, p.WorkerError] | None = None  # the first broken-group report, while unexplained
        self.events: deque[p.WorkerEvent] = deque(maxlen=10 * history)
        self._bus = CommandBus()
        self._standby_ids = itertools.count(-1, -1)
        self._stop = threading.Event()
        self._threads: list[threading.Thread] = []
        self._operation_threads: list[threading.Thread] = []
        self._store: dist.TCPStore | None = None
        self._subscribers: list[Callable[[str, dict[str, Any]], None]] = []
        #: Called with the operation on its thread before a scale touches the machine; raising vetoes
        #: the scale (the operation fails with the error, the machine stays ``running``). See elastic.service.hooks.
        self.before_scale: list[Callable[[Operation], None]] = []
        self.recovery_budget = RecoveryBudget(config.max_auto_recoveries)  # per incident (elastic.control.budget)
        self._auto_recovering = False
        self._last_generation = 0
        self._attempted: dict[int, tuple[int, int]] = {}  # generation -> (size, command seq) of every rescale attempt
        self.machine.subscribe(lambda t: self._emit("transition", t.to_dict()))
        self.machine.subscribe(self._note_failure)
        #: the invariant as a product feature (Hugging Face models): after every scale, recovery and
        #: rebalance the probe batch's tokens and logits must equal the unsharded model's, bitwise
        self.output_check: dict[str, Any] = {"enabled": isinstance(config.model, HFModelConfig), "checks": 0,
                                             "mismatches": 0, "identical": None, "last": None}
        self._probe_wanted = threading.Event()
        self._reference_digest: str | None = None
        #: completion requests (a real model): queue, admission into the group's batch, tokens
        self.requests: RequestEngine | None = None
        if isinstance(config.model, HFModelConfig):
            self.requests = RequestEngine(self, config.serving, clock=clock, on_mismatch=self._request_mismatch)
        #: scales, recoveries and failures with wall-clock times (what a load generator shades); rebalances
        #: apart, so an idle deployment's frequent rebalances never push the operations out
        self.timeline: deque[dict[str, Any]] = deque(maxlen=10 * history)
        self.rebalance_windows: deque[dict[str, Any]] = deque(maxlen=1000)
        self._rebalance_open: dict[Any, dict[str, Any]] = {}
        self._initial_rows: tuple[tuple[int, ...], ...] | None = None  # eplb.initial_placement's, set at start

    # -- lifecycle -------------------------------------------------------------------------
    def start(self) -> Coordinator:
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
        if self.output_check["enabled"]:
            self._threads.append(threading.Thread(target=self._check_outputs, name="coordinator-output-check", daemon=True))
            self._probe_wanted.set()  # a first check once the group serves
        if self.requests is not None:
            self.requests.start()
        for thread in self._threads:
            thread.start()
        # the watchdog finds a worker that never reported at worker_start and names it; this wait
        # ends a moment later so that the reason it raises is the named one
        self._await(0, set(self.workers), "Started", self.config.timeouts.worker_start + 1.0, fail_machine=False)
        return self

    def __enter__(self) -> Coordinator:
        return self.start()

    def __exit__(self, *exc: Any) -> None:
        self.shutdown()

    def shutdown(self, timeout: float = 10.0) -> None:
        """Retire every worker (a Shutdown, then a kill past ``timeout``), stop the threads, join
        the operation threads (bounded) and close the store. Safe to call more than once."""
        deadline = time.monotonic() + timeout
        if self.requests is not None:
            self.requests.stop()  # every request still queued or decoding gets a 503 to retry elsewhere
        with self._lock:
            live = [w for w in self.workers.values() if w.handle.is_alive()]
            for w in live:
                w.expected_exit = True
        if live:
            try:
                self._bus.send(lambda seq: p.Shutdown(seq=seq), live)
            except Exception:  # noqa: BLE001 - a queue to a dead process; we kill below anyway
                pass
            for w in live:
                w.handle.join(max(0.0, deadline - time.monotonic()))
        self._stop.set()
        with self._reports:
            self._reports.notify_all()  # operation threads waiting on reports see the stop at once
        for thread in self._threads:
            thread.join(2)
        self.launcher.shutdown()  # kills whatever did not leave on its Shutdown
        for thread in list(self._operation_threads):
            thread.join(max(0.5, deadline - time.monotonic()))
        if self._store is not None:
            store, self._store = self._store, None
            del store  # the TCPStore's server closes with its last reference

    def subscribe(self, callback: Callable[[str, dict[str, Any]], None]) -> None:
        """``callback(kind, data)`` for transitions, worker events and errors, operation updates and heartbeats."""
        self._subscribers.append(callback)

    def _emit(self, kind: str, data: dict[str, Any]) -> None:
        for callback in list(self._subscribers):
            try:
                callback(kind, data)
            except Exception:  # noqa: BLE001 - a subscriber never breaks the control plane
                log.exception("subscriber failed on %s", kind)

    def _launch(self, rank: int, size: int, generation: int, *, joining: bool = False, standby_seq: int = 0) -> WorkerRecord:
        """Start one worker: a rank of the first group, or (``joining``) one that stands by for
        the scale-up to ``size`` that will form ``generation``."""
        assert self._store is not None
        cfg = self.config
        t = cfg.timeouts
        spec = WorkerSpec(
            rank=rank, size=size, generation=generation, store_host=cfg.store_advertise_host, store_port=self._store.port,
            shape=cfg.model, eplb=cfg.eplb, trace=tuple((ph.start_step, ph.trace) for ph in cfg.trace),
            seed=cfg.seed, num_physical=cfg.slots_per_rank * size, backend=cfg.backend,
            # a peer waits a moment longer than worker_start for a rank that never shows up, so the
            # coordinator names the hung rank (lost at worker_start) before the peer's rendezvous fails
            collective_timeout_s=t.collective, join_timeout_s=t.worker_start + 2.0,
            heartbeat_s=cfg.heartbeat_s, step_delay_s=cfg.step_delay_s, joining=joining, standby_seq=standby_seq,
            serving=cfg.serving,
            # standing by lasts through draining and suppressed (the scale fails past those)
            standby_timeout_s=t.worker_start + t.draining + t.suppressed,
            faults=tuple(self.faults),
            initial_placement=self._initial_rows if generation == 0 and not joining else None,
        )
        handle = self.launcher.launch(spec)
        record = WorkerRecord(handle, rank, generation, standby=joining, launched_at=time.monotonic())
        with self._lock:
            self.workers[handle.pid] = record
        return record

    # -- reports ---------------------------------------------------------------------------
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

    def _start_operation(self, target: Callable[..., None], op: Operation, *args: Any) -> None:
        thread = threading.Thread(target=target, args=(op, *args), name=f"operation-{op.id}", daemon=True)
        with self._lock:
            self._operation_threads = [t for t in self._operation_threads if t.is_alive()] + [thread]
        thread.start()

    def _file(self, report: p.Report) -> None:
        if isinstance(report, (p.TokensOut, p.RequestsHeld)):
            self._file_serving(report)
            return
        if isinstance(report, p.Heartbeat) and report.waiting:
            # the step watch's: liveness only. Its state would hide a busy phase's ("rescaling",
            # which recovery waits out), and its empty counters would read as a stalled rank
            with self._reports:
                record = self.workers.get(report.pid)
                if record is not None:
                    record.last_report = time.monotonic()
            return
        with self._reports:
            record = self.workers.get(report.pid)
            if record is not None:
                if isinstance(report, (p.Heartbeat, p.PhaseDone)):
                    # liveness is heartbeats (and phase reports): an EPLB thread's events can keep
                    # coming from a rank whose decode loop no longer reports
                    record.last_report = time.monotonic()
                record.rank, record.generation = report.rank, report.generation
            if isinstance(report, p.Heartbeat) and record is not None:
                record.heartbeat = report
            elif isinstance(report, p.PhaseDone):
                self._done.setdefault(report.seq, {})[report.pid] = report
                self._forget_old_reports()
                if isinstance(report.result, p.RescaleDone) and report.result.retired and record is not None:
                    record.expected_exit = True
            elif isinstance(report, p.WorkerError):
                self._errors.append(report)
                log.warning("worker rank %d (pid %d): %s: %s", report.rank, report.pid, report.error_type, report.message)
            elif isinstance(report, p.WorkerEvent):
                self.events.append(report)
            self._reports.notify_all()
        if isinstance(report, p.WorkerError) and report.where == "decode":
            self._note_broken_group(report)
        if isinstance(report, p.WorkerEvent) and report.kind == "rebalance_finished":
            self._probe_wanted.set()  # experts moved: the output must not have changed
        if isinstance(report, p.WorkerEvent) and report.rank == 0:
            self._note_rebalance(report)
        if isinstance(report, p.WorkerEvent):
            self._emit("worker_event", {"rank": report.rank, "step": report.step, "kind": report.kind, **report.data})
        elif isinstance(report, p.WorkerError):
            self._emit("worker_error", {"rank": report.rank, "step": report.step, "error": f"{report.error_type}: {report.message}"})
        elif isinstance(report, p.Heartbeat) and self._subscribers:
            self._emit("heartbeat", {"rank": report.rank, "generation": report.generation, "pid": report.pid,
                                     "step": report.step, "step_seconds": report.step_seconds,
                                     "balancedness": report.balancedness, "state": report.state,
                                     "in_flight_layer": report.in_flight_layer, "rank_load": report.rank_load,
                                     "progress": report.progress, "received": time.monotonic()})

    def _file_serving(self, report: p.TokensOut | p.RequestsHeld) -> None:
        """Tokens and the held list go to the request engine (only rank 0 of a group sends them)."""
        if self.requests is None:
            return
        # a retired or replaced rank's last tokens are still good: the engine checks them by position
        if isinstance(report, p.TokensOut):
            self.requests.on_tokens(report)
        else:
            self.requests.on_held(report)

    def _note_failure(self, transition: Any) -> None:
        """A failure opens a timeline window; the recovery that brings the group back closes it."""
        if transition.dest == Phase.FAILED and not any(w["kind"] == "failure" and w["ended_at"] is None
                                                       for w in self.timeline):
            self.timeline.append({"kind": "failure", "id": f"failure-{transition.seq}", "started_at": time.time(),
                                  "ended_at": None, "reason": transition.reason})
        elif transition.dest == Phase.RUNNING:
            for window in self.timeline:
                if window["kind"] == "failure" and window["ended_at"] is None:
                    window["ended_at"] = time.time()

    def _note_operation(self, op: Operation) -> None:
        """A finished scale or recovery as a timeline window, with its pause (``rescaling``) in wall time."""
        offset = time.time() - time.monotonic()
        window: dict[str, Any] = {"kind": op.kind, "id": op.id, "status": op.status.value,
                                  "started_at": op.created_at, "ended_at": op.finished_at}
        rescaling = op.phases.get(Phase.RESCALING.value)
        if rescaling and "ended" in rescaling:
            window["pause"] = [rescaling["started"] + offset, rescaling["ended"] + offset]
        self.timeline.append(window)

    def _note_rebalance(self, report: p.WorkerEvent) -> None:
        """Rank 0's rebalance events as timeline windows (wall clock, the worker's)."""
        key = report.data.get("id")
        fresh: dict[str, Any] = {"kind": "rebalance", "id": f"rebalance-{report.generation}-{key}",
                                 "started_at": report.at, "ended_at": None}
        if report.kind == "rebalance_started":
            while len(self._rebalance_open) >= 16:  # never finished (the group broke): bounded
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

    # -- serving requests (elastic.serving.engine's gate) -----------------------------------------
    def send_serving(self, command: type[p.Command], **fields: Any) -> bool:
        """Send an Admit or Cancel to the serving group; False while it cannot decode (an
        operation replaces it, or it failed). Whatever the bus order against an operation's
        commands, every rank that will decode the request receives it (see docs/design.md)."""
        with self._lock:
            if self.machine.state not in SERVING_PHASES or self._stop.is_set():
                return False
            self._broadcast(command, **fields)
        return True

    @property
    def auto_recoveries(self) -> int:
        """Automatic recoveries tried over the deployment's life (the budget is per incident)."""
        return self.recovery_budget.total

    def serving_health(self) -> str:
        state = self.machine.state
        if state in SERVING_PHASES:
            return "ok"
        if state != Phase.FAILED or (self._current is not None and not self._current.terminal):
            return "paused"  # a scale or a recovery is replacing the group
        if self._auto_recovering or (self.config.auto_recover and self.recovery_budget.left()):
            return "failed"  # a recovery is coming
        return "down"

    def _request_mismatch(self, completion: Completion, position: int, expected: int, got: int) -> None:
        with self._lock:
            self.output_check["mismatches"] += 1
            self.output_check["identical"] = False
            self.output_check["last"] = {"identical": False, "request": completion.id, "position": position,
                                         "expected": expected, "got": got}
        log.error("output changed: request %s token %d replayed as %d, was %d", completion.id, position, got, expected)

    def _forget_old_reports(self) -> None:
        """Keep the phase reports of the most recent command seqs (recovery reads a failed
        attempt's, so they outlive their wait): ``operation_history``, and never fewer than the
        few dozen an operation and concurrent API calls may still be waiting on. Oldest first by
        arrival (a standby's "ready" report has a negative seq)."""
        extra = len(self._done) - max(64, self.config.operation_history)
        for seq in list(self._done)[:max(0, extra)]:
            del self._done[seq]

    def _note_broken_group(self, report: p.WorkerError) -> None:
        with self._lock:
            if self._broken_group is None:
                self._broken_group = (time.monotonic(), report)

    def _fail_if_group_broken(self) -> None:
        """A worker's group broke while no operation runs and, one heartbeat deadline (plus the step
        watch's margin and 0.5 s) later, no
        worker is lost or silent (a collective failed, nobody died or hung): the deployment no
        longer decodes, so it is ``failed``; broken ranks keep beating, so silence never comes.
        The wait lets a dead or stuck peer be found first, so the reason names the culprit and
        recovery leaves it out. An operation in flight sees the report in :meth:`_await` itself."""
        with self._lock:
            if self._broken_group is None:
                return
            since, report = self._broken_group
            record = self.workers.get(report.pid)
            if (record is None or record.expected_exit or report.generation != self.machine.generation
                    or self.machine.state == Phase.FAILED):
                self._broken_group = None  # superseded: retired, recovered, or already failed
                return
            # a culprit stuck inside its step is reported for by its step watch up to WATCH_MARGIN_S
            # past the collective timeout its victims waited out: it falls silent that much later
            if (self._current is not None and not self._current.terminal) \
                    or time.monotonic() - since < self.config.timeouts.heartbeat + WATCH_MARGIN_S + 0.5:
                return
            self._broken_group = None
        try:
            self.machine.fail(reason=f"rank {report.rank} group broken, no worker lost: {report.error_type}: {report.message}")
        except ElasticError:
            pass  # the state changed meanwhile

    def _watchdog(self) -> None:
        while not self._stop.wait(0.05):
            try:
                self.machine.fail_if_overdue()
                lost = self._find_lost()
                for w in lost:  # logged in every state: one lost while failed is left out of the recovery
                    log.warning("worker rank %d (pid %d, generation %d) lost in %s: %s", w.rank, w.handle.pid,
                                w.generation, self.machine.state.value, w.lost_reason)
                    note_lost_worker(self.launcher, w.handle)  # its host is left out until seen again
                if lost and self.machine.state not in (Phase.FAILED,):
                    reason = "; ".join(f"rank {w.rank} (pid {w.handle.pid}) {w.lost_reason}" for w in lost)
                    try:
                        self.machine.fail(reason=f"worker lost: {reason}")
                    except ElasticError:
                        pass
                self._fail_if_group_broken()
                self._maybe_auto_recover()
                self._forget_exited()
                with self._reports:
                    self._reports.notify_all()
            except Exception:  # noqa: BLE001 - the watchdog must outlive anything it looks at
                log.exception("watchdog iteration failed")

    def _maybe_auto_recover(self) -> None:
        if not self.config.auto_recover or self.machine.state != Phase.FAILED:
            return
        with self._lock:
            if self._current is not None and not self._current.terminal:
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

    def _find_lost(self) -> list[WorkerRecord]:
        """Workers newly found lost: exited unexpectedly (at once), silent for ``heartbeat`` since
        their last report, or, before their first report (a process still importing, loading or
        hung), past ``worker_start`` since their launch. A worker's long preparation reports
        progress, so ``heartbeat`` governs it from its first report on."""
        timeouts = self.config.timeouts
        now = time.monotonic()
        newly = []
        with self._lock:
            for record in self.workers.values():
                if record.expected_exit or record.lost_reason is not None:
                    continue
                if not record.handle.is_alive():
                    # a retiring worker reports and then exits: give its last reports a moment to
                    # be filed before calling its exit unexpected
                    record.dead_since = record.dead_since or now
                    if now - record.dead_since < EXIT_GRACE_S:
                        continue
                    record.lost_reason = "exited unexpectedly"
                elif record.last_report is None:
                    if now - record.launched_at <= timeouts.worker_start:
                        continue
                    record.lost_reason = (f"sent no report within worker_start ({timeouts.worker_start:g}s) of its "
                                          f"launch: hung while starting")
                elif now - record.last_report > timeouts.heartbeat:
                    record.lost_reason = (f"silent for {now - record.last_report:.1f}s "
                                          f"(heartbeat timeout {timeouts.heartbeat:g}s)")
                else:
                    continue
                newly.append(record)
        return newly

    def _forget_exited(self) -> None:
        """Drop the records (and launcher handles, inboxes) of workers that left as expected, and
        the store keys of generations no worker uses any more: a scale cycle leaves nothing behind."""
        now = time.monotonic()
        gone = []
        with self._lock:
            current = self._current if self._current is not None and not self._current.terminal else None
            for pid, record in list(self.workers.items()):
                if not record.expected_exit or record.handle.is_alive():
                    continue
                record.dead_since = record.dead_since or now
                # kept a moment for its last reports; and while an operation runs, kept if it died
                # during it (the operation may still wait on it). One that died before the running
                # operation began goes: back-to-back scales (an autoscaler) never leave a gap, and
                # waiting for one kept every retired worker's record, queue and pipes (4 fds and a
                # feeder thread per scale cycle, measured over 50 cycles)
                if now - record.dead_since > max(2.0, 4 * EXIT_GRACE_S) and (
                        current is None or record.dead_since < current.started_monotonic):
                    gone.append(self.workers.pop(pid))
        for record in gone:
            forget = getattr(self.launcher, "forget", None)
            if forget is not None:
                forget(record.handle)

    def _delete_retired_generations(self) -> None:
        """Delete the store keys of generations older than the serving one (after a Resume: no
        worker is in them, and a recovery starts from the serving one or a newer attempt)."""
        self._forget_attempts()
        store = self._store
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

    # -- commands --------------------------------------------------------------------------
    def live_workers(self) -> list[WorkerRecord]:
        with self._lock:
            return sorted((w for w in self.workers.values() if not w.expected_exit and w.lost_reason is None
                           and not w.standby and w.handle.is_alive()), key=lambda w: w.rank)

    def _broadcast(self, command_type: type, records: list[WorkerRecord] | None = None, **fields: Any) -> tuple[int, set[int]]:
        """Send one command to ``records`` (default: the live workers, chosen under the bus lock);
        returns its seq and the pids it went to."""
        seq, sent = self._bus.send(lambda n: command_type(seq=n, **fields),
                                   records if records is not None else self.live_workers)
        return seq, {w.handle.pid for w in sent}

    def _await(self, seq: int, pids: set[int], phase: str, deadline_s: float, *, fail_machine: bool = True,
               operation: Operation | None = None) -> dict[int, p.PhaseDone]:
        """Wait until every worker in ``pids`` reported ``seq`` done; raise on error, death or deadline.

        An error counts when the worker had taken up this command, or a later one, when it
        failed (``WorkerError.seq``; a rank whose group broke refuses the commands it then
        finds, naming each one's seq). Sequence numbers, never clocks: the worker's clock and
        this one's need not agree.
        """
        deadline = time.monotonic() + deadline_s
        with self._reports:
            while True:
                done = self._done.get(seq, {})
                if pids <= done.keys():
                    return {pid: done[pid] for pid in pids}
                errors = [e for e in self._errors if e.pid in pids and e.seq >= seq]
                if errors:
                    e = errors[-1]
                    raise OperationFailed(phase, f"rank {e.rank} failed in {e.where}: {e.error_type}: {e.message}")
                lost = [self.workers[pid] for pid in pids if pid in self.workers and self.workers[pid].lost_reason]
                if lost:
                    raise OperationFailed(phase, "; ".join(f"rank {w.rank} {w.lost_reason}" for w in lost))
                gone = [pid for pid in pids - done.keys() if pid not in self.workers]
                if gone:  # retired by a scale (and forgotten) before it answered: no answer will come
                    raise OperationFailed(phase, f"worker(s) {sorted(gone)} left the group (a scale retired them) "
                                                 f"before answering {phase}")
                if self._stop.is_set():
                    raise OperationFailed(phase, "the coordinator is shutting down")
                if fail_machine and self.machine.state == Phase.FAILED:
                    raise OperationFailed(phase, self.machine.failure_reason or "the machine failed")
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    missing = sorted(self.workers[pid].rank for pid in pids - done.keys() if pid in self.workers)
                    raise OperationFailed(phase, f"ranks {missing} did not finish {phase} within {deadline_s:.1f}s")
                self._reports.wait(min(remaining, 0.1))

    # -- scale -----------------------------------------------------------------------------
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
            self._forget_old_operations()
            if idempotency_key is not None and idempotency_key in self._by_key:
                earlier = self.operations[self._by_key[idempotency_key][0]]
                if earlier.kind != "scale" or earlier.target_size != ep_size:
                    raise IdempotencyKeyReused(idempotency_key, earlier.id, f"{earlier.kind} to {earlier.target_size}")
                return earlier
            ep_size = self.validate_size(ep_size)
            if expected_generation is not None and expected_generation != self.machine.generation:
                raise StaleGeneration(expected=expected_generation, actual=self.machine.generation)
            if self._current is not None and not self._current.terminal:
                raise ScaleConflict(self._current.id, self.machine.state, self.machine.allowed())
            op = Operation(id=f"op-{uuid.uuid4().hex[:12]}", kind="scale", target_size=ep_size,
                           from_size=self.size, generation_before=self.machine.generation,
                           idempotency_key=idempotency_key)
            if ep_size == self.size and self.machine.state == Phase.FAILED:  # not a no-op: the group is broken
                raise ScaleConflict(self.machine.operation_id, self.machine.state, self.machine.allowed())
            if ep_size == self.size:
                op.status, op.phase, op.finished_at = OperationStatus.NOOP, "noop", time.time()
                op.generation_after = self.machine.generation
                op.done.set()
            elif self.before_scale:  # hooks first, on the operation thread; the machine moves only if they pass
                if self.machine.state != Phase.RUNNING:
                    raise ScaleConflict(self.machine.operation_id, self.machine.state, self.machine.allowed())
                op.phase = "before_hooks"
                self._current = op
            else:
                self.machine.request_scale(operation_id=op.id, reason=f"scale {self.size} -> {ep_size}")
                op.status, op.phase = OperationStatus.RUNNING, Phase.DRAINING.value
                self._current = op
            self.operations[op.id] = op
            if idempotency_key is not None:
                self._by_key[idempotency_key] = (op.id, self.clock())
        if not op.terminal:
            self._start_operation(self._run_operation, op)
        if wait:
            op.done.wait(timeout)
        return op

    def recover(self, *, wait: bool = True, timeout: float | None = None) -> Operation:
        """From ``failed``: rebuild a consistent group from the living workers (a new generation).

        Survivors are chosen only once no worker is still in the middle of a rescale (a failed
        attempt settles within about one collective timeout), so none is picked by a generation
        it is about to leave.
        """
        self._check_recoverable()  # refused at once, before any wait
        self._await_settled(self.config.timeouts.collective + 5.0)
        with self._lock:
            self._check_recoverable()
            self._forget_old_operations()
            live = self.live_workers()
            attempts = {g: Attempt(n, frozenset(pid for pid, r in self._done.get(seq, {}).items()
                                                if isinstance(r.result, p.RescaleDone) and not r.result.retired))
                        for g, (n, seq) in self._attempted.items()}
            # a pure decision (elastic.control.plans); it refuses before the state changes when no one survives
            plan = plan_recovery([LiveWorker(w.handle.pid, w.rank, w.generation) for w in live], attempts,
                                 self.machine.generation, self.size)
            # too few survivors to hold every expert: fresh workers join the recovery, as few as needed
            target = self._recovery_size(plan.new_size)
            problem = self.config.size_problem(target)
            if problem:
                raise InvalidScaleRequest("ep_size", f"cannot recover with {len(plan.survivors)} living workers: {problem}")
            survivors = [self.workers[pid] for pid in plan.survivors]
            lost_ranks = plan.lost_ranks
            op = Operation(id=f"op-{uuid.uuid4().hex[:12]}", kind="recover", target_size=target,
                           from_size=self.size, generation_before=self.machine.generation)
            keep = set(plan.survivors)
            for w in self.workers.values():
                if w.handle.pid not in keep:
                    w.expected_exit = True  # retired by this recovery: its death is no new failure
            if plan.generation != self.machine.generation:  # recover from the adopted attempt's layout
                self.size = plan.base_size
                self.num_physical = self.config.slots_per_rank * plan.base_size
            self.machine.recover(operation_id=op.id, reason=f"recover with {len(survivors)} living workers")
            op.status, op.phase = OperationStatus.RUNNING, Phase.RESCALING.value
            self._current = op
            self.operations[op.id] = op
        self._start_operation(self._run_recovery, op, survivors, lost_ranks)
        if wait:
            op.done.wait(timeout)
        return op

    def _recovery_size(self, survivors: int) -> int:
        """The survivors, or the fewest ranks at least as many that hold every logical expert (the
        slots per rank are fixed), when the launcher has room for the fresh ones."""
        size = survivors
        while self.config.size_problem(size) and size < self.config.max_ep_size:
            size += 1
        return size if not self.config.size_problem(size) else survivors

    def _check_recoverable(self) -> None:
        with self._lock:
            if self._current is not None and not self._current.terminal:
                raise ScaleConflict(self._current.id, self.machine.state, self.machine.allowed())
            if self.machine.state != Phase.FAILED:
                raise InvalidTransition(self.machine.state, "recover", self.machine.allowed())

    def _forget_old_operations(self) -> None:
        """Keep the newest ``operation_history`` finished operations; an idempotency key lives as
        long as its operation, and at most ``idempotency_ttl_s``."""
        history, ttl = self.config.operation_history, self.config.idempotency_ttl_s
        finished = sorted((o for o in self.operations.values() if o.terminal), key=lambda o: o.created_at)
        for op in finished[:max(0, len(finished) - history)]:
            del self.operations[op.id]
        now = self.clock()
        for key, (op_id, made) in list(self._by_key.items()):
            if op_id not in self.operations or now - made > ttl:
                del self._by_key[key]

    def _await_settled(self, limit_s: float) -> None:
        """Wait (bounded) until no live worker reports being in the middle of a rescale or start."""
        deadline = time.monotonic() + limit_s
        with self._reports:
            while time.monotonic() < deadline:
                busy = [w for w in self.live_workers() if w.heartbeat is not None and w.heartbeat.state in ("rescaling", "starting")]
                if not busy:
                    return
                self._reports.wait(0.05)

    def _enter(self, op: Operation, phase: str) -> None:
        now = time.monotonic()
        with self._lock:  # readers (snapshot, get_operation) copy the op under the same lock
            previous = op.phase
            if previous in op.phases and "ended" not in op.phases[previous]:
                op.phases[previous]["ended"] = now
                op.phases[previous]["seconds"] = now - op.phases[previous]["started"]
            op.phase = phase
            op.phases[phase] = {"started": now}
            data = op.to_dict()
        self._emit("operation", data)

    def _finish(self, op: Operation, status: OperationStatus, error: str | None = None) -> None:
        self._enter(op, status.value)
        with self._lock:
            op.phases.pop(status.value, None)
            op.status, op.error, op.finished_at = status, error, time.time()
            op.generation_after = self.machine.generation
            data = op.to_dict()
            self._forget_old_operations()
            if status != OperationStatus.NOOP:
                self._note_operation(op)
        if status == OperationStatus.SUCCEEDED:
            self._probe_wanted.set()  # the group changed: check the output once it serves
        self._emit("operation", data)
        op.done.set()

    def _run_before_hooks(self, op: Operation) -> bool:
        """Run the before-scale hooks; True when the scale may go on (the machine is then ``draining``)."""
        self._enter(op, "before_hooks")
        for hook in list(self.before_scale):
            try:
                hook(op)
            except Exception as exc:  # noqa: BLE001 - a veto: the operation fails, the machine is untouched
                reason = str(exc) if isinstance(exc, ElasticError) else f"before-scale hook failed: {type(exc).__name__}: {exc}"
                self._finish(op, OperationStatus.FAILED, reason)
                return False
        with self._lock:
            try:
                self.machine.request_scale(operation_id=op.id, reason=f"scale {self.size} -> {op.target_size}")
            except ElasticError as exc:  # e.g. a worker was lost while the hooks ran
                self._finish(op, OperationStatus.FAILED, str(exc))
                return False
            op.status = OperationStatus.RUNNING
        self._enter(op, Phase.DRAINING.value)
        return True

    def _run_operation(self, op: Operation) -> None:
        if op.status == OperationStatus.PENDING and not self._run_before_hooks(op):
            return
        run: OperationRun | None = None
        try:
            with self._lock:
                op.phases.setdefault(Phase.DRAINING.value, {"started": time.monotonic()})
            old = self.live_workers()
            # the new group's layout is fixed now (hosts contiguous), and its joining ranks start
            # at once: process start and weight allocation overlap draining, not the pause
            mapping = plan_mapping(self.launcher, [w.handle for w in old], self.size, op.target_size)
            # the joining ranks report "ready" (weights allocated, registered) under a negative
            # number: command seqs must stay contiguous, and no command has one
            run = OperationRun(op, mapping, old, lost=(), generation=self._reserve_generation(),
                               standby_seq=next(self._standby_ids))
            for rank in mapping.joining:  # one by one: a launch that fails leaves the others retirable
                run.joining.append(self._launch(rank, mapping.new_size, run.generation, joining=True,
                                                standby_seq=run.standby_seq))
            self._execute_steps(run, SCALE_STEPS)
            self._finish(op, OperationStatus.SUCCEEDED)
            self._delete_retired_generations()
        except (OperationFailed, ElasticError) as exc:
            self._retire_standby(run.joining if run else [])
            self._fail(op, str(exc))
        except Exception as exc:  # noqa: BLE001 - an operation thread reports, never raises across threads
            log.exception("operation %s crashed", op.id)
            self._retire_standby(run.joining if run else [])
            self._fail(op, f"{type(exc).__name__}: {exc}")

    def _execute_steps(self, run: OperationRun, steps: tuple[Step, ...]) -> None:
        """The one executor of a plan's steps: enter the phase, send its command on the bus,
        await every rank's typed result within the phase's deadline, take what the step needs
        from the results, fire the step's trigger. Raises :class:`OperationFailed` on the first
        error, loss or deadline (the caller fails the operation)."""
        for step in steps:
            if run.op.phase != step.phase.value:
                self._enter(run.op, step.phase.value)
            if step.when is not None and not step.when(self, run):
                if step.trigger is not None:
                    getattr(self.machine, step.trigger)(reason=f"{step.phase.value} done; row skipped by configuration")
                continue
            seq, pids = step.send(self, run)
            if step.wait_first is not None:
                step.wait_first(self, run)
            try:
                reports = self._await(seq, pids, step.phase.value, getattr(self.config.timeouts, step.deadline),
                                      operation=run.op)
            except OperationFailed as exc:
                if step.on_failure is not None:
                    step.on_failure(self, run, exc)
                raise
            reason = step.take(self, run, reports)
            if step.trigger is None:
                continue
            trigger = getattr(self.machine, step.trigger)
            if step.trigger == "rescaled":
                trigger(generation=run.generation, reason=reason)
            else:
                trigger(reason=reason)

    # -- what each step sends, awaits and takes (SCALE_STEPS / RECOVERY_STEPS below) ----------
    def _send_drain(self, run: OperationRun) -> tuple[int, set[int]]:
        return self._broadcast(p.Drain, records=run.old, operation_id=run.op.id)

    def _await_joiners_ready(self, run: OperationRun) -> None:
        """The pause starts only once the joining ranks are ready: the old group decodes meanwhile."""
        if run.joining:
            self._await(run.standby_seq, {w.handle.pid for w in run.joining}, run.op.phase,
                        self.config.timeouts.worker_start, operation=run.op)

    def _wants_prepare(self, run: OperationRun) -> bool:
        return self.config.scaling.prepare

    def _execute_on(self, run: OperationRun) -> Literal["old", "new"]:
        """Scale down moves over the old group (the leaving ranks send); scale up and recovery over the new."""
        return "old" if run.mapping.new_size < len(run.mapping.old_to_new) and not run.lost else "new"

    def _rescale_spec(self, run: OperationRun) -> p.RescaleSpec:
        """What the operation's rescale means, the same in its Prepare, Suppress and Rescale."""
        return p.RescaleSpec(generation=run.generation, new_size=run.mapping.new_size,
                             mapping=tuple(run.mapping.old_to_new), lost=tuple(run.lost), execute_on=self._execute_on(run),
                             keep_requests=run.op.kind != "recover")

    def _send_prepare(self, run: OperationRun) -> tuple[int, set[int]]:
        """The prepare sub-phase of draining goes to the old group and to the joining ranks (standing by)."""
        scaling = self.config.scaling
        members = list(run.old) + list(run.joining)
        # the pre-transfer holds a layer only while the rest, back to back, would still end within 80%
        # of what is left of the draining deadline: a slow link makes the prepare cost throughput for
        # less of it, and does not make the scale overrun
        in_draining = time.monotonic() - run.op.phases[Phase.DRAINING.value]["started"]
        paced_for = max(0.0, 0.8 * (self.config.timeouts.draining - in_draining))
        command = functools.partial(p.Prepare, operation_id=run.op.id, spec=self._rescale_spec(run), paced_for_s=paced_for,
                                    prestage_max_bytes=int(scaling.prestage_max_bytes),
                                    prestage_share=scaling.prestage_share)
        seq, _ = self._bus.send(lambda n: command(seq=n), members)
        with self._lock:
            run.op.phases[Phase.DRAINING.value]["prepare_started"] = time.monotonic()
        return seq, {w.handle.pid for w in members}

    def _take_prepare(self, run: OperationRun, reports: dict[int, p.PhaseDone]) -> str:
        """Every rank prepared: keep what the operation shows (pre-transfer, standby group) and switch at the rescale."""
        results = [r.result for r in reports.values() if isinstance(r.result, p.PrepareDone)]
        run.prepared = True
        summary = {
            "seconds": max(r.seconds for r in results),
            "group_seconds": max(r.group_seconds for r in results),
            "layers": max(r.layers for r in results), "layers_total": max(r.layers_total for r in results),
            "bytes_received": sum(r.bytes_received for r in results),
            "prestage_bytes": max(r.prestage_bytes for r in results),
            "steps": max(r.steps for r in results),
            "steady_step_seconds": max(r.steady_step_seconds for r in results),
            "started_at": min(r.started_at for r in results), "ended_at": max(r.ended_at for r in results),
        }
        with self._lock:
            run.op.prepare = summary
            run.op.phases[Phase.DRAINING.value]["prepare_ended"] = time.monotonic()
        return (f"standby group formed; {summary['layers']} of {summary['layers_total']} changed layers "
                f"({summary['bytes_received']} bytes) moved ahead of the pause")

    def _send_suppress(self, run: OperationRun) -> tuple[int, set[int]]:
        # a scale down is announced: its placement is computed while the ranks still decode (a
        # prepared one computed it at Prepare)
        down = run.mapping.new_size < self.size and not run.prepared
        return self._broadcast(p.Suppress, records=run.old, operation_id=run.op.id,
                               announced=self._rescale_spec(run) if down else None)

    def _send_rescale(self, run: OperationRun) -> tuple[int, set[int]]:
        """The Rescale goes to the surviving ranks of the old group and to the joining ranks
        (standing by since the operation began)."""
        new_size = run.mapping.new_size
        members = [w for w in run.old if w.rank not in run.lost] + list(run.joining)

        def command(seq: int) -> p.Rescale:
            self._attempted[run.generation] = (new_size, seq)
            for w in run.joining:
                w.standby = False  # in the new group from here on (a failed attempt's recovery retires it)
            # a recovery's survivors may hold a request's KV cache mid-step: its batch starts empty, and
            # the request engine replays every request from its prompt (elastic.serving.engine)
            return p.Rescale(seq=seq, operation_id=run.op.id, spec=self._rescale_spec(run), prepared=run.prepared)

        seq, _ = self._bus.send(command, members)
        self._forget_attempts()
        run.rescale_started = time.monotonic()
        return seq, {w.handle.pid for w in members}

    def _abandon_generation(self, run: OperationRun, exc: OperationFailed) -> None:
        """Ranks still waiting to join the attempted generation give up now, not at their deadline."""
        if self._store is not None:
            abort_generation(self._store, run.generation, f"rescale attempt abandoned: {exc}")

    def _take_rescale(self, run: OperationRun, reports: dict[int, p.PhaseDone]) -> str:
        """Check the ranks agree on the new maps, let the retired ranks go, adopt the new size."""
        op = run.op
        results = {pid: r.result for pid, r in reports.items() if isinstance(r.result, p.RescaleDone)}
        # the pause is the ranks that go on decoding: a leaving rank's rescale ends with its report
        op.paused_seconds = max((r.seconds for r in results.values() if not r.retired),
                                default=max(r.seconds for r in results.values()))
        op.bytes_moved = sum(r.bytes_received for r in results.values())
        op.diverged_layers = sorted({layer for r in results.values() for layer in r.diverged_layers})
        kept = [r for r in results.values() if not r.retired]
        digests = {r.digest for r in kept}
        if len(digests) != 1:
            raise OperationFailed("rescaling", f"ranks disagree on the new placement: digests {sorted(map(str, digests))}")
        retired = [self.workers[pid] for pid, r in results.items() if r.retired]
        for w in retired:
            w.expected_exit = True
            if not w.handle.join(max(1.0, self.config.timeouts.collective)):
                w.handle.kill()
        op.released_ranks = sorted(w.rank for w in retired)
        new_size = run.mapping.new_size
        with self._lock:
            self.size = new_size
            self.num_physical = kept[0].num_physical or self.num_physical
        log.info("rescaled to %d ranks (generation %d) in %.2fs", new_size, run.generation,
                 time.monotonic() - run.rescale_started)
        return f"group of {new_size} formed, experts redistributed"

    def _send_resume(self, run: OperationRun) -> tuple[int, set[int]]:
        return self._broadcast(p.Resume, operation_id=run.op.id)

    def _reserve_generation(self) -> int:
        """The next generation number. One is never reused, even after a failed attempt: its
        store keys may linger."""
        with self._lock:
            self._last_generation = max(self._last_generation, self.machine.generation) + 1
            return self._last_generation

    def _retire_standby(self, joining: list[WorkerRecord]) -> None:
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

    def _fail(self, op: Operation, reason: str) -> None:
        """The operation failed: the machine goes to ``failed``. If the group was not being
        replaced (the failure came before ``rescaling``: a phase overran, joining ranks were not
        ready, a launch failed), the old group is still whole and decoding: its EPLB is stopped
        on every live rank (bounded), so nothing moves experts while the deployment is failed and
        a recovery finds every rank ready to rescale at its first attempt."""
        healthy_group = op.phase in (Phase.DRAINING.value, Phase.SUPPRESSED.value, "before_hooks", "pending")
        if self.machine.state != Phase.FAILED:
            try:
                self.machine.fail(reason=reason)
            except ElasticError:
                pass
        if healthy_group and not self._stop.is_set():
            self._stop_eplb_everywhere()
        self._finish(op, OperationStatus.FAILED, reason)

    def _stop_eplb_everywhere(self) -> None:
        try:
            seq, pids = self._broadcast(p.StopEPLB)
            self._await(seq, pids, "failed", self.config.timeouts.suppressed, fail_machine=False)
        except OperationFailed as exc:  # a rank broke or died meanwhile: recovery leaves it out
            log.warning("stopping the EPLB after a failure: %s", exc)

    def _forget_attempts(self) -> None:
        """Rescale attempts older than the serving generation can no longer be recovered from."""
        with self._lock:
            for g in [g for g in self._attempted if g <= self.machine.generation]:
                del self._attempted[g]

    def _run_recovery(self, op: Operation, survivors: list[WorkerRecord], lost_ranks: tuple[int, ...]) -> None:
        run: OperationRun | None = None
        try:
            without = RankMapping.without(self.size, lost_ranks)
            mapping = RankMapping(without.old_to_new, op.target_size)  # fresh ranks after the survivors, if any
            keep = {w.handle.pid for w in survivors}
            for w in list(self.workers.values()):
                if w.handle.pid not in keep and w.handle.is_alive():
                    w.expected_exit = True
                    w.handle.kill()  # retired: a fresh rank of a failed attempt, or a lost one
            run = OperationRun(op, mapping, survivors, lost=lost_ranks, generation=self._reserve_generation(),
                               standby_seq=next(self._standby_ids))
            for rank in mapping.joining:  # the survivors alone cannot hold the model
                run.joining.append(self._launch(rank, mapping.new_size, run.generation, joining=True,
                                                standby_seq=run.standby_seq))
            if run.joining:
                self._await_joiners_ready(run)
            self._execute_steps(run, RECOVERY_STEPS)
            self._finish(op, OperationStatus.SUCCEEDED)
            self._delete_retired_generations()
            self._maybe_replace_lost(op)
        except (OperationFailed, ElasticError) as exc:
            self._retire_standby(run.joining if run else [])
            self._fail(op, str(exc))
        except Exception as exc:  # noqa: BLE001
            log.exception("recovery %s crashed", op.id)
            self._retire_standby(run.joining if run else [])
            self._fail(op, f"{type(exc).__name__}: {exc}")

    # -- the output never changes when experts move (Hugging Face models) ---------------------
    def reference_digest(self) -> str:
        """The probe digest of the unsharded single-process model (built once, in this process,
        with one intra-op thread like the workers: the bits depend on the thread count)."""
        if self._reference_digest is None:
            import torch

            from eplb.models.hf import reference_probe

            model = self.config.model
            assert isinstance(model, HFModelConfig), "only a real model has a probe"
            threads = torch.get_num_threads()
            torch.set_num_threads(1)
            try:
                self._reference_digest = reference_probe(model).digest
            finally:
                torch.set_num_threads(threads)
        return self._reference_digest

    def probe(self, timeout: float = 60.0) -> dict[str, Any]:
        """Every rank decodes the fixed probe batch; the digests must equal the unsharded model's.

        Returns ``{"identical", "digests" (rank -> digest), "reference", "generation", "step"}``
        and records it in ``output_check`` (a mismatch counts in ``mismatches``).
        """
        if not self.output_check["enabled"]:
            raise InvalidScaleRequest("model", "the probe compares a real model's output (model kind hf); the "
                                      "reference model is checked slot by slot with verify()")
        reference = self.reference_digest()  # built first: it can take a while, the check below must not age
        with self._lock:
            # the probe is a collective of the group: never while an operation is replacing it. One
            # that starts right after this check sends its Drain after the Probe (the bus keeps the
            # order), so every rank still runs the probe in the old group
            if self._current is not None and not self._current.terminal:
                raise ScaleConflict(self._current.id, self.machine.state, self.machine.allowed(), trigger="probe")
        seq, pids = self._broadcast(p.Probe)
        if not pids:  # between groups (a rank just died): nothing to compare, and no verdict
            raise OperationFailed("probe", "no live rank to probe")
        reports = self._await(seq, pids, "probe", timeout, fail_machine=False)
        digests = {r.rank: r.result.digest for r in reports.values() if isinstance(r.result, p.ProbeDone)}
        identical = bool(digests) and all(d == reference for d in digests.values())
        result = {"identical": identical, "digests": digests, "reference": reference,
                  "generation": self.machine.generation, "step": max((r.step for r in reports.values()), default=0)}
        with self._lock:
            self.output_check["checks"] += 1
            self.output_check["mismatches"] += 0 if identical else 1
            self.output_check["identical"] = identical
            self.output_check["last"] = result
        if not identical:
            log.error("output changed: probe digests %s differ from the unsharded model's %s", digests, reference)
        self._emit("output_check", result)
        return result

    def _check_outputs(self) -> None:
        """Probe once the group serves again after a scale, a recovery or a rebalance."""
        while not self._stop.is_set():
            if not self._probe_wanted.wait(0.2):
                continue
            with self._lock:
                busy = self._current is not None and not self._current.terminal
            if busy or self.machine.state != Phase.RUNNING:
                continue  # checked once the operation ends (its end sets the flag again)
            self._probe_wanted.clear()
            try:
                self.probe(timeout=self.config.timeouts.collective * 2)
            except (ElasticError, OperationFailed) as exc:
                log.warning("output check skipped: %s", exc)
            except Exception:  # noqa: BLE001 - the checker thread must outlive one bad probe
                log.exception("output check failed")

    def _maybe_replace_lost(self, recovery: Operation) -> None:
        """``replace_lost``: a recovery that shrank the group is followed by a scale back to the
        size it had, with fresh workers in place of the lost ones, when the launcher has room."""
        if not self.config.replace_lost or recovery.target_size >= recovery.from_size:
            return
        try:
            op = self.scale(recovery.from_size, wait=False)
        except ElasticError as exc:  # no capacity, or another operation came first
            log.warning("not replacing the workers lost before %s: %s", recovery.id, exc)
            return
        with self._lock:
            op.cause = f"replace_lost after {recovery.id}"
        log.info("replacing lost workers: %s scales %d -> %d", op.id, recovery.target_size, recovery.from_size)

    def get_operation(self, operation_id: str) -> dict[str, Any] | None:
        """A consistent copy of one operation (``Operation.to_dict``), or None for an unknown id."""
        with self._lock:
            op = self.operations.get(operation_id)
            return op.to_dict() if op is not None else None

    def list_operations(self, limit: int | None = None) -> list[dict[str, Any]]:
        """Copies of the operations, newest first (at most ``limit``)."""
        with self._lock:
            ops = sorted(self.operations.values(), key=lambda o: o.created_at, reverse=True)
            return [o.to_dict() for o in ops[:limit]]

    # -- other operations ------------------------------------------------------------------
    def rebalance(self, timeout: float = 30.0) -> bool:
        """Ask every rank to start a rebalance at the next step boundary; True if one is under way on
        every rank then (this one, or one that was already running)."""
        if self.machine.state != Phase.RUNNING:
            raise ScaleConflict(self._current.id if self._current else None, self.machine.state, self.machine.allowed(),
                                trigger="rebalance")
        seq, pids = self._broadcast(p.RebalanceNow)
        try:
            reports = self._await(seq, pids, "rebalance", timeout, fail_machine=False)
        except OperationFailed as exc:
            if "did not finish" in exc.reason:
                raise  # only the confirmation is missing: the command is on its way
            raise RebalanceFailed(exc.reason) from exc
        return all(isinstance(r.result, p.RebalanceAck) and r.result.started for r in reports.values())

    def verify(self, timeout: float = 60.0) -> dict[int, dict[str, Any]]:
        """Every rank checks every local slot bit-exactly; returns rank -> its verdict."""
        seq, pids = self._broadcast(p.Verify)
        reports = self._await(seq, pids, "verify", timeout, fail_machine=False)
        return {r.rank: {**r.detail, "generation": r.generation, "step": r.step} for r in reports.values()}

    def export_placement(self, timeout: float = 30.0) -> dict[str, Any]:
        """The current placement and the load window as a placement file's content
        (:func:`eplb.placement_file.placement_document`), read at one agreed step on every rank.

        Only while ``running`` (during an operation the placement is about to change): else
        :class:`ScaleConflict`. Ranks that disagree (they never should) raise ``OperationFailed``.
        """
        if self.machine.state != Phase.RUNNING:
            raise ScaleConflict(self._current.id if self._current else None, self.machine.state, self.machine.allowed(),
                                trigger="export the placement")
        seq, pids = self._broadcast(p.ExportPlacement)
        reports = self._await(seq, pids, "export placement", timeout, fail_machine=False)
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
                                  digest=first.digest, exported_at=time.time())

    def wait_for_step(self, step: int, timeout: float = 60.0) -> int:
        """Block until every live worker has passed ``step``; returns the slowest worker's step."""
        deadline = time.monotonic() + timeout
        with self._reports:
            while True:
                steps = [w.heartbeat.step if w.heartbeat else 0 for w in self.live_workers()]
                if steps and min(steps) >= step:
                    return min(steps)
                if (self.machine.state == Phase.FAILED and (self._current is None or self._current.terminal)
                        and not self._serving(self.live_workers())):  # failed and not decoding: no step comes
                    raise OperationFailed("running", self.machine.failure_reason or "failed")
                if time.monotonic() > deadline:
                    raise TimeoutError(f"workers at steps {steps} did not reach step {step} within {timeout}s")
                self._reports.wait(0.1)

    def _serving(self, live: list[WorkerRecord]) -> bool:
        """Whether decoding runs. ``rescaling`` pauses it; in the other phases of an operation it
        runs unless a rank of the serving group reports its group broken. In ``failed`` the state
        alone does not tell (a deployment failed on a healthy group goes on decoding, one whose
        group broke does not): every rank of the serving group must say, in its last heartbeat,
        that it decodes. (The phases' own heartbeats may lag a step behind the machine, so they
        decide only where the machine's state cannot.)"""
        if self.machine.state == Phase.RESCALING:
            return False
        group = [w for w in live if w.generation == self.machine.generation]
        beats = [w.heartbeat.state for w in group if w.heartbeat is not None]
        if self.machine.state != Phase.FAILED:
            return bool(group) and p.WorkerMode.BROKEN not in beats
        return bool(group) and len(beats) == len(group) and all(state in p.DECODING_MODES for state in beats)

    @staticmethod
    def _eplb_health(eplb: list[dict[str, Any]]) -> dict[str, Any]:
        """The async EPLB's health over the ranks: degraded when any rank's is, with its last error."""
        degraded = [e for e in eplb if e.get("health") == "degraded"]
        last = next((e.get("last_error") for e in degraded or eplb if e.get("last_error")), None)
        return {"status": "degraded" if degraded else "healthy", "last_error": last,
                "restarts": max((e.get("restarts", 0) for e in eplb), default=0),
                "rebalances_failed": max((e.get("rebalances_failed", 0) for e in eplb), default=0)}

    def snapshot(self) -> dict[str, Any]:
        """State, generation, size, balancedness, in-flight layer, per-rank status, history tail."""
        with self._lock:
            live = self.live_workers()
            beats = [w.heartbeat for w in live if w.heartbeat is not None]
            eplb = [b.eplb for b in beats]
            return {
                "state": self.machine.state.value,
                "generation": self.machine.generation,
                "ep_size": self.size,
                "num_physical": self.num_physical,
                "serving": self._serving(live),
                "balancedness": min((b.balancedness for b in beats), default=None),
                "step": min((b.step for b in beats), default=0),
                "in_flight_layer": next((b.in_flight_layer for b in beats if b.in_flight_layer is not None), None),
                "operation": self._current.to_dict() if self._current is not None else None,
                "failure_reason": self.machine.failure_reason,
                "eplb_health": self._eplb_health(eplb),
                # every rank records the same all-reduced counts: any rank's summary of its last step
                "eplb_layer_balancedness": next((e["layer_balancedness"] for e in eplb if e.get("layer_balancedness")), None),
                "output_check": {k: v for k, v in self.output_check.items()},
                "ranks": [{"rank": w.rank, "pid": w.handle.pid, "generation": w.generation,
                           "step": w.heartbeat.step if w.heartbeat else 0,
                           "state": str(w.heartbeat.state) if w.heartbeat else p.WorkerMode.STARTING.value,
                           "requests": w.heartbeat.requests if w.heartbeat else 0,
                           "progress": list(w.heartbeat.progress) if w.heartbeat and w.heartbeat.progress else None}
                          for w in live],
                "rebalances": max((e.get("rebalances_finished", 0) for e in eplb), default=0),
                "layers_committed": max((e.get("layers_committed", 0) for e in eplb), default=0),
                "bytes_moved": sum(e.get("bytes_moved", 0) for e in eplb),
                "watchdog_stalls": sum(e.get("watchdog_stalls", 0) for e in eplb),
                "history": [t.to_dict() for t in self.machine.history()[-20:]],
                "requests": self.requests.stats() if self.requests is not None else None,
            }


def _said(reason: str) -> Callable[[Coordinator, OperationRun, dict[int, p.PhaseDone]], str]:
    return lambda coordinator, run, reports: reason


# -- the operations as tables of steps, run by Coordinator._execute_steps -------------------------

#: a scale from ``running`` (the before-scale hooks ran and the machine is ``draining``)
SCALE_STEPS: tuple[Step, ...] = (
    # finish in-flight layers, start nothing new; decoding goes on; joining ranks get ready meanwhile
    Step(Phase.DRAINING, "draining", None, send=Coordinator._send_drain,
         wait_first=Coordinator._await_joiners_ready,
         take=_said("every in-flight layer committed on every rank")),
    # the prepare sub-phase, still decoding: the plan, the standby group, the pre-transfer
    Step(Phase.DRAINING, "draining", "drained", send=Coordinator._send_prepare, take=Coordinator._take_prepare,
         when=Coordinator._wants_prepare, on_failure=Coordinator._abandon_generation),
    # join the EPLB threads everywhere; a scale down's placement is computed now, still decoding
    Step(Phase.SUPPRESSED, "suppressed", "suppressed", send=Coordinator._send_suppress,
         take=lambda c, run, reports: f"EPLB threads joined; mapping {run.mapping}"),
    # move experts, replace the group (decoding paused)
    Step(Phase.RESCALING, "rescaling", "rescaled", send=Coordinator._send_rescale, take=Coordinator._take_rescale,
         on_failure=Coordinator._abandon_generation),
    # rebuild the EPLB group and restart the async worker
    Step(Phase.RESUMING, "resuming", "resumed", send=Coordinator._send_resume,
         take=_said("EPLB group rebuilt and async worker restarted on every rank")),
)

#: a recovery from ``failed`` (the machine is ``rescaling``): the same rescale and resume, over the survivors
RECOVERY_STEPS: tuple[Step, ...] = SCALE_STEPS[3:]
