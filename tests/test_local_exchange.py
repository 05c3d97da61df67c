"""eplb.models.local_exchange: the data plane's collectives over shared memory on one host.

Its all_gather, all_gather_rows (each rank's real rows, none too), all_to_all (uneven splits, empty
parts) and all_reduce_max give what gloo gives, op after op (the two regions alternate); a rank
that turns it off turns it off for the whole group; nothing is left in /dev/shm; a peer that dies
ends a wait at once, a silent one at the deadline; only the last poster wakes, only the ranks
asleep, and a lost wake-up costs a short nap; an EP model's tokens are the same over it and over
gloo.
"""

from __future__ import annotations

import glob
import os
import time
from typing import Any

import pytest
import torch

from tests.distributed import run_distributed

pytestmark = [pytest.mark.multiprocess, pytest.mark.timeout(300)]


def body_ops(rank: int, world: int) -> dict:
    import torch.distributed as dist

    from eplb.models.local_exchange import LocalExchange

    before = set(glob.glob("/dev/shm/eplb-x-*"))
    pids = _group_pids(world)
    ex = LocalExchange.create(None, rank, world, timeout=20)
    assert ex is not None
    g = torch.Generator().manual_seed(rank)
    mismatches = []
    for op in range(40):
        rows = op % 5  # 0 rows too
        mine = torch.randn(rows, 3, generator=g)
        got = ex.all_gather(mine, 10, "test all_gather")
        want = [torch.empty_like(mine) for _ in range(world)]
        dist.all_gather(want, mine)
        if not all(torch.equal(a, b) for a, b in zip(got, want)):
            mismatches.append(("all_gather", op))
        send = [int(x) for x in torch.randint(0, 4, (world,), generator=g)]
        counts = torch.tensor(send)
        everyone = [torch.empty_like(counts) for _ in range(world)]
        dist.all_gather(everyone, counts)
        receive = [int(c[rank]) for c in everyone]
        payload = torch.randint(0, 255, (sum(send), 8), dtype=torch.uint8, generator=g)
        out = ex.all_to_all(payload, send, receive, 10, "test all_to_all")
        ref = torch.empty(sum(receive), 8, dtype=torch.uint8)
        dist.all_to_all_single(ref, payload, output_split_sizes=receive, input_split_sizes=send)
        if not torch.equal(out, ref):
            mismatches.append(("all_to_all", op))
        real = [int(x) for x in torch.randint(0, 4, (world,), generator=torch.Generator().manual_seed(op))]
        padded = torch.randint(0, 255, (max(real), 8), dtype=torch.uint8, generator=g)
        everyone_padded = [torch.empty_like(padded) for _ in range(world)]
        dist.all_gather(everyone_padded, padded)
        joined = ex.all_gather_rows(padded[: real[rank]], real, 10, "test all_gather_rows")
        if not torch.equal(joined, torch.cat([p[:m] for p, m in zip(everyone_padded, real)])):
            mismatches.append(("all_gather_rows", op))
        words = torch.randint(-5, 100, (6,), generator=g)
        reduced = words.clone()
        dist.all_reduce(reduced, op=dist.ReduceOp.MAX)
        if not torch.equal(ex.all_reduce_max(words, 10, "test max"), reduced):
            mismatches.append(("max", op))
    dist.barrier()  # rank 0 removed the directory before its first op
    left = _made_by(set(glob.glob("/dev/shm/eplb-x-*")) - before, pids)
    ex.close()
    return {"mismatches": mismatches, "left": sorted(left)}


def _group_pids(world: int) -> list[int]:
    """Every rank's pid (a collective: before a rank may die)."""
    import torch.distributed as dist

    pids: list[int] = [0] * world
    dist.all_gather_object(pids, os.getpid())
    return pids


def _made_by(paths: set[str], pids: list[int]) -> set[str]:
    """The exchange directories among ``paths`` that one of ``pids`` made (``eplb-x-<pid>-*``):
    another test process (``pytest -n``) may be serving a model over its own exchange meanwhile."""
    return {p for p in paths if int(os.path.basename(p).split("-")[2]) in pids}


@pytest.mark.parametrize("world", [2, 3])
def test_the_ops_give_what_gloo_gives_and_leave_nothing_behind(world):
    results = run_distributed(body_ops, world, timeout=120)
    for r in results:
        assert r["mismatches"] == [] and r["left"] == []


