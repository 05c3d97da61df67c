"""Prometheus metrics that operators ask for, the Grafana dashboard that reads them, and
``eplb.min_balancedness`` (a scheduled rebalance is skipped while the window is balanced enough).

Pure logic (the balancedness summary, the skip decision, the recorder, the collector) runs on
fakes; the scrape and the naming checks run on a live ``/metrics`` of real worker processes.
"""

from __future__ import annotations

import json
import re
import time
from pathlib import Path
from types import SimpleNamespace

import httpx
import pytest
import torch
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from elastic.core import protocol as p
from elastic.service.metrics import CoordinatorCollector, OperationRecorder, ServingMetrics
from eplb.config import EPLBConfig
from eplb.placement import Placement
from eplb.state import EPLBState, balancedness_of, balancedness_summary, layer_balancedness
from tests.conftest import running, small_config
from tests.helpers import assert_consistent

DASHBOARD = Path(__file__).resolve().parent.parent / "examples" / "grafana" / "elastic-ep.json"

#: units that are not base units: a name says seconds and bytes, never these
NON_BASE_UNITS = {"milliseconds", "microseconds", "nanoseconds", "ms", "us", "ns", "minutes", "hours", "days",
                  "kilobytes", "megabytes", "gigabytes", "kb", "mb", "gb", "kib", "mib", "gib", "bits", "percent"}
BASE_UNITS = ("seconds", "bytes")


# -- naming conventions and the dashboard: helpers -----------------------------------------------

def families(text: str) -> dict[str, object]:
    return {f.name: f for f in text_string_to_metric_families(text)}


def naming_problems(fams: dict[str, object]) -> list[str]:
    """What breaks Prometheus' naming conventions in a parsed exposition."""
    problems = []
    for name, fam in fams.items():
        if name.endswith("_created") and name.removesuffix("_created") in fams:
            continue  # prometheus_client's creation time of a histogram, a family of its own in the text format
        if not name.startswith("elastic_ep_"):
            problems.append(f"{name}: not prefixed elastic_ep_")
        if not (fam.documentation or "").strip():
            problems.append(f"{name}: no help text")
        tokens = name.split("_")
        if NON_BASE_UNITS & set(tokens):
            problems.append(f"{name}: a unit that is not a base unit")
        for unit in BASE_UNITS:  # a unit named anywhere is the name's suffix
            if unit in tokens and not name.endswith("_" + unit):
                problems.append(f"{name}: '{unit}' must end the name (before _total)")
        if fam.type == "counter":
            bad = [s.name for s in fam.samples if not s.name.endswith(("_total", "_created"))]
            if bad:
                problems.append(f"{name}: counter samples without _total: {bad}")
        elif name.endswith("_total"):
            problems.append(f"{name}: a {fam.type} must not end in _total")
        if fam.type == "histogram" and not name.endswith(BASE_UNITS) and "balancedness" not in name:
            problems.append(f"{name}: a histogram without its unit")
    return problems


def exported_names(fams: dict[str, object]) -> set[str]:
    """Every series name a query may use: the samples, plus the suffixes of each family's type
    (a labelled histogram or counter that has no child yet still is exported)."""
    names = set()
    suffixes = {"counter": ("_total",), "histogram": ("_bucket", "_count", "_sum"), "summary": ("_count", "_sum", ""),
                "gauge": ("",), "info": ("_info",), "stateset": ("",), "unknown": ("",)}
    for name, fam in fams.items():
        names.update(s.name for s in fam.samples)
        names.update(name + suffix for suffix in suffixes.get(fam.type, ("",)))
    return names


PROMQL_WORDS = {"by", "without", "on", "ignoring", "group_left", "group_right", "bool", "and", "or", "unless",
                "offset", "inf", "nan", "le"}


def promql_metric_names(expr: str) -> set[str]:
    """The series names in a PromQL expression: what remains once strings, label matchers,
    range selectors, groupings and function calls are taken out."""
    expr = re.sub(r'"(?:[^"\\]|\\.)*"' + r"|'(?:[^'\\]|\\.)*'", '""', expr)
    expr = re.sub(r"\{[^}]*\}", " ", expr)  # label matchers
    expr = re.sub(r"\[[^\]]*\]", " ", expr)  # range selectors, $__rate_interval included
    expr = re.sub(r"\b(?:by|without|on|ignoring|group_left|group_right)\s*\([^)]*\)", " ", expr)
    names = set()
    for match in re.finditer(r"(?<![\w$.])([A-Za-z_:][\w:]*)\s*(\()?", expr):
        word, call = match.group(1), match.group(2)
        if call or word.lower() in PROMQL_WORDS:
            continue
        names.add(word)
    return names


