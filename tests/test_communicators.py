"""Transfer communicators (eplb.communicator): gloo and NIXL on CPU, through the executor and the workers.

- The transfer suite of ``test_transfer`` (random plans over 4 ranks, every slot bit-exact)
  runs once per communicator; NIXL reads into registered staging buffers.
- Async EPLB and a 2 -> 4 -> 2 scale cycle run on real workers with NIXL selected: weights
  verified, one metadata exchange per generation, nothing left registered after scale-down.
- A NIXL peer that stops answering gives a typed timeout, never a hang; a rank that refuses
  its part fails the layer on every rank at once (the end-of-layer all-reduce).

NCCL shares :class:`TorchCommunicator` with gloo; it needs GPUs and is not tested here.
"""

from __future__ import annotations

import os
import signal
import threading
import time

import pytest
import torch

from eplb.communicator import (
    CommunicatorUnavailable,
    NixlCommunicator,
    TorchCommunicator,
    _Backoff,
    make_communicator,
    nixl_available,
    resolve_communicator,
)
from eplb.config import EPLBConfig
from eplb.plan import plan_layer
from eplb.transfer import TransferError, TransferTimeout, commit_layer, execute_layer, materialize, op_batches
from tests.distributed import run_distributed
from tests.test_transfer import (
    GARBAGE,
    SHAPES,
    STUCK_NEW,
    STUCK_OLD,
    WORLD,
    assert_slots,
    expert_weights,
    garbage,
    make_case,
    slot_weights,
)

needs_nixl = pytest.mark.skipif(not nixl_available(), reason="NIXL is not installed (pip install '.[nixl]')")
COMMUNICATORS = ["gloo", pytest.param("nixl", marks=needs_nixl)]


def _communicator(name: str):
    return NixlCommunicator() if name == "nixl" else TorchCommunicator(name)


def _test_store(tag: str):
    """A store for the test's metadata (workers of ``run_distributed`` share the default group's)."""
    import torch.distributed as dist
    from torch.distributed.distributed_c10d import _get_default_store

    return dist.PrefixStore(f"comm-test/{tag}/", _get_default_store())


# ---------------------------------------------------------------------------------------------
# choosing a communicator (in process)
# ---------------------------------------------------------------------------------------------


def test_resolve_and_config():
    assert resolve_communicator("gloo", "gloo") == "gloo"
    assert resolve_communicator("auto", "gloo") == ("nixl" if nixl_available() else "gloo")
    assert resolve_communicator("auto", "nccl") == ("nixl" if nixl_available() else "nccl")
    with pytest.raises(CommunicatorUnavailable, match="backend is 'gloo'"):
        resolve_communicator("nccl", "gloo")
    with pytest.raises(ValueError, match="unknown communicator"):
        resolve_communicator("mpi", "gloo")
    assert isinstance(make_communicator("gloo"), TorchCommunicator)
    assert EPLBConfig(communicator="nixl").communicator == "nixl"
    with pytest.raises(ValueError):
        EPLBConfig(communicator="ucx")


@needs_nixl
def test_a_polling_wait_looks_again_at_once_then_backs_off_to_its_cap_and_never_sleeps_past_its_deadline():
    backoff = _Backoff(first=1e-4, cap=4e-4)
    far = time.monotonic() + 60
    pauses = []
    for _ in range(5):
        pauses.append(backoff.pause)
        backoff.sleep(far)
    assert pauses == [0.0, 1e-4, 2e-4, 4e-4, 4e-4]
    slow = _Backoff(first=30.0, cap=30.0, pause=30.0)
    started = time.monotonic()
    slow.sleep(started + 0.05)
    assert time.monotonic() - started < 1.0  # the 30 s pause was cut to the deadline's 50 ms


