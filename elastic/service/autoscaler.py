"""Autoscaler hooks: a policy protocol, a default threshold policy, and the runner that calls it.

- :class:`AutoscalerPolicy` — ``decide(snapshot: MetricsSnapshot) -> ScaleDecision``. A policy
  is pure apart from its own memory (timers, cooldown); time comes in the snapshot (``now``).
- :class:`ThresholdPolicy` — the default: scale up when a metric stays above ``up_threshold``
  for ``up_after_s``, down when it stays below ``down_threshold`` for ``down_after_s``
  (two thresholds: hysteresis), wait ``cooldown_s`` after any scale (its own or anyone's),
  stay within ``[min_size, max_size]``, move ``step`` ranks at a time.
- :class:`Autoscaler` — every ``interval_s`` builds a snapshot from the coordinator, asks the
  policy, and submits a decision through the **same operation path as the API**
  (``coordinator.scale(target, expected_generation=..., wait=False)``), so validation,
  conflicts and stale generations apply; a refused decision is logged and recorded, never
  raised. ``observe_only`` logs what it would do and changes nothing. The clock is injected
  and :meth:`Autoscaler.tick` runs one round, so tests drive it without sleeping.

A custom policy is named by import path in the config (``policy: "mypkg.scaling:MyPolicy"``);
the class is called with ``policy_options`` as keyword arguments and must have ``decide``.
"""

from __future__ import annotations

import logging
import threading
from collections import deque
from collections.abc import Callable
from typing import Any, Literal, Protocol, runtime_checkable

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from elastic.control.plane import ControlPlane
from elastic.core.clock import Clock, as_clock
from elastic.core.errors import ElasticError
from elastic.core.phases import Phase
from elastic.service.hooks import resolve_import_path

__all__ = [
    "Autoscaler",
    "AutoscalerConfig",
    "AutoscalerPolicy",
    "MetricsSnapshot",
    "ScaleDecision",
    "ThresholdPolicy",
    "build_policy",
]

log = logging.getLogger("elastic.service.autoscaler")

Metric = Literal["load_per_rank", "max_rank_load", "step_time", "token_rate_per_rank", "queue_depth"]


class MetricsSnapshot(BaseModel):
    """What a policy sees at one instant. ``now`` comes from the autoscaler's (injectable) clock."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    now: float
    state: str = Phase.RUNNING.value
    generation: int = 0
    current_size: int = Field(ge=1)
    min_size: int = Field(1, ge=1)
    max_size: int = Field(ge=1)
    load_per_rank: tuple[float, ...] = Field((), description="tokens routed to each rank's slots in its last step")
    balancedness: float | None = None
    step_time_s: float | None = Field(None, description="slowest rank's last decode step, seconds")
    token_rate: float | None = Field(None, description="tokens per second over all ranks (approximate)")
    queue_depth: float | None = Field(None, description="requests waiting, when the engine reports it")
    operation_id: str | None = Field(None, description="a scale or recovery in progress")

    @property
    def mean_load(self) -> float | None:
        return sum(self.load_per_rank) / len(self.load_per_rank) if self.load_per_rank else None

    @property
    def max_load(self) -> float | None:
        return max(self.load_per_rank) if self.load_per_rank else None

    def metric(self, name: str) -> float | None:
        if name == "load_per_rank":
            return self.mean_load
        if name == "max_rank_load":
            return self.max_load
        if name == "step_time":
            return self.step_time_s
        if name == "token_rate_per_rank":
            return None if self.token_rate is None else self.token_rate / self.current_size
        if name == "queue_depth":
            return self.queue_depth
        raise ValueError(f"unknown metric {name!r}")


class ScaleDecision(BaseModel):
    """``target`` ranks (None: keep the size) and why."""

    model_config = ConfigDict(frozen=True)

    target: int | None = Field(None, ge=1)
    reason: str = ""

    @classmethod
    def hold(cls, reason: str) -> ScaleDecision:
        return cls(target=None, reason=reason)


@runtime_checkable
class AutoscalerPolicy(Protocol):
    def decide(self, snapshot: MetricsSnapshot) -> ScaleDecision: ...


class AutoscalerConfig(BaseModel):
    """The ``autoscaler:`` section of a serve config. Threshold knobs apply to ``policy: threshold``."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    enabled: bool = Field(True, description="start enabled (scenarios and the API can turn it on and off)")
    observe_only: bool = Field(False, description="log what it would do; change nothing")
    interval_s: float = Field(5.0, gt=0, le=3600, description="seconds between decisions")
    policy: str = Field("threshold", description="'threshold' or an import path 'package.module:Class'")
    policy_options: dict[str, Any] = Field(default_factory=dict, description="keyword arguments of a custom policy")
    min_size: int = Field(1, ge=1)
    max_size: int | None = Field(None, ge=1, description="default: the deployment's max_ep_size")
    metric: Metric = "load_per_rank"
    up_threshold: float | None = Field(None, description="scale up when the metric stays above this")
    down_threshold: float | None = Field(None, description="scale down when the metric stays below this")
    up_after_s: float = Field(30.0, ge=0)
    down_after_s: float = Field(120.0, ge=0)
    cooldown_s: float = Field(300.0, ge=0, description="no decision this long after any scale")
    step: int = Field(1, ge=1, description="ranks added or removed per decision")

    @field_validator("policy")
    @classmethod
    def _policy(cls, value: str) -> str:
        if value != "threshold":
            target = resolve_import_path(value, what="autoscaler policy")
            if not callable(target):
                raise ValueError(f"autoscaler policy {value!r} is not a class or factory")
            if isinstance(target, type) and not callable(getattr(target, "decide", None)):
                raise ValueError(f"autoscaler policy {value!r} has no decide(snapshot) method")
        return value

    @model_validator(mode="after")
    def _check(self) -> AutoscalerConfig:
        if self.max_size is not None and self.max_size < self.min_size:
            raise ValueError(f"max_size={self.max_size} is below min_size={self.min_size}")
        if self.policy == "threshold":
            if self.policy_options:
                raise ValueError("policy_options are for an import-path policy; the threshold policy takes "
                                 "metric, up_threshold, down_threshold, up_after_s, down_after_s, cooldown_s, step")
            if self.up_threshold is None or self.down_threshold is None:
                raise ValueError("the threshold policy needs up_threshold and down_threshold")
            if not self.down_threshold < self.up_threshold:
                raise ValueError(f"down_threshold ({self.down_threshold}) must be below up_threshold "
                                 f"({self.up_threshold}): the gap between them is the hysteresis")
        return self


