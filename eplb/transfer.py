"""Executing a :class:`~eplb.plan.LayerPlan` over a ``torch.distributed`` group, with deadlines.

The flow for one layer, on every rank of the executing group::

    plan = plan_layer(old_row, new_row, S_old, S_new, old_holder, new_holder)   # same on all ranks
    stats = execute_layer(plan, my_group_rank, old_weights, staging, group=g, timeout=30, layer=i)
    commit_layer(plan.for_rank(my_group_rank), staging, weights)     # same S: changed slots only
    # or, when S changes / the worker is fresh:  materialize(rank_plan, old_weights, staging)
    #                                            and staging *is* the new weights.

Weights are a sequence of tensors per layer (e.g. ``[w13, w2]``), each ``[slots, ...]``; slot
``i`` of every tensor together is one expert. ``old_weights`` has ``S_old`` slots (the worker's
old local slots; empty or ``None`` for a fresh worker), ``staging`` has ``S_new`` (empty or
``None`` for a leaving worker), with the same number of tensors, dtypes and trailing shapes.

The network phase is delegated to a communicator (:mod:`eplb.communicator`): this module
expands the rank's part of the plan into :class:`TransferOp` records (one per weight tensor of
each transfer) and hands one :class:`LayerExchange` per layer to ``communicator.exchange``.
The default is :class:`~eplb.communicator.TorchCommunicator` on the group's own backend (gloo
or NCCL), whose protocol is described below; :class:`~eplb.communicator.NixlCommunicator` has
receivers read remote experts one-sided and ends the layer with a small all-reduce (every
rank of the group must then call :func:`execute_layer` for every layer, idle or not).

Two-sided protocol (gloo / NCCL; deadlock free, no collective needed):

- The global transfer list of the plan (identical on every rank) expands into a global op
  list, one op per weight tensor per transfer: op ``k = transfer.index * T + w``.
- That list is cut into consecutive chunks of ``max_ops_per_batch`` ops, identically on every
  rank (so ``max_ops_per_batch`` must be the same everywhere). For each chunk in order, a
  rank posts only its own ops of the chunk (``isend`` as sender, ``irecv`` as receiver)
  through ``torch.distributed.batch_isend_irecv`` and waits for all of them before the next
  chunk. A chunk's sends and receives all lie in that chunk, so chunk ``c`` completes once
  every rank is done with its earlier chunks: no cycle, no deadlock. Ranks without ops in a
  chunk skip it. Between one pair of ranks ops are posted in the same global order on both
  sides, so messages match.
- With ``migration_batching`` (``EPLBConfig.enable_migration_batching``) the chunks follow the
  plan's migration rounds (:func:`eplb.plan.migration_rounds`: in a round every rank sends
  to at most one peer and receives from at most one): round after round, each round's ops
  (its transfers in index order, one op per weight tensor) cut into chunks of
  ``max_ops_per_batch``. The rounds come from the global transfer list, so these chunks too
  are global and identical on every rank (``migration_batching`` must be the same
  everywhere), every op lies in exactly one, and the argument above holds unchanged. A batch
  then carries at most one peer's traffic per direction per rank: no rank receives from (or
  sends to) several peers at once.
- Every rank of the group whose part is not idle must call :func:`execute_layer` for the
  layer. Idle ranks may call it (it returns at once) or not.
- Every wait has a deadline (``timeout`` for the whole network phase of the layer). A peer
  that does not post its side makes the wait raise :class:`TransferTimeout`; a peer whose
  connection breaks raises :class:`TransferError`; both name the layer and the peers.
  After either, ops may still be pending on the group: the group must be treated as broken
  (aborted/replaced), never reused for another transfer.

Peers: ``torch.distributed``'s ``P2POp`` takes GLOBAL ranks (ranks of the default group), so
plan group ranks are translated with ``torch.distributed.get_global_rank(group, r)`` when
``group`` is a subgroup. With ``group=None`` (default group) group rank == global rank.

With NCCL, note torch's rule that if ``batch_isend_irecv`` is the first collective on the
group, every rank of the group must take part; run one collective (e.g. a barrier) on a fresh
group before the first transfer.

After the network phase: received experts are fanned out locally to their other slots, local
copies are made from ``old_weights``, and reloads are filled from ``reload_fn(expert)``.
Kept slots of ``staging`` are never touched.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from eplb.communicator import Communicator, TorchCommunicator
from eplb.exchange import (
    LayerExchange,
    TransferError,
    TransferOp,
    TransferTimeout,
)
from eplb.plan import LayerPlan, RankPlan

__all__ = [
    "LayerExchange",
    "TransferError",
    "TransferOp",
    "TransferStats",
    "TransferTimeout",
    "commit_layer",
    "execute_layer",
    "materialize",
    "op_batches",
]


@dataclass(frozen=True)
class TransferStats:
    """What one rank did for one layer. Counts are experts (not tensors); bytes are summed over tensors."""

    bytes_sent: int = 0
    bytes_received: int = 0
    num_sends: int = 0
    num_recvs: int = 0
    num_local_copies: int = 0
    num_reloads: int = 0
    seconds: float = 0.0


def _tensors(ts: Sequence[torch.Tensor] | None) -> list[torch.Tensor]:
    return list(ts) if ts is not None else []


def _expert_bytes(ts: Sequence[torch.Tensor]) -> int:
    return sum(t[0].numel() * t.element_size() for t in ts) if ts and ts[0].shape[0] else 0


def _seconds(timeout: timedelta | float) -> float:
    value = timeout.total_seconds() if isinstance(timeout, timedelta) else float(timeout)
    if not value > 0:
        raise ValueError(f"timeout must be positive, got {timeout!r}")
    return value


def _check_args(rp: RankPlan, old: list[torch.Tensor], staging: list[torch.Tensor], reload_fn) -> int:
    """Validate buffers against the rank's part; return the number of tensors per expert."""
    needs_old = bool(rp.sends or rp.local_copies)
    needs_new = bool(rp.recvs or rp.local_copies or rp.reloads)
    if needs_old:
        if not old:
            raise ValueError(f"rank {rp.group_rank} sends or copies locally but was given no old weights")
        for w, t in enumerate(old):
            if t.dim() < 1 or t.shape[0] != rp.num_old_slots:
                raise ValueError(
                    f"old_weights[{w}] has shape {tuple(t.shape)}, expected {rp.num_old_slots} old slots first"
                )
    if needs_new:
        if not staging:
            raise ValueError(f"rank {rp.group_rank} receives or fills slots but was given no staging buffer")
        for w, t in enumerate(staging):
            if t.dim() < 1 or t.shape[0] != rp.num_new_slots:
                raise ValueError(
                    f"staging[{w}] has shape {tuple(t.shape)}, expected {rp.num_new_slots} new slots first"
                )
    if old and staging and needs_old and needs_new:
        if len(old) != len(staging):
            raise ValueError(f"{len(old)} old weight tensors but {len(staging)} staging tensors")
        for w, (a, b) in enumerate(zip(old, staging)):
            if a.dtype != b.dtype or a.shape[1:] != b.shape[1:]:
                raise ValueError(
                    f"tensor {w}: old weights {a.dtype}{list(a.shape[1:])} vs staging {b.dtype}{list(b.shape[1:])}"
                )
    if rp.reloads and reload_fn is None:
        experts = [r.expert for r in rp.reloads]
        raise ValueError(f"rank {rp.group_rank} must reload experts {experts} but no reload_fn was given")
    return len(staging) if (needs_new and staging) else len(old)


