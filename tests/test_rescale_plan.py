"""A rescale as data: the :class:`RescaleSpec` every Prepare, Suppress and Rescale carries, and
the worker's pure plan of it (:func:`elastic.worker.rescale_plan.plan_rescale`), tested without a
process or a group."""

from __future__ import annotations

import pytest

from elastic.core import protocol as p


def test_rescale_spec_says_who_survives_and_who_sends_the_state():
    down = p.RescaleSpec(generation=2, new_size=2, mapping=(0, 1, -1), execute_on="old")
    assert (down.old_size, down.survivors, down.source, down.joining) == (3, (0, 1), 0, False)
    recover = p.RescaleSpec(generation=3, new_size=3, mapping=(-1, 0, 1), lost=(0,), keep_requests=False)
    assert (recover.survivors, recover.source, recover.joining) == ((0, 1), 0, True)
    # the same scale in its Prepare and its Rescale is the same value
    assert p.Prepare(seq=4, spec=down).spec == p.Rescale(seq=5, spec=down, prepared=True).spec
    assert p.Suppress(seq=4).announced is None


@pytest.mark.parametrize(("fields", "words"), [
    ({"new_size": 2, "mapping": ()}, "at least one old rank"),
    ({"new_size": 0, "mapping": (0,)}, "new_size must be positive"),
    ({"new_size": 2, "mapping": (0, 0)}, "names a new rank twice"),
    ({"new_size": 2, "mapping": (0, 2)}, "outside 0..1"),
    ({"new_size": 2, "mapping": (0, 1), "lost": (2,)}, "lost (2,)"),
    ({"new_size": 2, "mapping": (0, 1), "execute_on": "both"}, "execute_on"),
])
def test_rescale_spec_refuses_a_meaningless_rescale_by_name(fields, words):
    with pytest.raises(ValueError, match=words.replace("(", r"\(").replace(")", r"\)")):
        p.RescaleSpec(generation=1, **fields)


def test_a_rescale_command_cannot_be_built_without_its_spec():
    with pytest.raises(TypeError):
        p.Rescale(seq=1)  # type: ignore[call-arg]


# -- the worker's plan, without a process or a group ---------------------------------------------

def _window(layers: int = 2, logical: int = 4, seed: int = 0):
    import torch

    from eplb.state import LoadWindow

    window = LoadWindow(4, layers, logical)
    g = torch.Generator().manual_seed(seed)
    for _ in range(4):
        window.record(torch.randint(0, 50, (layers, logical), generator=g))
    return window


def _static(layers: int = 2, logical: int = 4, physical: int = 6):
    from eplb.placement import Placement

    return Placement.static(layers, logical, physical)


def test_plan_rescale_of_a_scale_down_keeps_every_expert_and_only_survivors_receive():
    from elastic.worker.rescale_plan import plan_rescale
    from eplb.config import EPLBConfig

    spec = p.RescaleSpec(generation=2, new_size=2, mapping=(0, 1, -1), execute_on="old")
    base = _static()  # 3 ranks x 2 slots
    plan = plan_rescale(spec, base, _window(), config=EPLBConfig(), hosts=("h",) * 3)
    assert plan.placement.num_physical == 4  # the same slots per rank, on 2 ranks
    for layer in range(2):
        assert set(plan.placement.physical_to_logical[layer].tolist()) == {0, 1, 2, 3}  # every expert stays served
        transfers = plan.plans[layer].transfers
        assert all(t.dst in (0, 1) for t in transfers)  # the leaving rank (old rank 2) only sends
        # what a survivor already holds in a slot it keeps is not moved again
        assert all(t.src != t.dst for t in transfers)
    # the leaving rank's experts that the new placement needs come from it or a replica
    assert plan.changed_layers == tuple(layer for layer in range(2) if plan.plans[layer].changes_anything)


def test_plan_rescale_is_a_pure_function_of_its_inputs():
    from elastic.worker.rescale_plan import plan_rescale
    from eplb.config import EPLBConfig

    spec = p.RescaleSpec(generation=3, new_size=4, mapping=(0, 1, 2))
    base, window = _static(), _window(seed=1)
    first = plan_rescale(spec, base, window, config=EPLBConfig(), hosts=("h",) * 4)
    again = plan_rescale(spec, base, window, config=EPLBConfig(), hosts=("h",) * 4)
    assert first.placement.equals(again.placement) and first.plans == again.plans
    assert first.placement.num_physical == 8
    assert base.physical_to_logical.shape == (2, 6)  # the base maps are not touched


