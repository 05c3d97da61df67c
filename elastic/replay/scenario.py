"""Scenario files (``scenarios/*.yaml``): schema, loading and one clear message per error.

A scenario is a deployment (``deployment:``, an ``elastic.deployment.DeploymentConfig`` with its
names) plus what a replay adds: a load trace, a timeline of events, faults, an autoscaler and
the expectations a replay checks (see ``docs/scenarios.md`` for the reference). The old scenario
names (``model.layers``, ``initial_ep_size``...) are refused, each with the key that replaces it.
Loading runs the pre-flight checks (``elastic.service.preflight``: size, encoding, YAML limits, numeric
bounds, memory) and two passes, all before anything starts:

1. the schema (pydantic, ``extra="forbid"``): unknown keys, wrong types, values out of range;
2. the plan: the timeline is walked in order with the EP size, the generation and whether the
   deployment is failed, so a scale to a size the model cannot use, a kill of a rank that does
   not exist, a recover without a failure or an event while failed with nothing to recover it
   are refused up front.

Every problem becomes one line ``FILE: key.path[i].key: what was expected, got what`` and all
of a file's problems are raised together as one :class:`ScenarioError`.
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Any, Literal, Union

from pydantic import BaseModel, ConfigDict, Field, TypeAdapter, ValidationError, field_validator
from pydantic_core import ErrorDetails

from elastic.core.phases import Phase as P
from elastic.deployment import DeploymentConfig, TracePhase
from elastic.faults import CorruptBuffer, DropHeartbeats, Fault, KillRank, StallRank
from elastic.service.autoscaler import AutoscalerConfig
from elastic.service.preflight import (
    InputError,
    InputProblem,
    bound_problems,
    host_problems,
    load_yaml,
    memory_problems,
    one_line,
    policy_problems,
    read_text,
)
from eplb.trace import TraceConfig

__all__ = [
    "Scenario", "ScenarioError", "ScenarioProblem", "load_scenario", "parse_scenario", "EVENT_ACTIONS",
    "ScaleEvent", "KillEvent", "StallEvent", "DropHeartbeatsEvent", "RecoverEvent", "RebalanceEvent",
    "AutoscalerEvent", "Expectations",
]


# ---------------------------------------------------------------------------------------------
# errors

class ScenarioProblem(BaseModel):
    """One thing wrong with a scenario: where (a key path) and what was expected."""

    model_config = ConfigDict(frozen=True)

    path: str
    message: str

    def line(self, source: str) -> str:
        return one_line(f"{source}: {self.path}: {self.message}" if self.path else f"{source}: {self.message}")


class ScenarioError(InputError):
    """A scenario file that cannot be run; ``problems`` lists every error found (one line each)."""

    def __init__(self, source: str, problems: list[Any]):
        super().__init__(source, problems)


# ---------------------------------------------------------------------------------------------
# schema

class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class TraceSpec(TraceConfig):
    """One load regime (``eplb.trace.TraceConfig``) and the step it starts at."""

    at_step: int = Field(0, ge=0, description="the step this regime starts at (the first one at 0)")

    def phase(self) -> TracePhase:
        fields = self.model_dump(exclude={"at_step"})
        return TracePhase(start_step=self.at_step, trace=TraceConfig(**fields))


class _Event(_Strict):
    at_step: int = Field(ge=0, description="the step (of the slowest rank) the event fires at")

    def label(self) -> str:
        raise NotImplementedError


class ScaleEvent(_Event):
    """Scale the EP group to ``to`` ranks."""

    action: Literal["scale"]
    to: int = Field(ge=1, description="the new EP size")
    wait_for_transfer: bool = Field(False, description="also wait (up to transfer_wait_s) until an async layer transfer is in flight")
    transfer_wait_s: float = Field(10.0, gt=0)

    def label(self) -> str:
        return f"scale to {self.to}"


class KillEvent(_Event):
    """Rank ``rank`` dies (``faults.KillRank``); the coordinator should go ``failed``.

    Without ``in_phase`` it dies at ``at_step``. With ``in_phase`` it dies when that phase's
    command of the *next scale event* of the timeline reaches it (``rescaling`` with
    ``after_layers``: after moving that many layers in the pause; ``draining`` with
    ``after_layers``: after that many layers of the pre-transfer, the prepare sub-phase);
    ``at_step`` then only orders the event.
    """

    action: Literal["kill"]
    rank: int = Field(ge=0)
    generation: int | None = Field(None, ge=0, description="the generation it dies in (default: once, in the one "
                                   "the timeline predicts or a later one)")
    in_phase: Literal["draining", "suppressed", "rescaling", "resuming"] | None = Field(
        None, description="die in this phase of the next scale event instead of at at_step")
    after_layers: int | None = Field(None, ge=0, description="with in_phase: rescaling, die after moving this many "
                                     "layers in the pause; with in_phase: draining, after this many of the pre-transfer")

    @field_validator("after_layers")
    @classmethod
    def _only_moving_phases(cls, value: int | None, info: Any) -> int | None:
        if value is not None and info.data.get("in_phase") not in ("rescaling", "draining"):
            raise ValueError(f"expected after_layers only with in_phase: rescaling or draining, got in_phase "
                             f"{info.data.get('in_phase')!r}")
        return value

    def label(self) -> str:
        if self.in_phase is None:
            return f"kill rank {self.rank}"
        extra = f" after {self.after_layers} layer(s)" if self.after_layers is not None else ""
        return f"kill rank {self.rank} in {self.in_phase}{extra}"

    def record(self, generation: int) -> KillRank:
        if self.in_phase is None:
            return KillRank(rank=self.rank, at_step=self.at_step, **_pinned(self, generation))
        return KillRank(rank=self.rank, in_phase=self.in_phase, after_layers=self.after_layers, **_pinned(self, generation))


class StallEvent(_Event):
    """Rank ``rank`` stops answering at ``at_step`` for ``seconds`` (``faults.StallRank``).

    A stall at least as long as the collective or heartbeat deadline loses the rank (the group
    fails; with ``auto_recover`` it recovers without it); a shorter one is a hiccup.
    """

    action: Literal["stall"]
    rank: int = Field(ge=0)
    seconds: float = Field(gt=0)
    generation: int | None = Field(None, ge=0, description="the generation it stalls in (default: once, in the one "
                                   "the timeline predicts or a later one)")

    def label(self) -> str:
        return f"stall rank {self.rank} for {self.seconds:g}s"

    def record(self, generation: int) -> StallRank:
        return StallRank(rank=self.rank, at_step=self.at_step, seconds=self.seconds, **_pinned(self, generation))


class DropHeartbeatsEvent(_Event):
    """Rank ``rank`` keeps working but stops reporting from ``at_step`` (``faults.DropHeartbeats``):
    the coordinator declares it lost after the heartbeat deadline."""

    action: Literal["drop_heartbeats"]
    rank: int = Field(ge=0)
    generation: int | None = Field(None, ge=0, description="the generation it goes silent in (default: once, in "
                                   "the one the timeline predicts or a later one)")

    def label(self) -> str:
        return f"drop rank {self.rank}'s heartbeats"

    def record(self, generation: int) -> DropHeartbeats:
        return DropHeartbeats(rank=self.rank, from_step=self.at_step, **_pinned(self, generation))


def _pinned(event: KillEvent | StallEvent | DropHeartbeatsEvent, planned: int) -> dict[str, int]:
    """A fault event's generation: the one it gives (exactly), or the plan's prediction as a lower
    bound. The plan counts one generation per scale and recovery; a recovery that needs a second
    attempt, replace_lost's scale back or a scale failed by a fault take more, and a fault pinned
    to the prediction exactly would never fire. Unpinned, it fires once (``faults.ONCE``): a
    survivor renumbered into the lost rank's number is not hit again."""
    return {"generation": event.generation} if event.generation is not None else {"from_generation": planned}


