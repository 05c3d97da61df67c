"""eplb.placement: the static layout, derived maps, rank views, validation errors."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from eplb.placement import (
    Placement,
    PlacementError,
    align_slots,
    build_logical_to_physical,
    static_physical_to_logical,
    validate_physical_to_logical,
)

# ---------------------------------------------------------------------------------------------
# static layout
# ---------------------------------------------------------------------------------------------


def test_static_layout_slot_i_holds_expert_i_mod_l():
    p2l = static_physical_to_logical(3, 4, 6)
    assert p2l.dtype == torch.int64 and p2l.shape == (3, 6)
    assert p2l.tolist() == [[0, 1, 2, 3, 0, 1]] * 3


def test_static_placement_counts_and_l2p():
    pl = Placement.static(2, 4, 6)
    assert pl.replica_count.tolist() == [[2, 2, 1, 1]] * 2
    assert pl.logical_to_physical.shape == (2, 4, 3)  # width P - L + 1
    assert pl.logical_to_physical[0].tolist() == [[0, 4, -1], [1, 5, -1], [2, -1, -1], [3, -1, -1]]
    assert (pl.num_layers, pl.num_physical, pl.num_logical) == (2, 6, 4)


@pytest.mark.parametrize("args", [(0, 4, 4), (2, 0, 4), (2, 4, 3)])
def test_static_refuses_impossible_shapes(args):
    with pytest.raises(PlacementError):
        static_physical_to_logical(*args)


# ---------------------------------------------------------------------------------------------
# derived maps
# ---------------------------------------------------------------------------------------------


def test_l2p_lists_slots_ascending_and_pads():
    p2l = torch.tensor([[2, 0, 2, 1, 2], [0, 1, 1, 1, 2]])
    l2p, counts = build_logical_to_physical(p2l, 3)
    assert counts.tolist() == [[1, 1, 3], [1, 3, 1]]
    assert l2p.shape == (2, 3, 3)
    assert l2p[0].tolist() == [[1, -1, -1], [3, -1, -1], [0, 2, 4]]
    assert l2p[1].tolist() == [[0, -1, -1], [1, 2, 3], [4, -1, -1]]


def test_l2p_width_too_small_names_the_layer():
    p2l = torch.tensor([[0, 1, 1, 0], [0, 0, 0, 1]])  # layer 1: expert 0 has 3 replicas
    with pytest.raises(PlacementError) as err:
        build_logical_to_physical(p2l, 2, width=2)
    assert err.value.layer == 1 and "layer 1" in str(err.value)


@settings(max_examples=40, deadline=None)
@given(st.data())
def test_l2p_and_counts_agree_with_p2l(data):
    layers = data.draw(st.integers(1, 4))
    experts = data.draw(st.integers(1, 10))
    slots = data.draw(st.integers(experts, experts + 8))
    rows = []
    for _ in range(layers):
        extra = data.draw(st.lists(st.integers(0, experts - 1), min_size=slots - experts, max_size=slots - experts))
        perm = data.draw(st.permutations(list(range(experts)) + extra))
        rows.append(perm)
    p2l = torch.tensor(rows, dtype=torch.int64)
    pl = Placement.from_physical_to_logical(p2l, experts)
    l2p, counts = pl.logical_to_physical, pl.replica_count
    assert counts.sum(dim=1).tolist() == [slots] * layers
    assert ((l2p >= 0).sum(dim=2) == counts).all()
    for layer in range(layers):
        for expert in range(experts):
            held = [int(s) for s in l2p[layer, expert] if s >= 0]
            assert held == sorted(held)
            assert held == [s for s in range(slots) if int(p2l[layer, s]) == expert]


# ---------------------------------------------------------------------------------------------
# rank view, loads, updates
# ---------------------------------------------------------------------------------------------


def test_rank_view_is_the_rank_major_block():
    pl = Placement.from_physical_to_logical(torch.tensor([[0, 1, 2, 3, 0, 1]]), 4)
    view = pl.rank_view(1, 3)
    assert (view.rank, view.num_ranks, view.first_slot, view.num_local) == (1, 3, 2, 2)
    assert list(view.slots) == [2, 3]
    assert view.physical_to_logical.tolist() == [[2, 3]]


@pytest.mark.parametrize("rank,ranks", [(3, 3), (-1, 3), (0, 4), (0, 0)])
def test_rank_view_refuses_bad_ranks(rank, ranks):
    pl = Placement.static(1, 4, 6)
    with pytest.raises(PlacementError):
        pl.rank_view(rank, ranks)


def test_rank_loads_split_an_expert_evenly_over_its_replicas():
    pl = Placement.from_physical_to_logical(torch.tensor([[0, 1, 0, 2]]), 3)  # expert 0 on both ranks
    load = torch.tensor([[10, 4, 2]])
    assert pl.rank_loads(load, 2).tolist() == [[9.0, 7.0]]
    assert pl.balancedness(load, 2).tolist() == pytest.approx([8.0 / 9.0])
    assert pl.balancedness(torch.zeros(1, 3), 2).tolist() == [1.0]  # no load: balanced


def test_with_layer_makes_a_new_placement():
    pl = Placement.static(2, 3, 4)
    new = pl.with_layer(1, torch.tensor([2, 1, 0, 2]))
    assert new.physical_to_logical[1].tolist() == [2, 1, 0, 2]
    assert pl.physical_to_logical[1].tolist() == [0, 1, 2, 0]  # unchanged
    assert new.replica_count[1].tolist() == [1, 1, 2]
    assert not new.equals(pl) and pl.equals(Placement.static(2, 3, 4))
    with pytest.raises(PlacementError):
        pl.with_layer(0, torch.tensor([1, 1, 2, 2]))  # expert 0 lost


# ---------------------------------------------------------------------------------------------
# validation errors name the layer and slot
# ---------------------------------------------------------------------------------------------


def test_validate_accepts_a_valid_placement():
    validate_physical_to_logical(torch.tensor([[0, 1, 1], [1, 0, 0]]), 2)


def test_validate_out_of_range_names_layer_and_slot():
    with pytest.raises(PlacementError) as err:
        validate_physical_to_logical(torch.tensor([[0, 1, 1], [1, 0, 5]]), 2)
    assert (err.value.layer, err.value.slot) == (1, 2)
    assert "layer 1" in str(err.value) and "slot 2" in str(err.value) and "5" in str(err.value)


def test_validate_negative_expert_names_layer_and_slot():
    with pytest.raises(PlacementError) as err:
        validate_physical_to_logical(torch.tensor([[0, -1, 1]]), 2)
    assert (err.value.layer, err.value.slot) == (0, 1)


def test_validate_missing_expert_names_layer():
    with pytest.raises(PlacementError) as err:
        validate_physical_to_logical(torch.tensor([[0, 1, 2], [0, 0, 2]]), 3)
    assert err.value.layer == 1 and "expert 1" in str(err.value)


@pytest.mark.parametrize(
    "p2l,experts",
    [
        (torch.tensor([0, 1, 2]), 3),  # not 2-D
        (torch.tensor([[0.0, 1.0]]), 2),  # not integers
        (torch.tensor([[True, False]]), 2),  # bool is not an expert id
        (torch.tensor([[0, 1]]), 3),  # fewer slots than experts
    ],
)
def test_validate_refuses_malformed_maps(p2l, experts):
    with pytest.raises(PlacementError):
        validate_physical_to_logical(p2l, experts)


# -- align_slots ---------------------------------------------------------------------------
def _rank_multisets(p2l: torch.Tensor, s: int) -> list[list[list[int]]]:
    return [[sorted(row[r * s:(r + 1) * s]) for r in range(len(row) // s)] for row in p2l.tolist()]


@st.composite
def _realignment(draw):
    s = draw(st.integers(1, 5))
    old_ranks, new_ranks = draw(st.integers(1, 4)), draw(st.integers(1, 4))
    layers, experts = draw(st.integers(1, 3)), draw(st.integers(1, 6))
    expert = st.integers(0, experts - 1)
    held = torch.tensor(draw(st.lists(st.lists(expert, min_size=old_ranks * s, max_size=old_ranks * s),
                                      min_size=layers, max_size=layers)))
    new = torch.tensor(draw(st.lists(st.lists(expert, min_size=new_ranks * s, max_size=new_ranks * s),
                                     min_size=layers, max_size=layers)))
    targets = draw(st.permutations(list(range(new_ranks)) + [-1] * old_ranks))
    return held, new, s, list(targets[:old_ranks])


@given(_realignment())
@settings(max_examples=200, deadline=None)
def test_align_slots_only_permutes_within_a_rank_and_keeps_every_held_expert_it_can(case):
    held, new, s, mapping = case
    held_before, new_before = held.clone(), new.clone()
    out = align_slots(new, held, s, mapping)
    assert torch.equal(held, held_before) and torch.equal(new, new_before)  # inputs untouched
    assert _rank_multisets(out, s) == _rank_multisets(new, s)  # same experts per rank: same balance
    for layer in range(new.shape[0]):
        for o, n in enumerate(mapping):
            if n < 0:
                continue
            was, got = held[layer, o * s:(o + 1) * s].tolist(), out[layer, n * s:(n + 1) * s].tolist()
            given_to_n = new[layer, n * s:(n + 1) * s].tolist()
            kept = sum(1 for a, b in zip(was, got) if a == b)
            # the most slots that can stay: per expert, min(held copies, given copies)
            best = sum(min(was.count(e), given_to_n.count(e)) for e in set(was))
            assert kept == best, (was, given_to_n, got)


def test_align_slots_keeps_a_survivor_slots_on_scale_up():
    held = torch.tensor([[0, 1, 2, 3, 3, 2, 1, 0]])  # 2 ranks x 4 slots
    new = torch.tensor([[3, 2, 1, 0, 1, 3, 0, 2, 0, 1, 2, 3, 3, 3, 0, 1]])  # 4 ranks, packed afresh
    out = align_slots(new, held, 4, [0, 1])
    assert out[0, :8].tolist() == [0, 1, 2, 3, 3, 2, 1, 0]  # nothing the survivors hold moves
    assert out[0, 8:].tolist() == new[0, 8:].tolist()  # fresh ranks: the policy's order


def test_align_slots_refuses_a_mapping_of_the_wrong_length():
    with pytest.raises(PlacementError, match="rank_mapping has 1 entries for 2 old ranks"):
        align_slots(torch.zeros(1, 4, dtype=torch.int64), torch.zeros(1, 4, dtype=torch.int64), 2, [0])


def test_placement_for_keeps_held_slots_in_place_and_the_policy_balance():
    from eplb.algorithm import compute_placement
    from eplb.config import EPLBConfig
    from eplb.state import placement_for

    gen = torch.Generator().manual_seed(0)
    previous = compute_placement(torch.rand(6, 16, generator=gen) * 100, 32, 4)
    load = torch.rand(6, 16, generator=gen) * 100
    raw = compute_placement(load, 32, 4, previous=previous)
    aligned = placement_for(EPLBConfig(num_redundant_experts=16), load, 32, 4, previous)
    assert torch.allclose(aligned.balancedness(load, 4), raw.balancedness(load, 4), rtol=1e-12, atol=0)  # sum order only
    assert _rank_multisets(aligned.physical_to_logical, 8) == _rank_multisets(raw.physical_to_logical, 8)

    def kept(p):
        return int((p.physical_to_logical == previous.physical_to_logical).sum())

    assert kept(aligned) > kept(raw), (kept(aligned), kept(raw))  # the policy alone reshuffles slots
