"""Typed errors of the elastic control plane.

Every error carries structured fields (so a caller can act on them without parsing text),
a one-line ``str()`` that a person can read, a stable snake-case ``code`` and ``to_dict()``
for the HTTP API and the replay report. A refused request never changes anything: these
errors are raised before any state changes.

Hierarchy::

    ElasticError
    ├── InvalidTransition        a trigger that does not fit the current state
    │   └── ScaleConflict        a scale request while another operation runs
    ├── InvalidScaleRequest      a request with a bad field (size, id, ...)  [also a ValueError]
    │   └── InvalidRankMapping   a rank mapping that breaks a rule, naming the rank at fault
    ├── StaleGeneration          a generation number that does not move forward
    ├── PhaseTimeout             a phase overran its deadline
    ├── WorkerLost               a worker process died or stopped answering
    ├── LifecycleError           a coordinator used before start(), after shutdown(), or started twice  [also a RuntimeError]
    └── ScaleNoop                nothing to do (already at that size); a result, not a failure
"""

from __future__ import annotations

from collections.abc import Iterable
from enum import Enum
from typing import Any, ClassVar

__all__ = [
    "ElasticError",
    "InvalidRankMapping",
    "InvalidScaleRequest",
    "InvalidTransition",
    "LifecycleError",
    "PhaseTimeout",
    "ScaleConflict",
    "ScaleNoop",
    "StaleGeneration",
    "WorkerLost",
    "InvalidCompletionRequest",
    "ModelNotFound",
    "Overloaded",
    "RequestNotServed",
    "ServiceUnavailable",
]


class ElasticError(Exception):
    """Base of all elastic control-plane errors.

    Subclasses set ``code`` and pass their structured fields to ``__init__`` as keywords;
    the fields become attributes and appear in :meth:`to_dict`.
    """

    code: ClassVar[str] = "elastic_error"
    #: False for outcomes that are reported through the error path but are not failures.
    is_failure: ClassVar[bool] = True

    def __init__(self, message: str, **fields: Any) -> None:
        super().__init__(message)
        self.message = message
        self.fields: dict[str, Any] = dict(fields)
        for name, value in fields.items():
            setattr(self, name, value)

    def __str__(self) -> str:
        return self.message

    def to_dict(self) -> dict[str, Any]:
        """A JSON-ready description: ``{"error": code, "message": str(self), **fields}``."""
        out: dict[str, Any] = {"error": self.code, "message": self.message}
        for name, value in self.fields.items():
            out[name] = _jsonable(value)
        return out

    def __repr__(self) -> str:
        args = ", ".join(f"{k}={v!r}" for k, v in self.fields.items())
        return f"{type(self).__name__}({args})"

    def __reduce__(self):  # picklable across worker processes despite keyword-only fields
        return (_rebuild, (type(self), self.message, self.fields))


def _rebuild(cls: type[ElasticError], message: str, fields: dict[str, Any]) -> ElasticError:
    err = cls.__new__(cls)
    ElasticError.__init__(err, message, **fields)
    return err


def _label(value: Any) -> str:
    """An Enum's value (``Phase.RUNNING`` -> ``"running"``), else ``str(value)``."""
    return str(value.value) if isinstance(value, Enum) else str(value)


def _jsonable(value: Any) -> Any:
    if isinstance(value, Enum):
        return value.value
    if isinstance(value, (list, tuple, set, frozenset)):
        items = [_jsonable(v) for v in value]
        return sorted(items) if isinstance(value, (set, frozenset)) else items
    return value


class InvalidTransition(ElasticError):
    """A trigger was fired in a state that has no edge for it; the state is unchanged.

    ``allowed`` lists the triggers the current state does accept (sorted).
    """

    code = "invalid_transition"

    def __init__(self, state: str, trigger: str, allowed: Iterable[str], *, message: str | None = None, **extra: Any):
        allowed_t = tuple(sorted(_label(a) for a in allowed))
        state_s = _label(state)
        msg = message or (
            f"cannot {_label(trigger)} while {state_s}: "
            + (f"this state accepts {', '.join(allowed_t)}" if allowed_t else "this state accepts no trigger")
        )
        super().__init__(msg, state=state_s, trigger=_label(trigger), allowed=allowed_t, **extra)


class ScaleConflict(InvalidTransition):
    """A scale (or recovery) was requested while another operation is in progress.

    A subclass of :class:`InvalidTransition` (the machine is not ``running``), kept apart so
    an API can answer 409 with the id of the operation that holds the machine.
    """

    code = "scale_conflict"

    def __init__(self, operation_id: str | None, state: str, allowed: Iterable[str] = (), *, trigger: str = "request_scale"):
        state_s = _label(state)
        if state_s == "failed" and not operation_id:
            msg = f"cannot {trigger} while failed: recover first"
        else:
            who = f"operation {operation_id!r}" if operation_id else "another operation"
            hint = "; recover first" if state_s == "failed" else ""
            msg = f"cannot {trigger} while {state_s}: {who} holds the machine{hint}"
        super().__init__(state_s, trigger, allowed, message=msg, operation_id=operation_id)


