"""The model protocol the EPLB drives, and the reference MoE model that ships with the project.

An engine plugs in by implementing :class:`MixtureOfExperts`: its expert weights per MoE layer
(a list of tensors whose first dimension is the local physical slot), its counts, and a hook
that installs the maps it routes with.

The reference model has real weight tensors and real compute. Its expert weights are a pure
function of ``(seed, layer, logical expert)`` (:meth:`ReferenceMoE.canonical_expert`), which
is what makes every slot verifiable bit-exactly on any rank, makes all replicas of an expert
identical, and stands in for a checkpoint loader when a rank's weights are lost.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Protocol, runtime_checkable

import torch
from pydantic import BaseModel, ConfigDict, Field, model_validator

from eplb.placement import Placement
from eplb.trace import seed_for

__all__ = ["MixtureOfExperts", "ModelShape", "ReferenceMoE", "allocate_weights", "mismatched_slots", "mismatched_staged",
           "split_over_replicas"]


@runtime_checkable
class MixtureOfExperts(Protocol):
    num_moe_layers: int
    num_logical_experts: int
    num_physical_experts: int
    num_local_physical_experts: int
    num_expert_groups: int

    def expert_weights(self) -> list[list[torch.Tensor]]:
        """Per MoE layer, the expert weight tensors, each ``[num_local_physical_experts, ...]``."""
        ...

    def install_placement(self, placement: Placement, rank: int, num_ranks: int) -> None:
        """Route with these maps from now on (called after each commit and each rescale)."""
        ...


class ModelShape(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    num_layers: int = Field(4, ge=1)
    num_experts: int = Field(16, ge=1, description="logical experts per layer")
    num_expert_groups: int = Field(1, ge=1)
    hidden_size: int = Field(64, ge=1)
    intermediate_size: int = Field(128, ge=1)
    dtype: str = "float32"

    @model_validator(mode="after")
    def _check(self) -> ModelShape:
        if self.num_experts % self.num_expert_groups:
            raise ValueError(f"num_expert_groups={self.num_expert_groups} does not divide num_experts={self.num_experts}")
        if not isinstance(getattr(torch, self.dtype, None), torch.dtype):
            raise ValueError(f"dtype {self.dtype!r} is not a torch dtype")
        return self

    @property
    def torch_dtype(self) -> torch.dtype:
        return getattr(torch, self.dtype)

    @property
    def expert_bytes(self) -> int:
        """Bytes of one expert's weights (w1 and w2)."""
        return 2 * self.hidden_size * self.intermediate_size * torch.empty((), dtype=self.torch_dtype).element_size()


def split_over_replicas(logical_counts: torch.Tensor, placement: Placement, offset: int = 0) -> torch.Tensor:
    """Split each expert's tokens evenly over its replicas: ``[layers, L] -> [layers, P]``.

    Replica ``i`` of an expert with ``r`` replicas and ``c`` tokens gets ``c // r`` plus one of
    the ``c % r`` remainder tokens, starting at replica ``offset % r`` (so different ranks'
    remainders land on different replicas).
    """
    p2l = placement.physical_to_logical
    layers, slots = p2l.shape
    counts = torch.gather(logical_counts.long(), 1, p2l)
    replicas = torch.gather(placement.replica_count, 1, p2l)
    # replica index of every slot: its position among the slots holding the same expert
    l2p = placement.logical_to_physical
    replica_index = torch.empty_like(p2l)
    valid = l2p >= 0
    idx = torch.arange(l2p.shape[2]).expand_as(l2p)
    replica_index.view(-1).scatter_(0, (l2p + torch.arange(layers).view(-1, 1, 1) * slots)[valid], idx[valid])
    remainder = counts % replicas
    gets_extra = ((replica_index - offset) % replicas) < remainder
    return counts // replicas + gets_extra.long()


def allocate_weights(shape: ModelShape, num_local: int) -> list[list[torch.Tensor]]:
    """Uninitialized expert weights for ``num_local`` slots: per layer ``[w1 [S, H, I], w2 [S, I, H]]``."""
    return [
        [torch.empty(num_local, shape.hidden_size, shape.intermediate_size, dtype=shape.torch_dtype),
         torch.empty(num_local, shape.intermediate_size, shape.hidden_size, dtype=shape.torch_dtype)]
        for _ in range(shape.num_layers)
    ]


def mismatched_slots(model: Any) -> list[tuple[int, int]]:
    """``(layer, physical slot)`` of every local slot of ``model`` (a :class:`MixtureOfExperts` with
    ``placement``, ``rank``, ``num_ranks`` and ``canonical_expert``) not holding exactly its expert."""
    view = model.placement.rank_view(model.rank, model.num_ranks)
    weights = model.expert_weights()
    bad = []
    for layer in range(model.num_moe_layers):
        for local, expert in enumerate(view.physical_to_logical[layer].tolist()):
            want = model.canonical_expert(layer, expert)
            if not all(torch.equal(w[local], c) for w, c in zip(weights[layer], want)):
                bad.append((layer, view.first_slot + local))
    return bad


