"""The scale state machine: one declarative table of phases and triggers.

Modelled on Ray autoscaler v2's instance manager (explicit states, a table of allowed
transitions, every change recorded) and built on ``transitions``' ``LockedMachine``
with ``auto_transitions=False`` and ``ignore_invalid_triggers=False``.

Reading guide
-------------
- :class:`Phase` — the six states.
- :data:`EDGES` — THE table. Nothing else defines an edge: the ``transitions`` machine is
  built from it, :func:`reachable_from` walks it, and the tests compare the two.
- :class:`ScaleMachine` — the façade the coordinator owns. It has one typed public method
  per trigger (pytransitions' typing guidance declares trigger stubs on the model so
  readers and type checkers see them; here they are real methods with exact keyword
  signatures that validate, then fire the trigger on an internal model).

Rules the façade keeps
----------------------
- A trigger that does not fit the state raises :class:`~elastic.core.errors.InvalidTransition`
  (``ScaleConflict`` for ``request_scale``) and changes nothing. Argument checks
  (reason, operation id, generation) also run *before* the state changes.
- Every transition appends a frozen :class:`Transition` to a bounded history and is logged
  as one sentence on the ``elastic.core.machine`` logger.
- Subscribers are called after each transition, in order, under the machine lock;
  an exception in one is logged and recorded (:meth:`ScaleMachine.subscriber_errors`),
  never propagated. A subscriber may fire another trigger (the lock is re-entrant); that
  transition is delivered to subscribers after the current one. Subscribers must be quick
  and must not wait on a thread that needs the machine.
- Time comes from an injected :class:`~elastic.core.clock.Clock` (the real one by default; a
  ``() -> seconds`` function is accepted too), so tests drive it.

Generation
----------
The group generation is the coordinator's number. It changes in exactly one place:
``rescaled(generation=g)``, when the new process group has been formed, and ``g`` must be
greater than the current generation (else :class:`~elastic.core.errors.StaleGeneration`).
"Greater", not "current + 1": a rescale that failed after forming group ``k+1`` leaves
its store prefix used, so the recovery may form ``k+2``.

Recovery
--------
``recover``: ``failed -> rescaling``. Recovery is a rescale of whatever is alive: fix the
rank mapping (``RankMapping.without(lost)`` or back to the old size), form a new group,
reload or copy the experts that were lost, and check that every rank reports the same new
maps (one digest; the weights themselves are checked bit-exactly only by ``Verify``). That is exactly the work of
``rescaling``, so the coordinator reuses one path (``rescaled`` -> ``resuming`` ->
``resumed``) instead of a second one, and the same deadlines apply. Entering ``failed``
already implies EPLB is off on every rank that is alive (the coordinator stops it when it
handles the failure), which is what ``rescaling`` requires. There is no ``abort`` trigger:
an operator who gives up shuts the coordinator down; the machine stays ``failed``.
"""

from __future__ import annotations

import logging
import threading
from collections import deque
from collections.abc import Callable, Iterable
from contextlib import AbstractContextManager
from dataclasses import asdict, dataclass
from typing import Any, cast

from transitions import MachineError
from transitions.extensions import LockedMachine

from elastic.core.clock import Clock, as_clock
from elastic.core.config import TimeoutsConfig
from elastic.core.errors import InvalidScaleRequest, InvalidTransition, PhaseTimeout, ScaleConflict, StaleGeneration
from elastic.core.phases import Phase, Trigger

__all__ = [
    "EDGES",
    "TRIGGERS",
    "Edge",
    "Phase",
    "ScaleMachine",
    "SubscriberError",
    "Transition",
    "Trigger",
    "allowed_triggers",
    "reachable_from",
    "transitions_of",
]

logger = logging.getLogger("elastic.core.machine")


@dataclass(frozen=True, slots=True)
class Edge:
    """One row of the table: ``trigger`` moves ``source`` to ``dest``."""

    trigger: Trigger
    source: Phase
    dest: Phase


P = Phase
T = Trigger

