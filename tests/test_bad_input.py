"""Bad input costs one clear line, never a traceback, a hang or a minute of work (issue 19).

One test per row of the issue's table, the pre-flight limits one by one, the HTTP API's answers
to oversized and deeply nested bodies, and a property test that feeds ``validate``, ``replay``
and the deployment loader random bytes, random YAML and mutated shipped scenarios.
"""

from __future__ import annotations

import os
import random
import re
import textwrap
import time
import tracemalloc
from pathlib import Path
from types import SimpleNamespace

import pytest
import typer
import yaml
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st
from typer.testing import CliRunner

from elastic.cli import app
from elastic.deployment import DeploymentConfig
from elastic.replay.scenario import ScenarioError, load_scenario
from elastic.service import preflight
from elastic.service.api import create_app
from elastic.service.preflight import InputError
from elastic.service.server import load_serve_config

ROOT = Path(__file__).resolve().parent.parent
SHIPPED = sorted((ROOT / "scenarios").glob("*.yaml"))
QUICKSTART = (ROOT / "scenarios" / "quickstart.yaml").read_text()
runner = CliRunner()


def billion_laughs(levels: int = 8) -> str:
    """A scenario whose unknown key expands to 9**levels strings through nested aliases."""
    lines = ['a: &a ["lol", "lol", "lol", "lol", "lol", "lol", "lol", "lol", "lol"]']
    for i in range(1, levels + 1):
        prev, cur = chr(ord("a") + i - 1), chr(ord("a") + i)
        lines.append(f"{cur}: &{cur} [" + ", ".join([f"*{prev}"] * 9) + "]")
    return "name: laughs\nsteps: 10\n" + "\n".join(lines) + "\n"


@pytest.fixture
def no_workers(monkeypatch):
    """Any attempt to start a coordinator (workers) fails the test."""
    import elastic.control.coordinator

    def refuse(*args, **kwargs):
        raise AssertionError("a coordinator was started")

    monkeypatch.setattr(elastic.control.coordinator.Coordinator, "__init__", refuse)


def one_error_line(output: str, path: Path) -> str:
    lines = [line for line in output.splitlines() if line.strip()]
    assert len(lines) == 1, output
    assert str(path) in lines[0] and "Traceback" not in output
    return lines[0]


# -- the table, row by row ---------------------------------------------------------------

@pytest.mark.parametrize("command", ["validate", "replay"])
def test_random_bytes_are_one_line_not_utf8_exit_2(tmp_path, command, no_workers):
    path = tmp_path / "random.yaml"
    path.write_bytes(b"\x89\xff" + random.Random(19).randbytes(298))
    result = runner.invoke(app, [command, str(path)])
    assert result.exit_code == 2, result.output
    line = one_error_line(result.stderr, path)
    assert "not UTF-8 text" in line


def test_a_billion_laughs_is_refused_fast_in_bounded_memory(tmp_path):
    path = tmp_path / "laughs.yaml"
    path.write_text(billion_laughs(8))
    tracemalloc.start()
    started = time.perf_counter()
    try:
        with pytest.raises(ScenarioError) as info:
            load_scenario(path)
        seconds = time.perf_counter() - started
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert "aliases" in str(info.value) and str(path) in str(info.value)
    assert seconds < 0.5, seconds  # was 7 s and 248 MB before the bounded loader
    assert peak < 16 << 20, peak
    result = runner.invoke(app, ["validate", str(path)])
    assert result.exit_code == 2
    assert "expands to more than 50000 values once its aliases" in one_error_line(result.stderr, path)


def test_a_file_refused_before_parsing_costs_no_torch_import(tmp_path):
    """The command itself stays small: validate imports torch (2 s, 250 MB) only for a file that parses."""
    import subprocess
    import sys

    laughs = tmp_path / "laughs.yaml"
    laughs.write_text(billion_laughs(8))
    for command in ("validate", "replay"):
        probe = ("import sys\nfrom typer.testing import CliRunner\nfrom elastic.cli import app\n"
                 f"result = CliRunner().invoke(app, [{command!r}, {str(laughs)!r}])\n"
                 "print(result.exit_code, 'torch' in sys.modules)")
        done = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=60)
        assert done.stdout.split() == ["2", "False"], (command, done.stdout + done.stderr)


