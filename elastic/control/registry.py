"""The worker registry: the workers' records, their reports, their liveness, and the command bus.

Reports arrive on the launcher's queue and are filed here (:meth:`WorkerRegistry.file`):
heartbeats and phase reports keep a worker alive; ``PhaseDone`` reports are kept by command
seq for :meth:`WorkerRegistry.await_done`; errors and events are kept (bounded). Liveness
(:meth:`WorkerRegistry.find_lost`) reads the injected clock only, so a test moves a worker's
silence past its deadline without a sleep.

Commands reach every worker in the order of their sequence numbers, without gaps
(:class:`CommandBus`). A worker error is attributed to a command by the sequence number the
worker had taken up, never by comparing clocks across processes.
"""

from __future__ import annotations

import itertools
import logging
import threading
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from elastic.core import protocol as p
from elastic.core.clock import Clock
from elastic.core.config import TimeoutsConfig
from elastic.core.errors import ElasticError
from elastic.core.machine import ScaleMachine
from elastic.core.phases import Phase
from elastic.launch.launchers import WorkerHandle

__all__ = ["EXIT_GRACE_S", "CommandBus", "OperationFailed", "WorkerRecord", "WorkerRegistry"]

log = logging.getLogger("elastic.control.registry")

EXIT_GRACE_S = 0.3  # how long a dead worker's last reports get to arrive before it counts as lost


class OperationFailed(ElasticError):
    def __init__(self, phase: str, reason: str):
        self.phase, self.reason = phase, reason
        super().__init__(f"{phase}: {reason}")


@dataclass
class WorkerRecord:
    handle: WorkerHandle
    rank: int
    generation: int
    launched_at: float = 0.0  # the control plane's clock
    #: when its last report arrived; None until the first one (only ``worker_start`` applies then)
    last_report: float | None = None
    heartbeat: p.Heartbeat | None = None
    expected_exit: bool = False
    lost_reason: str | None = None
    dead_since: float | None = None  # first seen gone: a lost one gets EXIT_GRACE_S, a retired one is then forgotten
    standby: bool = False  # launched ahead of a scale-up, not yet sent its Rescale: in no group

    @property
    def pid(self) -> int:
        return self.handle.pid


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