def mismatched_staged(model: Any, layer: int, new_row: torch.Tensor, rank_plan: Any,
                      staging: list[torch.Tensor]) -> list[int]:
    """Local slots of a staged layer that do not hold exactly the expert ``new_row`` assigns."""
    first = rank_plan.num_new_slots * model.rank
    return [local for local in rank_plan.changed_slots
            if not all(torch.equal(s[local], c)
                       for s, c in zip(staging, model.canonical_expert(layer, int(new_row[first + local]))))]


class ReferenceMoE:
    """A real MoE block per layer on one EP rank: ``y = relu(x @ w1) @ w2`` for each local slot."""

    def __init__(self, shape: ModelShape, placement: Placement, rank: int, num_ranks: int, seed: int = 0,
                 *, materialize: bool = True):
        self.shape = shape
        self.seed = seed
        self.num_moe_layers = shape.num_layers
        self.num_logical_experts = shape.num_experts
        self.num_expert_groups = shape.num_expert_groups
        self._weights: list[list[torch.Tensor]] = []
        self._activations = torch.randn(
            256, shape.hidden_size, generator=torch.Generator().manual_seed(seed_for(seed, "x")), dtype=shape.torch_dtype
        )
        self.install_placement(placement, rank, num_ranks)
        self._weights = self.allocate(self.num_local_physical_experts)
        if materialize:
            self.load_canonical()

    # -- the protocol -------------------------------------------------------------------
    def expert_weights(self) -> list[list[torch.Tensor]]:
        return self._weights

    def install_placement(self, placement: Placement, rank: int, num_ranks: int) -> None:
        self.placement = placement
        self.rank = rank
        self.num_ranks = num_ranks
        self.num_physical_experts = placement.num_physical
        self.num_local_physical_experts = placement.slots_per_rank(num_ranks)

    # -- weights ------------------------------------------------------------------------
    def allocate(self, num_local: int) -> list[list[torch.Tensor]]:
        return allocate_weights(self.shape, num_local)

    def replace_weights(self, weights: list[list[torch.Tensor]]) -> None:
        self._weights = weights

    def canonical_expert(self, layer: int, expert: int) -> list[torch.Tensor]:
        """The checkpoint's weights of one logical expert (reproducible anywhere)."""
        s = self.shape
        g = torch.Generator().manual_seed(seed_for(self.seed, "expert", layer, expert))
        scale = s.hidden_size ** -0.5
        w1 = (torch.randn(s.hidden_size, s.intermediate_size, generator=g) * scale).to(s.torch_dtype)
        w2 = (torch.randn(s.intermediate_size, s.hidden_size, generator=g) * scale).to(s.torch_dtype)
        return [w1, w2]

    def load_canonical(self, layers: Sequence[int] | None = None) -> None:
        """Fill every local slot from the canonical source (the checkpoint loader)."""
        view = self.placement.rank_view(self.rank, self.num_ranks)
        for layer in range(self.num_moe_layers) if layers is None else layers:
            for local, expert in enumerate(view.physical_to_logical[layer].tolist()):
                for dst, src in zip(self._weights[layer], self.canonical_expert(layer, expert)):
                    dst[local].copy_(src)

    def verify(self) -> list[tuple[int, int]]:
        """``(layer, physical slot)`` of every local slot that does not hold exactly its expert."""
        return mismatched_slots(self)

    def verify_staged(self, layer: int, new_row: torch.Tensor, rank_plan, staging: list[torch.Tensor]) -> list[int]:
        """Local slots of a staged layer that do not hold exactly the expert ``new_row`` assigns."""
        return mismatched_staged(self, layer, new_row, rank_plan, staging)

    # -- compute ------------------------------------------------------------------------
    def route(self, logical_counts: torch.Tensor) -> torch.Tensor:
        """``[layers, L]`` logical token counts of this rank's batch -> ``[layers, P]`` per slot."""
        return split_over_replicas(logical_counts, self.placement, offset=self.rank)

    def forward(self, physical_counts: torch.Tensor) -> float:
        """Run every local expert on the tokens the whole group routed to it this step.

        ``physical_counts`` is ``[layers, P]`` (all ranks' tokens per slot). The work is real:
        a rank whose slots get more tokens takes longer. Returns a checksum of the outputs.
        """
        view = self.placement.rank_view(self.rank, self.num_ranks)
        local = physical_counts[:, view.first_slot : view.first_slot + view.num_local]
        total = 0.0
        cap = self._activations.shape[0]
        for layer, (w1, w2) in enumerate(self._weights):
            for slot, n in enumerate(local[layer].tolist()):
                while n > 0:
                    x = self._activations[: min(n, cap)]
                    total += float((torch.relu(x @ w1[slot]) @ w2[slot]).sum())
                    n -= x.shape[0]
        return total
