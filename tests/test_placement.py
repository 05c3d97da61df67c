"""eplb.placement: the static layout, derived maps, rank views, validation errors."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from eplb.placement import (
    Placement,
    PlacementError,
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