class WorkerRegistry:
    """The workers by pid, what they reported, whether they live; the bus their commands go on."""

    def __init__(self, machine: ScaleMachine, timeouts: TimeoutsConfig, clock: Clock, history: int,
                 stop: threading.Event):
        self.machine = machine
        self.timeouts = timeouts
        self.clock = clock
        self.history = history
        self.stop = stop
        self.workers: dict[int, WorkerRecord] = {}  # by pid
        self.lock = threading.RLock()  # the coordinator's lock: records, operations, reports
        self.reports = threading.Condition(self.lock)
        self.done: dict[int, dict[int, p.PhaseDone]] = {}  # seq -> pid -> report (the newest seqs only)
        self.errors: deque[p.WorkerError] = deque(maxlen=history)
        self.events: deque[p.WorkerEvent] = deque(maxlen=10 * history)
        self.bus = CommandBus()

    # -- records ----------------------------------------------------------------------------------
    def add(self, handle: WorkerHandle, rank: int, generation: int, *, standby: bool = False) -> WorkerRecord:
        record = WorkerRecord(handle, rank, generation, standby=standby, launched_at=self.clock.monotonic())
        with self.lock:
            self.workers[handle.pid] = record
        return record

    def live_workers(self) -> list[WorkerRecord]:
        with self.lock:
            return sorted((w for w in self.workers.values() if not w.expected_exit and w.lost_reason is None
                           and not w.standby and w.handle.is_alive()), key=lambda w: w.rank)

    def broadcast(self, command_type: type, records: list[WorkerRecord] | None = None,
                  **fields: Any) -> tuple[int, set[int]]:
        """Send one command to ``records`` (default: the live workers, chosen under the bus lock);
        returns its seq and the pids it went to."""
        seq, sent = self.bus.send(lambda n: command_type(seq=n, **fields),
                                  records if records is not None else self.live_workers)
        return seq, {w.handle.pid for w in sent}

    # -- reports ----------------------------------------------------------------------------------
    def file_report(self, report: p.Report) -> None:
        """File a worker's report (liveness, phase results, errors, events); wakes every waiter."""
        with self.reports:
            record = self.workers.get(report.pid)
            if isinstance(report, p.Heartbeat) and report.waiting:
                # the step watch's: liveness only. Its state would hide a busy phase's ("rescaling",
                # which recovery waits out), and its empty counters would read as a stalled rank
                if record is not None:
                    record.last_report = self.clock.monotonic()
                return
            if record is not None:
                if isinstance(report, (p.Heartbeat, p.PhaseDone)):
                    # liveness is heartbeats (and phase reports): an EPLB thread's events can keep
                    # coming from a rank whose decode loop no longer reports
                    record.last_report = self.clock.monotonic()
                record.rank, record.generation = report.rank, report.generation
            if isinstance(report, p.Heartbeat) and record is not None:
                record.heartbeat = report
            elif isinstance(report, p.PhaseDone):
                self.done.setdefault(report.seq, {})[report.pid] = report
                self._forget_old_reports()
                if isinstance(report.result, p.RescaleDone) and report.result.retired and record is not None:
                    record.expected_exit = True
            elif isinstance(report, p.WorkerError):
                self.errors.append(report)
                log.warning("worker rank %d (pid %d): %s: %s", report.rank, report.pid, report.error_type, report.message)
            elif isinstance(report, p.WorkerEvent):
                self.events.append(report)
            self.reports.notify_all()

    def _forget_old_reports(self) -> None:
        """Keep the phase reports of the most recent command seqs (recovery reads a failed
        attempt's, so they outlive their wait): ``operation_history``, and never fewer than the
        few dozen an operation and concurrent API calls may still be waiting on. Oldest first by
        arrival (a standby's "ready" report has a negative seq)."""
        extra = len(self.done) - max(64, self.history)
        for seq in list(self.done)[:max(0, extra)]:
            del self.done[seq]

    def await_done(self, seq: int, pids: set[int], phase: str, deadline_s: float, *,
                   fail_machine: bool = True) -> dict[int, p.PhaseDone]:
        """Wait until every worker in ``pids`` reported ``seq`` done; raise on error, death or deadline.

        An error counts when the worker had taken up this command, or a later one, when it
        failed (``WorkerError.seq``; a rank whose group broke refuses the commands it then
        finds, naming each one's seq). Sequence numbers, never clocks: the worker's clock and
        this one's need not agree.
        """
        deadline = self.clock.monotonic() + deadline_s
        with self.reports:
            while True:
                done = self.done.get(seq, {})
                if pids <= done.keys():
                    return {pid: done[pid] for pid in pids}
                problem = self._why_not_done(seq, pids, done, phase, fail_machine)
                if problem:
                    raise OperationFailed(phase, problem)
                remaining = deadline - self.clock.monotonic()
                if remaining <= 0:
                    missing = sorted(self.workers[pid].rank for pid in pids - done.keys() if pid in self.workers)
                    raise OperationFailed(phase, f"ranks {missing} did not finish {phase} within {deadline_s:.1f}s")
                self.reports.wait(min(remaining, 0.1))

    def _why_not_done(self, seq: int, pids: set[int], done: dict[int, p.PhaseDone], phase: str,
                      fail_machine: bool) -> str | None:
        """Why the answers to ``seq`` will never all come (an error, a loss, a retirement, a stop)."""
        errors = [e for e in self.errors if e.pid in pids and e.seq >= seq]
        if errors:
            e = errors[-1]
            return f"rank {e.rank} failed in {e.where}: {e.error_type}: {e.message}"
        lost = [self.workers[pid] for pid in pids if pid in self.workers and self.workers[pid].lost_reason]
        if lost:
            return "; ".join(f"rank {w.rank} {w.lost_reason}" for w in lost)
        gone = [pid for pid in pids - done.keys() if pid not in self.workers]
        if gone:  # retired by a scale (and forgotten) before it answered: no answer will come
            return f"worker(s) {sorted(gone)} left the group (a scale retired them) before answering {phase}"
        if self.stop.is_set():
            return "the coordinator is shutting down"
        if fail_machine and self.machine.state == Phase.FAILED:
            return self.machine.failure_reason or "the machine failed"
        return None

    def await_settled(self, limit_s: float) -> None:
        """Wait (bounded) until no live worker reports being in the middle of a rescale or start."""
        busy_states = (p.WorkerMode.RESCALING, p.WorkerMode.STARTING)
        deadline = self.clock.monotonic() + limit_s
        with self.reports:
            while self.clock.monotonic() < deadline:
                busy = [w for w in self.live_workers() if w.heartbeat is not None and w.heartbeat.state in busy_states]
                if not busy:
                    return
                self.reports.wait(0.05)

    # -- liveness ---------------------------------------------------------------------------------
    def find_lost(self) -> list[WorkerRecord]:
        """Workers newly found lost: exited unexpectedly (at once), silent for ``heartbeat`` since
        their last report, or, before their first report (a process still importing, loading or
        hung), past ``worker_start`` since their launch. A worker's long preparation reports
        progress, so ``heartbeat`` governs it from its first report on."""
        now = self.clock.monotonic()
        newly = []
        with self.lock:
            for record in self.workers.values():
                if record.expected_exit or record.lost_reason is not None:
                    continue
                reason = self._lost_reason(record, now)
                if reason is not None:
                    record.lost_reason = reason
                    newly.append(record)
        return newly

    def _lost_reason(self, record: WorkerRecord, now: float) -> str | None:
        t = self.timeouts
        if not record.handle.is_alive():
            # a retiring worker reports and then exits: give its last reports a moment to be filed
            # before calling its exit unexpected
            record.dead_since = record.dead_since or now
            return "exited unexpectedly" if now - record.dead_since >= EXIT_GRACE_S else None
        if record.last_report is None:
            if now - record.launched_at <= t.worker_start:
                return None
            return f"sent no report within worker_start ({t.worker_start:g}s) of its launch: hung while starting"
        if now - record.last_report > t.heartbeat:
            return f"silent for {now - record.last_report:.1f}s (heartbeat timeout {t.heartbeat:g}s)"
        return None

    def forget_exited(self, busy_since: float | None) -> list[WorkerRecord]:
        """Drop (and return) the records of workers that left as expected, a moment after they died.

        While an operation runs (``busy_since``: when it began), one that died during it is kept
        (the operation may still wait on it). One that died before it began goes: back-to-back
        scales (an autoscaler) never leave a gap, and waiting for one kept every retired worker's
        record, queue and pipes (4 fds and a feeder thread per scale cycle, measured over 50 cycles).
        """
        now = self.clock.monotonic()
        gone = []
        with self.lock:
            for pid, record in list(self.workers.items()):
                if not record.expected_exit or record.handle.is_alive():
                    continue
                record.dead_since = record.dead_since or now
                if now - record.dead_since > max(2.0, 4 * EXIT_GRACE_S) and (
                        busy_since is None or record.dead_since < busy_since):
                    gone.append(self.workers.pop(pid))
        return gone

    def serving(self) -> bool:
        """Whether decoding runs. ``rescaling`` pauses it; in the other phases of an operation it
        runs unless a rank of the serving group reports its group broken. In ``failed`` the state
        alone does not tell (a deployment failed on a healthy group goes on decoding, one whose
        group broke does not): every rank of the serving group must say, in its last heartbeat,
        that it decodes. (The phases' own heartbeats may lag a step behind the machine, so they
        decide only where the machine's state cannot.)"""
        if self.machine.state == Phase.RESCALING:
            return False
        group = [w for w in self.live_workers() if w.generation == self.machine.generation]
        beats = [w.heartbeat.state for w in group if w.heartbeat is not None]
        if self.machine.state != Phase.FAILED:
            return bool(group) and p.WorkerMode.BROKEN not in beats
        return bool(group) and len(beats) == len(group) and all(state in p.DECODING_MODES for state in beats)
