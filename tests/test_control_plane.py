"""The elastic control plane on real worker processes: scale up, down, cycles, conflicts, leaks."""

from __future__ import annotations

import threading

import pytest

from elastic.control.coordinator import OperationStatus
from elastic.core.errors import InvalidScaleRequest, ScaleConflict, StaleGeneration
from elastic.faults import DelayTransfer
from tests.conftest import running, small_config
from tests.helpers import assert_consistent

pytestmark = [pytest.mark.multiprocess]


def _scale(c, size):
    op = c.scale(size, timeout=120)
    assert op.status == OperationStatus.SUCCEEDED, f"scale to {size} failed: {op.error}"
    return op


def _transitions(c, operation_id):
    return [(t.source.value, t.dest.value) for t in c.machine.history() if t.operation_id == operation_id]


@pytest.mark.timeout(120)
def test_scale_cycle_2_4_3_2_with_async_eplb_firing():
    config = small_config(model=dict(num_layers=4, num_experts=8), eplb=dict(step_interval=5, window_size=5))
    # slow links keep a layer in flight most of the time, so drains have something to finish
    faults = [DelayTransfer(rank=r, seconds=0.02) for r in range(4)]
    with running(config, faults=faults) as c:
        c.wait_for_step(30)
        generation = 0
        for size in (4, 3, 2):
            before = c.snapshot()["rebalances"]
            op = _scale(c, size)
            generation += 1
            assert _transitions(c, op.id) == [("running", "draining"), ("draining", "suppressed"),
                                              ("suppressed", "rescaling"), ("rescaling", "resuming"),
                                              ("resuming", "running")]
            assert c.machine.generation == generation and op.generation_after == generation
            assert list(op.phases) == ["draining", "suppressed", "rescaling", "resuming"]
            c.wait_for_step(c.snapshot()["step"] + 30)
            assert c.snapshot()["rebalances"] > before, f"no rebalance fired after scaling to {size}"
            verdict = assert_consistent(c, size)
            assert all(v["generation"] == generation for v in verdict.values())
        assert op.released_ranks == [2]


@pytest.mark.timeout(120)
def test_scale_during_in_flight_transfer_finishes_and_commits_before_the_group_is_replaced():
    config = small_config(model=dict(num_layers=6, num_experts=8), eplb=dict(step_interval=4, window_size=4))
    faults = [DelayTransfer(rank=r, seconds=0.15) for r in range(2)]
    with running(config, faults=faults) as c:
        c.wait_for_step(10)
        # wait until a layer is in flight, then ask for the scale
        for _ in range(200):
            if c.snapshot()["in_flight_layer"] is not None:
                break
            c.wait_for_step(c.snapshot()["step"] + 1)
        assert c.snapshot()["in_flight_layer"] is not None, "no transfer ever in flight"
        op = _scale(c, 4)
        drains = [e for e in c.events if e.kind == "layer_committed"]
        drain_reports = c._done  # seq -> pid -> PhaseDone
        drain_done = [r for reports in drain_reports.values() for r in reports.values()
                      if r.phase == "Drain" and r.operation_id == op.id]
        assert len(drain_done) == 2
        steps_draining = [r.detail["steps_while_draining"] for r in drain_done]
        assert min(steps_draining) > 0, "the decode loop did not produce tokens while draining"
        drain_step = min(r.step for r in drain_done)
        rescale_step = min(r.step for reports in drain_reports.values() for r in reports.values()
                           if r.phase == "Rescale" and r.operation_id == op.id)
        # the in-flight layer was committed on both ranks, after the drain began and before the rescale
        committed_in_drain = {(e.rank, e.data["layer"]) for e in drains
                              if drain_step - min(steps_draining) <= e.step <= drain_step}
        assert {rank for rank, _ in committed_in_drain} == {0, 1}, "the in-flight layer was not committed during the drain"
        assert drain_step <= rescale_step
        assert_consistent(c, 4)


