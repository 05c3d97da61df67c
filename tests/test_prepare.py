"""A scale prepares while the old group decodes (issue 16): the standby group, the pre-transfer,
and a pause that only switches."""

from __future__ import annotations

import multiprocessing as mp
import time

import pytest

from elastic.core import protocol as p
from elastic.core.mapping import RankMapping
from elastic.faults import DelayTransfer, KillRank
from elastic.worker.prepare import over_share
from eplb.plan import holders_from_mapping, plan_layer, prestage_layers
from tests.conftest import running, small_config
from tests.helpers import assert_consistent, wait_for_state
from tests.test_communicators import COMMUNICATORS

#: a Prepare's scale for the pacing tests (they read only its pacing fields)
SPEC = p.RescaleSpec(generation=1, new_size=2, mapping=(0, 1, -1), execute_on="old")

# -- pure decisions -----------------------------------------------------------------------------

def _scale_down_plans(layers: int, moving: bool = True):
    """3 -> 2 ranks, 2 slots each: rank 2 leaves holding experts 3 and 1; survivors take them over."""
    mapping = RankMapping.for_resize(3, 2).old_to_new
    old_holder, new_holder = holders_from_mapping(list(mapping), 2, "old", frozenset())
    old_row = [0, 1, 2, 0, 3, 1]
    new_row = [0, 3, 2, 1] if moving else [0, 1, 2, 0]
    return [plan_layer(old_row, new_row, 2, 2, old_holder, new_holder) for _ in range(layers)]


def test_prestage_takes_layers_in_order_while_every_survivor_stays_within_its_budget():
    plans = _scale_down_plans(3)
    assert all(plan.for_rank(rank).changed_slots for plan in plans for rank in (0, 1))
    # each survivor stages every layer it changes whole: 2 slots of 10 bytes, 20 bytes a layer
    assert prestage_layers(plans, expert_bytes=10, budget_bytes=40, bounded=[0, 1]) == (0, 1)
    assert prestage_layers(plans, expert_bytes=10, budget_bytes=60, bounded=[0, 1]) == (0, 1, 2)
    assert prestage_layers(plans, expert_bytes=10, budget_bytes=19, bounded=[0, 1]) == ()
    # ranks outside ``bounded`` (joining ranks, receiving into their fresh weights) have no budget
    assert prestage_layers(plans, expert_bytes=10, budget_bytes=0, bounded=[]) == (0, 1, 2)


def test_prestage_skips_layers_that_change_nothing_and_a_full_rank_does_not_stop_layers_it_keeps():
    quiet = _scale_down_plans(1, moving=False)[0]
    assert quiet.num_transfers == 0 and not any(quiet.for_rank(r).changed_slots for r in quiet.group_ranks)
    busy = _scale_down_plans(1)[0]
    assert prestage_layers([quiet, busy, quiet], expert_bytes=10, budget_bytes=20, bounded=[0, 1]) == (1,)
    # only rank 1 changes ``one``: once rank 0's budget is spent on ``busy``, ``one`` still fits
    mapping = RankMapping.for_resize(3, 2).old_to_new
    old_holder, new_holder = holders_from_mapping(list(mapping), 2, "old", frozenset())
    one = plan_layer([0, 1, 2, 0, 3, 1], [0, 1, 2, 3], 2, 2, old_holder, new_holder)
    zero = plan_layer([0, 1, 2, 0, 3, 1], [3, 1, 2, 0], 2, 2, old_holder, new_holder)
    assert not one.for_rank(0).changed_slots and one.for_rank(1).changed_slots
    assert zero.for_rank(0).changed_slots and not zero.for_rank(1).changed_slots
    assert prestage_layers([zero, zero, one], expert_bytes=10, budget_bytes=20, bounded=[0, 1]) == (0, 2)
    assert prestage_layers([busy, zero, one], expert_bytes=10, budget_bytes=20, bounded=[0, 1]) == (0,)


def test_a_rank_holds_the_next_layer_once_it_spent_its_share_of_the_wall_time():
    assert not over_share(spent_s=0.0, elapsed_s=0.0, share=0.1)
    assert over_share(spent_s=0.05, elapsed_s=0.2, share=0.1)
    assert not over_share(spent_s=0.05, elapsed_s=0.6, share=0.1)


