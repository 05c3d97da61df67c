"""Static placements: export a running deployment's placement and load window (GET /placement,
``elastic-ep placement export``) and start a deployment from the file (``eplb.initial_placement``)."""

from __future__ import annotations

import json
from pathlib import Path

import httpx
import pytest

from eplb.placement import Placement
from eplb.placement_file import parse_placement, placement_document
from tests.conftest import running, small_config
from tests.helpers import free_port, run_cli

LAYERS, EXPERTS, SLOTS = 4, 8, 12  # small_config: 4 MoE layers of 8 experts, 4 redundant slots over 2 ranks


def _document(ep_size: int = 2, load: list[list[int]] | None = None) -> dict:
    """A valid file for small_config: the static placement and a skewed window."""
    p2l = Placement.static(LAYERS, EXPERTS, SLOTS).physical_to_logical.tolist()
    load = load if load is not None else [[40, 20, 10, 5, 3, 2, 1, 1] for _ in range(LAYERS)]
    return placement_document(p2l, load, ep_size=ep_size, window_steps=8)


def _write(path: Path, document: dict) -> Path:
    path.write_text(json.dumps(document))
    return path


def _digest_and_clean(coordinator) -> set[str]:
    """The maps' digests of every rank, after checking every slot holds its expert's weights."""
    verdicts = coordinator.verify(timeout=60)
    assert all(not v["mismatched"] and v["replica_min"] >= 1 for v in verdicts.values()), verdicts
    return {v["digest"] for v in verdicts.values()}


@pytest.mark.multiprocess
@pytest.mark.timeout(240)
def test_export_then_start_a_deployment_from_the_file(tmp_path):
    from elastic.service.api import create_app
    from elastic.service.server import BackgroundServer

    saved = tmp_path / "placement.json"
    with running(small_config()) as first, BackgroundServer(create_app(first)) as server:
        first.wait_for_step(3, timeout=60)
        first.rebalance(timeout=30)  # async: committed one layer per step
        deadline_steps = first.wait_for_step(3, timeout=60) + 40
        first.wait_for_step(deadline_steps, timeout=90)
        assert first.snapshot()["layers_committed"] >= LAYERS
        direct = httpx.get(f"{server.url}/placement", timeout=60)
        assert direct.status_code == 200, direct.text
        exported = run_cli("placement", "export", "--url", server.url, "-o", str(saved))
        assert exported.exit_code == 0 and f"wrote {saved}" in exported.output, exported.output
        _digest_and_clean(first)  # (its async EPLB goes on rebalancing: the digest may have moved on since)
    document = json.loads(saved.read_text())
    assert document["version"] == 1 and document["ep_size"] == 2 and document["num_physical"] == SLOTS
    assert document["model"] == {"num_moe_layers": LAYERS, "num_logical_experts": EXPERTS}
    assert document["load_window"]["steps"] == 8 and sum(map(sum, document["load_window"]["logical_load"])) > 0
    parse_placement(document)  # a valid file
    static = Placement.static(LAYERS, EXPERTS, SLOTS).physical_to_logical.tolist()
    assert document["physical_to_logical"] != static, "the rebalance should have moved experts"
    assert direct.json()["model"] == document["model"] and direct.json()["ep_size"] == 2

    # the same EP size: the file's placement as it is (no rebalance during the check)
    config = small_config(eplb=dict(initial_placement=str(saved), step_interval=100_000))
    assert config.initial_placement is not None and config.initial_placement[1] == "as saved"
    with running(config) as second:
        second.wait_for_step(2, timeout=60)
        again = second.export_placement(timeout=30)
        assert again["physical_to_logical"] == document["physical_to_logical"]
        assert _digest_and_clean(second) == {document["digest"]}

    # another EP size: recomputed from the file's load window, and it serves the right weights
    config = small_config(ep_size=3, eplb=dict(initial_placement=str(saved), step_interval=100_000))
    placement, how = config.initial_placement
    assert how.startswith("recomputed from the load window") and "ep_size 2" in how and "ep_size 3" in how
    with running(config) as third:
        third.wait_for_step(2, timeout=60)
        assert third.export_placement(timeout=30)["physical_to_logical"] == placement.physical_to_logical.tolist()
        assert len(_digest_and_clean(third)) == 1


def _no_replica(document: dict) -> dict:
    document["physical_to_logical"][2] = [0 if e == 3 else e for e in document["physical_to_logical"][2]]
    return document


def _set(document: dict, changes: dict) -> dict:
    document.update(changes)
    return document


