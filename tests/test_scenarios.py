"""Scenario files: the schema's errors, and every shipped scenario replayed on real workers.

The replays check the report too: the figures in ``report.json`` are the ones the run measured
(the final EP size is the coordinator's, the samples are the workers' steps, the verifications
are the workers' answers), and ``report.png`` is a real PNG.
"""

from __future__ import annotations

import json
import textwrap
from pathlib import Path

import pytest

from elastic.replay.scenario import Scenario, ScenarioError, load_scenario, parse_scenario

ROOT = Path(__file__).resolve().parent.parent
SHIPPED = sorted((ROOT / "scenarios").glob("*.yaml"))
REQUIRED = {"quickstart", "scale_up_under_skew", "scale_down_under_drift", "scale_during_async_transfer",
            "long_mixed_day"}

GOOD = """\
name: tiny
deployment:
  model: {num_layers: 2, num_experts: 8, hidden_size: 16, intermediate_size: 32}
  eplb: {num_redundant_experts: 4, use_async: true, window_size: 10, step_interval: 10}
  ep_size: 2
  max_ep_size: 3
trace:
  - {at_step: 0, kind: zipf, tokens_per_step: 16}
steps: 60
timeline:
  - {at_step: 20, action: scale, to: 3}
  - {at_step: 40, action: rebalance}
expect: {final_ep_size: 3}
"""


def write(tmp_path: Path, text: str, name: str = "scenario.yaml") -> Path:
    path = tmp_path / name
    path.write_text(textwrap.dedent(text))
    return path


def problems_of(path: Path) -> ScenarioError:
    with pytest.raises(ScenarioError) as info:
        load_scenario(path)
    return info.value


# -- the files we ship ---------------------------------------------------------------------------

def test_the_required_scenarios_ship_and_validate():
    names = {load_scenario(path).name for path in SHIPPED}
    assert REQUIRED <= names, f"missing scenarios: {REQUIRED - names}"
    for path in SHIPPED:
        assert load_scenario(path).name == path.stem, f"{path.name}: name should match the file name"


def test_a_good_scenario_parses_into_a_deployment(tmp_path):
    scenario = load_scenario(write(tmp_path, GOOD))
    deployment = scenario.deployment_config()
    assert deployment.ep_size == 2 and deployment.num_physical == 12
    assert deployment.eplb.use_async and deployment.eplb.step_interval == 10
    assert [e["size_after"] for e in scenario.planned()] == [3, 3]
    # the scenario's trace is the deployment's load; the replay's pacing and deadlines are its defaults
    assert [(p.start_step, p.trace.tokens_per_step) for p in deployment.trace] == [(0, 16)]
    assert (deployment.step_delay_s, deployment.heartbeat_s, deployment.timeouts.collective) == (0.01, 0.01, 10.0)


def test_an_old_style_scenario_names_the_new_keys(tmp_path):
    """Before scenarios embedded a deployment they had their own names; each one gets its new key."""
    old = write(tmp_path, GOOD.replace("""deployment:
  model: {num_layers: 2, num_experts: 8, hidden_size: 16, intermediate_size: 32}
  eplb: {num_redundant_experts: 4, use_async: true, window_size: 10, step_interval: 10}
  ep_size: 2
  max_ep_size: 3
""", """model: {layers: 2, experts: 8, redundant_slots: 4}
eplb: {mode: async, interval: 10}
initial_ep_size: 2
pace_s: 0.02
"""))
    error = problems_of(old)
    assert [(p.path, p.message.split(" (")[0]) for p in error.problems] == [
        ("model.layers", "moved: write deployment.model.num_layers"),
        ("model.experts", "moved: write deployment.model.num_experts"),
        ("model.redundant_slots", "moved: write deployment.eplb.num_redundant_experts"),
        ("eplb.mode", "moved: write deployment.eplb.use_async: true"),
        ("eplb.interval", "moved: write deployment.eplb.step_interval"),
        ("initial_ep_size", "moved: write deployment.ep_size"),
        ("pace_s", "moved: write deployment.step_delay_s"),
    ]
    assert "with DeploymentConfig's names" in str(error)
    inner = write(tmp_path, GOOD.replace("  max_ep_size: 3\n", "  max_ep_size: 3\n  trace: []\n"), "inner.yaml")
    assert f"{inner}: deployment.trace: a scenario's load is its top-level trace:" in str(problems_of(inner))


def test_every_deployment_option_can_be_set_in_a_scenario(tmp_path):
    text = GOOD.replace("step_interval: 10}", "step_interval: 10, async_layer_interval: 3, communicator: gloo}")
    text = text.replace("  max_ep_size: 3\n", "  max_ep_size: 3\n  seed: 7\n  max_memory: 1GiB\n"
                        "  timeouts: {collective: 4, heartbeat: 5}\n")
    deployment = load_scenario(write(tmp_path, text)).deployment_config()
    assert (deployment.eplb.async_layer_interval, deployment.eplb.communicator, deployment.seed) == (3, "gloo", 7)
    assert deployment.max_memory == 1 << 30
    assert (deployment.timeouts.collective, deployment.timeouts.heartbeat, deployment.timeouts.worker_start) == (4, 5, 60)


# -- malformed files: one clear message per error, naming the file and the key path ----------------