def dashboard_expressions(dashboard: dict) -> list[str]:
    exprs = []

    def walk(panels: list) -> None:
        for panel in panels:
            exprs.extend(t["expr"] for t in panel.get("targets", []) if t.get("expr"))
            walk(panel.get("panels", []))  # rows

    walk(dashboard["panels"])
    return exprs


# -- pure logic --------------------------------------------------------------------------------

def test_layer_balancedness_and_its_summary():
    # 2 ranks of 2 slots; layer 0 balanced, layer 1 all on rank 0, layer 2 empty, layer 3 3:1
    counts = torch.tensor([[5, 5, 5, 5], [10, 10, 0, 0], [0, 0, 0, 0], [3, 3, 1, 1]])
    per_layer = layer_balancedness(counts, 2)
    assert per_layer.tolist() == pytest.approx([1.0, 0.5, 1.0, 4 / 6])
    assert balancedness_of(counts, 2) == pytest.approx(float(per_layer.mean()))
    summary = balancedness_summary(per_layer)
    assert summary == pytest.approx({"min": 0.5, "p50": 4 / 6, "p90": 1.0, "mean": (1 + 0.5 + 1 + 4 / 6) / 4})
    ten = balancedness_summary(torch.arange(1, 11, dtype=torch.float64) / 10)
    assert ten == pytest.approx({"min": 0.1, "p50": 0.5, "p90": 0.9, "mean": 0.55})  # nearest rank: a layer's value
    assert balancedness_summary(torch.empty(0)) == {"min": 1.0, "p50": 1.0, "p90": 1.0, "mean": 1.0}


BALANCED = torch.tensor([[5, 5, 5, 5], [4, 4, 4, 4]])
SKEWED = torch.tensor([[10, 10, 0, 0], [8, 0, 0, 0]])


def eplb_state(rank: int = 0, **config) -> tuple[EPLBState, list[tuple[str, dict]]]:
    """An async EPLB whose worker is not started (a scheduled rebalance that is not skipped
    counts as started and stops there): the decision logic alone, no model, no group."""
    events: list[tuple[str, dict]] = []
    cfg = EPLBConfig(window_size=4, step_interval=2, use_async=True, **config)
    state = EPLBState(cfg, None, Placement.static(2, 4, 4), rank, 2, on_event=lambda k, d: events.append((k, d)))
    return state, events


def drive(state: EPLBState, counts: torch.Tensor, steps: int) -> None:
    for _ in range(steps):
        state.after_sync([1, 0, 0])  # the agreed words: nothing staged, no failure, nobody busy
        state.record(counts)


def test_a_scheduled_rebalance_is_skipped_while_the_window_is_above_min_balancedness():
    state, events = eplb_state(min_balancedness=0.9)
    drive(state, BALANCED, 6)  # scheduled at steps 2, 4 and 6: the window is perfectly balanced
    assert (state.stats.rebalances_skipped, state.stats.rebalances_started) == (3, 0)
    assert state.stats.balancedness_before == pytest.approx(1.0)
    skipped = [d for k, d in events if k == "rebalance_skipped"]
    assert len(skipped) == 3 and skipped[0] == {"balancedness": 1.0, "min_balancedness": 0.9}
    drive(state, SKEWED, 4)  # the window fills with skewed steps: its balancedness falls below 0.9
    assert state.stats.rebalances_started >= 1 and state.stats.balancedness_before < 0.9
    assert state.stats.layer_balancedness == {"min": 0.5, "p50": 0.5, "p90": 0.5, "mean": 0.5}  # every rank 1 idle


def test_an_operator_rebalance_and_the_default_threshold_never_skip():
    state, _ = eplb_state(min_balancedness=0.5)
    drive(state, BALANCED, 1)
    assert state.rebalance_now() is True  # asked for: never skipped
    assert (state.stats.rebalances_skipped, state.stats.rebalances_started) == (0, 1)
    default, _ = eplb_state()
    assert default.config.min_balancedness == 1.0
    drive(default, BALANCED, 6)  # balancedness 1.0 is not above 1.0
    assert (default.stats.rebalances_skipped, default.stats.rebalances_started) == (0, 3)
    with pytest.raises(ValueError):
        EPLBConfig(min_balancedness=1.5)


