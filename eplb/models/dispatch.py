"""Expert-parallel MoE: every (token, expert) pair goes to one replica of its expert and back.

Per MoE layer and step (every rank of the EP group calls :func:`exchange` for every MoE layer,
in layer order, also with no tokens: vLLM's dummy batches):

1. *counts*: one ``all_gather`` of each rank's pairs per logical expert (``[L]``, plus a
   fingerprint of the rank's placement row, so ranks that disagree on the placement raise
   :class:`~eplb.models.kernel.ReplicaDivergence` naming the layer instead of posting
   mismatched exchanges);
2. *assignment* (:func:`assign`, pure, the same on every rank): an expert's pairs, rank 0's
   first, then rank 1's, ..., are cut into contiguous, equal chunks, one per replica it uses;
   so every replica gets its expert's share, and every rank knows how many rows each rank sends
   to each slot without asking (the all_to_all's split sizes, and the load). An expert uses
   only as many replicas as give each at least :data:`SPLIT_ROWS` pairs (at least one): on a
   CPU a GEMM of a few rows costs about the read of its expert's weights, so cutting a decode
   step's 2 pairs over 2 replicas reads both replicas' weights for the work of one. Which of
   its replicas a lightly used expert takes rotates with the expert and its pair count, so the
   lone chunks spread over the ranks;
3. *dispatch*: ``all_to_all_single`` of the pairs' rows, sorted by destination slot;
4. the holding rank runs its slots' pairs through :func:`~eplb.models.kernel.pair_forward`
   (each pair its own row-independent product);
5. *combine*: a second ``all_to_all_single`` returns the outputs; the owner sums a token's k
   outputs in k order, in float32.

Every wait has a deadline; a dead or stalled peer becomes a :class:`TimeoutError` naming the
layer. With one rank nothing is sent.
"""

from __future__ import annotations

import math
import time
from datetime import timedelta
from typing import Any, cast

import torch
import torch.distributed as dist

from eplb.models.kernel import KERNEL_NAME, ExpertsContext, ReplicaDivergence, pair_forward

__all__ = ["SPLIT_ROWS", "assign", "ep_experts_forward", "exchange", "pair_slots", "register"]

#: An expert's pairs are cut over more than one replica only in chunks of at least this many.
SPLIT_ROWS = 16


def _starts(total: torch.Tensor, replicas: torch.Tensor, width: int) -> torch.Tensor:
    """``[L, width + 1]``: where chunk ``c`` of each expert starts in its expert's pair order
    (equal chunks; the first ``total % replicas`` one longer); ``total`` past the last chunk."""
    j = torch.arange(width + 1)
    base, extra = total // replicas, total % replicas
    starts = j[None, :] * base[:, None] + torch.minimum(j[None, :], extra[:, None])
    return torch.minimum(starts, total[:, None])


