"""Expert placements: the three maps an engine routes with, per MoE layer.

A placement says which logical expert each physical slot holds. Everything else is
derived from ``physical_to_logical`` alone:

- ``physical_to_logical``  ``[layers, P]``   int64, logical expert held by each slot
- ``logical_to_physical``  ``[layers, L, W]`` int64, slots holding each expert, ``-1`` padded,
  slots in ascending order (``W`` defaults to ``P - L + 1``, the widest a valid placement needs)
- ``replica_count``        ``[layers, L]``   int64, how many slots hold each expert

Physical slots are laid out rank-major: with ``P / num_ranks`` slots per rank, rank ``r``
holds slots ``[r * S, (r + 1) * S)``. This module is pure: no I/O, no ``torch.distributed``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

__all__ = [
    "Placement",
    "PlacementError",
    "RankView",
    "align_slots",
    "build_logical_to_physical",
    "static_physical_to_logical",
    "validate_physical_to_logical",
]


class PlacementError(ValueError):
    """A placement (or a request for one) that cannot be served.

    ``layer`` and ``slot`` name the place at fault when there is one, so a caller can
    report exactly which layer and physical slot broke the rule.
    """

    def __init__(self, reason: str, *, layer: int | None = None, slot: int | None = None):
        self.reason = reason
        self.layer = layer
        self.slot = slot
        where = []
        if layer is not None:
            where.append(f"layer {layer}")
        if slot is not None:
            where.append(f"slot {slot}")
        super().__init__(f"{', '.join(where)}: {reason}" if where else reason)


def static_physical_to_logical(num_layers: int, num_logical: int, num_physical: int) -> torch.Tensor:
    """The initial placement: slot ``i < L`` holds expert ``i``; redundant slot ``L + j`` holds ``j % L``.

    Returns ``[num_layers, num_physical]`` int64.
    """
    if num_layers < 1 or num_logical < 1:
        raise PlacementError(f"need at least one layer and one expert, got layers={num_layers}, experts={num_logical}")
    if num_physical < num_logical:
        raise PlacementError(
            f"{num_physical} physical slots cannot hold {num_logical} logical experts (need at least one slot each)"
        )
    row = torch.arange(num_physical, dtype=torch.int64) % num_logical
    return row.unsqueeze(0).expand(num_layers, num_physical).contiguous()


def validate_physical_to_logical(physical_to_logical: torch.Tensor, num_logical: int) -> None:
    """Raise :class:`PlacementError` naming the first layer/slot at fault, else return None.

    Rules: a 2-D integer tensor; every slot holds an expert in ``[0, num_logical)``;
    every expert is held by at least one slot on every layer.
    """
    p2l = physical_to_logical
    if not isinstance(p2l, torch.Tensor) or p2l.dim() != 2:
        raise PlacementError(f"physical_to_logical must be a [layers, slots] tensor, got shape {tuple(getattr(p2l, 'shape', ()))}")
    if p2l.dtype.is_floating_point or p2l.dtype == torch.bool:
        raise PlacementError(f"physical_to_logical must hold integers, got {p2l.dtype}")
    layers, slots = p2l.shape
    if slots < num_logical:
        raise PlacementError(f"{slots} slots cannot hold {num_logical} logical experts")
    bad = (p2l < 0) | (p2l >= num_logical)
    if bad.any():
        layer, slot = (int(i) for i in bad.nonzero()[0])
        raise PlacementError(
            f"holds expert {int(p2l[layer, slot])}, outside [0, {num_logical})", layer=layer, slot=slot
        )
    counts = _replica_counts(p2l.long(), num_logical)
    missing = counts == 0
    if missing.any():
        layer, expert = (int(i) for i in missing.nonzero()[0])
        raise PlacementError(f"logical expert {expert} has no replica", layer=layer)


def _replica_counts(p2l: torch.Tensor, num_logical: int) -> torch.Tensor:
    counts = torch.zeros(p2l.shape[0], num_logical, dtype=torch.int64)
    counts.scatter_add_(1, p2l, torch.ones_like(p2l))
    return counts


def build_logical_to_physical(
    physical_to_logical: torch.Tensor, num_logical: int, width: int | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Derive ``(logical_to_physical [layers, L, width], replica_count [layers, L])``.

    Vectorized over layers: slots are sorted by (expert, slot) and each slot's replica index
    is its position within its expert's run.
    """
    p2l = physical_to_logical.long()
    layers, slots = p2l.shape
    width = slots - num_logical + 1 if width is None else width
    counts = _replica_counts(p2l, num_logical)
    if int(counts.max()) > width:
        layer = int((counts.max(dim=1).values > width).nonzero()[0])
        raise PlacementError(f"an expert has {int(counts[layer].max())} replicas, more than width {width}", layer=layer)
    slot_ids = torch.arange(slots, dtype=torch.int64).expand(layers, slots)
    order = torch.argsort(p2l * slots + slot_ids, dim=1, stable=True)
    sorted_experts = torch.gather(p2l, 1, order)
    run_start = torch.cumsum(counts, dim=1) - counts  # first sorted position of each expert
    replica_index = torch.arange(slots).expand(layers, slots) - torch.gather(run_start, 1, sorted_experts)
    l2p = torch.full((layers, num_logical, width), -1, dtype=torch.int64)
    l2p.view(layers, -1).scatter_(1, sorted_experts * width + replica_index, order)
    return l2p, counts


