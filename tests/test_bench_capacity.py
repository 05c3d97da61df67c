"""The pure parts of bench/bench_capacity.py: the targets from given figures, the process-tree CPU
accounting (on real processes, a forkserver's worker included), the output comparison, and the
skewed-routing helpers (router factors, skew, window balancedness, phases of the rounds)."""

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
    hot_over_mean,
    make_prompts,
    mismatches,
    paired_ratios,
    phase_figures,
    phase_of_rounds,
    skew_factors,
    skew_targets,
    step_ceiling,
    summarize_samples,
    targets,
    tree_cpu,
    window_figures,
)
from bench.common import descendants


def _figures(ep2_cpu: float = 1.5, ep4_cpu: float = 2.0, ep2_tps16: float = 600.0, ep2_tps1: float = 100.0,
             idle: float = 0.01, wrong: tuple[int, ...] = ()) -> dict:
    def run(cpu: float, tps: float) -> dict:
        return {"cpu_per_token_ms": cpu, "tokens_per_s": tps, "mismatched": list(wrong), "requests": 16,
                "repeats": [{"cpu_per_token_ms": cpu, "tokens_per_s": tps}]}
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
    assert len(ok) == 10 and all(t.ok for t in ok.values())
    assert ok["CPU/token at 16, EP 4 / EP 2 (x)"].value == pytest.approx(2.0 / 1.5)
    assert ok["  the same, median of each round's own ratio (x)"].limit is None  # reported beside it
    bad = _by_name(targets(_figures(ep2_cpu=2.1, ep4_cpu=3.1, ep2_tps16=390.0, idle=0.06, wrong=(3,)), [2, 4], [1, 16]))
    failed = {name for name, t in bad.items() if not t.ok}
    assert failed == {"CPU/token at 16, EP 2 / reference (x)", "CPU/token at 16, EP 4 / reference (x)",
                      "tokens/s at 16, EP 2 / reference (x)", "tokens/s at 16 / at 1, EP 2 (x)",
                      "idle, EP 2 (cores per rank)", "idle, EP 4 (cores per rank)",
                      "requests with tokens unlike the reference, EP 2",
                      "requests with tokens unlike the reference, EP 4"}
    assert bad["CPU/token at 16, EP 4 / EP 2 (x)"].value == pytest.approx(3.1 / 2.1)  # 1.48: passes
    assert not _by_name(targets(_figures(ep4_cpu=2.3), [2, 4], [16]))["CPU/token at 16, EP 4 / EP 2 (x)"].ok


def test_the_rounds_are_compared_in_pairs() -> None:
    figures = _figures()
    figures["ep"][2]["runs"][16]["repeats"] = [{"cpu_per_token_ms": c} for c in (8.0, 6.0, 5.0)]
    figures["ep"][4]["runs"][16]["repeats"] = [{"cpu_per_token_ms": c} for c in (10.0, 9.0, 9.5)]
    # each round's own ratio (1.25, 1.5, 1.9), not the ratio of the medians (9.5 / 6.0)
    assert paired_ratios(figures, 4, 2, 16) == pytest.approx([1.25, 1.5, 1.9])
    assert _by_name(targets(figures, [2, 4], [16]))["  the same, median of each round's own ratio (x)"].value == \
        pytest.approx(1.5)
    del figures["ep"][4]["runs"][16]["repeats"]
    with pytest.raises(BenchError, match="ep/4/runs/16/repeats was not measured"):
        paired_ratios(figures, 4, 2, 16)


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


# -- skewed routing (--skew) ----------------------------------------------------------------------------

def test_skew_factors_are_a_seeded_zipf_permutation() -> None:
    assert skew_factors(8, 0.0, "0-0") == [1.0] * 8  # skew 0: the checkpoint unchanged
    factors = skew_factors(8, 1.0, "0-0")
    assert sorted(factors, reverse=True) == [1 / (r + 1) for r in range(8)]  # each Zipf rank once
    assert factors == skew_factors(8, 1.0, "0-0")  # seeded
    assert factors != skew_factors(8, 1.0, "0-1")  # another layer: other hot experts
    assert factors.index(1.0) == skew_factors(8, 2.0, "0-0").index(1.0)  # the same hottest expert at any skew
    steeper = sorted(skew_factors(8, 2.0, "0-0"))
    assert steeper[0] == pytest.approx(1 / 64) and steeper[0] < sorted(factors)[0]
    with pytest.raises(BenchError):
        skew_factors(8, -1.0, "0-0")
    with pytest.raises(BenchError):
        skew_factors(8, math.nan, "0-0")


def test_scaled_router_rows_skew_the_top_k() -> None:
    """The factors do what the bench relies on: a random router whose rows are scaled sends the hottest
    expert several times the mean share of pairs (unscaled: near even)."""
    import torch

    torch.manual_seed(0)
    hidden, gate = torch.randn(4096, 64), torch.randn(16, 64)

    def skew(weight: torch.Tensor) -> float:
        chosen = (hidden @ weight.T).topk(2, dim=1).indices
        return hot_over_mean(torch.bincount(chosen.flatten(), minlength=16)[None])[0]

    scaled = gate * torch.tensor(skew_factors(16, 1.0, "0-0"))[:, None]
    assert skew(gate) < 1.5 and skew(scaled) > 3.0