def _chunks(total: torch.Tensor, logical_to_physical: torch.Tensor, replica_count: torch.Tensor
            ) -> tuple[torch.Tensor, torch.Tensor]:
    """Each expert's chunk starts ``[L, W + 1]`` (as :func:`_starts`, over the replicas it uses:
    at most one per :data:`SPLIT_ROWS` pairs, at least one) and the physical slot of each chunk
    ``[L, W]``: chunk ``c`` goes to replica ``(c + expert + total) % replicas``."""
    num_logical, width = logical_to_physical.shape
    used = torch.minimum((total // SPLIT_ROWS).clamp(min=1), replica_count)
    starts = _starts(total, used, width)
    c = torch.arange(width)[None, :]
    rotation = (torch.arange(num_logical) + total) % replica_count.clamp(min=1)
    replica = torch.where(c < replica_count[:, None], (c + rotation[:, None]) % replica_count.clamp(min=1)[:, None], c)
    return starts, logical_to_physical.gather(1, replica)


def assign(counts: torch.Tensor, logical_to_physical: torch.Tensor, replica_count: torch.Tensor,
           num_physical: int) -> torch.Tensor:
    """``[R, P]``: how many pairs rank ``r`` sends to physical slot ``p``, given ``counts [R, L]``
    (each rank's pairs per logical expert). Pure; every rank computes the same from the same counts."""
    width = logical_to_physical.shape[1]
    total = counts.sum(0)
    starts, chunk_slots = _chunks(total, logical_to_physical, replica_count)  # [L, W + 1], [L, W]
    first = torch.cumsum(counts, 0) - counts  # [R, L]: where rank r's pairs start in expert order
    lo = torch.maximum(first[:, :, None], starts[None, :, :-1])
    hi = torch.minimum((first + counts)[:, :, None], starts[None, :, 1:])
    overlap = (hi - lo).clamp(min=0)  # [R, L, W]
    valid = torch.arange(width)[None, :] < replica_count[:, None]
    overlap = overlap * valid[None]
    slots = chunk_slots.clamp(min=0).reshape(1, -1).expand(counts.shape[0], -1)
    return torch.zeros(counts.shape[0], num_physical, dtype=torch.int64).scatter_add_(
        1, slots, overlap.reshape(counts.shape[0], -1))


def pair_slots(ids: torch.Tensor, rank: int, counts: torch.Tensor, logical_to_physical: torch.Tensor,
               replica_count: torch.Tensor) -> torch.Tensor:
    """The physical slot of each of this rank's pairs ``ids [n]`` under :func:`assign`'s chunks:
    a rank's pairs of one expert keep their order (token, then k)."""
    num_logical = counts.shape[1]
    order = torch.argsort(ids, stable=True)
    sorted_ids = ids[order]
    mine = torch.bincount(ids, minlength=num_logical)
    within = torch.arange(ids.numel()) - (torch.cumsum(mine, 0) - mine)[sorted_ids]
    first = (torch.cumsum(counts, 0) - counts)[rank]
    position = first[sorted_ids] + within  # in the expert's pair order over all ranks
    starts, chunk_slots = _chunks(counts.sum(0), logical_to_physical, replica_count)
    chunk = (position[:, None] >= starts[sorted_ids, 1:]).sum(1)
    physical = torch.empty_like(ids)
    physical[order] = chunk_slots[sorted_ids, chunk]
    return physical


def _clock(ctx: ExpertsContext) -> float:
    """The process's CPU seconds when this layer's CPU split is measured (``ctx.timed``), else 0:
    ``process_time`` sums every thread's time in the kernel, and cost a rank several percent of
    its samples when called around every exchange."""
    return time.process_time() if ctx.timed else 0.0


def _charge(ctx: ExpertsContext, key: str, started: float) -> None:
    if ctx.timed:
        ctx.stats[key] += time.process_time() - started


def _wait(work: Any, ctx: ExpertsContext, what: str, started: float) -> None:
    """Wait for ``work`` within the deadline; its CPU since ``started`` (the post) goes to the stats."""
    try:
        done = work.wait(timeout=timedelta(seconds=ctx.timeout))
    except RuntimeError as exc:  # gloo raises on its deadline and when a peer's connection closes
        raise TimeoutError(f"{what} of MoE layer {ctx.layer} did not finish within {ctx.timeout}s: {exc}") from exc
    if done is False:
        raise TimeoutError(f"{what} of MoE layer {ctx.layer} did not finish within {ctx.timeout}s")
    _charge(ctx, "collective_cpu_s", started)


def _group_counts(ctx: ExpertsContext, mine: torch.Tensor) -> torch.Tensor:
    """``[R, L]`` every rank's pairs per expert (one all_gather), after checking the placements agree."""
    send = torch.cat([mine, torch.tensor([ctx.placement_print], dtype=torch.int64)])
    recv = [torch.empty_like(send) for _ in range(ctx.num_ranks)]
    started = _clock(ctx)
    _wait(dist.all_gather(recv, send, group=ctx.group, async_op=True), ctx, "the pair-count all_gather", started)
    prints = [int(r[-1]) for r in recv]
    differ = [r for r, p in enumerate(prints) if p != ctx.placement_print]
    if differ:
        raise ReplicaDivergence(f"MoE layer {ctx.layer}: rank {ctx.rank} and ranks {differ} hold different placements "
                                "of this layer (a rank between placements?): the pairs cannot be exchanged")
    return torch.stack([r[:-1] for r in recv])


def _all_to_all(ctx: ExpertsContext, rows: torch.Tensor, send: list[int], receive: list[int], what: str) -> torch.Tensor:
    """Rows ``[n, H]`` (any dtype, sent as bytes) to the ranks in ``send`` counts; rows received per ``receive``."""
    width = math.prod(rows.shape[1:]) * rows.element_size()
    payload = rows.contiguous().view(torch.uint8).reshape(rows.shape[0], width)
    out = torch.empty(sum(receive), payload.shape[1], dtype=torch.uint8)
    started = _clock(ctx)
    work = dist.all_to_all_single(out, payload, output_split_sizes=receive, input_split_sizes=send,
                                  group=ctx.group, async_op=True)
    _wait(work, ctx, what, started)
    return out.view(rows.dtype).reshape(sum(receive), *rows.shape[1:])


def _record(ctx: ExpertsContext, counts: torch.Tensor, per_slot: torch.Tensor, per_rank: torch.Tensor) -> None:
    if not ctx.record:
        return
    assert ctx.logical_counts is not None and ctx.physical_counts is not None and ctx.rank_pairs is not None
    ctx.logical_counts += counts.sum(0)
    ctx.physical_counts += per_slot
    ctx.rank_pairs += per_rank


def exchange(ctx: ExpertsContext, module: torch.nn.Module, hidden: torch.Tensor, top_k_index: torch.Tensor,
             top_k_weights: torch.Tensor) -> torch.Tensor:
    """One MoE layer's experts for this rank's tokens ``hidden [n, H]`` (``n`` may be 0): ``[n, H]``."""
    num_tokens, top_k = top_k_index.shape
    ids = top_k_index.reshape(-1).to(torch.int64)
    mine = torch.bincount(ids, minlength=ctx.logical_to_physical.shape[0])
    counts = mine[None] if ctx.num_ranks == 1 else _group_counts(ctx, mine)
    num_physical = ctx.slots_per_rank * ctx.num_ranks
    sent = assign(counts, ctx.logical_to_physical, ctx.replica_count, num_physical)
    per_slot = sent.sum(0)  # the group's pairs per physical slot
    per_rank = per_slot.view(ctx.num_ranks, -1).sum(1)  # and per holding rank
    _record(ctx, counts, per_slot, per_rank)
    physical = pair_slots(ids, ctx.rank, counts, ctx.logical_to_physical, ctx.replica_count)
    weights = dict(zip(ctx.names, ctx.weights))
    x = hidden.repeat_interleave(top_k, dim=0)
    if ctx.num_ranks == 1:
        started = _clock(ctx)
        out = pair_forward(module, weights, x, physical, min_rows=ctx.min_rows) if ids.numel() else x
        _charge(ctx, "expert_cpu_s", started)
    else:
        out = _remote(ctx, module, weights, x, physical, sent)
    ctx.stats["pairs"] += int(per_rank[ctx.rank])
    # combine in k order, in float32, whatever the rank layout: the same bits everywhere
    weighted = out.to(hidden.dtype).float() * top_k_weights.reshape(-1, 1).float()
    return weighted.view(num_tokens, top_k, hidden.shape[1]).sum(dim=1).to(hidden.dtype)


def _remote(ctx: ExpertsContext, module: torch.nn.Module, weights: dict[str, torch.Tensor], x: torch.Tensor,
            physical: torch.Tensor, sent: torch.Tensor) -> torch.Tensor:
    """Dispatch ``x``'s pairs to their slots' ranks, compute what this rank holds, combine back."""
    per_rank = sent.view(ctx.num_ranks, ctx.num_ranks, ctx.slots_per_rank)  # [src, dst, local slot]
    flows = per_rank.sum(2)  # [src, dst]
    order = torch.argsort(physical, stable=True)  # by destination rank, then slot
    layer_what = "the expert dispatch all_to_all"
    received = _all_to_all(ctx, x[order], flows[ctx.rank].tolist(), flows[:, ctx.rank].tolist(), layer_what)
    if received.shape[0]:
        local = torch.repeat_interleave(torch.arange(ctx.slots_per_rank).repeat(ctx.num_ranks),
                                        per_rank[:, ctx.rank].reshape(-1))
        started = _clock(ctx)
        result = pair_forward(module, weights, received, local, min_rows=ctx.min_rows).to(x.dtype)
        _charge(ctx, "expert_cpu_s", started)
    else:
        result = received
    back = _all_to_all(ctx, result, flows[:, ctx.rank].tolist(), flows[ctx.rank].tolist(),
                       "the expert combine all_to_all")
    out = torch.empty_like(x)
    out[order] = back
    return out


def ep_experts_forward(self: torch.nn.Module, hidden_states: torch.Tensor, top_k_index: torch.Tensor,
                       top_k_weights: torch.Tensor) -> torch.Tensor:
    """The ``ALL_EXPERTS_FUNCTIONS`` entry: ``hidden_states [T, H]``, routing ``[T, k]`` -> ``[T, H]``.

    Inside a packed step (:mod:`eplb.models.packed`) only the first ``ctx.rows`` rows are real
    tokens; the padding rows are dropped before the dispatch and come back as zeros.
    """
    # cast: torch types nn.Module attributes as Tensor | Module; _eplb is the plain attribute HFMoE._bind sets
    ctx = cast(ExpertsContext, self._eplb)
    rows = hidden_states.shape[0] if ctx.rows is None else ctx.rows
    if ctx.rows is None and ctx.num_ranks > 1:
        raise RuntimeError("an expert-parallel model runs through HFMoE.forward_batch (its dispatch is a collective)")
    out = torch.empty_like(hidden_states)
    out[rows:] = 0  # the padding rows
    out[:rows] = exchange(ctx, self, hidden_states[:rows], top_k_index[:rows], top_k_weights[:rows])
    return out


def register() -> None:
    """Register :data:`KERNEL_NAME` with transformers (idempotent)."""
    from transformers.integrations.moe import ALL_EXPERTS_FUNCTIONS

    if KERNEL_NAME not in ALL_EXPERTS_FUNCTIONS:
        ALL_EXPERTS_FUNCTIONS.register(KERNEL_NAME, ep_experts_forward)