class RecoverEvent(_Event):
    """Recover from ``failed`` with the living workers (fires once the failure is seen: a failed group decodes no steps)."""

    action: Literal["recover"]
    at_step: int = Field(0, ge=0)

    def label(self) -> str:
        return "recover"


class RebalanceEvent(_Event):
    """Ask every rank to start a rebalance now."""

    action: Literal["rebalance"]

    def label(self) -> str:
        return "rebalance"


class AutoscalerEvent(_Event):
    """Turn the autoscaler (the scenario's ``autoscaler:`` section) on or off at a step."""

    action: Literal["autoscaler"]
    enabled: bool

    def label(self) -> str:
        return f"autoscaler {'on' if self.enabled else 'off'}"


Event = Annotated[ScaleEvent | KillEvent | StallEvent | DropHeartbeatsEvent | RecoverEvent | RebalanceEvent | AutoscalerEvent,
                  Field(discriminator="action")]
EVENT_ACTIONS = ("scale", "kill", "stall", "drop_heartbeats", "recover", "rebalance", "autoscaler")
FAULT_EVENTS = (KillEvent, StallEvent, DropHeartbeatsEvent)
#: a replay's deadlines unless the scenario overrides them: a dead peer is noticed in seconds
REPLAY_TIMEOUTS: dict[str, float] = {"collective": 10.0, "heartbeat": 15.0, "worker_start": 60.0}
#: a replay paces steps by 10 ms and samples every worker every 10 ms, so events land near their step
REPLAY_DEPLOYMENT: dict[str, Any] = {"step_delay_s": 0.01, "heartbeat_s": 0.01}
#: a prepared scale paces its pre-transfer at half the wall time (the deployment default is 0.1), as a
#: scenario's scale on a tiny model is mostly its set-up, and 1 / 0.1 times that is 100-200 steps with
#: the EPLB off, which would crowd the timeline (a scenario about the pacing sets its own)
REPLAY_SCALING: dict[str, float] = {"prestage_share": 0.5}


def _replay_defaults(deployment: dict[str, Any]) -> dict[str, Any]:
    """A scenario's deployment over the replay's defaults (pacing, sampling, short deadlines), the
    nested sections key by key."""
    out = {**REPLAY_DEPLOYMENT, **deployment}
    for section, defaults in (("timeouts", REPLAY_TIMEOUTS), ("scaling", REPLAY_SCALING)):
        given = deployment.get(section, {})
        if isinstance(given, dict):  # anything else is left for the schema to name
            out[section] = {**defaults, **given}
    return out
STATES = tuple(p.value for p in P)


