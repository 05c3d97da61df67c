"""eplb.models.packed and eplb.models.dispatch: one forward per rank over its whole batch.

A request's logits are bitwise the same alone and in any batch (other requests, order, prefill
and decode mixed), and close to what transformers computes for it alone; the states handed in
are left unchanged and travel by pickle; the replica assignment spreads a hot expert's pairs;
the start-up check trips on an op whose rows depend on the batch; a dead peer becomes a
TimeoutError naming the MoE layer.
"""

from __future__ import annotations

import pickle
import time

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from eplb.models.config import ARCHITECTURES, HFModelConfig
from eplb.placement import Placement
from tests.distributed import run_distributed

pytestmark = pytest.mark.timeout(300)


@pytest.fixture(scope="module")
def qwen():
    from eplb.models.hf import unsharded

    torch.set_num_threads(1)
    return unsharded({"architecture": "qwen3_moe", "seed": 5})


def _prompts(n: int, seed: int = 0) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, 128, (int(torch.randint(1, 12, (1,), generator=g)),), generator=g) for _ in range(n)]


def test_a_request_has_the_same_bits_alone_and_in_any_batch(qwen):
    """Request 0 decoded alone, then in batches of 16 whose mates, order and phases (prefill of
    new mates next to decodes of old ones) change every step: bitwise the same logits."""
    prompts = _prompts(40, seed=1)
    target = prompts[0]
    alone, state = [], None
    tokens = target
    for _ in range(5):
        logits, (state,) = qwen.forward_batch([(tokens, state)])
        alone.append(logits[0])
        tokens = logits[0].argmax()[None]

    g = torch.Generator().manual_seed(2)
    mates: list[tuple[torch.Tensor, object]] = [(p, None) for p in prompts[1:16]]
    fresh = iter(prompts[16:])
    tokens, state = target, None
    for step in range(5):
        batch = [*mates, (tokens, state)]
        order = torch.randperm(len(batch), generator=g).tolist()
        logits, states = qwen.forward_batch([batch[i] for i in order])
        at = order.index(len(batch) - 1)
        assert torch.equal(logits[at], alone[step]), f"step {step}: the request's logits changed with its batch"
        state = states[at]
        tokens = logits[at].argmax()[None]
        # mates go on decoding, a few leave and new ones arrive (prefill next to decode)
        kept = [(logits[order.index(i)].argmax()[None], states[order.index(i)]) for i in range(len(mates))]
        mates = kept[3:] + [(next(fresh), None) for _ in range(3)]


@pytest.mark.parametrize("arch", list(ARCHITECTURES))
def test_forward_batch_computes_what_transformers_computes(arch):
    """Prefill and decode of requests of different lengths in one batch, against transformers'
    own forward of each request alone with its own cache (gpt_oss's prompt is past its window)."""
    from transformers import DynamicCache

    from eplb.models.hf import unsharded

    model = unsharded({"architecture": arch, "seed": 1})
    prompts = _prompts(3, seed=3) + [torch.arange(20) % 128]
    logits, states = model.forward_batch([(p, None) for p in prompts])
    ours = [logits]
    for _ in range(2):
        logits, states = model.forward_batch([(ours[-1][i].argmax()[None], s) for i, s in enumerate(states)])
        ours.append(logits)
    for i, p in enumerate(prompts):
        with torch.no_grad():
            out = model.model(input_ids=p[None], cache=DynamicCache(config=model.model.config), use_cache=True)
            theirs = [out.logits[0, -1]]
            for step in range(2):
                out = model.model(input_ids=ours[step][i].argmax()[None, None], cache=out.cache, use_cache=True)
                theirs.append(out.logits[0, -1])
        for step, t in enumerate(theirs):
            torch.testing.assert_close(ours[step][i], t, rtol=1e-4, atol=1e-5, msg=f"request {i} step {step}")


def test_states_are_left_unchanged_travel_by_pickle_and_crop(qwen):
    prompt = torch.tensor([3, 1, 4, 1, 5, 9, 2])
    first, (state,) = qwen.forward_batch([(prompt, None)])
    step = torch.tensor([7])
    a, (after,) = qwen.forward_batch([(step, state)])
    assert qwen.state_length(state) == 7 and qwen.state_length(after) == 8
    b, _ = qwen.forward_batch([(step, state)])  # the old state again: a failed step rolls back by keeping it
    c, _ = qwen.forward_batch([(step, pickle.loads(pickle.dumps(state)))])
    cropped = qwen.crop_state(after, 7)
    d, _ = qwen.forward_batch([(step, cropped)])
    assert torch.equal(a, b) and torch.equal(a, c) and torch.equal(a, d)
    with pytest.raises(ValueError, match="cannot crop"):
        qwen.crop_state(after, 9)
    for bad in ([(torch.tensor([[1, 2]]), None)], [(torch.tensor([128]), None)], [(torch.tensor([1]), "state")],
                [(torch.tensor([], dtype=torch.long), None)]):
        with pytest.raises(ValueError, match="request 0"):
            qwen.forward_batch(bad)