class ThresholdPolicy:
    """Two thresholds, sustain timers, cooldown, bounds, step. See the module docstring."""

    def __init__(self, config: AutoscalerConfig):
        if config.up_threshold is None or config.down_threshold is None:
            raise ValueError("the threshold policy needs up_threshold and down_threshold")
        self.config = config
        self._above_since: float | None = None
        self._below_since: float | None = None
        self._cooldown_from: float | None = None
        self._generation: int | None = None

    def _reset(self) -> None:
        self._above_since = self._below_since = None

    def decide(self, s: MetricsSnapshot) -> ScaleDecision:
        c = self.config
        if s.state != Phase.RUNNING or s.operation_id is not None:
            # a scale is under way (anyone's): start over, and count the cooldown from its end
            self._reset()
            self._cooldown_from = s.now
            return ScaleDecision.hold(f"{s.state}: operation {s.operation_id or '-'} in progress")
        if self._generation is not None and s.generation != self._generation:
            self._reset()
            self._cooldown_from = s.now  # someone scaled (the API, an operator): the cooldown starts now
        self._generation = s.generation
        value = s.metric(c.metric)
        if value is None:
            self._reset()
            return ScaleDecision.hold(f"no {c.metric} reading yet")
        lo = max(s.min_size, c.min_size)  # the tighter of the snapshot's and the config's bounds
        hi = min(s.max_size, c.max_size) if c.max_size is not None else s.max_size
        cooldown_left = (self._cooldown_from + c.cooldown_s - s.now) if self._cooldown_from is not None else 0.0
        if value > c.up_threshold:  # type: ignore[operator]
            self._below_since = None
            self._above_since = s.now if self._above_since is None else self._above_since
            held = s.now - self._above_since
            if held < c.up_after_s:
                return ScaleDecision.hold(f"{c.metric}={value:.4g} above {c.up_threshold:g} for {held:.1f}s of {c.up_after_s:g}s")
            target = min(hi, s.current_size + c.step)
            if target <= s.current_size:
                return ScaleDecision.hold(f"{c.metric}={value:.4g} above {c.up_threshold:g} but already at max_size={hi}")
            if cooldown_left > 0:
                return ScaleDecision.hold(f"{c.metric}={value:.4g} above {c.up_threshold:g}; cooldown {cooldown_left:.1f}s left")
            return self._scale(s, target, f"{c.metric}={value:.4g} above {c.up_threshold:g} for {held:.1f}s: "
                                          f"scale up {s.current_size} -> {target}")
        if value < c.down_threshold:  # type: ignore[operator]
            self._above_since = None
            self._below_since = s.now if self._below_since is None else self._below_since
            held = s.now - self._below_since
            if held < c.down_after_s:
                return ScaleDecision.hold(f"{c.metric}={value:.4g} below {c.down_threshold:g} for {held:.1f}s of {c.down_after_s:g}s")
            target = max(lo, s.current_size - c.step)
            if target >= s.current_size:
                return ScaleDecision.hold(f"{c.metric}={value:.4g} below {c.down_threshold:g} but already at min_size={lo}")
            if cooldown_left > 0:
                return ScaleDecision.hold(f"{c.metric}={value:.4g} below {c.down_threshold:g}; cooldown {cooldown_left:.1f}s left")
            return self._scale(s, target, f"{c.metric}={value:.4g} below {c.down_threshold:g} for {held:.1f}s: "
                                          f"scale down {s.current_size} -> {target}")
        self._reset()
        return ScaleDecision.hold(f"{c.metric}={value:.4g} within [{c.down_threshold:g}, {c.up_threshold:g}]")

    def _scale(self, s: MetricsSnapshot, target: int, reason: str) -> ScaleDecision:
        self._reset()
        self._cooldown_from = s.now  # also when the decision is only observed or is refused: no hammering
        return ScaleDecision(target=target, reason=reason)