def test_the_set_up_before_the_first_layer_counts_against_the_share_like_a_layer():
    """Decoding waited while the rank planned and formed the standby group: with 0.3 s of set-up,
    a rank holds its first layer until 3 s have passed at a 0.1 share, as after a 0.3 s layer."""
    from elastic.worker.prepare import Preparation

    def prep(setup: float, spent: float) -> Preparation:
        plans = _scale_down_plans(3)
        return Preparation(command=p.Prepare(seq=1, spec=SPEC, prestage_share=0.1, paced_for_s=30.0), executing_rank=0, new_rank=0,
                           standby=None, base=None, placement=None, plans=plans, layers=(0, 1, 2), group=None,  # type: ignore[arg-type]
                           started_at=0.0, started=100.0, setup_seconds=setup, spent=spent)

    assert prep(setup=0.3, spent=0.0).words(now=101.0) == [1, 0]  # 0.3 s of 1 s
    assert prep(setup=0.3, spent=0.0).words(now=103.1) == [0, 0]  # 0.3 s of 3.1 s
    assert prep(setup=0.0, spent=0.3).words(now=101.0) == [1, 0]
    assert prep(setup=0.0, spent=0.0).words(now=101.0) == [0, 0]


def test_a_rank_whose_steps_fall_behind_its_steady_pace_holds_though_its_own_transfers_are_within_the_share():
    """Steps at 0.1 s before the Prepare; 10 s later, 0.5 s of it spent in layers (within a 0.1
    share): with 80 steps decoded (0.8 of the steady 100) the rank holds, with 95 it goes on. Slow
    steps between layers (a peer's transfer on shared cores) cost decoding as much as layers do."""
    from elastic.worker.prepare import Preparation, behind_pace

    assert behind_pace(steps=80, elapsed_s=10.0, steady_step_s=0.1, share=0.1)
    assert not behind_pace(steps=95, elapsed_s=10.0, steady_step_s=0.1, share=0.1)
    assert not behind_pace(steps=0, elapsed_s=10.0, steady_step_s=0.0, share=0.1)  # pace not known: time only

    def prep(steps: int) -> Preparation:
        return Preparation(command=p.Prepare(seq=1, spec=SPEC, prestage_share=0.1, paced_for_s=60.0), executing_rank=0, new_rank=0,
                           standby=None, base=None, placement=None, plans=_scale_down_plans(3), layers=(0, 1, 2),  # type: ignore[arg-type]
                           group=None, started_at=0.0, started=100.0, spent=0.5, steps=steps, next_index=1,
                           steady_step_s=0.1)

    assert prep(steps=80).words(now=110.0) == [1, 0]
    assert prep(steps=95).words(now=110.0) == [0, 0]
    # ahead now, but not through the next layer (0.5 s, the mean so far, which decodes nothing):
    # 0.9 of 105 steps is 94.5
    assert prep(steps=92).words(now=110.0) == [1, 0]
    # a pace from before the load changed stretches the pre-transfer at most PACE_STRETCH times:
    # 0.5 s in layers is under a third of the 0.1 share of 16 s, so the layers go on though behind
    assert prep(steps=80).words(now=116.0) == [0, 0]
    # behind, but holding would let the layers left overrun the pacing window: they go on
    late = prep(steps=80)
    late.command = p.Prepare(seq=1, spec=SPEC, prestage_share=0.1, paced_for_s=10.5)
    assert late.words(now=110.0) == [0, 0]


# -- the standby group, on real processes -------------------------------------------------------

def _standby_peer(rank: int, port: int, joining: bool, out) -> None:  # pragma: no cover - runs in a child
    import torch
    import torch.distributed as dist

    from elastic.worker.groups import GroupGeneration, StandbyGroup, connect_store, shutdown_detached

    try:
        store = connect_store("127.0.0.1", port, 30)
        if not joining:
            serving = GroupGeneration.join(store, 1, rank, 2, timeout_s=20)
            serving.build_eplb_group()
        standby = StandbyGroup.form(store, 2, rank, 3, timeout_s=20)
        # the standby group moves a tensor while the serving group still reduces over its own ranks
        if rank == 0:
            dist.send(torch.arange(4.0), group=standby.pg, group_dst=2)
        elif rank == 2:
            got = torch.empty(4)
            dist.recv(got, group=standby.pg, group_src=0)
            assert got.tolist() == [0.0, 1.0, 2.0, 3.0], got
        if not joining:
            t = torch.ones(1)
            dist.all_reduce(t)
            assert t.item() == 2, "the serving group changed before the switch"
        group, detached = standby.install()
        assert len(detached) == (0 if joining else 2)  # the serving default group and its EPLB subgroup
        t = torch.ones(1)
        dist.all_reduce(t)  # the default group is now the standby one
        assert (t.item(), dist.get_rank(), dist.get_world_size()) == (3, rank, 3)
        group.build_eplb_group()  # a subgroup made after the switch gets the same name on every rank
        t = torch.ones(1)
        dist.all_reduce(t, group=group.eplb_group)
        assert t.item() == 3
        shutdown_detached(detached)
        group.destroy()
        out.put((rank, "ok"))
    except BaseException as exc:  # noqa: BLE001 - reported to the test
        out.put((rank, f"{type(exc).__name__}: {exc}"))


