"""The experts kernel that serves Hugging Face MoE blocks, unsharded or expert-parallel, with the same bits.

Registered in transformers' ``ALL_EXPERTS_FUNCTIONS`` as :data:`KERNEL_NAME` (its entry, ``ep_experts_forward``,
and ``register`` live in :mod:`eplb.models.dispatch`, which imports this module); a model selects it
with ``model.set_experts_implementation(KERNEL_NAME)``. Each experts module it runs on carries an
:class:`ExpertsContext` (attribute ``_eplb``) saying which MoE layer it is, which physical slots
this rank holds, and the group to exchange pairs over.

Why a kernel of our own (measured on this machine, CPU torch 2.13 with MKL):

- *Rows per call.* The bits of an expert GEMM depend on how many rows one call holds: below a
  floor that depends on the CPU and the weights' shapes, MKL takes other code paths (measured:
  1-3 rows differ from larger calls on an AVX2 Xeon, 1-15 rows on an AVX-512 one, by ~1e-5);
  from the floor up a row's bits do not change with the row count, and expert parallelism
  changes how many rows each expert's call gets. Here each slot's rows are one group of a
  grouped GEMM, padded with zero rows to at least the floor, which :func:`row_floor` measures
  on this machine at start-up, so a pair's bits do not depend on the other rows:
  :func:`check_row_independent` proves it at start-up.
- *Summation order.* Eager HF sums a token's k contributions in ascending expert id, the
  batched kernels in k order. Here always in k order, in float32, then cast to the model dtype
  (eager bf16 accumulates in bf16 and differs from the other kernels by up to 0.29 in logits).

Expert parallelism: each rank runs attention and the dense layers for its own requests only
(:mod:`eplb.models.packed`); each MoE layer sends every (token, expert) pair of the rank's
tokens to one replica of its expert with ``all_to_all``, the holder computes it here, and the
outputs come back to be combined by the owner (:mod:`eplb.models.dispatch`). A pair's output
bits depend only on its row and its expert's weights, so they are the same whichever rank or
replica computes them, and a token's logits equal the unsharded model's.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

__all__ = ["KERNEL_NAME", "ExpertsContext", "ReplicaDivergence", "check_row_independent", "group_positions", "pair_forward",
           "decode_rows", "placement_print", "row_floor"]

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
    #: the group's collectives over shared memory (:class:`~eplb.models.local_exchange.LocalExchange`;
    #: None: gloo), set by ``HFMoE`` before each step
    local: Any = None
    timeout: float = 30.0
    min_rows: int = 1  # a slot's prefill rows are padded to at least this many (the machine's row_floor)
    decode_rows: int = 1  # a slot's decode rows go in groups of at most this many, unpadded (decode_rows)
    placement_print: int = 0  # a fingerprint of this layer's placement row: the ranks must agree on it
    routing: Any = None  # the placement row as the dispatch reads it (dispatch.routing_of; built at the first step)
    rows: int | None = None  # real token rows of the packed step being run (None: outside forward_batch)
    decode: torch.Tensor | None = None  # [rows] bool: the row is a request's one new token (None: all prefill)
    peer_rows: tuple[int, ...] = ()  # every rank's real rows this step (dispatch.step_header)
    peer_top_k: int = 0  # the group's top-k this step (0: no rank has tokens)
    record: bool = True
    timed: bool = False  # measure the CPU split in stats (benchmarks; HFMoE.measure_cpu)
    logical_counts: torch.Tensor | None = None  # [L] int64: the group's pairs, accumulated while record is on
    physical_counts: torch.Tensor | None = None  # [P] int64: the group's pairs delivered per physical slot
    rank_pairs: torch.Tensor | None = None  # [R] int64: pairs each rank's experts computed
    # pairs computed here; CPU seconds in the experts kernel and in the exchanges' posts and waits
    stats: dict[str, float] = field(default_factory=lambda: {"pairs": 0, "expert_cpu_s": 0.0, "collective_cpu_s": 0.0})


#: The most rows :func:`row_floor` accepts as a floor (a kernel whose bits change above it is refused).
FLOOR_LIMIT = 64


def pair_forward(module: torch.nn.Module, weights: dict[str, torch.Tensor], x: torch.Tensor,
                 slots: torch.Tensor, *, min_rows: int, decode: torch.Tensor | None = None,
                 decode_rows: int = 1) -> torch.Tensor:
    """One expert per row: ``x [n, H]`` through slot ``slots[i]`` of ``weights`` (every matrix
    ``[slots, in, out]``, the slots' layout, see :class:`~eplb.models.hf.HFMoE`); ``[n, H]``.

    The rows of each slot form groups of a grouped GEMM (``torch._grouped_mm`` over the slot
    tensors, no weight copy), so that a row's bits do not depend on the other rows:

    - a row of a prefill (``decode[i]`` False, or ``decode`` None) is in its slot's prefill group,
      padded with zero rows to at least ``min_rows`` (the machine's :func:`row_floor`);
    - a decode row (a request's one new token) is in a group of at most ``decode_rows`` decode
      rows of its slot, unpadded (:func:`decode_rows` measures how many rows share the bits of a
      row alone): a decode step's few rows per expert then cost their own rows, not the floor's.

    A row's bits depend only on its kind, its row and its slot (checked by
    :func:`check_row_independent`). Gating and activation are the module's. One grouped GEMM
    per round, a slot's groups in successive rounds (one round for a step of decode rows of at
    most ``decode_rows`` per slot).
    """
    num_slots = next(iter(weights.values())).shape[0]
    if decode is None or min_rows == 1 or not bool(decode.any()):
        return _grouped_forward(module, weights, x, slots, min_rows)
    # the index arithmetic in numpy: a decode step's few dozen rows cost a torch op several numpy ones
    slot_of, is_decode = slots.numpy(), decode.numpy()
    if is_decode.all() and np.bincount(slot_of, minlength=num_slots).max() <= decode_rows:
        return _grouped_forward(module, weights, x, slots, 1)  # a decode step's usual case: one round, unpadded
    has_big = np.bincount(slot_of[~is_decode], minlength=num_slots) > 0
    small = np.flatnonzero(is_decode)
    small_slots = slot_of[small]
    order, _, sorted_within = group_positions(small_slots, num_slots)
    within = np.empty_like(small)
    within[order] = sorted_within
    unit = np.zeros_like(slot_of)  # a row's group among its slot's: the prefill group first, then decode chunks
    unit[small] = within // decode_rows + has_big[small_slots]
    out = torch.empty(0)
    for u in range(int(unit.max()) + 1):
        rows = np.flatnonzero(unit == u)
        if not rows.shape[0]:
            continue
        pad = np.where(has_big, min_rows, 1) if u == 0 else 1
        index = torch.from_numpy(rows)
        part = _grouped_forward(module, weights, x[index], slots[index], pad)
        if not out.numel():
            out = part.new_empty(x.shape[0], part.shape[1])
        out[index] = part
    return out


def group_positions(keys: np.ndarray, num_keys: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """For ``keys [n]`` (each in ``[0, num_keys)``): the stable order that groups them by key, each
    key's count ``[num_keys]``, and each element's position within its key's group, in that order."""
    order = np.argsort(keys, kind="stable")
    counts = np.bincount(keys, minlength=num_keys)
    return order, counts, np.arange(keys.shape[0]) - (np.cumsum(counts) - counts)[keys[order]]


def _grouped_forward(module: torch.nn.Module, weights: dict[str, torch.Tensor], x: torch.Tensor,
                     slots: torch.Tensor, min_rows: int | np.ndarray) -> torch.Tensor:
    """Each slot's rows as one group, padded with zero rows to ``min_rows`` (per slot, or one for all)."""
    has_gate = getattr(module, "has_gate", True)
    num_slots = next(iter(weights.values())).shape[0]
    slot_of = slots.numpy()
    order, counts, within = group_positions(slot_of, num_slots)
    padded = np.where(counts > 0, np.maximum(counts, min_rows), 0)
    ends = np.cumsum(padded)
    source = torch.from_numpy(order)
    offsets = torch.from_numpy(ends.astype(np.int32))
    has_bias = any(name.endswith("_bias") for name in weights)
    row_slot = torch.from_numpy(np.repeat(np.arange(num_slots), padded)) if has_bias else None

    def linear(inp: torch.Tensor, name: str) -> torch.Tensor:
        w_all, bias = weights[name], weights.get(name + "_bias")
        out = torch._grouped_mm(inp, w_all, offs=offsets)
        return out if bias is None else out + bias[row_slot]

    total = int(ends[-1])
    padding = total > x.shape[0]  # else the rows sorted by slot are the groups as they are
    if padding:
        dest = torch.from_numpy((ends - padded)[slot_of[order]] + within)  # each sorted row's place among the groups
        rows = x.new_zeros(total, x.shape[1])  # padding: zeros
        rows[dest] = x[source]
    else:
        rows = x[source]
    h = linear(rows, "gate_up_proj" if has_gate else "up_proj")
    h = _activate(module, h, has_gate)
    h = linear(h, "down_proj")
    if getattr(module, "has_post_expert_norm", False):
        h = _module_fn(module, "post_expert_norm")(h)
    out = torch.empty(x.shape[0], h.shape[1], dtype=h.dtype)
    out[source] = h[dest] if padding else h
    return out


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
        if padded == inter:  # every half already a whole number of vectors: no tail, nothing to pad
            return _module_fn(module, "_apply_gate")(h)
        wide = h.new_zeros(n, 2 * padded)
        if getattr(module, "is_concatenated", True):  # [gate | up]: keep each half at the start of its half
            wide[:, :inter] = h[:, :inter]
            wide[:, padded : padded + inter] = h[:, inter:]
        else:  # interleaved [g0, u0, g1, u1, ...]: pairs stay pairs
            wide[:, : 2 * inter] = h
        return _module_fn(module, "_apply_gate")(wide)[:, :inter]
    padded = -(-width // _LANES) * _LANES
    if padded == width:
        return _module_fn(module, "act_fn")(h)
    wide = h.new_zeros(n, padded)
    wide[:, :width] = h
    return _module_fn(module, "act_fn")(wide)[:, :width]


class ReplicaDivergence(RuntimeError):
    """The ranks of an EP group disagree on a layer's placement: its pairs cannot be exchanged."""


_FLOORS: dict[tuple[Any, ...], int] = {}


def _measure_key(what: str, module: torch.nn.Module, weights: dict[str, torch.Tensor], hidden: int,
                 dtype: torch.dtype, *extra: Any) -> tuple[Any, ...]:
    """What a measured row count depends on: the experts class and layout, the weights' shapes and
    dtypes, the dtype, the width and torch's thread count (the cache key of :data:`_FLOORS`)."""
    return (what, type(module).__name__, getattr(module, "is_transposed", False), getattr(module, "has_gate", True),
            tuple((n, tuple(w.shape[1:]), w.dtype) for n, w in weights.items()), dtype, hidden, torch.get_num_threads(),
            *extra)


def _probe_rows(total: int, hidden: int, dtype: torch.dtype, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``total`` seeded rows ``[total, hidden]`` and their slots (all slot 0), for a measurement."""
    g = torch.Generator().manual_seed(seed)
    return torch.randn(total, hidden, generator=g).to(dtype), torch.zeros(total, dtype=torch.long)


def row_floor(module: torch.nn.Module, weights: dict[str, torch.Tensor], hidden: int, dtype: torch.dtype, *,
              seed: int = 0) -> int:
    """The fewest rows a slot's group must hold for its rows' bits not to change with the group's
    row count, measured on this machine (cached per experts class, weight shapes, dtype and torch's
    thread count: the bits depend on each).

    Runs ``2 * FLOOR_LIMIT`` seeded rows through one slot in one call, then every shorter prefix
    alone (each prefix's last rows fall in the GEMM's tail blocks), unpadded, and returns one more
    than the longest prefix whose bits differ. Raises if bits still change at :data:`FLOOR_LIMIT` rows.
    """
    key = _measure_key("floor", module, weights, hidden, dtype)
    if key in _FLOORS:
        return _FLOORS[key]
    total = 2 * FLOOR_LIMIT
    x, slots = _probe_rows(total, hidden, dtype, seed)
    sizes = [*range(1, FLOOR_LIMIT + 1), FLOOR_LIMIT + 13, FLOOR_LIMIT + 31, total - 1]
    with torch.no_grad():
        whole = pair_forward(module, weights, x, slots, min_rows=1)
        differ = [m for m in sizes if not torch.equal(pair_forward(module, weights, x[:m], slots[:m], min_rows=1), whole[:m])]
    floor = differ[-1] + 1 if differ else 1
    if floor > FLOOR_LIMIT:
        raise RuntimeError(
            f"the experts kernel is not row-independent on this machine: a row's bits still change with the "
            f"number of rows in the call at {differ[-1]} rows (tried up to {total}): expert-parallel output "
            "would not match the unsharded model")
    _FLOORS[key] = floor
    return floor


def decode_rows(module: torch.nn.Module, weights: dict[str, torch.Tensor], hidden: int, dtype: torch.dtype, *,
                floor: int, seed: int = 0) -> int:
    """The most rows of one slot that one call may hold below ``floor`` and still give every row
    the bits of that row computed alone (at least 1), measured on this machine and cached like
    :func:`row_floor`. Below the floor MKL runs a small-row path whose rows are often independent
    of each other (1-3 rows on an AMD EPYC, where 4 and more take the blocked path): a decode
    step's rows, computed in groups of at most this many, cost their own rows, not the floor's."""
    if floor <= 2:
        return 1
    key = _measure_key("decode", module, weights, hidden, dtype, floor)
    if key in _FLOORS:
        return _FLOORS[key]
    total = 4 * floor
    x, slots = _probe_rows(total, hidden, dtype, seed)
    with torch.no_grad():
        alone = torch.cat([pair_forward(module, weights, x[i : i + 1], slots[:1], min_rows=1) for i in range(total)])
        best = 1
        for m in range(2, floor):
            if not all(torch.equal(pair_forward(module, weights, x[s : s + m], slots[:m], min_rows=1), alone[s : s + m])
                       for s in range(0, total - m + 1, m)):
                break
            best = m
    _FLOORS[key] = best
    return best


def check_row_independent(module: torch.nn.Module, weights: dict[str, torch.Tensor], hidden: int,
                          dtype: torch.dtype, *, min_rows: int, decode_rows: int = 1, rows: int = 37,
                          seed: int = 0) -> None:
    """Raise if a pair's output bits depend on how many other pairs share the call, with every
    slot's prefill rows padded to ``min_rows`` and its decode rows in groups of ``decode_rows``.

    Runs ``rows`` (at least ``3 * min_rows + 5``) random pairs in one call, over random slots and
    again all in one slot, all prefill rows, then with a random half of them decode rows, then in
    uneven chunks (1, 2, ... ``min_rows + 2`` rows, around the floor, and the rest in one), and
    compares bitwise.
    """
    g = torch.Generator().manual_seed(seed)
    rows = max(rows, 3 * min_rows + 5)
    num_slots = next(iter(weights.values())).shape[0]
    x = torch.randn(rows, hidden, generator=g).to(dtype)
    mixed = torch.rand(rows, generator=g) < 0.5
    cases = [(slots, decode) for slots in (torch.randint(0, num_slots, (rows,), generator=g), torch.zeros(rows, dtype=torch.long))
             for decode in (None, mixed)]
    for slots, decode in cases:
        with torch.no_grad():
            whole = pair_forward(module, weights, x, slots, min_rows=min_rows, decode=decode, decode_rows=decode_rows)
            parts = []
            start, size = 0, 1
            while start < rows:
                parts.append(pair_forward(module, weights, x[start : start + size], slots[start : start + size],
                                          min_rows=min_rows, decode=None if decode is None else decode[start : start + size],
                                          decode_rows=decode_rows))
                start += size
                size = size % (min_rows + 2) + 1 if start < rows // 2 else rows
        pieces = torch.cat(parts)
        if not torch.equal(whole, pieces):
            bad = (whole != pieces).any(dim=1).nonzero().squeeze(1).tolist()
            raise RuntimeError(
                f"the experts kernel is not row-independent on this machine (rows {bad[:8]} changed bits "
                f"when computed in smaller calls; max diff {float((whole.float() - pieces.float()).abs().max()):.3g}): "
                "expert-parallel output would not match the unsharded model"
            )


def placement_print(logical_to_physical: torch.Tensor, replica_count: torch.Tensor) -> int:
    """A fingerprint of one layer's placement row (ranks exchanging pairs must hold the same)."""
    words = torch.cat([logical_to_physical.reshape(-1), replica_count.reshape(-1)]).to(torch.int64)
    return int((words * (torch.arange(words.numel()) % 65521 + 1)).sum() % (1 << 62))
