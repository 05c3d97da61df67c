"""eplb.transfer: in-process checks of the local paths, and real multi-process gloo runs.

Multi-process tests launch few processes (one launch runs many layers) and each has a timeout.
Weights are reproducible from (layer, expert), so every rank verifies its slots bit-exactly.
"""

from __future__ import annotations

import os
import random
import time

import pytest
import torch

from eplb.communicator import TorchCommunicator
from eplb.plan import holders_from_mapping, plan_layer
from eplb.transfer import (
    TransferError,
    TransferStats,
    TransferTimeout,
    commit_layer,
    execute_layer,
    materialize,
)
from tests.distributed import DistributedTestError, DistributedTimeout, RemoteError, run_distributed

# Two weight tensors per expert, of different dtypes and shapes (like w13 and w2).
SHAPES = (((3, 4), torch.float32), ((5,), torch.bfloat16))
GARBAGE = -512.0  # exact in every dtype used


def expert_weights(layer: int, expert: int) -> list[torch.Tensor]:
    out = []
    for w, (shape, dtype) in enumerate(SHAPES):
        gen = torch.Generator().manual_seed(1_000_003 * layer + 1009 * expert + w)
        out.append(torch.randn(shape, generator=gen).to(dtype))
    return out


def slot_weights(layer: int, experts) -> list[torch.Tensor]:
    per_expert = [expert_weights(layer, e) for e in experts]
    return [torch.stack([p[w] for p in per_expert]) for w in range(len(SHAPES))]


def garbage(slots: int) -> list[torch.Tensor]:
    return [torch.full((slots, *shape), GARBAGE, dtype=dtype) for shape, dtype in SHAPES]


def assert_slots(tensors, layer: int, experts, slots, what: str) -> None:
    for j in slots:
        want = expert_weights(layer, experts[j])
        for w, t in enumerate(tensors):
            assert torch.equal(t[j], want[w]), f"layer {layer}: {what} slot {j} tensor {w} is not expert {experts[j]}"


# ---------------------------------------------------------------------------------------------
# In-process tests (no network ops in the plan part of this rank)
# ---------------------------------------------------------------------------------------------


def test_local_copies_reloads_commit_and_keeps():
    # One rank: swap, duplicate, and an expert (5) nobody holds.
    old_row, new_row = [0, 1, 2, 3], [1, 0, 0, 5]
    plan = plan_layer(old_row, new_row, 4)
    rp = plan.for_rank(0)
    assert rp.keeps == () and plan.num_transfers == 0 and len(rp.reloads) == 1
    old = slot_weights(0, old_row)
    staging = garbage(4)
    reloaded = []
    stats = execute_layer(rp, 0, old, staging, reload_fn=lambda e: reloaded.append(e) or expert_weights(0, e), layer=0)
    assert reloaded == [5]
    assert stats == TransferStats(num_local_copies=3, num_reloads=1, seconds=stats.seconds)
    assert_slots(staging, 0, new_row, range(4), "staging")
    weights = [t.clone() for t in old]
    assert commit_layer(rp, staging, weights) == 4
    assert_slots(weights, 0, new_row, range(4), "weights")


def test_kept_slots_are_not_touched():
    old_row, new_row = [0, 1, 2, 3], [0, 2, 2, 3]
    plan = plan_layer(old_row, new_row, 4)
    rp = plan.for_rank(0)
    assert rp.keeps == (0, 2, 3) and rp.changed_slots == (1,)
    old = slot_weights(1, old_row)
    staging = garbage(4)
    execute_layer(plan, 0, old, staging)
    assert_slots(staging, 1, new_row, [1], "staging")
    assert all(bool((t[[0, 2, 3]].float() == GARBAGE).all()) for t in staging)
    weights = [t.clone() for t in old]
    commit_layer(rp, staging, weights)
    assert_slots(weights, 1, new_row, range(4), "weights")
    # materialize fills the kept slots instead: staging becomes the new weights.
    materialize(rp, old, staging)
    assert_slots(staging, 1, new_row, range(4), "materialized")


