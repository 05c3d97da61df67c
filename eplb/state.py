"""Per-rank EPLB state: the load window, balancedness, sync rearrange and the async worker.

The decode loop owns an :class:`EPLBState` and calls it at every step boundary:

1. ``record(physical_counts)`` with the step's global tokens per physical slot
   (``[layers, P]``, already summed over ranks by the decode loop's one collective).
2. ``control()`` returns this rank's small control vector; the decode loop MAX-reduces it with
   the other ranks' (together with its own control words, in one collective) and hands the
   result to ``after_sync(reduced, step)``, which commits a layer when every rank's buffer is
   ready, tells the worker whether to go on, and starts a new rebalance every
   ``step_interval`` steps. Every rank sees the same reduced vector at the same step, so every
   rank makes the same decision: the maps switch per layer at the same step everywhere.

The async worker (:class:`AsyncEPLBWorker`) is a named thread that talks to the decode loop
through two queues of frozen records, never through shared flags: it receives a job, computes
the placement, fills the staging buffer for one layer over the dedicated EPLB group, posts
:class:`LayerReady`, and blocks until the decode loop answers :class:`Proceed` or
:class:`Finish`. Any exception in the thread comes back as a :class:`WorkerFailed` record.
"""

from __future__ import annotations

import dataclasses
import hashlib
import logging
import queue
import threading
import time
import traceback
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from datetime import timedelta
from enum import StrEnum
from typing import Any

import torch

from eplb.algorithm import compute_placement
from eplb.config import EPLBConfig
from eplb.estimate import smoothed_load, smoothed_noise
from eplb.placement import Placement, align_slots
from eplb.plan import plan_layer
from eplb.transfer import TransferStats, commit_layer, execute_layer

log = logging.getLogger("eplb")

__all__ = [
    "AsyncEPLBWorker", "AsyncRun", "EPLBHealth", "EPLBState", "EPLBStats", "EPLBUnavailable", "Finish",
    "HandshakeMismatch", "LayerReady", "LoadWindow", "Proceed", "RebalanceFinished", "RebalanceJob",
    "StagedBatchesDiffer", "StagedWeightsCorrupt", "TransferHooks", "WorkerFailed", "balancedness_of", "balancedness_summary",
    "batch_fingerprint", "layer_balancedness",
]


# --------------------------------------------------------------------------------------------
# load window

class LoadWindow:
    """The last ``size`` steps of global logical load, ``[size, layers, L]`` int64, and the
    estimate of the next window's load that the rebalances so far fitted (``estimate``).

    Logical load does not depend on which rank holds what, so the window and the estimate carry
    over a rescale unchanged; :meth:`state` / :meth:`from_state` move them to ranks that join.
    """

    def __init__(self, size: int, num_layers: int, num_logical: int):
        self.buffer = torch.zeros(size, num_layers, num_logical, dtype=torch.int64)
        self.filled = 0
        self.position = 0
        #: ``[layers, L]`` float64: the last :meth:`fold`'s result (None: no rebalance yet)
        self.estimate: torch.Tensor | None = None

    def fold(self, weight: float, total: torch.Tensor | None = None) -> torch.Tensor:
        """The load a rebalance fits: the window's total folded into the running estimate
        (:func:`eplb.estimate.smoothed_load` with the last window's ``weight``), which it
        updates. ``weight`` 1: the total itself (int64, as vLLM fits), and the estimate restarts.
        ``total``: :meth:`total`, when the caller has it. Every rank folds the same agreed total at
        the same step, so the estimates agree."""
        total = self.total() if total is None else total
        if weight >= 1.0:
            self.estimate = None
            return total
        self.estimate = smoothed_load(self.estimate, total, weight)
        return self.estimate

    def record(self, logical_load: torch.Tensor) -> None:
        self.buffer[self.position].copy_(logical_load)
        self.position = (self.position + 1) % self.buffer.shape[0]
        self.filled = min(self.filled + 1, self.buffer.shape[0])

    def total(self) -> torch.Tensor:
        return self.buffer.sum(dim=0)

    def state(self) -> dict[str, Any]:
        estimate = None if self.estimate is None else self.estimate.clone()
        return {"buffer": self.buffer.clone(), "filled": self.filled, "position": self.position, "estimate": estimate}

    @classmethod
    def from_state(cls, state: dict[str, Any]) -> LoadWindow:
        size, layers, logical = state["buffer"].shape
        window = cls(size, layers, logical)
        window.buffer.copy_(state["buffer"])
        window.filled, window.position = state["filled"], state["position"]
        estimate = state.get("estimate")  # absent in a state from before the estimate
        window.estimate = None if estimate is None else estimate.clone()
        return window


def layer_balancedness(physical_counts: torch.Tensor, num_ranks: int) -> torch.Tensor:
    """Per layer, mean rank load / max rank load (``[layers]`` float64; 1.0 for a layer with no tokens)."""
    rank_load = physical_counts.double().view(physical_counts.shape[0], num_ranks, -1).sum(dim=2)
    peak = rank_load.max(dim=1).values
    return torch.where(peak > 0, rank_load.mean(dim=1) / peak.clamp(min=1e-300), torch.ones_like(peak))


def balancedness_of(physical_counts: torch.Tensor, num_ranks: int) -> float:
    """Mean over layers of (mean rank load / max rank load); 1.0 for a layer with no tokens."""
    return float(layer_balancedness(physical_counts, num_ranks).mean())


