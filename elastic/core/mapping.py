"""Rank mappings: where every old EP rank goes when the group changes size.

A :class:`RankMapping` is ``old_to_new[old_rank] = new_rank``, or ``-1`` for a rank that
leaves. New ranks that no old rank maps to are *joining* (fresh workers). Ranks that leave
are either *retiring* (alive: during a scale-down they still send their experts out before
they go) or *lost* (dead: their weights are gone and must come from a replica or the
checkpoint).

Constructors cover the three cases of the design:

- :meth:`RankMapping.for_resize` – scale down (the highest ranks retire) or up (identity plus
  fresh ranks at the top);
- :meth:`RankMapping.without` – failure: the lost ranks leave and survivors are compacted in
  order.

This module is pure: no I/O, no ``torch.distributed``.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from elastic.core.errors import InvalidRankMapping

__all__ = ["RankMapping"]


def _as_rank(value: Any, what: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        # numpy / torch integer scalars expose __index__; floats and strings do not
        index = getattr(value, "__index__", None)
        if index is None or isinstance(value, bool):
            raise InvalidRankMapping(f"{what} must be an integer, got {type(value).__name__} {value!r}")
        value = index()
    return int(value)


@dataclass(frozen=True, slots=True)
class RankMapping:
    """Old EP rank -> new EP rank for one change of the group.

    Args:
        old_to_new: index = old rank, value = new rank in ``[0, new_size)`` or ``-1`` (leaves).
        new_size: number of ranks in the new group.
        lost: old ranks whose worker is gone (they must map to ``-1``). Retiring ranks
            (``-1`` but not lost) are alive until the redistribution has finished.

    Raises:
        InvalidRankMapping: naming the old rank at fault, when a value is out of range, two
            old ranks share a new rank, a lost rank does not leave, or no rank survives.
    """

    old_to_new: tuple[int, ...]
    new_size: int
    lost: frozenset[int] = field(default_factory=frozenset)

    def __post_init__(self) -> None:
        try:
            raw = tuple(self.old_to_new)
        except TypeError:
            raise InvalidRankMapping(
                f"old_to_new must be a sequence of ranks, got {type(self.old_to_new).__name__}", field="old_to_new"
            ) from None
        new_size = _as_rank(self.new_size, "new_size")
        if new_size < 1:
            raise InvalidRankMapping("the new group needs at least one rank", field="new_size", value=new_size)
        if not raw:
            raise InvalidRankMapping("the old group needs at least one rank", field="old_to_new")
        values = tuple(_as_rank(v, f"the new rank of old rank {i}") for i, v in enumerate(raw))
        owner: dict[int, int] = {}
        for old, new in enumerate(values):
            if not -1 <= new < new_size:
                raise InvalidRankMapping(
                    f"old rank {old} maps to {new}, outside [-1, {new_size}) (-1 means it leaves)",
                    field="old_to_new",
                    old_rank=old,
                    value=new,
                )
            if new >= 0:
                if new in owner:
                    raise InvalidRankMapping(
                        f"old ranks {owner[new]} and {old} both map to new rank {new}",
                        field="old_to_new",
                        old_rank=old,
                        value=new,
                    )
                owner[new] = old
        if not owner:
            raise InvalidRankMapping(
                "no old rank survives (every value is -1): that is a restart, not a rescale", field="old_to_new"
            )
        try:
            lost_raw = list(self.lost)
        except TypeError:
            raise InvalidRankMapping(f"lost must be a set of old ranks, got {self.lost!r}", field="lost") from None
        lost = frozenset(_as_rank(r, "a lost rank") for r in lost_raw)
        for rank in sorted(lost):
            if not 0 <= rank < len(values):
                raise InvalidRankMapping(
                    f"lost rank {rank} is not an old rank (old ranks are 0..{len(values) - 1})", field="lost", old_rank=rank
                )
            if values[rank] != -1:
                raise InvalidRankMapping(
                    f"lost old rank {rank} maps to new rank {values[rank]}; a lost rank must map to -1",
                    field="lost",
                    old_rank=rank,
                )
        object.__setattr__(self, "old_to_new", values)
        object.__setattr__(self, "new_size", new_size)
        object.__setattr__(self, "lost", lost)

    # ------------------------------------------------------------------ constructors

    @classmethod
    def identity(cls, size: int) -> RankMapping:
        """Nobody leaves, nobody joins."""
        return cls.for_resize(size, size)

    @classmethod
    def for_resize(cls, old_size: int, new_size: int) -> RankMapping:
        """Scale ``old_size`` -> ``new_size``: down retires the highest ranks, up adds fresh ranks on top.

        Surviving ranks keep their number, so a rank's slots stay where they are.
        """
        old_size = _as_rank(old_size, "old_size")
        new_size = _as_rank(new_size, "new_size")
        if old_size < 1:
            raise InvalidRankMapping("the old group needs at least one rank", field="old_size", value=old_size)
        if new_size < 1:
            raise InvalidRankMapping("the new group needs at least one rank", field="new_size", value=new_size)
        return cls(tuple(r if r < new_size else -1 for r in range(old_size)), new_size)

    @classmethod
    def without(cls, old_size: int, lost_ranks: Iterable[int]) -> RankMapping:
        """Failure: drop ``lost_ranks`` and renumber the survivors ``0..k-1`` in their old order."""
        old_size = _as_rank(old_size, "old_size")
        if old_size < 1:
            raise InvalidRankMapping("the old group needs at least one rank", field="old_size", value=old_size)
        lost = set()
        for r in lost_ranks:
            rank = _as_rank(r, "a lost rank")
            if not 0 <= rank < old_size:
                raise InvalidRankMapping(
                    f"lost rank {rank} is not an old rank (old ranks are 0..{old_size - 1})",
                    field="lost_ranks",
                    old_rank=rank,
                )
            lost.add(rank)
        if len(lost) == old_size:
            raise InvalidRankMapping(
                f"all {old_size} ranks are lost: nothing survives to rescale", field="lost_ranks", value=sorted(lost)
            )
        old_to_new: list[int] = []
        nxt = 0
        for r in range(old_size):
            if r in lost:
                old_to_new.append(-1)
            else:
                old_to_new.append(nxt)
                nxt += 1
        return cls(tuple(old_to_new), nxt, frozenset(lost))

    @classmethod
    def from_dict(cls, mapping: Mapping[int, int], new_size: int, *, lost: Iterable[int] = ()) -> RankMapping:
        """From the design's ``{old_rank: new_rank}`` form; every old rank ``0..len-1`` must appear."""
        keys = sorted(_as_rank(k, "an old rank") for k in mapping)
        if keys != list(range(len(keys))):
            missing = sorted(set(range(max(keys, default=-1) + 1)) - set(keys))
            raise InvalidRankMapping(
                f"old ranks must be 0..{len(keys) - 1} without gaps; missing {missing}" if missing
                else f"old ranks must be 0..{len(keys) - 1}, got {keys}",
                field="old_to_new",
            )
        return cls(tuple(mapping[k] for k in range(len(keys))), new_size, frozenset(lost))

    # ------------------------------------------------------------------ views

    @property
    def old_size(self) -> int:
        """Number of ranks in the old group."""
        return len(self.old_to_new)

    @property
    def survivors(self) -> tuple[int, ...]:
        """Old ranks that stay in the new group, ascending."""
        return tuple(old for old, new in enumerate(self.old_to_new) if new >= 0)

    @property
    def leaving(self) -> tuple[int, ...]:
        """Old ranks that leave (retiring and lost), ascending."""
        return tuple(old for old, new in enumerate(self.old_to_new) if new < 0)

    @property
    def retiring(self) -> tuple[int, ...]:
        """Old ranks that leave but are alive (they can still send their experts out)."""
        return tuple(old for old in self.leaving if old not in self.lost)

    @property
    def joining(self) -> tuple[int, ...]:
        """New ranks no old rank maps to (fresh workers), ascending."""
        return tuple(new for new, old in enumerate(self.new_to_old) if old < 0)

    @property
    def new_to_old(self) -> tuple[int, ...]:
        """index = new rank, value = the old rank it continues, or ``-1`` for a joining rank."""
        out = [-1] * self.new_size
        for old, new in enumerate(self.old_to_new):
            if new >= 0:
                out[new] = old
        return tuple(out)

    @property
    def is_identity(self) -> bool:
        """True when the group is unchanged (same size, every rank keeps its number)."""
        return self.old_size == self.new_size and all(old == new for old, new in enumerate(self.old_to_new))

    def new_rank(self, old_rank: int) -> int:
        """The new rank of ``old_rank`` (``-1`` if it leaves)."""
        if not 0 <= old_rank < self.old_size:
            raise InvalidRankMapping(f"{old_rank} is not an old rank (0..{self.old_size - 1})", old_rank=old_rank)
        return self.old_to_new[old_rank]

    def old_rank(self, new_rank: int) -> int:
        """The old rank that ``new_rank`` continues (``-1`` if it joins)."""
        if not 0 <= new_rank < self.new_size:
            raise InvalidRankMapping(f"{new_rank} is not a new rank (0..{self.new_size - 1})", value=new_rank)
        return self.new_to_old[new_rank]

    def new_rank_of_old_slots(self, slots_per_rank: int) -> tuple[int, ...]:
        """For each old physical slot (rank-major layout), the new rank that keeps it, or ``-1``.

        Length ``old_size * slots_per_rank``. A planner uses it to see which old slots still have
        a home in the new group; slots of leaving ranks are ``-1`` (see :attr:`retiring` for
        those that can still send, :attr:`lost` for those whose weights are gone).
        """
        s = _as_rank(slots_per_rank, "slots_per_rank")
        if s < 1:
            raise InvalidRankMapping("slots_per_rank must be at least 1", field="slots_per_rank", value=s)
        return tuple(new for new in self.old_to_new for _ in range(s))

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready: ``{"old_to_new": {old: new}, "new_size", "leaving", "joining", "lost"}``."""
        return {
            "old_to_new": {str(old): new for old, new in enumerate(self.old_to_new)},
            "new_size": self.new_size,
            "leaving": list(self.leaving),
            "joining": list(self.joining),
            "lost": sorted(self.lost),
        }

    def __str__(self) -> str:
        pairs = ", ".join(f"{old}->{new if new >= 0 else 'x'}" for old, new in enumerate(self.old_to_new))
        extra = f"; joining {list(self.joining)}" if self.joining else ""
        return f"RankMapping({self.old_size}->{self.new_size}: {pairs}{extra})"