def test_steps_beyond_the_documented_bound_are_refused(tmp_path):
    path = tmp_path / "steps.yaml"
    path.write_text(re.sub(r"(?m)^steps: .*$", "steps: 99999999999999999999", QUICKSTART))
    result = runner.invoke(app, ["validate", str(path)])
    assert result.exit_code == 2, result.output
    line = one_error_line(result.stderr, path)
    assert f"{path}: steps: expected at most {preflight.MAX_STEPS} (a replay decodes one step at a time" in line
    # the bound itself is allowed
    path.write_text(re.sub(r"(?m)^steps: .*$", f"steps: {preflight.MAX_STEPS}", QUICKSTART))
    assert runner.invoke(app, ["validate", str(path)]).exit_code == 0


def test_serve_refuses_a_worker_that_does_not_fit_before_any_process_starts(tmp_path, no_workers):
    path = tmp_path / "deployment.yaml"
    path.write_text("ep_size: 2\neplb: {num_redundant_experts: 100000000}\n")
    typer_app = typer.Typer()
    from elastic.service.server import register_cli

    register_cli(typer_app)
    typer_app.command("other")(lambda: None)  # a second command, so typer keeps "serve" as a subcommand
    started = time.perf_counter()
    result = runner.invoke(typer_app, ["serve", str(path)])
    assert result.exit_code == 2, result.output
    assert time.perf_counter() - started < 20
    line = one_error_line(result.stderr, path)
    assert f"{path}: eplb.num_redundant_experts: a worker would need " in line
    assert "weights" in line and "staging" in line and "available for 2 local rank(s)" in line
    assert "fix: a smaller eplb.num_redundant_experts" in line


def test_serve_on_a_port_in_use_exits_2_before_any_process_starts(no_workers):
    """It started the whole deployment, then failed to bind and stopped it again (exit 3)."""
    import socket

    from elastic.service.server import register_cli

    typer_app = typer.Typer()
    register_cli(typer_app)
    typer_app.command("other")(lambda: None)
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        result = runner.invoke(typer_app, ["serve", "--port", str(port)])
    assert result.exit_code == 2, result.output
    assert result.stderr.strip() == (f"error: --host 127.0.0.1 --port {port}: cannot listen there (Address already in "
                                     "use); fix: another --port, or stop what listens on it")


@pytest.mark.parametrize("args, message", [
    (["--host", "10.255.255.1", "--port", "0"], "error: --host 10.255.255.1 --port 0: cannot listen there (Cannot assign "
     "requested address); fix: an address of this machine for --host (127.0.0.1, or 0.0.0.0 for every interface)"),
    (["--host", "256.1.1.1", "--port", "0"], "error: --host 256.1.1.1 --port 0: cannot listen there ("),
    (["--log-level", "chatty", "--port", "0"], "error: --log-level: expected one of critical, error, warning, info, "
     "debug, trace, got 'chatty'"),
])
def test_serve_with_a_host_not_of_this_machine_or_an_unknown_log_level_exits_2_before_any_process_starts(
        no_workers, args, message):
    """With --port 0 the host was not checked: the deployment started, uvicorn failed to bind and it
    stopped again (exit 3); an unknown --log-level was uvicorn's KeyError traceback once the workers ran."""
    from elastic.service.server import register_cli

    typer_app = typer.Typer()
    register_cli(typer_app)
    typer_app.command("other")(lambda: None)
    result = runner.invoke(typer_app, ["serve", *args])
    assert result.exit_code == 2, result.output
    assert result.stderr.strip().startswith(message) and len(result.stderr.strip().splitlines()) == 1, result.stderr


def test_a_store_host_that_is_no_address_or_nccl_without_a_gpu_is_refused_before_any_process_starts(
        tmp_path, no_workers):
    """A store_host that does not resolve was a gaierror traceback once the coordinator started (serve,
    replay); backend: nccl on this CPU build failed in every worker at its start."""
    import torch.distributed as dist

    path = tmp_path / "serve.yaml"
    path.write_text('ep_size: 2\nstore_host: "nosuch.invalid"\n' + ("" if dist.is_nccl_available() else "backend: nccl\n"))
    with pytest.raises(InputError) as info:
        load_serve_config(path)
    lines = info.value.lines()
    assert lines[0].startswith(f"{path}: store_host: the coordinator's store cannot listen on 'nosuch.invalid', which "
                               "is not an address (")
    assert lines[0].endswith("); give an address of this machine")
    if not dist.is_nccl_available():
        assert lines[1] == (f"{path}: backend: nccl needs NCCL and a GPU, and this machine's torch has no NCCL (a CPU "
                            "build); local workers on CPU use backend: gloo")
    scenario = tmp_path / "scenario.yaml"
    scenario.write_text(QUICKSTART.replace("  ep_size: 2\n", "  ep_size: 2\n  store_host: not a host!!\n", 1))
    result = runner.invoke(app, ["validate", str(scenario)])
    assert result.exit_code == 2
    assert "deployment.store_host: the coordinator's store cannot listen on 'not a host!!', which is not an address" \
        in one_error_line(result.output, scenario)


