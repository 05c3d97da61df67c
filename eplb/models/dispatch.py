"""Expert-parallel MoE: every (token, expert) pair goes to one replica of its expert and back.

Once per step (:func:`step_header`, called by ``HFMoE.forward_batch`` before the model runs):
one ``all_gather`` of each rank's real rows, its top-k, and a fingerprint of its placement row
of every MoE layer, so ranks that disagree on a placement raise
:class:`~eplb.models.kernel.ReplicaDivergence` naming the layer instead of posting mismatched
exchanges. Then per MoE layer (every rank of the EP group calls :func:`exchange` for every MoE
layer, in layer order, also with no tokens: vLLM's dummy batches):

1. *dispatch*: one ``all_gather`` of every rank's rows and their expert ids (as bytes, padded
   to the step's largest row count), so every rank sees every pair;
2. *assignment* (:func:`assign`, pure, the same on every rank): an expert's pairs, rank 0's
   first, then rank 1's, ..., are cut into contiguous chunks, one per replica: experts with
   one replica first, then the replicated ones, most pairs first, each whole to the replica on
   the least loaded rank, or spread over its replicas' ranks where that lowers the busiest one
   (:func:`_chunks`); then the busiest rank passes pairs on along chains of replicated experts
   while that lowers it (:func:`_even_out`); so the ranks' pairs even out as far as the replicas
   allow, and every rank knows which pairs every slot takes (the combine's split sizes, and the load);
3. the holding rank runs the pairs its slots take, from every rank, through
   :func:`~eplb.models.kernel.pair_forward` (each pair its own row-independent product);
4. *combine*: ``all_to_all_single`` returns each owner its pairs' outputs (in pair order per
   holder); the owner sums a token's k outputs in k order, in float32.

Two collectives per MoE layer and one per step: the pair counts travel with the rows, which an
all_gather can size from the step's header (an all_to_all needs every split size first, which
took a third collective per layer). Every wait has a deadline; a dead or stalled peer becomes a
:class:`TimeoutError` naming the layer. With one rank nothing is sent.
"""

from __future__ import annotations

import math
import time
from datetime import timedelta
from typing import Any, cast

import torch
import torch.distributed as dist

from eplb.models.kernel import KERNEL_NAME, ExpertsContext, ReplicaDivergence, pair_forward

__all__ = ["assign", "ep_experts_forward", "exchange", "pair_slots", "register", "step_header"]

def _water_fill(loads: list[int], n: int) -> list[int]:
    """``n`` pairs over ranks with these ``loads`` (ascending), lowest first: how many each gets
    so that the loads after are as even as whole pairs allow (the remainder to the lowest)."""
    level, used = 0.0, len(loads)
    for i in range(len(loads)):
        level = (sum(loads[: i + 1]) + n) / (i + 1)
        if i + 1 == len(loads) or level <= loads[i + 1]:
            used = i + 1
            break
    give = [max(0, int(level) - load) if i < used else 0 for i, load in enumerate(loads)]
    for i in range(n - sum(give)):
        give[i % used] += 1
    return give


