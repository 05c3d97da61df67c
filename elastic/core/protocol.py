"""What the coordinator and the worker processes say to each other: frozen, picklable records.

Commands carry a sequence number. Workers agree, with the MAX all-reduce they run at every
step boundary anyway, on the highest sequence number any of them has received, and then all
execute every command up to it, in order, at that same step. So every rank acts on a command
at the same step even though the commands reach their queues at different times.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any, Literal


class WorkerMode(StrEnum):
    """What a worker is doing, as its heartbeats say (a ``str``: compares equal to its value)."""

    STARTING = "starting"  # before its first group: connecting, joining, loading weights
    STANDBY = "standby"  # launched ahead of a scale-up: preparing, then waiting for its Rescale
    DECODING = "decoding"
    DRAINING = "draining"  # decoding; the in-flight layer finishes, no new rebalance starts
    SUPPRESSED = "suppressed"  # decoding; the async EPLB thread is joined
    RESCALING = "rescaling"  # decoding paused: experts move, the group is replaced
    RESUMING = "resuming"  # the new group is formed; EPLB restarts at the Resume
    HALTED = "halted"  # decoding; EPLB stopped because the deployment failed on a healthy group
    BROKEN = "broken"  # a collective failed: no decoding, waiting for a recovery or shutdown


#: the modes in which a rank runs decode steps
DECODING_MODES = frozenset({WorkerMode.DECODING, WorkerMode.DRAINING, WorkerMode.SUPPRESSED,
                            WorkerMode.RESUMING, WorkerMode.HALTED})


# -- commands (coordinator -> every worker) ---------------------------------------------------

@dataclass(frozen=True)
class Command:
    seq: int
    operation_id: str | None = None


@dataclass(frozen=True)
class Drain(Command):
    """Start no new rebalance; let the in-flight layer finish and commit; report when idle."""


@dataclass(frozen=True)
class RescaleSpec:
    """What one rescale means, the same value in its :class:`Prepare`, the :class:`Suppress`
    that announces it and the :class:`Rescale` itself (a worker plans from it alone,
    :func:`elastic.worker.rescale_plan.plan_rescale`).

    ``mapping[old_rank]`` is the new rank, or -1 for a rank that leaves; ``lost`` are old ranks
    whose weights are gone (dead processes): they take no part and their experts are copied
    from a surviving replica or reloaded from the canonical source.
    """

    generation: int
    new_size: int
    mapping: tuple[int, ...]
    lost: tuple[int, ...] = ()
    #: "old": move over the old group first, then replace it (a scale down: the leaving ranks
    #: send); "new": form the new group first and move over it (a scale up, a recovery)
    execute_on: Literal["old", "new"] = "new"
    #: every surviving rank keeps its own requests (a recovery's survivors first roll back a step
    #: the failure cut short); a scale down moves the leaving ranks' requests, KV caches included, to
    #: survivors; a joining rank starts with none. False: every batch is dropped and the coordinator
    #: replays every request from its prompt (no plan sends it any more)
    keep_requests: bool = True

    def __post_init__(self) -> None:
        if not self.mapping:
            raise ValueError("a rescale needs a mapping of at least one old rank")
        if self.new_size < 1:
            raise ValueError(f"a rescale's new_size must be positive, got {self.new_size}")
        kept = sorted(n for n in self.mapping if n >= 0)
        if any(n >= self.new_size for n in kept) or len(set(kept)) != len(kept):
            raise ValueError(f"mapping {self.mapping} names a new rank twice or one outside 0..{self.new_size - 1}")
        if any(not 0 <= r < len(self.mapping) for r in self.lost):
            raise ValueError(f"lost {self.lost} names a rank outside the old group of {len(self.mapping)}")
        if self.execute_on not in ("old", "new"):
            raise ValueError(f"execute_on must be 'old' or 'new', got {self.execute_on!r}")

    @property
    def old_size(self) -> int:
        return len(self.mapping)

    @property
    def survivors(self) -> tuple[int, ...]:
        """The new ranks of the old ranks that stay (lost ranks do not)."""
        return tuple(n for old, n in enumerate(self.mapping) if n >= 0 and old not in self.lost)

    @property
    def source(self) -> int:
        """The lowest surviving rank in the new group: it sends the state the new group starts from."""
        if not self.survivors:
            raise ValueError(f"no rank survives mapping {self.mapping} (lost {self.lost})")
        return min(self.survivors)

    @property
    def joining(self) -> bool:
        """Whether fresh ranks join (the new group has more ranks than survive)."""
        return self.new_size > len(self.survivors)


@dataclass(frozen=True)
class Prepare(Command):
    """The prepare sub-phase of ``draining`` (sent once every rank drained): everything of the
    rescale ``spec`` that can happen while the old group still decodes.

    Every rank of the old group, at the same agreed step, stops its (drained, idle) async EPLB
    thread and computes the new placement and every layer's plan from the same window; the
    ranks of the new group (survivors and the joining ranks standing by) form generation
    ``spec.generation`` as a standby group; then the network part of the plan moves ahead of the
    pause, a layer at a time at agreed steps, paced so decoding keeps its throughput
    (``prestage_share`` of the wall time at most). A joining rank receives into its fresh
    weights; a survivor into spare memory, at most ``prestage_max_bytes`` (layers that do not
    fit move in the pause, as before). A scale up moves over the standby group, a scale down
    over the old group (the leaving ranks send).
    """

    spec: RescaleSpec = field(kw_only=True)
    prestage_max_bytes: int = 0
    prestage_share: float = 0.1
    #: a rank holds the next layer only while the layers left, back to back at its pace so far,
    #: would end within this many seconds of the Prepare (a slow link would otherwise take the
    #: pre-transfer past the draining deadline)
    paced_for_s: float = 30.0


@dataclass(frozen=True)
class Suppress(Command):
    """Stop and join the async EPLB thread; report when it is gone.

    ``announced``: the scale down that follows (None: nothing announced). Every rank computes
    its new placement right then, at the same step and from the same window, while it still
    decodes, so the rescale's pause only moves weights.
    """

    announced: RescaleSpec | None = None


@dataclass(frozen=True)
class Rescale(Command):
    """Move experts as ``spec`` says and replace the process groups with its generation."""

    spec: RescaleSpec = field(kw_only=True)
    #: a Prepare of this very scale succeeded on every rank: switch to the standby group, move
    #: only what was not pre-transferred, copy the pre-transferred slots in place
    prepared: bool = False


@dataclass(frozen=True)
class Resume(Command):
    """Rebuild the EPLB group and restart the async worker on it."""


@dataclass(frozen=True)
class RebalanceNow(Command):
    """Start a rebalance at this step (if none is in flight and not draining)."""


@dataclass(frozen=True)
class Verify(Command):
    """Check every local slot bit-exactly against the canonical weights and report the maps' digest."""