class Expectations(_Strict):
    """What must hold at the end of the replay; a key left out (or null) is not checked."""

    final_ep_size: int | None = Field(None, ge=1)
    final_state: Literal["running", "draining", "suppressed", "rescaling", "resuming", "failed"] | None = "running"
    min_balancedness_after_rebalance: float | None = Field(
        None, gt=0, le=1, description="every completed rebalance: mean balancedness of the steps after it")
    no_lost_expert: bool = Field(True, description="every verification: every logical expert has a replica")
    all_slots_verified: bool = Field(True, description="every verification: no mismatched slot on any rank, digests agree")
    max_pause_s: float | None = Field(None, gt=0, description="longest decoding pause of any scale or recovery")
    min_rebalances: int | None = Field(None, ge=0, description="EPLB rebalances finished during the run")
    drain_committed_in_flight: bool = Field(
        False, description="a scale began with a layer transfer in flight and the drain committed it on every rank")
    events_ok: bool = Field(True, description="every timeline event did what it asked (scales succeeded, kills fired...)")
    min_steps: int | None = Field(None, ge=0, description="steps decoded by the end (default: the scenario's steps)")
    min_autoscaler_operations: int | None = Field(None, ge=0, description="scale operations the autoscaler started")
    min_refused_layers: int | None = Field(
        None, ge=0, description="received layers a rank refused (its own verification failed: rebalance_failed, local)")
    min_failures: int | None = Field(None, ge=0, description="times the deployment went failed (a fault was detected)")
    faults_fired: bool = Field(True, description="every kill, stall or drop_heartbeats record in faults: without "
                               "generation fired (a timeline fault that does not fire fails events_ok)")
    identical_output: bool = Field(
        False, description="every verification of a real model (deployment.model.kind: hf): the probe batch's greedy "
        "tokens and logits bitwise equal to the unsharded single-process model's; with traffic, also every "
        "request's tokens equal to the unsharded model's greedy output for its prompt")
    no_failed_requests: bool = Field(
        False, description="with traffic: every request answered in full (429/503 retried by the client count as "
        "retried, not failed)")


class TrafficSpec(_Strict):
    """Completion requests sent through the replay (``elastic-ep loadgen``'s client, streaming, greedy)."""

    rate: float = Field(4.0, gt=0, le=1000, description="requests per second (Poisson arrivals)")
    concurrency: int = Field(4, ge=1, le=256, description="requests in flight at most")
    prompt_len: tuple[int, int] = Field((4, 12), description="[min, max] prompt tokens")
    max_tokens: tuple[int, int] = Field((8, 24), description="[min, max] tokens per request")
    seed: int = Field(0, ge=0)

    @field_validator("prompt_len", "max_tokens")
    @classmethod
    def _span(cls, value: tuple[int, int]) -> tuple[int, int]:
        if not 1 <= value[0] <= value[1]:
            raise ValueError(f"expected [min, max] with 1 <= min <= max, got {list(value)}")
        return value


class Scenario(_Strict):
    """A replay: a deployment (every ``DeploymentConfig`` field, under ``deployment:``) plus the
    scenario's own keys: the load (``trace``), how long it runs, the timeline, the faults, the
    autoscaler and the expectations."""

    name: str = Field(min_length=1)
    description: str = ""
    deployment: DeploymentConfig = Field(
        default_factory=lambda: DeploymentConfig.model_validate(_replay_defaults({})),
        description="the deployment replayed (elastic.deployment.DeploymentConfig, its names and defaults; a replay "
                    "defaults step_delay_s and heartbeat_s to 0.01 s and scaling.prestage_share to 0.5, and uses short "
                    "timeouts); its load is the "
                    "scenario's trace")
    trace: list[TraceSpec] = Field(default_factory=lambda: [TraceSpec()], min_length=1)
    steps: int = Field(ge=1, description="decode steps to run")
    autoscaler: AutoscalerConfig | None = Field(
        None, description="run elastic.service.autoscaler with this config (its 'enabled' is the state at step 0)")
    faults: list[Fault] = Field(default_factory=list, description="extra fault injections (elastic.faults records)")
    timeline: list[Event] = Field(default_factory=list)
    traffic: TrafficSpec | None = Field(None, description="completion requests sent while the replay runs "
                                        "(a real model only)")
    expect: Expectations = Expectations()
    run_timeout_s: float = Field(300.0, gt=0, description="the whole replay's deadline")
    slow: bool = Field(False, description="the test suite marks this replay slow")

    @field_validator("deployment", mode="before")
    @classmethod
    def _replay_deployment(cls, value: Any) -> Any:
        return _replay_defaults(value) if isinstance(value, dict) else value

    # -- what it runs ---------------------------------------------------------------------------
    def deployment_config(self) -> DeploymentConfig:
        """What the replay runs: the embedded deployment with the scenario's trace as its load."""
        fields = self.deployment.model_dump(exclude_unset=True, exclude={"trace"})  # unset: defaults stay defaults
        return DeploymentConfig.model_validate({**fields, "trace": [p.phase().model_dump() for p in self.trace]})

    def planned(self) -> list[dict[str, Any]]:
        """The timeline walked in order: per event, the size and generation it finds and leaves."""
        return _plan(self)[0]

    def fault_records(self) -> tuple[Any, ...]:
        """The scenario's faults plus one record per kill/stall/drop_heartbeats event: pinned to the
        generation it gives, or else from the generation the plan predicts on, once."""
        plan = self.planned()
        kills = [e.record(step["generation"]) for e, step in zip(self.timeline, plan) if isinstance(e, FAULT_EVENTS)]
        return tuple(self.faults) + tuple(kills)

    def stall_loses_rank(self, seconds: float) -> bool:
        """Whether a stall this long outlasts a deadline (the rank is lost) rather than a hiccup."""
        timeouts = self.deployment.timeouts
        return seconds >= min(timeouts.collective, timeouts.heartbeat)


