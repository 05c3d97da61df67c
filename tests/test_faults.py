"""Faults on real worker processes: a rank dies or stalls; the deployment recovers and loses nothing."""

from __future__ import annotations

import time

import pytest

from elastic.control.coordinator import OperationStatus
from elastic.faults import DropHeartbeats, KillRank, StallRank, TornCommit
from tests.conftest import running, small_config
from tests.helpers import assert_consistent, wait_for_state

pytestmark = [pytest.mark.multiprocess]


@pytest.mark.timeout(120)
def test_rank_killed_while_running_auto_recovers_to_a_smaller_verified_group():
    config = small_config(ep_size=3, model=dict(num_layers=3, num_experts=8), eplb=dict(num_redundant_experts=4),
                          auto_recover=True)
    with running(config, faults=[KillRank(rank=2, at_step=25, generation=0)]) as c:
        wait_for_state(c, "running", timeout=60, generation=1)
        triggers = [t.trigger for t in c.machine.history()]
        assert triggers[-4:] == ["fail", "recover", "rescaled", "resumed"], triggers
        assert "worker lost" in c.machine.history()[-4].reason
        recovery = c._current
        assert recovery.kind == "recover" and recovery.status == OperationStatus.SUCCEEDED
        assert c.size == 2 and c.machine.generation == 1
        c.wait_for_step(c.snapshot()["step"] + 10)
        assert_consistent(c, 2)


@pytest.mark.timeout(120)
def test_survivors_waiting_out_a_stalled_peer_stay_alive_though_the_wait_outlasts_the_heartbeat_margin():
    """The survivors block in the step's all-reduce for the whole collective timeout (3 s) before
    they can report the failure; with the heartbeat deadline only 50 ms beyond it, they are still
    never silent (the step watch reports while a step waits): only the stalled rank is lost, and
    recovery goes on with the other two."""
    config = small_config(ep_size=3, model=dict(num_layers=3, num_experts=8), eplb=dict(num_redundant_experts=4),
                          auto_recover=True, timeouts=dict(collective=3, heartbeat=3.05))
    with running(config, faults=[StallRank(rank=2, at_step=20, seconds=30, generation=0)]) as c:
        wait_for_state(c, "running", timeout=60, generation=1)
        failure = next(t for t in c.machine.history() if t.trigger == "fail")
        assert "rank 2 " in failure.reason and "rank 0 " not in failure.reason and "rank 1 " not in failure.reason, \
            failure.reason
        assert c.size == 2
        c.wait_for_step(c.snapshot()["step"] + 5)
        assert_consistent(c, 2)


@pytest.mark.timeout(120)
def test_rank_killed_mid_rescale_fails_with_reason_then_recover_restores_running():
    config = small_config(ep_size=2, model=dict(num_layers=3, num_experts=8), eplb=dict(num_redundant_experts=8),
                          timeouts=dict(collective=4, heartbeat=6))
    with running(config, faults=[KillRank(rank=1, in_phase="rescaling", generation=0)]) as c:
        c.wait_for_step(10)
        op = c.scale(4, timeout=90)
        assert op.status == OperationStatus.FAILED
        assert c.machine.state.value == "failed" and op.error
        recovery = c.recover(timeout=90)
        assert recovery.status == OperationStatus.SUCCEEDED, recovery.error
        assert c.machine.state.value == "running" and c.size == 1
        c.wait_for_step(c.snapshot()["step"] + 10)
        assert_consistent(c, 1)
        # a failed scale never wedges later scales
        again = c.scale(2, timeout=90)
        assert again.status == OperationStatus.SUCCEEDED, again.error
        assert_consistent(c, 2)


@pytest.mark.timeout(120)
def test_stalled_rank_is_treated_as_lost_after_its_deadline():
    config = small_config(ep_size=2, timeouts=dict(collective=2, heartbeat=4), auto_recover=True,
                          eplb=dict(num_redundant_experts=4), model=dict(num_layers=2, num_experts=4))
    with running(config, faults=[StallRank(rank=1, at_step=20, seconds=60, generation=0)]) as c:
        wait_for_state(c, "running", timeout=60, generation=1)
        failure = next(t for t in c.machine.history() if t.trigger == "fail")
        assert "silent" in failure.reason or "failed" in failure.reason, failure.reason
        assert c.size == 1
        c.wait_for_step(c.snapshot()["step"] + 5)
        assert_consistent(c, 1)