@pytest.mark.parametrize("arch", ["qwen3_moe", "gpt_oss"])
def test_a_step_of_sizes_seen_before_takes_the_remembered_no_mask_and_keeps_its_bits(arch, monkeypatch):
    """Transformers builds no mask for qwen3_moe's steps (sdpa): a second run of the same sizes asks it
    for none and gives the same bits; gpt_oss's windowed masks are tensors, built every time."""
    import eplb.models.packed as packed
    from eplb.models.hf import unsharded

    model = unsharded({"architecture": arch, "seed": 2})
    prompts = _prompts(3, seed=4)

    def decode() -> list[torch.Tensor]:
        logits, states = model.forward_batch([(p, None) for p in prompts])
        out = [logits]
        for _ in range(3):
            logits, states = model.forward_batch([(row.argmax()[None], s) for row, s in zip(out[-1], states)])
            out.append(logits)
        return out

    first = decode()
    built = []
    original = packed.request_masks
    monkeypatch.setattr(packed, "request_masks", lambda *a: built.append(a) or original(*a))
    second = decode()
    assert all(torch.equal(a, b) for a, b in zip(first, second))
    assert len(built) == (0 if arch == "qwen3_moe" else 4 * len(prompts))


def test_a_cache_fork_copies_a_plain_object_as_copy_does_and_defers_to_anything_else():
    import copy

    from eplb.models.packed import _shallow

    class Plain:
        def __init__(self) -> None:
            self.items = [1]

    class Slotted:
        __slots__ = ("value",)

    class OwnCopy:
        def __copy__(self) -> str:
            return "its own"

    plain = Plain()
    forked = _shallow(plain)
    assert type(forked) is Plain and forked is not plain and forked.items is plain.items
    slotted = Slotted()
    slotted.value = 3
    assert _shallow(slotted).value == 3 and _shallow(slotted) is not slotted
    assert _shallow(OwnCopy()) == copy.copy(OwnCopy()) == "its own"


def test_the_replica_assignment_spreads_a_hot_expert():
    """Expert 0 is hot on rank 0 only and has a replica on each of 2 ranks: its pairs are cut in
    equal halves, so both ranks' experts compute the same number of pairs."""
    from eplb.models.dispatch import assign, pair_slots

    placement = Placement.from_physical_to_logical(torch.tensor([[0, 1, 2, 0, 3, 4]]), 5)  # 3 slots per rank
    l2p, rc = placement.logical_to_physical[0], placement.replica_count[0]
    counts = torch.tensor([[40, 2, 2, 0, 0], [0, 0, 0, 2, 2]])  # [R, L]
    sent = assign(counts, l2p, rc, 6, 2)
    assert sent.sum(0).tolist() == [20, 2, 2, 20, 2, 2]  # slot 0 and slot 3 hold expert 0's replicas
    assert sent.sum(0).view(2, 3).sum(1).tolist() == [24, 24]
    assert torch.equal(sent.sum(1), counts.sum(1))
    ids = torch.tensor([0] * 40 + [1, 1, 2, 2])[torch.randperm(44, generator=torch.Generator().manual_seed(0))]
    slots = pair_slots(ids, 0, counts, l2p, rc, 3)
    # every pair goes to a replica of its own expert, in the numbers assign counted
    assert torch.equal(placement.physical_to_logical[0][slots], ids)
    assert torch.bincount(slots, minlength=6).tolist() == sent[0].tolist()


