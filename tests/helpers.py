"""Assertions shared by the multi-process tests."""

from __future__ import annotations

import time


def assert_consistent(coordinator, expected_size: int) -> dict:
    """Every slot on every rank verified bit-exact, every expert served, every rank agrees."""
    verdict = coordinator.verify()
    assert sorted(verdict) == list(range(expected_size)), f"ranks {sorted(verdict)} answered, wanted {expected_size}"
    for rank, v in verdict.items():
        assert v["mismatched"] == [], f"rank {rank} holds wrong weights in (layer, slot) {v['mismatched']}"
        assert v["replica_min"] >= 1, f"rank {rank}: a logical expert has no replica"
        assert v["size"] == expected_size
    assert len({v["digest"] for v in verdict.values()}) == 1, "ranks disagree on the maps"
    assert len({v["generation"] for v in verdict.values()}) == 1, "ranks disagree on the generation"
    assert len({v["num_physical"] for v in verdict.values()}) == 1
    return verdict


def wait_for_state(coordinator, state: str, timeout: float = 60.0, generation: int | None = None) -> None:
    """Wait until the machine is in ``state`` with no operation running (and at ``generation``)."""
    c = coordinator
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if (c.machine.state.value == state and (c._current is None or c._current.terminal)
                and (generation is None or c.machine.generation == generation)):
            return
        time.sleep(0.05)
    raise AssertionError(f"state {c.machine.state.value}, wanted {state}; history {[t.sentence() for t in c.machine.history()]}")


def run_cli(*args: str):
    """``elastic-ep ARGS`` in this process (typer's runner): the result has ``exit_code`` and ``output``."""
    from typer.testing import CliRunner

    from elastic.cli import app

    return CliRunner().invoke(app, list(args))


def free_port() -> int:
    """A TCP port nothing listens on (an unreachable server's)."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
