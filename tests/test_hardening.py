"""Regressions of the control-plane defects that outside probes found (issue 13), and of workers
that are still starting counted as lost (issue 20). Each test failed on the code before its fix."""

from __future__ import annotations

import os
import queue
import socket
import threading
import time
from types import SimpleNamespace

import pytest
import torch

from elastic.control.coordinator import Coordinator, OperationFailed, OperationStatus
from elastic.core import protocol as p
from elastic.core.errors import IdempotencyKeyReused, InvalidTransition, RebalanceFailed
from elastic.faults import DelayTransfer, HangBeforeStart, SlowPrepare, TornCommit
from elastic.launch.channel import StoreQueue
from elastic.launch.launchers import LocalLauncher
from elastic.worker.groups import open_store
from eplb.config import EPLBConfig
from eplb.model import ModelShape, ReferenceMoE
from eplb.placement import Placement
from eplb.plan import plan_layer
from eplb.state import (
    STAGED,
    STAGED_NEG,
    AsyncEPLBWorker,
    EPLBState,
    Finish,
    HandshakeMismatch,
    LayerReady,
    Proceed,
    WorkerFailed,
    batch_fingerprint,
)
from eplb.transfer import TransferStats
from tests.conftest import running, small_config
from tests.helpers import assert_consistent, wait_for_state