def _default_communicator() -> Communicator:
    return TorchCommunicator()


def execute_layer(
    plan: RankPlan | LayerPlan,
    my_group_rank: int | None = None,
    old_weights: Sequence[torch.Tensor] | None = None,
    staging: Sequence[torch.Tensor] | None = None,
    *,
    group: dist.ProcessGroup | None = None,
    timeout: timedelta | float = 60.0,
    max_ops_per_batch: int = 64,
    reload_fn: Callable[[int], Sequence[torch.Tensor]] | None = None,
    layer: int | None = None,
    communicator: Communicator | None = None,
    migration_batching: bool = False,
    start_together: bool = False,
) -> TransferStats:
    """Fill ``staging`` with every slot this rank's part changes; return what was done.

    ``plan`` is the layer's :class:`LayerPlan` (then ``my_group_rank`` defaults to
    ``dist.get_rank(group)``) or this rank's :class:`RankPlan`. ``timeout`` (seconds or a
    timedelta) bounds the network phase; ``max_ops_per_batch`` must be equal on every rank.
    ``reload_fn(expert)`` returns one tensor per weight tensor (trailing shape of a slot) for
    experts no live worker holds. ``communicator`` moves the bytes (default: the group's own
    ``torch.distributed`` backend, gloo or NCCL, with ``batch_isend_irecv``; see
    :mod:`eplb.communicator` for NIXL). ``migration_batching`` batches by the plan's migration
    rounds (one peer per direction per rank per batch; equal on every rank). ``start_together``:
    no byte moves before every rank of the group entered the layer (equal on every rank; see
    :class:`~eplb.exchange.LayerExchange`). Raises :class:`TransferTimeout` / :class:`TransferError`
    on a stuck or broken peer, ``ValueError`` on buffers that do not fit the plan.
    """
    started = time.monotonic()
    limit = _seconds(timeout)
    rp = _rank_plan(plan, my_group_rank, group, max_ops_per_batch)
    old = _tensors(old_weights)
    new = _tensors(staging)
    num_tensors = _check_args(rp, old, new, reload_fn)
    _network_phase(rp, old, num_tensors, lambda k, t, w: new[w][t.dst_slots[0]], group=group, started=started,
                   limit=limit, max_ops_per_batch=max_ops_per_batch, layer=layer, communicator=communicator,
                   migration_batching=migration_batching, start_together=start_together)
    _local_phase(rp, old, new, num_tensors, reload_fn, layer)
    return _stats(rp, old, new, started)