def test_every_rank_decides_the_same_from_the_same_window():
    """The decision reads only the agreed window and placement: two ranks fed the same
    all-reduced counts skip and start at the same steps."""
    loads = [BALANCED, SKEWED, BALANCED, BALANCED, SKEWED, SKEWED, BALANCED, BALANCED, BALANCED, BALANCED] * 3
    ranks = [eplb_state(rank, min_balancedness=0.8) for rank in (0, 1)]
    decisions: list[list[tuple[int, int]]] = [[], []]
    for counts in loads:
        for (state, _), seen in zip(ranks, decisions):
            drive(state, counts, 1)
            seen.append((state.stats.rebalances_skipped, state.stats.rebalances_started))
    assert decisions[0] == decisions[1]
    assert decisions[0][-1][0] >= 1 and decisions[0][-1][1] >= 1  # both kinds of decision happened


def test_the_recorder_times_rebalances_from_rank_0():
    registry = CollectorRegistry()
    recorder = OperationRecorder(registry)

    def count(outcome: str) -> float:
        return registry.get_sample_value("elastic_ep_eplb_rebalance_seconds_count", {"outcome": outcome}) or 0.0

    assert count("finished") == 0 and count("failed") == 0  # exported before the first one
    recorder("worker_event", {"rank": 0, "step": 9, "kind": "rebalance_finished", "id": 1, "seconds": 0.25})
    recorder("worker_event", {"rank": 1, "step": 9, "kind": "rebalance_finished", "id": 1, "seconds": 0.26})
    recorder("worker_event", {"rank": 0, "step": 12, "kind": "rebalance_failed", "seconds": 1.5})
    recorder("worker_event", {"rank": 0, "step": 13, "kind": "rebalance_failed", "seconds": None})  # none in flight
    recorder("worker_event", {"rank": 0, "step": 14, "kind": "layer_committed", "layer": 1, "bytes": 8})
    assert count("finished") == 1 and count("failed") == 1
    assert registry.get_sample_value("elastic_ep_eplb_rebalance_seconds_sum", {"outcome": "finished"}) == 0.25


def test_the_collector_exports_the_distribution_and_the_outcomes():
    def beat(rank: int, **eplb) -> SimpleNamespace:
        return SimpleNamespace(rank=rank, rank_load=1.0, step_seconds=0.01, eplb=p.EPLBReport(**eplb))

    beats = [beat(0, rebalances_started=3, rebalances_finished=2, rebalances_failed=1, rebalances_skipped=4,
                  balancedness_before=0.7),
             beat(1, rebalances_started=3, rebalances_finished=3, rebalances_failed=1, rebalances_skipped=4,
                  balancedness_before=0.7)]
    snap = {"state": "running", "generation": 0, "ep_size": 2, "num_physical": 12, "serving": True,
            "balancedness": 0.8, "step": 10, "in_flight_layer": None, "eplb_health": {"status": "healthy"},
            "eplb_layer_balancedness": {"min": 0.5, "p50": 0.8, "p90": 0.95, "mean": 0.8}}
    coordinator = SimpleNamespace(snapshot=lambda: snap, list_operations=lambda: [], live_workers=lambda: [
        SimpleNamespace(heartbeat=b) for b in beats], config=SimpleNamespace(eplb=EPLBConfig(min_balancedness=0.9)))
    registry = CollectorRegistry()
    registry.register(CoordinatorCollector(coordinator))
    value = registry.get_sample_value
    assert {o: value("elastic_ep_eplb_rebalances_total", {"outcome": o})
            for o in ("skipped", "started", "finished", "failed")} == {"skipped": 4, "started": 3, "finished": 3, "failed": 1}
    assert {s: value("elastic_ep_eplb_layer_balancedness", {"stat": s}) for s in ("min", "p50", "p90", "mean")} == \
        {"min": 0.5, "p50": 0.8, "p90": 0.95, "mean": 0.8}
    assert value("elastic_ep_eplb_window_balancedness") == 0.7
    assert value("elastic_ep_eplb_min_balancedness") == 0.9
    assert value("elastic_ep_eplb_healthy") == 1.0
    assert naming_problems(families(generate_latest(registry).decode())) == []