# ---------------------------------------------------------------------------------------------
# the plan pass

def _plan(s: Scenario) -> tuple[list[dict[str, Any]], list[ScenarioProblem | InputProblem]]:
    """The plan pass: walk the timeline predicting size and generation, naming every problem found."""
    walk = _Walk(s)
    walk.check_inputs()
    if walk.problems:
        return walk.plan, walk.problems
    walk.check_autoscaler_and_faults()
    for i, event in enumerate(s.timeline):
        walk.step(i, event)
    walk.check_end()
    return walk.plan, walk.problems


class _Walk:
    """The plan pass's state as it walks the timeline: the size and generation it predicts, whether
    the deployment is failed (and by which event), the autoscaler, a kill armed for the next scale."""

    def __init__(self, s: Scenario):
        self.s = s
        d = self.d = s.deployment  # its own validation already holds: sizes divide, ep_size <= max_ep_size
        self.problems: list[ScenarioProblem | InputProblem] = []
        self.plan: list[dict[str, Any]] = []
        self.experts, self.max_size, self.per_rank = d.sizes.num_logical_experts, d.max_ep_size, d.slots_per_rank
        self.size, self.generation = d.ep_size, 0
        self.failed = False
        self.failed_by: str | None = None
        self.autoscaler = s.autoscaler is not None and s.autoscaler.enabled
        self.scaled_by_autoscaler = self.autoscaler  # from then on size and generation are decided at run time
        self.phase_killed: str | None = None  # the phase kill after which they are (no autoscaler needed)
        self.previous_step = 0
        self.phase_kill: tuple[int, KillEvent] | None = None  # armed, waiting for the next scale event

    def problem(self, path: str, message: str) -> None:
        self.problems.append(ScenarioProblem(path=path, message=message))

    def size_problem(self, n: int) -> str | None:
        if n > self.max_size:
            return f"expected at most deployment.max_ep_size={self.max_size}, got {n}"
        if self.per_rank * n < self.experts:
            return (f"expected a size whose {self.per_rank} slots per rank hold the {self.experts} experts "
                    f"(at least {-(-self.experts // self.per_rank)}), got {n}")
        return None

    def recovery_size(self, survivors: int) -> int:
        """The size a recovery from ``survivors`` reaches, as the coordinator's: too few to hold every
        expert, fresh workers join, as few as needed, when max_ep_size has room; else the survivors."""
        return _recovery_size(survivors, self.size_problem, self.max_size)

    def check_inputs(self) -> None:
        """The sections' own consistency: expectations, traffic, the trace's regimes."""
        s, d, problem = self.s, self.d, self.problem
        self.problems.extend(policy_problems(d, "deployment.eplb.policy"))
        if s.expect.identical_output and getattr(d.model, "kind", "reference") != "hf":
            problem("expect.identical_output", "expected false or absent: it compares a real model's output with the "
                    "unsharded model (deployment.model.kind: hf); the reference model is checked slot by slot "
                    "(all_slots_verified)")
        if s.traffic is not None and getattr(d.model, "kind", "reference") != "hf":
            problem("traffic", "requests need a real model (deployment.model.kind: hf); the reference model decodes "
                    "its trace only")
        if s.expect.no_failed_requests and s.traffic is None:
            problem("expect.no_failed_requests", "expected false or absent: there is no traffic: section")
        starts = [t.at_step for t in s.trace]
        if starts[0] != 0:
            problem("trace[0].at_step", f"expected 0 (the first regime starts the run), got {starts[0]}")
        for i in range(1, len(starts)):
            if starts[i] <= starts[i - 1]:
                problem(f"trace[{i}].at_step", f"expected a step after trace[{i - 1}].at_step={starts[i - 1]}, got {starts[i]}")
            elif starts[i] >= s.steps:
                problem(f"trace[{i}].at_step", f"expected a step before the end of the run (steps={s.steps}), got {starts[i]}")
        for i, t in enumerate(s.trace):
            if t.top_k > self.experts:
                problem(f"trace[{i}].top_k", f"expected at most deployment.model.num_experts={self.experts}, got {t.top_k}")

    def check_autoscaler_and_faults(self) -> None:
        s, problem, max_size = self.s, self.problem, self.max_size
        if s.autoscaler is not None:
            hi = s.autoscaler.max_size if s.autoscaler.max_size is not None else max_size
            if hi > max_size:
                problem("autoscaler.max_size", f"expected at most deployment.max_ep_size={max_size}, got {hi}")
            if "min_size" in s.autoscaler.model_fields_set and self.per_rank * s.autoscaler.min_size < self.experts:
                problem("autoscaler.min_size", f"expected a size whose {self.per_rank} slots per rank hold the "
                        f"{self.experts} experts, got {s.autoscaler.min_size}")
        for i, fault in enumerate(s.faults):
            if fault.rank >= max_size:
                problem(f"faults[{i}].rank", f"expected a rank below deployment.max_ep_size={max_size}, got {fault.rank}")
            if isinstance(fault, CorruptBuffer) and not self.d.eplb.verify_transfers:
                problem(f"faults[{i}]", "expected deployment.eplb.verify_transfers: true with a corrupt_buffer fault "
                        "(only a verified transfer catches the corrupted layer), got false")
            if isinstance(fault, KillRank) and fault.in_phase is not None and s.autoscaler is None \
                    and not any(isinstance(e, ScaleEvent) for e in s.timeline):
                problem(f"faults[{i}].in_phase", f"expected a scale event in the timeline to die in (a {fault.in_phase} "
                        "phase only happens during a scale), got none")

    def step(self, i: int, event: Any) -> None:
        """One timeline event: its checks, and the size and generation after it."""
        where = f"timeline[{i}]"
        entry = {"index": i, "action": event.action, "size_before": self.size, "generation": self.generation}
        if self.phase_kill is not None and not isinstance(event, ScaleEvent):
            k, kill = self.phase_kill
            self.problem(f"timeline[{k}].in_phase", f"expected the next event to be a scale to die in (a {kill.in_phase} "
                         f"phase only happens during a scale), got a {event.action} event")
            self.phase_kill = None
        self._check_step(where, event)
        if self.failed and not isinstance(event, RecoverEvent):
            self.problem(where, f"expected a recover event first: the deployment is failed after {self.failed_by} "
                         f"(or set deployment.auto_recover: true), got a {event.action} event")
        elif isinstance(event, ScaleEvent):
            self._scale(where, event, entry)
        elif isinstance(event, KillEvent) and event.in_phase is not None:
            self._arm_phase_kill(i, where, event)
        elif isinstance(event, StallEvent) and not self.s.stall_loses_rank(event.seconds):
            self._stall(where, event, entry)
        elif isinstance(event, FAULT_EVENTS):
            self._fault(where, event, entry)
        elif isinstance(event, RecoverEvent):
            self._recover(where)
        elif isinstance(event, AutoscalerEvent):
            if self.s.autoscaler is None:
                self.problem(where, "expected an autoscaler: section in the scenario for this event to turn on or off, "
                             "got none")
            self.autoscaler = event.enabled
            self.scaled_by_autoscaler = self.scaled_by_autoscaler or self.autoscaler
        entry.update(size_after=self.size, autoscaler=self.autoscaler, predicted=not self.scaled_by_autoscaler)
        self.plan.append(entry)

    def _check_step(self, where: str, event: Any) -> None:
        steps = self.s.steps
        if event.at_step > steps:
            self.problem(f"{where}.at_step", f"expected a step within the run (steps={steps}), got {event.at_step}")
        if isinstance(event, RecoverEvent) and "at_step" not in event.model_fields_set:
            pass  # a recover without a step fires as soon as the failure is seen
        elif event.at_step < self.previous_step:
            self.problem(f"{where}.at_step", f"expected events in step order (>= {self.previous_step}), got {event.at_step}")
        elif event.at_step <= steps:  # (one out of range is reported once, not for every event after it)
            self.previous_step = event.at_step

    def _scale(self, where: str, event: ScaleEvent, entry: dict[str, Any]) -> None:
        why = self.size_problem(event.to)
        if why:
            self.problem(f"{where}.to", why)
        elif self.phase_kill is not None:
            self.size, self.generation = _plan_phase_kill(self.s, self.phase_kill, event, self.size, self.generation,
                                                          self.plan, self.problem, self.size_problem)
            entry["phase_kill"] = self.phase_kill[0]
            self.scaled_by_autoscaler = True  # generations after a failed attempt are decided at run time
            self.phase_killed = f"timeline[{self.phase_kill[0]}]"
        elif event.to != self.size or self.scaled_by_autoscaler:
            self.size, self.generation = event.to, self.generation + 1
        self.phase_kill = None

    def _arm_phase_kill(self, i: int, where: str, event: KillEvent) -> None:
        if not self.d.auto_recover:
            self.problem(f"{where}.in_phase", "expected deployment.auto_recover: true with a kill in a phase (the failed "
                         "scale is recovered by the coordinator itself), got false")
        elif self.scaled_by_autoscaler and event.generation is None and self.s.autoscaler is not None:
            self.problem(f"{where}.generation", "expected an explicit generation: the autoscaler may have scaled "
                         "before this kill, so the timeline cannot tell which generation the rank dies in")
        else:
            self.phase_kill = (i, event)

    def _stall(self, where: str, event: StallEvent, entry: dict[str, Any]) -> None:
        if not self.scaled_by_autoscaler and event.rank >= self.size:
            self.problem(f"{where}.rank", f"expected a rank of the group of {self.size} at that point "
                         f"(0..{self.size - 1}), got {event.rank}")
        elif event.generation is not None:
            self.generation = event.generation
        entry["generation"] = self.generation
        entry["loses_rank"] = False

    def _fault(self, where: str, event: Any, entry: dict[str, Any]) -> None:
        """A rank lost: recovered by the coordinator (auto_recover), or the deployment is failed."""
        entry["loses_rank"] = True
        size, auto = self.size, self.d.auto_recover
        if self.scaled_by_autoscaler and event.generation is None:
            why = ("the autoscaler may have scaled before this event" if self.s.autoscaler is not None else
                   f"the scale that {self.phase_killed}'s kill in a phase failed leaves the group to its recovery")
            self.problem(f"{where}.generation", f"expected an explicit generation: {why}, so the timeline cannot "
                         "tell which generation the rank is in")
        elif self.scaled_by_autoscaler:
            self.failed, self.failed_by = (False, None) if auto else (True, where)
        elif event.rank >= size:
            self.problem(f"{where}.rank", f"expected a rank of the group of {size} at that point (0..{size - 1}), "
                         f"got {event.rank}")
        elif auto and (size - 1 < 1 or self.size_problem(self.recovery_size(size - 1))):
            self.problem(where, f"expected a kill the survivors can recover from (auto_recover): {size - 1} rank(s) "
                         "cannot hold the model")
        else:
            if event.generation is not None:
                self.generation = event.generation
            entry["generation"] = self.generation
            if auto:
                self._recovered(size)
            else:
                self.failed, self.failed_by = True, where

    def _recover(self, where: str) -> None:
        if not self.failed:
            self.problem(where, "expected a failure to recover from (a kill event before it, without auto_recover), "
                         "got none")
        elif self.size - 1 < 1 or self.size_problem(self.recovery_size(self.size - 1)):
            self.problem(where, f"expected survivors that can hold the model: {self.size - 1} rank(s) cannot")
            self.failed = False
        else:
            self._recovered(self.size)
            self.failed = False

    def _recovered(self, size: int) -> None:
        """After a recovery from ``size`` ranks with one lost: the survivors, one generation on; with
        ``replace_lost`` the coordinator then scales back to ``size`` with a fresh worker (one more
        generation). A fault event takes the prediction as a lower bound: a recovery that needs a
        second attempt takes more generations, never fewer."""
        after = self.recovery_size(size - 1)  # fresh workers join survivors too few to hold the model
        if self.d.replace_lost and after < size:
            self.generation += 2
        else:
            self.size, self.generation = after, self.generation + 1

    def check_end(self) -> None:
        """What the walk leaves: a kill still armed, a failed end, the deployment with the trace."""
        s = self.s
        if self.phase_kill is not None:
            k, kill = self.phase_kill
            self.problem(f"timeline[{k}].in_phase", f"expected a scale event after this kill to die in (a "
                         f"{kill.in_phase} phase only happens during a scale), got none")
        if self.failed and s.expect.final_state not in (None, P.FAILED):
            self.problem("expect.final_state", f"expected 'failed' or null: {self.failed_by} leaves the deployment "
                         "failed (add a recover event or deployment.auto_recover: true), got "
                         f"{s.expect.final_state!r}")
        if not self.problems:
            try:
                s.deployment_config()
            except ValidationError as exc:  # what the deployment still refuses with the scenario's trace as its load
                for err in exc.errors():
                    text = err["msg"].removeprefix("Value error, ")
                    self.problem("trace" if "trace" in text else "deployment",
                                 f"the deployment with this trace is invalid: {text}")