@pytest.mark.parametrize(
    "change, path, expected",
    [
        ({"deployment": {"model": {"num_experts": 8, "colour": "red"}}}, "deployment.model.colour",
         "unknown key (allowed here: "),
        ({"stepz": 10}, "stepz", "unknown key"),
        ({"deployment": {"eplb": {"use_async": "fast"}}}, "deployment.eplb.use_async", "expected true or false, got 'fast'"),
        ({"deployment": {"eplb": {"window_size": 0}}}, "deployment.eplb.window_size", "expected a value >= 1, got 0"),
        ({"deployment": {"eplb": {"policy": "nope"}}}, "deployment.eplb.policy", "expected one of 'default', "),
        ({"steps": "many"}, "steps", "expected an integer, got 'many'"),
        ({"expect": {"final_ep_size": "two"}}, "expect.final_ep_size", "expected an integer, got 'two'"),
        ({"deployment": {"timeouts": {"rescaling": -1}}}, "deployment.timeouts.rescaling", "expected a value > 0"),
        ({"trace": [{"at_step": 0, "kind": "zipf", "top_k": "x"}]}, "trace[0].top_k", "expected an integer"),
        ({"faults": [{"kind": "delay_transfer", "rank": 0}]}, "faults[0].seconds", "this key is required"),
    ],
)
def test_schema_errors_name_the_file_the_key_path_and_the_expectation(tmp_path, change, path, expected):
    import yaml

    def merge(into: dict, change: dict) -> None:
        for key, value in change.items():
            if isinstance(value, dict) and isinstance(into.get(key), dict):
                merge(into[key], value)
            else:
                into[key] = value

    data = yaml.safe_load(GOOD)
    merge(data, change)
    file = write(tmp_path, yaml.safe_dump(data))
    error = problems_of(file)
    lines = str(error).splitlines()
    match = [line for line in lines if line.startswith(f"{file}: {path}: ")]
    assert match, f"no error for {path} in:\n{error}"
    assert expected in match[0], match[0]


def test_timeline_errors_point_at_the_event_and_its_key(tmp_path):
    file = write(tmp_path, GOOD.replace("timeline:\n", """timeline:
  - {at_step: 5, action: scale, to: 2, extra: 1}
  - {at_step: soon, action: rebalance}
  - {at_step: 30, action: teleport}
  - {at_step: 30}
"""))
    error = problems_of(file)
    text = str(error)
    assert f"{file}: timeline[0].extra: unknown key (allowed here: action, at_step, to, " in text
    assert f"{file}: timeline[1].at_step: expected an integer, got 'soon'" in text
    assert (f"{file}: timeline[2]: expected action to be one of 'scale', 'kill', 'stall', 'drop_heartbeats', "
            "'recover', 'rebalance', 'autoscaler', got 'teleport'") in text
    assert f"{file}: timeline[3]: expected a mapping with the key 'action'" in text
    assert len(error.problems) == 4  # every error at once, one line each


def test_the_plan_pass_refuses_what_cannot_run(tmp_path):
    file = write(tmp_path, GOOD.replace("timeline:\n", """timeline:
  - {at_step: 10, action: scale, to: 8}
  - {at_step: 12, action: kill, rank: 5}
  - {at_step: 14, action: recover}
  - {at_step: 11, action: rebalance}
  - {at_step: 900, action: rebalance}
  - {at_step: 16, action: autoscaler, enabled: true}
"""))
    text = str(problems_of(file))
    assert f"{file}: timeline[0].to: expected at most deployment.max_ep_size=3, got 8" in text
    assert f"{file}: timeline[1].rank: expected a rank of the group of 2 at that point (0..1), got 5" in text
    assert f"{file}: timeline[2]: expected a failure to recover from" in text
    assert f"{file}: timeline[3].at_step: expected events in step order (>= 14), got 11" in text
    assert f"{file}: timeline[4].at_step: expected a step within the run (steps=60), got 900" in text
    assert f"{file}: timeline[5]: expected an autoscaler: section" in text
    assert "timeline[6]" not in text and "timeline[7]" not in text  # the step out of range is reported once


def test_a_kill_without_recovery_must_expect_failed(tmp_path):
    text = GOOD.replace("timeline:\n", "timeline:\n  - {at_step: 10, action: kill, rank: 1}\n")
    text = text.replace("  - {at_step: 20, action: scale, to: 3}\n  - {at_step: 40, action: rebalance}\n", "")
    error = problems_of(write(tmp_path, text.replace("expect: {final_ep_size: 3}", "expect: {final_ep_size: 1}")))
    assert "expect.final_state: expected 'failed' or null" in str(error)
    ok = load_scenario(write(tmp_path, text.replace("expect: {final_ep_size: 3}", "expect: {final_state: failed}"), "ok.yaml"))
    kill = ok.fault_records()[-1]  # from the generation it was planned in on (a lower bound), once
    assert (kill.generation, kill.from_generation) == (None, 0)