@pytest.mark.timeout(120)
def test_rank_dying_mid_redistribution_rolls_back_the_survivors_in_place_writes():
    # scale up 2 -> 4; new rank 3 dies after two of the three layers moved, so survivors have
    # already overwritten slots in place; they must roll back, and recovery verifies bit-exact
    config = small_config(ep_size=2, model=dict(num_layers=3, num_experts=8), eplb=dict(num_redundant_experts=8),
                          timeouts=dict(collective=4, heartbeat=6))
    with running(config, faults=[KillRank(rank=3, in_phase="rescaling", after_layers=2)]) as c:
        c.wait_for_step(20)
        op = c.scale(4, timeout=90)
        assert op.status == OperationStatus.FAILED and c.machine.state.value == "failed"
        recovery = c.recover(timeout=90)
        assert recovery.status == OperationStatus.SUCCEEDED, recovery.error
        assert c.size == 2, "the survivors of the last consistent generation form the group"
        c.wait_for_step(c.snapshot()["step"] + 10)
        assert_consistent(c, 2)


@pytest.mark.timeout(120)
def test_recovery_moves_experts_from_what_each_survivor_holds_after_a_torn_commit():
    # rank 1's step-boundary all-reduce breaks just before its first async commit while rank 0
    # commits: the two survivors' maps differ by one layer. Recovery must plan from what each
    # one holds (its own maps), not from rank 0's, or rank 1's slots of that layer are wrong.
    # 6 slots per rank for 8 experts: a rebalance has experts to move (with 8 per rank each rank
    # would hold every expert, and a slot-aligned rebalance would change nothing)
    config = small_config(ep_size=2, model=dict(num_layers=3, num_experts=8), eplb=dict(num_redundant_experts=4),
                          timeouts=dict(collective=3, heartbeat=6))
    with running(config, faults=[TornCommit(rank=1, at_commit=1, generation=0)]) as c:
        wait_for_state(c, "failed", timeout=60)
        assert "group broken, no worker lost" in c.machine.failure_reason, c.machine.failure_reason
        recovery = c.recover(timeout=90)
        assert recovery.status == OperationStatus.SUCCEEDED, recovery.error
        assert c.size == 2 and c.machine.state.value == "running"
        c.wait_for_step(c.snapshot()["step"] + 10)
        assert_consistent(c, 2)
        # the survivors really had diverged (so the check above is the one this test is about)
        assert len(recovery.diverged_layers) == 1, recovery.diverged_layers


@pytest.mark.timeout(120)
def test_a_scale_up_failing_before_its_rescale_retires_the_ranks_standing_by():
    config = small_config(ep_size=2, model=dict(num_layers=3, num_experts=8), eplb=dict(num_redundant_experts=8),
                          timeouts=dict(collective=4, heartbeat=6))
    with running(config, faults=[KillRank(rank=1, in_phase="draining", generation=0)]) as c:
        c.wait_for_step(10)
        op = c.scale(4, timeout=90)
        assert op.status == OperationStatus.FAILED and c.machine.state.value == "failed"
        standby = [w for w in c.workers.values() if w.standby]
        assert sorted(w.rank for w in standby) == [2, 3], "the joining ranks were not launched ahead"
        assert all(w.expected_exit for w in standby)
        deadline = time.monotonic() + 10
        while any(w.handle.is_alive() for w in standby):
            assert time.monotonic() < deadline, "a standing-by rank outlived its failed scale"
            time.sleep(0.05)
        assert all(w not in c.live_workers() for w in standby)
        recovery = c.recover(timeout=90)
        assert recovery.status == OperationStatus.SUCCEEDED, recovery.error
        assert c.size == 1
        assert_consistent(c, 1)


@pytest.mark.timeout(150)
def test_dropped_heartbeats_without_a_generation_silence_one_process_not_the_rank_renumbered_into_its_number():
    """Rank 1 of 3 goes silent; the recovery renumbers rank 2 as rank 1 and replace_lost adds a
    fresh rank 2. The fault (no generation) is bound to generation 0, the one it fired in: neither
    the renumbered rank 1 nor anyone later is silenced. Before the binding, the renumbered rank 1
    was silenced in the recovery's own rescaling, then the fresh worker, until the deployment
    stayed failed."""
    config = small_config(ep_size=3, max_ep_size=3, model=dict(num_layers=3, num_experts=8),
                          eplb=dict(num_redundant_experts=4), auto_recover=True, replace_lost=True,
                          timeouts=dict(collective=3, heartbeat=4))
    with running(config, faults=[DropHeartbeats(rank=1, from_step=20)]) as c:
        wait_for_state(c, "running", timeout=90, generation=2)  # the recovery (1), replace_lost's scale back (2)
        c.wait_for_step(c.snapshot()["step"] + 5)
        time.sleep(config.timeouts.heartbeat + 2.0)  # a silenced rank would be declared lost by now
        fails = [t for t in c.machine.history() if t.trigger == "fail"]
        assert len(fails) == 1 and "rank 1 " in fails[0].reason and "silent" in fails[0].reason, \
            [t.sentence() for t in c.machine.history()]
        assert c.machine.state.value == "running" and c.size == 3 and c.machine.generation == 2
        c.wait_for_step(c.snapshot()["step"] + 10)
        assert_consistent(c, 3)
