"""Planning one MoE layer's expert move: who sends what to whom, what is copied locally, what is reloaded.

The planner is pure and deterministic: every rank of the executing group calls
:func:`plan_layer` with the same inputs and gets the same global plan, then executes its own
part (:meth:`LayerPlan.for_rank`). No communication is needed to agree on the plan.

Vocabulary
----------
- *old rank* ``r`` holds old physical slots ``[r*S_old, (r+1)*S_old)`` of ``old_row``;
  *new rank* ``n`` holds new slots ``[n*S_new, (n+1)*S_new)`` of ``new_row``.
- The *executing group* is the process group the transfer runs on. A *group rank* ``g`` is a
  worker of that group. ``old_holder[r]`` is the group rank that has old rank ``r``'s weights
  (``-1``: lost, e.g. the rank died); ``new_holder[n]`` is the group rank that becomes new rank ``n``.
- Old *local* slot ``i`` of group rank ``g`` indexes the worker's old weights (``[S_old, ...]``);
  new local slot ``j`` indexes its staging buffer / new weights (``[S_new, ...]``).

One formulation covers every case:

============================  =============================  ======================================
case                          old_holder                     new_holder
============================  =============================  ======================================
rebalance                     identity                       identity
scale down, run on old group  identity                       ``new_holder[n]`` = old rank becoming n
scale up, run on new group    ``old_holder[r]`` = new rank   identity (fresh workers: no old rank)
failure                       ``-1`` for each lost rank      as above
============================  =============================  ======================================

:func:`holders_from_mapping` builds the two tables from a rank mapping.

Rules the plan follows
----------------------
1. *Keep*: a new slot whose worker held the same expert in the same local slot index is not
   touched (``RankPlan.keeps``).
2. *Local copy*: an expert the receiving worker already holds in one of its old slots is
   copied from there (lowest such old slot), never over the network.
3. *Transfer*: otherwise the expert is received once per receiving worker (``Transfer``), into
   every new slot that needs it (``dst_slots``; the executor receives into the first and fans
   out locally). The sender is the live holder with the fewest sends so far in this layer
   (ties: lowest group rank); its source slot is its lowest old slot holding the expert.
   With ``hosts`` (the host of every executing group rank, identical on every rank) a holder
   on the receiver's host comes first: same host, then fewest sends, then lowest rank.
4. *Reload*: an expert that no live worker holds comes from the canonical checkpoint
   (``RankPlan.reloads``), unless ``allow_reload=False`` (then :class:`PlanError`).
5. Workers without a new rank (leaving) only send; fresh workers (no old rank) only receive,
   copy locally among their new slots, or reload.

New slots are visited in order (new rank, local slot); the global transfer list is in the
order transfers were first needed. Its positions (``Transfer.index``) are what the executor
chunks on, identically on every rank.

Migration rounds
----------------
:func:`migration_rounds` splits the transfer list into *rounds* in which every group rank
sends to at most one peer and receives from at most one peer (a proper edge colouring of
the bipartite sender/receiver multigraph, one edge per transfer). It colours the transfers
in list order and repairs conflicts along an alternating path (Kőnig's construction), so it
needs exactly as many rounds as the busiest rank has transfers (sends or receives, whichever
is larger): the fewest possible. It is pure: every rank derives the same rounds from the
same list. Every plan carries them (``LayerPlan.rounds``, ``RankPlan.rounds``); the executor
uses them when ``enable_migration_batching`` is on.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Literal, TypedDict

import torch

__all__ = [
    "LayerPlan",
    "PlanError",
    "RankPlan",
    "Reload",
    "Transfer",
    "holders_from_mapping",
    "migration_rounds",
    "plan_layer",
    "prestage_layers",
]


class _RankParts(TypedDict):
    """One rank's part of a plan while it is being built (frozen into a :class:`RankPlan`)."""

    copies: list[tuple[int, int]]  # (old local slot, new local slot)
    keeps: list[int]  # new local slots whose content is unchanged
    reloads: dict[int, list[int]]  # expert -> new local slots reloaded with it


class PlanError(ValueError):
    """Inputs no plan can be made from (inconsistent rows, layouts, holders or mappings)."""