class InvalidScaleRequest(ElasticError, ValueError):
    """A request whose field ``field`` is invalid (``reason`` says why); nothing was started."""

    code = "invalid_scale_request"

    def __init__(self, field: str, reason: str, *, value: Any = None, **extra: Any):
        shown = f" (got {value!r})" if value is not None else ""
        super().__init__(f"invalid {field}: {reason}{shown}", field=field, reason=reason, value=value, **extra)


class InvalidRankMapping(InvalidScaleRequest):
    """A rank mapping that breaks a rule; ``old_rank`` names the old rank at fault when there is one."""

    code = "invalid_rank_mapping"

    def __init__(self, reason: str, *, field: str = "rank_mapping", old_rank: int | None = None, value: Any = None):
        super().__init__(field, reason, value=value, old_rank=old_rank)


class IdempotencyKeyReused(InvalidScaleRequest):
    """An idempotency key already named another request (``operation_id``): nothing was started."""

    code = "idempotency_key_reused"

    def __init__(self, key: str, operation_id: str, described: str):
        super().__init__("idempotency_key", f"key {key!r} was used for operation {operation_id} ({described}); "
                         "use a new key for a different request", operation_id=operation_id)


class RebalanceFailed(ElasticError):
    """A rank could not start the rebalance: ``reason`` names it (the deployment may have failed)."""

    code = "rebalance_failed"

    def __init__(self, reason: str):
        super().__init__(f"rebalance failed: {reason}", reason=reason)


class StaleGeneration(ElasticError):
    """A group generation that does not move forward: ``actual`` was given, at least ``expected`` needed."""

    code = "stale_generation"
    expected: int  # both set from the fields by ElasticError.__init__
    actual: int

    def __init__(self, expected: int, actual: int):
        super().__init__(
            f"generation {actual} is stale: expected {expected} or later", expected=int(expected), actual=int(actual)
        )


class PhaseTimeout(ElasticError):
    """Phase ``phase`` ran longer than its deadline of ``deadline_s`` seconds."""

    code = "phase_timeout"

    def __init__(self, phase: str, deadline_s: float, *, elapsed_s: float | None = None):
        phase_s = _label(phase)
        took = f" (in it for {elapsed_s:.3f}s)" if elapsed_s is not None else ""
        super().__init__(
            f"phase {phase_s} overran its deadline of {deadline_s:g}s{took}",
            phase=phase_s,
            deadline_s=float(deadline_s),
            elapsed_s=None if elapsed_s is None else float(elapsed_s),
        )


class WorkerLost(ElasticError):
    """The worker of EP rank ``rank`` died or stopped answering (``reason``)."""

    code = "worker_lost"

    def __init__(self, rank: int, reason: str):
        super().__init__(f"worker of rank {rank} lost: {reason}", rank=int(rank), reason=reason)


class LifecycleError(ElasticError, RuntimeError):
    """``action`` needs a started coordinator (or, for ``start``, a new one); ``lifecycle`` is where
    this one is: ``new`` (not started), ``started`` or ``shut down``. Nothing was done."""

    code = "lifecycle_error"

    _WHY: ClassVar[dict[str, str]] = {
        "new": "the coordinator is not started: call start(), or use it in a with statement",
        "started": "the coordinator is already started: one coordinator runs one deployment",
        "shut down": "the coordinator is shut down: make a new Coordinator",
    }

    def __init__(self, action: str, lifecycle: str):
        super().__init__(f"cannot {action}: {self._WHY[lifecycle]}", action=action, lifecycle=lifecycle)


class ScaleNoop(ElasticError):
    """The group already has ``size`` ranks: nothing to do.

    Not a failure (``is_failure`` is False): it travels the error path so a caller that only
    wants "did a scale start?" can catch it, and an API can answer 200 with this description.
    """

    code = "scale_noop"
    is_failure = False

    def __init__(self, size: int):
        super().__init__(f"already at size {size}: nothing to do", size=int(size))


# -- serving requests (elastic.control.requests) -----------------------------------------------------------

class InvalidCompletionRequest(ElasticError, ValueError):
    """A completion request whose field ``field`` is invalid (``reason`` says why); nothing was queued."""

    code = "invalid_request"

    def __init__(self, field: str, reason: str, *, value: Any = None):
        shown = f" (got {value!r})" if value is not None else ""
        super().__init__(f"invalid {field}: {reason}{shown}", field=field, reason=reason, value=value)


class ModelNotFound(ElasticError):
    """The request names a model this deployment does not serve (``served`` is the one it does)."""

    code = "model_not_found"

    def __init__(self, requested: str, served: str):
        super().__init__(f"model {requested!r} is not served here; this deployment serves {served!r} (GET /v1/models)",
                         requested=requested, served=served)


class RequestNotServed(ElasticError):
    """A request the deployment cannot take or finish now, and should be sent again after
    ``retry_after_s`` (HTTP ``Retry-After``): nothing of it is kept."""

    code = "request_not_served"
    retryable: ClassVar[bool] = True
    retry_after_s: int

    def __init__(self, message: str, *, retry_after_s: int, **fields: Any):
        super().__init__(message, retry_after_s=retry_after_s, **fields)


class Overloaded(RequestNotServed):
    """Every batch slot and queue place is taken (HTTP 429)."""

    code = "overloaded"


class ServiceUnavailable(RequestNotServed):
    """The deployment cannot decode: failed, and no recovery brought it back in time (HTTP 503)."""

    code = "unavailable"
