"""Fault injection for tests and scenarios: what to break, on which rank, when.

Each fault is a small validated record the coordinator hands to the workers in their spec;
a worker applies the ones that name its current rank. Nothing here is used in production
paths unless a scenario or test asks for it.

Which generation a fault applies in:

- ``generation``: only in that generation (ranks are renumbered by every scale and recovery, so
  this pins the fault to one group's numbering);
- otherwise in any generation from ``from_generation`` on (default 0).

A fault that happens once to one process (:class:`KillRank`, :class:`StallRank`,
:class:`DropHeartbeats`: ``ONCE``) and has no ``generation`` fires **once**: it is bound to the
generation current when it first fires (the first rank that fires it records that generation in
the coordinator's store, atomically). After the lost rank's group is renumbered, the process that
now has its number (a survivor or a fresh worker) is not hit again; without the binding a silenced
or killed rank 1 would silence or kill every later rank 1 in turn. The other faults (a slow link,
corrupt buffers, a torn commit, a slow or hung start) keep applying in every generation they name.
"""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from elastic.core.phases import OPERATION_PHASES

PHASES = tuple(str(phase) for phase in OPERATION_PHASES)  # the names a fault's in_phase takes


class _Fault(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    rank: int = Field(ge=0, description="the rank (at the moment the fault fires) it applies to")
    generation: int | None = Field(None, ge=0, description="only in this generation (default: any, from "
                                   "from_generation on; a ONCE fault then fires once, bound to the generation it "
                                   "first fires in)")
    from_generation: int | None = Field(None, ge=0, description="without generation: not before this generation "
                                        "(default 0)")

    @model_validator(mode="after")
    def _one_generation_rule(self) -> _Fault:
        if self.generation is not None and self.from_generation is not None:
            raise ValueError(f"expected generation (exactly that one) or from_generation (that one or later), not "
                             f"both: got generation {self.generation} and from_generation {self.from_generation}")
        return self

    def in_generation(self, generation: int) -> bool:
        """Whether the fault may apply in ``generation`` (a ONCE fault also needs its binding)."""
        if self.generation is not None:
            return self.generation == generation
        return generation >= (self.from_generation or 0)


class KillRank(_Fault):
    """The worker process dies abruptly (``os._exit``) at a step or when a phase's command reaches it.

    ``at_step``: at the first decode step at or after it in which the rank decodes outside any
    operation (a generation that starts past the step dies once it serves, not in its resuming);
    ``in_phase``: when that phase's command of the next operation reaches it.
    Without ``generation`` it kills once (the rank of the generation it first fires in).
    """

    kind: Literal["kill"] = "kill"
    at_step: int | None = Field(None, ge=0)
    in_phase: Literal["draining", "suppressed", "rescaling", "resuming"] | None = None
    after_layers: int | None = Field(None, ge=0, description="with in_phase=rescaling: die after moving this many layers "
                                     "in the pause; with in_phase=draining: after this many layers of the pre-transfer "
                                     "(the prepare sub-phase; a rank that joins dies while receiving)")

    @model_validator(mode="after")
    def _one_trigger(self) -> KillRank:
        if (self.at_step is None) == (self.in_phase is None):
            raise ValueError("a kill fault needs exactly one of at_step or in_phase")
        if self.after_layers is not None and self.in_phase not in ("rescaling", "draining"):
            raise ValueError("after_layers applies only to in_phase=rescaling or in_phase=draining")
        return self


class StallRank(_Fault):
    """The worker stops answering (sleeps in its decode loop) for ``seconds`` from ``at_step``; once
    (without ``generation``: in the generation it first fires in)."""

    kind: Literal["stall"] = "stall"
    at_step: int = Field(ge=0)
    seconds: float = Field(gt=0)


class DelayTransfer(_Fault):
    """The EPLB (async thread, or the decode loop in sync mode) sleeps ``seconds`` before each
    layer transfer (a slow link); with ``times``, only before the first ``times`` layers (a hiccup)."""

    kind: Literal["delay_transfer"] = "delay_transfer"
    seconds: float = Field(gt=0)
    times: int | None = Field(None, ge=1, description="delay only this many layer transfers (default: every one)")


class DropHeartbeats(_Fault):
    """The worker keeps working (decoding, answering its group's collectives) but sends nothing at
    all from ``from_step`` on: no heartbeat, no phase result, no tokens, no event. Under traffic its
    replies to admissions used to keep it alive while its step froze (the group's step is the
    slowest rank's). Without ``generation`` it silences one process: the one that has ``rank`` in
    the generation where it first fires (not, after the recovery renumbers the group, the rank
    that inherits the number). It silences a rank that serves: the start (its busy heartbeats and
    its ``Started``) is still reported, even with ``from_step`` 0, so the rank is lost at its
    heartbeat deadline like a kill at that step, never as a start that hung (``HangBeforeStart``)."""

    kind: Literal["drop_heartbeats"] = "drop_heartbeats"
    from_step: int = Field(0, ge=0)


class CorruptBuffer(_Fault):
    """Flip bits in the staging buffer after a layer is received (verification must catch it)."""

    kind: Literal["corrupt_buffer"] = "corrupt_buffer"
    times: int = Field(1, ge=1, description="how many received layers to corrupt")


class TornCommit(_Fault):
    """This rank's step-boundary all-reduce "fails" just before it would commit its
    ``at_commit``-th async layer, while every other rank completes it and commits.

    It is what a peer dying mid-all-reduce can leave behind (some ranks got the agreed result,
    some did not): survivors whose placements differ by one layer. Recovery must move experts
    by what each survivor actually holds, not by one rank's maps.
    """

    kind: Literal["torn_commit"] = "torn_commit"
    at_commit: int = Field(1, ge=1, description="the how-many-th layer commit (counted on this rank) breaks")


class SlowPrepare(_Fault):
    """The worker's preparation (joining its first group, or standing by ahead of a scale-up)
    takes ``seconds`` longer: a slow checkpoint load. It keeps reporting progress meanwhile."""

    kind: Literal["slow_prepare"] = "slow_prepare"
    seconds: float = Field(gt=0)


class HangBeforeStart(_Fault):
    """The worker process hangs before its first report (an import or a mount that never returns)."""

    kind: Literal["hang_before_start"] = "hang_before_start"


#: the faults that happen once to one process: without ``generation`` each fires once, bound to the
#: generation current when it first fires (see the module's docstring)
ONCE: tuple[type[_Fault], ...] = (KillRank, StallRank, DropHeartbeats)


def fires_once(fault: _Fault) -> bool:
    """Whether ``fault`` is bound to the generation it first fires in (a ONCE kind, no ``generation``)."""
    return isinstance(fault, ONCE) and fault.generation is None


Fault = Annotated[KillRank | StallRank | DelayTransfer | DropHeartbeats | CorruptBuffer | TornCommit | SlowPrepare | HangBeforeStart,
                  Field(discriminator="kind")]