def test_hot_over_mean() -> None:
    import torch

    assert hot_over_mean(torch.tensor([[1, 1, 1, 1], [4, 0, 0, 0], [3, 1, 0, 0]])) == [1.0, 4.0, 3.0]
    with pytest.raises(BenchError, match="no routed pairs"):
        hot_over_mean(torch.tensor([[0, 0]]))


def _placement_doc(p2l: list[list[int]], load: list[list[float]], ep: int, steps: int = 8) -> dict:
    from eplb.placement_file import placement_document

    return placement_document(p2l, load, ep_size=ep, window_steps=steps, step=40)


def test_window_figures_split_a_replicated_expert_evenly() -> None:
    load = [[6.0, 2.0, 2.0, 2.0]]  # expert 0 hot: 12 pairs, 6 on expert 0
    # 4 experts + 2 redundant slots on 2 ranks; expert 0 only on rank 0: rank loads 6+2+2=10 vs 2 -> 6/10
    alone = window_figures(_placement_doc([[0, 1, 2, 3, 1, 2]], load, 2))
    assert alone["balancedness"] == pytest.approx(((6 + 1 + 1) + (2 + 1 + 1)) / 2 / 8)
    # expert 0 on both ranks: 3 + 2 + 1 = 6 and 3 + 2 + 1 = 6: even
    spread = window_figures(_placement_doc([[0, 1, 2, 0, 3, 2]], load, 2))
    assert spread["balancedness"] == pytest.approx(1.0)
    assert spread["steps"] == 8 and spread["step"] == 40 and spread["hot_over_mean"] == [2.0]
    with pytest.raises(BenchError, match="window is empty"):
        window_figures(_placement_doc([[0, 1, 2, 3, 1, 2]], [[0.0] * 4], 2, steps=0))


def _round(start: int, end: int, rb0: int, rb1: int, layers: int = 0, in_flight: int | None = None,
           wall: float = 1.0, bal: float = 0.5, wrong: tuple[int, ...] = ()) -> dict:
    return {"step_start": start, "step_end": end, "rebalances_start": rb0, "rebalances_end": rb1,
            "layers_committed_end": layers, "in_flight_end": in_flight, "cpu_s": 2.0 * wall, "wall_s": wall,
            "tokens": 100, "requests": 4, "mismatched": list(wrong), "window": {"balancedness": bal, "steps": 8}}


def test_rounds_split_before_during_after_the_first_rebalance() -> None:
    rounds = [_round(0, 10, 0, 0), _round(10, 20, 0, 0, in_flight=1), _round(20, 30, 0, 0, layers=1),
              _round(30, 40, 0, 1, layers=2, bal=0.7), _round(40, 50, 1, 1, wall=0.5, bal=0.95),
              _round(50, 60, 1, 1, wall=0.5, bal=0.97, wrong=(2,))]
    phases = phase_of_rounds(rounds)
    assert phases == ["before", "during", "during", "during", "after", "after"]
    samples = {s: {"step": s, "balancedness": 0.5 if s <= 40 else 0.9} for s in (5, 15, 25, 35, 40, 45, 55, 60)}
    after = phase_figures(rounds, phases, "after", samples)
    assert after["rounds"] == 2 and after["tokens_per_s"] == pytest.approx(200.0)
    assert after["cpu_per_token_ms"] == pytest.approx(1e3 * 2.0 / 200)
    assert after["sampled_steps"] == 3 and after["step_balancedness"] == pytest.approx(0.9)  # 45, 55, 60; not 40
    assert after["window"]["balancedness"] == 0.97 and after["mismatched"] == [2]
    assert after["round_tokens_per_s"] == {"min": 200.0, "median": 200.0, "max": 200.0}
    assert phase_figures(rounds, phases, "during", samples)["round_tokens_per_s"]["median"] == 100.0
    before = phase_figures(rounds, phases, "before", samples)
    assert before["sampled_steps"] == 1 and before["window"]["balancedness"] == 0.5
    with pytest.raises(BenchError, match="no round before"):
        phase_figures(rounds[1:], phase_of_rounds(rounds[1:]), "before", samples)
    with pytest.raises(BenchError, match="no /state sample"):
        phase_figures(rounds, phases, "after", {5: {"step": 5, "balancedness": 0.5}})