BAD_FILES = {
    "wrong layer count": (lambda d: _set(d, {"physical_to_logical": d["physical_to_logical"][:3]}),
                          "physical_to_logical has 3 layers, the model has 4 MoE layers"),
    "made for another model": (lambda d: _set(d, {"model": {"num_moe_layers": 4, "num_logical_experts": 6},
                                                  "physical_to_logical": [[e % 6 for e in r] for r in d["physical_to_logical"]],
                                                  "load_window": {"steps": 1, "logical_load": [[1] * 6] * 4}}),
                               "made for a model of 4 MoE layers x 6 logical experts; this deployment's model has 4 x 8"),
    "expert out of range": (lambda d: d["physical_to_logical"][1].__setitem__(5, 8) or d,
                            "physical_to_logical layer 1, slot 5: expert 8 is out of range [0, 8)"),
    "negative expert": (lambda d: d["physical_to_logical"][0].__setitem__(0, -1) or d,
                        "layer 0, slot 0: expert -1 is out of range"),
    "an expert with no replica": (_no_replica, "layer 2: logical expert 3 has no replica"),
    "wrong slot count": (lambda d: d["physical_to_logical"][1].pop() and d,
                         "physical_to_logical layer 1 has 11 slots, expected 12 (ep_size 2 x 6 slots per rank)"),
    "slots that do not add up": (lambda d: _set(d, {"num_physical": 16}),
                                 "num_physical is 16, but ep_size 2 x slots_per_rank 6 = 12"),
    "a newer version": (lambda d: _set(d, {"version": 2}), "version 2 is not supported"),
    "a bad load window": (lambda d: d["load_window"]["logical_load"][3].__setitem__(2, -5) or d,
                          "load_window.logical_load layer 3, expert 2: expected a finite number >= 0, got -5"),
    # probe 28: an integer too large for a float was an OverflowError's traceback
    "a load too large for a float": (lambda d: d["load_window"]["logical_load"][0].__setitem__(1, 10 ** 400) or d,
                                     "load_window.logical_load layer 0, expert 1: expected a finite number >= 0, got 1"),
    "a window of more steps than int64": (lambda d: d["load_window"].__setitem__("steps", 2 ** 64) or d,
                                          "load_window.steps must be an integer in [0, 9223372036854775807], got "
                                          "18446744073709551616"),
    "another EP size and no load": (
        lambda d: _set(d, {"ep_size": 3, "slots_per_rank": 4, "load_window": {"steps": 0, "logical_load": [[0] * 8] * 4}}),
        "the file is for ep_size 3 (12 slots), this deployment starts ep_size 2 (12 slots), and the file's load "
        "window is empty"),
}


@pytest.mark.parametrize("case", sorted(BAD_FILES))
def test_a_bad_placement_file_is_refused_before_any_worker_starts(tmp_path, monkeypatch, case):
    from elastic.control import coordinator as coordinator_module
    from elastic.service.preflight import InputError
    from elastic.service.server import load_serve_config

    started = []
    monkeypatch.setattr(coordinator_module.Coordinator, "start", lambda self: started.append(self))
    monkeypatch.setattr("elastic.service.server.serve", lambda *a, **k: started.append(a))
    change, expected = BAD_FILES[case]
    path = _write(tmp_path / "placement.json", change(_document()))
    config = tmp_path / "serve.yaml"
    config.write_text(f"ep_size: 2\nmodel: {{num_layers: 4, num_experts: 8}}\n"
                      f"eplb: {{num_redundant_experts: 4, initial_placement: '{path}'}}\n")
    with pytest.raises(InputError) as info:
        load_serve_config(config)
    message = str(info.value)
    assert f"eplb.initial_placement: {path}: " in message and expected in message, message
    served = run_cli("serve", str(config))
    assert served.exit_code == 2 and expected in served.output, served.output
    assert started == []  # nothing was started


def test_serve_takes_the_file_on_the_command_line(tmp_path, monkeypatch):
    served = []
    monkeypatch.setattr("elastic.service.server.serve", lambda config, *a, **k: served.append(config))
    bad = _write(tmp_path / "bad.json", _no_replica(_document()))
    result = run_cli("serve", "--num-experts", "8", "--initial-placement", str(bad))  # the default deployment: 4 layers
    assert result.exit_code == 2 and "logical expert 3 has no replica" in result.output, result.output
    assert served == []
    from elastic.service.server import load_serve_config

    good = _write(tmp_path / "good.json", _document())  # what the flag becomes (serving for real configures logging)
    loaded = load_serve_config(None, overrides={"model.num_experts": 8, "eplb.initial_placement": str(good)})
    assert loaded.deployment.initial_placement is not None and loaded.deployment.initial_placement[1] == "as saved"


