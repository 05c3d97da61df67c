"""The control plane's pure decisions (elastic.control.plans): no process, no clock."""

from __future__ import annotations

import pytest

from elastic.control.plans import Attempt, LiveWorker, plan_recovery
from elastic.core.errors import InvalidScaleRequest


def workers(*triples):
    return [LiveWorker(pid, rank, generation) for pid, rank, generation in triples]


def test_recovery_keeps_the_living_ranks_of_the_serving_generation_and_names_the_lost_ones():
    plan = plan_recovery(workers((10, 0, 3), (12, 2, 3)), {}, generation=3, size=3)
    assert (plan.generation, plan.base_size, plan.survivors, plan.lost_ranks, plan.retire) == (3, 3, (10, 12), (1,), ())
    assert plan.new_size == 2


def test_recovery_prefers_an_attempt_adopted_by_more_living_workers_and_retires_the_rest():
    live = workers((10, 0, 3), (20, 0, 4), (21, 1, 4), (22, 2, 4))
    plan = plan_recovery(live, {4: Attempt(size=4, adopted=frozenset({20, 21, 22}))}, generation=3, size=2)
    assert (plan.generation, plan.base_size, plan.survivors, plan.lost_ranks) == (4, 4, (20, 21, 22), (3,))
    assert plan.retire == (10,)


def test_on_a_tie_the_last_consistent_generation_wins():
    live = workers((10, 0, 3), (11, 1, 3), (20, 0, 4), (21, 1, 4))
    plan = plan_recovery(live, {4: Attempt(size=4, adopted=frozenset({20, 21}))}, generation=3, size=2)
    assert plan.generation == 3 and plan.survivors == (10, 11) and plan.retire == (20, 21)


def test_only_workers_that_reported_adopting_an_attempt_count_for_it():
    live = workers((10, 0, 3), (20, 0, 4), (21, 1, 4))
    plan = plan_recovery(live, {4: Attempt(size=2, adopted=frozenset({20}))}, generation=3, size=1)
    assert plan.generation == 3 and plan.survivors == (10,) and set(plan.retire) == {20, 21}


def test_older_attempts_than_the_serving_generation_are_ignored():
    live = workers((10, 0, 3), (5, 0, 2), (6, 1, 2))
    plan = plan_recovery(live, {2: Attempt(size=2, adopted=frozenset({5, 6}))}, generation=3, size=2)
    assert plan.generation == 3 and plan.lost_ranks == (1,)


def test_recovery_with_no_survivor_is_refused():
    with pytest.raises(InvalidScaleRequest, match="no worker of the last consistent generation"):
        plan_recovery(workers((5, 0, 2)), {}, generation=3, size=2)
