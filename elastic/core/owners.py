"""Which rank owns a request: pure.

Requests are owned by ranks (data-parallel attention): the coordinator admits each request to the
least loaded rank of the group by tokens in flight
(:meth:`~elastic.core.protocol.RequestSpec.in_flight`), and a scale down gives a leaving rank's
requests to the least loaded survivors (:func:`elastic.worker.rescale_plan.plan_request_moves`),
both by :func:`least_loaded`.
"""

from __future__ import annotations

from collections.abc import Sequence

__all__ = ["least_loaded"]



def least_loaded(loads: Sequence[int], new: Sequence[int]) -> list[int]:
    """Each of the ``new`` loads (in order) to the rank whose load is then the lowest (the lowest
    rank on a tie), counting what it was given before: ``loads[r]`` is rank ``r``'s load now."""
    if not loads:
        raise ValueError("no rank to place requests on")
    current = list(loads)
    chosen = []
    for load in new:
        rank = min(range(len(current)), key=lambda r: (current[r], r))
        current[rank] += load
        chosen.append(rank)
    return chosen