def _recovery_size(survivors: int, size_problem: Any, max_size: int) -> int:
    """As ``Coordinator._recovery_size``: the survivors, or the fewest ranks at least as many that hold
    every logical expert, when ``max_size`` has room for the fresh ones."""
    size = survivors
    while size_problem(size) and size < max_size:
        size += 1
    return size if not size_problem(size) else survivors


def _plan_phase_kill(s: Scenario, armed: tuple[int, KillEvent], scale: ScaleEvent, size: int, generation: int,
                     plan: list[dict[str, Any]], problem: Any, size_problem: Any) -> tuple[int, int]:
    """A kill armed for the next scale: check it can fire there, pin its generation; the size after recovery."""
    k, kill = armed
    where = f"timeline[{k}]"
    if scale.to == size:
        problem(f"{where}.in_phase", f"expected the next scale to change the size (a scale to {size} ranks is a no-op "
                f"and has no {kill.in_phase} phase), got a scale to {scale.to}")
        return size, generation
    layers = s.deployment.sizes.num_moe_layers
    if kill.after_layers is not None and kill.after_layers >= layers:
        problem(f"{where}.after_layers", f"expected fewer than the model's {layers} layers, got {kill.after_layers}")
    pretransfer = kill.in_phase == P.DRAINING and kill.after_layers is not None
    if pretransfer and not s.deployment.scaling.prepare:
        problem(f"{where}.after_layers", "expected deployment.scaling.prepare: true for a kill during the pre-transfer "
                "(without it nothing moves in draining), got prepare: false")
    # which group the rank belongs to when the phase's command reaches it
    joining = kill.in_phase in (P.RESCALING, P.DRAINING) and (kill.in_phase == P.RESCALING or pretransfer) and kill.rank >= size
    if kill.in_phase == P.DRAINING and joining:  # a joining rank dies receiving: the old group stays whole
        bound, gen, survivors = max(size, scale.to), generation + 1, size
    elif kill.in_phase == P.RESUMING:
        bound, gen, survivors = scale.to, generation + 1, scale.to - 1
    elif kill.in_phase == P.RESCALING:
        bound, gen = max(size, scale.to), generation + 1 if joining else generation
        survivors = size if joining else size - 1  # the survivors of the last consistent generation
    else:
        bound, gen, survivors = size, generation, size - 1
    if kill.rank >= bound:
        problem(f"{where}.rank", f"expected a rank of the {kill.in_phase} group of {bound} (0..{bound - 1}), got {kill.rank}")
        return size, generation
    if survivors >= 1:
        survivors = _recovery_size(survivors, size_problem, s.deployment.max_ep_size)  # with fresh workers if need be
    if survivors < 1 or size_problem(survivors):
        problem(where, f"expected a kill the survivors can recover from (auto_recover): {survivors} rank(s) "
                "cannot hold the model")
        return size, generation
    plan[k]["generation"] = gen if kill.generation is None else kill.generation
    plan[k]["size_after"] = survivors
    return survivors, generation + 2