def test_nixl_registrations_follow_the_tensors():
    """Lazy registration, adopt of incoming weights, deregistration before release (one process)."""
    comm = NixlCommunicator()
    old = [slot_weights(0, [0, 1])]
    new = [garbage(2)]
    staging = garbage(2)
    comm.set_weights(old)
    comm.add_buffer(staging)
    nbytes = sum(t.numel() * t.element_size() for t in old[0])
    assert comm.stats()["registered_bytes"] == 2 * nbytes and comm.stats()["registered_regions"] == 2
    comm.set_weights([list(old[0])])  # the same tensors: not registered again
    assert comm.stats()["registrations"] == 2
    comm.set_incoming(new)
    assert comm.stats()["registered_regions"] == 3
    comm.adopt_incoming()  # the old weights are deregistered, the new ones are the weights now
    stats = comm.stats()
    assert stats["registered_regions"] == 2 and stats["deregistrations"] == 1
    assert comm._weights.tensors[0] is new[0][0]
    comm.remove_buffer(staging)
    assert comm.stats()["registered_regions"] == 1
    comm.close()
    assert comm.stats()["registered_regions"] == 0 and comm.stats()["deregistrations"] == 3


# ---------------------------------------------------------------------------------------------
# Multi-process: the random-plan transfer suite, per communicator
# ---------------------------------------------------------------------------------------------


def body_random_layers(rank: int, world_size: int, name: str, seed: int, num_layers: int,
                       batching: bool = False) -> dict:
    """Every layer of make_case on one group; weights registered once, every slot verified."""
    comm = _communicator(name)
    comm.bind(0, _test_store(f"{name}-{seed}"))
    cases = [make_case(layer, seed) for layer in range(num_layers)]
    olds, stagings, plans = [], [], []
    for layer, (_kind, old_row, new_row, s_old, s_new, old_holder, new_holder, _) in enumerate(cases):
        plan = plan_layer(old_row, new_row, s_old, s_new, old_holder, new_holder)
        rp = plan.for_rank(rank)
        plans.append(plan)
        olds.append(slot_weights(layer, old_row[rp.old_rank * s_old:(rp.old_rank + 1) * s_old])
                    if rp.old_rank is not None else None)
        stagings.append(garbage(s_new) if rp.new_rank is not None else None)
    comm.set_weights(olds)  # like a model's expert weights: every layer, once
    for staging in stagings:
        if staging is not None:
            comm.add_buffer(staging)
    out = {"sends": 0, "recvs": 0, "bytes_received": 0, "kinds": set(), "requests": 0, "requests_plain": 0,
           "moving_layers": sum(1 for plan in plans if plan.num_transfers > 0)}
    for layer, case in enumerate(cases):
        kind, old_row, new_row, s_old, s_new, _, _, max_ops = case
        plan, old, staging = plans[layer], olds[layer], stagings[layer]
        rp = plan.for_rank(rank)
        old_copy = [t.clone() for t in old] if old is not None else None
        stats = execute_layer(plan, rank, old, staging, timeout=20.0, max_ops_per_batch=max_ops, layer=layer,
                              reload_fn=lambda e, layer=layer: expert_weights(layer, e), communicator=comm,
                              migration_batching=batching)
        assert stats.num_sends == len(rp.sends) and stats.num_recvs == len(rp.recvs)
        if old is not None:
            assert all(torch.equal(a, b) for a, b in zip(old, old_copy)), "old weights were modified"
        if rp.new_rank is not None:
            want = new_row[rp.new_rank * s_new:(rp.new_rank + 1) * s_new]
            assert_slots(staging, layer, want, rp.changed_slots, f"{name} staging")
            for t in staging:
                assert bool((t[list(rp.keeps)].float() == GARBAGE).all()), "a kept staging slot was written"
            final = [s.clone() for s in staging]
            if old is not None and s_old == s_new:
                weights = [t.clone() for t in old]
                commit_layer(rp, final, weights)
            else:
                weights = materialize(rp, old, final)
            assert_slots(weights, layer, want, range(s_new), f"{name} committed")
        batch_of, _ = op_batches(rp, len(SHAPES), max_ops, batching)
        out["requests"] += len({(batch_of(t.index, w) if batching else 0, t.src)
                                for t in rp.recvs for w in range(len(SHAPES))})
        out["requests_plain"] += len({t.src for t in rp.recvs})
        out["sends"] += stats.num_sends
        out["recvs"] += stats.num_recvs
        out["bytes_received"] += stats.bytes_received
        out["kinds"].add(kind)
    out["comm"] = comm.stats()
    comm.close()
    out["closed"] = comm.stats()
    return out