@dataclass(frozen=True)
class Transfer:
    """One expert sent from one worker to another (group ranks).

    ``src_slot`` is an old local slot on ``src``; ``dst_slots`` are new local slots on ``dst``
    (ascending, at least one). ``index`` is the position in the layer's global transfer list.
    """

    src: int
    src_slot: int
    dst: int
    expert: int
    dst_slots: tuple[int, ...]
    index: int = 0


@dataclass(frozen=True)
class Reload:
    """An expert no live worker holds: load it from the checkpoint into ``slots`` (new local)."""

    expert: int
    slots: tuple[int, ...]


@dataclass(frozen=True)
class RankPlan:
    """One group rank's part of a :class:`LayerPlan`.

    ``old_rank``/``new_rank`` are ``None`` when the worker has no old weights (fresh or its
    weights were lost) / no new slots (leaving or a bystander). ``num_transfers`` is the size of
    the *global* transfer list: the executor needs it to chunk identically on every rank.
    """

    group_rank: int
    old_rank: int | None
    new_rank: int | None
    num_old_slots: int
    num_new_slots: int
    sends: tuple[Transfer, ...]
    recvs: tuple[Transfer, ...]
    local_copies: tuple[tuple[int, int], ...]  # (old local slot, new local slot)
    keeps: tuple[int, ...]  # new local slots whose content is unchanged
    reloads: tuple[Reload, ...]
    num_transfers: int
    #: the layer's migration rounds (global transfer indices, see :func:`migration_rounds`)
    rounds: tuple[tuple[int, ...], ...] = ()

    @property
    def changed_slots(self) -> tuple[int, ...]:
        """New local slots the plan writes (every new slot that is not kept)."""
        kept = set(self.keeps)
        return tuple(j for j in range(self.num_new_slots) if j not in kept)

    @property
    def is_idle(self) -> bool:
        """Nothing to send, receive, copy or reload."""
        return not (self.sends or self.recvs or self.local_copies or self.reloads)


@dataclass(frozen=True)
class LayerPlan:
    """The global plan for one layer. Immutable; equal inputs give equal plans."""

    old_row: tuple[int, ...]
    new_row: tuple[int, ...]
    old_slots_per_rank: int
    new_slots_per_rank: int
    old_holder: tuple[int, ...]
    new_holder: tuple[int, ...]
    transfers: tuple[Transfer, ...]
    _ranks: dict[int, RankPlan] = field(repr=False, compare=False)
    #: :func:`migration_rounds` of ``transfers`` (a function of them: not compared)
    rounds: tuple[tuple[int, ...], ...] = field(default=(), repr=False, compare=False)

    @property
    def num_transfers(self) -> int:
        return len(self.transfers)

    @property
    def changes_anything(self) -> bool:
        """Some rank sends, receives, copies or reloads an expert in this layer."""
        return not all(part.is_idle for part in self._ranks.values())

    @property
    def group_ranks(self) -> tuple[int, ...]:
        """Every group rank with a part in the plan (old or new holder), ascending."""
        return tuple(sorted(self._ranks))

    @property
    def num_local_copies(self) -> int:
        return sum(len(p.local_copies) for p in self._ranks.values())

    @property
    def num_reloads(self) -> int:
        """Reloaded (worker, expert) pairs (each loaded once, fanned out to its slots)."""
        return sum(len(p.reloads) for p in self._ranks.values())

    @property
    def num_kept(self) -> int:
        return sum(len(p.keeps) for p in self._ranks.values())

    def bytes_moved(self, expert_bytes: int) -> int:
        """Bytes over the network: one expert's bytes per transfer."""
        return self.num_transfers * int(expert_bytes)

    def sends_per_rank(self) -> dict[int, int]:
        return {g: len(p.sends) for g, p in sorted(self._ranks.items())}

    def for_rank(self, group_rank: int) -> RankPlan:
        """The part of ``group_rank``; an empty part for a group rank the plan does not involve."""
        plan = self._ranks.get(group_rank)
        if plan is None:
            return RankPlan(group_rank, None, None, 0, 0, (), (), (), (), (), self.num_transfers, self.rounds)
        return plan