@dataclass(frozen=True)
class RankView:
    """The part of a placement one rank holds: slots ``[first_slot, first_slot + num_local)``."""

    rank: int
    num_ranks: int
    first_slot: int
    num_local: int
    physical_to_logical: torch.Tensor  # [layers, num_local]

    @property
    def slots(self) -> range:
        return range(self.first_slot, self.first_slot + self.num_local)


@dataclass(frozen=True, eq=False)
class Placement:
    """A validated placement with its three maps. Immutable: updates make new objects."""

    physical_to_logical: torch.Tensor
    logical_to_physical: torch.Tensor
    replica_count: torch.Tensor

    @classmethod
    def from_physical_to_logical(
        cls, physical_to_logical: torch.Tensor, num_logical: int, width: int | None = None
    ) -> Placement:
        validate_physical_to_logical(physical_to_logical, num_logical)
        p2l = physical_to_logical.to(torch.int64).contiguous()
        l2p, counts = build_logical_to_physical(p2l, num_logical, width)
        return cls(p2l, l2p, counts)

    @classmethod
    def static(cls, num_layers: int, num_logical: int, num_physical: int) -> Placement:
        return cls.from_physical_to_logical(
            static_physical_to_logical(num_layers, num_logical, num_physical), num_logical
        )

    @property
    def num_layers(self) -> int:
        return self.physical_to_logical.shape[0]

    @property
    def num_physical(self) -> int:
        return self.physical_to_logical.shape[1]

    @property
    def num_logical(self) -> int:
        return self.replica_count.shape[1]

    def slots_per_rank(self, num_ranks: int) -> int:
        if num_ranks < 1 or self.num_physical % num_ranks:
            raise PlacementError(f"{self.num_physical} physical slots do not divide over {num_ranks} ranks")
        return self.num_physical // num_ranks

    def rank_view(self, rank: int, num_ranks: int) -> RankView:
        per_rank = self.slots_per_rank(num_ranks)
        if not 0 <= rank < num_ranks:
            raise PlacementError(f"rank {rank} is outside [0, {num_ranks})")
        first = rank * per_rank
        return RankView(rank, num_ranks, first, per_rank, self.physical_to_logical[:, first : first + per_rank])

    def with_layer(self, layer: int, physical_to_logical_row: torch.Tensor) -> Placement:
        """A new placement with one layer replaced (what an async commit installs)."""
        p2l = self.physical_to_logical.clone()
        p2l[layer] = physical_to_logical_row
        return Placement.from_physical_to_logical(p2l, self.num_logical, self.logical_to_physical.shape[2])

    def rank_loads(self, logical_load: torch.Tensor, num_ranks: int) -> torch.Tensor:
        """Per-rank load ``[layers, num_ranks]`` when each expert's load splits evenly over its replicas."""
        load = logical_load.to(torch.float64)
        per_slot = torch.gather(load / self.replica_count.clamp(min=1), 1, self.physical_to_logical)
        return per_slot.view(self.num_layers, num_ranks, -1).sum(dim=2)

    def balancedness(self, logical_load: torch.Tensor, num_ranks: int) -> torch.Tensor:
        """Mean rank load / max rank load per layer, ``[layers]`` float64 (1.0 where a layer has no load)."""
        loads = self.rank_loads(logical_load, num_ranks)
        peak = loads.max(dim=1).values
        return torch.where(peak > 0, loads.mean(dim=1) / peak.clamp(min=1e-300), torch.ones_like(peak))

    def equals(self, other: Placement) -> bool:
        return torch.equal(self.physical_to_logical, other.physical_to_logical)