def _skew_figures(window_on: float = 0.95, step_on: float = 0.92, tps_on: float = 300.0, tps_off: float = 200.0,
                  wrong: tuple[int, ...] = ()) -> dict:
    def phase(window: float, step: float, tps: float) -> dict:
        return {"tokens_per_s": tps + 100, "round_tokens_per_s": {"median": tps}, "step_balancedness": step,
                "sampled_steps": 12, "mismatched": list(wrong),
                "window": {"balancedness": window, "steps": 64, "step_ceiling": 0.95}}
    run = {"on": {"before": phase(0.7, 0.6, 250.0), "after": phase(window_on, step_on, tps_on),
                  "mismatched": list(wrong) + [9] if wrong else []},  # a round during the rebalance too
           "off": {"before": phase(0.7, 0.6, 250.0), "after": phase(0.7, 0.6, tps_off), "mismatched": list(wrong)}}
    return {"skew": {2: run}}


def test_skew_targets() -> None:
    ok = _by_name(skew_targets(_skew_figures(), [2]))
    assert all(t.ok for t in ok.values()) and len(ok) == 5
    control = ok["tokens/s before it (the same placement: the runs' noise), skewed, EPLB on / off, EP 2 (x, medians "
                 "of the rounds)"]
    assert control.value == pytest.approx(1.0) and control.limit is None
    ratio = ok["tokens/s after the 1st rebalance, skewed, EPLB on / off, EP 2 (x, medians of the rounds)"]
    assert ratio.value == pytest.approx(1.5) and ratio.limit is None
    bad = _by_name(skew_targets(_skew_figures(window_on=0.89, step_on=0.85, tps_on=100.0, wrong=(1,)), [2]))
    assert {n for n, t in bad.items() if not t.ok} == {
        "dispatch balancedness, skewed, EPLB on, EP 2: window of 64 steps after the 1st rebalance",
        "dispatch balancedness, skewed, EPLB on, EP 2: per step after the 1st rebalance (mean of 12 sampled steps; "
        "est. of a decode step drawn from the window 0.950)",
        "requests with tokens unlike the reference, skewed, EP 2"}
    assert bad["requests with tokens unlike the reference, skewed, EP 2"].value == 3  # every round of on and off
    figures = _skew_figures()
    figures["skew"][2]["on"]["after"]["window"]["balancedness"] = math.nan
    with pytest.raises(BenchError, match="is nan"):
        skew_targets(figures, [2])
    with pytest.raises(BenchError, match="skew/4/on/after/window/steps was not measured"):
        skew_targets(_skew_figures(), [2, 4])
    figures = _skew_figures()
    del figures["skew"][2]["off"]["mismatched"]
    with pytest.raises(BenchError, match="output check of EP 2, EPLB off was not made"):
        skew_targets(figures, [2])


def test_step_ceiling_is_the_sampling_limit_of_a_placement() -> None:
    load = [[6.0, 2.0, 2.0, 2.0]]
    spread = _placement_doc([[0, 1, 2, 0, 3, 2]], load, 2)  # even over the window (test above)
    small, large = step_ceiling(spread, 2, 2, draws=300), step_ceiling(spread, 256, 2, draws=100)
    # two replicated experts: the dispatch evens even a 4-pair step out over their ranks; many: even
    assert 0.95 < small <= 1.0 and 0.97 < large <= 1.0
    assert step_ceiling(spread, 2, 2, draws=300) == small  # seeded
    alone = step_ceiling(_placement_doc([[0, 1, 2, 3, 1, 2]], load, 2), 256, 2, draws=100)
    # the window's even-split model says 0.75 (expert 0 alone on rank 0); the dispatch sends the
    # replicated experts 1 and 2 to rank 1 instead, and evens the ranks out
    assert alone > 0.95
    one = _placement_doc([[0, 1, 2, 3, 0, 0]], [[5.0, 0.0, 0.0, 0.0]], 2)  # one expert, in slots 0 | 4, 5
    # the dispatch's cut: spread evenly over the expert's ranks (rank 1's two slots count once)
    assert step_ceiling(one, 24, 2, draws=5) == pytest.approx(1.0)
    assert step_ceiling(one, 1, 1, draws=5) == pytest.approx(0.5)  # 1 pair: whole, to one rank


def test_a_run_s_figures_are_its_median_repeat_and_a_mismatch_in_any_repeat_counts() -> None:
    from bench.bench_capacity import median_run

    def run(cpu: float, tps: float, mismatched: list[int]) -> dict:
        return {"cpu_per_token_ms": cpu, "tokens_per_s": tps, "mismatched": mismatched}

    chosen = median_run([run(9.0, 100.0, []), run(5.0, 300.0, [3]), run(6.0, 200.0, [])])
    assert (chosen["cpu_per_token_ms"], chosen["tokens_per_s"]) == (6.0, 200.0)  # the middle by CPU, whole
    assert [r["cpu_per_token_ms"] for r in chosen["repeats"]] == [9.0, 5.0, 6.0]  # every round, in order
    assert chosen["mismatched"] == [3]  # a request unlike the reference in one round is a mismatch
    assert median_run([run(4.0, 1.0, []), run(2.0, 2.0, [])])["cpu_per_token_ms"] == 2.0  # even: the lower middle