def test_held_rows_take_each_survivors_own_slots_and_name_the_torn_layers():
    import torch

    from elastic.worker.rescale_plan import diverged_layers, held_rows

    base = torch.tensor([[0, 1, 2, 3], [0, 1, 2, 3]])
    mine = torch.tensor([[0, 1, 2, 3], [9, 9, 9, 9]])  # old rank 1 committed layer 1, the source did not
    held = held_rows(base, [None, (1, mine), None], old_size=2)
    assert held.tolist() == [[0, 1, 2, 3], [0, 1, 9, 9]]
    assert diverged_layers(held, base) == (1,)
    assert base.tolist() == [[0, 1, 2, 3], [0, 1, 2, 3]]  # not modified


def test_a_ranks_role_follows_the_spec():
    from elastic.worker.rescale_plan import role_in

    down = p.RescaleSpec(generation=2, new_size=2, mapping=(1, -1, 0), execute_on="old")
    assert role_in(down, 0, fresh=False) == role_in(down, 0, fresh=False)
    assert (role_in(down, 0, fresh=False).new_rank, role_in(down, 0, fresh=False).executing_rank) == (1, 0)
    assert role_in(down, 1, fresh=False).leaves
    up = p.RescaleSpec(generation=2, new_size=3, mapping=(1, 0))
    assert role_in(up, 0, fresh=False).executing_rank == 1  # moves over the new group
    assert role_in(up, 2, fresh=True).fresh and role_in(up, 2, fresh=True).new_rank == 2
    with pytest.raises(ValueError, match="rank 2 is not in the old group of 2"):
        role_in(up, 2, fresh=False)


def test_the_policy_places_for_the_survivors_hosts_and_their_node_count():
    from elastic.worker.rescale_plan import eplb_config_for, policy_hosts
    from eplb.config import EPLBConfig

    down = p.RescaleSpec(generation=2, new_size=2, mapping=(1, -1, 0), execute_on="old")
    assert policy_hosts(down, ("a", "b", "c")) == ("c", "a")  # new rank 0 is old rank 2
    up = p.RescaleSpec(generation=2, new_size=4, mapping=(0, 1))
    assert policy_hosts(up, ("a", "a", "b", "b")) == ("a", "a", "b", "b")
    assert eplb_config_for(EPLBConfig(), ("a", "a", "b", "b")).policy_options["num_nodes"] == 2
    pinned = EPLBConfig(policy_options={"num_nodes": 1})
    assert eplb_config_for(pinned, ("a", "b")) is pinned


def test_the_worker_imports_nothing_above_it_and_its_executors_never_the_loop():
    """Layers: the worker imports core and eplb only (no service, control or serving), lazy imports
    included; the executors and the planner know the rank context, never ``process``."""
    import ast
    import pathlib

    root = pathlib.Path(__file__).resolve().parent.parent / "elastic" / "worker"
    for path in sorted(root.glob("*.py")):
        imported = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module:
                imported.add(node.module)
            elif isinstance(node, ast.Import):
                imported.update(alias.name for alias in node.names)
        above = {m for m in imported if m.split(".")[:2] in (["elastic", "service"], ["elastic", "control"],
                                                            ["elastic", "serving"], ["elastic", "launch"])}
        assert not above, f"{path.name} imports {sorted(above)}"
        if path.stem not in ("process", "preload"):
            assert "elastic.worker.process" not in imported, f"{path.name} imports the decode loop"


def test_a_scale_downs_leaving_requests_go_to_the_least_loaded_survivors():
    from elastic.core.owners import least_loaded
    from elastic.worker.rescale_plan import plan_request_moves

    assert least_loaded([5, 0, 3], [4, 4, 1]) == [1, 2, 1]
    with pytest.raises(ValueError, match="no rank"):
        least_loaded([], [1])
    # 4 -> 2: old ranks 1 and 3 leave; survivors 0 (new 0) and 2 (new 1) hold 4 and 2 tokens in flight
    down = p.RescaleSpec(generation=2, new_size=2, mapping=(0, -1, 1, -1), execute_on="old")
    held = [[("a", 4)], [("b", 5), ("c", 1)], [("d", 2)], [("e", 7)]]
    assert plan_request_moves(down, held) == {"b": 2, "c": 0, "e": 0}  # 2+5=7 > 4+1=5 < 7: e to old rank 0
    # nobody leaves: nothing moves; a lost rank's requests are not moved (they replay from their prompts)
    assert plan_request_moves(p.RescaleSpec(generation=2, new_size=3, mapping=(0, 1), execute_on="new"),
                              [[("a", 1)], [("b", 1)]]) == {}
    recover = p.RescaleSpec(generation=3, new_size=1, mapping=(0, -1), lost=(1,))
    assert plan_request_moves(recover, [[("a", 1)], [("b", 1)]]) == {}
    with pytest.raises(ValueError, match="held lists 1 ranks"):
        plan_request_moves(down, [[]])