@pytest.mark.multiprocess
@pytest.mark.timeout(60)
@pytest.mark.parametrize("name", COMMUNICATORS)
def test_random_layers_bit_exact(name):
    results = run_distributed(body_random_layers, WORLD, args=(name, 4321, 24), timeout=50)
    assert set().union(*(r["kinds"] for r in results)) == {"rebalance", "failure", "scale_down_old", "scale_up_new"}
    assert sum(r["sends"] for r in results) == sum(r["recvs"] for r in results) > 0
    if name == "nixl":
        for r in results:
            c = r["comm"]
            assert c["exchanges_by_generation"] == {0: 1}, c  # once, at the first transfer
            assert c["peers"] == [x for x in range(WORLD) if x != results.index(r)]
            assert c["bytes_read"] == r["bytes_received"] and c["reads"] == r["recvs"] * 2
            assert c["read_requests"] == r["requests"] == r["requests_plain"]  # one request per peer and layer
            # one exchange per layer that moves anything over the network; none for the others
            assert c["layers"] == r["moving_layers"] and c["leaked_handles"] == 0
            assert r["closed"]["registered_regions"] == 0 and r["closed"]["peers"] == []


@needs_nixl
@pytest.mark.multiprocess
@pytest.mark.timeout(60)
def test_nixl_random_layers_with_migration_batching_bit_exact():
    """NIXL reads one migration round after another (one peer at a time): the same slots, the same reads."""
    results = run_distributed(body_random_layers, WORLD, args=("nixl", 4321, 24, True), timeout=50)
    assert sum(r["sends"] for r in results) == sum(r["recvs"] for r in results) > 0
    for r in results:
        c = r["comm"]
        assert c["bytes_read"] == r["bytes_received"] and c["reads"] == r["recvs"] * 2
        assert c["layers"] == r["moving_layers"] and c["leaked_handles"] == 0
        # one request per (batch, peer): a receiver reads a round's experts from its one peer, then the next round
        assert c["read_requests"] == r["requests"] > 0 or r["recvs"] == 0, (c, r["requests"])
    assert sum(r["requests_plain"] for r in results) < sum(r["comm"]["read_requests"] for r in results)


# ---------------------------------------------------------------------------------------------
# Multi-process: a NIXL peer that stops answering
# ---------------------------------------------------------------------------------------------