def test_serve_whose_workers_fail_to_start_says_so_in_one_line(monkeypatch):
    """A worker that failed at its start (a checkpoint missing an expert's weights, a hung import) was
    an OperationFailed traceback from serve, after the deployment had shut down."""
    from elastic.control.coordinator import Coordinator, OperationFailed
    from elastic.service import server
    from elastic.service.server import register_cli

    def failing_start(self):
        raise OperationFailed("Started", "rank 0 failed in worker: KeyError: 'checkpoint /c has no down_proj of "
                                         "expert 3 in layer 0'")

    monkeypatch.setattr(Coordinator, "start", failing_start)
    monkeypatch.setattr(server, "configure_logging", lambda *a, **k: None)  # the root logger stays pytest's
    monkeypatch.setenv(server.ENV_FORMAT, "text")
    typer_app = typer.Typer()
    register_cli(typer_app)
    typer_app.command("other")(lambda: None)
    result = runner.invoke(typer_app, ["serve", "--port", "0"])
    assert result.exit_code == 1, result.output
    assert "Traceback" not in result.output
    assert result.stderr.strip().splitlines()[-1] == (
        "error: the deployment did not start: Started: rank 0 failed in worker: KeyError: 'checkpoint /c has no "
        "down_proj of expert 3 in layer 0'")


def test_max_memory_is_the_budget_when_set(tmp_path):
    path = tmp_path / "deployment.yaml"
    path.write_text("ep_size: 2\nmax_memory: 300MiB\nmodel: {num_experts: 16, hidden_size: 1024, intermediate_size: 2048}\n")
    with pytest.raises(InputError) as info:
        load_serve_config(path, available=lambda: 1 << 40)  # the machine has plenty; the budget says no
    (line,) = info.value.lines()
    assert f"{path}: model: a worker would need" in line and "but max_memory allows 300.0 MiB" in line
    # the same deployment within a larger budget loads
    path.write_text(path.read_text().replace("300MiB", "2GiB"))
    assert load_serve_config(path, available=lambda: 1 << 20).deployment.max_memory == 2 << 30


def test_the_default_budget_is_the_machine_share_of_each_local_rank():
    config = DeploymentConfig.model_validate({"ep_size": 4, "max_ep_size": 4})
    need = preflight.estimate_worker_memory(config).total
    assert not preflight.memory_problems(config, available=lambda: 4 * need)
    (problem,) = preflight.memory_problems(config, available=lambda: 4 * need - 4)
    assert problem.path == "ep_size" and "for 4 local rank(s)" in problem.message
    # workers elsewhere: this machine's memory says nothing about theirs
    remote = config.model_copy(update={"launcher": config.launcher.model_copy(update={"kind": "ray"})})
    assert not preflight.memory_problems(remote, available=lambda: 0)


def test_a_scenario_that_does_not_fit_names_its_own_key(tmp_path):
    path = tmp_path / "big.yaml"
    budget = "deployment:\n  max_memory: 1GiB\n"
    path.write_text(QUICKSTART.replace("num_redundant_experts: 4", "num_redundant_experts: 100004")
                    .replace("deployment:\n", budget))
    with pytest.raises(ScenarioError) as info:
        load_scenario(path)
    (problem,) = info.value.problems  # the key path as the scenario spells it: under deployment:
    assert problem.path == "deployment.eplb.num_redundant_experts", problem
    assert "but deployment.max_memory allows 1.0 GiB; fix: a smaller deployment.eplb.num_redundant_experts" \
        in problem.message
    path.write_text(QUICKSTART.replace("deployment:\n", budget))
    assert load_scenario(path).deployment_config().max_memory == 1 << 30


# -- the pre-flight limits one by one --------------------------------------------------------------

def test_oversized_and_non_regular_files_are_refused_without_reading_them(tmp_path):
    big = tmp_path / "big.yaml"
    big.write_bytes(b"#" * (preflight.MAX_FILE_BYTES + 1))
    with pytest.raises(InputError, match="more than the 1.0 MiB a config file may have"):
        preflight.read_text(big)
    fifo = tmp_path / "fifo.yaml"
    os.mkfifo(fifo)  # opening it would block until a writer came
    started = time.perf_counter()
    with pytest.raises(InputError, match="not a regular file"):
        preflight.read_text(fifo)
    assert time.perf_counter() - started < 1
    with pytest.raises(InputError, match="not a regular file"):
        preflight.read_text(tmp_path)
    with pytest.raises(InputError, match="cannot read the file"):
        preflight.read_text(tmp_path / "missing.yaml")
    bom = tmp_path / "bom.yaml"
    bom.write_bytes(b"\xef\xbb\xbfname: x\n")  # an editor's byte-order mark is fine
    assert preflight.read_yaml(bom) == {"name": "x"}


