"""Pure tests of migration rounds (eplb.plan.migration_rounds), the batches the executor cuts
from them (eplb.transfer.op_batches), and the same-host sender preference of plan_layer."""

from __future__ import annotations

from collections import Counter

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from eplb.config import EPLBConfig
from eplb.plan import PlanError, Transfer, migration_rounds, plan_layer
from eplb.transfer import op_batches
from tests.test_plan import layouts

# ---------------------------------------------------------------------------------------------
# Rounds
# ---------------------------------------------------------------------------------------------


@st.composite
def transfer_lists(draw):
    """Any (src, dst) multigraph over up to 8 ranks, as a transfer list (src != dst)."""
    ranks = draw(st.integers(2, 8))
    pairs = draw(st.lists(st.tuples(st.integers(0, ranks - 1), st.integers(0, ranks - 1)).filter(lambda p: p[0] != p[1]),
                          max_size=60))
    return tuple(Transfer(src, 0, dst, k, (0,), k) for k, (src, dst) in enumerate(pairs))


def check_rounds(transfers, rounds) -> None:
    """Every round a matching (one peer per direction per rank), every transfer exactly once,
    as few rounds as the busiest rank has transfers."""
    by_index = {t.index: t for t in transfers}
    flat = [i for r in rounds for i in r]
    assert sorted(flat) == sorted(by_index), "every transfer in exactly one round"
    assert all(r and list(r) == sorted(r) for r in rounds), "rounds are non-empty and ascending"
    for r in rounds:
        senders = [by_index[i].src for i in r]
        receivers = [by_index[i].dst for i in r]
        assert len(set(senders)) == len(senders), f"round {r}: a rank sends twice"
        assert len(set(receivers)) == len(receivers), f"round {r}: a rank receives twice"
    degree = max([*Counter(t.src for t in transfers).values(), *Counter(t.dst for t in transfers).values()], default=0)
    assert len(rounds) == degree, f"{len(rounds)} rounds for a maximum degree of {degree}"


@settings(max_examples=400, deadline=None)
@given(transfer_lists())
def test_rounds_are_matchings_covering_every_transfer_once(transfers):
    rounds = migration_rounds(transfers)
    check_rounds(transfers, rounds)
    assert migration_rounds(transfers) == rounds  # deterministic


@settings(max_examples=200, deadline=None)
@given(layouts())
def test_every_plan_carries_its_rounds_on_every_rank(case):
    old_row, new_row, s_old, s_new, old_holder, new_holder = case
    plan = plan_layer(old_row, new_row, s_old, s_new, old_holder, new_holder)
    check_rounds(plan.transfers, plan.rounds)
    assert plan.rounds == migration_rounds(plan.transfers)
    for g in [*plan.group_ranks, 99]:  # 99: a rank the plan does not involve gets them too
        assert plan.for_rank(g).rounds == plan.rounds
    again = plan_layer(list(old_row), list(new_row), s_old, s_new, list(old_holder), list(new_holder))
    assert again == plan and again.rounds == plan.rounds


def test_a_star_needs_as_many_rounds_as_its_centre_has_peers():
    # rank 0 receives from 1, 2, 3 (two experts from 3); rank 1 also receives from 2
    transfers = tuple(Transfer(s, 0, d, k, (0,), k) for k, (s, d) in enumerate([(1, 0), (2, 0), (3, 0), (3, 0), (2, 1)]))
    rounds = migration_rounds(transfers)
    assert len(rounds) == 4
    check_rounds(transfers, rounds)
    assert migration_rounds(()) == ()


# ---------------------------------------------------------------------------------------------
# Batches (what the executor posts), identical on every rank
# ---------------------------------------------------------------------------------------------


def global_batches(plan, num_tensors: int, max_ops: int, batching: bool):
    """batch -> [(op index, src, dst)], assembled from every rank's own view of its ops, and the
    batch count each rank computed."""
    batches: dict[int, set[tuple[int, int, int]]] = {}
    counts = set()
    for g in plan.group_ranks:
        rp = plan.for_rank(g)
        batch_of, num = op_batches(rp, num_tensors, max_ops, batching)
        counts.add(num)
        for t in (*rp.sends, *rp.recvs):
            for w in range(num_tensors):
                batches.setdefault(batch_of(t.index, w), set()).add((t.index * num_tensors + w, t.src, t.dst))
    return batches, counts


