"""What the coordinator and the worker processes say to each other: frozen, picklable records.

Commands carry a sequence number. Workers agree, with the MAX all-reduce they run at every
step boundary anyway, on the highest sequence number any of them has received, and then all
execute every command up to it, in order, at that same step. So every rank acts on a command
at the same step even though the commands reach their queues at different times.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any


class WorkerMode(StrEnum):
    """What a worker is doing, as its heartbeats say (a ``str``: compares equal to its value)."""

    STARTING = "starting"  # before its first group: connecting, joining, loading weights
    STANDBY = "standby"  # launched ahead of a scale-up: preparing, then waiting for its Rescale
    DECODING = "decoding"
    DRAINING = "draining"  # decoding; the in-flight layer finishes, no new rebalance starts
    SUPPRESSED = "suppressed"  # decoding; the async EPLB thread is joined
    RESCALING = "rescaling"  # decoding paused: experts move, the group is replaced
    RESUMING = "resuming"  # the new group is formed; EPLB restarts at the Resume
    HALTED = "halted"  # decoding; EPLB stopped because the deployment failed on a healthy group
    BROKEN = "broken"  # a collective failed: no decoding, waiting for a recovery or shutdown


#: the modes in which a rank runs decode steps
DECODING_MODES = frozenset({WorkerMode.DECODING, WorkerMode.DRAINING, WorkerMode.SUPPRESSED,
                            WorkerMode.RESUMING, WorkerMode.HALTED})


# -- commands (coordinator -> every worker) ---------------------------------------------------

@dataclass(frozen=True)
class Command:
    seq: int
    operation_id: str | None = None


@dataclass(frozen=True)
class Drain(Command):
    """Start no new rebalance; let the in-flight layer finish and commit; report when idle."""


@dataclass(frozen=True)
class Suppress(Command):
    """Stop and join the async EPLB thread; report when it is gone.

    ``new_size``/``mapping`` announce the scale down that follows (empty: nothing announced):
    every rank computes the new placement right then, at the same step and from the same
    window, while it still decodes, so the rescale's pause only moves weights.
    """

    new_size: int = 0
    mapping: tuple[int, ...] = ()


@dataclass(frozen=True)
class Rescale(Command):
    """Move experts by the rank mapping and replace the process groups with a new generation.

    ``mapping[old_rank]`` is the new rank, or -1 for a rank that leaves; ``lost`` are old ranks
    whose weights are gone (dead processes): they take no part and their experts are copied
    from a surviving replica or reloaded from the canonical source.
    """

    generation: int = 0
    new_size: int = 0
    mapping: tuple[int, ...] = ()
    lost: tuple[int, ...] = ()
    execute_on: str = "new"  # "old": move over the old group first (scale down); "new": form the new group first


@dataclass(frozen=True)
class Resume(Command):
    """Rebuild the EPLB group and restart the async worker on it."""


@dataclass(frozen=True)
class RebalanceNow(Command):
    """Start a rebalance at this step (if none is in flight and not draining)."""


@dataclass(frozen=True)
class Verify(Command):
    """Check every local slot bit-exactly against the canonical weights and report the maps' digest."""


@dataclass(frozen=True)
class StopEPLB(Command):
    """The deployment failed while the group is healthy: stop and join the async EPLB thread
    (an in-flight rebalance is dropped at the same step everywhere) and go on decoding, so a
    recovery finds every rank ready to rescale."""


@dataclass(frozen=True)
class Shutdown(Command):
    """Leave the decode loop and exit."""


# -- reports (worker -> coordinator) ----------------------------------------------------------

@dataclass(frozen=True)
class Report:
    rank: int
    generation: int
    pid: int
    at: float  # the worker's time.time() when sent


@dataclass(frozen=True)
class Heartbeat(Report):
    step: int = 0
    step_seconds: float = 0.0
    balancedness: float = 1.0
    tokens: int = 0
    state: WorkerMode = WorkerMode.DECODING
    #: a long preparation's progress: (what, done, total), e.g. ("loading weights", 3, 48)
    progress: tuple[str, int, int] | None = None
    in_flight_layer: int | None = None
    eplb: dict[str, Any] = field(default_factory=dict)
    rank_load: float = 0.0
    # per decode step since the last heartbeat: (step, monotonic end time, wall and CPU seconds
    # the decode thread spent in EPLB control/after_sync/record, 1 if a rebalance was in flight)
    step_timings: tuple[tuple[int, float, float, float, int], ...] = ()


@dataclass(frozen=True)
class PhaseDone(Report):
    """The worker finished what a command asked (``phase`` is the command's class name)."""

    seq: int = 0
    operation_id: str | None = None
    phase: str = ""
    step: int = 0
    detail: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class WorkerEvent(Report):
    """Something the control plane may want to show: a rebalance started, a layer committed..."""

    step: int = 0
    kind: str = ""
    data: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class WorkerError(Report):
    """A failure in the worker, as data: where it happened and why."""

    step: int = 0
    where: str = ""
    error_type: str = ""
    message: str = ""
    traceback: str = ""
    fatal: bool = True
    seq: int = 0  # the last command the worker had taken up when it failed
