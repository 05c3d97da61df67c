"""The EPLB runtime on real worker processes (gloo, CPU): sync and async rebalancing."""

from __future__ import annotations

from collections import defaultdict

import pytest

from elastic.faults import DelayTransfer
from tests.conftest import running, small_config
from tests.helpers import assert_consistent

pytestmark = [pytest.mark.multiprocess]


def _commits(coordinator, size):
    """(rebalance, layer) -> {rank: step} of every async layer commit the workers reported.

    A Verify round trip first: each worker answers it after every event it sent before, so all
    commits up to the verified step have arrived; later ones may still be on their way and are
    left out.
    """
    verdict = assert_consistent(coordinator, size)
    upto = min(v["step"] for v in verdict.values())
    seen = defaultdict(dict)
    for event in list(coordinator.events):
        if event.kind == "layer_committed" and event.step < upto:
            seen[(event.data["rebalance"], event.data["layer"])][event.rank] = event.step
    return seen


@pytest.mark.timeout(90)
@pytest.mark.parametrize(
    "ep_size, use_async, model",
    [
        (2, False, dict(num_layers=3, num_experts=8)),
        (2, True, dict(num_layers=4, num_experts=8)),
        (4, True, dict(num_layers=3, num_experts=16)),
        (4, False, dict(num_layers=2, num_experts=12)),
    ],
)
def test_rebalancing_keeps_every_slot_exact(ep_size, use_async, model):
    redundant = 4 if model["num_experts"] % 4 == 0 else 0
    config = small_config(ep_size=ep_size, model=model,
                          eplb=dict(use_async=use_async, num_redundant_experts=redundant, step_interval=6, window_size=6))
    with running(config) as c:
        c.wait_for_step(60, timeout=60)
        snap = c.snapshot()
        assert snap["rebalances"] >= 2, "the EPLB never rebalanced"
        assert snap["layers_committed"] > 0, "no layer ever moved: the test proves nothing"
        assert_consistent(c, ep_size)


@pytest.mark.timeout(90)
def test_async_commits_one_layer_per_step_on_every_rank_at_the_same_step():
    config = small_config(ep_size=4, model=dict(num_layers=4, num_experts=16),
                          eplb=dict(step_interval=10, window_size=10))
    # a slow link: each layer's transfer takes a while, so decoding visibly goes on meanwhile
    with running(config, faults=[DelayTransfer(rank=r, seconds=0.03) for r in range(4)]) as c:
        c.wait_for_step(80, timeout=60)
        commits = _commits(c, 4)
        assert commits, "no async layer commit happened"
        for (rebalance, layer), steps in commits.items():
            assert sorted(steps) == [0, 1, 2, 3], f"layer {layer} of rebalance {rebalance} committed on ranks {sorted(steps)} only"
            assert len(set(steps.values())) == 1, f"layer {layer} switched at different steps: {steps}"
        by_rebalance = defaultdict(list)
        for (rebalance, _layer), steps in commits.items():
            by_rebalance[rebalance].append(next(iter(steps.values())))
        gaps = []
        for steps in by_rebalance.values():
            steps.sort()
            assert len(set(steps)) == len(steps), "two layers committed in one step"
            gaps += [b - a for a, b in zip(steps, steps[1:])]
        assert gaps and max(gaps) >= 2, "the decode loop did not step while layers were in flight"
        assert_consistent(c, 4)


@pytest.mark.timeout(60)
def test_corrupted_buffer_is_refused_and_old_placement_keeps_serving():
    from elastic.faults import CorruptBuffer

    config = small_config(eplb=dict(verify_transfers=True, step_interval=6, window_size=6))
    with running(config, faults=[CorruptBuffer(rank=1, times=1)]) as c:
        c.wait_for_step(60, timeout=60)
        kinds = [e.kind for e in c.events]
        assert "rebalance_failed" in kinds, "the corrupted layer was not refused"
        failed = next(e for e in c.events if e.kind == "rebalance_failed" and e.data["local"])
        assert failed.rank == 1
        assert "do not hold their experts" in failed.data["error"]
        assert c.snapshot()["rebalances"] >= 1, "rebalancing did not go on after the refused layer"
        assert_consistent(c, 2)


@pytest.mark.timeout(90)
def test_async_layer_pacing_spreads_commits_and_keeps_weights_exact():
    config = small_config(ep_size=2, model=dict(num_layers=4, num_experts=8),
                          eplb=dict(step_interval=30, window_size=10, async_layer_interval=3))
    with running(config) as c:
        c.wait_for_step(100, timeout=60)
        commits = _commits(c, 2)
        by_rebalance = defaultdict(list)
        for (rebalance, layer), steps in commits.items():
            assert len(set(steps.values())) == 1 and len(steps) == 2, f"layer {layer}: {steps}"
            by_rebalance[rebalance].append(next(iter(steps.values())))
        gaps = [b - a for steps in by_rebalance.values() for a, b in zip(sorted(steps), sorted(steps)[1:])]
        assert gaps, "no rebalance moved two layers: the test proves nothing"
        assert min(gaps) >= 3, f"layers committed closer than the pacing allows: gaps {gaps}"
        assert_consistent(c, 2)