@dataclass(frozen=True)
class ExportPlacement(Command):
    """Report the committed placement and the load window's total (what a placement file holds)."""


@dataclass(frozen=True)
class Probe(Command):
    """Decode the model's fixed probe batch (greedy, a collective) and report a digest of the
    tokens and logits, to compare bitwise with the unsharded single-process model."""


@dataclass(frozen=True)
class StopEPLB(Command):
    """The deployment failed while the group is healthy: stop and join the async EPLB thread
    (an in-flight rebalance is dropped at the same step everywhere) and go on decoding, so a
    recovery finds every rank ready to rescale."""


@dataclass(frozen=True)
class Shutdown(Command):
    """Leave the decode loop and exit."""


# -- serving requests (elastic.worker.batch, elastic.control.requests): commands without a result, tokens as reports ---------

@dataclass(frozen=True)
class RequestSpec:
    """One completion request as every rank decodes it: the prompt's token ids and how to decode.

    Decoding is deterministic on every rank and on every replay: greedy at ``temperature`` 0,
    otherwise a sample drawn with a generator seeded by ``(seed, position)`` (:mod:`elastic.core.sampling`).
    """

    request_id: str
    prompt: tuple[int, ...]
    max_tokens: int
    temperature: float = 0.0
    seed: int = 0
    stop_token_ids: tuple[int, ...] = ()  # with the model's EOS ids unless the request ignores EOS
    logprobs: int | None = None  # None: no log-probabilities; n: the chosen token's and the top n
    # vLLM's sampling parameters, at their neutral values by default (elastic.core.sampling applies them)
    min_tokens: int = 0  # no stop token before this many tokens
    top_p: float = 1.0
    top_k: int = 0  # 0: every token
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: tuple[tuple[int, float], ...] = ()
    #: the rank of the group that holds and decodes it (the coordinator's choice: the least loaded)
    owner: int = 0

    def __post_init__(self) -> None:
        if self.owner < 0:
            raise ValueError(f"request {self.request_id}: owner must be a rank (>= 0), got {self.owner}")

    def in_flight(self, generated: int) -> int:
        """The tokens its rank still has to compute for it after ``generated`` tokens: the prompt
        until it is prefilled, and every token still to generate (the admission's load measure)."""
        return (len(self.prompt) if generated == 0 else 0) + max(0, self.max_tokens - generated)


