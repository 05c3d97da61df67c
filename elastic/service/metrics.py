"""Prometheus metrics of a coordinator, for ``GET /metrics``.

Two sources, one registry per app (never the process-global one, so two apps in one process
never clash):

- :class:`CoordinatorCollector` reads the coordinator's ``snapshot()``, its operations and its
  workers' last heartbeats **on every scrape** (so a scrape can never disagree with
  ``GET /state`` by more than the time between the two reads);
- :class:`OperationRecorder` follows the coordinator's events (``subscribe``) and feeds a
  histogram of phase durations, a histogram of decode pauses, a histogram of rebalance
  durations and a counter of transitions.

Every metric is prefixed ``elastic_ep_``; counters end in ``_total`` and a quantity with a unit
names it in base units (``_seconds``, ``_bytes``); every metric has a help text
(``tests/test_metrics.py`` checks all three on a live scrape).
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Iterator
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from elastic.control.plane import ControlPlane
from elastic.core import protocol as p
from elastic.core.machine import Phase

__all__ = ["CoordinatorCollector", "OperationRecorder", "RequestTimer", "ServingMetrics", "build_registry", "PREFIX"]

PREFIX = "elastic_ep_"
OPERATION_STATUSES = ("pending", "running", "succeeded", "failed", "noop")
#: the statistics of the per-layer balancedness distribution (eplb.state.BALANCEDNESS_STATS)
BALANCEDNESS_STATS = ("min", "p50", "p90", "mean")
#: what became of a scheduled or requested rebalance
REBALANCE_OUTCOMES = ("skipped", "started", "finished", "failed")
SEEN_OPERATIONS = 1024  # terminal operations remembered so each is observed once
PHASE_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0)


class CoordinatorCollector(Collector):
    """Gauges and counters read from the coordinator at scrape time."""

    def __init__(self, coordinator: ControlPlane, autoscaler: Any = None):
        self.coordinator = coordinator
        self.autoscaler = autoscaler

    def describe(self) -> Iterator[Metric]:
        return self._families(None, [], [])

    def collect(self) -> Iterator[Metric]:
        snap = self.coordinator.snapshot()
        ops = self.coordinator.list_operations()
        beats = [w.heartbeat for w in self.coordinator.live_workers() if getattr(w, "heartbeat", None) is not None]
        return self._families(snap, ops, beats)

    def _families(self, snap: dict[str, Any] | None, ops: list[dict[str, Any]], beats: list[Any]) -> Iterator[Metric]:
        """Every family; empty ones (for ``describe``) when ``snap`` is None."""
        yield from self._group(snap)
        yield from self._eplb(snap, beats)
        yield from self._operations(snap, ops)
        yield from self._ranks(snap, beats)
        yield from self._requests(snap)
        yield from self._autoscaler(snap)

    @staticmethod
    def _group(snap: dict[str, Any] | None) -> Iterator[Metric]:
        """The control plane's state and the group it serves with."""
        state = GaugeMetricFamily(PREFIX + "state", "1 for the control plane's current state, 0 for the others",
                                  labels=["state"])
        generation = GaugeMetricFamily(PREFIX + "generation", "generation of the current process group")
        size = GaugeMetricFamily(PREFIX + "ep_size", "EP ranks in the current group")
        physical = GaugeMetricFamily(PREFIX + "physical_slots", "physical expert slots over all ranks")
        serving = GaugeMetricFamily(PREFIX + "serving", "1 while decoding runs (every rank of the serving group says so)")
        balancedness = GaugeMetricFamily(PREFIX + "balancedness", "lowest balancedness (mean/max load) over ranks")
        step = GaugeMetricFamily(PREFIX + "step", "decode step of the slowest rank")
        if snap is not None:
            for phase in Phase:
                state.add_metric([phase.value], 1.0 if snap["state"] == phase.value else 0.0)
            generation.add_metric([], snap["generation"])
            size.add_metric([], snap["ep_size"])
            physical.add_metric([], snap.get("num_physical") or 0)
            serving.add_metric([], 1.0 if snap.get("serving") else 0.0)
            if snap.get("balancedness") is not None:
                balancedness.add_metric([], float(snap["balancedness"]))
            step.add_metric([], snap.get("step") or 0)
        yield from (state, generation, size, physical, serving, balancedness, step)

    def _eplb(self, snap: dict[str, Any] | None, beats: list[Any]) -> Iterator[Metric]:
        """The async EPLB: rebalances, their layers and bytes, its health and its balancedness figures."""
        in_flight = GaugeMetricFamily(PREFIX + "in_flight_layer", "layer of the async rebalance being transferred, -1 for none")
        rebalances = CounterMetricFamily(PREFIX + "rebalances", "rebalances finished (most of any rank)")
        layers = CounterMetricFamily(PREFIX + "layers_committed", "EPLB layers committed (most of any rank)")
        eplb_bytes = CounterMetricFamily(PREFIX + "eplb_moved_bytes", "bytes moved by EPLB rebalances (sum over live ranks)")
        stalls = CounterMetricFamily(PREFIX + "watchdog_stalls", "async EPLB handshakes flagged as stalled (sum over ranks)")
        eplb_healthy = GaugeMetricFamily(PREFIX + "eplb_healthy", "1 while the async EPLB can commit rebalances, 0 when "
                                         "degraded (it failed and could not be rebuilt; /state says why)")
        eplb_restarts = CounterMetricFamily(PREFIX + "eplb_restarts", "async EPLB runs rebuilt after a failed layer "
                                            "(most of any rank)")
        eplb_failed = CounterMetricFamily(PREFIX + "eplb_rebalances_failed", "rebalances aborted on every rank after a "
                                          "rank's layer failed (most of any rank)")
        outcomes = CounterMetricFamily(PREFIX + "eplb_rebalances", "rebalances by outcome: skipped (scheduled, the window "
                                       "above eplb.min_balancedness), started, finished, failed (most of any rank)",
                                       labels=["outcome"])
        layer_bal = GaugeMetricFamily(PREFIX + "eplb_layer_balancedness", "distribution over MoE layers of the last "
                                      "recorded step's balancedness (mean rank load / max rank load per layer)",
                                      labels=["stat"])
        window_bal = GaugeMetricFamily(PREFIX + "eplb_window_balancedness", "balancedness of the load window under the "
                                       "placement at the last rebalance decision (mean over layers)")
        min_bal = GaugeMetricFamily(PREFIX + "eplb_min_balancedness", "eplb.min_balancedness: a scheduled rebalance "
                                    "is skipped while the window's balancedness is above it")
        if snap is not None:
            layer = snap.get("in_flight_layer")
            in_flight.add_metric([], -1 if layer is None else layer)
            rebalances.add_metric([], snap.get("rebalances") or 0)
            layers.add_metric([], snap.get("layers_committed") or 0)
            eplb_bytes.add_metric([], snap.get("bytes_moved") or 0)
            stalls.add_metric([], snap.get("watchdog_stalls") or 0)
            health = snap.get("eplb_health") or {}
            eplb_healthy.add_metric([], 0.0 if health.get("status") == "degraded" else 1.0)
            eplb_restarts.add_metric([], health.get("restarts") or 0)
            eplb_failed.add_metric([], health.get("rebalances_failed") or 0)
            stats = [b.eplb.as_dict() for b in beats if isinstance(getattr(b, "eplb", None), p.EPLBReport)]
            for outcome in REBALANCE_OUTCOMES:
                outcomes.add_metric([outcome], max((e.get(f"rebalances_{outcome}") or 0 for e in stats), default=0))
            summary = snap.get("eplb_layer_balancedness") or {}
            for stat in BALANCEDNESS_STATS:
                if summary.get(stat) is not None:
                    layer_bal.add_metric([stat], float(summary[stat]))
            window = [e["balancedness_before"] for e in stats if e.get("balancedness_before") is not None]
            if window:
                window_bal.add_metric([], float(min(window)))
            threshold = self.coordinator.config.eplb.min_balancedness
            if threshold is not None:
                min_bal.add_metric([], float(threshold))
        yield from (in_flight, rebalances, layers, eplb_bytes, stalls, eplb_healthy, eplb_restarts, eplb_failed,
                    outcomes, layer_bal, window_bal, min_bal)

    @staticmethod
    def _operations(snap: dict[str, Any] | None, ops: list[dict[str, Any]]) -> Iterator[Metric]:
        """Scale and recovery operations by kind and status, the bytes they moved, and the output checks."""
        operations = GaugeMetricFamily(PREFIX + "operations", "operations by kind and status", labels=["kind", "status"])
        scale_bytes = CounterMetricFamily(PREFIX + "scale_moved_bytes",
                                          "bytes moved by scale and recovery operations (ahead of the pause and in it)")
        output_checks = CounterMetricFamily(PREFIX + "output_checks", "probes of a real model's output compared with the "
                                            "unsharded model's (after scales, recoveries and rebalances)")
        output_mismatch = CounterMetricFamily(PREFIX + "output_mismatch", "probes whose greedy tokens or logits differed "
                                              "from the unsharded model's (should stay 0)")
        if snap is not None:
            counts: dict[tuple[str, str], int] = {(k, s): 0 for k in ("scale", "recover") for s in OPERATION_STATUSES}
            for op in ops:
                key = (op["kind"], op["status"])
                counts[key] = counts.get(key, 0) + 1
            for (kind, status), n in sorted(counts.items()):
                operations.add_metric([kind, status], n)
            # in the pause and ahead of it (the pre-transfer of a prepared scale)
            scale_bytes.add_metric([], sum((op.get("bytes_moved") or 0) + (op.get("prepare") or {}).get("bytes_received", 0)
                                           for op in ops))
            check = snap.get("output_check") or {}
            if check.get("enabled"):
                output_checks.add_metric([], check.get("checks") or 0)
                output_mismatch.add_metric([], check.get("mismatches") or 0)
        yield from (operations, scale_bytes, output_checks, output_mismatch)

    @staticmethod
    def _ranks(snap: dict[str, Any] | None, beats: list[Any]) -> Iterator[Metric]:
        """Each live rank's last step: its load and its time."""
        rank_load = GaugeMetricFamily(PREFIX + "rank_load", "tokens routed to a rank's slots in its last step", labels=["rank"])
        rank_step = GaugeMetricFamily(PREFIX + "rank_step_seconds", "a rank's last decode step time", labels=["rank"])
        if snap is not None:
            for hb in sorted(beats, key=lambda b: b.rank):
                rank_load.add_metric([str(hb.rank)], float(hb.rank_load))
                rank_step.add_metric([str(hb.rank)], float(hb.step_seconds))
        yield from (rank_load, rank_step)

    @staticmethod
    def _requests(snap: dict[str, Any] | None) -> Iterator[Metric]:
        """Completion requests by outcome, running and queued."""
        requests = CounterMetricFamily(PREFIX + "requests", "completion requests by outcome: ok (answered in full), "
                                       "failed (503 after a failure), cancelled (the client left), rejected (429/503 "
                                       "at once), replayed (run again from the prompt after a recovery)", labels=["outcome"])
        requests_running = GaugeMetricFamily(PREFIX + "requests_running", "completion requests in the group's batch")
        requests_queued = GaugeMetricFamily(PREFIX + "requests_queued", "completion requests waiting for a batch slot")
        served = snap.get("requests") if snap is not None else None
        if served:
            for outcome in ("ok", "failed", "cancelled", "rejected", "replayed"):
                requests.add_metric([outcome], served.get(outcome) or 0)
            requests_running.add_metric([], served.get("running") or 0)
            requests_queued.add_metric([], served.get("queued") or 0)
        yield from (requests, requests_running, requests_queued)

    def _autoscaler(self, snap: dict[str, Any] | None) -> Iterator[Metric]:
        scaler = self.autoscaler
        enabled = GaugeMetricFamily(PREFIX + "autoscaler_enabled", "1 when the autoscaler is on", labels=["observe_only"])
        decisions = CounterMetricFamily(PREFIX + "autoscaler_decisions", "autoscaler decisions by what became of them",
                                        labels=["action"])
        if snap is not None and scaler is not None:
            enabled.add_metric([str(scaler.config.observe_only).lower()], 1.0 if scaler.enabled else 0.0)
            for action, n in sorted(scaler.counts.items()):
                decisions.add_metric([action], n)
        yield from (enabled, decisions)