def test_the_naming_check_and_the_promql_parser_catch_what_they_should():
    text = ("# HELP elastic_ep_pause_ms a pause\n# TYPE elastic_ep_pause_ms gauge\nelastic_ep_pause_ms 1\n"
            "# HELP elastic_ep_bytes_moved bytes\n# TYPE elastic_ep_bytes_moved gauge\nelastic_ep_bytes_moved 1\n"
            "# HELP elastic_ep_x_total x\n# TYPE elastic_ep_x_total gauge\nelastic_ep_x_total 1\n"
            "# TYPE elastic_ep_nohelp gauge\nelastic_ep_nohelp 1\n")
    problems = "\n".join(naming_problems(families(text)))
    assert "pause_ms: a unit that is not a base unit" in problems
    assert "bytes_moved: 'bytes' must end the name" in problems
    assert "x_total: a gauge must not end in _total" in problems
    assert "nohelp: no help text" in problems
    expr = ('histogram_quantile(0.9, sum by (le, phase) (rate(elastic_ep_operation_phase_seconds_bucket'
            '{kind="scale", phase=~"re.*"}[$__rate_interval]))) / on(instance) group_left elastic_ep_ep_size '
            'and max by (state) (elastic_ep_state) == 1 or vector(0) offset 5m')
    assert promql_metric_names(expr) == {"elastic_ep_operation_phase_seconds_bucket", "elastic_ep_ep_size",
                                         "elastic_ep_state"}


def test_the_dashboard_is_grafana_json_with_a_query_in_every_panel():
    dashboard = json.loads(DASHBOARD.read_text())
    assert dashboard["title"] and dashboard["panels"]
    for panel in dashboard["panels"]:
        assert panel["targets"] and all(promql_metric_names(t["expr"]) for t in panel["targets"]), panel["title"]
    used = set().union(*(promql_metric_names(e) for e in dashboard_expressions(dashboard)))
    for wanted in ("elastic_ep_eplb_layer_balancedness", "elastic_ep_eplb_rebalances_total",
                   "elastic_ep_eplb_rebalance_seconds_bucket", "elastic_ep_eplb_healthy",
                   "elastic_ep_operation_phase_seconds_bucket"):
        assert wanted in used


def test_the_readme_metrics_table_lists_every_exported_metric():
    coordinator = SimpleNamespace(snapshot=lambda: None, live_workers=lambda: [], list_operations=lambda: [])
    registry = CollectorRegistry()
    registry.register(CoordinatorCollector(coordinator))
    OperationRecorder(registry)
    ServingMetrics(registry)
    readme = (DASHBOARD.parent.parent.parent / "README.md").read_text()
    table = {m.group(1) for m in re.finditer(r"`(elastic_ep_\w+)`", readme)}
    exported = {m.name + ("_total" if m.type == "counter" else "") for m in registry.collect()}
    assert len(exported) > 25 and exported - table == set()


# -- a live scrape of real workers -----------------------------------------------------------------

def scrape(client: httpx.Client) -> tuple[str, dict[str, object], dict[str, float]]:
    text = client.get("/metrics").text
    fams = families(text)
    values = {}
    for fam in fams.values():
        for s in fam.samples:
            labels = ",".join(f"{k}={v}" for k, v in sorted(s.labels.items()))
            values[f"{s.name}{{{labels}}}" if labels else s.name] = s.value
    return text, fams, values


def wait_for(client: httpx.Client, predicate, timeout: float, what: str) -> tuple[str, dict, dict]:
    deadline = time.monotonic() + timeout
    while True:
        got = scrape(client)
        if predicate(got[2]):
            return got
        if time.monotonic() > deadline:
            raise AssertionError(f"not within {timeout}s: {what}; last scrape: "
                                 f"{ {k: v for k, v in got[2].items() if 'eplb' in k} }")
        time.sleep(0.1)


@pytest.mark.multiprocess
@pytest.mark.timeout(120)
def test_live_metrics_follow_conventions_and_serve_every_dashboard_query():
    from elastic.service.api import create_app
    from elastic.service.server import BackgroundServer

    config = small_config(eplb=dict(step_interval=6, window_size=6))
    with running(config) as c, BackgroundServer(create_app(c)) as server, \
            httpx.Client(base_url=server.url, timeout=30) as client:
        _, fams, m = wait_for(client, lambda m: m.get("elastic_ep_eplb_rebalances_total{outcome=finished}", 0) >= 1
                              and m.get("elastic_ep_eplb_rebalance_seconds_count{outcome=finished}", 0) >= 1
                              and "elastic_ep_eplb_layer_balancedness{stat=p90}" in m, 60, "a rebalance finished")
        assert naming_problems(fams) == []
        stats = {s: m[f"elastic_ep_eplb_layer_balancedness{{stat={s}}}"] for s in ("min", "p50", "p90", "mean")}
        assert 0 < stats["min"] <= stats["p50"] <= stats["p90"] <= 1 and stats["min"] <= stats["mean"] <= 1, stats
        assert m["elastic_ep_eplb_rebalances_total{outcome=started}"] >= m["elastic_ep_eplb_rebalances_total{outcome=finished}"]
        assert m["elastic_ep_eplb_rebalances_total{outcome=skipped}"] == 0  # min_balancedness 1.0: never skips
        assert m["elastic_ep_eplb_rebalance_seconds_sum{outcome=finished}"] > 0
        assert 0 < m["elastic_ep_eplb_window_balancedness"] <= 1 and m["elastic_ep_eplb_min_balancedness"] == 1.0
        assert m["elastic_ep_eplb_healthy"] == 1.0
        assert set(c.snapshot()["eplb_layer_balancedness"]) == {"min", "p50", "p90", "mean"}
        # every series the dashboard queries is one this app exports
        exported = exported_names(fams)
        dashboard = json.loads(DASHBOARD.read_text())
        missing = {e: sorted(promql_metric_names(e) - exported) for e in dashboard_expressions(dashboard)}
        assert {e: names for e, names in missing.items() if names} == {}
        assert_consistent(c, 2)