@pytest.mark.multiprocess
@pytest.mark.timeout(90)
def test_a_standby_group_carries_transfers_beside_the_serving_group_and_becomes_the_default_at_install():
    from elastic.worker.groups import open_store

    store = open_store("127.0.0.1", 0)
    ctx = mp.get_context("forkserver")  # the session's, torch already loaded (spawn: 3 fresh interpreters)
    out = ctx.Queue()
    procs = [ctx.Process(target=_standby_peer, args=(r, store.port, r == 2, out), daemon=True) for r in range(3)]
    for proc in procs:
        proc.start()
    try:
        results = dict(out.get(timeout=60) for _ in procs)
    finally:
        for proc in procs:
            proc.join(10)
            if proc.is_alive():
                proc.kill()
    assert results == {0: "ok", 1: "ok", 2: "ok"}


# -- scales on real workers ---------------------------------------------------------------------

def _reports(c, op, phase):
    return [r for by_pid in list(c._done.values()) for r in by_pid.values()
            if r.phase == phase and r.operation_id == op.id]


@pytest.mark.multiprocess
@pytest.mark.timeout(150)
@pytest.mark.parametrize("communicator", [*COMMUNICATORS, "gloo+rounds"])
def test_a_prepared_scale_moves_every_expert_before_the_pause_and_the_pause_only_switches(communicator):
    # gloo+rounds: with migration batching (every weight checked by assert_consistent)
    config = small_config(model=dict(num_layers=4, num_experts=8),
                          eplb=dict(communicator=communicator.removesuffix("+rounds"),
                                    enable_migration_batching=communicator.endswith("+rounds")))
    with running(config) as c:
        c.wait_for_step(15)
        for size in (4, 2):
            op = c.scale(size, timeout=120)
            assert op.status.value == "succeeded", op.error
            assert 0 < op.prepare["layers"] == op.prepare["layers_total"], op.prepare
            assert op.prepare["bytes_received"] > 0 and op.prepare["steps"] > 0  # moved while decoding
            rescale = _reports(c, op, "Rescale")
            assert rescale and all(r.detail["prepared"] for r in rescale)
            # nothing crossed the network in the pause, and nobody formed a group there
            assert op.bytes_moved == 0 and all(r.detail["bytes_received"] == 0 for r in rescale)
            assert all(r.detail["prestaged_layers"] == op.prepare["layers"] for r in rescale)
            c.wait_for_step(c.snapshot()["step"] + 10)
            assert_consistent(c, size)


@pytest.mark.multiprocess
@pytest.mark.timeout(150)
def test_what_does_not_fit_the_prestage_budget_moves_in_the_pause_and_every_slot_stays_exact():
    config = small_config(model=dict(num_layers=4, num_experts=8), scaling=dict(prestage_max_bytes=0))
    with running(config) as c:
        c.wait_for_step(15)
        up = c.scale(4, timeout=120)
        assert up.status.value == "succeeded", up.error
        c.wait_for_step(c.snapshot()["step"] + 10)
        down = c.scale(2, timeout=120)
        assert down.status.value == "succeeded", down.error
        # a survivor that takes over an expert needs spare memory for it: with none, its layers wait
        assert down.prepare["layers_total"] > 0, "nothing moved: the test proves nothing"
        assert down.prepare["layers"] < down.prepare["layers_total"] and down.bytes_moved > 0
        assert down.prepare["prestage_bytes"] == 0
        c.wait_for_step(c.snapshot()["step"] + 10)
        assert_consistent(c, 2)