def test_fault_events_and_faults_are_validated(tmp_path):
    base = GOOD.replace("timeline:\n  - {at_step: 20, action: scale, to: 3}\n  - {at_step: 40, action: rebalance}\n", "")
    base = base.replace("  max_ep_size: 3\n", "  max_ep_size: 3\n  auto_recover: true\n")
    base = base.replace("expect: {final_ep_size: 3}", "expect: {final_ep_size: 2}")
    text = base.replace("steps: 60", "steps: 60\ntimeline:\n"
                        "  - {at_step: 10, action: kill, rank: 1, in_phase: resuming, after_layers: 1}\n"
                        "  - {at_step: 12, action: kill, rank: 1, in_phase: suppressing}\n"
                        "  - {at_step: 14, action: stall, rank: 0}\n"
                        "faults:\n  - {kind: corrupt_buffer, rank: 0}\n  - {kind: delay_transfer, rank: 7, seconds: 1}\n")
    file = write(tmp_path, text)
    error = str(problems_of(file))
    assert f"{file}: timeline[0].after_layers: expected after_layers only with in_phase: rescaling or draining" in error
    assert f"{file}: timeline[1].in_phase: expected 'draining', 'suppressed', 'rescaling' or 'resuming'" in error
    assert f"{file}: timeline[2].seconds: expected a value: this key is required" in error
    # the plan pass: a phase kill needs a scale to die in; corrupt_buffer needs verify_transfers
    text = base.replace("steps: 60", "steps: 60\ntimeline:\n"
                        "  - {at_step: 10, action: kill, rank: 1, in_phase: draining}\n"
                        "  - {at_step: 12, action: rebalance}\n"
                        "  - {at_step: 14, action: kill, rank: 2, in_phase: resuming}\n"
                        "faults:\n  - {kind: corrupt_buffer, rank: 0}\n  - {kind: delay_transfer, rank: 7, seconds: 1}\n")
    file = write(tmp_path, text, "plan.yaml")
    error = str(problems_of(file))
    assert f"{file}: timeline[0].in_phase: expected the next event to be a scale to die in" in error
    assert f"{file}: timeline[2].in_phase: expected a scale event after this kill to die in" in error
    assert f"{file}: faults[0]: expected deployment.eplb.verify_transfers: true with a corrupt_buffer fault" in error
    assert f"{file}: faults[1].rank: expected a rank below deployment.max_ep_size=3, got 7" in error
    # a good one: pinned to the generation the rank is in when the phase's command reaches it
    ok = load_scenario(write(tmp_path, base.replace("steps: 60", "steps: 60\ntimeline:\n"
                             "  - {at_step: 10, action: kill, rank: 2, in_phase: resuming}\n"
                             "  - {at_step: 10, action: scale, to: 3}\n"
                             "  - {at_step: 30, action: drop_heartbeats, rank: 0, generation: 3}\n"), "ok.yaml"))
    kill, silent = ok.fault_records()
    assert (kill.in_phase, kill.rank, kill.generation, kill.from_generation) == ("resuming", 2, None, 1)
    assert (silent.from_step, silent.generation, silent.from_generation) == (30, 3, None)  # given: exactly that one
    assert [e["size_after"] for e in ok.planned()][:2] == [2, 2]  # the survivors of the new group of 3


def test_a_size_that_cannot_hold_the_model_is_refused(tmp_path):
    text = GOOD.replace("max_ep_size: 3", "max_ep_size: 4").replace("ep_size: 2", "ep_size: 4")
    text = text.replace("num_redundant_experts: 4", "num_redundant_experts: 0").replace("to: 3", "to: 1")
    text = text.replace("expect: {final_ep_size: 3}", "expect: {final_ep_size: 1}")
    error = problems_of(write(tmp_path, text))
    assert "timeline[0].to: expected a size whose 2 slots per rank hold the 8 experts (at least 4), got 1" in str(error)


def test_yaml_syntax_and_missing_files_are_scenario_errors(tmp_path):
    broken = write(tmp_path, "name: x\nsteps: [1,\n")
    assert f"{broken}: not valid YAML: line 3" in str(problems_of(broken))
    missing = tmp_path / "nope.yaml"
    assert f"{missing}: cannot read the file" in str(problems_of(missing))
    top = write(tmp_path, "- just\n- a list\n", "list.yaml")
    assert "expected a mapping of keys at the top level" in str(problems_of(top))


def test_an_invalid_scenario_runs_nothing(tmp_path, monkeypatch):
    import elastic.control.coordinator
    from elastic.replay.runner import replay

    def refuse(*args, **kwargs):
        raise AssertionError("a coordinator was started for an invalid scenario")

    monkeypatch.setattr(elastic.control.coordinator.Coordinator, "__init__", refuse)
    bad = write(tmp_path, GOOD.replace("steps: 60", "steps: -3"))
    with pytest.raises(ScenarioError, match=r"steps: expected a value >= 1, got -3"):
        replay(bad, report_dir=tmp_path / "out")
    assert not (tmp_path / "out").exists()


def test_parse_scenario_takes_a_mapping():
    scenario = parse_scenario({"name": "x", "steps": 10})
    assert isinstance(scenario, Scenario) and scenario.deployment.ep_size == 2
    with pytest.raises(ScenarioError, match="<scenario>: steps: expected a value: this key is required"):
        parse_scenario({"name": "x"})


# -- replays on real worker processes -------------------------------------------------------------

