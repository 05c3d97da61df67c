"""Expert placement algorithms: from per-expert load (and the current placement) to a new placement.

Modelled on DeepSeek's ``eplb.py``: one pure module, one entry point,
:func:`rebalance_experts`, with the same signature and the same output shapes and dtypes, so an
engine that calls the reference can call this instead. Everything here is pure: no I/O, no
``torch.distributed``, deterministic, CPU only (numpy inside, torch ``int64`` out).

Shapes (``B`` layers, ``L`` logical experts, ``P`` physical slots, ``G`` GPUs, ``S = P / G``):

- ``weight``               ``[B, L]``          load per logical expert (any real or integer dtype)
- ``physical_to_logical``  ``[B, P]``          int64, the expert each slot holds
- ``logical_to_physical``  ``[B, L, P - L + 1]`` int64, the slots of each expert, ``-1`` padded
- ``replica_count``        ``[B, L]``          int64

Slots are GPU-major: GPU ``g`` owns slots ``[g * S, (g + 1) * S)``; every GPU has exactly ``S``.
An expert's load splits evenly over its replicas; the balancedness of a layer is
mean GPU load / max GPU load (:meth:`eplb.placement.Placement.balancedness`). The mean does not
depend on the placement, so every policy below works by lowering the maximum.

Policies (registry :data:`POLICIES`, chosen by name, extended with :func:`register_policy`):

``default``
    Balance over all GPUs, ignoring groups and nodes. (1) replicate: give each redundant slot to
    the expert with the largest load per replica (this minimizes the largest replica); (2) pack:
    replicas in descending load, ``G`` per round, the heaviest of a round to the lightest GPU, so
    every GPU gets exactly ``S``; (3) improve: swap one replica of the heaviest GPU with one of a
    light GPU while that lowers the pair's maximum (never putting two replicas of an expert on
    one GPU). Stateless, like the reference.
``hierarchical``
    The reference behaviour (DeepSeek ``rebalance_experts``): when ``num_groups % num_nodes == 0``
    expert groups are packed to nodes (equal group counts, greedy by group load), replicas are
    made within each node, then packed to the node's GPUs; otherwise global balancing exactly as
    the reference does (its hierarchical routine with one group and one node). Reproduces the
    reference's output bit for bit on integer loads. What it buys: every expert of a group, and
    all of its replicas, sit on one node, so group-limited routing never leaves the node. What it
    costs: a node's load is fixed by the groups it got, so balance is capped by the node loads;
    with one group per node (DeepSeek-V3 on 8 nodes) a skewed load leaves balancedness near 0.5.
``hierarchical_spill``
    Keeps the meaningful half of the node constraint and drops the costly half: groups are packed
    to nodes as in ``hierarchical`` and each expert's first replica stays on its group's node (a
    full copy of every group on its node, so group-limited routing can always stay in the node),
    but redundant replicas are placed wherever they balance best, across nodes. Balance close to
    ``default``; the bench reports the share of load served on the home node.
``migration_aware``
    Incremental: start from ``previous`` (a ``[B, P_old]`` physical_to_logical or a
    :class:`~eplb.placement.Placement`) and make the fewest cross-GPU copies that bring each layer
    within ``tolerance`` of what ``default`` would reach on this load. Every move is one copy (give
    a slot of a cold GPU to an expert of the hottest GPU) or two (swap two experts between GPUs),
    picked by the largest drop of the peak per copy; a move is kept only if no GPU it touches ends
    at or above the old peak, so the result is never less balanced than keeping ``previous``.
    After a scale (``previous`` has another slot count) experts stay on the GPUs that still exist
    (GPU ``g`` is GPU ``g`` unless ``rank_mapping`` says otherwise); lost experts and new slots are
    filled first. Options: ``tolerance`` (balancedness points, default 0.01), ``max_copies`` (cap
    per layer per call), ``previous_num_gpus``, ``rank_mapping``.

Errors are :class:`AlgorithmError` (a ``ValueError``) subclasses with messages naming what is
wrong. Where the reference falls back to global balancing (``num_groups % num_nodes != 0``) this
module does the same; a group count that does not divide the experts, or a node count that does
not divide the GPUs, describes no real model or cluster and is refused for every policy.
The reference's ``logical_to_physical`` width is ``max(replica_count)`` (data dependent); here,
as in vLLM, it is the fixed ``P - L + 1``, and replicas are listed in ascending slot order
(:func:`eplb.placement.build_logical_to_physical`).
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from eplb.placement import Placement, PlacementError, build_logical_to_physical, validate_physical_to_logical

__all__ = [
    "AlgorithmError",
    "InvalidLoadError",
    "InvalidShapeError",
    "InvalidPreviousError",
    "InvalidOptionError",
    "UnknownPolicyError",
    "Policy",
    "POLICIES",
    "Problem",
    "register_policy",
    "rebalance_experts",
    "compute_placement",
    "cross_gpu_copies",
    "home_node_share",
]


# --------------------------------------------------------------------------------------------
# Errors
# --------------------------------------------------------------------------------------------


class AlgorithmError(ValueError):
    """Input that no policy can serve (or a policy request that cannot be served)."""


class InvalidLoadError(AlgorithmError):
    """``weight`` is not a ``[layers, experts]`` tensor of finite, non-negative loads."""


class InvalidShapeError(AlgorithmError):
    """Replica / group / node / GPU counts that do not fit each other."""


class InvalidPreviousError(AlgorithmError):
    """``previous`` is not a placement of the same layers and experts."""


class InvalidOptionError(AlgorithmError):
    """A policy option the policy does not take, or a bad value for one."""


class UnknownPolicyError(AlgorithmError):
    """No policy of that name is registered."""


# --------------------------------------------------------------------------------------------
# Problem and registry
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Problem:
    """A validated request, as the policies see it (numpy inside)."""

    weight: torch.Tensor  # [B, L] the caller's tensor on CPU, original dtype
    load: np.ndarray  # [B, L] float64
    num_replicas: int
    num_groups: int
    num_nodes: int
    num_gpus: int
    previous: np.ndarray | None  # [B, P_old] int64

    @property
    def num_layers(self) -> int:
        return self.load.shape[0]

    @property
    def num_logical(self) -> int:
        return self.load.shape[1]

    @property
    def slots_per_gpu(self) -> int:
        return self.num_replicas // self.num_gpus


Policy = Callable[..., np.ndarray]
"""``policy(problem, **options) -> physical_to_logical [B, P]`` (int64 numpy)."""

POLICIES: dict[str, Policy] = {}


def register_policy(name: str) -> Callable[[Policy], Policy]:
    """Decorator: register ``fn(problem: Problem, **options) -> np.ndarray [B, P]`` under ``name``."""

    def deco(fn: Policy) -> Policy:
        if name in POLICIES:
            raise AlgorithmError(f"policy {name!r} is already registered")
        POLICIES[name] = fn
        return fn

    return deco


def _get_policy(name: str) -> Policy:
    try:
        return POLICIES[name]
    except (KeyError, TypeError):
        raise UnknownPolicyError(f"unknown policy {name!r}; known policies: {', '.join(sorted(POLICIES))}") from None


def _check_options(name: str, fn: Policy, options: Mapping[str, Any]) -> None:
    params = inspect.signature(fn).parameters
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values()):
        return
    accepted = [n for n, p in params.items() if p.kind is inspect.Parameter.KEYWORD_ONLY]
    unknown = sorted(set(options) - set(accepted))
    if unknown:
        raise InvalidOptionError(
            f"policy {name!r} takes no option(s) {', '.join(unknown)}; it takes: {', '.join(accepted) or 'none'}"
        )


# --------------------------------------------------------------------------------------------
# Entry points
# --------------------------------------------------------------------------------------------


def rebalance_experts(
    weight: torch.Tensor,
    num_replicas: int,
    num_groups: int,
    num_nodes: int,
    num_gpus: int,
    *,
    policy: str = "default",
    previous: torch.Tensor | Placement | None = None,
    **policy_options: Any,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Entry point, drop-in for the reference ``rebalance_experts``.

    Parameters:
        weight: ``[layers, L]`` load of each logical expert (any real or integer dtype, >= 0).
        num_replicas: ``P``, physical slots per layer, a multiple of ``num_gpus``, at least ``L``.
        num_groups: expert groups (``L`` is a multiple of it); used by ``hierarchical``.
        num_nodes: nodes (``num_gpus`` is a multiple of it); used by ``hierarchical``.
        num_gpus: GPUs (EP ranks); GPU ``g`` owns slots ``[g*S, (g+1)*S)``.
        policy: a name in :data:`POLICIES`.
        previous: the current placement, ``[layers, P_old]`` or a ``Placement`` (``migration_aware``).
        policy_options: options of the chosen policy.

    Returns:
        ``physical_to_logical [layers, P]``, ``logical_to_physical [layers, L, P - L + 1]``
        (``-1`` padded), ``replica_count [layers, L]``, all int64 CPU tensors.
    """
    fn = _get_policy(policy)
    _check_options(policy, fn, policy_options)
    problem = _make_problem(weight, num_replicas, num_groups, num_nodes, num_gpus, previous)
    p2l_np = fn(problem, **policy_options)
    p2l = torch.from_numpy(np.ascontiguousarray(p2l_np, dtype=np.int64))
    validate_physical_to_logical(p2l, problem.num_logical)  # a policy bug must never leave here
    l2p, counts = build_logical_to_physical(p2l, problem.num_logical, problem.num_replicas - problem.num_logical + 1)
    return p2l, l2p, counts