@dataclass(frozen=True)
class Admit(Command):
    """Requests join the batch at this step (prefilled, then decoded one token per step), each on
    the rank its ``owner`` names (every rank receives the Admit; only the owner holds the request).

    No result: the tokens come back as :class:`TokensOut`. A rank outside a decoding group
    drops it; the coordinator re-admits what the group does not hold (:class:`RequestsHeld`).
    """

    requests: tuple[RequestSpec, ...] = ()


@dataclass(frozen=True)
class Cancel(Command):
    """These requests leave the batch at this step (a client went away, a stop string matched)."""

    request_ids: tuple[str, ...] = ()


#: commands that change the request batch only: no result, and dropped outside a decoding group
SERVING_COMMANDS: tuple[type[Command], ...] = (Admit, Cancel)


# -- reports (worker -> coordinator) ----------------------------------------------------------

@dataclass(frozen=True)
class Report:
    rank: int
    generation: int
    pid: int
    at: float  # the worker's time.time() when sent


@dataclass(frozen=True)
class EPLBFailure:
    """The last failed rebalance on a rank (``layer`` None: it failed before its first layer)."""

    layer: int | None
    error_type: str
    message: str


@dataclass(frozen=True)
class EPLBReport:
    """A rank's EPLB statistics as its heartbeat carries them (a frozen copy of
    :class:`eplb.state.EPLBStats`, made by :func:`elastic.worker.reports.eplb_report`)."""

    rebalances_started: int = 0
    rebalances_finished: int = 0
    rebalances_failed: int = 0
    rebalances_skipped: int = 0  # scheduled rebalances skipped: the window was above min_balancedness
    layers_committed: int = 0
    bytes_moved: int = 0
    watchdog_stalls: int = 0
    restarts: int = 0  # async runs rebuilt after a failure
    last_balancedness: float = 1.0
    balancedness_before: float | None = None  # window balancedness under the old placement
    #: min / p50 / p90 / mean over layers of the last recorded step's balancedness
    layer_balancedness: dict[str, float] | None = None
    last_rebalance_seconds: float | None = None
    last_failure: EPLBFailure | None = None
    placement_seconds: float = 0.0
    #: the decode loop's stall of every sync rebalance so far on this rank, in order
    sync_stall_seconds: tuple[float, ...] = ()
    health: str = "healthy"  # or "degraded": the async EPLB could not be rebuilt, no rebalance commits
    last_error: str | None = None

    def as_dict(self) -> dict[str, Any]:
        """The fields as plain data (the failure as a dict), as snapshots and metrics read them."""
        return _plain(dataclasses.asdict(self))