def body_nixl_peer_gone(rank: int, world_size: int, mode: str, timeout: float):
    """``late``: rank 3 never reaches its first transfer (so never publishes its metadata);
    ``stopped``: after a good first layer, rank 3 is frozen (SIGSTOP: no thread of it runs,
    UCX's included) during the second, and rank 0 thaws it once it has its answer; ``aborted``:
    like ``stopped``, but with a long deadline, and the waiting ranks are told to abort (as a
    rank whose group broke tells its transfer thread) half a second in; ``late_aborted``: like
    ``late`` (rank 3 never publishes its metadata), with a long deadline and the abort."""
    store = _test_store(f"gone-{mode}")
    comm = NixlCommunicator()
    comm.bind(0, store)
    old = {layer: slot_weights(layer, STUCK_OLD[2 * rank:2 * rank + 2]) for layer in (4, 5)}
    staging = garbage(2)
    comm.set_weights([None, None, None, None, old[4], old[5]])
    comm.add_buffer(staging)
    plan = plan_layer(STUCK_OLD, STUCK_NEW, 2)
    if mode in ("stopped", "aborted"):
        execute_layer(plan, rank, old[4], staging, timeout=20.0, layer=4, communicator=comm)
        assert_slots(staging, 4, STUCK_NEW[2 * rank:2 * rank + 2], plan.for_rank(rank).changed_slots, "layer 4")
        if rank == 3:
            store.set("pid3", str(os.getpid()))
            os.kill(os.getpid(), signal.SIGSTOP)
            return "thawed"
        store.wait(["pid3"])
        time.sleep(0.2)  # rank 3 is stopped by now
    elif mode == "late" and rank == 3:
        time.sleep(timeout + 1.5)
        return "slept"
    elif mode == "late_aborted" and rank == 3:
        time.sleep(3.0)
        return "slept"
    # "refused": rank 3 sends from a copy it never registered; it refuses the layer and the
    # end-of-layer all-reduce tells every rank at once
    sources = [t.clone() for t in old[5]] if mode == "refused" and rank == 3 else old[5]
    if mode in ("aborted", "late_aborted"):
        threading.Timer(0.5, comm.abort, args=("the group broke",)).start()
    started = time.monotonic()
    try:
        execute_layer(plan, rank, sources, staging, timeout=timeout, layer=5, communicator=comm)
        result = {"type": None, "elapsed": time.monotonic() - started}
    except TransferError as exc:
        result = {"type": type(exc).__name__, "elapsed": time.monotonic() - started, "error": exc}
    if mode in ("stopped", "aborted") and rank == 0:
        time.sleep(0.5)  # let ranks 1 and 2 reach their own deadline first
        os.kill(int(store.get("pid3")), signal.SIGCONT)
    return result


@pytest.mark.multiprocess
@pytest.mark.timeout(60)
@needs_nixl
@pytest.mark.parametrize("mode", ["late", "stopped"])
def test_nixl_peer_that_stops_answering_times_out(mode):
    timeout = 2.0
    results = run_distributed(body_nixl_peer_gone, WORLD, args=(mode, timeout), timeout=40)
    assert results[3] == ("slept" if mode == "late" else "thawed")
    for rank in range(3):
        r = results[rank]
        assert r["type"] == "TransferTimeout", r
        assert timeout - 0.1 <= r["elapsed"] < timeout + 1.5, r
        err = r["error"]
        assert isinstance(err, TransferTimeout) and err.layer == 5 and err.rank == rank and 3 in err.peers
        assert err.timeout == timeout
        if mode == "late":
            assert "metadata of ranks [3]" in err.waiting and err.peers == (3,)
        else:
            assert "expert 4 from rank 3" in err.waiting or "all-reduce" in err.waiting  # reads need rank 3 to progress


@pytest.mark.multiprocess
@pytest.mark.timeout(60)
@needs_nixl
@pytest.mark.parametrize("mode", ["aborted", "late_aborted"])
def test_nixl_abort_ends_a_wait_on_a_frozen_peer_long_before_its_deadline(mode):
    """``late_aborted``: the wait for a peer's metadata gives up on the abort too. It was one
    blocking store wait to the layer's deadline (found serving: a rank killed as a rebalance's
    first layer began held the survivors' recovery for transfer_timeout_s, 30 s, not ~6 s)."""
    timeout = 20.0
    results = run_distributed(body_nixl_peer_gone, WORLD, args=(mode, timeout), timeout=50)
    assert results[3] == ("thawed" if mode == "aborted" else "slept")
    for rank in range(3):
        r = results[rank]
        assert r["type"] == "TransferError", r  # not a timeout: the wait gave up when told to
        assert "aborted: the group broke" in str(r["error"]) and r["error"].layer == 5
        assert r["elapsed"] < 5.0, r  # 0.5 s to the abort, against a 20 s deadline


