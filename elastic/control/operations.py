"""Operations as the API shows them, and the book that keeps them (bounded, with idempotency keys).

An :class:`Operation` is a scale or a recovery: its status, the phase it is in, each phase's
start and end on the control plane's clock, and what it moved. :class:`OperationBook` holds
them (the newest ``operation_history`` finished ones), the one in progress, and the
idempotency keys, and records phase changes; it never talks to a worker.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any

from elastic.core.clock import Clock
from elastic.core.phases import OperationKind, OperationStage

__all__ = ["GroupLayout", "Operation", "OperationBook", "OperationStatus"]


class OperationStatus(StrEnum):
    PENDING = "pending"
    RUNNING = "running"
    SUCCEEDED = "succeeded"
    FAILED = "failed"
    NOOP = "noop"


@dataclass
class GroupLayout:
    """The serving group's size and slot count (the executor changes them at a rescale)."""

    size: int
    num_physical: int


@dataclass
class Operation:
    """A scale or recovery, as the API shows it. Times: ``created_at``/``finished_at`` wall clock,
    ``phases`` and ``started_monotonic`` the control plane's monotonic clock."""

    id: str
    kind: str  # OperationKind: scale | recover
    target_size: int
    from_size: int
    generation_before: int
    status: OperationStatus = OperationStatus.PENDING
    phase: str = OperationStage.PENDING.value
    created_at: float = 0.0
    started_monotonic: float = 0.0  # not reported: for this process's bookkeeping
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


class OperationBook:
    """The operations (bounded), the one in progress, the idempotency keys; phase bookkeeping."""

    def __init__(self, clock: Clock, lock: threading.RLock, history: int, idempotency_ttl_s: float):
        self.clock = clock
        self.lock = lock
        self.history = history
        self.ttl = idempotency_ttl_s
        self.operations: dict[str, Operation] = {}
        self.by_key: dict[str, tuple[str, float]] = {}  # idempotency key -> (operation id, when made)
        self.current: Operation | None = None

    def new(self, op_id: str, kind: OperationKind, target_size: int, from_size: int, generation: int,
            idempotency_key: str | None = None) -> Operation:
        return Operation(id=op_id, kind=kind.value, target_size=target_size, from_size=from_size,
                         generation_before=generation, idempotency_key=idempotency_key,
                         created_at=self.clock.wall(), started_monotonic=self.clock.monotonic())

    def busy(self) -> Operation | None:
        """The operation in progress, or None."""
        current = self.current
        return current if current is not None and not current.terminal else None

    def add(self, op: Operation, *, current: bool) -> None:
        """Keep ``op`` (and its idempotency key); ``current``: it is the one in progress. Caller holds the lock."""
        self.operations[op.id] = op
        if current:
            self.current = op
        if op.idempotency_key is not None:
            self.by_key[op.idempotency_key] = (op.id, self.clock.monotonic())

    def by_idempotency_key(self, key: str | None) -> Operation | None:
        if key is None or key not in self.by_key:
            return None
        return self.operations.get(self.by_key[key][0])

    def forget_old(self) -> None:
        """Keep the newest ``operation_history`` finished operations; an idempotency key lives as
        long as its operation, and at most ``idempotency_ttl_s``. Caller holds the lock."""
        finished = sorted((o for o in self.operations.values() if o.terminal), key=lambda o: o.created_at)
        for op in finished[:max(0, len(finished) - self.history)]:
            del self.operations[op.id]
        now = self.clock.monotonic()
        for key, (op_id, made) in list(self.by_key.items()):
            if op_id not in self.operations or now - made > self.ttl:
                del self.by_key[key]

    def enter(self, op: Operation, phase: str) -> dict[str, Any]:
        """``op`` enters ``phase`` (the previous one ends now); returns the operation's copy."""
        now = self.clock.monotonic()
        with self.lock:  # readers (snapshot, get_operation) copy the op under the same lock
            previous = op.phase
            if previous in op.phases and "ended" not in op.phases[previous]:
                op.phases[previous]["ended"] = now
                op.phases[previous]["seconds"] = now - op.phases[previous]["started"]
            op.phase = phase
            op.phases[phase] = {"started": now}
            return op.to_dict()

    def mark(self, op: Operation, phase: str, name: str) -> None:
        """Note the time of a moment inside ``phase`` (``prepare_started``, ``prepare_ended``)."""
        with self.lock:
            op.phases.setdefault(phase, {"started": self.clock.monotonic()})[name] = self.clock.monotonic()

    def finish(self, op: Operation, status: OperationStatus, error: str | None, generation: int) -> dict[str, Any]:
        """``op`` ended with ``status`` (it entered that phase just before); returns the operation's copy."""
        with self.lock:
            op.phases.pop(status.value, None)
            op.status, op.error, op.finished_at = status, error, self.clock.wall()
            op.generation_after = generation
            self.forget_old()
            return op.to_dict()

    def get(self, operation_id: str) -> dict[str, Any] | None:
        with self.lock:
            op = self.operations.get(operation_id)
            return op.to_dict() if op is not None else None

    def listing(self, limit: int | None = None) -> list[dict[str, Any]]:
        with self.lock:
            ops = sorted(self.operations.values(), key=lambda o: o.created_at, reverse=True)
            return [o.to_dict() for o in ops[:limit]]
