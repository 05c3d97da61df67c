"""The pure parts of bench/bench_capacity.py: the targets from given figures, the process-tree CPU
accounting (on real processes, a forkserver's worker included), the output comparison."""

from __future__ import annotations

import math
import subprocess
import sys
import textwrap
import time

import pytest

from bench.bench_capacity import (
    BenchError,
    cpu_between,
    descendants,
    make_prompts,
    mismatches,
    summarize_samples,
    targets,
    tree_cpu,
)


def _figures(ep2_cpu: float = 1.5, ep4_cpu: float = 2.0, ep2_tps16: float = 600.0, ep2_tps1: float = 100.0,
             idle: float = 0.01, wrong: tuple[int, ...] = ()) -> dict:
    def run(cpu: float, tps: float) -> dict:
        return {"cpu_per_token_ms": cpu, "tokens_per_s": tps, "mismatched": list(wrong), "requests": 16}
    return {
        "reference": {"batched": {"cpu_per_token_ms": 1.0, "tokens_per_s": 1000.0},
                      "single": {"cpu_per_token_ms": 4.0, "tokens_per_s": 250.0}},
        "ep": {2: {"runs": {1: run(3.0, ep2_tps1), 16: run(ep2_cpu, ep2_tps16)}, "idle_cores_per_rank": idle},
               4: {"runs": {1: run(5.0, 50.0), 16: run(ep4_cpu, 300.0)}, "idle_cores_per_rank": idle}},
    }


def _by_name(checks: list) -> dict:
    return {t.name: t for t in checks}


def test_targets_pass_and_fail_on_the_issue_limits() -> None:
    ok = _by_name(targets(_figures(), [2, 4], [1, 16]))
    assert len(ok) == 9 and all(t.ok for t in ok.values())
    assert ok["CPU/token at 16, EP 4 / EP 2 (x)"].value == pytest.approx(2.0 / 1.5)
    bad = _by_name(targets(_figures(ep2_cpu=2.1, ep4_cpu=3.1, ep2_tps16=390.0, idle=0.06, wrong=(3,)), [2, 4], [1, 16]))
    failed = {name for name, t in bad.items() if not t.ok}
    assert failed == {"CPU/token at 16, EP 2 / reference (x)", "CPU/token at 16, EP 4 / reference (x)",
                      "tokens/s at 16, EP 2 / reference (x)", "tokens/s at 16 / at 1, EP 2 (x)",
                      "idle, EP 2 (cores per rank)", "idle, EP 4 (cores per rank)",
                      "requests with tokens unlike the reference, EP 2",
                      "requests with tokens unlike the reference, EP 4"}
    assert bad["CPU/token at 16, EP 4 / EP 2 (x)"].value == pytest.approx(3.1 / 2.1)  # 1.48: passes
    assert not _by_name(targets(_figures(ep4_cpu=2.3), [2, 4], [16]))["CPU/token at 16, EP 4 / EP 2 (x)"].ok


def test_targets_of_a_narrower_run_and_missing_figures_fail_loudly() -> None:
    names = {t.name for t in targets(_figures(), [2], [16])}
    assert names == {"CPU/token at 16, EP 2 / reference (x)", "tokens/s at 16, EP 2 / reference (x)",
                     "idle, EP 2 (cores per rank)", "requests with tokens unlike the reference, EP 2"}
    figures = _figures()
    figures["ep"][4]["runs"][16]["cpu_per_token_ms"] = math.nan
    with pytest.raises(BenchError, match="ep/4/runs/16/cpu_per_token_ms is nan"):
        targets(figures, [2, 4], [1, 16])
    del figures["ep"][2]["idle_cores_per_rank"]
    with pytest.raises(BenchError, match="idle_cores_per_rank was not measured"):
        targets(figures, [2], [16])


def test_mismatches_and_prompts() -> None:
    assert mismatches([[1, 2], [3, 4], [5]], [[1, 2], [3, 5], [5], [9]]) == [1]
    with pytest.raises(BenchError):
        mismatches([[1]] * 3, [[1]] * 2)
    assert make_prompts(3, 4, 100, seed=1) == make_prompts(3, 4, 100, seed=1) != make_prompts(3, 4, 100, seed=2)
    assert all(len(p) == 4 and all(0 <= t < 100 for t in p) for p in make_prompts(3, 4, 100, seed=1))