@pytest.mark.parametrize("text, message", [
    ("a: " + "[" * 200 + "]" * 200, "nesting deeper than 64 levels"),
    ("a: &a [1, *a]", "alias *a refers to a node that contains it"),
    ("a: 2001-13-45", "a value cannot be read (ValueError: month must be in 1..12)"),
    ("a: !!int 0x", "a value cannot be read"),
    ("a: !!timestamp 1", "a value cannot be read"),
    ("a: [1, 2", "not valid YAML: line 2, column 1: while parsing a flow sequence, did not find expected ',' or ']'"),
    ("a: *nowhere", "found undefined alias"),
    ("a: 1\n---\nb: 2\n", "expected a single document"),
    ("x: [" + ", ".join(["1"] * 50_001) + "]", "the document has more than 50000 values"),
])
def test_yaml_limits_and_unreadable_values_are_one_input_error(text, message):
    with pytest.raises(InputError) as info:
        preflight.load_yaml(text, "f.yaml")
    assert message in str(info.value) and str(info.value).startswith("f.yaml: not valid YAML")
    assert "\n" not in str(info.value)


def test_modest_aliases_still_load():
    text = "base: &base {kind: zipf, top_k: 2}\ntrace: [*base, *base, *base]\n"
    assert preflight.load_yaml(text, "f.yaml")["trace"] == [{"kind": "zipf", "top_k": 2}] * 3


@pytest.mark.parametrize("edit, key, message", [
    (("max_ep_size: 4", "max_ep_size: 5000"), "deployment.max_ep_size", "expected at most 4096 (one worker process"),
    (("max_ep_size: 4", "max_ep_size: 4\n  seed: 99999999999999999999"), "deployment.seed",
     "expected an integer within int64"),
    (("max_ep_size: 4", "max_ep_size: 4\n  step_delay_s: 1e9"), "deployment.step_delay_s",
     "expected at most 604800 (a wait or a pace"),
    (("steps: 240", "steps: 240\nrun_timeout_s: .inf"), "run_timeout_s", "expected a finite number"),
    (("tokens_per_step: 64", "tokens_per_step: 64\n    seed: -99999999999999999999"), "trace[0].seed",
     "expected an integer within int64"),
    # probe 28: a fault record's seconds had no bound (a stall of 1e30 s crashed its worker's sleep)
    (("steps: 240", "steps: 240\nfaults: [{kind: stall, rank: 0, at_step: 5, seconds: 1e30}]"), "faults[0].seconds",
     "expected at most 604800 (a wait or a pace"),
    (("steps: 240", "steps: 240\nfaults: [{kind: delay_transfer, rank: 0, seconds: 1e9}]"), "faults[0].seconds",
     "expected at most 604800"),
    (("steps: 240", "steps: 240\nfaults: [{kind: slow_prepare, rank: 0, seconds: 1e9}]"), "faults[0].seconds",
     "expected at most 604800"),
])
def test_numeric_bounds_name_the_key_and_the_reason(tmp_path, edit, key, message):
    path = tmp_path / "s.yaml"
    path.write_text(QUICKSTART.replace(*edit))
    with pytest.raises(ScenarioError) as info:
        load_scenario(path)
    assert [p.path for p in info.value.problems] == [key]
    assert message in str(info.value)


def test_hook_programs_must_exist(tmp_path):
    script = tmp_path / "check.sh"
    script.write_text("#!/bin/sh\nexit 0\n")
    path = tmp_path / "serve.yaml"
    path.write_text(textwrap.dedent(f"""\
        ep_size: 2
        hooks:
          before_scale: [{{command: [{script}]}}, {{command: "true && echo ok"}}]
          after_scale: [{{command: "no-such-program-19 --now"}}]
        """))
    with pytest.raises(InputError) as info:
        load_serve_config(path)
    assert [p.path for p in info.value.problems] == ["hooks.before_scale[0].command", "hooks.after_scale[0].command"]
    assert "is not an executable file (chmod +x?)" in info.value.problems[0].message
    assert "'no-such-program-19' is not on PATH" in info.value.problems[1].message
    script.chmod(0o755)
    path.write_text(path.read_text().replace("no-such-program-19", "true"))
    assert load_serve_config(path).hooks is not None