@pytest.mark.parametrize("content, expected", [
    ("{\"version\": 1,", "not JSON: "),
    ("[1, 2]", "expected a JSON object, got list"),
    (None, "cannot read it: No such file or directory"),
])
def test_a_file_that_is_not_a_placement_is_refused(tmp_path, content, expected):
    from pydantic import ValidationError

    path = tmp_path / "placement.json"
    if content is not None:
        path.write_text(content)
    with pytest.raises(ValidationError) as info:
        small_config(eplb=dict(initial_placement=str(path)))
    assert f"eplb.initial_placement: {path}: {expected}" in str(info.value), str(info.value)


@pytest.mark.timeout(30)
def test_a_placement_path_that_is_a_device_a_fifo_or_a_directory_is_refused_without_reading_it(tmp_path):
    """/dev/zero was read until the process ran out of memory (the validate command was killed), and
    a FIFO blocked the open forever; the file must be a regular one, read at most to its limit."""
    import os

    from pydantic import ValidationError

    fifo = tmp_path / "placement.json"
    os.mkfifo(fifo)
    for path in ("/dev/zero", str(fifo), str(tmp_path)):
        with pytest.raises(ValidationError) as info:
            small_config(eplb=dict(initial_placement=path))
        assert (f"eplb.initial_placement: {path}: not a regular file; give the path of a placement file (JSON)"
                in str(info.value)), str(info.value)


def test_a_scenario_embedded_deployment_checks_its_placement_file(tmp_path):
    from elastic.replay.scenario import ScenarioError, parse_scenario

    bad = _write(tmp_path / "bad.json", _no_replica(_document()))
    good = _write(tmp_path / "good.json", _document())
    scenario = {"name": "placed", "steps": 20, "deployment": {
        "ep_size": 2, "model": {"num_layers": 4, "num_experts": 8},
        "eplb": {"num_redundant_experts": 4, "initial_placement": str(good)}}}
    parsed = parse_scenario(scenario, "placed.yaml")
    assert parsed.deployment_config().initial_placement[1] == "as saved"
    scenario["deployment"]["eplb"]["initial_placement"] = str(bad)
    with pytest.raises(ScenarioError) as info:
        parse_scenario(scenario, "placed.yaml")
    assert "logical expert 3 has no replica" in str(info.value), str(info.value)


def test_another_ep_size_is_recomputed_from_the_load_window(tmp_path):
    path = _write(tmp_path / "placement.json", _document())
    config = small_config(ep_size=3, eplb=dict(initial_placement=str(path)))  # 12 slots over 3 ranks
    placement, how = config.initial_placement
    assert how == ("recomputed from the load window (8 steps): the file is for ep_size 2 (12 slots), this deployment "
                   "starts ep_size 3 (12 slots)")
    assert placement.num_physical == SLOTS and int(placement.replica_count.min()) >= 1
    assert int(placement.replica_count[0, 0]) > 1  # the hottest expert got the redundant slots
    more = small_config(ep_size=2, eplb=dict(initial_placement=str(path), num_redundant_experts=6))  # 14 slots
    assert more.initial_placement[0].num_physical == 14 and more.initial_placement[1].startswith("recomputed")


def test_cli_export_against_an_unreachable_server_exits_3(tmp_path):
    out = tmp_path / "placement.json"
    result = run_cli("placement", "export", "--url", f"http://127.0.0.1:{free_port()}", "-o", str(out))
    assert result.exit_code == 3 and "cannot reach" in result.output, result.output
    assert not out.exists()


def test_export_while_not_running_is_a_409_and_exit_2(tmp_path):
    from elastic.core.errors import ScaleConflict
    from elastic.core.machine import Phase
    from elastic.service.api import create_app
    from elastic.service.server import BackgroundServer
    from tests.test_api import FakeController

    controller = FakeController(Phase.RESCALING)

    def export_placement(timeout: float = 30.0) -> dict:
        raise ScaleConflict("op-1", Phase.RESCALING, (), trigger="export the placement")

    controller.export_placement = export_placement
    with BackgroundServer(create_app(controller)) as server:
        answer = httpx.get(f"{server.url}/placement", timeout=10)
        assert answer.status_code == 409 and "export the placement" in answer.json()["message"], answer.text
        result = run_cli("placement", "export", "--url", server.url, "-o", str(tmp_path / "p.json"))
        assert result.exit_code == 2 and "409" in result.output, result.output
        controller.export_placement = lambda timeout=30.0: _document()
        printed = run_cli("placement", "export", "--url", server.url)  # no -o: the file on stdout
        assert printed.exit_code == 0 and json.loads(printed.output) == _document()
        bad_path = run_cli("placement", "export", "--url", server.url, "-o", str(tmp_path / "no" / "such" / "dir.json"))
        assert bad_path.exit_code == 2 and "cannot write" in bad_path.output, bad_path.output