class OperationRecorder:
    """Feeds phase durations, decode pauses, rebalance durations and transitions from the
    coordinator's events.

    A rebalance's duration is rank 0's (every group has a rank 0, and each rank sends its own
    ``rebalance_finished``): from the step it started to the step its worker finished (async; the
    other ranks finish within a step or two), or the sync rearrangement's stall.
    """

    def __init__(self, registry: CollectorRegistry):
        self.phase_seconds = Histogram(PREFIX + "operation_phase_seconds", "time an operation spent in each phase",
                                       ["kind", "phase"], registry=registry, buckets=PHASE_BUCKETS)
        self.operation_seconds = Histogram(PREFIX + "operation_seconds", "time from request to end of an operation",
                                           ["kind", "status"], registry=registry, buckets=PHASE_BUCKETS)
        self.paused_seconds = Histogram(PREFIX + "decode_paused_seconds",
                                        "decoding paused by a scale (the rescaling phase, slowest rank)",
                                        registry=registry, buckets=PHASE_BUCKETS)
        self.transitions = Counter(PREFIX + "transitions", "state machine transitions", ["trigger", "dest"],
                                   registry=registry)
        self.rebalance_seconds = Histogram(PREFIX + "eplb_rebalance_seconds",
                                           "a rebalance (rearrangement) from its start to its end on rank 0, by outcome",
                                           ["outcome"], registry=registry, buckets=PHASE_BUCKETS)
        for outcome in ("finished", "failed"):
            self.rebalance_seconds.labels(outcome=outcome)  # exported at 0 before the first one
        # operations already observed (an operation's terminal update can be emitted more than once);
        # bounded: ids are unique, so only the recent ones can come again
        self._seen: OrderedDict[str, None] = OrderedDict()
        self._lock = threading.Lock()

    def __call__(self, kind: str, data: dict[str, Any]) -> None:
        if kind == "transition":
            self.transitions.labels(trigger=data["trigger"], dest=str(data["dest"])).inc()
            return
        if kind == "worker_event":
            self._worker_event(data)
            return
        if kind != "operation" or data.get("status") not in ("succeeded", "failed"):
            return
        with self._lock:
            if data["id"] in self._seen:
                return
            self._seen[data["id"]] = None
            while len(self._seen) > SEEN_OPERATIONS:
                self._seen.popitem(last=False)
        total = 0.0
        for phase, timing in (data.get("phases") or {}).items():
            seconds = timing.get("seconds")
            if seconds is not None:
                self.phase_seconds.labels(kind=data["kind"], phase=phase).observe(seconds)
                total += seconds
        self.operation_seconds.labels(kind=data["kind"], status=data["status"]).observe(total)
        if data.get("paused_seconds") is not None:
            self.paused_seconds.observe(data["paused_seconds"])

    def _worker_event(self, data: dict[str, Any]) -> None:
        if data.get("rank") != 0 or data.get("seconds") is None:
            return
        outcome = {"rebalance_finished": "finished", "rebalance_failed": "failed"}.get(str(data.get("kind")))
        if outcome is not None:
            self.rebalance_seconds.labels(outcome=outcome).observe(float(data["seconds"]))