@dataclass(frozen=True)
class Heartbeat(Report):
    step: int = 0
    step_seconds: float = 0.0
    balancedness: float = 1.0
    tokens: int = 0
    state: WorkerMode = WorkerMode.DECODING
    #: a long preparation's progress: (what, done, total), e.g. ("loading weights", 3, 48)
    progress: tuple[str, int, int] | None = None
    in_flight_layer: int | None = None
    eplb: EPLBReport | None = None  # None: a busy or waiting heartbeat (no decode step's statistics)
    rank_load: float = 0.0
    requests: int = 0  # completion requests in this rank's batch
    # per decode step since the last heartbeat: (step, monotonic end time, wall and CPU seconds
    # the decode thread spent in EPLB control/after_sync/record, 1 if a rebalance was in flight)
    step_timings: tuple[tuple[int, float, float, float, int], ...] = ()
    #: sent by the step watch while a step waits on its peers (elastic.worker.liveness): liveness
    #: only; the coordinator refreshes the worker's last report and reads nothing else from it
    waiting: bool = False
    #: the group is idle and this rank sleeps on its command inbox (no step runs until a command comes)
    idle: bool = False


@dataclass(frozen=True)
class TokenOut:
    """A request's token at ``position`` (0 = the first generated token)."""

    request_id: str
    position: int
    token: int
    logprob: float | None = None
    top_logprobs: tuple[tuple[int, float], ...] = ()
    finish_reason: str | None = None  # "length" (max_tokens) or "stop" (a stop token); None: more follow


@dataclass(frozen=True)
class TokensOut(Report):
    """The tokens one decode step produced for the requests this rank owns (every rank sends its own)."""

    step: int = 0
    tokens: tuple[TokenOut, ...] = ()


@dataclass(frozen=True)
class RequestsHeld(Report):
    """After a rescale, rank 0 of the new group lists the requests the group decodes (gathered from
    every rank): ``(request id, tokens generated, the rank that holds it)``. The coordinator learns
    who holds what, and re-admits those it misses."""

    seq: int = 0  # the Rescale's
    held: tuple[tuple[str, int, int], ...] = ()


# -- results: one type per command, carried by PhaseDone --------------------------------------

@dataclass(frozen=True)
class Result:
    """What a worker reports once it has done what a command asked."""

    def as_dict(self) -> dict[str, Any]:
        """The fields as plain data (tuples as lists), as JSON and the reports show them."""
        return _plain(dataclasses.asdict(self))


