"""Expert-parallel MoE: every (token, expert) pair goes to one replica of its expert and back.

Once per step (:func:`step_header`, called by ``HFMoE.forward_batch`` before the model runs):
one ``all_gather`` of each rank's real rows, its top-k, and a fingerprint of its placement row
of every MoE layer, so ranks that disagree on a placement raise
:class:`~eplb.models.kernel.ReplicaDivergence` naming the layer instead of posting mismatched
exchanges. Then per MoE layer (every rank of the EP group calls :func:`exchange` for every MoE
layer, in layer order, also with no tokens: vLLM's dummy batches):

1. *dispatch*: one ``all_gather`` of every rank's rows and their expert ids (as bytes: each
   rank's real rows over shared memory, padded to the step's largest row count over gloo), so
   every rank sees every pair;
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
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, cast

import numpy as np
import torch
import torch.distributed as dist

from eplb.models.kernel import KERNEL_NAME, ExpertsContext, ReplicaDivergence, group_positions, pair_forward

__all__ = ["Routing", "assign", "ep_experts_forward", "exchange", "pair_slots", "register", "routing_of", "step_header"]


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


@dataclass(frozen=True)
class Routing:
    """One MoE layer's placement row in the forms the per-step assignment reads, built once per
    placement (:func:`routing_of`; a context keeps its own): ``[L, W]`` slots as numpy, each
    replica's holding rank, and each replicated expert's first replica on each of its ranks."""

    logical_to_physical: np.ndarray  # [L, W] int64, the unused entries 0
    single: np.ndarray  # [L] bool: the expert has one replica
    single_holder: np.ndarray  # [L] int64: the rank of the expert's first replica
    replicated: tuple[int, ...]  # the experts with more than one replica
    first_of: dict[int, dict[int, int]]  # replicated expert -> holding rank -> its first replica there
    num_ranks: int

    @classmethod
    def of(cls, logical_to_physical: torch.Tensor, replica_count: torch.Tensor, slots_per_rank: int) -> Routing:
        l2p = logical_to_physical.clamp(min=0).numpy().astype(np.int64)
        replicas = replica_count.tolist()
        holders = (l2p // slots_per_rank).tolist()
        first_of: dict[int, dict[int, int]] = {}
        for e, count in enumerate(replicas):
            if count > 1:
                first_of[e] = {}
                for j in range(count):
                    first_of[e].setdefault(holders[e][j], j)
        ranks = 1 + max((max(h[:count]) for h, count in zip(holders, replicas)), default=0)
        return cls(l2p, np.asarray(replicas) == 1, l2p[:, 0] // slots_per_rank, tuple(first_of), first_of, ranks)


def routing_of(ctx: ExpertsContext) -> Routing:
    """The context's :class:`Routing` (built at its first step: a context is rebuilt with every placement)."""
    if ctx.routing is None:
        ctx.routing = Routing.of(ctx.logical_to_physical, ctx.replica_count, ctx.slots_per_rank)
    return cast(Routing, ctx.routing)