def compute_placement(
    load: torch.Tensor,
    num_physical: int,
    num_gpus: int,
    *,
    num_groups: int = 1,
    num_nodes: int = 1,
    policy: str = "default",
    previous: torch.Tensor | Placement | None = None,
    **opts: Any,
) -> Placement:
    """:func:`rebalance_experts` returning a :class:`~eplb.placement.Placement`."""
    p2l, l2p, counts = rebalance_experts(
        load, num_physical, num_groups, num_nodes, num_gpus, policy=policy, previous=previous, **opts
    )
    return Placement(p2l, l2p, counts)


# --------------------------------------------------------------------------------------------
# Input checks
# --------------------------------------------------------------------------------------------


def _positive_int(name: str, value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
        raise InvalidShapeError(f"{name} must be an int, got {value!r}")
    if value < 1:
        raise InvalidShapeError(f"{name} must be >= 1, got {value}")
    return int(value)


def _make_problem(weight, num_replicas, num_groups, num_nodes, num_gpus, previous) -> Problem:
    # 1. weight: a 2-D tensor of finite, non-negative real numbers
    if not isinstance(weight, torch.Tensor):
        try:
            weight = torch.as_tensor(weight)
        except Exception as exc:  # noqa: BLE001 - anything that is not a tensor
            raise InvalidLoadError(f"weight must be a [layers, experts] tensor, got {type(weight).__name__}") from exc
    if weight.dim() != 2:
        raise InvalidLoadError(f"weight must be a 2-D [layers, experts] tensor, got shape {tuple(weight.shape)}")
    layers, experts = weight.shape
    if layers < 1 or experts < 1:
        raise InvalidLoadError(f"weight needs at least one layer and one expert, got shape {tuple(weight.shape)}")
    if weight.is_complex():
        raise InvalidLoadError(f"weight must be real, got {weight.dtype}")
    weight = weight.detach().cpu()
    w = weight.to(torch.float64)
    if weight.dtype.is_floating_point:
        finite = torch.isfinite(weight)
        if not bool(finite.all()):
            layer, expert = (int(i) for i in (~finite).nonzero()[0])
            raise InvalidLoadError(
                f"weight must be finite: layer {layer}, expert {expert} has {float(weight[layer, expert])}"
            )
    negative = w < 0
    if bool(negative.any()):
        layer, expert = (int(i) for i in negative.nonzero()[0])
        raise InvalidLoadError(f"weight must be >= 0: layer {layer}, expert {expert} has {weight[layer, expert].item()}")

    # 2. counts that fit each other
    num_replicas = _positive_int("num_replicas", num_replicas)
    num_groups = 1 if num_groups is None else _positive_int("num_groups", num_groups)
    num_nodes = _positive_int("num_nodes", num_nodes)
    num_gpus = _positive_int("num_gpus", num_gpus)
    if num_replicas < experts:
        raise InvalidShapeError(
            f"num_replicas={num_replicas} is less than the {experts} logical experts (each needs a slot)"
        )
    if num_replicas % num_gpus:
        raise InvalidShapeError(f"num_replicas={num_replicas} is not a multiple of num_gpus={num_gpus}")
    if num_gpus % num_nodes:
        raise InvalidShapeError(f"num_gpus={num_gpus} is not a multiple of num_nodes={num_nodes}")
    if experts % num_groups:
        raise InvalidShapeError(f"num_groups={num_groups} does not divide the {experts} logical experts")

    # 3. previous: a valid placement of the same layers and experts
    prev = None
    if previous is not None:
        if isinstance(previous, Placement):
            previous = previous.physical_to_logical
        if not isinstance(previous, torch.Tensor):
            try:
                previous = torch.as_tensor(previous)
            except Exception as exc:  # noqa: BLE001
                raise InvalidPreviousError(f"previous must be a [layers, slots] tensor, got {type(previous).__name__}") from exc
        if previous.dim() != 2 or previous.shape[0] != layers:
            raise InvalidPreviousError(
                f"previous must be [layers={layers}, slots], got shape {tuple(previous.shape)}"
            )
        try:
            validate_physical_to_logical(previous.detach().cpu(), experts)
        except PlacementError as exc:
            raise InvalidPreviousError(f"previous is not a valid placement: {exc}") from exc
        prev = previous.detach().cpu().to(torch.int64).numpy().copy()
    return Problem(weight, w.numpy().copy(), num_replicas, num_groups, num_nodes, num_gpus, prev)


# --------------------------------------------------------------------------------------------
# Shared building blocks (numpy, vectorized over the leading axis)
# --------------------------------------------------------------------------------------------


def _replicate(load: np.ndarray, num_slots: int) -> tuple[np.ndarray, np.ndarray]:
    """Greedy replication: each extra slot goes to the expert with the largest load per replica.

    ``load [X, n]`` -> ``(slot_expert [X, num_slots], counts [X, n])``; slot ``i < n`` holds
    expert ``i``, slot ``n + k`` the expert chosen at step ``k`` (the reference's order). Ties go to
    the lowest expert id. Arithmetic stays in ``load``'s dtype (float32 for the reference).
    """
    rows, n = load.shape
    counts = np.ones((rows, n), dtype=np.int64)
    slot_expert = np.empty((rows, num_slots), dtype=np.int64)
    slot_expert[:, :n] = np.arange(n)
    per_replica = load.copy()
    r = np.arange(rows)
    for k in range(n, num_slots):
        e = per_replica.argmax(axis=1)
        slot_expert[:, k] = e
        counts[r, e] += 1
        per_replica[r, e] = load[r, e] / counts[r, e].astype(load.dtype)
    return slot_expert, counts


def _greedy_pack(weight: np.ndarray, num_packs: int) -> tuple[np.ndarray, np.ndarray]:
    """Reference-style balanced packing: items in descending weight, each to the lightest pack
    that is not full (equal item counts per pack). ``weight [X, n]`` ->
    ``(pack [X, n], rank_in_pack [X, n])``. With one item per pack, item ``i`` goes to pack ``i``.
    """
    rows, n = weight.shape
    per_pack = n // num_packs
    if per_pack == 1:
        return np.broadcast_to(np.arange(n), (rows, n)).copy(), np.zeros((rows, n), dtype=np.int64)
    order = np.argsort(-weight, axis=1, kind="stable")
    pack_weight = np.zeros((rows, num_packs), dtype=weight.dtype)
    pack_items = np.zeros((rows, num_packs), dtype=np.int64)
    pack = np.empty((rows, n), dtype=np.int64)
    rank = np.empty((rows, n), dtype=np.int64)
    r = np.arange(rows)
    inf = np.array(np.inf, dtype=weight.dtype)
    for k in range(n):
        item = order[:, k]
        p = np.where(pack_items < per_pack, pack_weight, inf).argmin(axis=1)
        pack[r, item] = p
        rank[r, item] = pack_items[r, p]
        pack_weight[r, p] += weight[r, item]
        pack_items[r, p] += 1
    return pack, rank


def _inverse(perm: np.ndarray) -> np.ndarray:
    inv = np.empty_like(perm)
    np.put_along_axis(inv, perm, np.broadcast_to(np.arange(perm.shape[1]), perm.shape), axis=1)
    return inv


def _expand_counts(counts: np.ndarray) -> np.ndarray:
    """``counts [B, L]`` summing to ``P`` per row -> the expert of each replica ``[B, P]``, sorted."""
    b, n = counts.shape
    return np.repeat(np.tile(np.arange(n), b), counts.ravel()).reshape(b, -1)


def _gpu_loads(p2l: np.ndarray, load: np.ndarray, num_gpus: int) -> np.ndarray:
    b, n = load.shape
    counts = _counts_of(p2l, n)
    per_slot = np.take_along_axis(load / np.maximum(counts, 1), p2l, axis=1)
    return per_slot.reshape(b, num_gpus, -1).sum(axis=2)


def _counts_of(p2l: np.ndarray, num_logical: int) -> np.ndarray:
    """``[B, L]`` replicas of each expert; empty (``-1``) slots are not counted."""
    b = p2l.shape[0]
    flat = p2l + (np.arange(b) * num_logical)[:, None]
    flat = flat[p2l >= 0]
    return np.bincount(flat, minlength=b * num_logical).reshape(b, num_logical)


def _round_robin_pack(item_load: np.ndarray, num_gpus: int) -> np.ndarray:
    """Items ``[B, P]`` -> slot of each item ``[B, P]``, GPU-major with ``S = P / G`` per GPU.

    Items in descending load, ``G`` per round; in each round the heaviest item goes to the
    lightest GPU so far, the next to the next lightest, ...; round ``r`` fills slot ``r`` of each GPU.
    """
    b, p = item_load.shape
    s = p // num_gpus
    order = np.argsort(-item_load, axis=1, kind="stable")
    slot_of = np.empty((b, p), dtype=np.int64)
    loads = np.zeros((b, num_gpus))
    r = np.arange(b)[:, None]
    for rnd in range(s):
        items = order[:, rnd * num_gpus : (rnd + 1) * num_gpus]
        gpus = np.argsort(loads, axis=1, kind="stable")
        slot_of[r, items] = gpus * s + rnd
        loads[r, gpus] += item_load[r, items]
    return slot_of


def _refine_swaps(
    slot_load: np.ndarray,
    slot_expert: np.ndarray,
    *,
    max_iters: int,
    width: int,
    pinned: np.ndarray | None = None,
    node_of_gpu: np.ndarray | None = None,
) -> None:
    """Improve a packing in place by pairwise swaps. ``slot_load``/``slot_expert`` are ``[B, G, S]``.

    Each iteration, per layer: the heaviest GPU ``h`` and the ``width`` lightest GPUs ``g``; among
    all swaps of a replica on ``h`` with one on ``g`` that put no expert twice on a GPU, take the one
    that most lowers ``max(load_h, load_g)``; stop a layer when no swap lowers it. ``pinned``
    ``[B, G, S]`` marks replicas that may only move between GPUs of the same node (``node_of_gpu``).
    """
    b, g, s = slot_load.shape
    if g < 2:
        return
    width = max(1, min(width, g - 1))
    active = np.arange(b)
    loads = slot_load.sum(axis=2)
    for _ in range(max_iters):
        if active.size == 0:
            break
        la = loads[active]  # [A, G]
        h = la.argmax(axis=1)
        cand = np.argsort(la, axis=1, kind="stable")[:, :width]  # [A, K] the lightest GPUs
        ra = active[:, None]
        lh = la[np.arange(active.size), h]
        lg = la[np.arange(active.size)[:, None], cand]
        wh = slot_load[active, h]  # [A, S]
        wg = slot_load[ra, cand]  # [A, K, S]
        eh = slot_expert[active, h]
        eg = slot_expert[ra, cand]
        d = wh[:, None, :, None] - wg[:, :, None, :]  # [A, K, S_h, S_g]
        new_max = np.maximum(lh[:, None, None, None] - d, lg[:, :, None, None] + d)
        same = eh[:, None, :, None] == eg[:, :, None, :]
        bad = same.any(axis=3)[:, :, :, None] | same.any(axis=2)[:, :, None, :]
        bad |= (cand == h[:, None])[:, :, None, None]
        if pinned is not None:
            cross = node_of_gpu[cand] != node_of_gpu[h][:, None]  # [A, K]
            ph = pinned[active, h]  # [A, S]
            pg = pinned[ra, cand]  # [A, K, S]
            bad |= cross[:, :, None, None] & (ph[:, None, :, None] | pg[:, :, None, :])
        new_max = np.where(bad, np.inf, new_max).reshape(active.size, -1)
        best = new_max.argmin(axis=1)
        gain = lh - new_max[np.arange(active.size), best]
        ok = gain > 1e-12 * np.maximum(lh, 1.0)
        if not ok.any():
            break
        best, sel = best[ok], active[ok]
        k, rest = np.divmod(best, s * s)
        i, j = np.divmod(rest, s)
        gh, gg = h[ok], cand[ok][np.arange(sel.size), k]
        a, c = slot_load[sel, gh, i].copy(), slot_load[sel, gg, j].copy()
        slot_load[sel, gh, i], slot_load[sel, gg, j] = c, a
        ea, ec = slot_expert[sel, gh, i].copy(), slot_expert[sel, gg, j].copy()
        slot_expert[sel, gh, i], slot_expert[sel, gg, j] = ec, ea
        if pinned is not None:
            pa, pc = pinned[sel, gh, i].copy(), pinned[sel, gg, j].copy()
            pinned[sel, gh, i], pinned[sel, gg, j] = pc, pa
        loads[sel, gh] += c - a
        loads[sel, gg] += a - c
        active = sel


# --------------------------------------------------------------------------------------------
# default
# --------------------------------------------------------------------------------------------


def _balanced(load: np.ndarray, num_replicas: int, num_gpus: int, max_iters: int = 48, width: int = 8) -> np.ndarray:
    b, n = load.shape
    s = num_replicas // num_gpus
    # 1. replicate: counts [B, L] minimizing the largest load per replica
    _, counts = _replicate(load, num_replicas)
    # 2. the replicas [B, P] (expert, load) and a round-robin LPT packing onto GPUs
    item_expert = _expand_counts(counts)
    item_load = np.take_along_axis(load / counts, item_expert, axis=1)
    slot_of = _round_robin_pack(item_load, num_gpus)
    slot_expert = np.empty_like(item_expert)
    slot_load = np.empty_like(item_load)
    np.put_along_axis(slot_expert, slot_of, item_expert, axis=1)
    np.put_along_axis(slot_load, slot_of, item_load, axis=1)
    # 3. improve by swaps between the heaviest GPU and the lightest ones
    se, sl = slot_expert.reshape(b, num_gpus, s), slot_load.reshape(b, num_gpus, s)
    _refine_swaps(sl, se, max_iters=max_iters, width=width)
    return se.reshape(b, -1)


@register_policy("default")
def _default_policy(problem: Problem, *, max_swaps: int = 48, swap_width: int = 8) -> np.ndarray:
    """Global balancing over all GPUs (groups and nodes ignored); ``previous`` is ignored."""
    if max_swaps < 0 or swap_width < 1:
        raise InvalidOptionError(f"max_swaps must be >= 0 and swap_width >= 1, got {max_swaps}, {swap_width}")
    return _balanced(problem.load, problem.num_replicas, problem.num_gpus, max_swaps, swap_width)


# --------------------------------------------------------------------------------------------
# hierarchical (the reference) and hierarchical_spill
# --------------------------------------------------------------------------------------------


def _pack_groups_to_nodes(load: np.ndarray, num_groups: int, num_nodes: int) -> tuple[np.ndarray, np.ndarray]:
    """Step 1 of the reference: groups to nodes. Returns ``(log2mlog, mlog2log)`` ``[B, L]``, where
    "mlog" numbers experts node-major (node ``n`` owns mlog ids ``[n*L/N, (n+1)*L/N)``)."""
    b, n = load.shape
    group_size = n // num_groups
    groups_per_node = num_groups // num_nodes
    group_load = load.reshape(b, num_groups, group_size).sum(axis=2)
    pack, rank = _greedy_pack(group_load, num_nodes)
    base = (pack * groups_per_node + rank) * group_size  # [B, groups] first mlog id of each group
    log2mlog = (base[:, :, None] + np.arange(group_size)).reshape(b, n)
    return log2mlog, _inverse(log2mlog)


def _reference_hierarchical(load32: np.ndarray, num_phy: int, num_groups: int, num_nodes: int, num_gpus: int) -> np.ndarray:
    b, n = load32.shape
    s = num_phy // num_gpus
    # 1. pack groups to nodes
    log2mlog, mlog2log = _pack_groups_to_nodes(load32, num_groups, num_nodes)
    # 2. replicate within each node: rows are (layer, node), [B*N, L/N]
    node_load = np.take_along_axis(load32, mlog2log, axis=1).reshape(b * num_nodes, n // num_nodes)
    phy2mlog, mlog_count = _replicate(node_load, num_phy // num_nodes)
    # 3. pack each node's replicas to its GPUs; slot = GPU * S + arrival order on the GPU
    phy_load = np.take_along_axis(node_load / mlog_count.astype(np.float32), phy2mlog, axis=1)
    pack, rank = _greedy_pack(phy_load, num_gpus // num_nodes)
    pphy2phy = _inverse(pack * s + rank)
    pphy2mlog = np.take_along_axis(phy2mlog, pphy2phy, axis=1).reshape(b, num_nodes, -1)
    pphy2mlog = (pphy2mlog + (np.arange(num_nodes) * (n // num_nodes))[None, :, None]).reshape(b, num_phy)
    return np.take_along_axis(mlog2log, pphy2mlog, axis=1)


@register_policy("hierarchical")
def _hierarchical_policy(problem: Problem) -> np.ndarray:
    """The reference algorithm, float32 arithmetic and tie-breaking included."""
    load32 = problem.weight.to(torch.float32).numpy()
    if problem.num_groups % problem.num_nodes == 0:
        return _reference_hierarchical(load32, problem.num_replicas, problem.num_groups, problem.num_nodes, problem.num_gpus)
    return _reference_hierarchical(load32, problem.num_replicas, 1, 1, problem.num_gpus)


@register_policy("hierarchical_spill")
def _hierarchical_spill_policy(problem: Problem, *, max_swaps: int = 48, swap_width: int = 8) -> np.ndarray:
    """Groups packed to nodes; each expert's first replica on its group's node; redundant replicas
    anywhere. Falls back to ``default`` where the reference falls back (groups % nodes != 0)."""
    load, p, g, nn = problem.load, problem.num_replicas, problem.num_gpus, problem.num_nodes
    if problem.num_groups % nn or nn == 1:
        return _balanced(load, p, g, max_swaps, swap_width)
    b, n = load.shape
    s = p // g
    gpus_per_node = g // nn
    node_of_gpu = np.arange(g) // gpus_per_node
    # 1. pack groups to nodes: home node of each expert
    log2mlog, _ = _pack_groups_to_nodes(load, problem.num_groups, nn)
    home = log2mlog // (n // nn)  # [B, L]
    # 2. replicate globally
    _, counts = _replicate(load, p)
    item_expert = _expand_counts(counts)  # sorted by expert: the first replica of each is primary
    first = np.concatenate([np.ones((b, 1), bool), item_expert[:, 1:] != item_expert[:, :-1]], axis=1)
    item_load = np.take_along_axis(load / counts, item_expert, axis=1)
    item_home = np.where(first, np.take_along_axis(home, item_expert, axis=1), -1)
    # 3. pack: descending load, each replica to the lightest GPU that may take it (its home node
    #    if primary; any node with room beyond its remaining primaries if redundant; never a GPU
    #    already holding the expert)
    order = np.argsort(-item_load, axis=1, kind="stable")
    r = np.arange(b)
    loads = np.zeros((b, g))
    free = np.full((b, g), s, dtype=np.int64)
    primaries_left = np.full((b, nn), n // nn, dtype=np.int64)
    holds = np.zeros((b, g, n), dtype=bool)
    slot_expert = np.empty((b, g, s), dtype=np.int64)
    slot_load = np.empty((b, g, s))
    pinned = np.zeros((b, g, s), dtype=bool)
    for k in range(p):
        it = order[:, k]
        e, w, hn = item_expert[r, it], item_load[r, it], item_home[r, it]
        primary = hn >= 0
        node_free = free.reshape(b, nn, gpus_per_node).sum(axis=2)  # [B, N]
        spare = (node_free - primaries_left)[:, node_of_gpu] > 0  # redundant may use this GPU's node
        allowed = np.where(primary[:, None], node_of_gpu[None, :] == hn[:, None], spare) & (free > 0)
        pref = allowed & ~holds[r, :, e]
        allowed = np.where(pref.any(axis=1, keepdims=True), pref, allowed)
        gpu = np.where(allowed, loads, np.inf).argmin(axis=1)
        pos = s - free[r, gpu]
        slot_expert[r, gpu, pos] = e
        slot_load[r, gpu, pos] = w
        pinned[r, gpu, pos] = primary
        loads[r, gpu] += w
        free[r, gpu] -= 1
        holds[r, gpu, e] = True
        primaries_left[r[primary], hn[primary]] -= 1
    # 4. improve by swaps; a primary only swaps within its node
    _refine_swaps(slot_load, slot_expert, max_iters=max_swaps, width=swap_width, pinned=pinned, node_of_gpu=node_of_gpu)
    return slot_expert.reshape(b, p)


def home_node_share(
    physical_to_logical: torch.Tensor, load: torch.Tensor, num_groups: int, num_nodes: int, num_gpus: int
) -> torch.Tensor:
    """``[layers]``: share of the load served on each expert's home node, the node holding most
    of its group's replicas (1.0 for ``hierarchical``). Load splits evenly over replicas."""
    p2l = physical_to_logical.long().numpy()
    w = load.detach().cpu().to(torch.float64).numpy()
    b, n = w.shape
    p = p2l.shape[1]
    node_of_slot = np.arange(p) // (p // num_nodes)
    group_of = p2l // (n // num_groups)
    per_group_node = np.zeros((b, num_groups, num_nodes))
    np.add.at(per_group_node, (np.arange(b)[:, None], group_of, node_of_slot[None, :]), 1.0)
    home = per_group_node.argmax(axis=2)  # [B, groups]
    counts = _counts_of(p2l, n)
    per_slot = np.take_along_axis(w / np.maximum(counts, 1), p2l, axis=1)
    at_home = node_of_slot[None, :] == np.take_along_axis(home, group_of, axis=1)
    total = w.sum(axis=1)
    share = np.where(total > 0, (per_slot * at_home).sum(axis=1) / np.maximum(total, 1e-300), 1.0)
    return torch.from_numpy(share)


# --------------------------------------------------------------------------------------------
# migration_aware
# --------------------------------------------------------------------------------------------


def cross_gpu_copies(old_p2l: torch.Tensor, new_p2l: torch.Tensor, num_gpus: int, old_num_gpus: int | None = None) -> torch.Tensor:
    """``[layers]``: (GPU, expert) pairs held by the new placement and not by the old one on the
    same GPU, i.e. expert weights that must be copied onto a GPU. GPU ``g`` is the same GPU in
    both (GPUs beyond the old count are new and hold nothing)."""
    old = old_p2l.long().numpy()
    new = new_p2l.long().numpy()
    n = int(max(old.max(), new.max())) + 1
    old_g = old_num_gpus or num_gpus
    hold_old = _holds(old, old_g, n)
    hold_new = _holds(new, num_gpus, n)
    g = min(old_g, num_gpus)
    kept = (hold_new[:, :g] & hold_old[:, :g]).sum(axis=(1, 2))
    return torch.from_numpy(hold_new.sum(axis=(1, 2)) - kept)


def _holds(p2l: np.ndarray, num_gpus: int, num_logical: int) -> np.ndarray:
    """``[B, G, L]`` bool: GPU g holds expert e."""
    b, p = p2l.shape
    out = np.zeros((b, num_gpus, num_logical), dtype=bool)
    gpu = np.broadcast_to(np.arange(p) // (p // num_gpus), (b, p))
    out[np.arange(b)[:, None], gpu, p2l] = True
    return out


def _carry_over(prev: np.ndarray, num_gpus: int, slots: int, prev_gpus: int, mapping: np.ndarray) -> np.ndarray:
    """Previous experts at their (mapped) GPUs in the new layout; ``-1`` where a slot is empty."""
    b = prev.shape[0]
    out = np.full((b, num_gpus, slots), -1, dtype=np.int64)
    old = prev.reshape(b, prev_gpus, -1)
    keep = min(slots, old.shape[2])
    src = np.nonzero(mapping >= 0)[0]
    out[:, mapping[src], :keep] = old[:, src, :keep]
    return out.reshape(b, -1)


def _fill(p2l: np.ndarray, load: np.ndarray, num_gpus: int) -> np.ndarray:
    """Make a carried-over placement valid: every expert held, every slot filled.

    One slot per layer per step: a missing expert (heaviest first) or, when none is missing, the
    expert with the largest load per replica (greedy replication) goes to an empty slot on the
    lightest GPU that does not hold it; with no empty slot left, a missing expert takes the slot
    of the replica whose loss hurts least (an expert with >= 2 replicas, smallest load per
    remaining replica)."""
    b, p = p2l.shape
    n = load.shape[1]
    s = p // num_gpus
    r = np.arange(b)
    gpu_of_slot = np.arange(p) // s
    while True:
        empty = p2l < 0
        counts = _counts_of(p2l, n)
        missing = counts == 0
        todo = missing.any(axis=1) | empty.any(axis=1)
        if not todo.any():
            return p2l
        rows = r[todo]
        cnt = counts[rows]
        w = load[rows]
        has_missing = missing[rows].any(axis=1)
        e = np.where(has_missing, np.where(missing[rows], w, -1.0).argmax(axis=1), (w / np.maximum(cnt, 1)).argmax(axis=1))
        cur = p2l[rows]
        safe = np.where(cur < 0, 0, cur)
        per_slot = np.where(cur < 0, 0.0, np.take_along_axis(w / np.maximum(cnt, 1), safe, axis=1))
        gload = per_slot.reshape(rows.size, num_gpus, s).sum(axis=2)
        holds_e = (cur == e[:, None]).reshape(rows.size, num_gpus, s).any(axis=2)  # [R, G]
        emp = cur < 0
        # candidate empty slots: prefer a GPU not holding e, then the lightest
        score = gload[:, gpu_of_slot] + np.where(holds_e[:, gpu_of_slot], 1e300, 0.0)
        score = np.where(emp, score, np.inf)
        slot_empty = score.argmin(axis=1)
        # eviction candidates (only used when no empty slot is left)
        evict_cost = np.take_along_axis(w / np.maximum(cnt - 1, 1), safe, axis=1)
        evictable = (np.take_along_axis(cnt, safe, axis=1) >= 2) & ~emp & (cur != e[:, None])
        evict_cost = np.where(evictable, evict_cost + np.where(holds_e[:, gpu_of_slot], 1e300, 0.0), np.inf)
        slot_evict = evict_cost.argmin(axis=1)
        use_empty = emp.any(axis=1)
        slot = np.where(use_empty, slot_empty, slot_evict)
        p2l[rows, slot] = e


def _matched_default(problem: Problem, carried: np.ndarray) -> np.ndarray:
    """``default``'s placement with its GPUs permuted to keep the most experts where they are."""
    b = problem.num_layers
    g, s, n = problem.num_gpus, problem.slots_per_gpu, problem.num_logical
    fresh = _balanced(problem.load, problem.num_replicas, g).reshape(b, g, s)
    hold_new = _holds(fresh.reshape(b, -1), g, n).astype(np.float32)
    hold_old = _holds(np.where(carried < 0, 0, carried), g, n) & (carried >= 0).reshape(b, g, s).any(axis=2)[:, :, None]
    overlap = np.einsum("bge,bhe->bgh", hold_new, hold_old.astype(np.float32))  # new GPU g vs old GPU h
    target = np.empty((b, g), dtype=np.int64)
    r = np.arange(b)
    for _ in range(g):  # greedy matching, the largest overlap first
        flat = overlap.reshape(b, -1).argmax(axis=1)
        gn, go = np.divmod(flat, g)
        target[r, gn] = go
        overlap[r, gn, :] = -1
        overlap[r, :, go] = -1
    out = np.empty_like(fresh)
    out[r[:, None], target] = fresh
    return out.reshape(b, -1)


def _copies_vs(carried: np.ndarray, p2l: np.ndarray, num_gpus: int, n: int) -> np.ndarray:
    old = _holds(np.where(carried < 0, 0, carried), num_gpus, n) & _holds_mask(carried, num_gpus, n)
    new = _holds(p2l, num_gpus, n)
    return (new & ~old).sum(axis=(1, 2))


def _holds_mask(p2l: np.ndarray, num_gpus: int, n: int) -> np.ndarray:
    """Like ``_holds`` but ignoring empty (-1) slots."""
    b, p = p2l.shape
    out = np.zeros((b, num_gpus, n), dtype=bool)
    gpu = np.broadcast_to(np.arange(p) // (p // num_gpus), (b, p))
    ok = p2l >= 0
    out[np.nonzero(ok)[0], gpu[ok], p2l[ok]] = True
    return out


@register_policy("migration_aware")
def _migration_aware_policy(
    problem: Problem,
    *,
    tolerance: float = 0.01,
    max_copies: int | None = None,
    previous_num_gpus: int | None = None,
    rank_mapping: Mapping[int, int] | Sequence[int] | None = None,
) -> np.ndarray:
    """Keep experts where they are unless moving them buys balance (see the module docstring)."""
    if not (0.0 <= float(tolerance) <= 1.0):
        raise InvalidOptionError(f"tolerance must be in [0, 1], got {tolerance}")
    if max_copies is not None and (isinstance(max_copies, bool) or int(max_copies) < 0):
        raise InvalidOptionError(f"max_copies must be >= 0 or None, got {max_copies}")
    load, g, s, n = problem.load, problem.num_gpus, problem.slots_per_gpu, problem.num_logical
    b, p = problem.num_layers, problem.num_replicas
    if problem.previous is None:
        return _balanced(load, p, g)
    prev = problem.previous
    p_old = prev.shape[1]
    # 1. the previous layout's GPU count and where each old GPU went
    if previous_num_gpus is None:
        if p_old == p:
            previous_num_gpus = g
        elif p_old % s == 0:
            previous_num_gpus = p_old // s  # the same slots per GPU, as after a scale
        else:
            raise InvalidPreviousError(
                f"previous has {p_old} slots, not a multiple of the {s} slots per GPU; pass previous_num_gpus"
            )
    prev_gpus = _positive_int("previous_num_gpus", previous_num_gpus)
    if p_old % prev_gpus:
        raise InvalidPreviousError(f"previous has {p_old} slots, not a multiple of previous_num_gpus={prev_gpus}")
    mapping = _rank_mapping(rank_mapping, prev_gpus, g)
    carried = _carry_over(prev, g, s, prev_gpus, mapping)
    # 2. make it valid (lost experts, new slots): unavoidable copies
    cur = _fill(carried.copy(), load, g)
    # 3. targets: what default reaches, less the tolerance
    mean = load.sum(axis=1) / g
    fresh = _matched_default(problem, carried)
    peak_default = _gpu_loads(fresh, load, g).max(axis=1)
    bal_default = np.where(peak_default > 0, mean / np.maximum(peak_default, 1e-300), 1.0)
    target_peak = mean / np.maximum(bal_default - tolerance, 1e-9)
    budget = np.full(b, np.iinfo(np.int64).max if max_copies is None else int(max_copies), dtype=np.int64)
    spent = _copies_vs(carried, cur, g, n)
    # 4. local search: one move per layer per step, the largest peak drop per copy
    cur = _improve(cur, load, g, target_peak, budget - spent)
    # 5. a layer still short of its target takes default's placement (GPU-matched) when that
    #    is better and fits the budget
    peak_cur = _gpu_loads(cur, load, g).max(axis=1)
    fresh_copies = _copies_vs(carried, fresh, g, n)
    swap = (peak_cur > target_peak * (1 + 1e-12)) & (peak_default < peak_cur) & (fresh_copies <= budget)
    cur[swap] = fresh[swap]
    return cur


def _rank_mapping(rank_mapping, prev_gpus: int, num_gpus: int) -> np.ndarray:
    """Old GPU -> new GPU (``-1``: gone). Default: GPU ``g`` stays GPU ``g`` while it exists."""
    if rank_mapping is None:
        m = np.arange(prev_gpus)
        return np.where(m < num_gpus, m, -1)
    if isinstance(rank_mapping, Mapping):
        m = np.full(prev_gpus, -1, dtype=np.int64)
        for old, new in rank_mapping.items():
            if not 0 <= int(old) < prev_gpus:
                raise InvalidOptionError(f"rank_mapping: old rank {old} is outside [0, {prev_gpus})")
            m[int(old)] = int(new)
    else:
        m = np.asarray(list(rank_mapping), dtype=np.int64)
        if m.shape != (prev_gpus,):
            raise InvalidOptionError(f"rank_mapping must have one entry per previous GPU ({prev_gpus}), got {m.shape[0]}")
    kept = m[m >= 0]
    if (m < -1).any() or (kept >= num_gpus).any() or np.unique(kept).size != kept.size:
        raise InvalidOptionError(f"rank_mapping must map old ranks to distinct new ranks in [0, {num_gpus}) or -1, got {m.tolist()}")
    return m


def _improve(p2l: np.ndarray, load: np.ndarray, num_gpus: int, target_peak: np.ndarray, budget: np.ndarray, max_steps: int | None = None) -> np.ndarray:
    """Greedy moves from ``p2l`` until each layer's peak is at most ``target_peak``.

    Moves, evaluated for the heaviest GPU ``h`` of each layer:
    - replace (1 copy): a slot on another GPU holding expert ``f`` with >= 2 replicas takes an
      expert ``e`` of ``h`` (not already on that GPU): ``e`` gains a replica, ``f`` loses one;
    - swap (2 copies): a replica on ``h`` and one on another GPU trade places.
    The best move minimizes the largest new load among the GPUs it touches (conservatively
    estimated), per copy spent. A move is kept only if, recomputed exactly, every GPU it touched
    ends below the old peak; otherwise the layer stops.
    """
    b, p = p2l.shape
    n = load.shape[1]
    g = num_gpus
    s = p // g
    gpu_of_slot = np.arange(p) // s
    active = np.arange(b)
    budget = budget.copy()
    steps = max_steps if max_steps is not None else 4 * p
    for _ in range(steps):
        if active.size == 0:
            break
        a = active.size
        ra = np.arange(a)
        cur = p2l[active]
        w = load[active]
        cnt = _counts_of(cur, n)
        per = w / cnt  # per-replica load of each expert
        slot_load = np.take_along_axis(per, cur, axis=1)
        gl = slot_load.reshape(a, g, s).sum(axis=2)
        h = gl.argmax(axis=1)
        peak = gl[ra, h]
        need = (peak > target_peak[active] * (1 + 1e-12)) & (budget[active] >= 1)
        if not need.any():
            break
        holds = _holds(cur, g, n)  # [A, G, L]
        eh = cur.reshape(a, g, s)[ra, h]  # [A, S] experts on h
        ce = np.take_along_axis(cnt, eh, axis=1)
        we = np.take_along_axis(w, eh, axis=1)
        # replace: e (on h) -> slot q (on GPU gq != h, holding f with cnt >= 2, gq not holding e)
        h_new = peak[:, None] - we / ce + we / (ce + 1)  # [A, S] (one replica of e on h)
        f = cur  # [A, P]
        cf = np.take_along_axis(cnt, f, axis=1)
        wf = np.take_along_axis(w, f, axis=1)
        delta_f = np.where(cf >= 2, wf / np.maximum(cf - 1, 1) - wf / cf, np.inf)  # rise of f's other holders
        # the highest load among f's holders after the rise (conservative: includes slot q's GPU)
        holder_peak = np.where(holds, gl[:, :, None], -np.inf).max(axis=1)  # [A, L]
        f_peak = np.take_along_axis(holder_peak, f, axis=1) + delta_f  # [A, P]
        gq_load = gl[:, gpu_of_slot] - slot_load  # [A, P] the slot's GPU without f's replica
        q_new = gq_load[:, None, :] + (we / (ce + 1))[:, :, None]  # [A, S, P]
        e_on_q = holds[ra[:, None, None], gpu_of_slot[None, None, :], eh[:, :, None]]  # [A, S, P]
        bad = e_on_q | (gpu_of_slot[None, None, :] == h[:, None, None]) | (cf < 2)[:, None, :]
        est_r = np.maximum(np.maximum(h_new[:, :, None], q_new), f_peak[:, None, :])
        est_r = np.where(bad, np.inf, est_r).reshape(a, -1)
        best_r = est_r.argmin(axis=1)
        gain_r = peak - est_r[ra, best_r]
        # swap: e (on h, slot i) <-> f (on GPU gj, slot j)
        sl3 = slot_load.reshape(a, g, s)
        e3 = cur.reshape(a, g, s)
        wi = sl3[ra, h]  # [A, S]
        d = wi[:, :, None, None] - sl3[:, None, :, :]  # [A, S_i, G, S_j]
        est_s = np.maximum(peak[:, None, None, None] - d, gl[:, None, :, None] + d)
        f_on_h = holds[ra[:, None, None], h[:, None, None], e3]  # [A, G, S] expert j already on h
        bad_s = holds[ra[:, None, None], np.arange(g)[None, None, :], eh[:, :, None]][:, :, :, None]  # e_i on GPU j [A,S,G,1]
        bad_s = bad_s | f_on_h[:, None, :, :] | (np.arange(g)[None, None, :, None] == h[:, None, None, None])
        est_s = np.where(bad_s, np.inf, est_s).reshape(a, -1)
        best_s = est_s.argmin(axis=1)
        gain_s = np.where(budget[active] >= 2, peak - est_s[ra, best_s], -np.inf)
        use_swap = gain_s / 2 > gain_r
        gain = np.where(use_swap, gain_s, gain_r)
        go = need & (gain > 1e-12 * np.maximum(peak, 1.0))
        if not go.any():
            break
        new = cur.copy()
        rs = ra[go & ~use_swap]
        if rs.size:
            i, q = np.divmod(best_r[rs], p)
            new[rs, q] = eh[rs, i]
        sw = ra[go & use_swap]
        if sw.size:
            i, rest = np.divmod(best_s[sw], g * s)
            gj, j = np.divmod(rest, s)
            si, sj = h[sw] * s + i, gj * s + j
            vi, vj = new[sw, si].copy(), new[sw, sj].copy()
            new[sw, si], new[sw, sj] = vj, vi
        # exact check: every GPU whose load changed must end below the old peak
        gl_new = _gpu_loads(new, w, g)
        changed = np.abs(gl_new - gl) > 1e-12 * np.maximum(peak[:, None], 1.0)
        ok = go & (np.where(changed, gl_new, -np.inf).max(axis=1) < peak * (1 - 1e-12)) & changed[ra, h]
        p2l[active[ok]] = new[ok]
        budget[active[ok & use_swap]] -= 2
        budget[active[ok & ~use_swap]] -= 1
        active = active[ok]
    return p2l