def _plain(value: Any) -> Any:
    if isinstance(value, dict):
        return {k: _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    return value


@dataclass(frozen=True)
class Started(Result):
    """The worker joined the first group and decodes (seq 0)."""

    num_physical: int = 0


@dataclass(frozen=True)
class StandbyReady(Result):
    """A rank launched ahead of a scale-up has its weights allocated and registered (a negative seq)."""

    prepare_seconds: float = 0.0


@dataclass(frozen=True)
class DrainDone(Result):
    layers_committed: int = 0
    steps_while_draining: int = 0


@dataclass(frozen=True)
class PrepareDone(Result):
    """A rank's prepare sub-phase: the standby group formed and its part of the pre-transfer done."""

    seconds: float = 0.0  # from the Prepare to the last pre-transferred layer, on this rank
    group_seconds: float = 0.0  # forming the standby group
    placement_seconds: float = 0.0  # the new placement and every layer's plan
    layers: int = 0  # layers pre-transferred (every rank the same)
    layers_total: int = 0  # layers the scale changes anywhere
    bytes_received: int = 0  # by this rank, ahead of the pause
    prestage_bytes: int = 0  # spare memory this rank holds for the pause (a survivor's)
    steps: int = 0  # decode steps this rank ran during its prepare (0 for a joining rank)
    transfer_seconds: float = 0.0  # this rank's time in the pre-transfer's layers
    steady_step_seconds: float = 0.0  # the step time the pacing kept (0 for a joining rank)
    started_at: float = 0.0  # time.monotonic() at the Prepare (same clock as the coordinator's on one host)
    ended_at: float = 0.0


@dataclass(frozen=True)
class SuppressDone(Result):
    join_seconds: float = 0.0
    placement_seconds: float = 0.0  # the announced scale down's placement and plans
    announced: bool = False
    threads: tuple[str, ...] = ()


@dataclass(frozen=True)
class RescaleDone(Result):
    retired: bool = False  # this rank left the group
    bytes_received: int = 0
    seconds: float = 0.0  # the whole rescale on this rank (the pause)
    digest: str | None = None  # of the new maps (None: retired)
    num_physical: int | None = None
    diverged_layers: tuple[int, ...] = ()  # layers whose survivors' maps differed (a torn commit)
    placement_before: list[list[int]] | None = None
    placement_after: list[list[int]] | None = None
    timing: dict[str, Any] = field(default_factory=dict)  # group/placement/transfer/barrier/adopt seconds

    def as_dict(self) -> dict[str, Any]:
        out = super().as_dict()
        return {**out, **out.pop("timing")}


@dataclass(frozen=True)
class ResumeDone(Result):
    seconds: float = 0.0
    threads: tuple[str, ...] = ()


@dataclass(frozen=True)
class RebalanceAck(Result):
    started: bool = False  # a rebalance is under way on every rank (this one, or one already running)


@dataclass(frozen=True)
class VerifyResult(Result):
    mismatched: tuple[tuple[int, int], ...] = ()  # (layer, physical slot) holding the wrong weights
    digest: str = ""
    replica_min: int = 0
    num_physical: int = 0
    size: int = 0
    threads: tuple[str, ...] = ()
    process_groups: int = 0
    rss_bytes: int = 0
    expert_weight_bytes: int = 0
    staging_bytes: int = 0
    communicator: dict[str, Any] = field(default_factory=dict)
    hosts: tuple[str, ...] = ()
    num_nodes: int = 1


@dataclass(frozen=True)
class PlacementExport(Result):
    """The placement every rank routes with and the load window, read at the same agreed step on
    every rank (so every rank's answer is the same; the coordinator checks that)."""

    physical_to_logical: tuple[tuple[int, ...], ...] = ()  # [layers][slots]
    logical_load: tuple[tuple[int, ...], ...] = ()  # [layers][logical experts]: the window's total
    window_steps: int = 0  # steps the window holds
    digest: str = ""  # of the maps (as Verify reports it)
    size: int = 0


@dataclass(frozen=True)
class ProbeDone(Result):
    digest: str = ""  # of the probe's greedy tokens and logits (eplb.models.hf.ProbeResult)
    tokens: tuple[tuple[int, ...], ...] = ()  # the probe's greedy tokens, per sequence
    seconds: float = 0.0


@dataclass(frozen=True)
class EPLBStopped(Result):
    threads: tuple[str, ...] = ()


@dataclass(frozen=True)
class ShutdownDone(Result):
    pass


#: the result type of each command
RESULT_OF: dict[type[Command], type[Result]] = {
    Drain: DrainDone, Prepare: PrepareDone, Suppress: SuppressDone, Rescale: RescaleDone, Resume: ResumeDone,
    RebalanceNow: RebalanceAck, Verify: VerifyResult, ExportPlacement: PlacementExport,
    Probe: ProbeDone, StopEPLB: EPLBStopped, Shutdown: ShutdownDone,
}
_PHASE_OF_RESULT = {result: command.__name__ for command, result in RESULT_OF.items()}
_PHASE_OF_RESULT.update({Started: "Started", StandbyReady: "Standby"})


@dataclass(frozen=True)
class PhaseDone(Report):
    """The worker finished what command ``seq`` asked; ``result`` is that command's result type."""

    seq: int = 0
    operation_id: str | None = None
    step: int = 0
    result: Result = field(default_factory=Result)

    @property
    def phase(self) -> str:
        """The command's class name (``"Started"`` and ``"Standby"`` for the two reports without one)."""
        return _PHASE_OF_RESULT.get(type(self.result), "")

    @property
    def detail(self) -> dict[str, Any]:
        """The result as a plain dict (reports, benchmarks)."""
        return self.result.as_dict()


@dataclass(frozen=True)
class WorkerEvent(Report):
    """Something the control plane may want to show: a rebalance started, a layer committed..."""

    step: int = 0
    kind: str = ""
    data: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class WorkerError(Report):
    """A failure in the worker, as data: where it happened and why."""

    step: int = 0
    where: str = ""
    error_type: str = ""
    message: str = ""
    traceback: str = ""
    seq: int = 0  # the last command the worker had taken up when it failed