def test_a_replicated_expert_is_cut_only_where_that_lowers_the_busiest_rank():
    """Expert 0 has a replica on each of 2 ranks (slots 0 and 3). Its pairs go whole to the less
    loaded rank when that is as good as spreading them (a cut reads both replicas' weights), and
    are spread, evening the ranks, when the busiest rank gains."""
    from eplb.models.dispatch import assign, pair_slots

    placement = Placement.from_physical_to_logical(torch.tensor([[0, 1, 2, 0, 3, 4]]), 5)
    l2p, rc = placement.logical_to_physical[0], placement.replica_count[0]

    def per_slot(counts: list[list[int]]) -> list[int]:
        return assign(torch.tensor(counts), l2p, rc, 6, 2).sum(0).tolist()

    # rank 0's other experts hold 3 pairs, rank 1's 1: expert 0's 2 pairs go whole to rank 1
    assert per_slot([[1, 2, 1, 0, 0], [1, 0, 0, 1, 0]]) == [0, 2, 1, 2, 1, 0]
    # 1 pair and even ranks: whole (a cut cannot lower the busiest rank)
    assert per_slot([[1, 1, 0, 0, 0], [0, 0, 0, 1, 0]]) == [1, 1, 0, 0, 1, 0]
    # 9 pairs, rank 0 at 3 and rank 1 at 1: spread 3 / 6 -> the ranks at 6 / 7 (whole: 3 / 10);
    # the odd pair goes to the rank that was less loaded
    assert per_slot([[5, 2, 1, 0, 0], [4, 0, 0, 1, 0]]) == [3, 2, 1, 6, 1, 0]
    # pair_slots agrees with assign for each rank's own pairs, which keep their order
    counts = torch.tensor([[5, 2, 1, 0, 0], [4, 0, 0, 1, 0]])
    for rank, ids in ((0, torch.tensor([0, 1, 0, 2, 0, 1, 0, 0])), (1, torch.tensor([0, 3, 0, 0, 0]))):
        slots = pair_slots(ids, rank, counts, l2p, rc, 3)
        assert torch.bincount(slots, minlength=6).tolist() == assign(counts, l2p, rc, 6, 2)[rank].tolist()
        assert torch.equal(placement.physical_to_logical[0][slots], ids)


@settings(max_examples=60, deadline=None)
@given(st.lists(st.lists(st.integers(0, 12), min_size=5, max_size=5), min_size=2, max_size=2))
def test_spreading_never_leaves_a_rank_busier_than_sending_each_expert_whole(rows):
    """Property: whatever the counts, the busiest rank holds no more pairs than with every
    replicated expert sent whole to its first replica, and every pair lands on a replica of its
    own expert."""
    from eplb.models.dispatch import assign

    placement = Placement.from_physical_to_logical(torch.tensor([[0, 1, 2, 0, 3, 4]]), 5)
    l2p, rc = placement.logical_to_physical[0], placement.replica_count[0]
    counts = torch.tensor(rows)
    sent = assign(counts, l2p, rc, 6, 2)
    assert torch.equal(sent.sum(1), counts.sum(1))
    per_logical = torch.zeros(5, dtype=torch.int64).scatter_add_(0, placement.physical_to_logical[0], sent.sum(0))
    assert torch.equal(per_logical, counts.sum(0))
    whole = counts.sum(0)
    first_only = torch.tensor([whole[0] + whole[1] + whole[2], whole[3] + whole[4]])
    assert int(sent.sum(0).view(2, 3).sum(1).max()) <= int(first_only.max())


def test_the_busiest_rank_passes_a_pair_along_a_chain_of_replicated_experts():
    """Expert 0 has replicas on ranks 0 and 1, expert 1 on ranks 1 and 2. Each expert seen alone
    leaves ranks 0 and 1 at 7 pairs and rank 2 at 4; rank 0 then passes a pair of expert 0 to
    rank 1, which passes one of expert 1 on to rank 2, and again from rank 1: every rank at 6."""
    from eplb.models.dispatch import assign

    placement = Placement.from_physical_to_logical(torch.tensor([[0, 2, 0, 1, 1, 3]]), 4)  # 2 slots per rank
    sent = assign(torch.tensor([[4, 6, 5, 3]]), placement.logical_to_physical[0], placement.replica_count[0], 6, 3)
    assert sent.sum(0).view(3, 2).sum(1).tolist() == [6, 6, 6]
    assert sent.sum(0).tolist() == [1, 5, 3, 3, 3, 3]  # expert 0: 1 + 3, expert 1: 3 + 3


@settings(max_examples=80, deadline=None)
@given(st.lists(st.integers(0, 9), min_size=4, max_size=4))
def test_no_cut_of_the_replicated_experts_has_a_less_busy_busiest_rank(total):
    """Property: on the chain placement above, the busiest rank holds exactly as many pairs as the
    best of every way to cut the two replicated experts' pairs (found by trying them all)."""
    from eplb.models.dispatch import assign

    placement = Placement.from_physical_to_logical(torch.tensor([[0, 2, 0, 1, 1, 3]]), 4)
    sent = assign(torch.tensor([total]), placement.logical_to_physical[0], placement.replica_count[0], 6, 3)
    a, b, on_0, on_2 = total
    best = min(max(on_0 + x, a - x + y, on_2 + b - y) for x in range(a + 1) for y in range(b + 1))
    assert int(sent.sum(0).view(3, 2).sum(1).max()) == best
    per_logical = torch.zeros(4, dtype=torch.int64).scatter_add_(0, placement.physical_to_logical[0], sent.sum(0))
    assert per_logical.tolist() == total