# -- the HTTP API: the same problems in request bodies answer 422 -----------------------------------

class _Controller:
    """Just enough of a coordinator for the app: a scale call is recorded, never run."""

    def __init__(self):
        from elastic.core.machine import Phase

        self.machine = SimpleNamespace(state=Phase.RUNNING, generation=0)
        self.requests = None
        self.scaled: list[int] = []

    def list_operations(self, limit=None):
        return []

    def subscribe(self, callback):  # the metrics registry listens; nothing happens here
        pass

    def snapshot(self):
        return {"state": "running", "generation": 0, "ep_size": 2, "history": []}

    def scale(self, n, **kwargs):
        self.scaled.append(n)
        raise AssertionError("an invalid body reached the controller")


def test_the_api_answers_422_to_oversized_and_deeply_nested_bodies():
    from fastapi.testclient import TestClient

    controller = _Controller()
    client = TestClient(create_app(controller), raise_server_exceptions=False)
    json_type = {"content-type": "application/json"}
    big = b'{"ep_size": 4, "note": "' + b"x" * (preflight.MAX_BODY_BYTES + 1) + b'"}'

    def chunks():
        for _ in range(20):
            yield b"x" * (preflight.MAX_BODY_BYTES // 10)

    answers = [client.post("/scale", content=big, headers=json_type),
               client.post("/scale", content=chunks(), headers=json_type),
               client.post("/scale", content=b"[" * 5000 + b"]" * 5000, headers=json_type),
               client.post("/scale", content=b'{"ep_size": "\xff"}', headers=json_type),
               client.post("/scale", content=b'{"ep_size": 4,}', headers=json_type),
               client.post("/scale", content=b'{"ep_size": 4}', headers={"content-type": "text/plain"})]
    assert [r.status_code for r in answers] == [422] * 6, [r.text for r in answers]
    assert "larger than the 64.0 KiB a request may have" in answers[0].json()["message"]
    assert "larger than the 64.0 KiB a request may have" in answers[1].json()["message"]
    assert answers[2].json()["message"] == "body: JSON nested too deeply; send a flat object"
    # each says what is wrong with the body (they were "There was an error parsing the body" and "body.14: JSON
    # decode error")
    assert answers[3].json()["message"] == "body: not UTF-8 text (byte 13); send JSON in UTF-8"
    assert answers[4].json()["message"].startswith("body: not valid JSON at character 14 (Expecting property name")
    assert "Content-Type: application/json" in answers[5].json()["message"]
    assert all(r.json()["error"] == "invalid_request" for r in answers)
    assert controller.scaled == []
    assert client.get("/healthz").status_code == 200  # small requests still pass


# -- the property test ----------------------------------------------------------------------------

KEYS = ["name", "steps", "deployment", "model", "eplb", "trace", "timeline", "expect", "initial_ep_size", "max_ep_size",
        "num_layers", "num_experts", "use_async", "window_size", "step_interval", "step_delay_s",
        "ep_size", "num_redundant_experts", "layers", "experts", "redundant_slots", "window", "interval",
        "at_step", "action", "to", "rank", "kind", "tokens_per_step", "top_k", "seed", "launcher", "hooks",
        "max_memory", "timeouts", "collective", "heartbeat"]
NASTY = ["99999999999999999999", "-1", "0", ".nan", ".inf", "-.inf", "1e400", "[", "{", "]", "*x", "&x",
         "!!binary x", "2001-13-45", "!!timestamp 1", "~", "''", "é", "\t", "!!python/object:os.system",
         "'\\x00'", "?", "- - -", "1.5", "true", "12GiB", "*", "&a [*a]"]

scalars = (st.integers(min_value=-(2 ** 70), max_value=2 ** 70) | st.floats() | st.booleans() | st.none()
           | st.text(max_size=12) | st.sampled_from(["zipf", "scale", "kill", "async", "local", "2GiB"]))
trees = st.recursive(scalars, lambda inner: st.lists(inner, max_size=4) | st.dictionaries(
    st.sampled_from(KEYS) | st.text(max_size=6), inner, max_size=5), max_leaves=25)
documents = st.dictionaries(st.sampled_from(KEYS), trees, max_size=8)


DEPLOYMENT = """\
ep_size: 2
max_ep_size: 4
eplb: {num_redundant_experts: 4, use_async: true, step_interval: 50, window_size: 50}
model: {num_experts: 16, num_expert_groups: 4}
trace: [{start_step: 0, trace: {kind: zipf, tokens_per_step: 64}}]
timeouts: {collective: 10, heartbeat: 15}
autoscaler: {up_threshold: 100, down_threshold: 10}
hooks: {before_scale: [{command: "true", timeout_s: 5}]}
"""


@st.composite
def mutated_shipped(draw):
    """A shipped scenario (or a deployment) with a few lines changed, dropped, repeated, cut or salted with bytes."""
    text = draw(st.sampled_from([path.read_text() for path in SHIPPED] + [DEPLOYMENT]))
    for _ in range(draw(st.integers(1, 3))):
        lines = text.splitlines() or [""]  # a truncation may have left nothing
        kind = draw(st.sampled_from(["value", "drop", "bytes", "truncate", "duplicate"]))
        i = draw(st.integers(0, len(lines) - 1))
        if kind == "value" and ":" in lines[i]:
            key = lines[i].split(":", 1)[0]
            lines[i] = f"{key}: {draw(st.sampled_from(NASTY))}"
        elif kind == "drop" and lines:
            del lines[i]
        elif kind == "duplicate" and lines:
            lines.insert(i, lines[i])
        text = "\n".join(lines) + "\n"
        if kind == "bytes":
            at = draw(st.integers(0, len(text)))
            junk = draw(st.binary(min_size=1, max_size=8)).decode("latin-1")
            text = text[:at] + junk + text[at:]
        elif kind == "truncate":
            text = text[:draw(st.integers(0, len(text)))]
    return text.encode("utf-8", "surrogateescape")


@st.composite
def alias_bombs(draw):
    """Aliases nested a random number of levels, each level a random number of references wide."""
    width, levels = draw(st.integers(2, 12)), draw(st.integers(1, 10))
    lines = ["l0: &l0 [x, x]"] + [f"l{i}: &l{i} [" + ", ".join([f"*l{i - 1}"] * width) + "]"
                                  for i in range(1, levels + 1)]
    return ("name: bomb\nsteps: 5\n" + "\n".join(lines) + "\n").encode()


inputs = (st.binary(max_size=400)
          | documents.map(lambda d: yaml.safe_dump(d, allow_unicode=True).encode())
          | mutated_shipped()
          | alias_bombs())


@pytest.fixture(scope="module")
def serve_app():
    from elastic.service.server import register_cli

    typer_app = typer.Typer()
    register_cli(typer_app)
    typer_app.command("other")(lambda: None)
    return typer_app


def _no_replay(*args, **kwargs):
    raise typer.Exit(0)  # a file that got this far parsed; the property is about the input, not the run


# FUZZ_EXAMPLES=1500 for a longer hunt; the suite keeps it small (about 3 s on 2 cores)
@settings(max_examples=int(os.environ.get("FUZZ_EXAMPLES", "60")), deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
@given(data=inputs)
def test_no_input_gives_a_traceback_a_hang_or_a_minute_of_work(data, tmp_path_factory, monkeypatch, serve_app):
    import elastic.control.coordinator
    import elastic.replay.runner

    monkeypatch.setattr(elastic.replay.runner, "replay", _no_replay)
    monkeypatch.setattr(elastic.control.coordinator.Coordinator, "__init__",
                        lambda *a, **k: (_ for _ in ()).throw(AssertionError("a coordinator was started")))
    path = tmp_path_factory.mktemp("fuzz") / "input.yaml"
    path.write_bytes(data)
    for argv in (["validate", str(path)], ["replay", str(path), "--json-only"]):
        started = time.perf_counter()
        result = runner.invoke(app, argv)
        seconds = time.perf_counter() - started
        assert result.exit_code in (0, 2), (argv, result.output, result.exception)
        assert result.exception is None or isinstance(result.exception, SystemExit), repr(result.exception)
        assert "Traceback" not in result.output
        if result.exit_code == 2:
            assert all(line.startswith(f"error {path}") for line in result.stderr.splitlines() if line), result.stderr
        assert seconds < 20, (argv, seconds)  # a hang or a minute of work, not a speed target (a loaded CI core)
        event(f"{argv[0]} exit {result.exit_code}")
    started = time.perf_counter()
    try:
        load_serve_config(path)
        event("deployment loaded")
    except InputError as exc:
        assert all(line.startswith(f"{path}: ") and "\n" not in line for line in exc.lines())
    assert time.perf_counter() - started < 20


# -- checkpoint directories ------------------------------------------------------------------------

def _safetensors(path: Path, *, truncate: int = 0) -> None:
    header = b'{"w": {"dtype": "F32", "shape": [1], "data_offsets": [0, 4]}}'
    data = len(header).to_bytes(8, "little") + header + b"\0\0\0\0"
    path.write_bytes(data[:len(data) - truncate])


def test_checkpoint_directories_are_checked_before_a_worker_opens_them(tmp_path):
    ckpt = tmp_path / "ckpt"
    assert "is not a directory" in preflight.checkpoint_problems(ckpt)[0].message
    ckpt.mkdir()
    assert "config.json: cannot read the file" in preflight.checkpoint_problems(ckpt)[0].message
    (ckpt / "config.json").write_bytes(b"\xff{}")
    assert "config.json: not UTF-8 text" in preflight.checkpoint_problems(ckpt)[0].message
    (ckpt / "config.json").write_text("[" * 5000 + "]" * 5000)
    assert "config.json is not valid JSON" in preflight.checkpoint_problems(ckpt)[0].message
    (ckpt / "config.json").write_text('{"model_type": "mixtral"}')
    assert "has neither model.safetensors nor" in preflight.checkpoint_problems(ckpt)[0].message
    _safetensors(ckpt / "model.safetensors", truncate=30)
    (problem,) = preflight.checkpoint_problems(ckpt)
    assert problem.path == "model.path" and "is not a complete safetensors file" in problem.message
    _safetensors(ckpt / "model.safetensors")
    assert preflight.checkpoint_problems(ckpt) == []
    # a sharded checkpoint: every shard the index names must be there, inside the directory
    (ckpt / "model.safetensors.index.json").write_text(
        '{"weight_map": {"a": "model-1.safetensors", "b": "model-2.safetensors", "c": "../../etc/passwd"}}')
    _safetensors(ckpt / "model-1.safetensors")
    messages = [p.message for p in preflight.checkpoint_problems(ckpt)]
    assert messages == ["the index names '../../etc/passwd', outside the checkpoint directory",
                        "the index names model-2.safetensors, which is missing (incomplete download?)"]


def _serve_config_problems(tmp_path: Path, text: str) -> list:
    """The problems ``load_serve_config`` names in a serve config of ``text``."""
    path = tmp_path / "serve.yaml"
    path.write_text(text)
    with pytest.raises(InputError) as info:
        load_serve_config(path)
    return info.value.problems


def test_an_option_the_eplb_policy_does_not_take_is_refused_before_the_workers_start(tmp_path):
    # pair_iters was an option of default's old swaps (see the README's migration note)
    (problem,) = _serve_config_problems(
        tmp_path, "ep_size: 2\neplb: {policy: default, policy_options: {pair_iters: 2, num_groups: 1, max_swaps: 8}}\n")
    assert problem.path == "eplb.policy_options.pair_iters"
    assert problem.message == ("policy 'default' takes no option 'pair_iters'; it takes: max_swaps, num_groups, "
                               "num_nodes, recount")
    path = tmp_path / "serve.yaml"
    path.write_text("ep_size: 2\neplb: {policy: hierarchical_spill, policy_options: {pair_iters: 2, num_groups: 1}}\n")
    assert load_serve_config(path).deployment.eplb.policy_options == {"pair_iters": 2, "num_groups": 1}


def test_an_unknown_eplb_policy_is_refused_before_the_workers_start(tmp_path):
    (problem,) = _serve_config_problems(tmp_path, "ep_size: 2\neplb: {policy: fastest}\n")
    assert problem.path == "eplb.policy" and "expected one of 'default', " in problem.message
    assert problem.message.endswith("got 'fastest'")


# -- probe 28: a checkpoint that cannot be read, through the config (serve, validate, replay) --------

@pytest.fixture(scope="module")
def saved_checkpoints(tmp_path_factory):
    """A tiny qwen3_moe and a tiny dense qwen3, as save_pretrained writes them (nothing downloaded)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from eplb.models.config import tiny_config

    root = tmp_path_factory.mktemp("checkpoints")
    AutoModelForCausalLM.from_config(AutoConfig.for_model("qwen3_moe", **tiny_config("qwen3_moe"))).save_pretrained(
        root / "moe")
    dense = dict(vocab_size=128, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                 intermediate_size=64, head_dim=8)
    AutoModelForCausalLM.from_config(AutoConfig.for_model("qwen3", **dense)).save_pretrained(root / "dense")
    return root


def _broken_checkpoint(saved: Path, tmp_path: Path, case: str) -> Path:
    import shutil

    if case == "missing":
        return tmp_path / "nowhere"
    if case == "a file":
        (tmp_path / "weights.bin").write_bytes(b"\0" * 64)
        return tmp_path / "weights.bin"
    if case == "dense":
        return saved / "dense"
    ckpt = tmp_path / "ckpt"
    shutil.copytree(saved / "moe", ckpt)
    if case == "config.json garbage":
        (ckpt / "config.json").write_text("{not json")
    elif case == "weights truncated":  # the header still fits: only the tensors' bytes are short
        weights = ckpt / "model.safetensors"
        weights.write_bytes(weights.read_bytes()[:-4])
    elif case == "top_k above the experts":
        import json

        config = json.loads((ckpt / "config.json").read_text())
        (ckpt / "config.json").write_text(json.dumps({**config, "num_experts_per_tok": 20}))
    return ckpt


@pytest.mark.parametrize("case, message", [
    ("missing", r"model\.path: .*nowhere is not a directory; give the directory save_pretrained wrote"),
    ("a file", r"model\.path: .*weights\.bin is not a directory"),
    ("config.json garbage", r"model\.path: config\.json is not valid JSON"),
    ("weights truncated", r"model\.path: model\.safetensors is not a complete safetensors file \(its tensors take "
                          r"(\d+) bytes, the file holds (\d+) after its header\); download it again"),
    ("dense", r"model\.path: .*dense: cannot read the model's MoE layers \(IndexError: .*\); expected a "
              r"Mixture-of-Experts model"),
    # transformers builds it, and every worker then failed on "selected index k out of range"
    ("top_k above the experts", r"model\.path: .*ckpt: config\.json: num_experts_per_tok=20, expected 1 to the "
                                r"model's 8 experts per MoE layer"),
])
def test_a_checkpoint_that_cannot_be_read_is_one_line_from_serve_and_validate(saved_checkpoints, tmp_path, no_workers,
                                                                               case, message):
    """Reading the model's layout when the config is validated raised what transformers or safetensors
    raise (FileNotFoundError, OSError, SafetensorError, IndexError): a traceback from validate, replay
    and serve; the checkpoint checks that name the problem came after it. A truncated tensor region
    behind a header that fits passed those checks and failed in every worker."""
    ckpt = _broken_checkpoint(saved_checkpoints, tmp_path, case)
    serve_file = tmp_path / "serve.yaml"
    serve_file.write_text(yaml.safe_dump({"ep_size": 2, "model": {"kind": "hf", "path": str(ckpt)},
                                          "eplb": {"num_redundant_experts": 2}}))
    scenario = tmp_path / "scenario.yaml"
    scenario.write_text(yaml.safe_dump({"name": "ckpt", "steps": 10, "deployment": {
        "ep_size": 2, "model": {"kind": "hf", "path": str(ckpt)}, "eplb": {"num_redundant_experts": 2}}}))
    for args, path in ((["serve", str(serve_file), "--port", "0"], serve_file), (["validate", str(scenario)], scenario),
                       (["replay", str(scenario)], scenario)):
        result = runner.invoke(app, args)
        assert result.exit_code == 2, (args, result.output)
        assert re.search(message, one_error_line(result.output, path)), result.output


def test_a_random_model_whose_top_k_exceeds_its_experts_is_refused(tmp_path):
    path = tmp_path / "serve.yaml"
    path.write_text("ep_size: 2\nmodel: {kind: hf, architecture: qwen3_moe, config: {num_experts_per_tok: 9}}\n"
                    "eplb: {num_redundant_experts: 2}\n")
    with pytest.raises(InputError) as info:
        load_serve_config(path)
    assert info.value.lines() == [f"{path}: model.config: num_experts_per_tok=9, expected 1 to the model's 8 experts "
                                  "per MoE layer"]


def test_a_key_given_twice_is_refused_naming_both_lines(tmp_path):
    """YAML keeps the last of two equal keys silently: a second timeline: dropped the first's events,
    a second steps: ran a replay of another length. A key that overrides a merged one (<<) is fine."""
    path = tmp_path / "twice.yaml"
    path.write_text(QUICKSTART.replace("timeline:\n", "timeline:\n  - {at_step: 40, action: rebalance}\ntimeline:\n", 1))
    result = runner.invoke(app, ["validate", str(path)])
    assert result.exit_code == 2
    line = one_error_line(result.output, path)
    first = QUICKSTART.splitlines().index("timeline:") + 1
    assert line.endswith(f"not valid YAML: line {first + 2}, column 1: key 'timeline' is given twice (first on line "
                         f"{first}); YAML would keep only the last: remove one"), line
    assert preflight.load_yaml("base: &b {steps: 10, name: x}\nrun:\n  <<: *b\n  steps: 20\n", "m.yaml") == {
        "base": {"steps": 10, "name": "x"}, "run": {"steps": 20, "name": "x"}}