def _chunks(total: np.ndarray, routing: Routing) -> np.ndarray:
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
    num_logical, width = routing.logical_to_physical.shape
    sizes = np.zeros((num_logical, width), dtype=np.int64)
    single = routing.single
    sizes[:, 0] = np.where(single, total, 0)  # an expert with one replica: all its pairs to it
    load = np.bincount(routing.single_holder[single], weights=total[single], minlength=routing.num_ranks)
    load = load.astype(np.int64).tolist()
    tot = total.tolist()
    held: dict[int, dict[int, int]] = {}  # replicated expert -> its pairs per holding rank
    for e in sorted((e for e in routing.replicated if tot[e] > 0), key=lambda e: (-tot[e], e)):
        order = sorted(routing.first_of[e], key=lambda r: (load[r], r))
        give = _water_fill([load[r] for r in order], tot[e])
        if max(load[r] + g for r, g in zip(order, give)) >= load[order[0]] + tot[e]:
            give = [tot[e]] + [0] * (len(order) - 1)  # spreading gains nothing: whole, to the least loaded
        held[e] = dict(zip(order, give))
        for r, g in zip(order, give):
            load[r] += g
    _even_out(load, held)
    for e, share in held.items():
        for r, g in share.items():
            sizes[e, routing.first_of[e][r]] += g
    starts = np.zeros((num_logical, width + 1), dtype=np.int64)
    np.cumsum(sizes, axis=1, out=starts[:, 1:])
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
    routing = Routing.of(logical_to_physical, replica_count, num_physical // num_ranks)
    starts = torch.from_numpy(_chunks(total.numpy().astype(np.int64), routing))
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
    routing = Routing.of(logical_to_physical, replica_count, slots_per_rank)
    first = (torch.cumsum(counts, 0) - counts)[rank].numpy().astype(np.int64)
    total = counts.sum(0).numpy().astype(np.int64)
    return torch.from_numpy(_slots(ids.numpy().astype(np.int64), first, total, routing))


def _slots(ids: np.ndarray, first: np.ndarray, total: np.ndarray, routing: Routing) -> np.ndarray:
    """:func:`pair_slots` on numpy: ``first [L]`` is where these pairs start in each expert's
    order over all ranks, ``total [L]`` the group's pairs per expert."""
    order, _, within = group_positions(ids, total.shape[0])
    sorted_ids = ids[order]
    position = first[sorted_ids] + within  # in the expert's pair order over all ranks
    starts = _chunks(total, routing)
    chunk = (position[:, None] >= starts[sorted_ids, 1:]).sum(1)
    physical = np.empty_like(ids)
    physical[order] = routing.logical_to_physical[sorted_ids, chunk]
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
    header = np.stack([r.numpy() for r in recv])  # [R, 2 + layers]
    prints = np.array([c.placement_print for c in contexts], dtype=np.int64)
    if (header[:, [2 + c.layer for c in contexts]] != prints).any():  # numpy: a few dozen numbers, every step
        for c in contexts:
            differ = np.flatnonzero(header[:, 2 + c.layer] != c.placement_print).tolist()
            if differ:
                raise ReplicaDivergence(f"MoE layer {c.layer}: rank {c.rank} and ranks {differ} hold different "
                                        "placements of this layer (a rank between placements?): the pairs cannot be "
                                        "exchanged")
    peer_rows, peer_top_k = tuple(header[:, 0].tolist()), int(header[:, 1].max())
    for c in contexts:
        c.peer_rows, c.peer_top_k = peer_rows, peer_top_k


def _gather_pairs(ctx: ExpertsContext, hidden: torch.Tensor, ids: torch.Tensor
                  ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The group's rows as bytes ``[N, H * element size]``, expert ids ``[N, k]`` and decode flags ``[N]``
    (the row is a request's one new token: see :func:`~eplb.models.kernel.pair_forward`), all numpy, rank 0's
    rows first, then rank 1's, ... (one all_gather of each rank's real rows as bytes: :func:`_gather_rows`).
    The payload is built and read in numpy: a decode step's few rows cost a torch op several numpy ones."""
    width = hidden.shape[1] * hidden.element_size()
    k = ctx.peer_top_k
    n = hidden.shape[0]
    payload = np.zeros((n, width + 4 * k + 4), dtype=np.uint8)  # the flag in 4 bytes: rows stay aligned
    if n:
        payload[:, :width] = hidden.contiguous().view(torch.uint8).numpy().reshape(n, width)
        payload[:, width : width + 4 * k] = ids.numpy().astype(np.int32).view(np.uint8).reshape(n, 4 * k)
        if ctx.decode is not None:
            payload[:, -4] = ctx.decode[:n].numpy()
    real = _gather_rows(ctx, torch.from_numpy(payload), "the expert dispatch all_gather").numpy()  # every rank's real rows
    total = real.shape[0]
    expert_ids = np.ascontiguousarray(real[:, width : width + 4 * k]).view(np.int32).astype(np.int64)
    return real[:, :width], expert_ids.reshape(total, k), real[:, -4] != 0


def _gather_rows(ctx: ExpertsContext, payload: torch.Tensor, what: str) -> torch.Tensor:
    """Every rank's ``payload [peer_rows[r], W]`` (bytes), in rank order, joined ``[sum(peer_rows), W]``:
    over shared memory where the group has it and the largest fits, else one gloo all_gather of the
    payloads padded to the largest row count."""
    started = _clock(ctx)
    local, most = ctx.local, max(ctx.peer_rows)
    if local is not None and local.fits(most * payload.shape[1]):
        real = _local_op(ctx, what, lambda: local.all_gather_rows(payload, list(ctx.peer_rows), ctx.timeout, what))
        _charge(ctx, "collective_cpu_s", started)
        return cast(torch.Tensor, real)
    padded = torch.zeros(most, payload.shape[1], dtype=torch.uint8)
    padded[: payload.shape[0]] = payload
    recv = [torch.empty_like(padded) for _ in range(ctx.num_ranks)]
    _wait(dist.all_gather(recv, padded, group=ctx.group, async_op=True), ctx, what, started)
    return torch.cat([got[:m] for got, m in zip(recv, ctx.peer_rows)])


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


def _place(ctx: ExpertsContext, flat: np.ndarray) -> np.ndarray:
    """Every pair's physical slot, for the group's expert ids ``flat`` rank-major (each rank's in
    token, then k order: an expert's pairs in this order are the order :func:`assign` cuts into
    chunks, so one :func:`_slots` places them all); what the slots and ranks take is recorded as
    the load (while ``ctx.record``), and this rank's pairs in the stats."""
    routing = routing_of(ctx)
    size, ranks = ctx.slots_per_rank, ctx.num_ranks
    total = np.bincount(flat, minlength=routing.logical_to_physical.shape[0])
    if any(total[e] for e in routing.replicated):
        physical = _slots(flat, np.zeros_like(total), total, routing)
    else:  # no replicated expert has pairs: every pair goes to its expert's one replica (what _slots gives)
        physical = routing.logical_to_physical[flat, 0]
    per_slot = np.bincount(physical, minlength=size * ranks)  # the group's pairs per physical slot
    per_rank = per_slot.reshape(ranks, -1).sum(1)  # and per holding rank
    if ctx.record:
        assert ctx.logical_counts is not None and ctx.physical_counts is not None and ctx.rank_pairs is not None
        ctx.logical_counts += torch.from_numpy(total)
        ctx.physical_counts += torch.from_numpy(per_slot)
        ctx.rank_pairs += torch.from_numpy(per_rank)
    ctx.stats["pairs"] += int(per_rank[ctx.rank])
    return physical


def exchange(ctx: ExpertsContext, module: torch.nn.Module, hidden: torch.Tensor, top_k_index: torch.Tensor,
             top_k_weights: torch.Tensor) -> torch.Tensor:
    """One MoE layer's experts for this rank's tokens ``hidden [n, H]`` (``n`` may be 0): ``[n, H]``."""
    num_tokens, top_k = top_k_index.shape
    weights = dict(zip(ctx.names, ctx.weights))
    if ctx.num_ranks == 1:
        ids = top_k_index.reshape(-1).to(torch.int64)
        physical = torch.from_numpy(_place(ctx, ids.numpy()))
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
    Returns this rank's pairs' outputs ``[n * k, H]`` in pair order. The bookkeeping is numpy on a
    few dozen pairs a decode step (a torch op costs several times a numpy one at that size)."""
    rows, expert_ids, decode = _gather_pairs(ctx, hidden, top_k_index)
    k, size, rank = ctx.peer_top_k, ctx.slots_per_rank, ctx.rank
    pairs = [m * k for m in ctx.peer_rows]
    physical = _place(ctx, expert_ids.reshape(-1))
    holder = physical // size
    # this rank's slots' pairs from every owner, owner by owner, each owner's in pair order
    taken = np.flatnonzero(holder == rank)
    row_of = taken // k  # pair j is row j // k of the group's rows
    if taken.shape[0]:
        x = torch.from_numpy(rows[row_of]).view(hidden.dtype)  # the rows' bytes, copied once
        started = _clock(ctx)
        result = pair_forward(module, weights, x, torch.from_numpy(physical[taken] - rank * size),
                              min_rows=ctx.min_rows, decode=torch.from_numpy(decode[row_of]),
                              decode_rows=ctx.decode_rows)
        result = result.to(hidden.dtype)
        _charge(ctx, "expert_cpu_s", started)
    else:
        result = hidden.new_empty(0, hidden.shape[1])
    # combine: each owner gets its pairs' outputs from every holder, in rank order, each in pair order
    ends = np.cumsum(pairs)
    first = int(ends[rank]) - pairs[rank]
    mine = holder[first : first + pairs[rank]]
    send = np.bincount(np.searchsorted(ends, taken, side="right"), minlength=ctx.num_ranks).tolist()
    receive = np.bincount(mine, minlength=ctx.num_ranks).tolist()
    largest = int(np.bincount(holder, minlength=ctx.num_ranks).max())  # the most pairs a holder sends back
    back = _all_to_all(ctx, result, send, receive, "the expert combine all_to_all", largest)
    out = torch.empty(mine.shape[0], hidden.shape[1], dtype=hidden.dtype)
    if mine.shape[0]:  # in bytes, in numpy: each received row to its pair's place
        out.view(torch.uint8).numpy()[np.argsort(mine, kind="stable")] = back.view(torch.uint8).numpy()
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