#: TTFT and end-to-end latency buckets (seconds), and inter-token gaps (vLLM's spans)
LATENCY_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
                   40.0, 80.0, 160.0)
TOKEN_GAP_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.015, 0.02, 0.025, 0.03, 0.04, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3,
                     0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 10.0)


class ServingMetrics:
    """Latencies and token counts of completion requests, as the HTTP front end sees them
    (vLLM's ``time_to_first_token``, ``inter_token_latency``, ``e2e_request_latency``,
    ``prompt_tokens`` and ``generation_tokens``, in this project's namespace)."""

    def __init__(self, registry: CollectorRegistry, clock: Any = None):
        import time

        self.clock = clock or time.monotonic
        self.ttft = Histogram(PREFIX + "request_time_to_first_token_seconds",
                              "from a request's arrival to its first token", registry=registry, buckets=LATENCY_BUCKETS)
        self.inter_token = Histogram(PREFIX + "request_inter_token_seconds", "between two tokens of one request",
                                     registry=registry, buckets=TOKEN_GAP_BUCKETS)
        self.e2e = Histogram(PREFIX + "request_e2e_seconds", "from a request's arrival to its last token",
                             registry=registry, buckets=LATENCY_BUCKETS)
        self.prompt_tokens = Counter(PREFIX + "prompt_tokens", "prompt tokens of the requests answered",
                                     registry=registry)
        self.generation_tokens = Counter(PREFIX + "generation_tokens", "tokens generated for the requests answered",
                                         registry=registry)

    def timer(self) -> RequestTimer:
        return RequestTimer(self)