def _until(predicate, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return
        time.sleep(0.05)
    raise AssertionError(f"not within {timeout}s: {what}")


def _eplb(c: Coordinator, key: str) -> list:
    """``key`` of every live rank's EPLB statistics (from decode heartbeats; busy ones carry none)."""
    values = [getattr(w.heartbeat.eplb, key) for w in c.live_workers()
              if w.heartbeat is not None and w.heartbeat.eplb is not None]
    return values if len(values) == len(c.live_workers()) else [0]


# -- 1. the async EPLB runtime belongs to one generation -----------------------------------------

@pytest.mark.timeout(10)
def test_an_answer_for_another_rebalance_or_generation_is_a_loud_error_not_a_step_ahead():
    worker = AsyncEPLBWorker(config=EPLBConfig(use_async=True), weights=lambda: [], staging=[], group=None,
                             rank=0, generation=3)
    worker.start()
    try:
        worker._inbox.put(Proceed(rebalance_id=1, generation=3))  # no rebalance was ever taken up
        event = worker.events.get(timeout=5)
        assert isinstance(event, WorkerFailed) and event.error_type == HandshakeMismatch.__name__, event
        worker._last_job = 7  # rebalance 7 ended here (failed, aborted everywhere): its late Finish needs no answer
        worker._inbox.put(Finish(rebalance_id=7, generation=3))
        worker._inbox.put(Finish(rebalance_id=7, generation=2))  # a record of the previous generation
        event = worker.events.get(timeout=5)
        assert isinstance(event, WorkerFailed) and "generation 2" in event.message, event
        with pytest.raises(queue.Empty):
            worker.events.get(timeout=0.2)  # and nothing about the late Finish of rebalance 7
    finally:
        assert worker.stop(5)


@pytest.mark.timeout(20)
def test_ranks_that_staged_different_batches_refuse_them_everywhere_instead_of_committing():
    # two ranks whose rebalances diverged (they once did, after a torn commit's recovery) used to
    # commit each its own layer and row at the same agreed step: wrong weights, silently
    shape = ModelShape(num_layers=2, num_experts=4, hidden_size=4, intermediate_size=4)
    placement = Placement.static(2, 4, 6)  # rank 0 holds slots 0-2: experts 0, 1, 2 in every layer
    model = ReferenceMoE(shape, placement, 0, 2)
    state = EPLBState(EPLBConfig(use_async=True, step_interval=1000), model, placement, 0, 2)
    state.start_worker(None, 0)
    assert state.run is not None
    mine = torch.tensor([0, 1, 3, 2, 0, 1])  # slot 2 takes expert 3
    rank_plan = plan_layer(placement.physical_to_logical[1], mine, 3, 3, [0, 1], [0, 1]).for_rank(0)
    for staged, want in zip(state.run.slots[0], model.canonical_expert(1, 3)):
        staged[2].copy_(want)  # what the transfer received
    peer = batch_fingerprint([LayerReady(1, 1, torch.tensor([0, 1, 2, 3, 1, 0]), None, TransferStats())])

    def stage(rebalance_id: int) -> list[int]:
        assert state.run is not None
        state.run.in_flight = rebalance_id
        state.run.worker.events.put(LayerReady(rebalance_id, 1, mine, rank_plan, TransferStats()))
        return state.control()

    try:
        words = stage(1)
        assert words[STAGED] == batch_fingerprint([LayerReady(1, 1, mine.clone(), rank_plan, TransferStats())])
        reduced = [0, 0, 1, max(words[STAGED], peer), max(words[STAGED_NEG], -peer)]  # the peer staged another row
        assert not state.commits_now(reduced)
        state.after_sync(reduced)
        assert state.placement.equals(placement) and model.verify() == []  # nothing committed
        assert state.stats.rebalances_failed == 1 and "StagedBatchesDiffer" in (state.stats.last_error or "")
        assert state.in_flight is None
        state.after_sync(stage(2))  # every rank staged this batch: it commits
        assert state.placement.physical_to_logical[1].tolist() == mine.tolist() and model.verify() == []
        assert state.stats.layers_committed == 1
    finally:
        assert state.stop_worker(5)


@pytest.mark.multiprocess
@pytest.mark.timeout(150)
def test_paced_async_eplb_after_a_torn_commit_and_recovery_keeps_every_rank_on_the_same_weights():
    # the pacing countdown of the broken generation used to leak into the recovered one and send
    # its thread a Proceed one handshake early: different digests, wrong weights, while "running"
    config = small_config(eplb=dict(async_layer_interval=3, step_interval=6, window_size=6),
                          timeouts=dict(collective=2, heartbeat=3))
    with running(config, faults=[TornCommit(rank=1, at_commit=1, generation=0)]) as c:
        wait_for_state(c, "failed", timeout=60)
        assert "group broken, no worker lost" in c.machine.failure_reason
        op = c.recover(timeout=60)
        assert op.status == OperationStatus.SUCCEEDED, op.error
        committed = max(_eplb(c, "layers_committed"))
        _until(lambda: min(_eplb(c, "layers_committed")) >= committed + 4, 60, "4 more paced layer commits")
        assert c.machine.state.value == "running"
        assert_consistent(c, 2)


@pytest.mark.multiprocess
@pytest.mark.timeout(150)
def test_after_a_torn_commit_every_rank_starts_the_next_scheduled_rebalance_at_the_same_step():
    # the rank that broke skipped the torn step's EPLB decision, so its countdown to the next scheduled
    # rebalance was one step behind; the recovery shared the window but not the countdown, and rank 0
    # started the next rebalance alone (its transfer waited on a peer that never came), folded one window
    # more into its load estimate, and from the restart on the ranks committed other layers at the same
    # steps: wrong weights in a "running" deployment. The flaky case needed the torn commit to come so
    # soon after its rebalance's start that the countdowns had not run out by the recovery's Resume;
    # slow steps (the first layer stages at once) and a long interval make it so every time.
    config = small_config(eplb=dict(async_layer_interval=3, step_interval=24, window_size=6, transfer_timeout_s=10),
                          timeouts=dict(collective=2, heartbeat=3), step_delay_s=0.1)
    with running(config, faults=[TornCommit(rank=1, at_commit=1, generation=0)]) as c:
        wait_for_state(c, "failed", timeout=60)
        op = c.recover(timeout=60)
        assert op.status == OperationStatus.SUCCEEDED, op.error

        def started() -> dict[int, list[int]]:  # rank -> steps of its rebalance starts in generation 1
            steps: dict[int, list[int]] = {0: [], 1: []}
            for e in list(c.events):
                if e.generation == 1 and e.kind == "rebalance_started":
                    steps[e.rank].append(e.step)
            return steps

        _until(lambda: all(started().values()), 30, "a rebalance started on every rank after the recovery")
        steps = started()
        assert steps[0][0] == steps[1][0], f"the first rebalance after the recovery started at steps {steps} by rank"
        committed = max(_eplb(c, "layers_committed"))
        _until(lambda: min(_eplb(c, "layers_committed")) >= committed + 4, 60, "4 more paced layer commits")
        failed = [(e.rank, e.data) for e in list(c.events) if e.generation == 1 and e.kind == "rebalance_failed"]
        assert not failed, failed
        assert_consistent(c, 2)


# -- 2. commands reach every worker in order, without gaps ---------------------------------------

class SlowInboxLauncher(LocalLauncher):
    """A local launcher whose inbox puts take 2 ms, like the store channel of the command launcher."""

    def launch(self, spec):
        worker = super().launch(spec)
        inner_put = worker.inbox.put

        def slow_put(item, *args, **kwargs):
            time.sleep(0.002)
            inner_put(item, *args, **kwargs)

        worker.inbox.put = slow_put
        return worker


@pytest.mark.multiprocess
@pytest.mark.timeout(150)
def test_concurrent_api_callers_on_a_slow_channel_never_break_the_group():
    config = small_config(eplb=dict(step_interval=1000))
    coordinator = Coordinator(config, launcher=SlowInboxLauncher(capacity=4))
    with coordinator as c:
        c.wait_for_step(5)
        errors: list[BaseException] = []

        def caller() -> None:
            try:
                for _ in range(6):
                    c.rebalance(timeout=30)
                    c.verify(timeout=30)
            except BaseException as exc:  # noqa: BLE001 - collected and asserted below
                errors.append(exc)

        threads = [threading.Thread(target=caller) for _ in range(3)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(120)
        assert not errors, errors
        assert not list(c._errors), [f"{e.error_type}: {e.message}" for e in c._errors]
        assert c.machine.state.value == "running"
        assert_consistent(c, 2)


@pytest.mark.timeout(20)
def test_an_inbox_waits_for_a_slow_producer_and_never_skips_its_command():
    store = open_store("127.0.0.1", 0)
    inbox = StoreQueue(store, "t/inbox", hole_timeout_s=None)
    store.add("t/inbox/tail", 1)  # a producer took number 1 and is slow to write it
    StoreQueue(store, "t/inbox").put("second")
    with pytest.raises(queue.Empty):
        inbox.get(timeout=2.5)  # longer than the reports queue's hole timeout: still not skipped
    import pickle

    store.set("t/inbox/1", pickle.dumps("first"))
    assert [inbox.get(timeout=2), inbox.get(timeout=2)] == ["first", "second"]


# -- 3. a failure on a healthy group stops its EPLB; the first recovery succeeds ---------------------

@pytest.mark.multiprocess
@pytest.mark.timeout(150)
def test_a_scale_that_fails_while_the_group_is_healthy_halts_eplb_and_recovers_at_the_first_attempt():
    # the joining rank takes longer to prepare than worker_start: the scale fails in draining
    config = small_config(eplb=dict(step_interval=4, window_size=4),
                          timeouts=dict(worker_start=4, collective=3, heartbeat=4))
    with running(config, faults=[SlowPrepare(rank=2, seconds=30, generation=1)]) as c:
        c.wait_for_step(10)
        op = c.scale(3, timeout=60)
        assert op.status == OperationStatus.FAILED and "did not finish draining" in op.error, op.error
        assert c.machine.state.value == "failed"
        _until(lambda: {str(w.heartbeat.state) for w in c.live_workers()} == {"halted"}
               and all(w.heartbeat.eplb is not None for w in c.live_workers()), 20,
               "every rank halted and decoding (its decode heartbeats carry the EPLB statistics)")
        started = max(_eplb(c, "rebalances_started"))
        step = c.snapshot()["step"]
        c.wait_for_step(step + 12, timeout=30)  # decoding goes on ...
        assert max(_eplb(c, "rebalances_started")) == started  # ... and no rebalance starts
        assert c.snapshot()["serving"] is True
        assert all(not w.handle.is_alive() for w in c.workers.values() if w.generation == 1)  # the joiner is retired
        recovery = c.recover(timeout=60)
        assert recovery.status == OperationStatus.SUCCEEDED, recovery.error  # at the first attempt
        assert_consistent(c, 2)


# -- 4. a transient transfer error does not turn the EPLB off for good -------------------------------

@pytest.mark.multiprocess
@pytest.mark.timeout(150)
def test_one_transfer_hiccup_rebuilds_the_eplb_group_and_later_rebalances_commit():
    config = small_config(eplb=dict(transfer_timeout_s=0.5, step_interval=6, window_size=6),
                          timeouts=dict(collective=4, heartbeat=6))
    with running(config, faults=[DelayTransfer(rank=1, seconds=1.5, times=1, generation=0)]) as c:
        _until(lambda: min(_eplb(c, "rebalances_failed") or [0]) >= 1, 60, "the hiccup fails one rebalance")
        failed_commits = max(_eplb(c, "layers_committed"))
        _until(lambda: min(_eplb(c, "layers_committed")) >= failed_commits + 3, 60, "commits after the hiccup")
        health = c.snapshot()["eplb_health"]
        assert health["status"] == "healthy" and health["restarts"] >= 1, health
        from prometheus_client import generate_latest

        from elastic.service.metrics import build_registry

        exposition = generate_latest(build_registry(c)).decode()
        assert "elastic_ep_eplb_healthy 1.0" in exposition and "elastic_ep_eplb_restarts_total" in exposition
        assert "TransferTimeout" in (health["last_error"] or "") or "failed" in (health["last_error"] or ""), health
        assert c.machine.state.value == "running"
        assert_consistent(c, 2)


# -- 6. nothing grows with every scale cycle ------------------------------------------------------

def _open_fds() -> int:
    return len(os.listdir("/proc/self/fd"))


@pytest.mark.multiprocess
@pytest.mark.timeout(240)
def test_scale_cycles_leave_no_records_queues_store_keys_or_fds_behind():
    config = small_config(model=dict(num_layers=2, num_experts=4), eplb=dict(num_redundant_experts=4),
                          operation_history=4)
    with running(config) as c:
        c.wait_for_step(3)

        def cycle(pause: bool = True) -> None:
            for size in (3, 2):
                op = c.scale(size, timeout=60)
                assert op.status == OperationStatus.SUCCEEDED, op.error
            if pause:  # retired workers' records are forgotten a moment (2 s) after they exit
                deadline = time.monotonic() + 10
                while len(c.workers) > 2:
                    assert time.monotonic() < deadline, f"{len(c.workers) - 2} retired workers' records kept 10 s on"
                    time.sleep(0.05)

        for _ in range(2):
            cycle()  # warm up: the forkserver, the store's first keys
        before = (_open_fds(), threading.active_count(), c._store.num_keys(), len(c.workers))
        for _ in range(3):
            cycle()
        after = (_open_fds(), threading.active_count(), c._store.num_keys(), len(c.workers))
        assert after[0] <= before[0] + 2, f"fds {before[0]} -> {after[0]}"
        assert after[1] <= before[1] + 1, f"threads {before[1]} -> {after[1]}"
        assert after[2] <= before[2] + 4, f"store keys {before[2]} -> {after[2]}"
        assert after[3] == before[3] == 2, f"worker records {before[3]} -> {after[3]}"
        assert len(c.operations) <= 4 and len(c.launcher._workers) == 2
        assert len(c._done) <= 64 and not any(g <= c.machine.generation for g in c._attempted)
        # back to back, as an autoscaler may scale: a worker retired before the running operation
        # began is forgotten all the same (only those of the last ~2 s may still be kept)
        for _ in range(4):
            cycle(pause=False)
        kept = len(c.workers) - 2
        assert kept <= 3, f"{kept} retired workers' records kept after 4 back-to-back cycles"
        # a kept record holds its worker's pidfd and queue pipes (5 fds here) until it is forgotten,
        # so the fds are counted once the last ones are (a fixed bound per kept record failed as
        # soon as the cycles got fast enough to keep 3)
        deadline = time.monotonic() + 10
        while len(c.workers) > 2:
            assert time.monotonic() < deadline, f"{len(c.workers) - 2} retired workers' records kept 10 s on"
            time.sleep(0.05)
        assert _open_fds() <= before[0] + 2, f"fds {before[0]} -> {_open_fds()} after the retired workers were forgotten"


@pytest.mark.multiprocess
@pytest.mark.timeout(90)
def test_a_step_watch_heartbeat_refreshes_liveness_and_nothing_else():
    """The step watch's heartbeat says only "alive": it must not replace what the worker last
    reported (a busy phase's state, which recovery waits out; the counters metrics read)."""
    with running(small_config()) as c:
        c.wait_for_step(3)
        w = c.live_workers()[0]
        kept = w.heartbeat
        w.last_report = time.monotonic() - 3.0
        c._file(p.Heartbeat(rank=w.rank, generation=w.generation + 7, pid=w.handle.pid, at=time.time(), step=0,
                            state=p.WorkerMode.RESCALING, waiting=True))
        assert time.monotonic() - w.last_report < 1.0  # alive
        assert w.generation == 0  # what the worker said before stands
        assert w.heartbeat is kept or (w.heartbeat is not None and not w.heartbeat.waiting), w.heartbeat
        assert w.heartbeat is None or w.heartbeat.state != p.WorkerMode.RESCALING


# -- 7. error attribution uses sequence numbers, never another host's clock ------------------------

@pytest.mark.multiprocess
@pytest.mark.timeout(90)
def test_an_old_error_from_a_worker_with_a_fast_clock_does_not_fail_a_new_command():
    with running(small_config()) as c:
        c.wait_for_step(3)
        w = c.live_workers()[0]
        # an error the worker reported before the next command was taken up, stamped by a clock
        # an hour ahead of this host's
        c._file(p.WorkerError(rank=w.rank, generation=w.generation, pid=w.handle.pid, at=time.time() + 3600,
                              step=1, where="decode", error_type="Skewed", message="old news",
                              seq=0))
        verdict = c.verify(timeout=30)
        assert sorted(verdict) == [0, 1]


# -- 8. API semantics ------------------------------------------------------------------------------

@pytest.mark.multiprocess
@pytest.mark.timeout(120)
def test_idempotency_keys_name_one_request_and_expire():
    now = [1000.0]
    # the one clock moves liveness too: the jump past the key's lifetime stays inside the heartbeat deadline
    config = small_config(idempotency_ttl_s=60, timeouts=dict(heartbeat=120))
    coordinator = Coordinator(config, clock=lambda: now[0] + time.monotonic())
    with coordinator as c:
        op = c.scale(3, idempotency_key="k1", timeout=60)
        assert op.status == OperationStatus.SUCCEEDED, op.error
        assert c.scale(3, idempotency_key="k1") is op  # the same request: the same operation
        with pytest.raises(IdempotencyKeyReused, match="op-"):
            c.scale(2, idempotency_key="k1")
        assert c.size == 3  # nothing started
        now[0] += 61  # past the key's lifetime: a new request
        again = c.scale(2, idempotency_key="k1", timeout=60)
        assert again is not op and again.status == OperationStatus.SUCCEEDED, again.error


@pytest.mark.multiprocess
@pytest.mark.timeout(90)
def test_recover_is_refused_at_once_when_not_failed_even_while_a_rank_reports_busy():
    with running(small_config(timeouts=dict(collective=20, heartbeat=25))) as c:
        c.wait_for_step(3)
        w = c.live_workers()[0]
        busy = p.Heartbeat(rank=w.rank, generation=w.generation, pid=w.handle.pid, at=time.time(),
                           step=w.heartbeat.step, state=p.WorkerMode.RESCALING)
        c._file(busy)
        started = time.monotonic()
        with pytest.raises(InvalidTransition):
            c.recover()
        assert time.monotonic() - started < 1.0  # not after collective + 5 s


@pytest.mark.multiprocess
@pytest.mark.timeout(120)
def test_rebalance_says_failed_when_a_rank_refuses_because_its_group_broke():
    config = small_config(eplb=dict(step_interval=4, window_size=4), timeouts=dict(collective=3, heartbeat=20))
    with running(config, faults=[TornCommit(rank=1, at_commit=1, generation=0)]) as c:
        _until(lambda: any(str(w.heartbeat.state) == "broken" for w in c.live_workers() if w.heartbeat), 60,
               "rank 1 broken")
        assert c.machine.state.value == "running"  # for one heartbeat deadline, nobody is lost yet
        with pytest.raises(RebalanceFailed, match="RebalanceNow refused: the group is broken"):
            c.rebalance(timeout=15)


@pytest.mark.multiprocess
@pytest.mark.timeout(120)
def test_wait_for_step_raises_on_failed_after_an_operation_has_run():
    config = small_config(timeouts=dict(collective=3, heartbeat=4))
    with running(config) as c:
        assert c.scale(3, timeout=60).status == OperationStatus.SUCCEEDED
        c.live_workers()[1].handle.kill()
        started = time.monotonic()
        with pytest.raises(OperationFailed, match="worker lost"):
            c.wait_for_step(10**9, timeout=60)
        assert time.monotonic() - started < 30


# -- 9. a sync-mode transfer timeout breaks the group; it does not kill the worker -------------------

@pytest.mark.multiprocess
@pytest.mark.timeout(150)
def test_a_sync_transfer_timeout_is_a_broken_group_and_no_rank_counts_as_lost():
    config = small_config(eplb=dict(use_async=False, transfer_timeout_s=0.5, step_interval=6, window_size=6),
                          timeouts=dict(collective=3, heartbeat=4))
    with running(config, faults=[DelayTransfer(rank=1, seconds=2.0, times=1, generation=0)]) as c:
        wait_for_state(c, "failed", timeout=60)
        assert "group broken, no worker lost" in c.machine.failure_reason, c.machine.failure_reason
        assert len(c.live_workers()) == 2
        op = c.recover(timeout=60)
        assert op.status == OperationStatus.SUCCEEDED, op.error
        assert_consistent(c, 2)


# -- 10. a worker never tears down a group its EPLB thread may still use -------------------------------

def test_a_worker_whose_eplb_thread_does_not_stop_leaves_without_destroying_the_group():
    from elastic.worker.liveness import StepWatch
    from elastic.worker.process import Worker

    destroyed = []
    worker = Worker.__new__(Worker)  # the teardown alone: no process group is needed to decide it
    worker.ctx = SimpleNamespace(stopping=True, rank=0, spec=SimpleNamespace(collective_timeout_s=0.1),
                                 eplb_if_any=SimpleNamespace(stop_worker=lambda timeout: False),
                                 group=SimpleNamespace(destroy=lambda: destroyed.append("group")),
                                 comm=SimpleNamespace(close=lambda: destroyed.append("comm")))
    worker.start = lambda: None
    worker.step_watch = StepWatch(lambda waited: None, interval_s=0.1, bound_s=1.0)
    worker.run()
    assert destroyed == []
    worker.ctx.eplb_if_any = SimpleNamespace(stop_worker=lambda timeout: True)
    worker.run()
    assert destroyed == ["group", "comm"]


# -- 11. shutdown closes the store and joins the operation threads -----------------------------------

@pytest.mark.multiprocess
@pytest.mark.timeout(90)
def test_shutdown_closes_the_store_and_leaves_no_thread_behind():
    c = Coordinator(small_config())
    c.start()
    port = c._store.port
    c.scale(3, wait=False)
    c.shutdown()
    assert not [t.name for t in threading.enumerate() if t.name.startswith(("operation-", "coordinator-"))]
    with pytest.raises(OSError):
        socket.create_connection(("127.0.0.1", port), timeout=2).close()


# -- issue 20: a worker still starting or loading is not lost ---------------------------------------

@pytest.mark.multiprocess
@pytest.mark.timeout(150)
def test_command_launcher_starts_four_workers_whose_import_outlasts_the_heartbeat():
    from elastic.deployment import LauncherConfig

    remote = ["{python}", "-m", "elastic.launch.remote_worker", "--store", "{store}", "--worker-id", "{worker_id}"]
    config = small_config(ep_size=4, max_ep_size=4, model=dict(num_layers=2, num_experts=8),
                          timeouts=dict(collective=1.5, heartbeat=2.0, worker_start=90),
                          launcher=LauncherConfig(kind="command", template=remote, hosts=[{"name": "h"}]))
    started = time.monotonic()
    # four fresh Pythons on two cores import torch for longer than the 2 s heartbeat before they report
    # (gloo's connect, right after the rendezvous, waits for the peers' addresses for one collective
    # timeout: 0.5 s was too short for it on two loaded cores)
    with running(config) as c:
        assert time.monotonic() - started > 2.0
        assert c.machine.state.value == "running"
        assert_consistent(c, 4)


@pytest.mark.multiprocess
@pytest.mark.timeout(60)
def test_a_worker_that_hangs_before_its_first_report_is_lost_at_worker_start():
    config = small_config(timeouts=dict(worker_start=4, collective=1, heartbeat=1.5))
    c = Coordinator(config, faults=(HangBeforeStart(rank=1),))
    started = time.monotonic()
    try:
        with pytest.raises(OperationFailed, match=r"rank 1 .*sent no report within worker_start \(4s\)"):
            c.start()
        assert 3.5 < time.monotonic() - started < 15
    finally:
        c.shutdown()


@pytest.mark.multiprocess
@pytest.mark.timeout(120)
def test_a_scale_up_whose_joiner_loads_slowly_succeeds_within_worker_start():
    config = small_config(timeouts=dict(worker_start=30, collective=1.5, heartbeat=2))
    events = []
    with running(config, faults=[SlowPrepare(rank=2, seconds=5, generation=1)]) as c:
        c.subscribe(lambda kind, data: events.append(data) if kind == "heartbeat" and data.get("progress") else None)
        op = c.scale(3, timeout=60)
        assert op.status == OperationStatus.SUCCEEDED, op.error
        assert op.phases["draining"]["seconds"] > 4.5  # the old group decoded while the joiner loaded
        assert any(e["progress"][0].startswith("loading weights") and e["rank"] == 2 for e in events), events[:3]
        assert_consistent(c, 3)


@pytest.mark.multiprocess
@pytest.mark.timeout(120)
def test_a_scale_up_whose_joiner_loads_past_worker_start_fails_cleanly_and_retires_it():
    config = small_config(timeouts=dict(worker_start=3, collective=1.5, heartbeat=2))
    with running(config, faults=[SlowPrepare(rank=2, seconds=20, generation=1)]) as c:
        c.wait_for_step(3)
        op = c.scale(3, timeout=60)
        assert op.status == OperationStatus.FAILED and "ranks [2] did not finish draining" in op.error, op.error
        joiner = [w for w in c.workers.values() if w.generation == 1]
        assert all(not w.handle.is_alive() for w in joiner)
        assert c.recover(timeout=60).status == OperationStatus.SUCCEEDED
        assert_consistent(c, 2)


# -- lost workers come back (replace_lost) ----------------------------------------------------------

@pytest.mark.multiprocess
@pytest.mark.timeout(150)
def test_with_replace_lost_a_recovery_that_shrank_the_group_is_followed_by_a_scale_back():
    config = small_config(ep_size=3, max_ep_size=4, model=dict(num_layers=3, num_experts=8),
                          eplb=dict(num_redundant_experts=4), auto_recover=True, replace_lost=True,
                          timeouts=dict(collective=3, heartbeat=4))
    with running(config) as c:
        c.wait_for_step(5)
        c.live_workers()[2].handle.kill()
        wait_for_state(c, "running", timeout=90, generation=2)  # recovery (1), then the scale back (2)
        ops = c.list_operations()
        assert [o["kind"] for o in ops[:2]] == ["scale", "recover"], ops[:2]
        assert ops[0]["target_size"] == 3 and ops[0]["cause"] == f"replace_lost after {ops[1]['id']}"
        assert ops[1]["target_size"] == 2
        assert_consistent(c, 3)


@pytest.mark.multiprocess
@pytest.mark.timeout(120)
def test_survivors_too_few_to_hold_the_model_recover_with_fresh_workers():
    # 8 experts in 6 slots per rank: the one survivor cannot hold them all; the recovery adds one
    config = small_config(ep_size=2, max_ep_size=3, model=dict(num_layers=3, num_experts=8),
                          eplb=dict(num_redundant_experts=4), timeouts=dict(collective=3, heartbeat=4))
    with running(config) as c:
        c.wait_for_step(5)
        c.live_workers()[1].handle.kill()
        wait_for_state(c, "failed", timeout=60)
        op = c.recover(timeout=90)
        assert op.status == OperationStatus.SUCCEEDED, op.error
        assert op.target_size == 2 and c.size == 2
        assert_consistent(c, 2)


@pytest.mark.multiprocess
@pytest.mark.timeout(120)
def test_a_rebalance_started_in_the_same_step_as_a_drain_is_drained_not_left_in_flight():
    # the scales move everything in the pause (prepare off): the 1 s per layer link below would
    # otherwise also pace six pre-transfers, and this test is about the drain
    config = small_config(eplb=dict(step_interval=100000, window_size=4), step_delay_s=0.02,
                          scaling=dict(prepare=False))
    with running(config, faults=[DelayTransfer(rank=0, seconds=1.0)]) as c:
        c.wait_for_step(8)
        for size in (3, 2, 3, 2, 3, 2):
            # the RebalanceNow and the scale's Drain reach the ranks within one decode step
            asker = threading.Thread(target=lambda: c.rebalance(timeout=30))
            asker.start()
            op = c.scale(size, timeout=90)
            asker.join(40)
            assert op.status == OperationStatus.SUCCEEDED, op.error
        assert_consistent(c, 2)


# -- a dying worker cannot silence the others' reports ----------------------------------------------

def _send_from_child(outbox, hold_lock: bool) -> None:  # a worker's reporting, in a child process
    if hold_lock:
        outbox._wlock.acquire()  # as a worker killed in the middle of a write leaves it
        os._exit(17)
    for i in range(3):
        outbox.put(("report", i))
    time.sleep(0.5)  # the feeder thread flushes before the process leaves


@pytest.mark.multiprocess
@pytest.mark.timeout(60)
def test_a_worker_that_dies_holding_its_report_queues_lock_does_not_stop_the_others_reports():
    """Every local worker reports on a queue of its own: one that dies mid-write (holding the
    queue's cross-process write lock) leaves the other workers' reports flowing. With one queue
    shared by all, the coordinator heard nothing more from anyone and declared every worker lost."""
    import multiprocessing as mp
    import queue as queue_module

    from elastic.launch.launchers import WorkerReports

    ctx = mp.get_context("forkserver")
    reports = WorkerReports()
    dying, living = ctx.Queue(), ctx.Queue()
    reports.add(dying)
    reports.add(living)
    killed = ctx.Process(target=_send_from_child, args=(dying, True))
    killed.start()
    dying._writer.close()  # as LocalLauncher.launch does: the child holds the write end
    killed.join(30)
    sender = ctx.Process(target=_send_from_child, args=(living, False))
    sender.start()
    living._writer.close()
    got = []
    deadline = time.monotonic() + 20
    while len(got) < 3 and time.monotonic() < deadline:
        try:
            got.append(reports.get(timeout=0.2))
        except queue_module.Empty:
            pass
    sender.join(30)
    reports.close()
    assert got == [("report", 0), ("report", 1), ("report", 2)]