# ---------------------------------------------------------------------------------------------
# loading and error formatting

def _path(loc: tuple[Any, ...]) -> str:
    out = ""
    for part in loc:
        if isinstance(part, int):
            out += f"[{part}]"
        else:
            out += ("." if out else "") + str(part)
    return out


def _model_at(loc: tuple[Any, ...]) -> type[BaseModel] | None:
    """The pydantic model a location points into (for the list of allowed keys)."""
    import typing

    current: Any = Scenario
    for part in loc:
        if isinstance(part, int):
            continue
        if isinstance(current, type) and issubclass(current, BaseModel):
            field = current.model_fields.get(str(part))
            if field is None:
                return None
            current = field.annotation
        else:
            return None
        # unwrap list[...] / Optional / Annotated / discriminated unions we cannot resolve
        for _ in range(4):
            origin = typing.get_origin(current)
            if origin in (list, tuple):
                current = typing.get_args(current)[0]
            elif origin is Annotated:
                current = typing.get_args(current)[0]
            elif origin is Union or str(origin) == "types.UnionType":
                members = [a for a in typing.get_args(current) if a is not type(None)]
                current = members[0] if len(members) == 1 else None
            else:
                break
    return current if isinstance(current, type) and issubclass(current, BaseModel) else None


_TAGS: dict[str, dict[str, type[BaseModel]]] = {
    "timeline": {"scale": ScaleEvent, "kill": KillEvent, "stall": StallEvent, "drop_heartbeats": DropHeartbeatsEvent,
                 "recover": RecoverEvent, "rebalance": RebalanceEvent, "autoscaler": AutoscalerEvent}}