#: THE table. One edge per (trigger, source); the comment says when the coordinator fires it.
EDGES: tuple[Edge, ...] = (
    # a scale operation begins (operator/API/autoscaler request, or a rank lost while serving)
    Edge(T.REQUEST_SCALE, P.RUNNING, P.DRAINING),
    # every in-flight EPLB layer transfer has committed on every rank; no new rebalance started
    Edge(T.DRAINED, P.DRAINING, P.SUPPRESSED),
    # the EPLB worker thread is joined on every rank and the rank mapping is fixed
    Edge(T.SUPPRESSED, P.SUPPRESSED, P.RESCALING),
    # the new group (generation g) is formed, the experts redistributed and every rank reports the same maps
    Edge(T.RESCALED, P.RESCALING, P.RESUMING),
    # the EPLB group is rebuilt and the async worker restarted on every rank of the new group
    Edge(T.RESUMED, P.RESUMING, P.RUNNING),
    # a worker was lost or a collective failed while serving and no rescale can absorb it yet
    Edge(T.FAIL, P.RUNNING, P.FAILED),
    # draining overran its deadline, or a rank died / a commit failed mid-drain
    Edge(T.FAIL, P.DRAINING, P.FAILED),
    # a rank could not join its EPLB thread in time, or died
    Edge(T.FAIL, P.SUPPRESSED, P.FAILED),
    # group formation, a transfer or a worker start failed or timed out, or the ranks' new maps differ
    Edge(T.FAIL, P.RESCALING, P.FAILED),
    # the EPLB group or worker could not be restarted in time
    Edge(T.FAIL, P.RESUMING, P.FAILED),
    # roll back to a consistent group by rescaling the living ranks (see module docstring)
    Edge(T.RECOVER, P.FAILED, P.RESCALING),
)

#: Every trigger name, in table order.
TRIGGERS: tuple[Trigger, ...] = tuple(dict.fromkeys(e.trigger for e in EDGES))


def allowed_triggers(state: Phase | str) -> tuple[Trigger, ...]:
    """Triggers the table accepts in ``state``, in table order."""
    s = Phase(state)
    return tuple(dict.fromkeys(e.trigger for e in EDGES if e.source is s))


def reachable_from(state: Phase | str) -> frozenset[Phase]:
    """Every phase reachable from ``state`` by zero or more edges of the table (includes ``state``)."""
    seen = {Phase(state)}
    todo = [Phase(state)]
    while todo:
        cur = todo.pop()
        for e in EDGES:
            if e.source is cur and e.dest not in seen:
                seen.add(e.dest)
                todo.append(e.dest)
    return frozenset(seen)


def _dest(trigger: Trigger | str, source: Phase) -> Phase | None:
    for e in EDGES:
        if e.trigger == trigger and e.source is source:
            return e.dest
    return None


@dataclass(frozen=True, slots=True)
class Transition:
    """One recorded change of phase. ``generation`` is the generation after the change."""

    at: float
    source: Phase
    dest: Phase
    trigger: Trigger
    generation: int
    reason: str
    operation_id: str | None
    seq: int = 0  # 1-based position in the machine's whole history (survives the bounded window)

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["source"] = self.source.value
        d["dest"] = self.dest.value
        d["trigger"] = self.trigger.value
        return d

    def sentence(self) -> str:
        op = f", operation {self.operation_id}" if self.operation_id else ""
        why = f": {self.reason}" if self.reason else ""
        return (
            f"elastic state {self.source.value} -> {self.dest.value} on {self.trigger} "
            f"at t={self.at:.3f} (generation {self.generation}{op}){why}"
        )


@dataclass(frozen=True, slots=True)
class SubscriberError:
    """A subscriber raised while being told about ``transition``."""

    transition: Transition
    subscriber: str
    error: str


class _Model:
    """The object ``transitions`` drives; it binds ``state``, the triggers and ``is_*`` here."""

    state: str


