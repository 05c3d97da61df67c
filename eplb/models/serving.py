"""What a worker needs to serve either model kind: sizes before building, building on a rank, batches.

- :func:`model_info` gives the counts and the expert layout of a ``model:`` spec without building
  the model (a standby rank allocates its slots from it).
- :func:`build_model` builds one EP rank of the reference model or of a Hugging Face model.
- :class:`DecodeBatches` is the decode loop of a Hugging Face model: seeded prompts of the
  rank's own, greedy decoding with the model's KV cache (one ``forward_batch`` per step), a new
  batch when one is done; each step returns the dispatch's load (the group's counts).
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from eplb.model import ModelShape, ReferenceMoE, allocate_weights
from eplb.models.config import HFModelConfig
from eplb.placement import Placement
from eplb.trace import seed_for

if TYPE_CHECKING:
    from eplb.models.hf import DecodeState

__all__ = ["DecodeBatches", "ModelSizes", "StepOutput", "build_model", "model_info"]


@dataclass(frozen=True)
class ModelSizes:
    """Counts and expert layout of a model spec, for placements and memory before any weights exist."""

    kind: str
    num_moe_layers: int
    num_logical_experts: int
    num_expert_groups: int
    expert_bytes: int  # one expert's tensors in one layer
    spec: Any

    def allocate(self, num_local: int) -> list[list[torch.Tensor]]:
        """Uninitialized slot tensors for ``num_local`` slots, the layout the model serves from."""
        if self.kind == "hf":
            from eplb.models.hf import describe

            return describe(self.spec).allocate(num_local)
        return allocate_weights(self.spec, num_local)


def model_info(spec: ModelShape | HFModelConfig) -> ModelSizes:
    if isinstance(spec, HFModelConfig):
        from eplb.models.hf import describe

        info = describe(spec)
        return ModelSizes("hf", info.num_moe_layers, info.num_logical_experts, info.num_expert_groups,
                          info.expert_bytes, spec)
    return ModelSizes("reference", spec.num_layers, spec.num_experts, spec.num_expert_groups, spec.expert_bytes, spec)


def build_model(spec: ModelShape | HFModelConfig, placement: Placement, rank: int, num_ranks: int, *,
                seed: int = 0, group: Any = None, timeout: float = 30.0, joining: bool = False):
    """One EP rank of the model ``spec`` describes, holding ``placement``'s slots of ``rank``.

    ``joining``: a rank whose experts arrive by transfer and, for a Hugging Face model, whose
    non-expert weights arrive from a peer (``sync_non_expert``, a collective on the new group);
    nothing is read from disk. ``seed`` is the reference model's (a HF spec carries its own).
    """
    if isinstance(spec, HFModelConfig):
        from eplb.models.hf import HFMoE

        return HFMoE(spec, placement, rank, num_ranks, group=group, timeout=timeout,
                     materialize=not joining, load_non_expert=not joining)
    return ReferenceMoE(spec, placement, rank, num_ranks, seed=seed, materialize=not joining)


@dataclass(frozen=True)
class StepOutput:
    tokens: torch.Tensor  # [B] the greedy tokens of this step
    new_batch: bool  # this step prefilled a new batch
    logical: torch.Tensor  # [layers, L] pairs the dispatch delivered this step (the group's)
    physical: torch.Tensor  # [layers, P] the same per physical slot
    seconds: float


class DecodeBatches:
    """Greedy decoding of seeded batches, one token per sequence per step.

    Batch ``b`` holds ``batch`` prompts of ``prompt_len`` tokens drawn from ``(seed, b, rank)``;
    it is prefilled at its first step and decoded until ``max_new_tokens``, then batch ``b + 1``
    starts. Every rank of the EP group calls :meth:`step` at the same step (a collective: the
    experts are exchanged), each decoding its own prompts.
    """

    def __init__(self, model, *, batch: int = 4, prompt_len: int = 8, max_new_tokens: int = 16, seed: int = 0):
        if batch < 1 or prompt_len < 1 or max_new_tokens < 1:
            raise ValueError("batch, prompt_len and max_new_tokens must be positive")
        self.model = model
        self.batch, self.prompt_len, self.max_new_tokens, self.seed = batch, prompt_len, max_new_tokens, seed
        self.batch_index = -1
        self.state: DecodeState | None = None

    def prompts(self, index: int) -> torch.Tensor:
        g = torch.Generator().manual_seed(seed_for(self.seed, "prompts", index, getattr(self.model, "rank", 0)))
        return torch.randint(0, self.model.vocab_size, (self.batch, self.prompt_len), generator=g)

    def step(self) -> StepOutput:
        started = time.perf_counter()
        new_batch = self.state is None or len(self.state.tokens) >= self.max_new_tokens
        if new_batch:
            self.batch_index += 1
            self.state = self.model.prefill(self.prompts(self.batch_index))
            tokens = self.state.last
        else:
            assert self.state is not None  # not a new batch: one is being decoded
            tokens = self.model.decode_step(self.state)
        logical, physical = self.model.take_load()
        return StepOutput(tokens, new_batch, logical, physical, time.perf_counter() - started)