@settings(max_examples=300, deadline=None)
@given(layouts(), st.integers(1, 3), st.integers(1, 7))
def test_batches_with_migration_batching_talk_to_one_peer_per_direction(case, num_tensors, max_ops):
    plan = plan_layer(*case)
    batches, counts = global_batches(plan, num_tensors, max_ops, True)
    # every rank counts the same batches, and every op of the layer lies in exactly one of them
    # (the sender and the receiver of an op put it in the same batch: one entry per op)
    assert len(counts) <= 1
    ops = [op for ops in batches.values() for op in ops]
    assert sorted(op[0] for op in ops) == list(range(plan.num_transfers * num_tensors))
    if plan.num_transfers:
        assert counts == {len(batches)} and sorted(batches) == list(range(len(batches)))
    for b, members in batches.items():
        assert len(members) <= max_ops, f"batch {b} has {len(members)} ops"
        senders: dict[int, set[int]] = {}
        receivers: dict[int, set[int]] = {}
        for _, src, dst in members:
            senders.setdefault(src, set()).add(dst)
            receivers.setdefault(dst, set()).add(src)
        assert all(len(peers) == 1 for peers in senders.values()), f"batch {b}: a rank sends to several peers"
        assert all(len(peers) == 1 for peers in receivers.values()), f"batch {b}: a rank receives from several peers"
    # a batch never mixes two rounds
    round_of = {i: r for r, members in enumerate(plan.rounds) for i in members}
    for members in batches.values():
        assert len({round_of[op[0] // num_tensors] for op in members}) == 1


@settings(max_examples=100, deadline=None)
@given(layouts(), st.integers(1, 3), st.integers(1, 7))
def test_batches_without_migration_batching_are_the_plain_chunks(case, num_tensors, max_ops):
    plan = plan_layer(*case)
    batches, counts = global_batches(plan, num_tensors, max_ops, False)
    for b, members in batches.items():
        assert all(op[0] // max_ops == b for op in members)
    assert counts <= {-(-plan.num_transfers * num_tensors // max_ops)}


def test_the_config_knob_is_off_by_default():
    assert EPLBConfig().enable_migration_batching is False
    assert EPLBConfig(enable_migration_batching=True).enable_migration_batching is True


# ---------------------------------------------------------------------------------------------
# Same-host senders
# ---------------------------------------------------------------------------------------------


@st.composite
def with_hosts(draw):
    case = draw(layouts())
    _, _, _, _, old_holder, new_holder = case
    group = max([*old_holder, *new_holder]) + 1
    hosts = draw(st.lists(st.sampled_from(["a", "b", "c"]), min_size=group, max_size=group + 2))
    return case, hosts


@settings(max_examples=400, deadline=None)
@given(with_hosts())
def test_a_sender_on_the_receivers_host_is_preferred(case_hosts):
    (old_row, new_row, s_old, s_new, old_holder, new_holder), hosts = case_hosts
    plan = plan_layer(old_row, new_row, s_old, s_new, old_holder, new_holder, hosts=hosts)
    plain = plan_layer(old_row, new_row, s_old, s_new, old_holder, new_holder)
    # the rest of the plan does not change: which transfers, to whom, in which order
    assert [(t.dst, t.expert, t.dst_slots) for t in plan.transfers] == [(t.dst, t.expert, t.dst_slots) for t in plain.transfers]
    for g in plain.group_ranks:
        a, b = plan.for_rank(g), plain.for_rank(g)
        assert (a.local_copies, a.keeps, a.reloads, len(a.recvs)) == (b.local_copies, b.keeps, b.reloads, len(b.recvs))
    s = s_old
    old_of = {g: old_row[r * s : (r + 1) * s] for r, g in enumerate(old_holder) if g >= 0}
    count = {g: 0 for g in old_of}
    for t in plan.transfers:
        holders = [g for g, slots in old_of.items() if t.expert in slots]
        same = [g for g in holders if hosts[g] == hosts[t.dst]]
        if same:
            assert hosts[t.src] == hosts[t.dst], f"{t}: a holder on the receiver's host ({same}) was passed over"
        best = min(same or holders, key=lambda h: (count[h], h))
        assert t.src == best, f"{t}: expected sender {best}"
        assert t.src_slot == list(old_of[t.src]).index(t.expert)
        count[t.src] += 1
    check_rounds(plan.transfers, plan.rounds)
    # one host for everybody is no preference at all
    assert plan_layer(old_row, new_row, s_old, s_new, old_holder, new_holder, hosts=["h"] * len(hosts)) == plain


def test_same_host_preference_on_two_hosts():
    # ranks 0, 1 on host a, ranks 2, 3 on host b; expert 9 is on ranks 0 and 2, rank 3 needs it
    old_row = [9, 1, 2, 3, 9, 5, 6, 7]
    new_row = [9, 1, 2, 3, 9, 5, 9, 7]
    plain = plan_layer(old_row, new_row, 2)
    assert [(t.src, t.dst) for t in plain.transfers] == [(0, 3)]  # fewest sends, then the lowest rank
    placed = plan_layer(old_row, new_row, 2, hosts=("a", "a", "b", "b"))
    assert [(t.src, t.dst) for t in placed.transfers] == [(2, 3)]
    # without a same-host holder the old rule holds
    assert plan_layer([9, 1, 2, 3, 4, 5, 6, 7], [9, 1, 2, 3, 4, 5, 9, 7], 2, hosts=("a", "a", "b", "b")).transfers[0].src == 0


@pytest.mark.parametrize("hosts, message", [
    (("a", "b", "a"), "hosts names 3 group ranks"),
    ("ab", "not a string"),
])
def test_hosts_errors(hosts, message):
    with pytest.raises(PlanError, match=message):
        plan_layer([0, 1, 2, 3, 4, 5, 6, 7], [7, 6, 5, 4, 3, 2, 1, 0], 2, hosts=hosts)


def test_the_eplb_plans_with_the_hosts_of_its_generation_only():
    """Hosts come with start_worker (the generation's list); a rescale's adopt forgets them, so a
    rebalance between the adopt and the next start never plans with the old group's hosts."""
    from eplb.placement import Placement
    from eplb.state import EPLBState

    state = EPLBState(EPLBConfig(use_async=False), None, Placement.static(2, 4, 4), 0, 2)
    assert state.hosts is None
    state.start_worker(None, 1, hosts=("a", "b"))
    assert state.hosts == ("a", "b")
    state.start_worker(None, 1)  # a restart after a failed layer keeps them
    assert state.hosts == ("a", "b")
    state.adopt(Placement.static(2, 4, 8), 0, 4)
    assert state.hosts is None
    state.start_worker(None, 2, hosts=())  # a group that knows no hosts
    assert state.hosts is None