def _least_busiest(total: list[int], physical_to_logical: list[int], slots_per_rank: int, ranks: int) -> int:
    """The lowest busiest rank over every way to cut each expert's pairs over its replicas' ranks:
    the least ``limit`` for which a max-flow (source -> expert: its pairs; expert -> each rank
    holding it; rank -> sink: ``limit``) carries every pair. Plain augmenting paths: the graphs are tiny."""
    holders = [sorted({s // slots_per_rank for s, e in enumerate(physical_to_logical) if e == x}) for x in range(len(total))]

    def augment(x: int, given: list[list[int]], limit: int, seen: set[int]) -> bool:
        """Place one more pair of expert ``x``, moving other experts' pairs along if need be."""
        for r in holders[x]:
            if r in seen:
                continue
            seen.add(r)
            if sum(g[r] for g in given) < limit:
                given[x][r] += 1
                return True
            for y in range(len(total)):  # make room on r: one of y's pairs there moves elsewhere
                if given[y][r] and augment(y, given, limit, seen):
                    given[y][r] -= 1
                    given[x][r] += 1
                    return True
        return False

    for limit in range(-(-sum(total) // ranks), sum(total) + 1):
        given = [[0] * ranks for _ in total]  # pairs of expert x on rank r
        if all(augment(x, given, limit, set()) for x in range(len(total)) for _ in range(total[x])):
            return limit
    raise AssertionError("unreachable: every pair fits at the total")


@settings(max_examples=60, deadline=None)
@given(st.data())
def test_the_dispatch_s_busiest_rank_is_the_least_any_cut_allows(data):
    """Property: on random placements of 6 experts in 12 slots over 4 ranks (replicas anywhere,
    two of one expert on one rank too) and random pair counts, the busiest rank holds as few pairs
    as the best cut of every expert's pairs over its replicas (found by max-flow)."""
    from eplb.models.dispatch import assign

    extra = data.draw(st.lists(st.integers(0, 5), min_size=6, max_size=6))
    order = data.draw(st.permutations(list(range(12))))
    p2l = [(list(range(6)) + extra)[i] for i in order]
    total = data.draw(st.lists(st.integers(0, 9), min_size=6, max_size=6))
    placement = Placement.from_physical_to_logical(torch.tensor([p2l]), 6)
    sent = assign(torch.tensor([total]), placement.logical_to_physical[0], placement.replica_count[0], 12, 4)
    assert int(sent.sum(0).view(4, 3).sum(1).max()) == _least_busiest(total, p2l, 3, 4)
    per_logical = torch.zeros(6, dtype=torch.int64).scatter_add_(0, placement.physical_to_logical[0], sent.sum(0))
    assert per_logical.tolist() == total


def test_the_start_up_check_trips_on_an_op_that_depends_on_the_batch(qwen):
    from eplb.models.packed import check_batch_invariant

    check_batch_invariant(qwen.model, tile=qwen.tile)  # the real model passes at its tile
    norm = qwen.model.model.layers[0].input_layernorm
    norm.forward = lambda x: x - x.mean(dim=0, keepdim=True)  # rows that see the other rows
    try:
        with pytest.raises(RuntimeError, match="layers.0.input_layernorm .* is not batch-invariant"):
            check_batch_invariant(qwen.model, tile=qwen.tile)
    finally:
        del norm.forward


def test_a_moe_block_s_narrow_gate_is_checked_and_its_tile_keeps_a_request_s_bits():
    """qwen3_next gates its shared expert with a ``[T, 1]`` sigmoid inside the MoE block: at a tile
    below twice the vector width, one request's 5 rows and a batch's 15 run that sigmoid in
    different loops (scalar tail or vector) and the logits differ in the last bit. The start-up
    check runs each MoE block around its experts, so that tile is refused and a request's bits are
    the same alone and in a batch."""
    from eplb.models.hf import unsharded
    from eplb.models.packed import check_batch_invariant

    torch.set_num_threads(1)
    model = unsharded(HFModelConfig(architecture="qwen3_next", seed=7))
    if torch.backends.cpu.get_cpu_capability() in ("AVX2", "AVX512"):  # 8 or 16 float lanes: a tail below 16 rows
        with pytest.raises(RuntimeError, match="mlp .* is not batch-invariant"):
            check_batch_invariant(model.model, tile=8)
        assert model.tile >= 16
    ids = torch.randint(0, model.vocab_size, (3, 5), generator=torch.Generator().manual_seed(99))
    _, together = model.generate(ids, 2)
    _, alone = model.generate(ids[2:], 2)
    assert torch.equal(alone[0], together[2])


# -- a hot expert's pairs cut over replicas on both ranks --------------------------------------

def body_split_replicas(rank: int, world_size: int) -> dict:
    from eplb.models.hf import HFMoE, describe, unsharded

    torch.set_num_threads(1)
    spec = HFModelConfig(architecture="qwen3_moe", seed=3)
    layers = describe(spec).num_moe_layers
    g = torch.Generator().manual_seed(11)
    prompts = [torch.randint(0, 128, (48,), generator=g) for _ in range(world_size)]
    reference = unsharded(spec)
    expected = [reference.forward_batch([(p, None)])[0][0] for p in prompts]
    del reference
    # 12 slots over 2 ranks: slots 8-11 (rank 1) are replicas of experts 0-3 (slots 0-3, rank 0)
    model = HFMoE(spec, Placement.static(layers, 8, 12), rank, world_size, timeout=30)
    logits, _ = model.forward_batch([(prompts[rank], None)])
    _, physical = model.take_load()
    return {"equal": torch.equal(logits[0], expected[rank]), "physical": physical.tolist()}


@pytest.mark.multiprocess
def test_a_hot_expert_s_pairs_are_cut_over_replicas_on_both_ranks_with_the_same_bits():
    """Two ranks prefill 48 tokens each (192 pairs over 8 experts): some replicated expert has
    its pairs computed on both ranks (its two replicas) to even the ranks out, and every
    request's logits are bitwise the unsharded model's."""
    r0, r1 = run_distributed(body_split_replicas, 2, timeout=120, pg_timeout=60)
    assert r0["equal"] and r1["equal"]
    assert r0["physical"] == r1["physical"]  # the group's load, the same on every rank
    split = [(layer, e) for layer, row in enumerate(r0["physical"]) for e in range(4)
             if row[e] > 0 and row[8 + e] > 0]
    assert split, r0["physical"]
    for row in r0["physical"]:  # the ranks' pairs even out: within a pair of each other where an expert was cut
        if any(row[e] > 0 and row[8 + e] > 0 for e in range(4)):
            assert abs(sum(row[:6]) - sum(row[6:])) <= 1, row


# -- a dead peer ---------------------------------------------------------------------------------

DEADLINE = 3.0


def body_dead_peer(rank: int, world_size: int) -> dict:
    from eplb.models.hf import HFMoE, describe

    torch.set_num_threads(1)
    spec = HFModelConfig(architecture="qwen3_moe", seed=2)
    layers = describe(spec).num_moe_layers
    model = HFMoE(spec, Placement.static(layers, 8, 8), rank, world_size, timeout=DEADLINE)
    ids = torch.tensor([1, 2, 3]) if rank == 0 else torch.tensor([4])
    logits, states = model.forward_batch([(ids, None)])  # both ranks take part
    out: dict = {"first": tuple(logits.shape)}
    if rank == 1:
        time.sleep(DEADLINE + 3)  # stalls, then leaves without stepping again
        return out
    started = time.monotonic()
    try:
        model.forward_batch([(torch.tensor([5]), states[0])])
        out["error"] = "no error"
    except TimeoutError as exc:
        out["error"] = str(exc)
    out["seconds"] = time.monotonic() - started
    return out


@pytest.mark.multiprocess
def test_a_stalled_peer_becomes_a_timeout_naming_the_layer():
    r0, r1 = run_distributed(body_dead_peer, 2, timeout=90, pg_timeout=30)
    assert r0["first"] == (1, 128) and r1["first"] == (1, 128)
    assert "MoE layer 0" in r0["error"] and "within 3.0s" in r0["error"], r0["error"]
    assert DEADLINE - 0.5 <= r0["seconds"] <= DEADLINE + 2.5


def test_the_cpu_split_is_measured_only_when_asked(qwen):
    """Reading the process's CPU clock around every exchange costs a serving rank; the split is
    measured only after time_cpu(), and survives a rebind (a rescale makes new contexts)."""
    prompt = [(torch.tensor([1, 2, 3]), None)]
    qwen.take_cpu_split()
    qwen.forward_batch(prompt)
    assert qwen.take_cpu_split() == {"expert_cpu_s": 0.0, "collective_cpu_s": 0.0}
    qwen.time_cpu()
    try:
        qwen.install_placement(qwen.placement, 0, 1)  # new contexts keep the setting
        qwen.forward_batch(prompt)
        assert qwen.take_cpu_split()["expert_cpu_s"] > 0.0
    finally:
        qwen.time_cpu(False)