def check_report(result, out: Path) -> dict:
    """The files exist and hold what the run measured."""
    coordinator = result.replayer.coordinator
    data = json.loads((out / "report.json").read_text())
    final = data["final"]
    # the final figures are the coordinator's
    assert final["ep_size"] == coordinator.size
    assert final["generation"] == coordinator.machine.generation
    assert final["state"] == coordinator.machine.state.value
    assert [t["seq"] for t in data["transitions"]] == [t.seq for t in coordinator.machine.history()]
    # per-step samples: the workers' steps, in order, with real measurements
    samples = data["samples"]
    assert samples, "no samples recorded"
    steps = [s["step"] for s in samples]
    assert steps == sorted(set(steps))
    assert steps[-1] >= result.scenario.steps if final["state"] == "running" else True
    assert len(steps) >= 0.8 * steps[-1], "most steps should have a sample"
    assert all(0 < s["balancedness"] <= 1 and s["step_time"] > 0 for s in samples)
    assert {s["state"] for s in samples} <= {"running", "draining", "suppressed", "rescaling", "resuming", "failed"}
    if final["state"] == "running":
        assert samples[-1]["ep_size"] == coordinator.size
        last = data["verifications"][-1]
        assert last["after"] == "end of run" and sorted(map(int, last["ranks"])) == list(range(coordinator.size))
    # operations carry their phase timings and pauses, as the coordinator recorded them
    for op in data["operations"]:
        record = coordinator.operations[op["id"]]
        assert op["paused_seconds"] == record.paused_seconds and op["status"] == record.status.value
        if op["status"] == "succeeded" and op["kind"] == "scale":
            assert set(op["phase_seconds"]) == {"draining", "suppressed", "rescaling", "resuming"}
            assert all(v is not None and v >= 0 for v in op["phase_seconds"].values())
    # every expectation is there with a verdict and a measured value, as the result says
    assert [e["name"] for e in data["expectations"]] == [e["name"] for e in result.expectations]
    assert data["passed"] == result.passed
    # the plot is a real PNG
    png = out / "report.png"
    raw = png.read_bytes()
    assert len(raw) > 10_000 and raw[:8] == b"\x89PNG\r\n\x1a\n"
    import matplotlib.image

    height, width = matplotlib.image.imread(png).shape[:2]
    assert width > 800 and height > 500
    return data


def _params():
    for path in SHIPPED:
        slow = load_scenario(path).slow
        yield pytest.param(path, id=path.stem, marks=[pytest.mark.slow] if slow else [])


@pytest.mark.multiprocess
@pytest.mark.timeout(300)
@pytest.mark.parametrize("path", list(_params()))
def test_shipped_scenario_replays_green(path, tmp_path):
    from elastic.replay.runner import replay

    result = replay(path, report_dir=tmp_path)
    failed = "\n".join(f"{e['name']}: expected {e['expected']}, measured {e['measured']} ({e['detail']})"
                       for e in result.failed)
    assert result.passed, f"{path.name}:\n{failed}\nerrors: {result.report['errors']}"
    data = check_report(result, tmp_path)
    expected = result.scenario.expect
    if expected.final_ep_size is not None:
        assert data["final"]["ep_size"] == expected.final_ep_size
    # every verification passed on every rank
    assert data["verifications"] and all(v["ok"] for v in data["verifications"])
    if result.scenario.expect.drain_committed_in_flight:
        scales = [e for e in data["events"] if e["action"] == "scale"]
        assert scales and all(e["transfer_in_flight"] for e in scales)


@pytest.mark.multiprocess
@pytest.mark.timeout(180)
def test_a_kill_without_recovery_ends_failed_and_reports_it(tmp_path):
    """The replay stops waiting once the group is failed with nothing to recover it, and says so."""
    from elastic.replay.runner import replay

    text = GOOD.replace("timeline:\n  - {at_step: 20, action: scale, to: 3}\n  - {at_step: 40, action: rebalance}\n",
                        "timeline:\n  - {at_step: 25, action: kill, rank: 1}\n")
    text = text.replace("expect: {final_ep_size: 3}", "expect: {final_state: failed, final_ep_size: 2}")
    result = replay(write(tmp_path, text), report_dir=tmp_path / "out")
    assert result.passed, result.failed
    data = check_report(result, tmp_path / "out")
    assert data["final"]["state"] == "failed" and "rank 1" in data["final"]["failure_reason"]
    assert data["events"][0]["ok"] and data["samples"][-1]["step"] <= 26  # nothing decoded after the kill
    assert [t["dest"] for t in data["transitions"]] == ["failed"]
    assert result.duration_s < 60


def test_the_real_model_scenarios_expect_identical_output_and_the_reference_cannot():
    hf = [load_scenario(path) for path in SHIPPED if path.stem.startswith("hf_")]
    assert {s.deployment.model.architecture for s in hf} >= {"deepseek_v3", "gpt_oss"} and len(hf) >= 3
    assert all(s.expect.identical_output for s in hf)
    from elastic.replay.scenario import parse_scenario

    data = {"name": "x", "deployment": {"ep_size": 2}, "steps": 10, "expect": {"identical_output": True}}
    with pytest.raises(Exception, match="identical_output.*kind: hf"):
        parse_scenario(data, "inline")