def body_off_on_one_rank(rank: int, world: int) -> bool:
    from eplb.models.local_exchange import LocalExchange

    if rank == 1:
        os.environ["EPLB_LOCAL_EXCHANGE"] = "0"
    return LocalExchange.create(None, rank, world, timeout=20) is None


def test_a_rank_that_turns_it_off_turns_it_off_for_the_group():
    assert run_distributed(body_off_on_one_rank, 2, timeout=60) == [True, True]


def body_dead_peer(rank: int, world: int) -> dict:
    from eplb.models.local_exchange import LocalExchange

    ex = LocalExchange.create(None, rank, world, timeout=20)
    assert ex is not None
    ex.all_gather(torch.ones(2), 10, "first")
    if rank == 1:
        os._exit(0)  # dies without a word: its FIFOs close
    started = time.monotonic()
    try:
        ex.all_gather(torch.ones(2), 20, "second")
        error = "no error"
    except TimeoutError as exc:
        error = str(exc)
    return {"error": error, "seconds": time.monotonic() - started}


def test_a_dead_peer_ends_the_wait_at_once():
    r0, _ = run_distributed(body_dead_peer, 2, timeout=60, return_exceptions=True)
    assert "rank 1" in r0["error"] and "gone" in r0["error"], r0
    assert r0["seconds"] < 5.0


def body_silent_peer(rank: int, world: int) -> dict:
    from eplb.models.local_exchange import LocalExchange

    ex = LocalExchange.create(None, rank, world, timeout=20)
    assert ex is not None
    if rank == 1:
        time.sleep(4)
        return {}
    started = time.monotonic()
    try:
        ex.all_gather(torch.ones(2), 1.5, "the test all_gather")
        error = "no error"
    except TimeoutError as exc:
        error = str(exc)
    return {"error": error, "seconds": time.monotonic() - started}


def test_a_silent_peer_is_a_timeout_at_the_deadline():
    r0, _ = run_distributed(body_silent_peer, 2, timeout=60)
    assert "within 1.5s" in r0["error"] and "[1]" in r0["error"], r0
    assert 1.4 <= r0["seconds"] <= 3.5


def body_wake_ups(rank: int, world: int, drop: bool) -> dict:
    """Ranks 0 and 1 post at once and sleep; rank 2 posts 0.5 s later. Counts the wake-up bytes
    each rank writes (with ``drop``, rank 2's are lost) and how long the sleepers waited."""
    from eplb.models import local_exchange
    from eplb.models.local_exchange import LocalExchange

    ex = LocalExchange.create(None, rank, world, timeout=20)
    assert ex is not None
    ex.all_gather(torch.ones(2), 10, "warm-up")
    writes = []
    real_write = local_exchange.os.write

    def counting_write(fd: int, data: bytes) -> int:
        writes.append(fd)
        return len(data) if drop and rank == 2 else real_write(fd, data)

    local_exchange.os.write = counting_write  # this rank's process only
    try:
        if rank == 2:
            time.sleep(0.5)
        started = time.monotonic()
        got = ex.all_gather(torch.full((2,), float(rank)), 20, "the test all_gather")
        waited = time.monotonic() - started
    finally:
        local_exchange.os.write = real_write
    if drop and rank == 2:
        time.sleep(3.5)  # its FIFOs stay open: its exit would wake the sleepers too (POLLHUP)
    ex.close()
    return {"writes": len(writes), "waited": waited, "got": [g.tolist() for g in got]}


def test_only_the_last_poster_wakes_and_only_the_ranks_asleep():
    results = run_distributed(body_wake_ups, 3, args=(False,), timeout=60)
    assert [r["writes"] for r in results] == [0, 0, 2]  # not 2 bytes from every rank (6)
    assert all(r["got"] == [[0.0, 0.0], [1.0, 1.0], [2.0, 2.0]] for r in results)


def test_a_lost_wake_up_costs_a_short_nap_not_the_deadline():
    results = run_distributed(body_wake_ups, 3, args=(True,), timeout=60)
    assert results[2]["writes"] == 2  # written, and lost
    for r in results[:2]:
        assert 0.4 <= r["waited"] < 3.0, r  # the deadline is 20 s
        assert r["got"] == [[0.0, 0.0], [1.0, 1.0], [2.0, 2.0]]