def align_slots(
    new_p2l: torch.Tensor,
    held_p2l: torch.Tensor,
    slots_per_rank: int,
    rank_mapping: list[int] | tuple[int, ...] | None = None,
) -> torch.Tensor:
    """Reorder each rank's slots so that an expert the rank already holds stays in its slot.

    Inside one rank the order of slots is free: routing, load and balance depend only on
    which experts a rank holds, not where. A policy that packs from scratch reshuffles them
    anyway, and every reshuffled slot is a local copy (plus an undo entry during a rescale).
    This keeps the per-rank multisets of ``new_p2l`` and only permutes within a rank, so the
    result is exactly as balanced and every rank still receives the same experts.

    Args:
        new_p2l: ``[layers, R_new * S]`` the policy's placement.
        held_p2l: ``[layers, R_old * S]`` what each old rank's slots hold now.
        slots_per_rank: ``S``, the same before and after.
        rank_mapping: ``rank_mapping[old] = new`` rank, ``-1`` for a rank that leaves or is
            lost; default the identity (a rebalance on the same group).

    Returns:
        ``[layers, R_new * S]`` int64, a new tensor (inputs are not modified).

    Steps, per layer and per new rank ``n`` that was old rank ``o``:
        1. count the experts the policy gave ``n``;
        2. slot by slot, keep ``o``'s expert where ``n`` still gets a replica of it;
        3. put the remaining experts, in the policy's order, into the remaining slots.
    """
    s = slots_per_rank
    old_ranks = held_p2l.shape[1] // s
    new_ranks = new_p2l.shape[1] // s
    mapping = list(range(min(old_ranks, new_ranks))) + [-1] * max(0, old_ranks - new_ranks) \
        if rank_mapping is None else [int(m) for m in rank_mapping]
    if len(mapping) != old_ranks:
        raise PlacementError(f"rank_mapping has {len(mapping)} entries for {old_ranks} old ranks")
    out = new_p2l.to(torch.int64).clone()
    new_rows, held_rows = out.tolist(), held_p2l.tolist()
    for layer, (new_row, held_row) in enumerate(zip(new_rows, held_rows)):
        changed = False
        for o, n in enumerate(mapping):
            if not 0 <= n < new_ranks:
                continue
            given = new_row[n * s : (n + 1) * s]
            aligned = _align_rank(given, held_row[o * s : (o + 1) * s])
            if aligned != given:
                new_row[n * s : (n + 1) * s] = aligned
                changed = True
        if changed:
            out[layer] = torch.tensor(new_row, dtype=torch.int64)
    return out


def _align_rank(given: list[int], held: list[int]) -> list[int]:
    """One rank's slots: the experts ``given`` (the policy's order), arranged so that each slot
    whose ``held`` expert the rank still gets keeps it (steps 1-3 of :func:`align_slots`)."""
    if given == held:
        return given
    # 1. what the policy gave this rank, by expert
    left: dict[int, int] = {}
    for e in given:
        left[e] = left.get(e, 0) + 1
    # 2. keep what the rank holds in place
    slots: list[int | None] = [None] * len(held)
    for j, e in enumerate(held):
        if left.get(e, 0) > 0:
            slots[j] = e
            left[e] -= 1
    # 3. the rest, in the policy's order, into the free slots
    rest: list[int] = []
    for e in given:
        if left[e] > 0:
            rest.append(e)
            left[e] -= 1
    fill = iter(rest)
    return [e if e is not None else next(fill) for e in slots]