@pytest.mark.parametrize("data, names", [
    ({"traffic": {"rate": 2}}, "traffic: requests need a real model"),
    ({"expect": {"no_failed_requests": True}}, "expect.no_failed_requests: expected false or absent"),
    ({"traffic": {"rate": 2, "max_tokens": [8, 4]}, "deployment": {"model": {"kind": "hf", "architecture": "qwen3_moe"}}},
     "traffic.max_tokens"),
    ({"traffic": {"rate": 0}, "deployment": {"model": {"kind": "hf", "architecture": "qwen3_moe"}}}, "traffic.rate"),
])
def test_a_scenarios_traffic_is_checked_before_anything_starts(data, names):
    from elastic.replay.scenario import ScenarioError, parse_scenario

    scenario = {"name": "x", "steps": 10, **data}
    scenario["deployment"] = {"ep_size": 2, **data.get("deployment", {})}
    with pytest.raises(ScenarioError) as caught:
        parse_scenario(scenario, "inline")
    assert names in str(caught.value), str(caught.value)


def test_the_traffic_scenario_expects_every_request_served_and_identical():
    scenario = load_scenario(ROOT / "scenarios" / "hf_traffic.yaml")
    assert scenario.traffic is not None and scenario.expect.no_failed_requests and scenario.expect.identical_output
    assert {e.action for e in scenario.timeline} >= {"scale", "kill"}


SILENCED_UNDER_TRAFFIC = """\
name: silenced_under_traffic
deployment:
  model: {kind: hf, architecture: qwen3_moe, seed: 0}
  eplb: {num_redundant_experts: 8, use_async: true, window_size: 8, step_interval: 8}
  ep_size: 2
  max_ep_size: 2
  timeouts: {collective: 3, heartbeat: 5, worker_start: 120}
  auto_recover: true
  replace_lost: true
  serving: {background_load: false, max_batch: 6, max_queue: 16}
traffic: {rate: 3, concurrency: 4, prompt_len: [4, 10], max_tokens: [16, 32], seed: 0}
steps: 160
timeline:
  - {at_step: 40, action: drop_heartbeats, rank: 1}
run_timeout_s: 120
expect: {final_state: running, final_ep_size: 2, min_failures: 1, identical_output: true, no_failed_requests: true}
"""


@pytest.mark.multiprocess
@pytest.mark.timeout(300)
def test_a_rank_silenced_under_traffic_is_lost_at_its_heartbeat_deadline_and_no_request_fails(tmp_path):
    # a silenced rank still decodes; it used to answer admissions, which kept it alive while its
    # step (the group's: the slowest rank's) froze, and the replay waited out its run_timeout_s
    from elastic.replay.runner import replay

    path = tmp_path / "silenced.yaml"
    path.write_text(SILENCED_UNDER_TRAFFIC)
    result = replay(path, report_dir=tmp_path / "out")
    failed = [f"{e['name']}: {e['measured']} ({e['detail']})" for e in result.failed]
    assert result.passed, failed
    data = json.loads((tmp_path / "out" / "report.json").read_text())
    assert "rank 1" in data["transitions"][0]["reason"] and "silent" in data["transitions"][0]["reason"]
    assert data["duration_s"] < 60, data["duration_s"]  # well inside the run's deadline: nothing waited it out


def test_a_fault_event_s_generation_is_a_lower_bound_and_replace_lost_keeps_the_size(tmp_path):
    """The plan counts one generation per recovery; replace_lost's scale back is one more and
    restores the size. A fault event's record takes the prediction as a lower bound: pinned to
    it exactly, a fault after a recovery that took more generations never fired."""
    text = GOOD.replace("  max_ep_size: 3\n", "  max_ep_size: 3\n  auto_recover: true\n  replace_lost: true\n")
    text = text.replace("ep_size: 2\n", "ep_size: 3\n", 1).replace("num_redundant_experts: 4", "num_redundant_experts: 16")
    text = text.replace("timeline:\n  - {at_step: 20, action: scale, to: 3}\n  - {at_step: 40, action: rebalance}\n",
                        "timeline:\n  - {at_step: 20, action: kill, rank: 2}\n  - {at_step: 40, action: drop_heartbeats, rank: 2}\n")
    scenario = load_scenario(write(tmp_path, text))
    assert [(e["generation"], e["size_after"]) for e in scenario.planned()] == [(0, 3), (2, 3)]
    kill, silent = scenario.fault_records()
    assert (kill.from_generation, silent.from_generation, silent.generation) == (0, 2, None)
    # a given generation stays exact; both at once is refused with one clear line
    both = text.replace("action: drop_heartbeats, rank: 2}", "action: drop_heartbeats, rank: 2, generation: 1}")
    assert load_scenario(write(tmp_path, both, "both.yaml")).fault_records()[1].generation == 1
    raw = GOOD + "faults:\n  - {kind: drop_heartbeats, rank: 1, from_step: 5, generation: 0, from_generation: 1}\n"
    file = write(tmp_path, raw, "raw.yaml")
    assert (f"{file}: faults[0]: expected generation (exactly that one) or from_generation (that one or later), "
            "not both: got generation 0 and from_generation 1") in str(problems_of(file))