#: the tags pydantic puts in an error's location for a tagged union member (never a key of the file)
FAULT_KINDS = ("kill", "stall", "delay_transfer", "drop_heartbeats", "corrupt_buffer", "torn_commit", "slow_prepare",
               "hang_before_start")
MODEL_KINDS = ("reference", "hf")


def _clean_loc(loc: tuple[Any, ...]) -> tuple[tuple[Any, ...], type[BaseModel] | None]:
    """Drop the union member names pydantic puts in a location; return the member model too."""
    out: list[Any] = []
    member = None
    parts = list(loc)
    i = 0
    while i < len(parts):
        part = parts[i]
        out.append(part)
        if part == "timeline" and i + 2 < len(parts) and isinstance(parts[i + 1], int) and parts[i + 2] in _TAGS["timeline"]:
            out.append(parts[i + 1])
            member = _TAGS["timeline"][parts[i + 2]]
            i += 3
            continue
        if part == "faults" and i + 2 < len(parts) and isinstance(parts[i + 1], int) and isinstance(parts[i + 2], str) \
                and parts[i + 2] in FAULT_KINDS:
            out.append(parts[i + 1])
            i += 3
            continue
        if part == "model" and i + 1 < len(parts) and parts[i + 1] in MODEL_KINDS:  # the model's kind (tag)
            from eplb.models.config import HFModelConfig, ReferenceModelConfig

            kinds: dict[str, type[BaseModel]] = {"reference": ReferenceModelConfig, "hf": HFModelConfig}
            member = kinds[parts[i + 1]]
            i += 2
            continue
        i += 1
    return tuple(out), member