def _as_row(row: torch.Tensor | Sequence[int], name: str) -> tuple[int, ...]:
    if isinstance(row, torch.Tensor):
        if row.dim() != 1:
            raise PlanError(f"{name} must be 1-D, got shape {tuple(row.shape)}")
        if row.dtype.is_floating_point or row.dtype.is_complex or row.dtype == torch.bool:
            raise PlanError(f"{name} must hold integers, got {row.dtype}")
        values = tuple(int(v) for v in row.tolist())
    else:
        try:
            values = tuple(int(v) for v in row)
        except (TypeError, ValueError) as exc:
            raise PlanError(f"{name} must be a sequence of integers: {exc}") from None
    if not values:
        raise PlanError(f"{name} is empty")
    bad = [v for v in values if v < 0]
    if bad:
        raise PlanError(f"{name} holds negative expert ids {sorted(set(bad))[:5]}")
    return values


def _ranks_of(row: tuple[int, ...], slots_per_rank: int, name: str) -> int:
    if isinstance(slots_per_rank, bool) or not isinstance(slots_per_rank, int) or slots_per_rank < 1:
        raise PlanError(f"{name} slots per rank must be a positive int, got {slots_per_rank!r}")
    if len(row) % slots_per_rank:
        raise PlanError(f"{name} row has {len(row)} slots, not divisible by {slots_per_rank} slots per rank")
    return len(row) // slots_per_rank


def _as_holders(holders: Iterable[int] | None, count: int, name: str, allow_lost: bool) -> tuple[int, ...]:
    if holders is None:
        return tuple(range(count))
    values = tuple(int(h) for h in holders)
    if len(values) != count:
        raise PlanError(f"{name} has {len(values)} entries, expected one per {name.split('_')[0]} rank ({count})")
    low = -1 if allow_lost else 0
    bad = [h for h in values if h < low]
    if bad:
        allowed = ">= 0 or -1 (lost)" if allow_lost else ">= 0"
        raise PlanError(f"{name} entries must be {allowed}, got {bad[:5]}")
    live = [h for h in values if h >= 0]
    if len(set(live)) != len(live):
        dup = sorted({h for h in live if live.count(h) > 1})
        raise PlanError(f"{name} names group ranks {dup} more than once")
    return values


def plan_layer(
    old_row: torch.Tensor | Sequence[int],
    new_row: torch.Tensor | Sequence[int],
    old_slots_per_rank: int,
    new_slots_per_rank: int | None = None,
    old_holder: Sequence[int] | None = None,
    new_holder: Sequence[int] | None = None,
    *,
    allow_reload: bool = True,
    hosts: Sequence[str] | None = None,
) -> LayerPlan:
    """Plan one layer's move from ``old_row`` (``[P_old]``) to ``new_row`` (``[P_new]``).

    ``new_slots_per_rank`` defaults to ``old_slots_per_rank``; ``old_holder``/``new_holder``
    default to the identity (a rebalance on the same group). ``hosts[g]`` is the host of
    executing group rank ``g`` (one entry per group rank the holders name, or more): senders on
    the receiver's host are preferred; every rank must pass the same list. See the module
    docstring. Raises :class:`PlanError` on inconsistent inputs.
    """
    old = _as_row(old_row, "old_row")
    new = _as_row(new_row, "new_row")
    s_old = old_slots_per_rank
    s_new = old_slots_per_rank if new_slots_per_rank is None else new_slots_per_rank
    n_old = _ranks_of(old, s_old, "old")
    n_new = _ranks_of(new, s_new, "new")
    old_h = _as_holders(old_holder, n_old, "old_holder", allow_lost=True)
    new_h = _as_holders(new_holder, n_new, "new_holder", allow_lost=False)
    host_of = _as_hosts(hosts, old_h, new_h)
    # 1. what each live worker holds in its old slots
    held = _Holdings.of(old, s_old, old_h)
    if not allow_reload:
        missing = sorted({e for e in new if e not in held.holders_of})
        if missing:
            lost = [r for r, g in enumerate(old_h) if g < 0]
            raise PlanError(
                f"experts {missing[:10]} of new_row are held by no live worker "
                f"(lost old ranks: {lost}) and reload is not allowed"
            )
    # 2. each new slot: kept, copied locally, received from a holder, or reloaded
    transfers, per_rank = _assign_slots(new, s_old, s_new, new_h, held, host_of)
    # 3. freeze: the transfers in order, their rounds, and every rank's part
    frozen, ranks, rounds = _freeze(transfers, per_rank, held, new_h, s_old, s_new)
    return LayerPlan(old, new, s_old, s_new, old_h, new_h, frozen, ranks, rounds)