def small_fault_scenario(name: str, deployment: str, rest: str, *, redundant: int = 4,
                         timeouts: str = "collective: 3, heartbeat: 4") -> str:
    """A small synthetic-model scenario for the fault tests: ``deployment`` is the lines its
    deployment adds (sizes, recovery), ``rest`` what follows its trace (steps, timeline, faults, expect)."""
    added = "".join(f"  {line}\n" for line in deployment.splitlines())
    return (f"name: {name}\ndeployment:\n"
            "  model: {num_layers: 3, num_experts: 8, hidden_size: 32, intermediate_size: 64}\n"
            f"  eplb: {{num_redundant_experts: {redundant}, use_async: true, window_size: 10, step_interval: 100000}}\n"
            f"{added}  timeouts: {{{timeouts}}}\n"
            "trace:\n  - {at_step: 0, kind: zipf, zipf_exponent: [1.0, 1.4], tokens_per_step: 32}\n" + rest)


FAULT_IN_A_SCALE = small_fault_scenario(
    "fault_in_a_scale",
    """\
auto_recover: true
ep_size: 2
max_ep_size: 3
""",
    """\
run_timeout_s: 150
steps: 120
timeline:
  - {at_step: 20, action: scale, to: 3}
  - {at_step: 25, action: drop_heartbeats, rank: 1}
expect: {final_state: running, final_ep_size: 2, min_failures: 1}
""")


@pytest.mark.multiprocess
@pytest.mark.timeout(300)
def test_a_fault_that_lands_inside_a_scale_is_reported_as_lost_there_and_recovered(tmp_path):
    """Rank 1 of the scale's new generation goes silent as it takes it (the scale's own rescaling):
    the scale fails and the deployment recovers before the drop's event is played. The drop event
    used to count failures from its own start and said "the deployment did not fail"; it now finds
    the failure it caused and says where it was absorbed."""
    from elastic.replay.runner import replay

    path = write(tmp_path, FAULT_IN_A_SCALE)
    result = replay(path, report_dir=tmp_path / "out")
    assert result.passed, [f"{e['name']}: {e['measured']} ({e['detail']})" for e in result.failed]
    data = check_report(result, tmp_path / "out")
    scale, drop = data["events"]
    assert scale["operation_status"] == "failed" and scale["ok"]
    assert "absorbed the timeline's drop rank 1's heartbeats" in scale["detail"], scale["detail"]
    assert drop["ok"] and "recovered by itself" in drop["detail"], drop["detail"]
    assert f"during the scale 2 -> 3 ({scale['operation_id']}, in " in drop["detail"], drop["detail"]
    assert drop["failure"]["operation_id"] == scale["operation_id"] and "rank 1" in drop["failure"]["reason"]


AFTER_REPLACE_LOST = small_fault_scenario(
    "fault_after_replace_lost",
    """\
auto_recover: true
replace_lost: true
ep_size: 3
max_ep_size: 3
""",
    """\
run_timeout_s: 150
steps: 200
timeline:
  - {at_step: 30, action: kill, rank: 2}
  - {at_step: 100, action: drop_heartbeats, rank: 1}
expect: {final_state: running, final_ep_size: 3, min_failures: 2}
""",
    redundant=16)


@pytest.mark.multiprocess
@pytest.mark.timeout(300)
def test_a_fault_after_a_recovery_with_replace_lost_fires_in_the_generation_the_group_is_in(tmp_path):
    """The recovery after the kill (generation 1) is followed by replace_lost's scale back
    (generation 2). The plan predicted generation 1 for the drop, which pinned to it exactly never
    fired ("the deployment did not fail", one failure); now it fires once, in generation 2."""
    from elastic.replay.runner import replay

    result = replay(write(tmp_path, AFTER_REPLACE_LOST), report_dir=tmp_path / "out")
    assert result.passed, [f"{e['name']}: {e['measured']} ({e['detail']})" for e in result.failed]
    data = check_report(result, tmp_path / "out")
    kill, drop = data["events"]
    assert kill["ok"] and drop["ok"] and "rank 1" in drop["failure"]["reason"], drop
    assert "during" not in drop["failure"]  # the group was running when it lost the rank
    fails = [t for t in data["transitions"] if t["dest"] == "failed"]
    assert len(fails) == 2 and data["final"]["ep_size"] == 3


def test_after_a_phase_kill_a_fault_event_needs_a_generation_and_the_message_names_the_kill_not_an_autoscaler(tmp_path):
    base = GOOD.replace("  max_ep_size: 3\n", "  max_ep_size: 3\n  auto_recover: true\n")
    text = base.replace("timeline:\n  - {at_step: 20, action: scale, to: 3}\n  - {at_step: 40, action: rebalance}\n",
                        "timeline:\n  - {at_step: 10, action: kill, rank: 2, in_phase: resuming}\n"
                        "  - {at_step: 10, action: scale, to: 3}\n  - {at_step: 30, action: drop_heartbeats, rank: 0}\n")
    file = write(tmp_path, text.replace("expect: {final_ep_size: 3}", "expect: {final_ep_size: 1}"))
    error = str(problems_of(file))
    assert (f"{file}: timeline[2].generation: expected an explicit generation: the scale that timeline[0]'s kill in a "
            "phase failed leaves the group to its recovery, so the timeline cannot tell which generation the rank is in"
            ) in error, error
    assert "autoscaler" not in error


# -- faults the timeline or faults: section cause, judged in process -------------------------------

