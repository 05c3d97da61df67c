"""Decisions of the control plane as pure functions: they look at a snapshot and return a plan.

The coordinator gathers what a decision needs (which workers live, in which generation, what
each rescale attempt was), calls the function, and only then acts on the plan: retire these
workers, rescale those. So a decision is tested without processes, and the coordinator's
threads only carry plans out.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from elastic.core.errors import InvalidScaleRequest

__all__ = ["Attempt", "LiveWorker", "RecoveryPlan", "plan_recovery"]


@dataclass(frozen=True)
class LiveWorker:
    """What a decision needs to know of one living worker."""

    pid: int
    rank: int
    generation: int


@dataclass(frozen=True)
class Attempt:
    """A rescale attempt to ``generation``: the group size it was to have, and the workers
    that reported adopting it (a failed attempt may have been adopted by some ranks when a
    peer died after its final barrier)."""

    size: int
    adopted: frozenset[int]


@dataclass(frozen=True)
class RecoveryPlan:
    generation: int  # the generation the survivors come from
    base_size: int  # that generation's size: the old ranks the recovery's mapping starts from
    survivors: tuple[int, ...]  # pids, by rank
    lost_ranks: tuple[int, ...]  # ranks of that generation with no living worker
    retire: tuple[int, ...]  # pids of every other living worker: killed, their death expected

    @property
    def new_size(self) -> int:
        return self.base_size - len(self.lost_ranks)


def plan_recovery(live: Sequence[LiveWorker], attempts: Mapping[int, Attempt], generation: int,
                  size: int) -> RecoveryPlan:
    """Choose the survivors of a recovery from ``failed``.

    1. Candidates: the serving (last consistent) ``generation`` of ``size`` ranks, with its
       living workers; and every later rescale attempt, with the living workers that reported
       adopting it and are in it.
    2. The candidate with the most living workers wins; on a tie the older generation (the
       last consistent one first), so a half-adopted attempt never wins over what served.
    3. Every living worker that is not a survivor is retired, so no rank is left on a half-made
       generation.

    Raises :class:`InvalidScaleRequest` (nothing changes) when no candidate has a living worker.
    The caller checks the new size against the deployment's limits.
    """
    sizes = {generation: size}
    members = {generation: [w for w in live if w.generation == generation]}
    for g, attempt in attempts.items():
        if g > generation:
            sizes[g] = attempt.size
            members[g] = [w for w in live if w.pid in attempt.adopted and w.generation == g]
    chosen = max(members, key=lambda g: (len(members[g]), -g))
    survivors = sorted(members[chosen], key=lambda w: w.rank)
    if not survivors:
        # what was weighed, so that an operator (and a failed test) sees why no side had a worker
        seen = ", ".join(f"rank {w.rank} pid {w.pid} on generation {w.generation}" for w in live) or "none"
        tried = ", ".join(f"generation {g} ({a.size} ranks, adopted by pids {sorted(a.adopted)})"
                          for g, a in sorted(attempts.items())) or "none"
        raise InvalidScaleRequest("ep_size", "cannot recover: no worker of the last consistent generation "
                                  f"({generation}) is alive, nor one that adopted a later attempt; living workers: "
                                  f"{seen}; attempts: {tried}")
    alive = {w.rank for w in survivors}
    keep = {w.pid for w in survivors}
    return RecoveryPlan(generation=chosen, base_size=sizes[chosen], survivors=tuple(w.pid for w in survivors),
                        lost_ranks=tuple(r for r in range(sizes[chosen]) if r not in alive),
                        retire=tuple(sorted(w.pid for w in live if w.pid not in keep)))