#: the statistics of the per-layer balancedness distribution that the heartbeat carries
BALANCEDNESS_STATS = ("min", "p50", "p90", "mean")


def balancedness_summary(per_layer: torch.Tensor) -> dict[str, float]:
    """``min``, ``p50``, ``p90`` and ``mean`` of a per-layer balancedness vector (nearest-rank
    percentiles: each is one layer's value). Empty: every statistic is 1.0."""
    if per_layer.numel() == 0:
        return dict.fromkeys(BALANCEDNESS_STATS, 1.0)
    ordered = per_layer.double().sort().values.tolist()
    n = len(ordered)

    def nearest_rank(q: float) -> float:
        return ordered[max(0, min(n - 1, -(-int(q * 100) * n // 100) - 1))]

    return {"min": ordered[0], "p50": nearest_rank(0.5), "p90": nearest_rank(0.9), "mean": sum(ordered) / n}


def estimate_options(config: EPLBConfig) -> dict[str, Any]:
    """Options for a policy fitting :meth:`LoadWindow.fold`'s estimate: with ``load_smoothing``
    below 1 and a policy that judges noise (``migration_aware``), ``noise`` = the next window's
    variance against the estimate per unit of load (:func:`eplb.estimate.smoothed_noise`), unless
    ``policy_options`` set it. The estimate is float64, which the policy's ``noise="auto"`` would
    read as noiseless; the last window alone (1.0) stays int64 token counts (noise 2)."""
    from eplb.algorithm import policy_option_names

    names = policy_option_names(config.policy)
    if config.load_smoothing >= 1.0 or "noise" in config.policy_options or (names is not None and "noise" not in names):
        return {}
    return {"noise": smoothed_noise(config.load_smoothing)}


def placement_for(config: EPLBConfig, load: torch.Tensor, num_physical: int, num_ranks: int,
                  previous: Placement, *, held: torch.Tensor | None = None,
                  held_mapping: Sequence[int] | None = None, **extra: Any) -> Placement:
    """The configured policy's placement: ``policy_options`` carry ``num_groups``/``num_nodes``
    (the hierarchy) beside the policy's own options; ``extra`` adds or overrides options.
    A rebalance fitting :meth:`LoadWindow.fold`'s estimate passes :func:`estimate_options` in ``extra``.

    The result is slot-aligned (:func:`~eplb.placement.align_slots`) to what the ranks hold:
    ``held`` (``[layers, P_old]``, default ``previous``'s maps) under ``held_mapping`` (old rank
    -> new rank or -1, default the identity), so no rank copies an expert it already has just
    because the policy packed its slots in another order.
    """
    opts = {**config.policy_options, **extra}
    new = compute_placement(load, num_physical, num_ranks, num_groups=opts.pop("num_groups", 1),
                            num_nodes=opts.pop("num_nodes", 1), policy=config.policy, previous=previous, **opts)
    held = previous.physical_to_logical if held is None else held
    per_rank = num_physical // num_ranks
    if held.shape[1] % per_rank:
        return new  # slots per rank changed: nothing to keep in place
    aligned = align_slots(new.physical_to_logical, held, per_rank,
                          None if held_mapping is None else list(held_mapping))
    if torch.equal(aligned, new.physical_to_logical):
        return new
    return Placement.from_physical_to_logical(aligned, new.num_logical, new.logical_to_physical.shape[2])


# --------------------------------------------------------------------------------------------
# records exchanged with the worker thread (frozen: a record never changes after it is sent).
# Every handshake record names its rebalance and the group generation it belongs to, so an
# answer meant for another rebalance or another generation is a loud error, never a step ahead.

@dataclass(frozen=True)
class RebalanceJob:
    rebalance_id: int
    load: torch.Tensor  # [layers, L] the load to fit (LoadWindow.fold), identical on every rank
    placement: Placement  # the placement being served when the job started
    num_ranks: int
    rank: int
    generation: int = 0


@dataclass(frozen=True)
class Proceed:
    """Decode loop -> worker: the last layer is committed everywhere, transfer the next one."""

    rebalance_id: int
    generation: int


@dataclass(frozen=True)
class Finish:
    """Decode loop -> worker: commit done, start no further layer (drain, failure or last layer)."""

    rebalance_id: int
    generation: int


@dataclass(frozen=True)
class Shutdown:
    """Decode loop -> worker: leave the thread."""


@dataclass(frozen=True)
class PlacementComputed:
    rebalance_id: int
    layers: tuple[int, ...]  # layers whose row changes, in transfer order
    seconds: float


@dataclass(frozen=True)
class LayerReady:
    rebalance_id: int
    layer: int
    new_row: torch.Tensor  # [P]
    rank_plan: Any
    stats: TransferStats
    #: the last layer of its batch (``layers_per_step``): the worker now waits for the answer
    batch_end: bool = True
    #: which staging buffer of the run holds it (its position in the batch)
    slot: int = 0


@dataclass(frozen=True)
class RebalanceFinished:
    rebalance_id: int
    layers_transferred: int
    drained: bool  # stopped early because the decode loop asked it to


@dataclass(frozen=True)
class WorkerFailed:
    rebalance_id: int
    layer: int | None
    error_type: str
    message: str
    traceback: str


class HandshakeMismatch(RuntimeError):
    """An answer of the decode loop names another rebalance or generation than the one in hand."""


# --------------------------------------------------------------------------------------------
# the async worker thread

@dataclass(frozen=True)
class TransferHooks:
    """Optional callbacks around each async layer transfer.

    ``before_layer(layer)`` runs before the transfer (fault injection: a slow link);
    ``after_fill(layer, rank_plan, staging)`` runs once the staging buffer is filled (fault
    injection: corruption); ``verify_staged(layer, new_row, rank_plan, staging)`` returns the
    local slots whose staged weights are wrong, and a non-empty answer fails the layer, so
    a corrupted buffer is never committed.
    """

    before_layer: Callable[[int], None] | None = None
    after_fill: Callable[[int, Any, list[torch.Tensor]], None] | None = None
    verify_staged: Callable[[int, torch.Tensor, Any, list[torch.Tensor]], list[int]] | None = None


class StagedWeightsCorrupt(RuntimeError):
    """A received layer does not hold what the plan says: it is refused, never committed."""


class AsyncEPLBWorker:
    """A background thread per rank that computes placements and fills the staging buffer.

    Lifecycle, driven by the decode loop / control plane: :meth:`start`, :meth:`submit` a job,
    answer each :class:`LayerReady` with :meth:`proceed` or :meth:`finish`, :meth:`stop`
    (join with a timeout). One thread serves one group generation (``generation``).
    """

    def __init__(self, *, config: EPLBConfig, weights: Callable[[], list[list[torch.Tensor]]],
                 staging: list[torch.Tensor], group: Any, rank: int, name: str = "eplb-async",
                 hooks: TransferHooks | None = None, communicator: Any = None, generation: int = 0,
                 extra_staging: Sequence[list[torch.Tensor]] = (), hosts: Sequence[str] | None = None):
        self.config = config
        #: the host of every rank of ``group`` (the same list on every rank): plans prefer same-host senders
        self.hosts = tuple(hosts) if hosts else None
        self.hooks = hooks or TransferHooks()
        self.communicator = communicator  # eplb.communicator.Communicator; None: the group's backend
        self._weights = weights
        self.staging = staging
        #: one staging buffer per layer of a batch: ``layers_per_step`` layers are staged, then
        #: committed together at one agreed step
        self.slots: list[list[torch.Tensor]] = [staging, *extra_staging]
        self.group = group
        self.rank = rank
        self.generation = generation
        self._last_job = 0  # the newest rebalance id this thread took up
        self._finished_early: set[int] = set()  # rebalances the decode loop ended before their job arrived
        self._inbox: queue.Queue[object] = queue.Queue()
        self.events: queue.Queue[object] = queue.Queue()
        self._thread = threading.Thread(target=self._run, name=f"{name}-rank{rank}-g{generation}", daemon=True)
        self.last_progress = time.monotonic()

    # -- decode-loop side --------------------------------------------------------------------
    def start(self) -> None:
        self._thread.start()

    @property
    def alive(self) -> bool:
        return self._thread.is_alive()

    def submit(self, job: RebalanceJob) -> None:
        self._inbox.put(job)

    def proceed(self, rebalance_id: int) -> None:
        self._inbox.put(Proceed(rebalance_id, self.generation))

    def finish(self, rebalance_id: int) -> None:
        self._inbox.put(Finish(rebalance_id, self.generation))

    def stop(self, timeout: float) -> bool:
        """Ask the thread to leave and join it; True when it is gone within ``timeout``."""
        self._inbox.put(Shutdown())
        self._thread.join(timeout)
        return not self._thread.is_alive()

    # -- the thread ------------------------------------------------------------------------
    def _post(self, event: object) -> None:
        self.last_progress = time.monotonic()
        self.events.put(event)

    def _mismatch(self, answer: Proceed | Finish, expected: int | None) -> HandshakeMismatch:
        want = "no answer (no rebalance in hand)" if expected is None else f"rebalance {expected}"
        return HandshakeMismatch(f"{type(answer).__name__} for rebalance {answer.rebalance_id} of generation "
                                 f"{answer.generation} reached the thread of generation {self.generation}, "
                                 f"which expected {want}")

    def _run(self) -> None:
        while True:
            message = self._inbox.get()
            if isinstance(message, Shutdown):
                return
            if isinstance(message, RebalanceJob):
                self._last_job = message.rebalance_id
                if message.rebalance_id in self._finished_early:
                    # the decode loop ended this rebalance before the thread took it up: nothing to do
                    self._finished_early.discard(message.rebalance_id)
                    self._post(RebalanceFinished(message.rebalance_id, 0, drained=True))
                    continue
                if not self._rebalance(message):
                    return
            elif isinstance(message, (Proceed, Finish)):
                # an answer to a rebalance that already ended here (it failed, and the decode loop
                # aborted it everywhere) needs none; a Finish for one not taken up yet ends it before
                # it starts; anything else (another generation's answer, a Proceed for a layer this
                # thread never staged) is a protocol break
                if message.generation == self.generation and message.rebalance_id > self._last_job \
                        and isinstance(message, Finish):
                    log.warning("rebalance %d finished before the thread took it up", message.rebalance_id)
                    self._finished_early.add(message.rebalance_id)
                elif message.generation != self.generation or message.rebalance_id > self._last_job:
                    exc = self._mismatch(message, None)
                    log.error("%s", exc)
                    self._post(WorkerFailed(message.rebalance_id, None, type(exc).__name__, str(exc), ""))

    def _rebalance(self, job: RebalanceJob) -> bool:
        """Run one job; False when asked to shut down in the middle."""
        layer: int | None = None
        done = 0
        try:
            if job.generation != self.generation:
                raise HandshakeMismatch(f"rebalance {job.rebalance_id} of generation {job.generation} reached the "
                                        f"thread of generation {self.generation}")
            started = time.perf_counter()
            new = placement_for(self.config, job.load, job.placement.num_physical, job.num_ranks, job.placement,
                                **estimate_options(self.config))
            changed = tuple(
                int(i) for i in (new.physical_to_logical != job.placement.physical_to_logical).any(dim=1).nonzero().flatten()
            )
            self._post(PlacementComputed(job.rebalance_id, changed, time.perf_counter() - started))
            slots = job.placement.slots_per_rank(job.num_ranks)
            identity = list(range(job.num_ranks))
            timeout = timedelta(seconds=self.config.transfer_timeout_s)
            # batches of len(self.slots) layers, cut the same way on every rank (the changed layers are)
            per_batch = len(self.slots)
            for first in range(0, len(changed), per_batch):
                batch = changed[first : first + per_batch]
                for position, layer in enumerate(batch):
                    staging = self.slots[position]
                    old_row = job.placement.physical_to_logical[layer]
                    new_row = new.physical_to_logical[layer]
                    plan = plan_layer(old_row, new_row, slots, slots, identity, identity, hosts=self.hosts)
                    rank_plan = plan.for_rank(self.rank)
                    if self.hooks.before_layer is not None:
                        self.hooks.before_layer(layer)
                    stats = execute_layer(
                        plan, self.rank, self._weights()[layer], staging, group=self.group,
                        timeout=timeout, max_ops_per_batch=self.config.max_ops_per_batch, layer=layer,
                        communicator=self.communicator, migration_batching=self.config.enable_migration_batching,
                    )
                    if self.hooks.after_fill is not None:
                        self.hooks.after_fill(layer, rank_plan, staging)
                    if self.hooks.verify_staged is not None:
                        wrong = self.hooks.verify_staged(layer, new_row, rank_plan, staging)
                        if wrong:
                            raise StagedWeightsCorrupt(f"layer {layer}: staged slots {wrong} do not hold their experts")
                    self._post(LayerReady(job.rebalance_id, layer, new_row.clone(), rank_plan, stats,
                                          batch_end=position == len(batch) - 1, slot=position))
                answer = self._inbox.get()  # the decode loop answers after the commit step
                done += len(batch)
                if isinstance(answer, Shutdown):
                    return False
                if not isinstance(answer, (Proceed, Finish)) or answer.rebalance_id != job.rebalance_id \
                        or answer.generation != self.generation:
                    raise self._mismatch(answer, job.rebalance_id) if isinstance(answer, (Proceed, Finish)) \
                        else HandshakeMismatch(f"{type(answer).__name__} arrived while layer {layer} waited for its answer")
                if isinstance(answer, Finish):
                    self._post(RebalanceFinished(job.rebalance_id, done, drained=batch[-1] != changed[-1]))
                    return True
            self._post(RebalanceFinished(job.rebalance_id, done, drained=False))
        except Exception as exc:  # noqa: BLE001 - every failure goes back as data
            self._post(WorkerFailed(job.rebalance_id, layer, type(exc).__name__, str(exc), traceback.format_exc()))
        return True


# --------------------------------------------------------------------------------------------
# the decode loop's side

class EPLBHealth(StrEnum):
    HEALTHY = "healthy"
    DEGRADED = "degraded"  # the async EPLB could not be rebuilt after a failure: no rebalance commits


@dataclass
class EPLBStats:
    rebalances_started: int = 0
    rebalances_finished: int = 0
    rebalances_failed: int = 0
    rebalances_skipped: int = 0  # scheduled rebalances skipped: the window was above min_balancedness
    layers_committed: int = 0
    bytes_moved: int = 0
    watchdog_stalls: int = 0
    restarts: int = 0  # async runs rebuilt (fresh EPLB group, staging and thread) after a failure
    last_balancedness: float = 1.0
    balancedness_before: float | None = None  # window balancedness under the old placement
    #: min / p50 / p90 / mean over layers of the last recorded step's balancedness
    layer_balancedness: dict[str, float] | None = None
    last_rebalance_seconds: float | None = None  # the last finished rebalance, from its start on this rank
    last_failure: WorkerFailed | None = None
    placement_seconds: float = 0.0
    sync_stall_seconds: list[float] = field(default_factory=list)
    health: EPLBHealth = EPLBHealth.HEALTHY
    last_error: str | None = None

    def as_dict(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        d["health"] = self.health.value
        d["last_failure"] = None if self.last_failure is None else {
            "layer": self.last_failure.layer, "error_type": self.last_failure.error_type, "message": self.last_failure.message}
        return d


# control vector indices (MAX-reduced over ranks)
NOT_READY = 0  # 1 when this rank has no staged layer waiting (or none in flight)
FAILED = 1  # 1 when this rank's worker reported a failure
BUSY = 2  # 1 while this rank has a rebalance in flight
STAGED = 3  # the fingerprint of the staged batch (its layers and new rows; 0: none): MAX is the highest
STAGED_NEG = 4  # minus that fingerprint: MAX is minus the lowest, so the ranks agree iff both say one value
CONTROL_WORDS = 5


def batch_fingerprint(staged: Sequence[LayerReady]) -> int:
    """What a staged batch commits (each layer and its new row), as a positive int64 that every
    rank staging the same batch computes alike."""
    digest = hashlib.blake2b(digest_size=7)
    for ready in staged:
        digest.update(ready.layer.to_bytes(4, "little"))
        digest.update(ready.new_row.to(torch.int64).contiguous().numpy().tobytes())
    return int.from_bytes(digest.digest(), "little") + 1


class StagedBatchesDiffer(RuntimeError):
    """Every rank staged a batch, but not the same one: committing would leave the ranks on
    different maps and make their transfers read and write the wrong experts."""


class EPLBUnavailable(RuntimeError):
    """The async EPLB failed and could not be rebuilt: the deployment must leave ``running``."""


@dataclass
class AsyncRun:
    """Everything the async EPLB holds for one group generation: the thread, its staging buffer,
    the handshake in hand and the pacing countdown. Built fresh by :meth:`EPLBState.start_worker`
    and dropped whole by :meth:`EPLBState.stop_worker`; only the load window, the placement and
    the statistics outlive it. So nothing of one generation's handshake can reach the next."""

    generation: int
    worker: AsyncEPLBWorker
    staging: list[torch.Tensor]
    in_flight: int | None = None  # rebalance id being transferred, if any
    ready: LayerReady | None = None  # the last layer of a complete batch: the batch can commit
    fingerprint: int = 0  # batch_fingerprint of the complete batch (0: none staged)
    staged: list[LayerReady] = field(default_factory=list)  # the batch's layers staged so far
    slots: list[list[torch.Tensor]] = field(default_factory=list)  # staging buffer per batch position
    in_flight_layer: int | None = None
    release_in: int = 0  # pacing: agreed steps until the next layer's transfer starts
    failure: WorkerFailed | None = None


class EPLBState:
    """The EPLB of one rank, driven once per step by the decode loop."""

    def __init__(self, config: EPLBConfig, model: Any, placement: Placement, rank: int, num_ranks: int,
                 *, group: Any = None, window: LoadWindow | None = None,
                 on_event: Callable[[str, dict[str, Any]], None] | None = None,
                 hooks: TransferHooks | None = None, communicator: Any = None):
        self.config = config
        self.hooks = hooks
        self.model = model
        self.placement = placement
        self.rank = rank
        self.num_ranks = num_ranks
        self.group = group
        #: the host of every rank of the group (``start_worker(hosts=...)``), identical on every rank;
        #: None: unknown (plans then ignore hosts)
        self.hosts: tuple[str, ...] | None = None
        self.window = window or LoadWindow(config.window_size, placement.num_layers, placement.num_logical)
        self.stats = EPLBStats()
        self.on_event = on_event or (lambda kind, data: None)
        #: moves the weights (eplb.communicator); None: the group's own backend (gloo / NCCL)
        self.communicator: Any = communicator
        #: ``rebuild_group()`` -> a fresh EPLB group (a collective over the decode group: every rank
        #: calls it at the same agreed step). Set by the owner; None: a failed run is not rebuilt.
        self.rebuild_group: Callable[[], Any] | None = None
        self.run: AsyncRun | None = None
        self._sync_staging: list[torch.Tensor] = []
        self.draining = False
        self.all_idle = True  # agreed at the last step boundary: no rank has a rebalance in flight
        self._next_id = 0
        self.steps_since_rebalance = 0
        self._rebalance_started = 0.0  # time.monotonic() of the last rebalance_now that started one

    # -- what the owner reads ----------------------------------------------------------------
    @property
    def running(self) -> bool:
        """An async thread exists (stop it before the group it uses is replaced)."""
        return self.run is not None

    @property
    def in_flight(self) -> int | None:
        return None if self.run is None else self.run.in_flight

    @property
    def in_flight_layer(self) -> int | None:
        run = self.run  # one read: another thread (a heartbeat) may read this while stop_worker clears it
        return None if run is None else run.in_flight_layer

    @property
    def staging(self) -> list[torch.Tensor]:
        return self.run.staging if self.run is not None else self._sync_staging

    # -- lifecycle (driven by the control plane) -----------------------------------------------
    def start_worker(self, group: Any = None, generation: int = 0, *, config: EPLBConfig | None = None,
                     rebuild_group: Callable[[], Any] | None = None, hosts: Sequence[str] | None = None) -> None:
        """Start a fresh async run on ``group`` (the dedicated EPLB group) for ``generation``;
        ``config`` (this generation's: its node count), ``rebuild_group`` and ``hosts`` (the host
        of every rank of the group, the same list on every rank: plans prefer same-host senders)
        replace the old ones."""
        if config is not None:
            self.config = config
        if hosts is not None:
            self.hosts = tuple(hosts) or None
        if rebuild_group is not None:
            self.rebuild_group = rebuild_group
        if not (self.config.enabled and self.config.use_async):
            self.group = group if group is not None else self.group  # sync rebalances move over it
            return
        if self.run is not None:
            raise RuntimeError("the async EPLB worker is already running")
        self.group = group if group is not None else self.group
        weights = self.model.expert_weights()
        # one layer of local experts per layer of a batch, allocated once per run, never per layer
        slots = [[torch.empty_like(t) for t in weights[0]]
                 for _ in range(min(self.config.layers_per_step, max(1, len(weights))))]
        staging = [t for slot in slots for t in slot]
        if self.communicator is not None:
            self.communicator.add_buffer(staging)  # NIXL reads land here: registered once per start
        worker = AsyncEPLBWorker(config=self.config, weights=self.model.expert_weights, staging=slots[0],
                                 group=self.group, rank=self.rank, hooks=self.hooks,
                                 communicator=self.communicator, generation=generation, extra_staging=slots[1:],
                                 hosts=self.hosts)
        self.run = AsyncRun(generation, worker, staging, slots=slots)
        self.all_idle = True
        worker.start()

    def begin_drain(self) -> None:
        """No new rebalance starts; the in-flight layer (if any) still completes and commits."""
        self.draining = True

    def stop_worker(self, timeout: float) -> bool:
        """Join the async thread. True when it is gone within ``timeout``; the whole run (staging,
        handshake, pacing countdown) goes with it. A rebalance still in flight (the group broke
        before a drain) dies with its thread: its uncommitted layers are dropped, the committed
        ones stay."""
        run = self.run
        if run is None:
            return True
        if not run.worker.stop(timeout):
            return False
        if self.communicator is not None:
            self.communicator.remove_buffer(run.staging)  # deregistered before it is freed
        self.run = None
        self.all_idle = True
        return True

    def resume(self) -> None:
        self.draining = False

    def carry_over(self, window: LoadWindow, stats: EPLBStats | None = None, steps_since_rebalance: int | None = None) -> None:
        """A rescale carried the load window (and, to a joining rank, the statistics and the
        rebalance countdown) over from the lowest surviving rank."""
        self.window = window
        if stats is not None:
            self.stats = stats
        if steps_since_rebalance is not None:
            self.steps_since_rebalance = steps_since_rebalance

    def release_group(self) -> None:
        """The group this EPLB moved over is being destroyed: forget it (and how to rebuild it)."""
        self.group = None
        self.rebuild_group = None

    def adopt(self, placement: Placement, rank: int, num_ranks: int) -> None:
        """A rescale installed ``placement`` for this rank of a group of ``num_ranks``: the EPLB
        stays off (draining) until the owner restarts it on the new group."""
        if self.run is not None:
            raise RuntimeError("adopt while the async EPLB worker runs: stop it first")
        self.placement, self.rank, self.num_ranks = placement, rank, num_ranks
        self.group = None
        self.hosts = None  # the old group's: the owner names the new group's at start_worker
        self.draining = True

    # -- per step ------------------------------------------------------------------------------
    def record(self, physical_counts: torch.Tensor) -> float:
        """Record one step's global tokens per physical slot; returns the step's balancedness."""
        logical = torch.zeros(self.placement.num_layers, self.placement.num_logical, dtype=torch.int64)
        logical.scatter_add_(1, self.placement.physical_to_logical, physical_counts.long())
        self.window.record(logical)
        per_layer = layer_balancedness(physical_counts, self.num_ranks)
        summary = balancedness_summary(per_layer)
        self.stats.layer_balancedness = summary
        self.stats.last_balancedness = summary["mean"]
        return self.stats.last_balancedness

    def _drain_events(self, run: AsyncRun) -> None:
        while True:
            try:
                event = run.worker.events.get_nowait()
            except queue.Empty:
                return
            if isinstance(event, WorkerFailed) and event.error_type == HandshakeMismatch.__name__:
                run.failure = event  # a protocol break is never a late record: always acted on
                self.stats.last_failure = event
                continue
            if getattr(event, "rebalance_id", None) != run.in_flight:
                continue  # a late record of a rebalance already aborted
            if isinstance(event, LayerReady):
                run.staged.append(event)
                if event.batch_end:
                    run.ready = event  # every layer of the batch is staged here
                    run.fingerprint = batch_fingerprint(run.staged)
            elif isinstance(event, PlacementComputed):
                self.stats.placement_seconds = event.seconds
                if event.layers:
                    run.in_flight_layer = event.layers[0]
            elif isinstance(event, RebalanceFinished):
                run.in_flight = None
                run.in_flight_layer = None
                self.stats.rebalances_finished += 1
                seconds = time.monotonic() - self._rebalance_started
                self.stats.last_rebalance_seconds = seconds
                self.on_event("rebalance_finished", {"id": event.rebalance_id, "mode": "async",
                                                     "layers": event.layers_transferred, "drained": event.drained,
                                                     "seconds": seconds})
            elif isinstance(event, WorkerFailed):
                self.stats.last_failure = event
                run.failure = event

    def control(self) -> list[int]:
        """This rank's control words, to be MAX-reduced with every other rank's."""
        words = [0] * CONTROL_WORDS
        run = self.run
        if run is None:  # suppressed or sync: nothing staged, nothing failed, nothing in flight
            words[NOT_READY] = 1
            return words
        self._drain_events(run)
        words[NOT_READY] = 0 if run.ready is not None else 1
        words[FAILED] = 1 if run.failure is not None else 0
        words[BUSY] = 1 if run.in_flight is not None else 0
        if run.ready is not None:
            words[STAGED], words[STAGED_NEG] = run.fingerprint, -run.fingerprint
        if run.in_flight is not None and run.ready is None:
            if time.monotonic() - run.worker.last_progress > self.config.watchdog_s:
                self.stats.watchdog_stalls += 1
                run.worker.last_progress = time.monotonic()  # count each stall period once
                self.on_event("watchdog_stall", {"rebalance": run.in_flight, "layer": run.in_flight_layer})
        return words

    def after_sync(self, reduced: list[int]) -> None:
        """Act on the reduced control words: identical input on every rank, identical decisions.

        ``BUSY`` is agreed, not local: a rank whose worker already reported the end of a
        rebalance still waits until every rank's has, so no rank starts the next one alone.
        """
        # a rebalance that a command started at this very step is in flight on every rank (commands
        # run at agreed steps) but is not in the agreed BUSY yet: it counts as busy, so a Drain in
        # the same step waits for it instead of reporting drained with a transfer in flight
        self.all_idle = not reduced[BUSY] and self.in_flight is None
        if not self.config.enabled:
            return
        run = self.run
        if reduced[FAILED]:
            self._abort_rebalance()
            self._restart_after_failure()
        elif run is not None and run.release_in > 0:
            self._release_worker(run)  # pacing: the last commit's worker is still held back
        elif self._all_staged(reduced) and not self._staged_alike(reduced):
            # the ranks' rebalances diverged (they must never: every decision is made from agreed
            # words and identical state): refuse the batch everywhere, loudly, rather than commit
            # other layers or rows on each rank
            assert run is not None and run.ready is not None
            exc = StagedBatchesDiffer(f"rebalance {run.in_flight}: the ranks staged different batches (this rank: "
                                      f"layers {[r.layer for r in run.staged]}); none is committed")
            log.error("%s", exc)
            run.failure = WorkerFailed(run.in_flight or 0, run.ready.layer, type(exc).__name__, str(exc), "")
            self.stats.last_failure = run.failure
            self._abort_rebalance()
            self._restart_after_failure()
        elif self.commits_now(reduced):
            assert run is not None and run.ready is not None
            self._commit(run)
        self.steps_since_rebalance += 1
        if self.steps_since_rebalance >= self.config.step_interval and not self.draining and self.all_idle:
            self.rebalance_now(scheduled=True)

    def commits_now(self, reduced: list[int]) -> bool:
        """Whether :meth:`after_sync` with these reduced words commits the in-flight layer: every
        rank has staged its batch, and the same one (:func:`batch_fingerprint`)."""
        return self._all_staged(reduced) and self._staged_alike(reduced)

    def _all_staged(self, reduced: list[int]) -> bool:
        run = self.run
        return (self.config.enabled and run is not None and not reduced[FAILED] and run.release_in <= 0
                and run.in_flight is not None and not reduced[NOT_READY])

    @staticmethod
    def _staged_alike(reduced: list[int]) -> bool:
        return reduced[STAGED] == -reduced[STAGED_NEG]

    @property
    def drained(self) -> bool:
        """Every rank's worker has finished (agreed at the last step boundary)."""
        return self.all_idle

    def _commit(self, run: AsyncRun) -> None:
        """Commit every layer of the staged batch (``layers_per_step``, 1 by default) at this step."""
        weights = self.model.expert_weights()
        for ready in run.staged:
            commit_layer(ready.rank_plan, run.slots[ready.slot], weights[ready.layer])
            self.placement = self.placement.with_layer(ready.layer, ready.new_row)
        self.model.install_placement(self.placement, self.rank, self.num_ranks)
        for ready in run.staged:
            self.stats.layers_committed += 1
            self.stats.bytes_moved += ready.stats.bytes_received
            self.on_event("layer_committed", {"rebalance": ready.rebalance_id, "layer": ready.layer,
                                              "bytes": ready.stats.bytes_received})
        run.staged = []
        run.ready = None
        run.fingerprint = 0
        run.in_flight_layer = None
        # the next layer starts only `async_layer_interval` steps after this commit (1: at once):
        # spreading a rebalance over more steps leaves more of the machine to the decode loop.
        # The count is of agreed step boundaries, so every rank releases its worker at the same step.
        run.release_in = self.config.async_layer_interval
        self._release_worker(run)
        # the worker answers with the next LayerReady or RebalanceFinished; until that arrives
        # the rebalance stays in flight so no new one starts and a drain waits for it

    def _release_worker(self, run: AsyncRun) -> None:
        """Count down to the next layer's start; a drain ends the rebalance at once instead."""
        if run.release_in <= 0 or run.in_flight is None:
            return
        if self.draining:
            run.release_in = 0
            run.worker.finish(run.in_flight)
            return
        run.release_in -= 1
        if run.release_in == 0:
            run.worker.proceed(run.in_flight)

    def _abort_rebalance(self) -> None:
        run = self.run
        failure = None if run is None else run.failure
        self.stats.rebalances_failed += 1
        seconds = None if run is None or run.in_flight is None else time.monotonic() - self._rebalance_started
        if run is not None:
            if run.in_flight is not None:
                run.worker.finish(run.in_flight)
            run.in_flight = run.ready = run.in_flight_layer = run.failure = None
            run.staged = []
            run.fingerprint = 0
            run.release_in = 0
        self.on_event("rebalance_failed", {
            "error": "another rank's layer failed" if failure is None else f"{failure.error_type}: {failure.message}",
            "local": failure is not None, "layer": None if failure is None else failure.layer, "seconds": seconds})
        self.stats.last_error = ("another rank's layer failed" if failure is None
                                 else f"{failure.error_type}: {failure.message}")

    def _restart_after_failure(self) -> None:
        """After an agreed failure every rank rebuilds its async run at this same step: a transfer
        error may have closed the EPLB group's pairs (gloo does on a timeout), and a fresh group,
        staging buffer and thread let the next rebalance commit on a healthy link. A thread that
        does not stop (it is stuck in a wait past its own deadline) cannot be rebuilt around: the
        EPLB is then degraded and :class:`EPLBUnavailable` tells the owner to leave ``running``."""
        run = self.run
        if run is None or self.rebuild_group is None:
            return
        if self.communicator is not None:
            self.communicator.abort("the rebalance failed: rebuilding the EPLB group")
        if not self.stop_worker(timeout=self.config.transfer_timeout_s + 5.0):
            self.stats.health = EPLBHealth.DEGRADED
            raise EPLBUnavailable(f"the async EPLB thread did not stop after a failure ({self.stats.last_error})")
        if self.communicator is not None:
            self.communicator.clear_abort()
        try:
            group = self.rebuild_group()
        except Exception as exc:  # noqa: BLE001 - the decode group's collective failed too
            self.stats.health = EPLBHealth.DEGRADED
            raise EPLBUnavailable(f"the EPLB group could not be rebuilt: {type(exc).__name__}: {exc}") from exc
        draining = self.draining
        self.start_worker(group, run.generation)
        self.draining = draining  # a drain in progress stays one
        self.stats.restarts += 1
        self.on_event("eplb_restarted", {"restarts": self.stats.restarts, "after": self.stats.last_error})

    def rebalance_now(self, *, scheduled: bool = False) -> bool:
        """Start a rebalance (async: hand a job to the worker; sync: move every layer now).

        A ``scheduled`` one (every ``step_interval`` steps) is skipped while the window's
        balancedness under the current placement is above ``min_balancedness``: the window and
        the placement are identical on every rank, so every rank skips at the same step. One an
        operator asked for is never skipped. Returns False when skipped. Either way the window is
        folded into the load estimate (``load_smoothing``), which is what a rebalance fits."""
        self.steps_since_rebalance = 0
        window = self.window.total()
        load = self.window.fold(self.config.load_smoothing, window)
        before = float(self.placement.balancedness(window, self.num_ranks).mean())
        self.stats.balancedness_before = before
        if scheduled and before > self.config.min_balancedness:
            self.stats.rebalances_skipped += 1
            self.on_event("rebalance_skipped", {"balancedness": before, "min_balancedness": self.config.min_balancedness})
            return False
        self.stats.rebalances_started += 1
        self._rebalance_started = time.monotonic()
        self._next_id += 1
        if self.config.use_async:
            run = self.run
            if run is None:
                return True  # suppressed: no worker, nothing starts
            run.in_flight = self._next_id
            self.all_idle = False
            run.worker.submit(RebalanceJob(self._next_id, load, self.placement, self.num_ranks, self.rank, run.generation))
            self.on_event("rebalance_started", {"id": self._next_id, "mode": "async", "balancedness": before})
        else:
            self._rebalance_sync(load)  # its one event is rebalance_finished (the replay report reads it so)
        return True

    def _rebalance_sync(self, load: torch.Tensor) -> None:
        """Move every changed layer now, in the decode thread. The maps follow the weights layer
        by layer, so a transfer that fails half-way leaves maps that say what each slot holds."""
        started = time.perf_counter()
        new = placement_for(self.config, load, self.placement.num_physical, self.num_ranks, self.placement,
                            **estimate_options(self.config))
        slots = self.placement.slots_per_rank(self.num_ranks)
        identity = list(range(self.num_ranks))
        weights = self.model.expert_weights()
        if not self._sync_staging:
            self._sync_staging = [torch.empty_like(t) for t in weights[0]]
            if self.communicator is not None:
                self.communicator.add_buffer(self._sync_staging)
        timeout = timedelta(seconds=self.config.transfer_timeout_s)
        for layer in range(self.placement.num_layers):
            old_row, new_row = self.placement.physical_to_logical[layer], new.physical_to_logical[layer]
            if torch.equal(old_row, new_row):
                continue
            plan = plan_layer(old_row, new_row, slots, slots, identity, identity, hosts=self.hosts)
            rank_plan = plan.for_rank(self.rank)
            if self.hooks is not None and self.hooks.before_layer is not None:
                self.hooks.before_layer(layer)
            stats = execute_layer(plan, self.rank, weights[layer], self._sync_staging, group=self.group,
                                  timeout=timeout, max_ops_per_batch=self.config.max_ops_per_batch, layer=layer,
                                  communicator=self.communicator,
                                  migration_batching=self.config.enable_migration_batching)
            commit_layer(rank_plan, self._sync_staging, weights[layer])
            self.placement = self.placement.with_layer(layer, new_row)
            self.stats.layers_committed += 1
            self.stats.bytes_moved += stats.bytes_received
        self.placement = new
        self.model.install_placement(self.placement, self.rank, self.num_ranks)
        self.stats.rebalances_finished += 1
        self.stats.sync_stall_seconds.append(time.perf_counter() - started)
        self.stats.last_rebalance_seconds = self.stats.sync_stall_seconds[-1]
        self.on_event("rebalance_finished", {"id": self._next_id, "mode": "sync",
                                             "seconds": self.stats.sync_stall_seconds[-1]})