def body_nixl_reader_enters_first(rank: int, world_size: int, start_together: bool) -> dict:
    """Rank 1 reads expert 0 from rank 0. Rank 1 enters the layer first; rank 0 rewrites the
    slot in place (the same registered memory) before it enters. A first layer, run together,
    has exchanged the metadata already."""
    store = _test_store(f"enters-first-{start_together}")
    comm = NixlCommunicator()
    comm.bind(0, store)
    row, new_row = [0, 1, 2, 3], [0, 1, 0, 3]
    old = [slot_weights(layer, row[2 * rank:2 * rank + 2]) for layer in (0, 1)]
    staging = garbage(2)
    comm.set_weights(old)
    comm.add_buffer(staging)
    plan = plan_layer(row, new_row, 2)
    execute_layer(plan, rank, old[1], staging, timeout=20.0, layer=1, communicator=comm)  # metadata exchanged
    if rank == 1:
        store.set("reader-entering", "1")
    else:
        store.wait(["reader-entering"])
        time.sleep(0.5)  # rank 1 is inside the layer by now
        for w, t in enumerate(old[0]):
            t[0].copy_(expert_weights(0, 7)[w])  # what rank 0 holds when it enters
    execute_layer(plan, rank, old[0], staging, timeout=20.0, layer=0, communicator=comm,
                  start_together=start_together)
    out: dict = {"start_wait_seconds": comm.stats()["start_wait_seconds"]}
    if rank == 1:
        def holds(expert: int) -> bool:
            return all(torch.equal(t[0], want) for t, want in zip(staging, expert_weights(0, expert)))

        out["read"] = "rewritten" if holds(7) else "original" if holds(0) else "neither"
    comm.close()
    return out


@pytest.mark.multiprocess
@pytest.mark.timeout(60)
@needs_nixl
@pytest.mark.parametrize("start_together", [True, False])
def test_nixl_reader_that_enters_first_reads_only_once_the_sender_entered_when_told_to_start_together(start_together):
    """A scale's pre-transfer runs each layer inside one decode step of the old ranks: a joining
    rank's one-sided reads must happen in that step, not while they decode (issue 16)."""
    results = run_distributed(body_nixl_reader_enters_first, 2, args=(start_together,), timeout=40)
    if start_together:
        assert results[1]["read"] == "rewritten"  # read after rank 0 entered: what it held then
        assert results[1]["start_wait_seconds"] >= 0.4
    else:
        assert results[1]["read"] == "original"  # one-sided: read at once, before rank 0 rewrote the slot
        assert results[1]["start_wait_seconds"] == 0.0


# ---------------------------------------------------------------------------------------------
# Real workers with NIXL selected: async EPLB and a 2 -> 4 -> 2 scale cycle
# ---------------------------------------------------------------------------------------------


def _wait_for_commits(c, more_than: int, timeout: float = 30.0) -> None:
    """Until the async EPLB committed more than ``more_than`` layers (the first NIXL transfer of a
    process also starts its agent, so the first rebalance takes a moment)."""
    deadline = time.monotonic() + timeout
    while c.snapshot()["layers_committed"] <= more_than:
        assert time.monotonic() < deadline, f"no layer committed over NIXL within {timeout}s"
        time.sleep(0.1)


def _wait_for_exchanges(c, generation: int, count: int, timeout: float = 30.0) -> None:
    """Until every rank's NIXL communicator exchanged metadata ``count`` times in ``generation``."""
    deadline = time.monotonic() + timeout
    while True:
        seen = {rank: v["communicator"]["exchanges_by_generation"].get(generation) for rank, v in c.verify().items()}
        if all(n == count for n in seen.values()):
            return
        assert time.monotonic() < deadline, f"exchanges of generation {generation} by rank: {seen}, wanted {count}"
        time.sleep(0.2)


