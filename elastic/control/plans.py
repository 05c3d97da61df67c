"""Decisions of the control plane as pure functions: they look at a snapshot and return a plan.

An operation (a scale, a recovery) is a tuple of :class:`Step` records. Each says, as data:
the phase it runs in, the command it sends and to whom, the result type every recipient
answers with, a pure interpretation of those results into :data:`Outcome` values
(:class:`Retire`, :class:`AdoptSize`, ...), and the machine trigger it fires. One executor
(:mod:`elastic.control.executor`) carries any plan out; this module never touches a process,
a lock or a clock, so a plan is built, printed (:func:`render_steps`) and tested on its own.

Modelled on TorchElastic's rendezvous (a decision returns an action, one executor applies it)
and on this project's ``eplb/plan.py`` / ``eplb/transfer.py`` split.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from enum import StrEnum
from typing import Literal

from elastic.core import protocol as p
from elastic.core.errors import InvalidScaleRequest
from elastic.core.mapping import RankMapping
from elastic.core.phases import OperationKind, Phase, Trigger

__all__ = [
    "AdoptSize", "Attempt", "JoinerWait", "LiveWorker", "MeasurePause", "OnFailure", "OperationPlan", "Outcome",
    "Prepared", "Reason", "Recipients", "RecordAttempt", "RecoveryPlan", "Refuse", "Retire", "ScaleSnapshot",
    "Step", "admit_joiners", "rescale_spec", "plan_recovery", "plan_scale", "render_steps",
]


# -- what the executor applies ------------------------------------------------------------------

@dataclass(frozen=True)
class Reason:
    """Why the step's trigger fires (the transition's reason)."""

    text: str


@dataclass(frozen=True)
class Refuse:
    """The results cannot be accepted (the ranks disagree): the operation fails with ``reason``."""

    reason: str


@dataclass(frozen=True)
class Retire:
    """These workers left the group: their exit is expected; each gets ``grace_s`` to exit, then is killed."""

    pids: tuple[int, ...]
    ranks: tuple[int, ...]
    grace_s: float = 1.0


@dataclass(frozen=True)
class AdoptSize:
    """The deployment now has ``size`` ranks (and ``num_physical`` slots, when a rank said)."""

    size: int
    num_physical: int | None


@dataclass(frozen=True)
class MeasurePause:
    """What the operation shows of its rescale: the pause, the bytes moved, torn layers found."""

    paused_seconds: float
    bytes_moved: int
    diverged_layers: tuple[int, ...]


@dataclass(frozen=True)
class Prepared:
    """Every rank prepared (the prepare sub-phase's summary, as the operation shows it)."""

    summary: tuple[tuple[str, float], ...]


@dataclass(frozen=True)
class RecordAttempt:
    """At the send: the rescale attempt to ``generation`` (of ``size`` ranks) is under way; a
    recovery may later start from it (its seq is the one the command was given)."""

    generation: int
    size: int


@dataclass(frozen=True)
class AdmitJoiners:
    """At the send: the joining ranks are in the new group from here on (no longer standing by)."""


admit_joiners = AdmitJoiners()

Outcome = Reason | Refuse | Retire | AdoptSize | MeasurePause | Prepared | RecordAttempt | AdmitJoiners


class Recipients(StrEnum):
    """Who a step's command goes to."""

    GROUP = "serving group"  # the ranks of the serving group that take part
    GROUP_AND_JOINING = "serving group + joining"
    KEPT_AND_JOINING = "surviving ranks + joining"  # the group less its lost ranks, and the fresh ones
    LIVE = "every live rank"  # chosen when sent (the new group, after a rescale)


class JoinerWait(StrEnum):
    """When the step waits for the joining ranks' "ready" (their start overlaps the old group's decoding)."""

    NONE = "-"
    AFTER_SEND = "after the send"
    BEFORE_SEND = "before the send"


class OnFailure(StrEnum):
    NOTHING = "-"
    ABANDON_GENERATION = "abandon the generation"  # ranks still joining it give up now, not at their deadline


@dataclass(frozen=True)
class Step:
    """One row of an operation: in ``phase``, send ``build(seq, seconds_in_phase)`` (a ``command``)
    to ``recipients``, wait (the phase's deadline) for each one's ``expects`` result, turn them
    into outcomes with ``interpret``, then fire ``trigger`` (None: the phase goes on)."""

    phase: Phase
    command: type[p.Command]
    build: Callable[[int, float], p.Command]
    recipients: Recipients
    interpret: Callable[[Mapping[int, p.PhaseDone]], tuple[Outcome, ...]]
    trigger: Trigger | None
    yields: tuple[type, ...] = (Reason,)  # the outcome types ``interpret`` returns (for the table)
    at_send: tuple[Outcome, ...] = ()
    joiners: JoinerWait = JoinerWait.NONE
    on_failure: OnFailure = OnFailure.NOTHING

    @property
    def expects(self) -> type[p.Result]:
        return p.RESULT_OF[self.command]


@dataclass(frozen=True)
class OperationPlan:
    """A scale or a recovery, decided: the new layout, the generation it forms, and its steps."""

    kind: OperationKind
    operation_id: str
    mapping: RankMapping
    spec: p.RescaleSpec  # what its Prepare, Suppress and Rescale carry
    steps: tuple[Step, ...]

    @property
    def generation(self) -> int:
        return self.spec.generation

    @property
    def lost(self) -> tuple[int, ...]:
        return self.spec.lost

    @property
    def joining(self) -> tuple[int, ...]:
        """New ranks the executor launches (standing by) before the first step."""
        return self.mapping.joining

    def table(self) -> str:
        return render_steps(self.steps)


# -- the interpretations (pure) -----------------------------------------------------------------

def _said(text: str, reports: Mapping[int, p.PhaseDone]) -> tuple[Outcome, ...]:
    return (Reason(text),)


def _prepared(reports: Mapping[int, p.PhaseDone]) -> tuple[Outcome, ...]:
    results = [r.result for r in reports.values() if isinstance(r.result, p.PrepareDone)]
    if not results:
        return (Refuse("no rank reported its prepare"),)
    summary = {
        "seconds": max(r.seconds for r in results), "group_seconds": max(r.group_seconds for r in results),
        "layers": max(r.layers for r in results), "layers_total": max(r.layers_total for r in results),
        "bytes_received": sum(r.bytes_received for r in results),
        "prestage_bytes": max(r.prestage_bytes for r in results), "steps": max(r.steps for r in results),
        "steady_step_seconds": max(r.steady_step_seconds for r in results),
        "started_at": min(r.started_at for r in results), "ended_at": max(r.ended_at for r in results),
    }
    return (Prepared(tuple(summary.items())),
            Reason(f"standby group formed; {summary['layers']} of {summary['layers_total']} changed layers "
                   f"({summary['bytes_received']} bytes) moved ahead of the pause"))


def _rescaled(new_size: int, grace_s: float, reports: Mapping[int, p.PhaseDone]) -> tuple[Outcome, ...]:
    """The ranks must agree on the new maps; the retired ones go; the group has ``new_size`` ranks."""
    done = {pid: r for pid, r in reports.items() if isinstance(r.result, p.RescaleDone)}
    results = {pid: r.result for pid, r in done.items() if isinstance(r.result, p.RescaleDone)}
    if not results:
        return (Refuse("no rank reported its rescale"),)
    kept = [r for r in results.values() if not r.retired]
    digests = {r.digest for r in kept}
    if len(digests) != 1:
        return (Refuse(f"ranks disagree on the new placement: digests {sorted(map(str, digests))}"),)
    retired = sorted((pid for pid, r in results.items() if r.retired), key=lambda pid: done[pid].rank)
    # the pause is the ranks that go on decoding: a leaving rank's rescale ends with its report
    return (
        MeasurePause(paused_seconds=max(r.seconds for r in kept),
                     bytes_moved=sum(r.bytes_received for r in results.values()),
                     diverged_layers=tuple(sorted({layer for r in results.values() for layer in r.diverged_layers}))),
        Retire(tuple(retired), tuple(sorted(done[pid].rank for pid in retired)), grace_s),
        AdoptSize(new_size, kept[0].num_physical),
        Reason(f"group of {new_size} formed, experts redistributed"),
    )


# -- scale --------------------------------------------------------------------------------------

@dataclass(frozen=True)
class ScaleSnapshot:
    """What a scale's plan needs to know of the deployment."""

    operation_id: str
    size: int  # ranks serving now
    generation: int  # the generation the rescale forms (reserved: never reused)
    layout: RankMapping | None = None  # the launcher's choice of layout (hosts contiguous); None: for_resize
    prepare: bool = False  # scaling.prepare: a prepare sub-phase in draining
    prestage_max_bytes: int = 0
    prestage_share: float = 0.1
    draining_s: float = 30.0  # the draining deadline: the prepare's pre-transfer is paced to 80% of what is left
    retire_grace_s: float = 1.0  # how long a retired rank gets to exit before it is killed


def rescale_spec(generation: int, mapping: RankMapping, lost: tuple[int, ...], *, keep_requests: bool) -> p.RescaleSpec:
    """What the operation's rescale means, the one value its Prepare, Suppress and Rescale carry. A scale
    down moves over the old group (the leaving ranks send); a scale up and a recovery over the new."""
    execute_on: Literal["old", "new"] = "old" if mapping.new_size < len(mapping.old_to_new) and not lost else "new"
    return p.RescaleSpec(generation=generation, new_size=mapping.new_size, mapping=tuple(mapping.old_to_new),
                         lost=tuple(lost), execute_on=execute_on, keep_requests=keep_requests)


def _prepare_command(s: ScaleSnapshot, spec: p.RescaleSpec, seq: int, in_phase_s: float) -> p.Command:
    return p.Prepare(seq=seq, operation_id=s.operation_id, spec=spec,
                     paced_for_s=max(0.0, 0.8 * (s.draining_s - in_phase_s)),
                     prestage_max_bytes=int(s.prestage_max_bytes), prestage_share=s.prestage_share)


def _rescale_command(operation_id: str, spec: p.RescaleSpec, prepared: bool, seq: int, in_phase_s: float) -> p.Command:
    # a recovery's survivors keep their requests (each rolled back to its last whole step); the lost
    # ranks' requests are replayed from their prompts by the request engine (elastic.control.requests)
    return p.Rescale(seq=seq, operation_id=operation_id, spec=spec, prepared=prepared)


def _simple(command: type[p.Command], operation_id: str, seq: int, in_phase_s: float) -> p.Command:
    return command(seq=seq, operation_id=operation_id)


def _rescale_step(operation_id: str, spec: p.RescaleSpec, *, prepared: bool, grace_s: float,
                  joiners: JoinerWait) -> Step:
    """Move experts, replace the group (the switch pauses decoding): the step scale and recovery share."""
    return Step(Phase.RESCALING, p.Rescale, functools.partial(_rescale_command, operation_id, spec, prepared),
                Recipients.KEPT_AND_JOINING, functools.partial(_rescaled, spec.new_size, grace_s), Trigger.RESCALED,
                yields=(MeasurePause, Retire, AdoptSize, Reason, Refuse),
                at_send=(RecordAttempt(spec.generation, spec.new_size), admit_joiners), joiners=joiners,
                on_failure=OnFailure.ABANDON_GENERATION)


def _resume_step(operation_id: str) -> Step:
    """Rebuild the EPLB group and restart the async worker, on every rank of the new group."""
    return Step(Phase.RESUMING, p.Resume, functools.partial(_simple, p.Resume, operation_id), Recipients.LIVE,
                functools.partial(_said, "EPLB group rebuilt and async worker restarted on every rank"),
                Trigger.RESUMED)


def plan_scale(snapshot: ScaleSnapshot, target: int) -> OperationPlan:
    """The steps of a scale from ``snapshot.size`` to ``target`` ranks (the machine is ``draining``).

    1. ``draining``: a Drain to the group (in-flight layers commit, none starts; decoding goes
       on); the joining ranks' start overlaps it.
    2. with ``prepare``, still ``draining``: a Prepare to the group and the joining ranks (the
       plan, the standby group, the paced pre-transfer).
    3. ``suppressed``: a Suppress joins the EPLB threads; an unprepared scale down announces its
       layout, so its placement is computed while the ranks still decode.
    4. ``rescaling``: the Rescale (the switch, and whatever was not moved ahead of it).
    5. ``resuming``: the Resume restarts the EPLB on the new group.
    """
    if isinstance(target, bool) or not isinstance(target, int) or target < 1:
        raise InvalidScaleRequest("ep_size", "must be a positive integer", value=target)
    s = snapshot
    mapping = s.layout if s.layout is not None else RankMapping.for_resize(s.size, target)
    if mapping.new_size != target or len(mapping.old_to_new) != s.size:
        raise InvalidScaleRequest("layout", f"maps {len(mapping.old_to_new)} -> {mapping.new_size} ranks, "
                                            f"not {s.size} -> {target}")
    op = s.operation_id
    spec = rescale_spec(s.generation, mapping, (), keep_requests=True)
    down = target < s.size and not s.prepare  # an unprepared scale down announces its layout at Suppress
    drain = Step(Phase.DRAINING, p.Drain, functools.partial(_simple, p.Drain, op), Recipients.GROUP,
                 functools.partial(_said, "every in-flight layer committed on every rank"),
                 None if s.prepare else Trigger.DRAINED, joiners=JoinerWait.AFTER_SEND)
    prepare = Step(Phase.DRAINING, p.Prepare, functools.partial(_prepare_command, s, spec),
                   Recipients.GROUP_AND_JOINING, _prepared, Trigger.DRAINED, yields=(Prepared, Reason, Refuse),
                   on_failure=OnFailure.ABANDON_GENERATION)
    suppress = Step(Phase.SUPPRESSED, p.Suppress,
                    functools.partial(_suppress_command, op, spec if down else None), Recipients.GROUP,
                    functools.partial(_said, f"EPLB threads joined; mapping {mapping}"), Trigger.SUPPRESSED)
    rescale = _rescale_step(op, spec, prepared=s.prepare, grace_s=s.retire_grace_s, joiners=JoinerWait.NONE)
    steps = (drain, prepare, suppress, rescale, _resume_step(op)) if s.prepare else \
        (drain, suppress, rescale, _resume_step(op))
    return OperationPlan(OperationKind.SCALE, op, mapping, spec, steps)


def _suppress_command(operation_id: str, announced: p.RescaleSpec | None, seq: int, in_phase_s: float) -> p.Command:
    return p.Suppress(seq=seq, operation_id=operation_id, announced=announced)


# -- recovery -----------------------------------------------------------------------------------

@dataclass(frozen=True)
class LiveWorker:
    """What a decision needs to know of one living worker."""

    pid: int
    rank: int
    generation: int


@dataclass(frozen=True)
class Attempt:
    """A rescale attempt to ``generation``: the group size it was to have, and the workers
    that reported adopting it (a failed attempt may have been adopted by some ranks when a
    peer died after its final barrier)."""

    size: int
    adopted: frozenset[int]


@dataclass(frozen=True)
class RecoveryPlan:
    generation: int  # the generation the survivors come from
    base_size: int  # that generation's size: the old ranks the recovery's mapping starts from
    survivors: tuple[int, ...]  # pids, by rank
    lost_ranks: tuple[int, ...]  # ranks of that generation with no living worker
    retire: tuple[int, ...]  # pids of every other worker: killed, their death expected

    @property
    def new_size(self) -> int:
        return self.base_size - len(self.lost_ranks)

    def operation(self, operation_id: str, generation: int, target: int, *, retire_grace_s: float = 1.0) -> OperationPlan:
        """The recovery's steps: the survivors (and, when they cannot hold every expert, fresh ranks
        up to ``target``) rescale into ``generation``, then resume. The survivors' requests go on;
        the lost ranks' restart from their prompts."""
        if target < self.new_size:
            raise InvalidScaleRequest("ep_size", f"a recovery keeps its {self.new_size} survivors", value=target)
        without = RankMapping.without(self.base_size, self.lost_ranks)
        mapping = RankMapping(without.old_to_new, target)  # fresh ranks after the survivors, if any
        spec = rescale_spec(generation, mapping, self.lost_ranks, keep_requests=True)
        rescale = _rescale_step(operation_id, spec, prepared=False, grace_s=retire_grace_s,
                                joiners=JoinerWait.BEFORE_SEND)
        return OperationPlan(OperationKind.RECOVER, operation_id, mapping, spec, (rescale, _resume_step(operation_id)))


def plan_recovery(live: Sequence[LiveWorker], attempts: Mapping[int, Attempt], generation: int,
                  size: int, *, others: Sequence[int] = ()) -> RecoveryPlan:
    """Choose the survivors of a recovery from ``failed``.

    1. Candidates: the serving (last consistent) ``generation`` of ``size`` ranks, with its
       living workers; and every later rescale attempt, with the living workers that reported
       adopting it and are in it.
    2. The candidate with the most living workers wins; on a tie the older generation (the
       last consistent one first), so a half-adopted attempt never wins over what served.
    3. Every other worker is retired (the living ones that are not survivors, and ``others``:
       those already lost or standing by), so no rank is left on a half-made generation.

    Raises :class:`InvalidScaleRequest` (nothing changes) when no candidate has a living worker.
    The caller checks the new size against the deployment's limits.
    """
    sizes = {generation: size}
    members = {generation: [w for w in live if w.generation == generation]}
    for g, attempt in attempts.items():
        if g > generation:
            sizes[g] = attempt.size
            members[g] = [w for w in live if w.pid in attempt.adopted and w.generation == g]
    chosen = max(members, key=lambda g: (len(members[g]), -g))
    survivors = sorted(members[chosen], key=lambda w: w.rank)
    if not survivors:
        # what was weighed, so that an operator (and a failed test) sees why no side had a worker
        seen = ", ".join(f"rank {w.rank} pid {w.pid} on generation {w.generation}" for w in live) or "none"
        tried = ", ".join(f"generation {g} ({a.size} ranks, adopted by pids {sorted(a.adopted)})"
                          for g, a in sorted(attempts.items())) or "none"
        raise InvalidScaleRequest("ep_size", "cannot recover: no worker of the last consistent generation "
                                  f"({generation}) is alive, nor one that adopted a later attempt; living workers: "
                                  f"{seen}; attempts: {tried}")
    alive = {w.rank for w in survivors}
    keep = {w.pid for w in survivors}
    retire = {w.pid for w in live if w.pid not in keep} | {pid for pid in others if pid not in keep}
    return RecoveryPlan(generation=chosen, base_size=sizes[chosen], survivors=tuple(w.pid for w in survivors),
                        lost_ranks=tuple(r for r in range(sizes[chosen]) if r not in alive),
                        retire=tuple(sorted(retire)))


# -- printing -----------------------------------------------------------------------------------

def render_steps(steps: Sequence[Step]) -> str:
    """A plan's steps as a markdown table (``docs/design.md`` prints the scale's and the recovery's)."""
    rows = ["| phase | command | to | result | outcomes | at the send | joiners | on failure | trigger |",
            "|---|---|---|---|---|---|---|---|---|"]
    for s in steps:
        at_send = ", ".join(type(o).__name__ for o in s.at_send) or "-"
        rows.append(f"| `{s.phase.value}` | `{s.command.__name__}` | {s.recipients.value} | `{s.expects.__name__}` | "
                    f"{', '.join(t.__name__ for t in s.yields)} | {at_send} | {s.joiners.value} | "
                    f"{s.on_failure.value} | {f'`{s.trigger.value}`' if s.trigger else '-'} |")
    return "\n".join(rows)