def _describe(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def _message(err: ErrorDetails, loc: tuple[Any, ...], member: type[BaseModel] | None) -> str:
    kind = err["type"]
    ctx = err.get("ctx") or {}
    given = err.get("input")
    if kind == "extra_forbidden":
        owner = _model_at(loc[:-1]) if member is None else member
        allowed = sorted(owner.model_fields) if owner is not None else []
        hint = f" (allowed here: {', '.join(allowed)})" if allowed else ""
        return f"unknown key{hint}"
    if kind == "missing":
        return "expected a value: this key is required"
    if kind == "union_tag_invalid":
        return f"expected action to be one of {ctx.get('expected_tags', '')}, got {_describe(ctx.get('tag'))}"
    if kind == "union_tag_not_found":
        return f"expected a mapping with the key {ctx.get('discriminator', 'action')!s} naming its kind"
    if kind in ("value_error", "assertion_error"):
        text = str(ctx.get("error", err["msg"]))
        return text if text.startswith("expected") else f"{text}"
    simple = {
        "int_parsing": "expected an integer", "int_type": "expected an integer", "int_from_float": "expected an integer",
        "float_parsing": "expected a number", "float_type": "expected a number",
        "bool_parsing": "expected true or false", "bool_type": "expected true or false",
        "string_type": "expected a string", "list_type": "expected a list", "tuple_type": "expected a list",
        "dict_type": "expected a mapping", "model_type": "expected a mapping", "model_attributes_type": "expected a mapping",
        "finite_number": "expected a finite number",
    }
    bounds = {"greater_than_equal": (">=", "ge"), "greater_than": (">", "gt"),
              "less_than_equal": ("<=", "le"), "less_than": ("<", "lt")}
    if kind in simple:
        return f"{simple[kind]}, got {_describe(given)}"
    if kind in bounds:
        op, key = bounds[kind]
        return f"expected a value {op} {ctx.get(key)}, got {_describe(given)}"
    if kind == "too_short":
        return f"expected at least {ctx.get('min_length')} item(s), got {ctx.get('actual_length')}"
    text = err["msg"]
    for prefix in ("Input should be ", "Input should have "):
        if text.startswith(prefix):
            text = "expected " + ("" if prefix == "Input should be " else "to have ") + text[len(prefix):]
            break
    return f"{text}, got {_describe(given)}"


def _problems_from(exc: ValidationError) -> list[ScenarioProblem]:
    problems = []
    seen = set()
    for err in exc.errors():
        loc, member = _clean_loc(tuple(err["loc"]))
        path = _path(loc)
        message = _message(err, loc, member)
        if (path, message) in seen:
            continue
        seen.add((path, message))
        problems.append(ScenarioProblem(path=path, message=message))
    return problems


def parse_scenario(data: Any, source: str = "<scenario>") -> Scenario:
    """Validate a mapping (already parsed YAML) into a :class:`Scenario`; raise :class:`ScenarioError`."""
    if not isinstance(data, dict):
        raise ScenarioError(source, [ScenarioProblem(
            path="", message=f"expected a mapping of keys at the top level, got {type(data).__name__}")])
    moved = old_style_problems(data)
    if moved:  # the old vocabulary: say where each key went rather than "unknown key"
        raise ScenarioError(source, moved)
    try:
        scenario = Scenario.model_validate(data)
    except ValidationError as exc:
        raise ScenarioError(source, _problems_from(exc)) from None
    out_of_bounds = bound_problems(scenario)
    if out_of_bounds:  # before the plan: it walks steps and sizes
        raise ScenarioError(source, out_of_bounds)
    _, problems = _plan(scenario)
    if problems:
        raise ScenarioError(source, problems)
    too_big = memory_problems(scenario.deployment_config(), rename=_scenario_key)
    if too_big:
        raise ScenarioError(source, too_big)
    unfit = host_problems(scenario.deployment_config(), rename=_scenario_key)
    if unfit:
        raise ScenarioError(source, unfit)
    return scenario


def _scenario_key(path: str) -> str:
    """A deployment's key path as a scenario spells it (the memory check reads the deployment it runs)."""
    if path.startswith("trace[") and path.endswith("].trace.tokens_per_step"):
        return path.replace("].trace.", "].")  # the load is the scenario's own trace
    return f"deployment.{path}"


# -- the old vocabulary (before scenarios embedded a deployment) -------------------------------------

#: top-level keys of an old scenario -> where they live now, under ``deployment:``
MOVED_KEYS: dict[str, str] = {
    "initial_ep_size": "ep_size", "max_ep_size": "max_ep_size", "seed": "seed", "pace_s": "step_delay_s",
    "heartbeat_s": "heartbeat_s", "auto_recover": "auto_recover", "timeouts": "timeouts", "launcher": "launcher",
    "max_memory": "max_memory",
}
#: ``model:`` and ``eplb:`` keys of an old scenario -> their DeploymentConfig path (vLLM's names)
MOVED_MODEL_KEYS: dict[str, str] = {
    "layers": "model.num_layers", "experts": "model.num_experts", "groups": "model.num_expert_groups",
    "hidden": "model.hidden_size", "intermediate": "model.intermediate_size", "dtype": "model.dtype",
    "redundant_slots": "eplb.num_redundant_experts",
}
MOVED_EPLB_KEYS: dict[str, str] = {
    "mode": "eplb.use_async", "window": "eplb.window_size", "interval": "eplb.step_interval",
    "enabled": "eplb.enabled", "policy": "eplb.policy", "policy_options": "eplb.policy_options",
    "verify_transfers": "eplb.verify_transfers", "transfer_timeout_s": "eplb.transfer_timeout_s",
}
_NEW_STYLE = "a scenario embeds its deployment under deployment:, with DeploymentConfig's names"


def old_style_problems(data: dict[str, Any]) -> list[ScenarioProblem]:
    """One problem per key of the old vocabulary, naming the key that replaces it."""
    problems = []
    for section, table in (("model", MOVED_MODEL_KEYS), ("eplb", MOVED_EPLB_KEYS)):
        if section not in data:
            continue
        value = data[section]
        known = [k for k in value if isinstance(k, str) and k in table] if isinstance(value, dict) else []
        if not known:
            problems.append(ScenarioProblem(path=section, message=f"moved: write deployment.{section} ({_NEW_STYLE})"))
        for key in known:
            new = f"deployment.{table[key]}"
            if key == "mode":
                new += ": true (mode: async) or false (mode: sync)"
            problems.append(ScenarioProblem(path=f"{section}.{key}", message=f"moved: write {new} ({_NEW_STYLE})"))
    for key, new in MOVED_KEYS.items():
        if key in data:
            problems.append(ScenarioProblem(path=key, message=f"moved: write deployment.{new} ({_NEW_STYLE})"))
    deployment = data.get("deployment")
    if isinstance(deployment, dict) and "trace" in deployment:
        problems.append(ScenarioProblem(path="deployment.trace", message="a scenario's load is its top-level "
                                        "trace: (regimes with at_step); move it there"))
    return problems


def load_scenario(path: str | Path) -> Scenario:
    """Read and validate a scenario file; every error names the file and the key path."""
    path = Path(path)
    source = str(path)
    try:  # size, encoding and YAML limits (elastic.service.preflight) before any parsing work
        data = load_yaml(read_text(path), source)
    except InputError as exc:
        raise ScenarioError(source, exc.problems) from None
    return parse_scenario(data, source)


# a TypeAdapter is cheap to keep for callers that validate single events (the HTTP API, tests)
event_adapter: TypeAdapter[Any] = TypeAdapter(Event)
