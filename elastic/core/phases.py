"""The one phase vocabulary: the control plane's states and the groups of them the code asks about.

Everything that names a phase (the state machine, the timeouts, fault triggers, reports,
benchmarks, the HTTP API) takes it from here.
"""

from __future__ import annotations

from enum import StrEnum

__all__ = ["OPERATION_PHASES", "OperationKind", "OperationStage", "Phase", "SERVING_PHASES", "Trigger"]


class Phase(StrEnum):
    """States of the control plane. ``str(Phase.RUNNING) == "running"``."""

    RUNNING = "running"  # serving; EPLB on; rebalances every step_interval steps
    DRAINING = "draining"  # serving; no new rebalance; in-flight layers finish and commit everywhere
    SUPPRESSED = "suppressed"  # serving; EPLB worker thread flushed and joined on every rank
    RESCALING = "rescaling"  # paused; mapping fixed, experts redistributed, group replaced
    RESUMING = "resuming"  # EPLB group rebuilt, async worker restarted, load window carried over
    FAILED = "failed"  # a phase failed or timed out; reason recorded; waiting for recover


#: the phases a scale passes through, in order; each has a deadline (``TimeoutsConfig``)
OPERATION_PHASES: tuple[Phase, ...] = (Phase.DRAINING, Phase.SUPPRESSED, Phase.RESCALING, Phase.RESUMING)

#: the states in which a healthy group decodes (only ``rescaling`` pauses it; in ``failed`` the
#: workers' own reports tell, see ``Coordinator.snapshot()["serving"]``)
SERVING_PHASES: frozenset[Phase] = frozenset({Phase.RUNNING, Phase.DRAINING, Phase.SUPPRESSED, Phase.RESUMING})


class Trigger(StrEnum):
    """The state machine's triggers (``core/machine.py``'s table names its edges with these)."""

    REQUEST_SCALE = "request_scale"
    DRAINED = "drained"
    SUPPRESSED = "suppressed"
    RESCALED = "rescaled"
    RESUMED = "resumed"
    FAIL = "fail"
    RECOVER = "recover"


class OperationKind(StrEnum):
    """What an operation is: a scale asked for, or a recovery from ``failed``."""

    SCALE = "scale"
    RECOVER = "recover"


class OperationStage(StrEnum):
    """Where an operation stands outside the machine's phases (``Operation.phase`` before the
    machine moves, and once it ended)."""

    PENDING = "pending"
    BEFORE_HOOKS = "before_hooks"
    NOOP = "noop"