def _rank_plan(plan: RankPlan | LayerPlan, my_group_rank: int | None, group: dist.ProcessGroup | None,
               max_ops_per_batch: int) -> RankPlan:
    if isinstance(plan, LayerPlan):
        if my_group_rank is None:
            my_group_rank = dist.get_rank(group)
        rp = plan.for_rank(my_group_rank)
    else:
        rp = plan
        if my_group_rank is not None and my_group_rank != rp.group_rank:
            raise ValueError(f"rank plan is for group rank {rp.group_rank}, not {my_group_rank}")
    if isinstance(max_ops_per_batch, bool) or not isinstance(max_ops_per_batch, int) or max_ops_per_batch < 1:
        raise ValueError(f"max_ops_per_batch must be a positive int, got {max_ops_per_batch!r}")
    return rp


def _network_phase(rp: RankPlan, old: list[torch.Tensor], num_tensors: int,
                   recv_target: Callable[[int, Any, int], torch.Tensor], *, group: dist.ProcessGroup | None,
                   started: float, limit: float, max_ops_per_batch: int, layer: int | None,
                   communicator: Communicator | None, migration_batching: bool = False,
                   start_together: bool = False) -> None:
    """Hand this rank's sends and receives (``recv_target(k, transfer, tensor)``: where receive
    ``k`` of weight tensor ``tensor`` lands) to the communicator, with the layer's deadline."""
    comm = communicator if communicator is not None else _default_communicator()
    sends: list[TransferOp] = []
    recvs: list[TransferOp] = []
    if (rp.sends or rp.recvs) and num_tensors < 1:
        raise ValueError("experts have no weight tensors")
    batch_of, num_batches = op_batches(rp, max(num_tensors, 1), max_ops_per_batch, migration_batching)
    for t in rp.sends:
        for w in range(num_tensors):
            sends.append(TransferOp(t.index * num_tensors + w, True, t.dst, t, w, old[w][t.src_slot],
                                    batch_of(t.index, w)))
    for k, t in enumerate(rp.recvs):
        for w in range(num_tensors):
            recvs.append(TransferOp(t.index * num_tensors + w, False, t.src, t, w, recv_target(k, t, w),
                                    batch_of(t.index, w)))
    # a layer nobody moves over the network needs no exchange at all (every rank knows the global count)
    if sends or recvs or (comm.collective_per_layer and rp.num_transfers > 0):
        comm.exchange(LayerExchange(
            layer=layer, rank=rp.group_rank, group=group, sends=tuple(sorted(sends, key=lambda op: op.index)),
            recvs=tuple(sorted(recvs, key=lambda op: op.index)), num_ops=rp.num_transfers * max(num_tensors, 0),
            max_ops_per_batch=max_ops_per_batch, timeout=limit, deadline=started + limit,
            num_batches=num_batches, migration_batching=migration_batching, start_together=start_together,
        ))


