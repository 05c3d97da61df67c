"""The experts kernel that serves Hugging Face MoE blocks, unsharded or expert-parallel, with the same bits.

Registered in transformers' ``ALL_EXPERTS_FUNCTIONS`` as :data:`KERNEL_NAME`; a model selects it
with ``model.set_experts_implementation(KERNEL_NAME)``. Each experts module it runs on carries an
:class:`ExpertsContext` (attribute ``_eplb``) saying which MoE layer it is, which physical slots
this rank holds, and the group to combine over.

Why a kernel of our own (measured on this machine, CPU torch 2.13 with MKL):

- *Rows per call.* The bits of an expert GEMM depend on how many rows one call holds
  (``F.linear`` at 1-5 rows differs from larger calls by ~1e-5, ``bmm(W[ids], x)`` too), and
  expert parallelism changes how many rows each expert's call gets. Here every (token, k) pair
  is its own ``1 x H`` product in a batched call (``bmm(x[rows, None, :], W[slot]^T.expand(...))``),
  whose bits do not depend on the other rows: :func:`check_row_independent` proves it at start-up.
- *Summation order.* Eager HF sums a token's k contributions in ascending expert id, the
  batched kernels in k order. Here always in k order, in float32, then cast to the model dtype
  (eager bf16 accumulates in bf16 and differs from the other kernels by up to 0.29 in logits).
- *Rows per rank.* Non-expert compute (attention, norms, router) runs on the whole batch on
  every rank (replicated), so the router's choices, and with them every pair's input, are the
  same bits on every rank and in one process: splitting the batch across ranks would change them.

Expert parallelism: a pair goes to one replica of its expert, ``token % replica_count``, so
every rank computes the same assignment without talking. The owning rank computes it; one
``all_gather`` (padded to the largest rank's pair count, waited on with a deadline) brings every
rank's outputs back, and every rank combines all pairs in the same fixed order. The ranks check
that they routed the same pairs from the same bits before the sizes are trusted (see :func:`_combine`).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any, cast

import torch
import torch.distributed as dist

__all__ = ["KERNEL_NAME", "ExpertsContext", "ReplicaDivergence", "check_row_independent", "ep_experts_forward", "pair_forward", "register"]

KERNEL_NAME = "eplb_rowwise"


@dataclass
class ExpertsContext:
    """What one MoE layer's experts module needs to run under EP (one per layer, per rank).

    ``weights`` are this rank's slot tensors (``[num_local_slots, ...]``, in ``names`` order);
    ``logical_to_physical`` / ``replica_count`` are the layer's rows of the placement. With
    ``num_ranks == 1`` and an identity placement this is the unsharded model.
    """

    layer: int
    names: tuple[str, ...]
    weights: list[torch.Tensor]
    logical_to_physical: torch.Tensor  # [L, W]
    replica_count: torch.Tensor  # [L]
    rank: int = 0
    num_ranks: int = 1
    slots_per_rank: int = 0
    group: Any = None
    timeout: float = 30.0
    one_shot_bytes: int = 1 << 20  # combine in one all_gather while all pairs' outputs fit in this
    record: bool = True
    logical_counts: torch.Tensor | None = None  # [L] int64, accumulated while record is on
    physical_counts: torch.Tensor | None = None  # [P] int64
    stats: dict[str, float] = field(default_factory=lambda: {"pairs": 0, "gathered_bytes": 0})


def pair_forward(module: torch.nn.Module, weights: dict[str, torch.Tensor], x: torch.Tensor,
                 slots: torch.Tensor) -> torch.Tensor:
    """One expert per row: ``x [n, H]`` through slot ``slots[i]`` of ``weights``; ``[n, H]``.

    Every row is its own ``1 x H`` GEMM: the rows of one slot go in one batched call against the
    slot's weight expanded over the batch (stride 0, no copy), so a row's bits do not depend on
    the other rows (checked by :func:`check_row_independent`); gathering ``W[slots]`` per row gave
    the same bits 24x slower at H = I = 1024. Gating and activation are the module's.
    """
    transposed = getattr(module, "is_transposed", False)
    has_gate = getattr(module, "has_gate", True)
    order = torch.argsort(slots, stable=True)
    used, counts = torch.unique_consecutive(slots[order], return_counts=True)
    groups = list(zip(used.tolist(), order.split(counts.tolist())))

    def linear(inp: torch.Tensor, name: str) -> torch.Tensor:
        w_all, bias = weights[name], weights.get(name + "_bias")
        out = None
        for slot, rows in groups:
            w = w_all[slot] if transposed else w_all[slot].t()  # [in, out]
            r = torch.bmm(inp[rows, None, :], w.expand(rows.numel(), *w.shape)).squeeze(1)
            if bias is not None:
                r = r + bias[slot]
            if out is None:
                out = inp.new_empty(inp.shape[0], r.shape[1], dtype=r.dtype)
            out[rows] = r
        assert out is not None  # every caller passes at least one row
        return out

    h = linear(x, "gate_up_proj" if has_gate else "up_proj")
    h = _activate(module, h, has_gate)
    h = linear(h, "down_proj")
    if getattr(module, "has_post_expert_norm", False):
        h = _module_fn(module, "post_expert_norm")(h)
    return h


def _module_fn(module: torch.nn.Module, name: str) -> Callable[[torch.Tensor], torch.Tensor]:
    """``module.<name>``, a method or submodule of the transformers experts class (not known to nn.Module)."""
    return getattr(module, name)


#: Activations run on rows padded to a multiple of this many elements (see _activate).
_LANES = 64


def _activate(module: torch.nn.Module, h: torch.Tensor, has_gate: bool) -> torch.Tensor:
    """The module's gate/activation on ``h [n, 2I]`` (``[n, I]`` without gate), row-independent.

    torch runs an elementwise op's full SIMD vectors with a vectorized function (Sleef) and the
    tail of the tensor with a scalar one, whose transcendentals can differ in the last bit; which
    elements fall in the tail depends on how many rows the call holds (gpt_oss's gate changed bits
    at 1 row vs 37 here). Padding every row to a multiple of 64 elements (zeros, cut off after)
    leaves no tail, so every element takes the vectorized path whatever the row count.
    """
    n, width = h.shape
    if has_gate:
        inter = width // 2
        padded = -(-inter // _LANES) * _LANES
        wide = h.new_zeros(n, 2 * padded)
        if getattr(module, "is_concatenated", True):  # [gate | up]: keep each half at the start of its half
            wide[:, :inter] = h[:, :inter]
            wide[:, padded : padded + inter] = h[:, inter:]
        else:  # interleaved [g0, u0, g1, u1, ...]: pairs stay pairs
            wide[:, : 2 * inter] = h
        return _module_fn(module, "_apply_gate")(wide)[:, :inter]
    padded = -(-width // _LANES) * _LANES
    wide = h.new_zeros(n, padded)
    wide[:, :width] = h
    return _module_fn(module, "act_fn")(wide)[:, :width]


def _wait(work, timeout: float, what: str) -> None:
    if not work.wait(timeout=timedelta(seconds=timeout)):
        raise TimeoutError(f"{what} did not finish within {timeout}s")


class ReplicaDivergence(RuntimeError):
    """The ranks' replicated compute (attention, router) gave different bits: EP cannot combine."""