def test_execute_validates_buffers():
    plan = plan_layer([0, 1, 2, 3], [1, 0, 2, 4], 4)
    rp = plan.for_rank(0)
    old = slot_weights(0, [0, 1, 2, 3])
    with pytest.raises(ValueError, match="no reload_fn"):
        execute_layer(rp, 0, old, garbage(4))
    with pytest.raises(ValueError, match="no old weights"):
        execute_layer(rp, 0, None, garbage(4), reload_fn=lambda e: expert_weights(0, e))
    with pytest.raises(ValueError, match="expected 4 new slots"):
        execute_layer(rp, 0, old, garbage(3), reload_fn=lambda e: expert_weights(0, e))
    with pytest.raises(ValueError, match="not 1"):
        execute_layer(rp, 1, old, garbage(4))
    with pytest.raises(ValueError, match="max_ops_per_batch"):
        execute_layer(rp, 0, old, garbage(4), max_ops_per_batch=0)
    with pytest.raises(ValueError, match="timeout"):
        execute_layer(rp, 0, old, garbage(4), timeout=0)
    with pytest.raises(TransferError, match="layer 7.*reload_fn\\(4\\) returned shapes"):
        execute_layer(rp, 0, old, garbage(4), reload_fn=lambda e: [torch.zeros(1)], layer=7)
    with pytest.raises(ValueError, match="slot count changed"):
        commit_layer(rp, garbage(4), slot_weights(0, [0, 1]))


def test_transfer_errors_carry_fields_and_pickle():
    import pickle

    err = TransferTimeout("not done", layer=3, rank=0, peers=[2, 1, 2], timeout=1.5, waiting="recv of expert 4")
    back = pickle.loads(pickle.dumps(err))
    assert type(back) is TransferTimeout and isinstance(back, TransferError) and isinstance(back, TimeoutError)
    assert (back.layer, back.rank, back.peers, back.timeout, back.waiting) == (3, 0, (1, 2), 1.5, "recv of expert 4")
    assert str(back) == str(err) and "layer 3" in str(err) and "peers [1, 2]" in str(err)


# ---------------------------------------------------------------------------------------------
# Multi-process: many random layers on one 4-rank group
# ---------------------------------------------------------------------------------------------

WORLD = 4


def valid_row(rng: random.Random, num_experts: int, slots: int) -> list[int]:
    row = list(range(num_experts)) + [rng.randrange(num_experts) for _ in range(slots - num_experts)]
    rng.shuffle(row)
    return row


