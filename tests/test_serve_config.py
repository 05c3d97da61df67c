"""``elastic-ep serve``: the example deployment files, the embedded default deployment and the flags."""

from __future__ import annotations

from pathlib import Path

import pytest
import typer
from typer.testing import CliRunner

import elastic.service.server
from elastic.deployment import DEFAULT_DEPLOYMENT
from elastic.service.server import DEFAULT_SOURCE, load_serve_config, register_cli

ROOT = Path(__file__).resolve().parent.parent
EXAMPLES = sorted((ROOT / "examples").glob("*.yaml"))
runner = CliRunner()


def test_the_examples_cover_every_launcher():
    kinds = {load_serve_config(path).deployment.launcher.kind for path in EXAMPLES}
    assert {path.stem for path in EXAMPLES} >= {"local", "netns", "ssh", "ray"}
    assert kinds == {"local", "command", "ray"}


@pytest.mark.parametrize("path", EXAMPLES, ids=[p.stem for p in EXAMPLES])
def test_every_example_deployment_passes_its_preflight(path):
    loaded = load_serve_config(path)  # schema, bounds, memory budget, hook programs
    deployment = loaded.deployment
    assert deployment.size_problem(deployment.max_ep_size) is None  # it can scale to its capacity
    if deployment.launcher.kind != "local":
        assert deployment.max_memory is not None, "remote workers' memory is only checked against max_memory"


@pytest.fixture
def served(monkeypatch):
    """The serve command with ``serve()`` replaced: what it would run, nothing started."""
    calls: list[dict] = []
    monkeypatch.setattr(elastic.service.server, "serve", lambda config, host, port, **kwargs: calls.append(
        {"config": config, "host": host, "port": port, **kwargs}))
    app = typer.Typer()
    register_cli(app)
    app.command("other")(lambda: None)  # a second command, so typer keeps "serve" as a subcommand

    def invoke(*args: str):
        result = runner.invoke(app, ["serve", *args])
        return result, (calls[-1]["config"] if calls and result.exit_code == 0 else None)

    return invoke


def test_serve_without_a_file_runs_the_embedded_default(served):
    result, config = served()
    assert result.exit_code == 0, result.output
    assert (config.ep_size, config.max_ep_size, config.launcher.kind) == (2, 4, "local")
    assert config.model.num_experts == DEFAULT_DEPLOYMENT["model"]["num_experts"] and config.eplb.use_async


@pytest.mark.parametrize("size, capacity, redundant", [(3, 6, 5), (4, 8, 4), (8, 16, 8), (1, 4, 4)])
def test_ep_size_on_the_default_gets_room_and_slots_that_divide(served, size, capacity, redundant):
    result, config = served("--ep-size", str(size))
    assert result.exit_code == 0, result.output
    assert (config.ep_size, config.max_ep_size, config.eplb.num_redundant_experts) == (size, capacity, redundant)
    assert config.num_physical % size == 0


def test_flags_override_a_file_and_are_checked_like_it(served, tmp_path):
    path = ROOT / "examples" / "local.yaml"
    result, config = served(str(path), "--ep-size", "4", "--num-redundant-experts", "8")
    assert result.exit_code == 0, result.output
    assert (config.ep_size, config.max_ep_size, config.eplb.num_redundant_experts) == (4, 4, 8)
    # a file's own values are never adjusted: 20 slots do not divide over 3 ranks, and that is said
    result, _ = served(str(path), "--ep-size", "3")
    assert result.exit_code == 2
    assert result.stderr.strip() == (f"error: {path}: 16 experts + 4 redundant = 20 physical slots do not divide "
                                     "over ep_size=3")
    result, _ = served("--max-memory", "1MiB")
    assert result.exit_code == 2
    assert result.stderr.startswith(f"error: {DEFAULT_SOURCE}: max_memory: a worker would need ")
    result, _ = served("--ep-size", "5000", "--max-ep-size", "5000")
    assert result.exit_code == 2
    assert [line.split(": ")[2] for line in result.stderr.splitlines()] == ["ep_size", "max_ep_size"]
    assert "expected at most 4096 (one worker process per rank" in result.stderr