def _freeze(transfers: list[dict], per_rank: dict[int, _RankParts], held: _Holdings, new_h: tuple[int, ...],
            s_old: int, s_new: int) -> tuple[tuple[Transfer, ...], dict[int, RankPlan], tuple[tuple[int, ...], ...]]:
    """Step 3 of :func:`plan_layer`: the transfers in planning order, their rounds, and each rank's part."""
    frozen = tuple(
        Transfer(t["src"], t["src_slot"], t["dst"], t["expert"], tuple(t["dst_slots"]), index)
        for index, t in enumerate(transfers)
    )
    rounds = migration_rounds(frozen)
    new_rank_of = {g: n for n, g in enumerate(new_h)}
    ranks: dict[int, RankPlan] = {}
    for g in sorted(set(held.old_rank_of) | set(new_rank_of)):
        mine = per_rank.get(g, {"copies": [], "keeps": [], "reloads": {}})
        ranks[g] = RankPlan(
            group_rank=g,
            old_rank=held.old_rank_of.get(g),
            new_rank=new_rank_of.get(g),
            num_old_slots=s_old if g in held.old_rank_of else 0,
            num_new_slots=s_new if g in new_rank_of else 0,
            sends=tuple(t for t in frozen if t.src == g),
            recvs=tuple(t for t in frozen if t.dst == g),
            local_copies=tuple(mine["copies"]),
            keeps=tuple(mine["keeps"]),
            reloads=tuple(Reload(e, tuple(slots)) for e, slots in mine["reloads"].items()),
            num_transfers=len(frozen),
            rounds=rounds,
        )
    return frozen, ranks, rounds


@dataclass(frozen=True)
class _Holdings:
    """What the live workers of the old layout hold (step 1 of :func:`plan_layer`)."""

    old_rank_of: dict[int, int]  # group rank -> old rank
    old_slots_of: dict[int, tuple[int, ...]]  # group rank -> its old slots' experts
    first_slot: dict[int, dict[int, int]]  # group rank -> expert -> lowest old local slot
    holders_of: dict[int, list[int]]  # expert -> live group ranks holding it, ascending

    @staticmethod
    def of(old: tuple[int, ...], s_old: int, old_h: tuple[int, ...]) -> _Holdings:
        old_rank_of = {g: r for r, g in enumerate(old_h) if g >= 0}
        old_slots_of = {g: old[r * s_old : (r + 1) * s_old] for g, r in old_rank_of.items()}
        first_slot: dict[int, dict[int, int]] = {}
        holders_of: dict[int, list[int]] = {}
        for g in sorted(old_slots_of):
            seen: dict[int, int] = {}
            for i, e in enumerate(old_slots_of[g]):
                seen.setdefault(e, i)
            first_slot[g] = seen
            for e in seen:
                holders_of.setdefault(e, []).append(g)
        return _Holdings(old_rank_of, old_slots_of, first_slot, holders_of)