@pytest.mark.timeout(90)
def test_concurrent_and_invalid_requests_one_wins_rest_refused_state_unchanged():
    config = small_config(eplb=dict(step_interval=5, window_size=5))
    with running(config) as c:
        c.wait_for_step(10)
        history = len(c.machine.history())
        for bad, reason in [(0, "at least 1"), (5, "capacity"), (-1, "at least 1"), ("3", "integer"), (True, "integer")]:
            with pytest.raises(InvalidScaleRequest, match=reason):
                c.scale(bad)
        with pytest.raises(StaleGeneration):
            c.scale(4, expected_generation=7)
        assert len(c.machine.history()) == history and c.machine.state.value == "running"
        noop = c.scale(2)
        assert noop.status == OperationStatus.NOOP
        results, errors = [], []
        barrier = threading.Barrier(8)

        def request(size):
            barrier.wait()
            try:
                results.append(c.scale(size, wait=False))
            except ScaleConflict as exc:
                errors.append(exc)

        threads = [threading.Thread(target=request, args=(4 if i % 2 else 3,)) for i in range(8)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(10)
        assert len(results) == 1 and len(errors) == 7, f"{len(results)} started, {len(errors)} refused"
        assert all(e.operation_id == results[0].id for e in errors), "a conflict did not name the running operation"
        winner = results[0]
        winner.done.wait(120)
        assert winner.status == OperationStatus.SUCCEEDED, winner.error
        assert_consistent(c, winner.target_size)


@pytest.mark.timeout(240)
def test_six_scale_cycles_leak_nothing():
    config = small_config(eplb=dict(step_interval=5, window_size=5))
    with running(config) as c:
        c.wait_for_step(10)
        samples = []
        for _ in range(6):  # the long soak is bench_soak's (50 cycles)
            _scale(c, 4)
            _scale(c, 2)
            c.wait_for_step(c.snapshot()["step"] + 5)
            verdict = assert_consistent(c, 2)
            samples.append({r: (len(v["threads"]), v["process_groups"], v["rss_bytes"]) for r, v in verdict.items()})
        for rank in (0, 1):
            threads = [s[rank][0] for s in samples]
            groups = [s[rank][1] for s in samples]
            rss = [s[rank][2] for s in samples]
            assert len(set(threads[1:])) == 1, f"rank {rank} thread count drifts: {threads}"
            assert len(set(groups)) == 1, f"rank {rank} open process groups drift: {groups}"
            # memory settles after the first cycles (allocator warm-up); later cycles must not grow it
            assert rss[-1] - rss[2] < 16 * 2**20, f"rank {rank} resident memory grows: {[r >> 20 for r in rss]} MiB"


@pytest.mark.timeout(120)
@pytest.mark.parametrize("policy", ["migration_aware", "hierarchical"])
def test_scale_cycle_with_other_policies(policy):
    config = small_config(model=dict(num_layers=3, num_experts=8, num_expert_groups=2),
                          eplb=dict(policy=policy, step_interval=5, window_size=5))
    with running(config) as c:
        c.wait_for_step(20)
        for size in (4, 2):
            _scale(c, size)
            c.wait_for_step(c.snapshot()["step"] + 15)
            assert_consistent(c, size)
        assert c.snapshot()["rebalances"] >= 2


@pytest.mark.timeout(120)
@pytest.mark.parametrize("prepare", [True, False], ids=["prepared", "in-the-pause"])
def test_joining_ranks_are_ready_before_the_pause_and_a_scale_down_is_planned_while_decoding(prepare):
    config = small_config(model=dict(num_layers=4, num_experts=8), scaling=dict(prepare=prepare))
    with running(config) as c:
        c.wait_for_step(10)
        up = _scale(c, 4)
        reports = [r for by_pid in list(c._done.values()) for r in by_pid.values()]
        ready = [r for r in reports if r.phase == "Standby"]
        rescale = [r for r in reports if r.phase == "Rescale" and r.operation_id == up.id]
        assert sorted(r.rank for r in ready) == [2, 3]
        assert all(r.detail["prepare_seconds"] > 0 for r in ready)
        # both joining ranks had allocated and registered their weights before any rank paused
        first_pause = min(r.at - r.detail["seconds"] for r in rescale)
        assert max(r.at for r in ready) <= first_pause
        assert all(r.detail["prepared"] is prepare for r in rescale)
        assert_consistent(c, 4)

        down = _scale(c, 2)
        done = [r for by_pid in list(c._done.values()) for r in by_pid.values() if r.operation_id == down.id]
        suppress = [r for r in done if r.phase == "Suppress"]
        rescale = [r for r in done if r.phase == "Rescale"]
        prepared = [r for r in done if r.phase == "Prepare"]
        # the scale down was planned while decoding (at Prepare, or announced at Suppress without
        # it), every rank the same way, and the rescale used that plan
        assert len(rescale) == 4 and all(r.detail["announced"] for r in rescale)
        if prepare:
            assert len(prepared) == 4 and not any(r.detail["announced"] for r in suppress)
            assert down.prepare["layers"] == down.prepare["layers_total"], "a budget this large holds every layer"
        else:
            assert not prepared and len(suppress) == 4 and all(r.detail["announced"] for r in suppress)
        assert_consistent(c, 2)
        # a scale up is not announced at Suppress: the joining ranks get the placement from the survivors
        suppress_up = [r for by_pid in list(c._done.values()) for r in by_pid.values()
                       if r.phase == "Suppress" and r.operation_id == up.id]
        assert len(suppress_up) == 2 and not any(r.detail["announced"] for r in suppress_up)
