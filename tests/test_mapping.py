"""Rank mappings: constructors, validation, and properties over random sizes."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from elastic.core.errors import InvalidRankMapping, InvalidScaleRequest
from elastic.core.mapping import RankMapping

# ---------------------------------------------------------------------------------- constructors


def test_scale_down_retires_the_highest_ranks():
    m = RankMapping.for_resize(4, 2)
    assert m.old_to_new == (0, 1, -1, -1)
    assert m.new_size == 2 and m.old_size == 4
    assert m.leaving == (2, 3) and m.retiring == (2, 3) and m.lost == frozenset()
    assert m.survivors == (0, 1) and m.joining == ()
    assert m.new_to_old == (0, 1)
    assert not m.is_identity


def test_scale_up_keeps_old_ranks_and_adds_fresh_ones_on_top():
    m = RankMapping.for_resize(2, 5)
    assert m.old_to_new == (0, 1)
    assert m.joining == (2, 3, 4) and m.leaving == ()
    assert m.new_to_old == (0, 1, -1, -1, -1)


def test_same_size_is_identity():
    assert RankMapping.for_resize(3, 3).is_identity
    assert RankMapping.identity(3) == RankMapping((0, 1, 2), 3)


def test_failure_compacts_survivors_in_order():
    m = RankMapping.without(5, [1, 3])
    assert m.old_to_new == (0, -1, 1, -1, 2)
    assert m.new_size == 3
    assert m.lost == frozenset({1, 3}) and m.retiring == ()
    assert m.leaving == (1, 3) and m.survivors == (0, 2, 4)
    assert m.new_to_old == (0, 2, 4) and m.joining == ()
    assert RankMapping.without(3, []).is_identity
    assert RankMapping.without(3, [2, 2]).new_size == 2  # duplicates are one loss


def test_from_dict_and_to_dict():
    m = RankMapping.from_dict({0: 0, 1: -1, 2: 1}, 3)
    assert m.old_to_new == (0, -1, 1) and m.joining == (2,)
    d = m.to_dict()
    assert d == {"old_to_new": {"0": 0, "1": -1, "2": 1}, "new_size": 3, "leaving": [1], "joining": [2], "lost": []}


def test_lookups():
    m = RankMapping.without(4, [0])
    assert m.new_rank(0) == -1 and m.new_rank(3) == 2
    assert m.old_rank(0) == 1
    with pytest.raises(InvalidRankMapping, match="not an old rank"):
        m.new_rank(4)
    with pytest.raises(InvalidRankMapping, match="not a new rank"):
        m.old_rank(3)


def test_new_rank_of_old_slots_is_rank_major():
    m = RankMapping.for_resize(3, 2)
    assert m.new_rank_of_old_slots(2) == (0, 0, 1, 1, -1, -1)
    with pytest.raises(InvalidRankMapping):
        m.new_rank_of_old_slots(0)


def test_integer_scalars_from_numpy_and_torch_are_accepted():
    m = RankMapping(tuple(torch.tensor([1, 0, -1]).tolist()), torch.tensor(2).item())
    assert m.old_to_new == (1, 0, -1)
    m2 = RankMapping((torch.tensor(0), torch.tensor(1)), 2)
    assert m2.old_to_new == (0, 1) and all(type(v) is int for v in m2.old_to_new)


def test_frozen_and_hashable():
    m = RankMapping.for_resize(2, 3)
    with pytest.raises(AttributeError):
        m.new_size = 4  # type: ignore[misc]
    assert hash(m) == hash(RankMapping((0, 1), 3))


# ---------------------------------------------------------------------------------- validation


@pytest.mark.parametrize(
    ("args", "needle", "old_rank"),
    [
        (((0, 2), 2), "old rank 1 maps to 2, outside [-1, 2)", 1),
        (((0, -2), 2), "old rank 1 maps to -2", 1),
        (((1, 0, 1), 3), "old ranks 0 and 2 both map to new rank 1", 2),
        (((-1, -1), 1), "no old rank survives", None),
        (((), 1), "old group needs at least one rank", None),
        (((0,), 0), "new group needs at least one rank", None),
        (((0, 1.0), 2), "the new rank of old rank 1 must be an integer", None),
        (((0, True), 2), "must be an integer", None),
        (((0, "1"), 2), "must be an integer", None),
        ((5, 2), "must be a sequence", None),
    ],
)
def test_invalid_mappings_name_the_rank_at_fault(args, needle, old_rank):
    with pytest.raises(InvalidRankMapping) as info:
        RankMapping(*args)
    assert needle in str(info.value)
    assert info.value.old_rank == old_rank
    assert isinstance(info.value, InvalidScaleRequest) and isinstance(info.value, ValueError)


def test_lost_ranks_must_leave_and_exist():
    with pytest.raises(InvalidRankMapping, match="lost old rank 1 maps to new rank 1"):
        RankMapping((0, 1), 2, frozenset({1}))
    with pytest.raises(InvalidRankMapping, match="lost rank 5 is not an old rank"):
        RankMapping((0, -1), 1, frozenset({5}))
    m = RankMapping((0, -1, -1), 1, [2])  # any iterable; alive rank 1 retires, rank 2 is lost
    assert m.lost == frozenset({2}) and m.retiring == (1,)


@pytest.mark.parametrize(
    ("call", "needle"),
    [
        (lambda: RankMapping.for_resize(0, 2), "old group"),
        (lambda: RankMapping.for_resize(2, 0), "new group"),
        (lambda: RankMapping.for_resize(2, -3), "new group"),
        (lambda: RankMapping.without(3, [3]), "lost rank 3 is not an old rank"),
        (lambda: RankMapping.without(3, [-1]), "lost rank -1 is not an old rank"),
        (lambda: RankMapping.without(2, [0, 1]), "all 2 ranks are lost"),
        (lambda: RankMapping.from_dict({0: 0, 2: 1}, 2), "missing [1]"),
    ],
)
def test_constructor_errors(call, needle):
    with pytest.raises(InvalidRankMapping) as info:
        call()
    assert needle in str(info.value)


# ---------------------------------------------------------------------------------- properties

sizes = st.integers(min_value=1, max_value=64)


@settings(max_examples=100, deadline=None)
@given(sizes, sizes)
def test_resize_properties(old, new):
    m = RankMapping.for_resize(old, new)
    assert len(m.survivors) == min(old, new)
    assert len(m.leaving) == max(0, old - new)
    assert len(m.joining) == max(0, new - old)
    assert all(m.old_to_new[r] == r for r in m.survivors)  # survivors keep their number
    assert m.lost == frozenset()


@settings(max_examples=100, deadline=None)
@given(st.data())
def test_without_properties(data):
    old = data.draw(sizes)
    lost = data.draw(st.sets(st.integers(0, old - 1), max_size=old - 1))
    m = RankMapping.without(old, lost)
    assert m.new_size == old - len(lost)
    assert set(m.leaving) == lost == m.lost
    assert m.survivors == tuple(r for r in range(old) if r not in lost)
    assert m.new_to_old == m.survivors  # compacted, order kept
    assert m.joining == ()


@st.composite
def valid_mappings(draw):
    old = draw(sizes)
    new = draw(sizes)
    k = draw(st.integers(1, min(old, new)))
    survivors = draw(st.permutations(range(old)))[:k]
    targets = draw(st.permutations(range(new)))[:k]
    old_to_new = [-1] * old
    for o, n in zip(survivors, targets):
        old_to_new[o] = n
    return tuple(old_to_new), new


@settings(max_examples=100, deadline=None)
@given(valid_mappings())
def test_any_injective_mapping_is_valid_and_views_agree(args):
    m = RankMapping(*args)
    # new_to_old inverts old_to_new on survivors
    for old in m.survivors:
        assert m.new_to_old[m.old_to_new[old]] == old
    for new in range(m.new_size):
        old = m.new_to_old[new]
        assert (old == -1) == (new in m.joining)
    assert len(m.survivors) + len(m.leaving) == m.old_size
    assert len(m.survivors) + len(m.joining) == m.new_size
    assert RankMapping.from_dict(dict(enumerate(m.old_to_new)), m.new_size) == m
    assert len(m.new_rank_of_old_slots(3)) == 3 * m.old_size


@settings(max_examples=100, deadline=None)
@given(valid_mappings(), st.data())
def test_breaking_injectivity_or_range_is_refused(args, data):
    old_to_new, new = args
    survivors = [o for o, n in enumerate(old_to_new) if n >= 0]
    broken = list(old_to_new)
    if len(old_to_new) > 1 and data.draw(st.booleans()):
        # copy a survivor's target to another old rank
        src = data.draw(st.sampled_from(survivors))
        dst = data.draw(st.sampled_from([o for o in range(len(old_to_new)) if o != src]))
        broken[dst] = old_to_new[src]
        needle = f"both map to new rank {old_to_new[src]}"
    else:
        dst = data.draw(st.integers(0, len(old_to_new) - 1))
        broken[dst] = data.draw(st.one_of(st.integers(new, new + 10), st.integers(-10, -2)))
        needle = f"old rank {dst} maps to {broken[dst]}"
    with pytest.raises(InvalidRankMapping) as info:
        RankMapping(tuple(broken), new)
    assert needle in str(info.value)