def _nixl_verdict(c, size: int, generation: int) -> dict:
    """Every slot exact; every rank's communicator is NIXL, knows exactly its current peers, has
    exchanged metadata at most once per generation (twice for one a prepared scale formed: at the
    pre-transfer and after the switch) and holds exactly its weights and staging."""
    from tests.helpers import assert_consistent

    verdict = assert_consistent(c, size)
    for rank, v in verdict.items():
        comm = v["communicator"]
        assert comm["name"] == "nixl", comm
        assert all(n in (1, 2) for n in comm["exchanges_by_generation"].values()), comm
        assert comm["generation"] == generation, comm
        if generation in comm["exchanges_by_generation"]:
            assert comm["peers"] == [r for r in range(size) if r != rank], comm  # retired peers forgotten
        else:
            assert comm["peers"] == [], comm
        # registrations follow the tensors: exactly the expert weights and the staging buffer
        assert comm["registered_bytes"] == v["expert_weight_bytes"] + v["staging_bytes"], (rank, comm, v)
        assert comm["registered_regions"] == 2 and comm["pending_bytes"] == 0, comm
        assert comm["leaked_handles"] == 0
    return verdict


@pytest.mark.multiprocess
@pytest.mark.timeout(100)
@needs_nixl
def test_nixl_async_eplb_and_scale_cycle_2_4_2():
    from elastic.control.coordinator import OperationStatus
    from tests.conftest import running, small_config

    config = small_config(model=dict(num_layers=4, num_experts=8),
                          eplb=dict(communicator="nixl", step_interval=5, window_size=5))
    with running(config) as c:
        _wait_for_commits(c, 0)
        verdict = _nixl_verdict(c, 2, 0)
        assert all(v["communicator"]["exchanges_by_generation"] == {0: 1} for v in verdict.values())
        assert all(v["communicator"]["bytes_read"] > 0 for v in verdict.values())
        generation = 0
        for size in (4, 2):
            before = c.snapshot()["layers_committed"]
            op = c.scale(size, timeout=90)
            assert op.status == OperationStatus.SUCCEEDED, f"scale to {size} failed: {op.error}"
            generation += 1
            # experts crossed the network, ahead of the pause (prepare, the default) or in it
            assert op.bytes_moved + op.prepare.get("bytes_received", 0) > 0
            _wait_for_commits(c, before)
            if size == 4:  # the async EPLB thread exchanges after the switch at its first layer: let it finish
                _wait_for_exchanges(c, generation, 2)
            verdict = _nixl_verdict(c, size, generation)
            exchanges = [v["communicator"]["exchanges_by_generation"].get(generation) for v in verdict.values()]
            if size == 4:
                # the new ranks' experts crossed the network ahead of the switch, over the standby group
                # of this generation: exchanged then, and once more after the switch (survivors swapped
                # their staged layers in: new tensors, new addresses), before the async EPLB's first layer
                assert exchanges == [2] * size, exchanges
            else:  # a layer that moves nothing over the network needs no exchange: at most once
                assert set(exchanges) <= {None, 1}, exchanges
        # the two survivors went through generations 0 (exchange), 1 (scale up: exchange at the
        # pre-transfer's first layer, and again after the switch for the async EPLB) and 2 (after the scale down)
        for v in verdict.values():
            assert v["communicator"]["exchanges"] == sum(v["communicator"]["exchanges_by_generation"].values())
            assert v["communicator"]["peers_forgotten"] >= 3  # gen 0's peer, gen 1's three


@pytest.mark.multiprocess
@pytest.mark.timeout(60)
@needs_nixl
def test_nixl_rank_that_refuses_its_part_fails_the_layer_everywhere():
    results = run_distributed(body_nixl_peer_gone, WORLD, args=("refused", 10.0), timeout=40)
    for rank in range(WORLD):
        r = results[rank]
        assert r["type"] == "TransferError" and r["elapsed"] < 5.0, r
        assert 3 in r["error"].peers or rank == 3
    assert "not inside the registered weights" in str(results[3]["error"])
    assert "ranks [3] failed" in str(results[0]["error"])


# ---------------------------------------------------------------------------------------------
# Multi-process: a peer's registrations moved (found by an outside soak of a served model)
# ---------------------------------------------------------------------------------------------

VIEW_OLD = [0, 1, 2, 3]
VIEW_NEW = [0, 3, 2, 1]  # each rank reads its peer's slot 1