class RequestTimer:
    """One request's clock: :meth:`update` on every look at its choices (objects with a
    ``completion``), :meth:`finish` once when answered."""

    def __init__(self, metrics: ServingMetrics):
        self.metrics = metrics
        self.started = metrics.clock()
        self._seen: dict[str, tuple[int, float]] = {}  # request id -> (tokens seen, when the last came)
        self._finished = False

    def update(self, choices: Any) -> None:
        now = self.metrics.clock()
        for ch in choices:
            c = ch.completion
            count, last = self._seen.get(c.id, (0, self.started))
            new = len(c.tokens) - count
            if new <= 0:
                continue
            if count == 0:
                self.metrics.ttft.observe(now - self.started)
                new, last = new - 1, now  # tokens that came with the first one: no gap
            for _ in range(new):
                self.metrics.inter_token.observe((now - last) / max(new, 1))
            self._seen[c.id] = (len(c.tokens), now)

    def finish(self, choices: Any) -> None:
        if self._finished:
            return
        self._finished = True
        self.update(choices)
        self.metrics.e2e.observe(self.metrics.clock() - self.started)
        prompts = {getattr(ch, "prompt_index", ch.completion.id): len(ch.completion.spec.prompt) for ch in choices}
        self.metrics.prompt_tokens.inc(sum(prompts.values()))
        self.metrics.generation_tokens.inc(sum(len(ch.completion.tokens) for ch in choices))


def build_registry(coordinator: Any, autoscaler: Any = None) -> CollectorRegistry:
    """A fresh registry with the collector and an event-fed recorder subscribed to ``coordinator``."""
    registry = CollectorRegistry()
    registry.register(CoordinatorCollector(coordinator, autoscaler))
    coordinator.subscribe(OperationRecorder(registry))
    return registry
