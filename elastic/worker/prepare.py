"""A scale's prepare sub-phase on one rank: the standby group and the pre-transfer.

What a rescale can do before its pause, it does in ``draining`` once the drain is over
(:class:`~elastic.core.protocol.Prepare`): the EPLB is off and every rank has committed the same
layers, so the placement is fixed until the switch, and expert weights do not change while a
model serves. So the new placement and every layer's plan are computed once, the new group is
formed as a standby group, and the network part of the plan moves while the old group decodes:

- a joining rank receives its experts straight into its fresh weights;
- a surviving rank stages the layers it changes in spare memory (:class:`StagedLayer`: the
  whole new layer, swapped in at the switch, or with NIXL the new contents of the changed slots
  and room for their undo copy, copied in place), at most ``prestage_max_bytes``; layers that do
  not fit move in the pause;
- a scale up moves over the standby group (the joining ranks are in no other group); a scale
  down over the old group (the leaving ranks are in no other).

Old ranks move one layer per decode step, at agreed steps: the step-boundary all-reduce carries
two words (:meth:`Preparation.words`): *hold* (some rank has spent more than its share of the
wall time on the pre-transfer, and the pacing window has not run out) and *failed* (some rank's layer failed: every rank drops the
preparation at the same step and the old group keeps serving). The joining ranks wait for each
layer in turn. The pause is then the switch: install the standby group, copy the pre-transferred
slots in place (with the undo log), move what was left, a barrier, adopt.
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


def over_share(spent_s: float, elapsed_s: float, share: float) -> bool:
    """Whether a rank that spent ``spent_s`` of ``elapsed_s`` wall seconds on the pre-transfer
    must hold the next layer to keep within ``share`` (decoding keeps ``1 - share``)."""
    return spent_s > share * elapsed_s


@dataclass
class StagedLayer:
    """A surviving rank's layer, ready for the switch, in one of two forms.

    - *Whole layer* (``layer``: the new tensors of the layer, every slot): the switch swaps them
      in for the serving ones, which stay untouched until adoption (so nothing to undo and
      nothing to copy). For communicators whose peers do not address the weight tensors (gloo,
      NCCL).
    - *Rows* (``new_rows``: the new contents of the changed local ``slots``, one ``[len(slots),
      ...]`` tensor per weight tensor, and ``undo_rows``, as much room for the undo copy): the
      switch copies them in place, two vectorized copies per weight tensor. For NIXL, whose peers
      read the registered weight tensors: they must stay the same tensors.
    """

    slots: torch.Tensor  # int64 local slot indices that change
    new_rows: list[torch.Tensor] = field(default_factory=list)
    undo_rows: list[torch.Tensor] = field(default_factory=list)
    layer: list[torch.Tensor] | None = None

    @property
    def nbytes(self) -> int:
        """What the switch copies in place (the new rows; the undo copy is as large); 0 for a whole layer."""
        return sum(t.numel() * t.element_size() for t in self.new_rows)

    @property
    def held_bytes(self) -> int:
        """Spare memory this layer holds until the switch."""
        tensors = self.layer if self.layer is not None else [*self.new_rows, *self.undo_rows]
        return sum(t.numel() * t.element_size() for t in tensors)

    def install(self, weights: list[torch.Tensor]) -> None:
        for tensor, rows in zip(weights, self.new_rows):
            tensor.index_copy_(0, self.slots, rows)


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
    received: dict[int, StagedLayer] = field(default_factory=dict)  # a survivor's staged layers
    next_index: int = 0  # into ``layers``
    spent: float = 0.0  # seconds in pre-transfer layers
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
        return sum(staged.held_bytes for staged in self.received.values())

    def words(self, now: float) -> list[int]:
        """This rank's vote at the next step boundary: [hold, failed]."""
        elapsed = now - self.started
        hold = (not self.complete and elapsed < self.command.paced_for_s
                and over_share(self.spent, elapsed, self.command.prestage_share))
        return [int(hold), int(self.failed is not None)]

    def matches(self, rescale: p.Rescale) -> bool:
        """Whether ``rescale`` is the scale this preparation was made for."""
        c = self.command
        return (rescale.prepared and not rescale.lost and (c.generation, c.new_size, c.mapping, c.execute_on)
                == (rescale.generation, rescale.new_size, rescale.mapping, rescale.execute_on))

    def done(self, now_at: float, now: float, layers_total: int) -> p.PrepareDone:
        return p.PrepareDone(
            seconds=now - self.started, group_seconds=self.group_seconds, placement_seconds=self.placement_seconds,
            layers=len(self.layers), layers_total=layers_total, bytes_received=self.bytes_received,
            prestage_bytes=self.prestage_bytes, steps=self.steps, transfer_seconds=self.spent,
            started_at=self.started_at, ended_at=now_at)