def make_case(layer: int, seed: int):
    """A random layer move executed on a group of WORLD ranks; the same on every rank."""
    rng = random.Random(seed * 7919 + layer)
    kind = ("rebalance", "failure", "scale_down_old", "scale_up_new")[layer % 4]
    s_old = rng.randint(1, 4)
    s_new = s_old if rng.random() < 0.7 else rng.randint(1, 4)
    if kind in ("rebalance", "failure"):
        n_old = n_new = WORLD
        s_new = s_old
        lost = {rng.randrange(WORLD)} if kind == "failure" else set()
        old_holder = tuple(-1 if r in lost else r for r in range(WORLD))
        new_holder = tuple(range(WORLD))
    elif kind == "scale_down_old":
        n_old, n_new = WORLD, rng.randint(1, WORLD - 1)
        mapping = [-1] * n_old
        for n, r in enumerate(rng.sample(range(n_old), n_new)):
            mapping[r] = n
        old_holder, new_holder = holders_from_mapping(mapping, n_new, "old")
    else:
        n_old, n_new = rng.randint(1, WORLD - 1), WORLD
        mapping = rng.sample(range(n_new), n_old)
        old_holder, new_holder = holders_from_mapping(mapping, n_new, "new")
    most = min(n_old * s_old, n_new * s_new)
    num_experts = rng.randint(max(1, most // 2), most)
    old_row = valid_row(rng, num_experts, n_old * s_old)
    new_row = valid_row(rng, num_experts, n_new * s_new)
    max_ops = rng.choice([1, 2, 3, 5, 64])
    return kind, old_row, new_row, s_old, s_new, old_holder, new_holder, max_ops


def run_layer(rank: int, layer: int, case, timeout: float = 20.0, *, batching: bool = False,
              communicator=None) -> dict:
    """Execute one layer's case on this rank and verify every slot bit-exactly."""
    kind, old_row, new_row, s_old, s_new, old_holder, new_holder, max_ops = case
    plan = plan_layer(old_row, new_row, s_old, s_new, old_holder, new_holder)
    rp = plan.for_rank(rank)
    old = slot_weights(layer, old_row[rp.old_rank * s_old : (rp.old_rank + 1) * s_old]) if rp.old_rank is not None else None
    old_copy = [t.clone() for t in old] if old is not None else None
    staging = garbage(s_new) if rp.new_rank is not None else None
    stats = execute_layer(
        plan, rank, old, staging, timeout=timeout, max_ops_per_batch=max_ops,
        reload_fn=lambda e: expert_weights(layer, e), layer=layer, migration_batching=batching,
        communicator=communicator,
    )
    assert stats.num_sends == len(rp.sends) and stats.num_recvs == len(rp.recvs)
    if old is not None:
        assert all(torch.equal(a, b) for a, b in zip(old, old_copy)), "old weights were modified"
    if rp.new_rank is not None:
        want = new_row[rp.new_rank * s_new : (rp.new_rank + 1) * s_new]
        assert_slots(staging, layer, want, rp.changed_slots, "staging")
        for t in staging:
            assert bool((t[list(rp.keeps)].float() == GARBAGE).all()), "a kept staging slot was written"
        if old is not None and s_old == s_new:
            weights = old
            commit_layer(rp, staging, weights)
        else:
            weights = materialize(rp, old, staging)
        assert_slots(weights, layer, want, range(s_new), "committed")
    return {
        "kind": kind, "transfers": plan.num_transfers, "sends": stats.num_sends, "recvs": stats.num_recvs,
        "copies": stats.num_local_copies, "reloads": stats.num_reloads, "keeps": len(rp.keeps),
        "bytes_sent": stats.bytes_sent, "bytes_received": stats.bytes_received, "max_ops": max_ops,
    }


def body_random_layers(rank: int, world_size: int, seed: int, num_layers: int) -> list[dict]:
    assert world_size == WORLD
    return [run_layer(rank, layer, make_case(layer, seed)) for layer in range(num_layers)]


@pytest.mark.multiprocess
@pytest.mark.timeout(90)
def test_random_layers_on_four_ranks_bit_exact():
    num_layers = 40
    results = run_distributed(body_random_layers, WORLD, args=(1234, num_layers), timeout=75)
    kinds = {r["kind"] for per_rank in results for r in per_rank}
    assert kinds == {"rebalance", "failure", "scale_down_old", "scale_up_new"}
    for layer in range(num_layers):
        rows = [results[rank][layer] for rank in range(WORLD)]
        assert sum(r["sends"] for r in rows) == sum(r["recvs"] for r in rows) == rows[0]["transfers"]
        assert sum(r["bytes_sent"] for r in rows) == sum(r["bytes_received"] for r in rows)
    totals = {k: sum(r[k] for per_rank in results for r in per_rank) for k in ("sends", "copies", "reloads", "keeps")}
    assert all(v > 0 for v in totals.values()), totals
    # Chunking was exercised: some layer had more ops than one batch holds.
    assert any(r["transfers"] * len(SHAPES) > r["max_ops"] for r in results[0])


class RecordingCommunicator(TorchCommunicator):
    """gloo, recording per layer and batch the peers this rank sent to and received from."""

    def __init__(self):
        super().__init__()
        self.batches: list[tuple[int | None, int, tuple[int, ...], tuple[int, ...]]] = []

    def exchange(self, x):
        by_batch: dict[int, tuple[set[int], set[int]]] = {}
        for op in x.sends:
            by_batch.setdefault(op.batch, (set(), set()))[0].add(op.peer)
        for op in x.recvs:
            by_batch.setdefault(op.batch, (set(), set()))[1].add(op.peer)
        for b, (to, frm) in sorted(by_batch.items()):
            self.batches.append((x.layer, b, tuple(sorted(to)), tuple(sorted(frm))))
        super().exchange(x)


def body_random_layers_batched(rank: int, world_size: int, seed: int, num_layers: int) -> dict:
    comm = RecordingCommunicator()
    layers = [run_layer(rank, layer, make_case(layer, seed), batching=True, communicator=comm)
              for layer in range(num_layers)]
    return {"layers": layers, "batches": comm.batches}


@pytest.mark.multiprocess
@pytest.mark.timeout(90)
def test_random_layers_with_migration_batching_bit_exact():
    """Every layer of the random suite with migration batching on: bit-exact slots (run_layer
    checks), and in every batch a rank sent to at most one peer and received from at most one."""
    num_layers = 24
    results = run_distributed(body_random_layers_batched, WORLD, args=(4321, num_layers), timeout=75)
    kinds = {r["kind"] for per_rank in results for r in per_rank["layers"]}
    assert kinds == {"rebalance", "failure", "scale_down_old", "scale_up_new"}
    for layer in range(num_layers):
        rows = [results[rank]["layers"][layer] for rank in range(WORLD)]
        assert sum(r["sends"] for r in rows) == sum(r["recvs"] for r in rows) == rows[0]["transfers"]
    posted = [b for per_rank in results for b in per_rank["batches"]]
    assert posted, "nothing was sent"
    for layer, batch, to, frm in posted:
        assert len(to) <= 1 and len(frm) <= 1, f"layer {layer} batch {batch}: sent to {to}, received from {frm}"
    # the rounds spread a rank's peers over several batches (with plain chunks they share one)
    assert any(len({p for _, _, to, frm in per_rank["batches"] for p in (*to, *frm)}) > 1 for per_rank in results)


def body_rescale(rank: int, world_size: int, case_name: str) -> dict:
    L = 5
    if case_name == "down":  # 4 -> 2 on the old group: old ranks 1 and 2 become 0 and 1; 0 and 3 leave
        mapping, s = [-1, 0, 1, -1], 3
        old_row = [0, 1, 2, 3, 4, 0, 1, 2, 3, 4, 0, 1]
        new_row = [4, 3, 2, 1, 0, 0]
        old_holder, new_holder = holders_from_mapping(mapping, 2, "old")
    else:  # 2 -> 4 on the new group: old 0 -> new 3, old 1 -> new 1; new 0 and 2 are fresh
        mapping, s = [3, 1], 3
        old_row = [0, 1, 2, 3, 4, 0]
        new_row = [0, 1, 2, 3, 4, 0, 1, 2, 3, 4, 4, 4]
        old_holder, new_holder = holders_from_mapping(mapping, 4, "new")
    plan = plan_layer(old_row, new_row, s, s, old_holder, new_holder, allow_reload=False)
    case = (case_name, old_row, new_row, s, s, old_holder, new_holder, 2)
    out = run_layer(rank, 0, case)
    rp = plan.for_rank(rank)
    out.update(old_rank=rp.old_rank, new_rank=rp.new_rank)
    assert L == len(set(old_row))
    return out


@pytest.mark.multiprocess
@pytest.mark.timeout(60)
@pytest.mark.parametrize("case_name", ["down", "up"])
def test_rescale_bit_exact(case_name):
    results = run_distributed(body_rescale, WORLD, args=(case_name,), timeout=45)
    if case_name == "down":
        assert [(r["old_rank"], r["new_rank"]) for r in results] == [(0, None), (1, 0), (2, 1), (3, None)]
        assert results[0]["recvs"] == results[3]["recvs"] == 0  # leaving ranks only send
        assert results[0]["sends"] + results[3]["sends"] > 0
    else:
        assert [(r["old_rank"], r["new_rank"]) for r in results] == [(None, 0), (1, 1), (None, 2), (0, 3)]
        assert results[0]["sends"] == results[2]["sends"] == 0  # fresh workers only receive
        assert results[0]["recvs"] > 0 and results[2]["recvs"] > 0
    assert sum(r["reloads"] for r in results) == 0


# ---------------------------------------------------------------------------------------------
# Multi-process: a stuck peer and a dead peer never hang the others
# ---------------------------------------------------------------------------------------------

# Rank 3 alone holds expert 4, which ranks 0..2 all need; ranks 0..2 also trade among themselves.
STUCK_OLD = [0, 1, 1, 2, 2, 3, 3, 4]
STUCK_NEW = [4, 2, 4, 3, 4, 1, 0, 4]


def body_peer_gone(rank: int, world_size: int, mode: str, timeout: float):
    if rank == 3:
        if mode == "dead":
            time.sleep(0.5)
            os._exit(3)  # dies without a word
        time.sleep(timeout + 1.5)  # stuck: never posts its sends
        return "slept"
    plan = plan_layer(STUCK_OLD, STUCK_NEW, 2)
    old = slot_weights(5, STUCK_OLD[2 * rank : 2 * rank + 2])
    started = time.monotonic()
    try:
        execute_layer(plan, rank, old, garbage(2), timeout=timeout, layer=5)
    except TransferError as exc:
        return {"type": type(exc).__name__, "elapsed": time.monotonic() - started, "error": exc}
    return {"type": None, "elapsed": time.monotonic() - started}


@pytest.mark.multiprocess
@pytest.mark.timeout(60)
def test_stuck_peer_times_out_without_hanging():
    timeout = 2.0
    results = run_distributed(body_peer_gone, WORLD, args=("stuck", timeout), timeout=40)
    assert results[3] == "slept"
    for rank in range(3):
        r = results[rank]
        assert r["type"] == "TransferTimeout", r
        assert timeout - 0.1 <= r["elapsed"] < timeout + 1.5, r
        err = r["error"]
        assert err.layer == 5 and err.rank == rank and 3 in err.peers and err.timeout == timeout
        assert "expert 4 from rank 3" in err.waiting and "layer 5" in str(err)


@pytest.mark.multiprocess
@pytest.mark.timeout(60)
def test_dead_peer_raises_transfer_error():
    timeout = 10.0
    results = run_distributed(body_peer_gone, WORLD, args=("dead", timeout), timeout=40, return_exceptions=True)
    assert isinstance(results[3], RemoteError) and "exit code 3" in str(results[3])
    for rank in range(3):
        r = results[rank]
        assert r["type"] in ("TransferError", "TransferTimeout"), r
        assert r["elapsed"] < timeout + 1.5, r
        assert 3 in r["error"].peers and r["error"].layer == 5


# ---------------------------------------------------------------------------------------------
# The multi-process helper itself
# ---------------------------------------------------------------------------------------------


def body_helper(rank: int, world_size: int, mode: str):
    import torch.distributed as dist

    # both ranks finish joining before either may leave: a rank that exits while its peer is
    # still connecting makes the peer's init fail instead of showing the behaviour under test
    dist.barrier()
    if mode == "ok":
        t = torch.tensor([float(rank + 1)])
        dist.all_reduce(t)
        return (rank, world_size, float(t))
    if mode == "raise" and rank == 1:
        raise KeyError("boom on rank 1")
    if mode == "hang" and rank == 0:
        time.sleep(60)
    return rank


@pytest.mark.multiprocess
@pytest.mark.timeout(60)
def test_helper_results_errors_and_timeouts():
    assert run_distributed(body_helper, 2, args=("ok",), timeout=30) == [(0, 2, 3.0), (1, 2, 3.0)]
    with pytest.raises(DistributedTestError, match="boom on rank 1") as info:
        run_distributed(body_helper, 2, args=("raise",), timeout=30)
    assert list(info.value.errors) == [1] and isinstance(info.value.errors[1], KeyError)
    assert run_distributed(body_helper, 2, args=("raise",), timeout=30, return_exceptions=True)[0] == 0
    started = time.monotonic()
    with pytest.raises(DistributedTimeout) as hang:
        # long enough for rank 1 to start and finish on a loaded machine (2.5 s was not, at a load of 8)
        run_distributed(body_helper, 2, args=("hang",), timeout=10)
    assert hang.value.unfinished == [0] and hang.value.finished == {1: 1}
    assert time.monotonic() - started < 25