def _chunks(total: torch.Tensor, logical_to_physical: torch.Tensor, replica_count: torch.Tensor,
            slots_per_rank: int) -> torch.Tensor:
    """Each expert's chunk starts ``[L, W + 1]`` for the group's pairs per expert ``total [L]``:
    chunk ``j``, the pairs of replica ``j`` (slot ``logical_to_physical[e, j]``), is
    ``[starts[j], starts[j + 1])`` of the expert's pairs in order.

    1. An expert with one replica: all its pairs to it.
    2. The replicated experts, most pairs first: the pairs go whole to the replica on the least
       loaded rank (pairs so far), unless spreading them over the replicas' ranks (water-filling
       them up to an even level) leaves their busiest rank with fewer pairs; then spread.
    3. While the busiest rank can pass a pair on, along a chain of replicated experts, to a rank
       with at least 2 pairs fewer, it does (:func:`_even_out`): step 2 sees one expert at a time,
       and misses what moving a second expert's pairs would free.
    So the ranks' pairs even out, and an expert's pairs are cut only where that lowers the
    busiest rank: on a CPU a GEMM of a few rows costs about the read of its expert's weights,
    and cutting 2 pairs over 2 replicas would read both replicas' weights for no gain.
    """
    num_logical, width = logical_to_physical.shape
    holders = (logical_to_physical.clamp(min=0) // slots_per_rank).tolist()  # [L][W]
    tot, replicas = total.tolist(), replica_count.tolist()
    sizes = [[0] * width for _ in range(num_logical)]
    load = [0] * (1 + max((max(h[: replicas[e]]) for e, h in enumerate(holders)), default=0))
    for e in range(num_logical):
        if replicas[e] == 1:  # an expert with one replica: all its pairs to it
            sizes[e][0] = tot[e]
            load[holders[e][0]] += tot[e]
    held: dict[int, dict[int, int]] = {}  # replicated expert -> its pairs per holding rank
    first_of: dict[int, dict[int, int]] = {}  # replicated expert -> holding rank -> its first replica there
    for e in sorted((e for e in range(num_logical) if replicas[e] > 1 and tot[e] > 0), key=lambda e: (-tot[e], e)):
        first_of[e] = {}
        for j in range(replicas[e]):
            first_of[e].setdefault(holders[e][j], j)
        order = sorted(first_of[e], key=lambda r: (load[r], r))
        give = _water_fill([load[r] for r in order], tot[e])
        if max(load[r] + g for r, g in zip(order, give)) >= load[order[0]] + tot[e]:
            give = [tot[e]] + [0] * (len(order) - 1)  # spreading gains nothing: whole, to the least loaded
        held[e] = dict(zip(order, give))
        for r, g in zip(order, give):
            load[r] += g
    _even_out(load, held)
    for e, share in held.items():
        for r, g in share.items():
            sizes[e][first_of[e][r]] += g
    starts = torch.zeros(num_logical, width + 1, dtype=torch.int64)
    torch.cumsum(torch.tensor(sizes, dtype=torch.int64), 1, out=starts[:, 1:])
    return starts


def _even_out(load: list[int], held: dict[int, dict[int, int]]) -> None:
    """Lower the busiest rank (in place) one pair at a time: a pair of a replicated expert it holds
    goes to another rank holding that expert, which passes one of its own on, and so on, until a
    rank with at least 2 pairs fewer than the busiest takes one (a shortest such chain, the
    lowest-numbered first: the same on every rank). Ends when a busiest rank has no such chain
    (then no assignment of these replicas has a lower busiest rank) or the ranks are even."""
    even = -(-sum(load) // len(load))
    while (top := max(load)) > even:
        source = load.index(top)
        came: dict[int, tuple[int, int]] = {}  # rank -> (the rank it was reached from, over this expert)
        queue, end = [source], None
        while queue and end is None:
            u = queue.pop(0)
            for e in sorted(held):
                if held[e][u] if u in held[e] else 0:
                    for v in sorted(held[e]):
                        if v != source and v not in came:
                            came[v] = (u, e)
                            if load[v] <= top - 2:
                                end = v
                                break
                            queue.append(v)
                if end is not None:
                    break
        if end is None:
            return
        load[source] -= 1
        load[end] += 1
        v = end
        while v != source:
            u, e = came[v]
            held[e][u] -= 1
            held[e][v] += 1
            v = u


def assign(counts: torch.Tensor, logical_to_physical: torch.Tensor, replica_count: torch.Tensor,
           num_physical: int, num_ranks: int) -> torch.Tensor:
    """``[R, P]``: how many pairs rank ``r`` sends to physical slot ``p``, given ``counts [R, L]``
    (each rank's pairs per logical expert) and a placement of ``num_physical`` slots over
    ``num_ranks`` ranks. Pure; every rank computes the same from the same counts."""
    width = logical_to_physical.shape[1]
    total = counts.sum(0)
    starts = _chunks(total, logical_to_physical, replica_count, num_physical // num_ranks)
    first = torch.cumsum(counts, 0) - counts  # [R, L]: where rank r's pairs start in expert order
    lo = torch.maximum(first[:, :, None], starts[None, :, :-1])
    hi = torch.minimum((first + counts)[:, :, None], starts[None, :, 1:])
    overlap = (hi - lo).clamp(min=0)  # [R, L, W]
    valid = torch.arange(width)[None, :] < replica_count[:, None]
    overlap = overlap * valid[None]
    slots = logical_to_physical.clamp(min=0).reshape(1, -1).expand(counts.shape[0], -1)
    return torch.zeros(counts.shape[0], num_physical, dtype=torch.int64).scatter_add_(
        1, slots, overlap.reshape(counts.shape[0], -1))


def pair_slots(ids: torch.Tensor, rank: int, counts: torch.Tensor, logical_to_physical: torch.Tensor,
               replica_count: torch.Tensor, slots_per_rank: int) -> torch.Tensor:
    """The physical slot of each of this rank's pairs ``ids [n]`` under :func:`assign`'s chunks:
    a rank's pairs of one expert keep their order (token, then k)."""
    num_logical = counts.shape[1]
    order = torch.argsort(ids, stable=True)
    sorted_ids = ids[order]
    mine = torch.bincount(ids, minlength=num_logical)
    within = torch.arange(ids.numel()) - (torch.cumsum(mine, 0) - mine)[sorted_ids]
    first = (torch.cumsum(counts, 0) - counts)[rank]
    position = first[sorted_ids] + within  # in the expert's pair order over all ranks
    starts = _chunks(counts.sum(0), logical_to_physical, replica_count, slots_per_rank)
    chunk = (position[:, None] >= starts[sorted_ids, 1:]).sum(1)
    physical = torch.empty_like(ids)
    physical[order] = logical_to_physical[sorted_ids, chunk]
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


def step_header(contexts: list[ExpertsContext], rows: int, top_k: int) -> None:
    """Once per step, before the model runs: every rank's real rows and top-k (0: no tokens), and
    the ranks' placement fingerprints of every MoE layer checked, over one all_gather; every
    context learns the rows (``peer_rows``) and the top-k (``peer_top_k``) its exchanges size from."""
    first = contexts[0]
    if first.num_ranks == 1:
        for c in contexts:
            c.peer_rows, c.peer_top_k = (rows,), top_k
        return
    send = torch.tensor([rows, top_k, *(c.placement_print for c in contexts)], dtype=torch.int64)
    recv = _all_gather(first, send, "the step header all_gather")
    header = torch.stack(recv)  # [R, 2 + layers]
    for c in contexts:
        differ = (header[:, 2 + c.layer] != c.placement_print).nonzero().flatten().tolist()
        if differ:
            raise ReplicaDivergence(f"MoE layer {c.layer}: rank {c.rank} and ranks {differ} hold different placements "
                                    "of this layer (a rank between placements?): the pairs cannot be exchanged")
    peer_rows, peer_top_k = tuple(header[:, 0].tolist()), int(header[:, 1].max())
    for c in contexts:
        c.peer_rows, c.peer_top_k = peer_rows, peer_top_k


def _gather_pairs(ctx: ExpertsContext, hidden: torch.Tensor, ids: torch.Tensor
                  ) -> tuple[list[torch.Tensor], list[torch.Tensor], list[torch.Tensor]]:
    """Every rank's rows ``[n_r, H]``, expert ids ``[n_r, k]`` and decode flags ``[n_r]`` (the row is a
    request's one new token: see :func:`~eplb.models.kernel.pair_forward`), in rank order (one
    all_gather of bytes, each rank's padded to the step's largest row count)."""
    width = hidden.shape[1] * hidden.element_size()
    k = ctx.peer_top_k
    most = max(ctx.peer_rows)
    payload = torch.zeros(most, width + 4 * k + 4, dtype=torch.uint8)  # the flag in 4 bytes: rows stay aligned
    n = hidden.shape[0]
    if n:
        payload[:n, :width] = hidden.contiguous().view(torch.uint8).reshape(n, width)
        payload[:n, width : width + 4 * k] = ids.to(torch.int32).contiguous().view(torch.uint8).reshape(n, 4 * k)
        if ctx.decode is not None:
            payload[:n, -4] = ctx.decode[:n]
    recv = _all_gather(ctx, payload, "the expert dispatch all_gather")
    rows, expert_ids, decode = [], [], []
    for r, got in enumerate(recv):
        m = ctx.peer_rows[r]
        rows.append(got[:m, :width].contiguous().view(hidden.dtype).reshape(m, hidden.shape[1]))
        expert_ids.append(got[:m, width : width + 4 * k].contiguous().view(torch.int32).reshape(m, k).to(torch.int64))
        decode.append(got[:m, -4].bool())
    return rows, expert_ids, decode


def _all_gather(ctx: ExpertsContext, payload: torch.Tensor, what: str) -> list[torch.Tensor]:
    """Every rank's ``payload`` (the same shape on every rank), in rank order: over shared memory
    where the group has it (:mod:`eplb.models.local_exchange`) and the payload fits, else gloo."""
    started = _clock(ctx)
    local = ctx.local
    if local is not None and local.fits(payload.numel() * payload.element_size()):
        recv = _local_op(ctx, what, lambda: local.all_gather(payload, ctx.timeout, what))
        _charge(ctx, "collective_cpu_s", started)
        return recv
    recv = [torch.empty_like(payload) for _ in range(ctx.num_ranks)]
    _wait(dist.all_gather(recv, payload, group=ctx.group, async_op=True), ctx, what, started)
    return recv


def _local_op(ctx: ExpertsContext, what: str, op: Any) -> Any:
    try:
        return op()
    except TimeoutError as exc:
        raise TimeoutError(f"{what} of MoE layer {ctx.layer} did not finish within {ctx.timeout}s: {exc}") from exc


def _all_to_all(ctx: ExpertsContext, rows: torch.Tensor, send: list[int], receive: list[int], what: str,
                largest: int) -> torch.Tensor:
    """Rows ``[n, H]`` (any dtype, sent as bytes) to the ranks in ``send`` counts; rows received per
    ``receive``. ``largest``: the most rows any rank of the group sends (the same on every rank:
    it decides alike everywhere whether the op fits in shared memory)."""
    width = math.prod(rows.shape[1:]) * rows.element_size()
    payload = rows.contiguous().view(torch.uint8).reshape(rows.shape[0], width)
    started = _clock(ctx)
    local = ctx.local
    if local is not None and local.fits(largest * width):
        out = _local_op(ctx, what, lambda: local.all_to_all(payload, send, receive, ctx.timeout, what))
        _charge(ctx, "collective_cpu_s", started)
    else:
        out = torch.empty(sum(receive), payload.shape[1], dtype=torch.uint8)
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


def _place(ctx: ExpertsContext, flat: torch.Tensor, pairs: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """Every pair's physical slot and owning rank, for the group's expert ids ``flat`` rank-major
    (``pairs[r]`` of rank ``r``, each rank's in token, then k order: an expert's pairs in this
    order are the order :func:`assign` cuts into chunks, so one :func:`pair_slots` places them
    all); what the slots and ranks take is recorded as the load."""
    num_logical, size, ranks = ctx.logical_to_physical.shape[0], ctx.slots_per_rank, ctx.num_ranks
    total = torch.bincount(flat, minlength=num_logical)
    if bool(((ctx.replica_count > 1) & (total > 0)).any()):
        physical = pair_slots(flat, 0, total[None], ctx.logical_to_physical, ctx.replica_count, size)
    else:  # no replicated expert has pairs: every pair goes to its expert's one replica (what pair_slots gives)
        physical = ctx.logical_to_physical[flat, 0]
    owner = torch.repeat_interleave(torch.arange(ranks), torch.tensor(pairs))
    counts = torch.bincount(owner * num_logical + flat, minlength=ranks * num_logical).view(ranks, -1)
    per_slot = torch.bincount(physical, minlength=size * ranks)  # the group's pairs per physical slot
    per_rank = per_slot.view(ranks, -1).sum(1)  # and per holding rank
    _record(ctx, counts, per_slot, per_rank)
    ctx.stats["pairs"] += int(per_rank[ctx.rank])
    return physical, owner


def exchange(ctx: ExpertsContext, module: torch.nn.Module, hidden: torch.Tensor, top_k_index: torch.Tensor,
             top_k_weights: torch.Tensor) -> torch.Tensor:
    """One MoE layer's experts for this rank's tokens ``hidden [n, H]`` (``n`` may be 0): ``[n, H]``."""
    num_tokens, top_k = top_k_index.shape
    weights = dict(zip(ctx.names, ctx.weights))
    if ctx.num_ranks == 1:
        ids = top_k_index.reshape(-1).to(torch.int64)
        physical, _ = _place(ctx, ids, [ids.numel()])
        x = hidden.repeat_interleave(top_k, dim=0)
        started = _clock(ctx)
        decode = None if ctx.decode is None else ctx.decode.repeat_interleave(top_k)
        out = pair_forward(module, weights, x, physical, min_rows=ctx.min_rows, decode=decode,
                           decode_rows=ctx.decode_rows) if ids.numel() else x
        _charge(ctx, "expert_cpu_s", started)
    else:
        if max(ctx.peer_rows) == 0:  # no rank has a token this step (all know it from the header)
            return hidden.new_zeros(0, hidden.shape[1])
        out = _remote(ctx, module, weights, hidden, top_k_index)
    # combine in k order, in float32, whatever the rank layout: the same bits everywhere
    weighted = out.to(hidden.dtype).float() * top_k_weights.reshape(-1, 1).float()
    return weighted.view(num_tokens, top_k, hidden.shape[1]).sum(dim=1).to(hidden.dtype)


def _remote(ctx: ExpertsContext, module: torch.nn.Module, weights: dict[str, torch.Tensor], hidden: torch.Tensor,
            top_k_index: torch.Tensor) -> torch.Tensor:
    """Gather every rank's pairs, compute those this rank's slots take, send each owner its outputs.
    Returns this rank's pairs' outputs ``[n * k, H]`` in pair order."""
    rows, expert_ids, decode = _gather_pairs(ctx, hidden, top_k_index)
    k, size = ctx.peer_top_k, ctx.slots_per_rank
    pairs = [e.numel() for e in expert_ids]
    physical, owner = _place(ctx, torch.cat([e.reshape(-1) for e in expert_ids]), pairs)
    holder = torch.div(physical, size, rounding_mode="floor")
    # this rank's slots' pairs from every owner, owner by owner, each owner's in pair order
    taken = (holder == ctx.rank).nonzero().flatten()
    row_of = torch.div(taken, k, rounding_mode="floor")  # pair j is row j // k of the group's rows
    x = torch.cat(rows)[row_of]
    if x.shape[0]:
        started = _clock(ctx)
        result = pair_forward(module, weights, x, physical[taken] - ctx.rank * size, min_rows=ctx.min_rows,
                              decode=torch.cat(decode)[row_of], decode_rows=ctx.decode_rows)
        result = result.to(hidden.dtype)
        _charge(ctx, "expert_cpu_s", started)
    else:
        result = x
    # combine: each owner gets its pairs' outputs from every holder, in rank order, each in pair order
    first = sum(pairs[: ctx.rank])
    mine = holder[first : first + pairs[ctx.rank]]
    send = torch.bincount(owner[taken], minlength=ctx.num_ranks).tolist()
    receive = torch.bincount(mine, minlength=ctx.num_ranks).tolist()
    largest = int(torch.bincount(holder, minlength=ctx.num_ranks).max())  # the most pairs a holder sends back
    back = _all_to_all(ctx, result, send, receive, "the expert combine all_to_all", largest)
    out = torch.empty(mine.numel(), hidden.shape[1], dtype=hidden.dtype)
    out[torch.argsort(mine, stable=True)] = back
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
