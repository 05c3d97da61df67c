"""The ``elastic-ep`` command: help, validate, replay's exit status and outputs, bench dispatch."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from typer.testing import CliRunner

from elastic import cli
from elastic.cli import app

ROOT = Path(__file__).resolve().parent.parent
SHIPPED = sorted((ROOT / "scenarios").glob("*.yaml"))

# a scenario whose expectation cannot hold: it never scales, but expects 3 ranks at the end
FAILING = """\
name: expects_too_much
description: two ranks for 40 steps; the expectation wants three.
deployment:
  model: {num_layers: 2, num_experts: 8, hidden_size: 16, intermediate_size: 32}
  eplb: {num_redundant_experts: 4, use_async: true, window_size: 10, step_interval: 10}
  ep_size: 2
  max_ep_size: 3
trace:
  - {at_step: 0, kind: zipf, tokens_per_step: 16}
steps: 40
expect:
  final_ep_size: 3
"""

runner = CliRunner()


def write(tmp_path: Path, text: str, name: str = "scenario.yaml") -> Path:
    path = tmp_path / name
    path.write_text(textwrap.dedent(text))
    return path


@pytest.mark.parametrize("args", [["--help"], ["replay", "--help"], ["validate", "--help"], ["bench", "--help"],
                                  ["serve", "--help"]])
def test_help_for_everything(args):
    result = runner.invoke(app, args)
    assert result.exit_code == 0, result.output
    assert "Usage" in result.output


def test_bench_help_lists_the_benchmarks_that_exist():
    result = runner.invoke(app, ["bench", "--help"])
    for name in cli.available_benchmarks():
        assert name in result.output


def test_validate_accepts_the_shipped_scenarios():
    result = runner.invoke(app, ["validate", *map(str, SHIPPED)])
    assert result.exit_code == 0, result.output
    assert result.output.count("ok ") == len(SHIPPED)


def test_validate_names_file_key_path_and_expectation(tmp_path):
    good = write(tmp_path, FAILING, "good.yaml")
    bad = write(tmp_path, FAILING.replace("steps: 40", "steps: forty").replace("eplb: {", "eplb: {colour: red, "),
                "bad.yaml")
    result = runner.invoke(app, ["validate", str(good), str(bad)])
    assert result.exit_code == 2  # invalid input, as for replay (1 is kept for a failed expectation)
    assert f"ok {good}" in result.output
    assert f"error {bad}: steps: expected an integer, got 'forty'" in result.stderr
    assert f"error {bad}: deployment.eplb.colour: unknown key (allowed here: " in result.stderr


def test_replay_of_an_invalid_file_exits_2_and_runs_nothing(tmp_path, monkeypatch):
    import elastic.control.coordinator

    monkeypatch.setattr(elastic.control.coordinator.Coordinator, "__init__",
                        lambda *a, **k: (_ for _ in ()).throw(AssertionError("started")))
    bad = write(tmp_path, FAILING.replace("  ep_size: 2", "  ep_size: 6"))
    result = runner.invoke(app, ["replay", str(bad), "--report-dir", str(tmp_path / "out")])
    assert result.exit_code == 2, result.output
    assert f"error {bad}: deployment: ep_size=6 exceeds max_ep_size=3" in result.stderr
    assert not (tmp_path / "out").exists()
    missing = runner.invoke(app, ["replay", str(tmp_path / "nope.yaml")])
    assert missing.exit_code == 2 and "cannot read the file" in missing.stderr


def test_replay_to_a_report_directory_it_cannot_write_exits_2_and_runs_nothing(tmp_path, monkeypatch):
    """A --report-dir that is a file, or a scenario name too long for a directory, was found once the
    whole replay had run: a traceback, and the report was lost."""
    import elastic.control.coordinator

    monkeypatch.setattr(elastic.control.coordinator.Coordinator, "__init__",
                        lambda *a, **k: (_ for _ in ()).throw(AssertionError("started")))
    scenario = write(tmp_path, FAILING)
    taken = tmp_path / "taken"
    taken.write_text("")
    result = runner.invoke(app, ["replay", str(scenario), "--report-dir", str(taken)])
    assert result.exit_code == 2, result.output
    assert result.stderr.strip() == f"error --report-dir {taken}: a file is there, not a directory"
    long_name = write(tmp_path, FAILING.replace("name:", "name: " + "x" * 300 + " #", 1), "long.yaml")
    monkeypatch.chdir(tmp_path)
    result = runner.invoke(app, ["replay", str(long_name)])
    assert result.exit_code == 2, result.output
    assert "the report directory (reports/<name>; give --report-dir) reports/xxx" in result.stderr
    assert result.stderr.strip().endswith("cannot make the directory (File name too long)")


# -- bench dispatch -----------------------------------------------------------------------------

@pytest.fixture
def fake_bench(tmp_path, monkeypatch):
    """A benchmark package with one module that has main(argv) and one that runs as __main__."""
    package = tmp_path / "fakebench_pkg"
    package.mkdir()
    (package / "__init__.py").write_text("")
    (package / "bench_echo.py").write_text(textwrap.dedent("""\
        \"\"\"Echo: writes its argv to ECHO_OUT.\"\"\"
        import json, os
        def main(argv=None):
            open(os.environ["ECHO_OUT"], "w").write(json.dumps(argv))
            return 3 if "--fail" in argv else 0
        """))
    (package / "bench_script.py").write_text(textwrap.dedent("""\
        import json, os, sys
        if __name__ == "__main__":
            open(os.environ["ECHO_OUT"], "w").write(json.dumps(sys.argv[1:]))
            sys.exit(0)
        """))
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setattr(cli, "BENCH_PACKAGE", "fakebench_pkg")
    out = tmp_path / "echo.json"
    monkeypatch.setenv("ECHO_OUT", str(out))
    return out


def test_bench_dispatches_to_the_module_with_its_arguments(fake_bench):
    assert cli.available_benchmarks() == ["echo", "script"]
    result = runner.invoke(app, ["bench", "echo", "--shape", "small", "--help-me", "x"])
    assert result.exit_code == 0, result.output
    assert json.loads(fake_bench.read_text()) == ["--shape", "small", "--help-me", "x"]
    assert runner.invoke(app, ["bench", "echo", "--fail"]).exit_code == 3
    result = runner.invoke(app, ["bench", "script", "-n", "2"])
    assert result.exit_code == 0, result.output
    assert json.loads(fake_bench.read_text()) == ["-n", "2"]


def test_bench_passes_help_through_to_the_benchmark(fake_bench):
    result = runner.invoke(app, ["bench", "echo", "--help"])
    assert result.exit_code == 0
    assert json.loads(fake_bench.read_text()) == ["--help"]


def test_a_missing_benchmark_is_a_clear_error(fake_bench):
    result = runner.invoke(app, ["bench", "decode"])
    assert result.exit_code == 2
    assert "no benchmark 'decode': module fakebench_pkg.bench_decode not found (available: echo, script)" in result.stderr


@pytest.mark.parametrize("name", ["algorithm", "decode", "scale"])
def test_the_project_benchmarks_are_wired(name):
    if name not in cli.available_benchmarks():
        pytest.skip(f"bench/bench_{name}.py is not in this checkout")
    import importlib

    assert callable(getattr(importlib.import_module(f"bench.bench_{name}"), "main", None))


# -- replay on real worker processes --------------------------------------------------------------

@pytest.mark.multiprocess
@pytest.mark.timeout(240)
def test_a_failed_expectation_exits_1_and_names_it(tmp_path):
    scenario = write(tmp_path, FAILING)
    out = tmp_path / "report"
    result = runner.invoke(app, ["replay", str(scenario), "--report-dir", str(out), "--no-progress"])
    assert result.exit_code == 1, result.output
    assert "FAILED expectation final_ep_size: expected 3, measured 2" in result.stderr
    assert "Expectations" in result.output and "Timeline" in result.output  # the end-of-run tables
    data = json.loads((out / "report.json").read_text())
    assert data["passed"] is False and data["scenario"]["file"] == str(scenario)
    failed = [e for e in data["expectations"] if not e["passed"]]
    assert [(e["name"], e["expected"], e["measured"]) for e in failed] == [("final_ep_size", 3, 2)]
    assert data["final"]["ep_size"] == 2 and data["samples"][-1]["ep_size"] == 2
    assert (out / "report.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.multiprocess
@pytest.mark.timeout(240)
def test_the_console_script_replays_with_json_only(tmp_path):
    """The installed ``elastic-ep`` entry point, as a user runs it: JSON on stdout, exit 0 or 1."""
    scenario = write(tmp_path, FAILING.replace("final_ep_size: 3", "final_ep_size: 2"))
    out = tmp_path / "report"
    env = {**os.environ, "GLOO_SOCKET_IFNAME": "lo"}
    exe = Path(sys.executable).with_name("elastic-ep")
    command = [str(exe)] if exe.exists() else [sys.executable, "-c", "from elastic.cli import app; app()"]
    done = subprocess.run([*command, "replay", str(scenario), "--report-dir", str(out), "--json-only"],
                          capture_output=True, text=True, timeout=200, env=env, cwd=tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    report = json.loads(done.stdout)
    assert report["passed"] is True and report["final"]["ep_size"] == 2
    assert json.loads((out / "report.json").read_text())["final"] == report["final"]