def decode_small_model(rank: int, world: int) -> tuple[Any, list[list[int]], torch.Tensor]:
    """A tiny qwen3_moe served as rank ``rank`` of ``world`` (experts replicated on 2 ranks): 5 prompts
    split over the ranks, 4 greedy steps. Returns the model, each step's tokens and the last logits."""
    from eplb.models.config import HFModelConfig
    from eplb.models.hf import HFMoE, describe
    from eplb.placement import Placement

    spec = HFModelConfig(architecture="qwen3_moe", seed=3)
    layers = describe(spec).num_moe_layers
    model = HFMoE(spec, Placement.static(layers, 8, 12), rank, world, timeout=30)  # replicas on 2 ranks
    g = torch.Generator().manual_seed(21)
    prompts = [torch.randint(0, 128, (int(n),), generator=g) for n in (9, 3, 17, 1, 6)]
    inputs = [(p, None) for p in prompts[rank::world]]
    tokens = []
    for _ in range(4):
        logits, states = model.forward_batch(inputs)
        step = logits.argmax(-1)
        tokens.append(step.tolist())
        inputs = [(t[None], s) for t, s in zip(step, states)]
    return model, tokens, logits


def body_model(rank: int, world: int, local: str) -> dict:
    os.environ["EPLB_LOCAL_EXCHANGE"] = local
    model, tokens, logits = decode_small_model(rank, world)
    return {"tokens": tokens, "local": model.local_exchange() is not None, "logits": logits.tolist()}


def test_an_ep_model_gives_the_same_bits_over_shared_memory_and_over_gloo():
    over_shm = run_distributed(body_model, 2, args=("1",), timeout=200)
    over_gloo = run_distributed(body_model, 2, args=("0",), timeout=200)
    assert [r["local"] for r in over_shm] == [True, True]
    assert [r["local"] for r in over_gloo] == [False, False]
    for a, b in zip(over_shm, over_gloo):
        assert a["tokens"] == b["tokens"]
        assert a["logits"] == b["logits"]


def body_rank0_dies_in_set_up(rank: int, world: int) -> dict:
    from eplb.models.local_exchange import LocalExchange

    before = set(glob.glob("/dev/shm/eplb-x-*"))
    pids = _group_pids(world)
    if rank == 0:
        def die(*args, **kwargs):  # after every rank made its file and FIFOs, before rank 0 removes them
            os._exit(0)

        LocalExchange._open_peers = staticmethod(die)  # type: ignore[method-assign]
    try:
        LocalExchange.create(None, rank, world, timeout=10)
        error = "no error"
    except TimeoutError as exc:
        error = str(exc)
    fds = []
    for fd in os.listdir("/proc/self/fd"):
        try:
            fds.append(os.readlink(f"/proc/self/fd/{fd}"))
        except OSError:  # the listing's own descriptor, closed by now
            pass
    return {"error": error, "left": sorted(_made_by(set(glob.glob("/dev/shm/eplb-x-*")) - before, pids)),
            "fds": [fd for fd in fds if "eplb-x-" in fd]}


@pytest.mark.skipif(not os.path.isdir("/dev/shm"), reason="the files go to /dev/shm on Linux")
def test_a_set_up_whose_rank_0_dies_leaves_no_file_and_no_descriptor_on_the_survivor():
    """Rank 0 made the directory and dies once every rank made its file: the survivor removes them
    (33 MB were left in /dev/shm) and closes its FIFOs (they stayed open in every survivor)."""
    _, r1 = run_distributed(body_rank0_dies_in_set_up, 2, timeout=60, return_exceptions=True)
    assert r1["error"].startswith("the shared-memory exchange's set-up failed"), r1
    assert r1["left"] == [] and r1["fds"] == [], r1


@pytest.mark.skipif(not os.path.isdir("/dev/shm"), reason="the files go to /dev/shm on Linux")
def test_the_next_set_up_removes_a_directory_whose_creator_is_dead():
    import subprocess

    from eplb.models import local_exchange

    gone = subprocess.Popen(["true"])
    gone.wait()
    stale = f"/dev/shm/eplb-x-{gone.pid}-abc123"
    os.makedirs(stale)
    mine = local_exchange._new_directory()
    try:
        assert not os.path.exists(stale)
        assert os.path.basename(mine).startswith(f"eplb-x-{os.getpid()}-") and os.path.exists(f"{mine}/token")
    finally:
        import shutil

        shutil.rmtree(mine, ignore_errors=True)
        shutil.rmtree(stale, ignore_errors=True)
