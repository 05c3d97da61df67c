"""Pure tests of eplb.plan: the plan, simulated in plain Python, yields new_row everywhere."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from eplb.plan import LayerPlan, PlanError, Reload, Transfer, holders_from_mapping, plan_layer

# ---------------------------------------------------------------------------------------------
# A reference simulation of a plan
# ---------------------------------------------------------------------------------------------


def simulate(plan: LayerPlan) -> dict[int, list[int]]:
    """Apply the plan to worker contents; return group rank -> new local slot contents.

    Asserts on the way that every new slot is written exactly once (keeps included), that
    every source is a live holder of the expert it sends/copies, and that nothing reads a
    lost rank.
    """
    s_old, s_new = plan.old_slots_per_rank, plan.new_slots_per_rank
    old_of = {g: list(plan.old_row[r * s_old : (r + 1) * s_old]) for r, g in enumerate(plan.old_holder) if g >= 0}
    new_of: dict[int, list] = {g: [None] * s_new for g in plan.new_holder}
    written: dict[int, list[int]] = {g: [0] * s_new for g in plan.new_holder}

    def write(g: int, j: int, value: int) -> None:
        new_of[g][j] = value
        written[g][j] += 1

    for t in plan.transfers:
        assert t.src in old_of, f"{t} sends from a worker without live old weights"
        assert t.dst in new_of, f"{t} sends to a worker without new slots"
        assert t.src != t.dst
        assert old_of[t.src][t.src_slot] == t.expert, f"{t}: source slot holds another expert"
        assert t.dst_slots and list(t.dst_slots) == sorted(set(t.dst_slots))
        for j in t.dst_slots:
            write(t.dst, j, old_of[t.src][t.src_slot])
    for g in plan.group_ranks:
        rp = plan.for_rank(g)
        for j in rp.keeps:
            write(g, j, old_of[g][j])
        for i, j in rp.local_copies:
            write(g, j, old_of[g][i])
        for r in rp.reloads:
            for j in r.slots:
                write(g, j, r.expert)
    for g, counts in written.items():
        assert counts == [1] * s_new, f"group rank {g}: slots written {counts} times"
    return new_of


def check_plan(plan: LayerPlan) -> None:
    """Every property the planner promises."""
    s_old, s_new = plan.old_slots_per_rank, plan.new_slots_per_rank
    old_of = {g: plan.old_row[r * s_old : (r + 1) * s_old] for r, g in enumerate(plan.old_holder) if g >= 0}
    live_experts = {e for slots in old_of.values() for e in slots}

    # 1. The result is new_row everywhere.
    result = simulate(plan)
    for n, g in enumerate(plan.new_holder):
        assert result[g] == list(plan.new_row[n * s_new : (n + 1) * s_new]), f"new rank {n} (group rank {g})"

    for n, g in enumerate(plan.new_holder):
        rp = plan.for_rank(g)
        assert rp.new_rank == n and rp.num_new_slots == s_new
        want = plan.new_row[n * s_new : (n + 1) * s_new]
        mine = old_of.get(g)
        # 2. Keeps are exactly the unchanged slots; no transfer or copy touches them.
        unchanged = {j for j in range(s_new) if mine is not None and j < s_old and mine[j] == want[j]}
        assert set(rp.keeps) == unchanged
        assert set(rp.changed_slots) == set(range(s_new)) - unchanged
        # 3. An expert already on the receiver is never received over the network.
        for t in rp.recvs:
            assert mine is None or t.expert not in mine, f"{t}: expert already on the receiver"
        for i, j in rp.local_copies:
            assert mine is not None and mine[i] == want[j]
        # 4. Reloads only for experts no live worker holds.
        for r in rp.reloads:
            assert r.expert not in live_experts
    for g in plan.group_ranks:
        rp = plan.for_rank(g)
        if rp.new_rank is None:  # leaving: only sends
            assert not (rp.recvs or rp.local_copies or rp.keeps or rp.reloads)
        assert rp.num_transfers == plan.num_transfers
        assert all(t.src == g for t in rp.sends) and all(t.dst == g for t in rp.recvs)

    # 5. Each (receiver, expert) at most once; indices are positions.
    pairs = [(t.dst, t.expert) for t in plan.transfers]
    assert len(pairs) == len(set(pairs))
    assert [t.index for t in plan.transfers] == list(range(plan.num_transfers))
    assert sum(len(plan.for_rank(g).sends) for g in plan.group_ranks) == plan.num_transfers
    assert sum(len(plan.for_rank(g).recvs) for g in plan.group_ranks) == plan.num_transfers

    # 6. Senders: at every step the chosen holder had the fewest sends so far (ties: lowest rank).
    count = {g: 0 for g in old_of}
    for t in plan.transfers:
        holders = sorted(g for g, slots in old_of.items() if t.expert in slots)
        best = min(holders, key=lambda h: (count[h], h))
        assert t.src == best, f"{t}: expected sender {best} with counts {count}"
        assert t.src_slot == list(old_of[t.src]).index(t.expert)
        count[t.src] += 1


# ---------------------------------------------------------------------------------------------
# Strategies
# ---------------------------------------------------------------------------------------------


@st.composite
def layouts(draw):
    """(old_row, new_row, S_old, S_new, old_holder, new_holder) over every kind of move."""
    kind = draw(st.sampled_from(["rebalance", "scale_old", "scale_new", "arbitrary"]))
    s_old = draw(st.integers(1, 4))
    s_new = s_old if draw(st.booleans()) else draw(st.integers(1, 4))
    n_old = draw(st.integers(1, 5))
    if kind == "rebalance":
        n_new, s_new = n_old, s_old
        old_holder, new_holder = tuple(range(n_old)), tuple(range(n_new))
        lost = draw(st.sets(st.integers(0, n_old - 1), max_size=n_old - 1))
        old_holder = tuple(-1 if r in lost else r for r in old_holder)
    elif kind == "scale_old":
        n_new = draw(st.integers(1, n_old))
        staying = draw(st.permutations(range(n_old)))[:n_new]
        mapping = [-1] * n_old
        for n, r in enumerate(staying):
            mapping[r] = n
        leaving = [r for r in range(n_old) if mapping[r] < 0]
        lost = draw(st.sets(st.sampled_from(leaving), max_size=len(leaving))) if leaving else set()
        old_holder, new_holder = holders_from_mapping(mapping, n_new, "old", lost)
    elif kind == "scale_new":
        n_new = draw(st.integers(1, 6))
        targets = draw(st.permutations(range(n_new)))
        mapping = [targets[r] if r < n_new and draw(st.booleans()) else -1 for r in range(n_old)]
        lost = draw(st.sets(st.integers(0, n_old - 1), max_size=n_old))
        old_holder, new_holder = holders_from_mapping(mapping, n_new, "new", lost)
    else:  # arbitrary holders in a group of up to 7 ranks
        n_new = draw(st.integers(1, 5))
        group = 7
        old_perm = draw(st.permutations(range(group)))
        old_holder = tuple(old_perm[r] if draw(st.booleans()) or r == 0 else -1 for r in range(n_old))
        new_holder = tuple(draw(st.permutations(range(group)))[:n_new])
    num_experts = draw(st.integers(1, max(1, min(n_old * s_old, n_new * s_new) + 1)))
    expert = st.integers(0, num_experts - 1)
    old_row = draw(st.lists(expert, min_size=n_old * s_old, max_size=n_old * s_old))
    if draw(st.booleans()):  # a realistic new row: a perturbation of the old one where sizes allow
        new_row = [old_row[i % len(old_row)] for i in range(n_new * s_new)]
        for _ in range(draw(st.integers(0, 4))):
            new_row[draw(st.integers(0, len(new_row) - 1))] = draw(expert)
    else:
        new_row = draw(st.lists(expert, min_size=n_new * s_new, max_size=n_new * s_new))
    return old_row, new_row, s_old, s_new, old_holder, new_holder


# ---------------------------------------------------------------------------------------------
# Property tests
# ---------------------------------------------------------------------------------------------


@settings(max_examples=400, deadline=None)
@given(layouts())
def test_plan_properties(case):
    old_row, new_row, s_old, s_new, old_holder, new_holder = case
    plan = plan_layer(old_row, new_row, s_old, s_new, old_holder, new_holder)
    check_plan(plan)


@settings(max_examples=100, deadline=None)
@given(layouts())
def test_plan_is_deterministic(case):
    old_row, new_row, s_old, s_new, old_holder, new_holder = case
    a = plan_layer(old_row, new_row, s_old, s_new, old_holder, new_holder)
    b = plan_layer(
        torch.tensor(old_row, dtype=torch.int64), torch.tensor(new_row, dtype=torch.int64),
        s_old, s_new, list(old_holder), list(new_holder),
    )
    assert a == b
    assert all(a.for_rank(g) == b.for_rank(g) for g in a.group_ranks)


@settings(max_examples=100, deadline=None)
@given(layouts())
def test_no_reload_mode(case):
    old_row, new_row, s_old, s_new, old_holder, new_holder = case
    live = {e for r, g in enumerate(old_holder) if g >= 0 for e in old_row[r * s_old : (r + 1) * s_old]}
    if set(new_row) <= live:
        plan = plan_layer(old_row, new_row, s_old, s_new, old_holder, new_holder, allow_reload=False)
        assert plan.num_reloads == 0
        check_plan(plan)
    else:
        with pytest.raises(PlanError, match="no live worker"):
            plan_layer(old_row, new_row, s_old, s_new, old_holder, new_holder, allow_reload=False)


# ---------------------------------------------------------------------------------------------
# Examples
# ---------------------------------------------------------------------------------------------


def test_identical_rows_move_nothing():
    row = [0, 1, 2, 3, 0, 1]
    plan = plan_layer(row, row, 2)
    assert plan.num_transfers == 0 and plan.num_local_copies == 0 and plan.num_reloads == 0
    assert plan.num_kept == 6
    assert all(plan.for_rank(g).is_idle for g in plan.group_ranks)
    assert plan.bytes_moved(1000) == 0


def test_swap_within_a_rank_is_local():
    plan = plan_layer([0, 1, 2, 3], [1, 0, 2, 3], 2)
    assert plan.num_transfers == 0
    assert plan.for_rank(0).local_copies == ((1, 0), (0, 1))
    assert plan.for_rank(1).keeps == (0, 1)


def test_one_receive_fans_out_to_several_slots():
    plan = plan_layer([0, 1, 2, 3], [0, 1, 3, 3, 3, 2], 2, 3, new_holder=[0, 1])
    # S grows 2 -> 3: new rank 0 = [0, 1, 3], new rank 1 = [3, 3, 2].
    assert plan.transfers == (Transfer(src=1, src_slot=1, dst=0, expert=3, dst_slots=(2,), index=0),)
    rp1 = plan.for_rank(1)
    assert rp1.keeps == (1,) and rp1.local_copies == ((1, 0), (0, 2))
    plan = plan_layer([0, 1, 2, 3], [2, 2, 2, 3], 2)
    assert plan.transfers == (Transfer(src=1, src_slot=0, dst=0, expert=2, dst_slots=(0, 1), index=0),)


def test_senders_are_spread():
    # Experts 0 is held by ranks 0 and 1; ranks 2..5 all need it.
    old_row = [0, 1, 0, 1, 2, 3, 2, 3, 2, 3, 2, 3]
    new_row = [0, 1, 0, 1, 0, 3, 0, 3, 0, 3, 0, 3]
    plan = plan_layer(old_row, new_row, 2)
    assert plan.num_transfers == 4
    assert plan.sends_per_rank() == {0: 2, 1: 2, 2: 0, 3: 0, 4: 0, 5: 0}
    assert plan.bytes_moved(10) == 40


def test_scale_down_on_old_group():
    # 4 ranks -> 2: old ranks 1 and 3 leave, 0 -> 0, 2 -> 1; S stays 2, 4 experts.
    old_holder, new_holder = holders_from_mapping([0, -1, 1, -1], 2, "old")
    assert old_holder == (0, 1, 2, 3) and new_holder == (0, 2)
    plan = plan_layer([0, 1, 2, 3, 0, 1, 2, 3], [0, 3, 1, 2], 2, 2, old_holder, new_holder)
    check_plan(plan)
    for leaving in (1, 3):
        rp = plan.for_rank(leaving)
        assert rp.new_rank is None and not rp.recvs and rp.num_new_slots == 0
    assert plan.for_rank(0).keeps == (0,)
    # Old rank 2 held [0, 1] and becomes new rank 1 = [1, 2]: expert 1 moves locally, 2 comes in.
    assert plan.for_rank(2).local_copies == ((1, 0),)
    assert [(t.expert, t.dst_slots) for t in plan.for_rank(2).recvs] == [(2, (1,))]


def test_scale_up_on_new_group_with_fresh_workers():
    old_holder, new_holder = holders_from_mapping([1, 3], 4, "new")
    assert old_holder == (1, 3) and new_holder == (0, 1, 2, 3)
    plan = plan_layer([0, 1, 2, 3], [0, 1, 2, 3, 0, 1, 2, 3], 2, 2, old_holder, new_holder)
    check_plan(plan)
    for fresh in (0, 2):
        rp = plan.for_rank(fresh)
        assert rp.old_rank is None and not rp.sends and not rp.keeps and len(rp.recvs) == 2
    assert plan.for_rank(1).old_rank == 0 and plan.for_rank(1).new_rank == 1


def test_failure_reloads_what_only_the_dead_rank_held():
    # Rank 1 dies; it alone held expert 3; expert 2 has a replica on rank 2.
    plan = plan_layer([0, 1, 2, 3, 2, 0], [0, 1, 2, 3, 2, 0], 2, 2, [0, -1, 2], [0, 1, 2])
    check_plan(plan)
    rp1 = plan.for_rank(1)
    assert rp1.old_rank is None and rp1.reloads == (Reload(3, (1,)),)
    assert [(t.src, t.expert) for t in rp1.recvs] == [(2, 2)]
    with pytest.raises(PlanError, match=r"experts \[3\].*lost old ranks: \[1\]"):
        plan_layer([0, 1, 2, 3, 2, 0], [0, 1, 2, 3, 2, 0], 2, 2, [0, -1, 2], [0, 1, 2], allow_reload=False)


def test_for_rank_of_an_uninvolved_rank_is_empty():
    plan = plan_layer([0, 1], [1, 0], 1)
    rp = plan.for_rank(7)
    assert rp.is_idle and rp.num_transfers == plan.num_transfers == 2 and rp.changed_slots == ()


@pytest.mark.parametrize(
    "args, kwargs, message",
    [
        (([0, 1, 2], [0, 1, 2], 2), {}, "not divisible"),
        (([0, 1, 2, 3], [0, 1, 2], 2, 2), {}, "not divisible"),
        (([0, 1, 2, 3], [0, 1, 2, 3], 0), {}, "positive int"),
        (([0, 1, 2, 3], [0, 1, 2, 3], 2, 2, [0]), {}, "old_holder has 1 entries"),
        (([0, 1, 2, 3], [0, 1, 2, 3], 2, 2, [0, 1], [0, 1, 2]), {}, "new_holder has 3 entries"),
        (([0, 1, 2, 3], [0, 1, 2, 3], 2, 2, [1, 1]), {}, r"group ranks \[1\] more than once"),
        (([0, 1, 2, 3], [0, 1, 2, 3], 2, 2, [0, 1], [0, 0]), {}, "more than once"),
        (([0, 1, 2, 3], [0, 1, 2, 3], 2, 2, [0, 1], [0, -1]), {}, "must be >= 0"),
        (([0, 1, 2, 3], [0, 1, 2, 3], 2, 2, [0, -2]), {}, "-1 \\(lost\\)"),
        (([0, -1, 2, 3], [0, 1, 2, 3], 2), {}, "negative"),
        (([], [0], 1), {}, "empty"),
        ((torch.zeros(2, 2, dtype=torch.int64), [0, 1], 2), {}, "1-D"),
        ((torch.tensor([0.0, 1.0]), [0, 1], 2), {}, "integers"),
        (([0, 1, 2, 3], [0, 1, 2, 4], 2), {"allow_reload": False}, r"experts \[4\]"),
    ],
)
def test_plan_errors(args, kwargs, message):
    with pytest.raises(PlanError, match=message):
        plan_layer(*args, **kwargs)


@pytest.mark.parametrize(
    "args, message",
    [
        (([0, 0], 2, "old"), "several old ranks"),
        (([0, 2], 2, "old"), r"-1 or in \[0, 2\)"),
        (([0, -1], 2, "old"), r"new ranks \[1\] are not the image"),
        (([0, 1], 2, "old", {1}), "old rank 1 is lost"),
        (([0, 1], 2, "old", {5}), r"lost ranks \[5\]"),
        (([0, 1], 2, "sideways"), "execute_on"),
        (([0, 1], 0, "new"), "num_new_ranks"),
        (([], 2, "new"), "empty"),
    ],
)
def test_mapping_errors(args, message):
    with pytest.raises(PlanError, match=message):
        holders_from_mapping(*args)


def test_mapping_execute_on_new_drops_leaving_and_lost():
    assert holders_from_mapping([2, -1, 0], 3, "new", lost={2}) == ((2, -1, -1), (0, 1, 2))
    assert holders_from_mapping([-1, 0, 1], 2, "old", lost={0}) == ((-1, 1, 2), (1, 2))


def test_plan_error_is_a_value_error():
    assert issubclass(PlanError, ValueError)