@pytest.mark.multiprocess
@pytest.mark.timeout(150)
def test_a_slow_channel_spreads_the_pre_transfer_and_decoding_goes_on_between_its_layers():
    config = small_config(model=dict(num_layers=4, num_experts=8), scaling=dict(prestage_share=0.25))
    slow = [DelayTransfer(rank=r, seconds=0.05, generation=0) for r in range(2)]
    with running(config, faults=slow) as c:
        c.wait_for_step(15)
        op = c.scale(4, timeout=120)
        assert op.status.value == "succeeded", op.error
        layers = op.prepare["layers"]
        # each layer costs the old ranks at least 50 ms, so they hold about 150 ms after it
        assert layers == op.prepare["layers_total"] > 1
        assert op.prepare["seconds"] >= (layers - 1) * 0.05 / 0.25
        assert op.prepare["steps"] >= 2 * layers, op.prepare
        c.wait_for_step(c.snapshot()["step"] + 10)
        assert_consistent(c, 4)


@pytest.mark.multiprocess
@pytest.mark.timeout(150)
@pytest.mark.parametrize("communicator", COMMUNICATORS)
def test_joining_ranks_wait_out_holds_longer_than_the_collective_timeout(communicator):
    """0.25 s per layer at a 0.1 share: the old ranks hold each next layer about 2.3 s, past the
    1.5 s collective timeout of the standby group the joining ranks wait on."""
    config = small_config(model=dict(num_layers=3, num_experts=8), eplb=dict(communicator=communicator),
                          scaling=dict(prestage_share=0.1), timeouts=dict(collective=1.5, heartbeat=2.5))
    slow = [DelayTransfer(rank=r, seconds=0.25, generation=0) for r in range(2)]
    with running(config, faults=slow) as c:
        c.wait_for_step(10)
        op = c.scale(4, timeout=120)
        assert op.status.value == "succeeded", op.error
        assert op.prepare["layers"] == op.prepare["layers_total"] == 3
        assert op.prepare["seconds"] >= 2 * 0.25 / 0.1  # two holds of about 2.3 s each
        assert_consistent(c, 4)


@pytest.mark.multiprocess
@pytest.mark.timeout(150)
@pytest.mark.parametrize("communicator", COMMUNICATORS)
def test_a_joining_rank_killed_during_the_pre_transfer_fails_the_scale_before_any_pause(communicator):
    config = small_config(model=dict(num_layers=4, num_experts=8), scaling=dict(prestage_share=0.5),
                          eplb=dict(communicator=communicator), timeouts=dict(collective=4, heartbeat=5))
    # the first scale reserves generation 1 for its new group: rank 2 dies receiving its second layer
    kill = KillRank(rank=2, generation=1, in_phase="draining", after_layers=1)
    with running(config, faults=[kill]) as c:
        c.wait_for_step(15)
        op = c.scale(4, timeout=120)
        assert op.status.value == "failed" and "draining" in (op.error or ""), op.error
        assert not _reports(c, op, "Rescale"), "a rank paused for a scale that failed while preparing"
        # the old group never stopped decoding, and its weights were never touched
        c.wait_for_step(c.snapshot()["step"] + 10, timeout=30)
        assert c.snapshot()["state"] == "failed"
        recovered = c.recover(timeout=120)
        assert recovered.status.value == "succeeded", recovered.error
        assert_consistent(c, 2)
        again = c.scale(4, timeout=120)
        assert again.status.value == "succeeded", again.error
        c.wait_for_step(c.snapshot()["step"] + 10)
        assert_consistent(c, 4)


@pytest.mark.multiprocess
@pytest.mark.timeout(150)
def test_a_surviving_rank_killed_during_the_pre_transfer_breaks_the_group_and_recovery_keeps_every_expert():
    config = small_config(ep_size=3, model=dict(num_layers=4, num_experts=8), auto_recover=True,
                          scaling=dict(prestage_share=0.5), timeouts=dict(collective=4, heartbeat=5))
    kill = KillRank(rank=1, generation=0, in_phase="draining", after_layers=1)
    with running(config, faults=[kill]) as c:
        c.wait_for_step(15)
        op = c.scale(4, timeout=120)
        assert op.status.value == "failed", op.error
        wait_for_state(c, "running", timeout=90)
        assert c.snapshot()["ep_size"] == 2  # ranks 0 and 2 of the old group
        c.wait_for_step(c.snapshot()["step"] + 10)
        assert_consistent(c, 2)