@pytest.mark.multiprocess
@pytest.mark.timeout(120)
def test_min_balancedness_skips_on_every_rank_and_counts_it():
    """A threshold of 0 skips every scheduled rebalance: each rank skips at the same agreed step,
    nothing starts, nothing moves, and the skips are counted."""
    from elastic.service.api import create_app
    from elastic.service.server import BackgroundServer

    config = small_config(eplb=dict(step_interval=4, window_size=4, min_balancedness=0.0))
    with running(config) as c, BackgroundServer(create_app(c)) as server, \
            httpx.Client(base_url=server.url, timeout=30) as client:
        _, _, m = wait_for(client, lambda m: m.get("elastic_ep_eplb_rebalances_total{outcome=skipped}", 0) >= 3,
                           60, "three scheduled rebalances skipped")
        assert m["elastic_ep_eplb_rebalances_total{outcome=started}"] == 0
        assert m["elastic_ep_eplb_rebalances_total{outcome=finished}"] == 0
        assert m["elastic_ep_layers_committed_total"] == 0 and m["elastic_ep_eplb_moved_bytes_total"] == 0
        assert m["elastic_ep_eplb_min_balancedness"] == 0.0
        # the metric is the most any rank counted; a rank's heartbeat (every 0.1 s) may trail it by
        # a few 4-step intervals, so wait until every rank has reported two skips of its own
        deadline = time.monotonic() + 30
        while True:
            beats = [w.heartbeat.eplb for w in c.live_workers() if w.heartbeat is not None and w.heartbeat.eplb]
            if len(beats) == 2 and all(b.rebalances_skipped >= 2 for b in beats) or time.monotonic() > deadline:
                break
            time.sleep(0.05)
        assert len(beats) == 2 and all(b.rebalances_skipped >= 2 for b in beats), beats
        assert all(b.rebalances_started == 0 for b in beats), beats
        # an operator's rebalance is never skipped
        assert c.rebalance() is not False
        _, _, m = wait_for(client, lambda m: m.get("elastic_ep_eplb_rebalances_total{outcome=finished}", 0) >= 1,
                           60, "the requested rebalance finished")
        assert_consistent(c, 2)


@pytest.mark.multiprocess
@pytest.mark.timeout(120)
def test_layers_per_step_commits_a_batch_of_layers_at_one_agreed_step():
    """``layers_per_step: 2``: each rank stages two layers, then every rank commits both at the
    same step; the weights stay bit-exact."""
    config = small_config(eplb=dict(step_interval=6, window_size=6, layers_per_step=2))
    commits: list[tuple[int, int, int]] = []  # (rank, step, layer)

    def on_event(kind: str, data: dict) -> None:
        if kind == "worker_event" and data.get("kind") == "layer_committed":
            commits.append((data["rank"], data["step"], data["layer"]))

    with running(config) as c:
        c.subscribe(on_event)
        deadline = time.monotonic() + 60
        while not any(sum(1 for r, s, _ in commits if r == 0 and s == step) >= 2 for _, step, _ in list(commits)):
            assert time.monotonic() < deadline, f"no two layers committed at one step: {commits}"
            time.sleep(0.05)
        c.wait_for_step(max(s for _, s, _ in commits) + 3, timeout=30)
        assert_consistent(c, 2)
        by_rank = {rank: {(s, layer) for r, s, layer in list(commits) if r == rank} for rank in (0, 1)}
        last = min(max(s for s, _ in v) for v in by_rank.values())
        # the same layers at the same steps on both ranks (up to the newest step both reported)
        assert {x for x in by_rank[0] if x[0] <= last} == {x for x in by_rank[1] if x[0] <= last}
        per_step = {}
        for s, _ in by_rank[0]:
            per_step[s] = per_step.get(s, 0) + 1
        assert max(per_step.values()) == 2 and all(n <= 2 for n in per_step.values()), per_step