def _bits_sum(t: torch.Tensor) -> int:
    """A fingerprint of a tensor's exact bits (integer sum of its bytes as int16 words, position-weighted)."""
    words = t.detach().contiguous().view(torch.int16).to(torch.int64).reshape(-1)
    return int((words * (torch.arange(words.numel()) % 65521 + 1)).sum())


def _fingerprint(counts: torch.Tensor, hidden: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """What every rank must agree on before combining: pairs per rank, and the bits of the MoE
    input and of the router's choices and weights (int64 ``[N + 3]``)."""
    return torch.cat([counts.to(torch.int64),
                      torch.tensor([_bits_sum(hidden), _bits_sum(ids), _bits_sum(weights)], dtype=torch.int64)])


def _check_agreement(ctx: ExpertsContext, mine: torch.Tensor, everyone: list[torch.Tensor]) -> None:
    differ = [r for r, other in enumerate(everyone) if not torch.equal(other, mine)]
    if differ:
        raise ReplicaDivergence(
            f"MoE layer {ctx.layer}: rank {ctx.rank} and ranks {differ} routed different tokens or from different "
            f"bits (replicated compute diverged: same torch intra-op thread count on every rank?)")


def _gather(ctx: ExpertsContext, send: torch.Tensor, what: str) -> list[torch.Tensor]:
    recv = [torch.empty_like(send) for _ in range(ctx.num_ranks)]
    _wait(dist.all_gather(recv, send, group=ctx.group, async_op=True), ctx.timeout, f"{what} of MoE layer {ctx.layer}")
    return recv


def _combine(ctx: ExpertsContext, out: torch.Tensor, mine: torch.Tensor, owner: torch.Tensor, meta: torch.Tensor) -> None:
    """Fill ``out``'s rows of other ranks' pairs from those ranks, after checking everyone agrees.

    Every rank derives the combine's sizes from its own routing; ranks that disagreed would post
    all_gathers of different sizes, which gloo answers by aborting the process. So the sizes are
    agreed first: when every rank's whole pair list fits in ``one_shot_bytes``, one all_gather of
    ``[meta | pairs padded to all pairs]`` (sizes fixed by the batch); else a small all_gather of
    ``meta`` (fixed size), then the pairs padded to the largest rank's count. A disagreement
    raises :class:`ReplicaDivergence` naming the layer on every rank.
    """
    counts = meta[: ctx.num_ranks]
    hidden = out.shape[1]
    one_shot = out.numel() * out.element_size() <= ctx.one_shot_bytes
    if one_shot:
        width = out.shape[0]
    else:
        _check_agreement(ctx, meta, _gather(ctx, meta, "routing agreement all_gather"))
        width = int(counts.max())
    rows = torch.zeros(width, hidden, dtype=out.dtype)
    rows[: mine.numel()] = out[mine]
    payload = rows.view(-1).view(torch.uint8)
    if one_shot:  # the metadata travels in front of the rows, as raw bytes
        payload = torch.cat([meta.view(torch.uint8), payload])
    received = _gather(ctx, payload, "expert combine all_gather")
    ctx.stats["gathered_bytes"] += payload.numel() * ctx.num_ranks
    if one_shot:
        meta_bytes = meta.numel() * meta.element_size()
        _check_agreement(ctx, meta, [r[:meta_bytes].view(torch.int64) for r in received])
        received = [r[meta_bytes:] for r in received]
    for r, data in enumerate(received):
        if r != ctx.rank and counts[r]:
            # a rank's pairs come back in ascending pair order, the order it packed them in
            out[(owner == r).nonzero().squeeze(1)] = data.view(out.dtype).view(width, hidden)[: int(counts[r])]


def ep_experts_forward(self: torch.nn.Module, hidden_states: torch.Tensor, top_k_index: torch.Tensor,
                       top_k_weights: torch.Tensor) -> torch.Tensor:
    """The ``ALL_EXPERTS_FUNCTIONS`` entry: ``hidden_states [T, H]``, routing ``[T, k]`` -> ``[T, H]``."""
    # cast: torch types nn.Module attributes as Tensor | Module; _eplb is the plain attribute HFMoE._bind sets
    ctx = cast(ExpertsContext, self._eplb)
    num_tokens, top_k = top_k_index.shape
    hidden = hidden_states.size(-1)
    ids = top_k_index.reshape(-1)
    num_pairs = ids.numel()
    # replica of each pair: token % replicas, the same on every rank without communication
    token = torch.arange(num_tokens).repeat_interleave(top_k)
    replica = token % ctx.replica_count[ids]
    physical = ctx.logical_to_physical[ids, replica]
    if ctx.record and ctx.logical_counts is not None:
        assert ctx.physical_counts is not None  # the counters are set together
        ctx.logical_counts += torch.bincount(ids, minlength=ctx.logical_counts.numel())
        ctx.physical_counts += torch.bincount(physical, minlength=ctx.physical_counts.numel())
    owner = physical // ctx.slots_per_rank
    local = physical % ctx.slots_per_rank
    x = hidden_states.repeat_interleave(top_k, dim=0)
    weights = dict(zip(ctx.names, ctx.weights))
    out = torch.zeros(num_pairs, hidden, dtype=hidden_states.dtype)
    mine = (owner == ctx.rank).nonzero().squeeze(1)
    if mine.numel():
        out[mine] = pair_forward(self, weights, x[mine], local[mine]).to(out.dtype)
    ctx.stats["pairs"] += int(mine.numel())
    if ctx.num_ranks > 1:
        counts = torch.bincount(owner, minlength=ctx.num_ranks)
        _combine(ctx, out, mine, owner, _fingerprint(counts, hidden_states, top_k_index, top_k_weights))
    # combine in k order, in float32, whatever the rank layout: the same bits everywhere
    weighted = out.float() * top_k_weights.reshape(-1, 1).float()
    return weighted.view(num_tokens, top_k, hidden).sum(dim=1).to(hidden_states.dtype)


def check_row_independent(module: torch.nn.Module, weights: dict[str, torch.Tensor], hidden: int,
                          dtype: torch.dtype, *, rows: int = 37, seed: int = 0) -> None:
    """Raise if a pair's output bits depend on how many other pairs share the call.

    Runs ``rows`` random pairs over the given slots in one call, then every row alone and in
    uneven chunks (1..5 rows, the counts where MKL changed bits), and compares bitwise.
    """
    g = torch.Generator().manual_seed(seed)
    num_slots = next(iter(weights.values())).shape[0]
    x = torch.randn(rows, hidden, generator=g).to(dtype)
    slots = torch.randint(0, num_slots, (rows,), generator=g)
    with torch.no_grad():
        whole = pair_forward(module, weights, x, slots)
        parts = []
        start, size = 0, 1
        while start < rows:
            parts.append(pair_forward(module, weights, x[start : start + size], slots[start : start + size]))
            start += size
            size = size % 5 + 1
    pieces = torch.cat(parts)
    if not torch.equal(whole, pieces):
        bad = (whole != pieces).any(dim=1).nonzero().squeeze(1).tolist()
        raise RuntimeError(
            f"the experts kernel is not row-independent on this machine (rows {bad[:8]} changed bits "
            f"when computed in smaller calls; max diff {float((whole.float() - pieces.float()).abs().max()):.3g}): "
            "expert-parallel output would not match the unsharded model"
        )


def register() -> None:
    """Register :data:`KERNEL_NAME` with transformers (idempotent)."""
    from transformers.integrations.moe import ALL_EXPERTS_FUNCTIONS

    if KERNEL_NAME not in ALL_EXPERTS_FUNCTIONS:
        ALL_EXPERTS_FUNCTIONS.register(KERNEL_NAME, ep_experts_forward)