def body_nixl_stale_view(rank: int, world_size: int, tag: str) -> dict:
    """Generation 0: the weights sit in slots 2-3 of a buffer, and a small region inside its slot 0
    is registered too; generation 1: the small region is dropped and the weights move to slots
    0-1 of the buffer (as a switch swaps staged layers in over freed memory). A reader's view of
    its peer, updated by loading the peer's new metadata, still lists the dropped region, which
    starts inside the new weights' first slot: NIXL finds no registration for slot 1 there."""
    comm = NixlCommunicator()
    plan = plan_layer(VIEW_OLD, VIEW_NEW, 2)
    mine = VIEW_OLD[2 * rank:2 * rank + 2]
    base = [torch.zeros((4, *shape), dtype=dtype) for shape, dtype in SHAPES]
    small = [b[0].reshape(-1)[1:2] for b in base]  # inside slot 0, not at its start
    staging = garbage(2)
    comm.add_buffer(staging)
    for generation, offset in enumerate((2, 0)):
        weights = []
        for b, content in zip(base, slot_weights(0, mine)):
            weights.append(b[offset:offset + 2])
            weights[-1].copy_(content)
        comm.bind(generation, _test_store(f"stale-view-{tag}-{generation}"))
        comm.set_weights([weights])
        if generation == 0:
            comm.add_buffer(small)
        else:
            comm.remove_buffer(small)
        for t in staging:
            t.fill_(GARBAGE)
        execute_layer(plan, rank, weights, staging, timeout=10.0, layer=0, communicator=comm)
        assert_slots(staging, 0, VIEW_NEW[2 * rank:2 * rank + 2], plan.for_rank(rank).changed_slots,
                     f"generation {generation}")
    stats = comm.stats()
    comm.close()
    return stats


@pytest.mark.multiprocess
@pytest.mark.timeout(60)
@needs_nixl
def test_nixl_reads_a_peer_whose_weights_moved_over_a_region_it_dropped():
    results = run_distributed(body_nixl_stale_view, 2, args=("a",), timeout=50)
    for stats in results:
        assert stats["layers"] == 2 and stats["reads"] == 2 * len(SHAPES), stats  # a slot of each tensor, twice
        assert stats["remote_reloads"] == 1, stats  # the stale view, loaded again once


def body_nixl_post_raises(rank: int, world_size: int, timeout: float) -> dict:
    """Rank 1's NIXL raises while it posts its read (as nixlNotFoundError did): every rank must
    fail the layer together, at once, and the group must stay usable (no collective skipped)."""
    import torch.distributed as dist

    comm = NixlCommunicator()
    comm.bind(0, _test_store("post-raises"))
    plan = plan_layer(VIEW_OLD, VIEW_NEW, 2)
    weights = slot_weights(0, VIEW_OLD[2 * rank:2 * rank + 2])
    staging = garbage(2)
    comm.set_weights([weights])
    comm.add_buffer(staging)
    if rank == 1:
        agent = comm._mem.get_agent()

        def refuse(*args, **kwargs):
            raise RuntimeError("NIXL_ERR_BACKEND: injected")

        agent.initialize_xfer = refuse
    started = time.monotonic()
    try:
        execute_layer(plan, rank, weights, staging, timeout=timeout, layer=0, communicator=comm)
        out = {"type": None}
    except TransferError as exc:
        out = {"type": type(exc).__name__, "error": str(exc)}
    out["elapsed"] = time.monotonic() - started
    t = torch.ones(1)
    dist.all_reduce(t)  # the group still lines up: nobody skipped the end-of-layer all-reduce
    out["after"] = t.item()
    comm.close()
    return out


@pytest.mark.multiprocess
@pytest.mark.timeout(60)
@needs_nixl
def test_nixl_error_while_posting_a_read_fails_the_layer_on_every_rank_at_once():
    results = run_distributed(body_nixl_post_raises, 2, args=(10.0,), timeout=50)
    for r in results:
        assert r["type"] == "TransferError" and r["elapsed"] < 5.0 and r["after"] == 2.0, r
    assert "injected" in results[1]["error"] and "ranks [1] failed" in results[0]["error"]