KILLED_TWICE = small_fault_scenario(
    "fault_kill_replace_lost_twice",
    """\
ep_size: 3
max_ep_size: 4
auto_recover: true
replace_lost: true
""",
    """\
run_timeout_s: 120
steps: 120
timeline:
  - {at_step: 30, action: kill, rank: 1}
  - {at_step: 60, action: kill, rank: 1}
expect: {final_ep_size: 3, min_failures: 2}
""")


class FakeCoordinator:
    """What the replayer's verification of an unplanned operation reads: replace_lost's scale 2 -> 3
    (generation 2) done; the snapshot's step advances on each read (``steps``, the last one kept)."""

    def __init__(self, steps: list[int], fired: dict[int, int | None], broken: bool):
        self.steps, self.fired, self.broken, self.verified = list(steps), fired, broken, 0
        self.size = 3
        self.output_check = {"enabled": False}

    def snapshot(self) -> dict:
        step = self.steps.pop(0) if len(self.steps) > 1 else self.steps[0]
        return {"operation": {"id": "op-scale", "kind": "scale", "status": "succeeded", "from_size": 2, "target_size": 3},
                "state": "running", "generation": 2, "step": step, "ep_size": 3}

    def verify(self, timeout: float) -> dict:
        self.verified += 1
        if self.broken:
            raise RuntimeError("verify: rank 0 failed in broken: Refused: Verify refused: the group is broken")
        return {r: {"mismatched": [], "digest": "d", "replica_min": 1, "num_physical": 12, "size": 3, "generation": 2,
                    "step": 80} for r in range(3)}

    def fired_faults(self) -> dict[int, int | None]:
        return dict(self.fired)


def _unplanned_verification(tmp_path, steps, fired, broken):
    from elastic.replay.report import evaluate
    from elastic.replay.runner import Replayer

    scenario = load_scenario(write(tmp_path, KILLED_TWICE))
    replayer = Replayer(scenario)
    replayer.coordinator = FakeCoordinator(steps, fired, broken)
    replayer._verify_unplanned(replayer.coordinator.snapshot())
    report = {"errors": [], "final": {"state": "running", "ep_size": 3, "step": 130},
              "events": [{"index": 0, "ok": True, "label": "kill"}, {"index": 1, "ok": True, "label": "kill"}],
              "verifications": replayer.verifications + [
                  {"after": "end of run", "ok": True, "ranks": {0: {}, 1: {}, 2: {}}, "replica_min": 1, "mismatched": 0,
                   "digests_agree": True, "all_ranks": True}],
              "operations": [], "rebalances": [], "worker_events": []}
    return replayer, {e["name"]: e for e in evaluate(scenario, report)}


def test_a_verification_the_timeline_s_next_kill_breaks_is_not_counted_and_the_report_says_so(tmp_path):
    """replace_lost's scale back (2 -> 3) was verified as the timeline's second kill broke the group:
    "Verify refused: the group is broken" failed no_lost_expert ("expected replica_min >= 1 ...,
    measured 1") and all_slots_verified (2/3), although both kills did what they asked."""
    # the verification starts at step 50; by its refusal the group is at step 80, past the kill at step 60
    replayer, checks = _unplanned_verification(tmp_path, [80, 50, 50, 80], {0: 0, 1: None}, broken=True)
    entry = replayer.verifications[0]
    assert entry["excused"].startswith("kill rank 1 at step 60 broke the group while it ran"), entry
    assert checks["no_lost_expert"]["passed"] and checks["all_slots_verified"]["passed"], checks
    assert checks["all_slots_verified"]["measured"] == "1/1 ok"
    assert "not counted: after scale 2 -> 3 (op-scale): kill rank 1 at step 60" in checks["no_lost_expert"]["detail"]


def test_the_kill_being_played_does_not_excuse_the_verification_of_its_own_recovery(tmp_path):
    """The first kill fired in generation 0; the group is in generation 2: it is not "due" there, so
    the scale back is verified (and a refusal counts)."""
    replayer, checks = _unplanned_verification(tmp_path, [50], {0: 0, 1: None}, broken=False)
    assert replayer.coordinator.verified == 1 and "excused" not in replayer.verifications[0]
    replayer, checks = _unplanned_verification(tmp_path, [50], {0: 0, 1: None}, broken=True)
    assert "excused" not in replayer.verifications[0]
    assert not checks["no_lost_expert"]["passed"] and not checks["all_slots_verified"]["passed"]
    # the failed check names what failed: never "measured 1" against "replica_min >= 1"
    lost = checks["no_lost_expert"]
    assert lost["measured"] == "1/2 gave no replica count", lost
    assert "after scale 2 -> 3 (op-scale): RuntimeError: verify: rank 0 failed in broken" in lost["detail"], lost


RAW_FAULTS = small_fault_scenario(
    "raw_faults",
    """\
ep_size: 3
max_ep_size: 4
auto_recover: true
""",
    """\
run_timeout_s: 120
steps: 60
faults:
  - {kind: kill, rank: 3, at_step: 20}
  - {kind: kill, rank: 1, at_step: 20}
expect: {final_ep_size: 2, min_failures: 1}
""")