def op_batches(rp: RankPlan, num_tensors: int, max_ops_per_batch: int,
               migration_batching: bool) -> tuple[Callable[[int, int], int], int]:
    """``(batch_of(transfer index, weight tensor), number of batches)``: the global batch every
    op of the layer is posted in, the same on every rank (pure: a function of the plan's global
    transfer list, its rounds and the two settings).

    Off: op ``k = index * T + w`` is in batch ``k // max_ops_per_batch``. On: the plan's
    migration rounds in order, each round's ops (its transfers in index order, ``T`` ops each)
    cut into chunks of ``max_ops_per_batch``."""
    per = max_ops_per_batch
    if not migration_batching:
        return (lambda index, w: (index * num_tensors + w) // per), -(-rp.num_transfers * num_tensors // per)
    rounds = rp.rounds
    if sum(len(r) for r in rounds) != rp.num_transfers:
        raise ValueError(f"the plan's migration rounds cover {sum(len(r) for r in rounds)} transfers, "
                         f"not its {rp.num_transfers}")
    where: dict[int, tuple[int, int]] = {}  # transfer index -> (first batch of its round, op position in the round)
    first = 0
    for members in rounds:
        for position, index in enumerate(members):
            where[index] = (first, position * num_tensors)
        first += -(-len(members) * num_tensors // per)

    def batch_of(index: int, w: int) -> int:
        start, offset = where[index]
        return start + (offset + w) // per

    return batch_of, first


def _local_phase(rp: RankPlan, old: list[torch.Tensor], new: list[torch.Tensor], num_tensors: int,
                 reload_fn: Callable[[int], Sequence[torch.Tensor]] | None, layer: int | None) -> None:
    """Fan out received experts to their other slots, local copies, reloads."""
    for t in rp.recvs:
        for w in range(num_tensors):
            first = new[w][t.dst_slots[0]]
            for j in t.dst_slots[1:]:
                new[w][j].copy_(first)
    for i, j in rp.local_copies:
        for w in range(len(new)):
            new[w][j].copy_(old[w][i])
    for r in rp.reloads:
        try:
            loaded = list(reload_fn(r.expert))  # type: ignore[misc]
        except Exception as exc:
            raise TransferError(
                f"reloading expert {r.expert} failed", layer=layer, rank=rp.group_rank, cause=f"{type(exc).__name__}: {exc}"
            ) from exc
        if len(loaded) != len(new) or any(a.shape != b.shape[1:] for a, b in zip(loaded, new)):
            raise TransferError(
                f"reload_fn({r.expert}) returned shapes {[tuple(a.shape) for a in loaded]}, "
                f"expected {[tuple(b.shape[1:]) for b in new]}", layer=layer, rank=rp.group_rank,
            )
        for w, value in enumerate(loaded):
            for j in r.slots:
                new[w][j].copy_(value)


def _stats(rp: RankPlan, old: list[torch.Tensor], new: list[torch.Tensor], started: float) -> TransferStats:
    return TransferStats(
        bytes_sent=len(rp.sends) * _expert_bytes(old),
        bytes_received=len(rp.recvs) * _expert_bytes(new),
        num_sends=len(rp.sends),
        num_recvs=len(rp.recvs),
        num_local_copies=len(rp.local_copies),
        num_reloads=len(rp.reloads),
        seconds=time.monotonic() - started,
    )


def commit_layer(
    rank_plan: RankPlan, staging: Sequence[torch.Tensor], weights: Sequence[torch.Tensor]
) -> int:
    """Copy every changed slot from ``staging`` into ``weights`` in place; kept slots are untouched.

    Needs ``weights`` with the new slot count (``S_new``); when the slot count changes (or the
    worker is fresh), use :func:`materialize` instead. Returns the number of slots written.
    """
    changed = rank_plan.changed_slots
    if not changed:
        return 0
    if len(staging) != len(weights):
        raise ValueError(f"{len(staging)} staging tensors but {len(weights)} weight tensors")
    for w, (s, t) in enumerate(zip(staging, weights)):
        if t.shape[0] != rank_plan.num_new_slots or s.shape[0] != rank_plan.num_new_slots:
            raise ValueError(
                f"tensor {w}: weights {tuple(t.shape)} / staging {tuple(s.shape)} must both have "
                f"{rank_plan.num_new_slots} slots (slot count changed? use materialize)"
            )
    for s, t in zip(staging, weights):
        for j in changed:
            t[j].copy_(s[j])
    return len(changed)


def materialize(
    rank_plan: RankPlan, old_weights: Sequence[torch.Tensor] | None, staging: Sequence[torch.Tensor]
) -> Sequence[torch.Tensor]:
    """Copy the kept slots from ``old_weights`` into ``staging``; ``staging`` then is the new weights.

    For a rescale where the slot count changes, or a fresh worker (no kept slots). Returns ``staging``.
    """
    if rank_plan.keeps:
        old = _tensors(old_weights)
        if len(old) != len(staging):
            raise ValueError(f"{len(old)} old weight tensors but {len(staging)} staging tensors")
        for o, s in zip(old, staging):
            for j in rank_plan.keeps:
                s[j].copy_(o[j])
    return staging
