"""A scale's prepare sub-phase on one rank: the standby group and the pre-transfer.

What a rescale can do before its pause, it does in ``draining`` once the drain is over
(:class:`~elastic.core.protocol.Prepare`): the EPLB is off and every rank has committed the same
layers, so the placement is fixed until the switch, and expert weights do not change while a
model serves. So the new placement and every layer's plan are computed once, the new group is
formed as a standby group, and the network part of the plan moves while the old group decodes:

- a joining rank receives its experts straight into its fresh weights;
- a surviving rank stages each layer it changes whole in spare memory (a copy of its serving
  tensors with the changed slots filled in), at most ``prestage_max_bytes``, and the switch swaps
  it in; layers that do not fit move in the pause;
- a scale up moves over the standby group (the joining ranks are in no other group); a scale
  down over the old group (the leaving ranks are in no other).

Old ranks move one layer per decode step, at agreed steps: the step-boundary all-reduce carries
two words (:meth:`Preparation.words`): *hold* (some rank has spent more than its share of the
wall time on the prepare, its set-up included, or decoded fewer steps than ``1 - share`` of its
steady pace, and the layers left, back to back at its pace so far, would still end within the
pacing window) and *failed* (some rank's layer failed: every rank drops the
preparation at the same step and the old group keeps serving). The joining ranks wait for each
layer in turn. The pause is then the switch: install the standby group, swap the staged layers in (the
serving tensors stay untouched until adoption, so there is nothing to undo), move what was
left, a barrier, adopt.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from elastic.core import protocol as p
from elastic.worker.groups import StandbyGroup
from eplb.placement import Placement
from eplb.plan import LayerPlan

#: the words the pre-transfer adds to the step-boundary all-reduce (MAX): hold, failed
PREPARE_WORDS = 2
#: how many times longer than the time share alone the step count may make the pre-transfer: a
#: steady pace taken before the load changed (a larger batch, slower steps) would otherwise hold
#: every layer to the end of the pacing window
PACE_STRETCH = 3.0


def over_share(spent_s: float, elapsed_s: float, share: float) -> bool:
    """Whether a rank that spent ``spent_s`` of ``elapsed_s`` wall seconds on the pre-transfer
    must hold the next layer to keep within ``share`` (decoding keeps ``1 - share``)."""
    return spent_s > share * elapsed_s


def behind_pace(steps: int, elapsed_s: float, steady_step_s: float, share: float) -> bool:
    """Whether a rank that decoded ``steps`` steps in the ``elapsed_s`` wall seconds since its
    Prepare kept less than ``1 - share`` of its steady throughput (a step per ``steady_step_s``
    before the Prepare; 0: not known, never behind).

    The time a rank spends in the pre-transfer is not all it costs decoding: on cores the ranks
    share, a peer's transfer, a progress thread or fresh pages slow the steps in between too. The
    step count sees all of it."""
    return steady_step_s > 0 and steps < (1 - share) * elapsed_s / steady_step_s


@dataclass
class Preparation:
    """Everything one rank holds for a prepared scale, from its Prepare to the switch."""

    command: p.Prepare
    executing_rank: int  # this rank in the group the pre-transfer moves over
    new_rank: int  # -1: this rank leaves at the switch
    standby: StandbyGroup | None  # the next generation (None on a leaving rank)
    base: Placement  # the drained placement every old rank holds
    placement: Placement  # the new one
    plans: list[LayerPlan]
    layers: tuple[int, ...]  # pre-transferred layers, in order (the same on every rank)
    group: Any  # the group the pre-transfer moves over (None: the old default group)
    started_at: float  # time.monotonic() at the Prepare
    started: float  # time.perf_counter() at the Prepare
    group_seconds: float = 0.0
    placement_seconds: float = 0.0
    #: a survivor's staged layers: per layer, its whole new tensors (swapped in at the switch)
    received: dict[int, list[torch.Tensor]] = field(default_factory=dict)
    next_index: int = 0  # into ``layers``
    spent: float = 0.0  # seconds in pre-transfer layers
    #: seconds the decode thread spent setting up the scale before the first layer (stopping the
    #: EPLB, the plan, the standby group): the pacing counts them, as decoding lost them too
    setup_seconds: float = 0.0
    #: this rank's step time before the Drain, the lower of the median and the mean of its last
    #: steps in this group (0: not known)
    steady_step_s: float = 0.0
    bytes_received: int = 0
    steps: int = 0  # decode steps since the Prepare
    failed: str | None = None
    reported: bool = False

    @property
    def complete(self) -> bool:
        return self.next_index >= len(self.layers)

    @property
    def prestage_bytes(self) -> int:
        """Spare memory held for the pause (a survivor's staged layers)."""
        return sum(t.numel() * t.element_size() for staged in self.received.values() for t in staged)

    def words(self, now: float) -> list[int]:
        """This rank's vote at the next step boundary: [hold, failed]. It holds while its time in
        the pre-transfer is over its share, or its decode steps are behind ``1 - share`` of its
        steady pace (while that time is over ``share / PACE_STRETCH``), unless holding would make
        the layers left overrun the pacing window."""
        elapsed = now - self.started
        share = self.command.prestage_share
        spent = self.setup_seconds + self.spent
        # the steps must stay ahead of the pace through the next layer too, which decodes none (at
        # its end, a short prepare would otherwise lose a layer's worth of steps below the line)
        through_next = elapsed + self.layer_estimate()
        paced = over_share(spent, elapsed, share) or (behind_pace(self.steps, through_next, self.steady_step_s, share)
                                                      and over_share(spent, elapsed, share / PACE_STRETCH))
        hold = (not self.complete and paced
                and elapsed + self.remaining_estimate() < self.command.paced_for_s)
        return [int(hold), int(self.failed is not None)]

    def layer_estimate(self) -> float:
        """Seconds the next layer will take: this rank's mean layer so far (0 before the first)."""
        return self.spent / max(1, self.next_index)

    def remaining_estimate(self) -> float:
        """Seconds the layers left would take back to back, at this rank's mean so far."""
        return self.layer_estimate() * (len(self.layers) - self.next_index)

    def matches(self, rescale: p.Rescale) -> bool:
        """Whether ``rescale`` is the scale this preparation was made for."""
        return rescale.prepared and not rescale.spec.lost and self.command.spec == rescale.spec

    def done(self, now_at: float, now: float) -> p.PrepareDone:
        return p.PrepareDone(
            seconds=now - self.started, group_seconds=self.group_seconds, placement_seconds=self.placement_seconds,
            layers=len(self.layers), layers_total=sum(1 for plan in self.plans if plan.changes_anything),
            bytes_received=self.bytes_received,
            prestage_bytes=self.prestage_bytes, steps=self.steps, transfer_seconds=self.spent,
            steady_step_seconds=self.steady_step_s,
            started_at=self.started_at, ended_at=now_at)