def test_a_raw_fault_that_never_fires_fails_faults_fired_with_one_line_naming_it(tmp_path):
    from elastic.replay.runner import _fault_expectations

    scenario = load_scenario(write(tmp_path, RAW_FAULTS))
    report = {"expectations": [], "transitions": [], "worker_events": [], "faults_fired": {0: None, 1: 0}}
    _fault_expectations(scenario, report)
    fired = next(e for e in report["expectations"] if e["name"] == "faults_fired")
    assert not report["passed"] and not fired["passed"] and fired["measured"] == "1/2 fired"
    assert fired["detail"] == ("faults[0] (kill rank 3 at step 20) never fired: no rank 3 reached it in any "
                               "generation from 0 on")
    failed = [{"dest": "failed", "reason": "worker lost: rank 1 exited unexpectedly"}]
    report = {"expectations": [], "transitions": failed, "worker_events": [], "faults_fired": {0: 1, 1: 0}}
    _fault_expectations(scenario, report)
    assert report["passed"] and report["expectations"][0]["detail"] == ("faults[0] fired in generation 1; "
                                                                       "faults[1] fired in generation 0")
    off = load_scenario(write(tmp_path, RAW_FAULTS.replace("min_failures: 1}", "min_failures: 1, faults_fired: false}"),
                              "off.yaml"))
    report = {"expectations": [], "transitions": failed, "worker_events": [], "faults_fired": {0: None, 1: 0}}
    _fault_expectations(off, report)
    assert report["passed"] and not any(e["name"] == "faults_fired" for e in report["expectations"])


@pytest.mark.multiprocess
@pytest.mark.timeout(180)
def test_a_replay_reports_the_raw_fault_that_never_fired(tmp_path):
    """A kill of rank 3 at size 3 never fires; the run passed with no word of it. The kill of rank 1 fires."""
    from elastic.replay.runner import replay

    result = replay(write(tmp_path, RAW_FAULTS), report_dir=tmp_path / "out")
    assert [e["name"] for e in result.failed] == ["faults_fired"], result.failed
    data = check_report(result, tmp_path / "out")
    assert data["faults_fired"] == {"0": None, "1": 0}
    assert result.failed[0]["detail"].startswith("faults[0] (kill rank 3 at step 20) never fired")


DROPPED_FROM_STEP_0 = small_fault_scenario(
    "drop_from_step_0",
    """\
ep_size: 3
max_ep_size: 4
auto_recover: true
""",
    """\
run_timeout_s: 120
steps: 60
timeline:
  - {at_step: 0, action: drop_heartbeats, rank: 1}
expect: {min_failures: 1, final_ep_size: 2}
""",
    timeouts='collective: 3, heartbeat: 4, worker_start: 10')


@pytest.mark.multiprocess
@pytest.mark.timeout(180)
def test_a_drop_heartbeats_at_step_0_lets_the_start_complete_and_loses_the_rank_at_its_heartbeat_deadline(tmp_path):
    """It silenced the Started report too: "rank 1 sent no report within worker_start ... hung while starting"."""
    from elastic.replay.runner import replay

    result = replay(write(tmp_path, DROPPED_FROM_STEP_0), report_dir=tmp_path / "out")
    assert result.passed, [f"{e['name']}: {e['measured']} ({e['detail']})" for e in result.failed]
    data = check_report(result, tmp_path / "out")
    fails = [t for t in data["transitions"] if t["dest"] == "failed"]
    assert len(fails) == 1 and "rank 1" in fails[0]["reason"] and "heartbeat timeout" in fails[0]["reason"], fails
    assert not data["errors"] and [v["after"] for v in data["verifications"] if not v.get("excused")][-1] == "end of run"


def test_a_kill_whose_survivors_are_too_few_is_planned_as_the_coordinator_recovers_with_fresh_workers(tmp_path):
    """The plan pass refused a kill whose survivors could not hold the model ("1 rank(s) cannot hold
    the model"), while the coordinator recovers such a group with fresh workers when max_ep_size has
    room (replayed: 2 -> recover 2 -> 2 -> scale to 3, every expectation held). GOOD has 6 slots per
    rank for 8 experts: one survivor cannot hold them."""
    text = (GOOD.replace("eplb: {", "auto_recover: true\n  eplb: {")
            .replace("  - {at_step: 20, action: scale, to: 3}\n  - {at_step: 40, action: rebalance}\n",
                     "  - {at_step: 10, action: kill, rank: 1}\n  - {at_step: 20, action: kill, rank: 1, in_phase: "
                     "draining}\n  - {at_step: 20, action: scale, to: 3}\n  - {at_step: 40, action: scale, to: 3}\n"))
    scenario = load_scenario(write(tmp_path, text))
    assert [e["size_after"] for e in scenario.planned()] == [2, 2, 2, 3]  # each recovery: 1 survivor + 1 fresh
    alone = GOOD.replace("ep_size: 2", "ep_size: 1").replace("eplb: {", "auto_recover: true\n  eplb: {").replace(
        "  - {at_step: 20, action: scale, to: 3}\n", "  - {at_step: 20, action: kill, rank: 0}\n")
    assert "timeline[0]: expected a kill the survivors can recover from (auto_recover): 0 rank(s) cannot hold the " \
           "model" in str(problems_of(write(tmp_path, alone, "alone.yaml")))  # no survivor: nothing to recover from