class ScaleMachine:
    """The control plane's state machine (thread-safe).

    Args:
        timeouts: per-phase deadlines (:class:`~elastic.core.config.TimeoutsConfig`).
        clock: the control plane's clock (:mod:`elastic.core.clock`); injected so tests drive time.
        generation: the generation of the group the machine starts with.
        history_limit: how many transitions :meth:`history` keeps (oldest dropped first).
        subscriber_error_limit: how many subscriber errors are kept.
    """

    def __init__(
        self,
        *,
        timeouts: TimeoutsConfig | None = None,
        clock: Clock | Callable[[], float] | None = None,
        generation: int = 0,
        history_limit: int = 1000,
        subscriber_error_limit: int = 100,
    ) -> None:
        if isinstance(generation, bool) or not isinstance(generation, int) or generation < 0:
            raise InvalidScaleRequest("generation", "must be an integer >= 0", value=generation)
        if history_limit < 1:
            raise InvalidScaleRequest("history_limit", "must be at least 1", value=history_limit)
        self._timeouts = timeouts if timeouts is not None else TimeoutsConfig()
        self._clock = as_clock(clock)
        self._lock = threading.RLock()
        self._generation = generation
        self._operation_id: str | None = None
        self._failure_reason: str | None = None
        self._entered_at = self._clock.monotonic()
        self._seq = 0
        self._history: deque[Transition] = deque(maxlen=history_limit)
        self._subscribers: list[Callable[[Transition], Any]] = []
        self._subscriber_errors: deque[SubscriberError] = deque(maxlen=subscriber_error_limit)
        self._pending: deque[Transition] = deque()
        self._delivering = False
        self._model = _Model()
        self._machine = LockedMachine(
            model=self._model,
            states=[p.value for p in Phase],
            initial=Phase.RUNNING.value,
            transitions=[{"trigger": e.trigger.value, "source": e.source.value, "dest": e.dest.value} for e in EDGES],
            auto_transitions=False,
            ignore_invalid_triggers=False,
            # transitions' stub types machine_context as AbstractContextManager[None], but RLock.__enter__
            # returns bool (the runtime only enters and exits it): the stub is too narrow.
            machine_context=[cast(AbstractContextManager[None], self._lock)],
        )

    # ------------------------------------------------------------------ read side

    @property
    def state(self) -> Phase:
        """The current phase."""
        return Phase(self._model.state)

    @property
    def generation(self) -> int:
        """Generation of the current (last formed) process group."""
        return self._generation

    @property
    def operation_id(self) -> str | None:
        """The operation in progress (or the one that failed); None while running with no operation."""
        return self._operation_id

    @property
    def failure_reason(self) -> str | None:
        """Why the machine entered ``failed`` last (kept until the next ``fail``)."""
        return self._failure_reason

    @property
    def entered_at(self) -> float:
        """Clock reading when the current phase was entered."""
        return self._entered_at

    @property
    def timeouts(self) -> TimeoutsConfig:
        return self._timeouts

    def allowed(self) -> tuple[Trigger, ...]:
        """Triggers the current phase accepts."""
        return allowed_triggers(self.state)

    def history(self) -> list[Transition]:
        """A copy of the recorded transitions, oldest first (bounded by ``history_limit``)."""
        with self._lock:
            return list(self._history)

    def subscriber_errors(self) -> list[SubscriberError]:
        """A copy of the recorded subscriber failures, oldest first."""
        with self._lock:
            return list(self._subscriber_errors)

    def snapshot(self) -> dict[str, Any]:
        """JSON-ready view for ``GET /state``: phase, generation, operation, timing, allowed triggers."""
        with self._lock:
            return {
                "state": self.state.value,
                "generation": self._generation,
                "operation_id": self._operation_id,
                "failure_reason": self._failure_reason,
                "entered_at": self._entered_at,
                "deadline_s": self._timeouts.for_phase(self.state),
                "allowed": [t.value for t in self.allowed()],
            }

    # ------------------------------------------------------------------ subscribers

    def subscribe(self, callback: Callable[[Transition], Any]) -> Callable[[], None]:
        """Call ``callback(transition)`` after every transition; returns a function that unsubscribes."""
        with self._lock:
            self._subscribers.append(callback)

        def unsubscribe() -> None:
            with self._lock:
                try:
                    self._subscribers.remove(callback)
                except ValueError:
                    pass

        return unsubscribe

    # ------------------------------------------------------------------ triggers (one per table trigger)

    def request_scale(self, *, operation_id: str, reason: str = "") -> Transition:
        """``running -> draining``: operation ``operation_id`` begins.

        Raises :class:`~elastic.core.errors.ScaleConflict` in any other phase (naming the operation
        in progress), :class:`~elastic.core.errors.InvalidScaleRequest` for an empty id.
        """
        with self._lock:
            state = self.state
            if _dest(T.REQUEST_SCALE, state) is None:
                raise ScaleConflict(self._operation_id, state, self.allowed())
            op = _check_text("operation_id", operation_id)
            return self._fire(T.REQUEST_SCALE, reason=_check_reason(reason, required=False), operation_id=op)

    def drained(self, *, reason: str = "") -> Transition:
        """``draining -> suppressed``: every in-flight layer committed on every rank."""
        with self._lock:
            self._require(T.DRAINED)
            return self._fire(T.DRAINED, reason=_check_reason(reason, required=False))

    def suppressed(self, *, reason: str = "") -> Transition:
        """``suppressed -> rescaling``: EPLB threads joined on every rank; the mapping is fixed."""
        with self._lock:
            self._require(T.SUPPRESSED)
            return self._fire(T.SUPPRESSED, reason=_check_reason(reason, required=False))

    def rescaled(self, *, generation: int, reason: str = "") -> Transition:
        """``rescaling -> resuming``: group ``generation`` formed, experts redistributed.

        ``generation`` must be greater than :attr:`generation`
        (else :class:`~elastic.core.errors.StaleGeneration`); it becomes the machine's generation.
        """
        with self._lock:
            self._require(T.RESCALED)
            if isinstance(generation, bool) or not isinstance(generation, int):
                raise InvalidScaleRequest("generation", "must be an integer", value=generation)
            if generation <= self._generation:
                raise StaleGeneration(expected=self._generation + 1, actual=generation)
            return self._fire(T.RESCALED, reason=_check_reason(reason, required=False), generation=generation)

    def resumed(self, *, reason: str = "") -> Transition:
        """``resuming -> running``: EPLB rebuilt and restarted everywhere; the operation is done."""
        with self._lock:
            self._require(T.RESUMED)
            return self._fire(T.RESUMED, reason=_check_reason(reason, required=False), end_operation=True)

    def fail(self, *, reason: str) -> Transition:
        """Any phase but ``failed`` -> ``failed``, recording ``reason`` (required)."""
        with self._lock:
            self._require(T.FAIL)
            return self._fire(T.FAIL, reason=_check_reason(reason, required=True))

    def recover(self, *, operation_id: str | None = None, reason: str) -> Transition:
        """``failed -> rescaling``: roll back by rescaling the living ranks.

        ``operation_id`` names the recovery operation; by default the failed operation's id
        is kept (or ``recover-<seq>`` when the failure happened outside an operation).
        """
        with self._lock:
            self._require(T.RECOVER)
            r = _check_reason(reason, required=True)
            if operation_id is None:
                op = self._operation_id or f"recover-{self._seq + 1}"
            else:
                op = _check_text("operation_id", operation_id)
            return self._fire(T.RECOVER, reason=r, operation_id=op)

    def fire(self, trigger: Trigger, *, reason: str = "", generation: int | None = None) -> Transition:
        """Fire an operation step's ``trigger`` (``drained``, ``suppressed``, ``rescaled``, ``resumed``)
        through its typed method; ``generation`` goes with ``rescaled`` only."""
        if trigger is T.RESCALED:
            if generation is None:
                raise InvalidScaleRequest("generation", "rescaled needs the new group's generation")
            return self.rescaled(generation=generation, reason=reason)
        if generation is not None:
            raise InvalidScaleRequest("generation", f"only rescaled takes a generation, not {trigger}", value=generation)
        steps = {T.DRAINED: self.drained, T.SUPPRESSED: self.suppressed, T.RESUMED: self.resumed}
        if trigger not in steps:
            raise InvalidScaleRequest("trigger", "an operation step fires drained, suppressed, rescaled or resumed",
                                      value=trigger)
        return steps[trigger](reason=reason)

    # ------------------------------------------------------------------ deadlines

    def check_deadline(self, now: float | None = None) -> PhaseTimeout | None:
        """The :class:`~elastic.core.errors.PhaseTimeout` if the current phase overran its deadline, else None.

        ``now`` defaults to the machine's clock. ``running`` and ``failed`` have no deadline.
        """
        with self._lock:
            state = self.state
            deadline = self._timeouts.for_phase(state)
            if deadline is None:
                return None
            t = float(self._clock.monotonic() if now is None else now)
            elapsed = t - self._entered_at
            if elapsed > deadline:
                return PhaseTimeout(state, deadline, elapsed_s=elapsed)
            return None

    def fail_if_overdue(self, now: float | None = None) -> Transition | None:
        """Atomically: if the current phase overran, fire ``fail`` with the timeout as reason.

        Returns the ``fail`` transition, or None when nothing was overdue.
        """
        with self._lock:
            timeout = self.check_deadline(now)
            if timeout is None:
                return None
            return self._fire(T.FAIL, reason=str(timeout), now=now)

    # ------------------------------------------------------------------ internals

    def _require(self, trigger: Trigger) -> None:
        state = self.state
        if _dest(trigger, state) is None:
            raise InvalidTransition(state, trigger, self.allowed())

    def _fire(
        self,
        trigger: Trigger,
        *,
        reason: str,
        operation_id: str | None = None,
        generation: int | None = None,
        end_operation: bool = False,
        now: float | None = None,
    ) -> Transition:
        """Fire ``trigger`` (already validated) and record it. Caller holds the lock."""
        source = self.state
        try:
            ok = self._model.trigger(trigger.value)  # type: ignore[attr-defined]  # bound by transitions
        except MachineError as err:  # the table and the façade disagree: refuse, change nothing
            raise InvalidTransition(source, trigger, self.allowed()) from err
        if not ok:  # no conditions exist in the table, so this cannot happen; refuse loudly if it does
            raise InvalidTransition(source, trigger, self.allowed())
        at = float(self._clock.monotonic() if now is None else now)
        if generation is not None:
            self._generation = generation
        if operation_id is not None:
            self._operation_id = operation_id
        if trigger is T.FAIL:
            self._failure_reason = reason
        self._entered_at = at
        self._seq += 1
        record = Transition(
            at=at,
            source=source,
            dest=self.state,
            trigger=trigger,
            generation=self._generation,
            reason=reason,
            operation_id=self._operation_id,
            seq=self._seq,
        )
        if end_operation:
            self._operation_id = None
        self._history.append(record)
        logger.info("%s", record.sentence())
        self._notify(record)
        return record

    def _notify(self, record: Transition) -> None:
        self._pending.append(record)
        if self._delivering:  # re-entrant call from a subscriber: the outer loop delivers it in order
            return
        self._delivering = True
        try:
            while self._pending:
                item = self._pending.popleft()
                for callback in list(self._subscribers):
                    try:
                        callback(item)
                    except Exception as exc:  # a subscriber never breaks the machine
                        name = getattr(callback, "__qualname__", None) or repr(callback)
                        self._subscriber_errors.append(SubscriberError(item, name, f"{type(exc).__name__}: {exc}"))
                        logger.exception("subscriber %s failed on %s -> %s", name, item.source.value, item.dest.value)
        finally:
            self._delivering = False


def _check_text(field: str, value: Any) -> str:
    if not isinstance(value, str) or not value.strip():
        raise InvalidScaleRequest(field, "must be a non-empty string", value=value)
    return value


def _check_reason(reason: Any, *, required: bool) -> str:
    if not isinstance(reason, str):
        raise InvalidScaleRequest("reason", "must be a string", value=reason)
    if required and not reason.strip():
        raise InvalidScaleRequest("reason", "must say why (non-empty)", value=reason)
    return reason


def transitions_of(machine: ScaleMachine, states: Iterable[Phase] = tuple(Phase)) -> set[tuple[str, Phase, Phase]]:
    """The edges the underlying ``transitions`` machine knows, as ``(trigger, source, dest)``.

    For tests and docs: it must equal :data:`EDGES`.
    """
    out: set[tuple[str, Phase, Phase]] = set()
    m = machine._machine
    for s in states:
        for trig in m.get_triggers(s.value):
            for t in m.events[trig].transitions.get(s.value, []):
                assert t.dest is not None  # every edge of EDGES has a destination (no internal transitions)
                out.add((trig, Phase(t.source), Phase(t.dest)))
    return out