#: a parent that starts a forkserver worker burning CPU (as the deployment's workers are started), then waits
_PARENT = textwrap.dedent("""
    import multiprocessing as mp, os, sys, time
    def burn(seconds, go):
        while not os.path.exists(go):
            time.sleep(0.01)
        end = time.process_time() + seconds
        while time.process_time() < end:
            pass
        time.sleep(60)
    if __name__ == "__main__":
        ctx = mp.get_context("forkserver")
        worker = ctx.Process(target=burn, args=(float(sys.argv[1]), sys.argv[2]), daemon=True)
        worker.start()
        print(worker.pid, flush=True)
        time.sleep(60)
""")


@pytest.mark.timeout(60)
def test_tree_cpu_counts_a_forkserver_worker(tmp_path) -> None:
    script = tmp_path / "parent.py"
    script.write_text(_PARENT)
    go = tmp_path / "go"
    parent = subprocess.Popen([sys.executable, str(script), "0.6", str(go)], stdout=subprocess.PIPE, text=True)
    try:
        worker = int(parent.stdout.readline())  # type: ignore[union-attr]
        tree = descendants(parent.pid)
        assert parent.pid in tree and worker in tree and len(tree) >= 3  # the parent, its forkserver, the worker
        before = tree_cpu(parent.pid)
        go.touch()  # the worker burns 0.6 s of CPU from now
        deadline = time.monotonic() + 30
        spent = 0.0
        while time.monotonic() < deadline and spent < 0.55:
            time.sleep(0.2)
            spent = cpu_between(before, tree_cpu(parent.pid))
        time.sleep(0.5)
        spent = cpu_between(before, tree_cpu(parent.pid))
        assert 0.55 <= spent <= 1.2, spent  # the worker's burn, seen from the parent's tree
        assert cpu_between(before, before) == 0.0
    finally:
        for pid in descendants(parent.pid)[::-1]:
            subprocess.run(["kill", "-9", str(pid)], check=False)
        parent.wait(10)


def test_summarize_samples_self_and_inclusive() -> None:
    records = [["MainThread", ["run.py:main", "loop.py:step", "kernel.py:matmul"], 6],
               ["MainThread", ["run.py:main", "loop.py:step", "dist.py:all_reduce"], 3],
               ["MainThread", ["run.py:main", "loop.py:idle"], 1],
               ["MainThread", ["run.py:main", "threading.py:wait"], 10],
               ["heartbeat", ["threading.py:wait"], 50]]
    summary = summarize_samples(records, "MainThread")
    assert summary["samples"] == 20 and summary["waiting"] == 0.5
    assert summary["self"] == [("kernel.py:matmul", 0.6), ("dist.py:all_reduce", 0.3), ("loop.py:idle", 0.1)]
    inclusive = dict(summary["inclusive"])
    assert "run.py:main" not in inclusive and "loop.py:step" not in inclusive  # in (nearly) every sample: left out
    assert inclusive["kernel.py:matmul"] == 0.6
    assert summarize_samples(records, None)["samples"] == 70
    assert summarize_samples(records, "heartbeat") == {"samples": 50, "waiting": 1.0, "self": [], "inclusive": []}
    with pytest.raises(BenchError, match="no stack samples"):
        summarize_samples(records, "nobody")


_SAMPLED = textwrap.dedent("""
    import multiprocessing as mp, time
    def spin_in_the_worker():
        end = time.monotonic() + 3
        while time.monotonic() < end:
            pass
    if __name__ == "__main__":
        worker = mp.get_context("forkserver").Process(target=spin_in_the_worker)
        worker.start()
        print(worker.pid, flush=True)
        worker.join()
""")


@pytest.mark.timeout(60)
def test_the_sampler_records_a_forkserver_worker_while_switched_on(tmp_path) -> None:
    import json
    import os
    from pathlib import Path

    import bench.bench_capacity as bc

    script, samples = tmp_path / "sampled.py", tmp_path / "samples"
    script.write_text(_SAMPLED)
    samples.mkdir()
    (samples / "on").touch()
    sampler = str(Path(bc.__file__).parent / "capacity_sampler")
    env = {**os.environ, "ELASTIC_EP_SAMPLE_DIR": str(samples), "PYTHONPATH": sampler}
    run = subprocess.run([sys.executable, str(script)], env=env, capture_output=True, text=True, timeout=50)
    worker = int(run.stdout.split()[0])
    records = json.loads((samples / f"{worker}.json").read_text())
    summary = summarize_samples(records, "MainThread")
    assert summary["samples"] >= 20
    assert dict(summary["inclusive"]).get("sampled.py:spin_in_the_worker", 0) > 0.5 or \
        dict(summary["self"]).get("sampled.py:spin_in_the_worker", 0) > 0.5