@pytest.mark.parametrize("value, message", [
    (-1, "expected a number of bytes >= 0, got -1"),
    (True, "expected a number of bytes (or with a unit: '1GiB'), got True"),
    ("lots", "could not parse value and unit"),
])
def test_a_bad_prestage_budget_is_refused_naming_the_field(value, message):
    from pydantic import ValidationError

    from elastic.deployment import DeploymentConfig

    with pytest.raises(ValidationError, match="scaling.prestage_max_bytes") as info:
        DeploymentConfig(scaling={"prestage_max_bytes": value})
    assert message in str(info.value)
    with pytest.raises(ValidationError, match="scaling.prestage_share"):
        DeploymentConfig(scaling={"prestage_share": 0})


def test_retiring_standby_ranks_never_raises_when_one_is_already_gone():
    """A standby rank that died on its own between the liveness check and the kill (a killed
    joining rank reaped by the forkserver) once made the operation's error handler raise, so the
    operation held the machine for good and recover() was refused."""
    from elastic.control.executor import retire_standby
    from elastic.control.registry import WorkerRecord

    class Gone:
        def kill(self) -> None:
            raise ProcessLookupError(3, "No such process")

    class Alive:
        killed = False

        def kill(self) -> None:
            self.killed = True

    alive = Alive()
    records = [WorkerRecord(Gone(), 2, 1, standby=True), WorkerRecord(alive, 3, 1, standby=True)]
    retire_standby(records)  # type: ignore[arg-type]
    assert alive.killed and all(w.expected_exit for w in records)


def _settled_fds(pid: int) -> int:
    """The fewest open descriptors over half a second: a socket a thread is still closing counts once, not as a leak."""
    import os

    samples = []
    for _ in range(6):
        samples.append(len(os.listdir(f"/proc/{pid}/fd")))
        time.sleep(0.1)
    return min(samples)


@pytest.mark.multiprocess
@pytest.mark.timeout(180)
def test_failed_preparations_leave_the_serving_ranks_no_groups_sockets_or_threads_behind():
    config = small_config(model=dict(num_layers=4, num_experts=8), auto_recover=True, max_auto_recoveries=10,
                          scaling=dict(prestage_share=0.5), eplb=dict(communicator="gloo"),
                          timeouts=dict(collective=4, heartbeat=5))
    # every attempt's joining rank dies receiving: a kill without a generation fires once, so one per
    # generation an attempt may take (recoveries run at 2 ranks, where there is no rank 2)
    kills = [KillRank(rank=2, in_phase="draining", after_layers=1, generation=g) for g in range(1, 16)]
    with running(config, faults=kills) as c:
        c.wait_for_step(15)
        counts = []
        for _ in range(3):
            op = c.scale(3, timeout=120)
            assert op.status.value == "failed", op.error
            wait_for_state(c, "running", timeout=90)
            c.wait_for_step(c.snapshot()["step"] + 5)
            counts.append({w.rank: _settled_fds(w.handle.pid) for w in c.live_workers()})
        # each failed attempt's standby group is shut down: no attempt leaves more open than the first left
        # (a leak of even one descriptor per attempt puts the third two above the first)
        assert all(later[rank] <= counts[0][rank] for later in counts[1:] for rank in counts[0]), counts
        assert_consistent(c, 2)


@pytest.mark.multiprocess
@pytest.mark.timeout(120)
def test_a_slow_link_makes_the_pre_transfer_slower_but_not_overrun_the_draining_deadline():
    # 1.5 s per layer on rank 0, 4 layers, an 8 s draining deadline: pacing at the default share would
    # need about 60 s; the layers go back to back once holding would not let them end in time
    config = small_config(model=dict(num_layers=4, num_experts=8), eplb=dict(communicator="gloo", step_interval=100000),
                          scaling=dict(prestage_share=0.1), timeouts=dict(draining=8, collective=4, heartbeat=5))
    with running(config, faults=[DelayTransfer(rank=0, seconds=1.5, generation=0)]) as c:
        c.wait_for_step(10)
        op = c.scale(3, timeout=60)
        assert op.status.value == "succeeded", op.error
        assert op.prepare["layers"] == op.prepare["layers_total"] == 4 and op.prepare["seconds"] >= 4 * 1.5
        assert_consistent(c, 3)