def _assign_slots(new: tuple[int, ...], s_old: int, s_new: int, new_h: tuple[int, ...], held: _Holdings,
                  host_of: tuple[str, ...] | None) -> tuple[list[dict], dict[int, _RankParts]]:
    """Step 2 of :func:`plan_layer`: every new slot, in order, is kept (same expert in the same
    slot), copied from another local slot, added to a transfer already planned to that rank,
    received from the least-used holder (same host first), or reloaded."""
    send_count: dict[int, int] = {g: 0 for g in held.old_slots_of}
    transfers: list[dict] = []  # mutable while planning
    recv_of: dict[tuple[int, int], dict] = {}  # (dst, expert) -> transfer being built
    per_rank: dict[int, _RankParts] = {}
    for n, g in enumerate(new_h):
        mine = per_rank.setdefault(g, {"copies": [], "keeps": [], "reloads": {}})
        local = held.first_slot.get(g, {})
        own_old = held.old_slots_of.get(g)
        for j in range(s_new):
            e = new[n * s_new + j]
            if own_old is not None and j < s_old and own_old[j] == e:
                mine["keeps"].append(j)
            elif e in local:
                mine["copies"].append((local[e], j))
            elif (g, e) in recv_of:
                recv_of[(g, e)]["dst_slots"].append(j)
            elif e in held.holders_of:
                if host_of is None:
                    src = min(held.holders_of[e], key=lambda h: (send_count[h], h))
                else:
                    src = min(held.holders_of[e], key=lambda h: (host_of[h] != host_of[g], send_count[h], h))
                send_count[src] += 1
                t = {"src": src, "src_slot": held.first_slot[src][e], "dst": g, "expert": e, "dst_slots": [j]}
                recv_of[(g, e)] = t
                transfers.append(t)
            else:
                mine["reloads"].setdefault(e, []).append(j)
    return transfers, per_rank


def _as_hosts(hosts: Sequence[str] | None, old_h: tuple[int, ...], new_h: tuple[int, ...]) -> tuple[str, ...] | None:
    if hosts is None:
        return None
    if isinstance(hosts, str):
        raise PlanError("hosts must be a sequence of host names (one per group rank), not a string")
    values = tuple(str(h) for h in hosts)
    needed = max([*old_h, *new_h]) + 1
    if len(values) < needed:
        raise PlanError(f"hosts names {len(values)} group ranks, but the holders name group ranks up to {needed - 1}")
    return values


def migration_rounds(transfers: Sequence[Transfer]) -> tuple[tuple[int, ...], ...]:
    """The transfers (by ``Transfer.index``) in rounds where every group rank sends to at most
    one peer and receives from at most one peer; rounds in order, each ascending.

    A proper edge colouring of the bipartite multigraph (senders on one side, receivers on the
    other, one edge per transfer), built in list order: a transfer takes the lowest colour free
    at its sender (``a``); when ``a`` is taken at its receiver, the path from the receiver that
    alternates ``a`` and the receiver's lowest free colour ``b`` has the two swapped (it cannot
    reach the sender: the sender has no ``a`` edge and the graph is bipartite), which frees
    ``a`` there. That uses exactly the maximum degree of colours (Kőnig): as many rounds as the
    busiest rank has sends or receives. Pure and deterministic.
    """
    # node: (0, sender group rank) or (1, receiver group rank) -> colour -> position in ``transfers``
    at: dict[tuple[int, int], dict[int, int]] = {}
    colour: list[int] = []

    def ends(k: int) -> tuple[tuple[int, int], tuple[int, int]]:
        return (0, transfers[k].src), (1, transfers[k].dst)

    def lowest_free(used: dict[int, int]) -> int:
        c = 0
        while c in used:
            c += 1
        return c

    for k in range(len(transfers)):
        u, v = ends(k)
        at_u, at_v = at.setdefault(u, {}), at.setdefault(v, {})
        a = lowest_free(at_u)
        if a in at_v:
            b = lowest_free(at_v)
            path: list[int] = []
            node, cur, other = v, a, b
            while cur in at[node]:
                e = at[node][cur]
                path.append(e)
                x, y = ends(e)
                node = y if node == x else x
                cur, other = other, cur
            for e in path:  # swap a <-> b along the path: take every edge out, then put it back
                for n in ends(e):
                    del at[n][colour[e]]
            for e in path:
                colour[e] = b if colour[e] == a else a
                for n in ends(e):
                    at[n][colour[e]] = e
        colour.append(a)
        at_u[a] = k
        at_v[a] = k
    rounds: dict[int, list[int]] = {}
    for k, c in enumerate(colour):
        rounds.setdefault(c, []).append(transfers[k].index)
    return tuple(tuple(sorted(rounds[c])) for c in sorted(rounds))