def build_policy(config: AutoscalerConfig) -> AutoscalerPolicy:
    """The policy the config names: the threshold policy, or ``Class(**policy_options)`` from an import path."""
    if config.policy == "threshold":
        return ThresholdPolicy(config)
    factory = resolve_import_path(config.policy, what="autoscaler policy")
    try:
        policy = factory(**config.policy_options)
    except TypeError as exc:
        raise ValueError(f"autoscaler policy {config.policy!r} rejected policy_options "
                         f"{sorted(config.policy_options)}: {exc}") from exc
    if not callable(getattr(policy, "decide", None)):
        raise ValueError(f"autoscaler policy {config.policy!r} built {type(policy).__name__}, which has no decide(snapshot)")
    return policy


class Autoscaler:
    """Calls a policy every ``interval_s`` and submits its decisions as scale operations.

    ``metrics_fn`` (optional) returns extra readings an embedding engine has (e.g.
    ``{"queue_depth": 12}``); they override what the coordinator's heartbeats give.
    """

    def __init__(self, coordinator: ControlPlane, config: AutoscalerConfig, *, policy: AutoscalerPolicy | None = None,
                 clock: Clock | Callable[[], float] | None = None,
                 metrics_fn: Callable[[], dict[str, Any]] | None = None, keep: int = 100):
        self.coordinator = coordinator
        self.config = config
        self.policy = policy if policy is not None else build_policy(config)
        # the control plane's one clock (the coordinator's), unless a test gives its own
        self.clock = as_clock(clock if clock is not None else coordinator.clock)
        self.metrics_fn = metrics_fn
        deployment = coordinator.config
        capacity = deployment.max_ep_size
        self.max_size = config.max_size if config.max_size is not None else (capacity or config.min_size)
        self.min_size = config.min_size
        if capacity is not None and self.max_size > capacity:
            raise ValueError(f"autoscaler max_size={self.max_size} exceeds the deployment's max_ep_size={capacity}")
        if self.max_size < self.min_size:
            raise ValueError(f"autoscaler max_size={self.max_size} is below min_size={self.min_size}")
        problem = deployment.size_problem
        if "min_size" not in config.model_fields_set:
            # not set: the smallest size that holds the model
            self.min_size = next((n for n in range(1, self.max_size + 1) if not problem(n)), self.min_size)
        if problem(self.min_size):
            raise ValueError(f"autoscaler min_size={self.min_size} cannot hold the model: {problem(self.min_size)}")
        self._enabled = config.enabled
        self.decisions: deque[dict[str, Any]] = deque(maxlen=keep)
        self.last: dict[str, Any] | None = None
        self.counts: dict[str, int] = {"submitted": 0, "observed": 0, "refused": 0, "error": 0}
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    # -- on / off --------------------------------------------------------------------------
    @property
    def enabled(self) -> bool:
        return self._enabled

    def enable(self) -> None:
        self._enabled = True
        log.info("autoscaler enabled%s", " (observe only)" if self.config.observe_only else "")

    def disable(self) -> None:
        self._enabled = False
        log.info("autoscaler disabled")

    # -- one round -------------------------------------------------------------------------
    def snapshot(self) -> MetricsSnapshot:
        """A :class:`MetricsSnapshot` from the coordinator's state and its workers' last heartbeats."""
        snap = self.coordinator.snapshot()
        beats = []
        for worker in self.coordinator.live_workers():
            if worker.heartbeat is not None:
                beats.append(worker.heartbeat)
        beats.sort(key=lambda hb: hb.rank)
        heartbeat_s = self.coordinator.config.heartbeat_s or 1.0
        op = snap.get("operation") or {}
        in_progress = op.get("id") if op and op.get("status") in ("pending", "running") else None
        fields: dict[str, Any] = {
            "now": self.clock.monotonic(),
            "state": snap["state"],
            "generation": snap["generation"],
            "current_size": snap["ep_size"],
            "min_size": self.min_size,
            "max_size": self.max_size,
            "load_per_rank": tuple(float(hb.rank_load) for hb in beats),
            "balancedness": snap.get("balancedness"),
            "step_time_s": max((float(hb.step_seconds) for hb in beats), default=None),
            "token_rate": (sum(hb.tokens for hb in beats) / heartbeat_s) if beats else None,
            "operation_id": in_progress,
        }
        if self.metrics_fn is not None:
            fields.update(self.metrics_fn() or {})
        return MetricsSnapshot(**fields)

    def tick(self) -> dict[str, Any] | None:
        """One round: snapshot, decide, submit (or log). Returns the record, None when disabled."""
        if not self._enabled:
            return None
        with self._lock:  # one round at a time (the thread and a test or API call may overlap)
            record: dict[str, Any] = {"at": None, "target": None, "reason": "", "action": "hold",
                                      "operation_id": None, "error": None, "observe_only": self.config.observe_only}
            try:
                snap = self.snapshot()
                record["at"], record["from_size"] = snap.now, snap.current_size
                decision = self.policy.decide(snap)
            except Exception as exc:  # noqa: BLE001 - a broken policy or reading is logged, the loop goes on
                log.exception("autoscaler round failed")
                record.update(action="error", error=f"{type(exc).__name__}: {exc}")
                return self._keep(record)
            record.update(target=decision.target, reason=decision.reason)
            if decision.target is None or decision.target == snap.current_size:
                self.last = record
                return record
            if self.config.observe_only:
                log.info("autoscaler (observe only) would scale %d -> %d: %s", snap.current_size, decision.target,
                         decision.reason)
                record["action"] = "observed"
                return self._keep(record)
            try:
                op = self.coordinator.scale(decision.target, expected_generation=snap.generation, wait=False)
            except ElasticError as exc:
                log.warning("autoscaler decision %d -> %d refused: %s", snap.current_size, decision.target, exc)
                record.update(action="refused", error=exc.to_dict())
                return self._keep(record)
            log.info("autoscaler started operation %s: %s", op.id, decision.reason)
            record.update(action="submitted", operation_id=op.id)
            return self._keep(record)

    def _keep(self, record: dict[str, Any]) -> dict[str, Any]:
        self.last = record
        if record["action"] != "hold":
            self.decisions.append(record)
            self.counts[record["action"]] = self.counts.get(record["action"], 0) + 1
        return record

    # -- the thread ------------------------------------------------------------------------
    def start(self) -> Autoscaler:
        if self._thread is not None and self._thread.is_alive():
            return self
        self._stop.clear()
        self._thread = threading.Thread(target=self._loop, name="autoscaler", daemon=True)
        self._thread.start()
        return self

    def _loop(self) -> None:
        while not self._stop.wait(self.config.interval_s):
            try:
                self.tick()
            except Exception:  # noqa: BLE001 - the loop outlives any round
                log.exception("autoscaler tick failed")

    def stop(self, timeout: float = 5.0) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout)
            self._thread = None

    @property
    def running(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def status(self) -> dict[str, Any]:
        """JSON-ready: on/off, mode, policy, bounds, the last round and recent decisions."""
        return {
            "enabled": self._enabled,
            "running": self.running,
            "observe_only": self.config.observe_only,
            "policy": self.config.policy,
            "metric": self.config.metric if self.config.policy == "threshold" else None,
            "interval_s": self.config.interval_s,
            "min_size": self.min_size,
            "max_size": self.max_size,
            "last": self.last,
            "counts": dict(self.counts),
            "decisions": list(self.decisions)[-20:],
        }