def holders_from_mapping(
    rank_mapping: Sequence[int],
    num_new_ranks: int,
    execute_on: Literal["old", "new"],
    lost: Iterable[int] = frozenset(),
) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """``(old_holder, new_holder)`` for a rank mapping, executed on the old or the new group.

    ``rank_mapping[old_rank]`` is the new rank the old rank becomes, ``-1`` if it leaves.
    ``lost`` are old ranks whose weights are gone (dead). Group ranks are those of the
    executing group: old ranks for ``execute_on="old"``, new ranks for ``"new"``.

    - ``"old"``: every new rank must be the image of a live old rank (no fresh workers on
      the old group); leaving ranks still send.
    - ``"new"``: new ranks not the image of any old rank are fresh workers (no old
      weights); leaving old ranks are not in the new group, so they cannot send
      (their weights count as lost for this plan).
    """
    mapping = tuple(int(m) for m in rank_mapping)
    if isinstance(num_new_ranks, bool) or not isinstance(num_new_ranks, int) or num_new_ranks < 1:
        raise PlanError(f"num_new_ranks must be a positive int, got {num_new_ranks!r}")
    if not mapping:
        raise PlanError("rank_mapping is empty")
    if execute_on not in ("old", "new"):
        raise PlanError(f"execute_on must be 'old' or 'new', got {execute_on!r}")
    bad = [(r, m) for r, m in enumerate(mapping) if not -1 <= m < num_new_ranks]
    if bad:
        raise PlanError(f"rank_mapping entries must be -1 or in [0, {num_new_ranks}), got (old, new) {bad[:5]}")
    targets = [m for m in mapping if m >= 0]
    if len(set(targets)) != len(targets):
        dup = sorted({m for m in targets if targets.count(m) > 1})
        raise PlanError(f"rank_mapping maps several old ranks onto new ranks {dup}")
    lost_set = {int(r) for r in lost}
    out = sorted(r for r in lost_set if not 0 <= r < len(mapping))
    if out:
        raise PlanError(f"lost ranks {out} are outside [0, {len(mapping)})")

    if execute_on == "old":
        old_holder = tuple(-1 if r in lost_set else r for r in range(len(mapping)))
        new_holder: list[int] = [-1] * num_new_ranks
        for r, m in enumerate(mapping):
            if m >= 0:
                if r in lost_set:
                    raise PlanError(
                        f"old rank {r} is lost but maps to new rank {m}: a dead rank cannot receive "
                        "on the old group (execute on the new group with a replacement worker)"
                    )
                new_holder[m] = r
        fresh = [n for n, h in enumerate(new_holder) if h < 0]
        if fresh:
            raise PlanError(
                f"new ranks {fresh} are not the image of any old rank: fresh workers are not in the "
                "old group (execute on the new group)"
            )
        return old_holder, tuple(new_holder)
    old_holder = tuple(-1 if (r in lost_set or m < 0) else m for r, m in enumerate(mapping))
    return old_holder, tuple(range(num_new_ranks))


def prestage_layers(plans: Sequence[LayerPlan], expert_bytes: int, budget_bytes: int,
                    bounded: Iterable[int]) -> tuple[int, ...]:
    """The layers a rescale prepares ahead of its pause (pure: every rank gets the same answer
    from the same plans).

    Every layer that changes a slot anywhere, in layer order, first fit: a layer is taken when
    every rank of ``bounded`` (group ranks that keep serving from their weights until the switch)
    still holds at most ``budget_bytes`` with it; a layer that does not fit is skipped (it moves
    in the pause) and later ones may still fit. A bounded rank holds, for a layer it changes, the
    whole new layer (``new slots * expert_bytes``: the switch swaps it in); nothing for a layer
    it does not change. Ranks outside ``bounded`` (joining ranks: they receive into their fresh
    weights) take part without a budget.
    """
    used = {rank: 0 for rank in bounded}
    chosen: list[int] = []
    for index, plan in enumerate(plans):
        if not plan.changes_anything:
            continue
        need = {}
        for rank in used:
            rank_plan = plan.for_rank(rank)
            need[rank] = rank_plan.num_new_slots * expert_bytes if rank_plan.changed_slots else 0
        if all(used[rank] + n <= budget_bytes for rank, n in need.items()):
            for rank, n in need.items():
                used[rank] += n
            chosen.append(index)
    return tuple(chosen)
