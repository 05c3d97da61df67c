"""A scale's prepare sub-phase on one rank: the standby group and the pre-transfer.

What a rescale can do before its pause, it does in ``draining`` once the drain is over
(:class:`~elastic.core.protocol.Prepare`): the EPLB is off and every rank has committed the same
layers, so the placement is fixed until the switch, and expert weights do not change while a
model serves. So the new placement and every layer's plan are computed once, the new group is
formed as a standby group, and the network part of the plan moves while the old group decodes:

- a joining rank receives its experts straight into its fresh weights;
- a surviving rank stages each layer it changes whole in spare memory (a copy of its serving
  tensors with the changed slots filled in), at most ``prestage_max_bytes``, and the switch swaps
  it in; layers that do not fit move in the pause;
- a scale up moves over the standby group (the joining ranks are in no other group); a scale
  down over the old group (the leaving ranks are in no other).

Old ranks move one layer per decode step, at agreed steps: the step-boundary all-reduce carries
two words (:meth:`Preparation.words`): *hold* (some rank has spent more than its share of the
wall time on the prepare, its set-up included, or decoded fewer steps than ``1 - share`` of its
steady pace, and the layers left, back to back at its pace so far, would still end within the
pacing window) and *failed* (some rank's layer failed: every rank drops the
preparation at the same step and the old group keeps serving). The joining ranks wait for each
layer in turn. The pause is then the switch: install the standby group, swap the staged layers in (the
serving tensors stay untouched until adoption, so there is nothing to undo), move what was
left, a barrier, adopt.
"""

from __future__ import annotations

import logging
import time
import traceback
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from elastic.core import protocol as p
from elastic.worker.context import RankContext
from elastic.worker.groups import StandbyGroup, raise_if_aborted, shutdown_detached
from elastic.worker.rescale_plan import layer_plans, next_placement
from eplb.models.serving import build_model
from eplb.placement import Placement
from eplb.plan import LayerPlan, prestage_layers
from eplb.transfer import TransferTimeout, execute_layer

log = logging.getLogger("elastic.worker.prepare")

#: set (with the layer's index) by the old ranks of a prepared scale up as they start a pre-transfer layer
PRESTAGE_LAYER_KEY = "elastic-prestage-layer"

#: the words the pre-transfer adds to the step-boundary all-reduce (MAX): hold, failed
PREPARE_WORDS = 2
#: how many times longer than the time share alone the step count may make the pre-transfer: a
#: steady pace taken before the load changed (a larger batch, slower steps) would otherwise hold
#: every layer to the end of the pacing window
PACE_STRETCH = 3.0


def over_share(spent_s: float, elapsed_s: float, share: float) -> bool:
    """Whether a rank that spent ``spent_s`` of ``elapsed_s`` wall seconds on the pre-transfer
    must hold the next layer to keep within ``share`` (decoding keeps ``1 - share``)."""
    return spent_s > share * elapsed_s


def behind_pace(steps: int, elapsed_s: float, steady_step_s: float, share: float) -> bool:
    """Whether a rank that decoded ``steps`` steps in the ``elapsed_s`` wall seconds since its
    Prepare kept less than ``1 - share`` of its steady throughput (a step per ``steady_step_s``
    before the Prepare; 0: not known, never behind).

    The time a rank spends in the pre-transfer is not all it costs decoding: on cores the ranks
    share, a peer's transfer, a progress thread or fresh pages slow the steps in between too. The
    step count sees all of it."""
    return steady_step_s > 0 and steps < (1 - share) * elapsed_s / steady_step_s


@dataclass
class Preparation:
    """Everything one rank holds for a prepared scale, from its Prepare to the switch."""

    command: p.Prepare
    executing_rank: int  # this rank in the group the pre-transfer moves over
    new_rank: int  # -1: this rank leaves at the switch
    standby: StandbyGroup | None  # the next generation (None on a leaving rank)
    base: Placement  # the drained placement every old rank holds
    placement: Placement  # the new one
    plans: Sequence[LayerPlan]
    layers: tuple[int, ...]  # pre-transferred layers, in order (the same on every rank)
    group: Any  # the group the pre-transfer moves over (None: the old default group)
    started_at: float  # time.monotonic() at the Prepare
    started: float  # time.perf_counter() at the Prepare
    group_seconds: float = 0.0
    placement_seconds: float = 0.0
    #: a survivor's staged layers: per layer, its whole new tensors (swapped in at the switch)
    received: dict[int, list[torch.Tensor]] = field(default_factory=dict)
    next_index: int = 0  # into ``layers``
    spent: float = 0.0  # seconds in pre-transfer layers
    #: seconds the decode thread spent setting up the scale before the first layer (stopping the
    #: EPLB, the plan, the standby group): the pacing counts them, as decoding lost them too
    setup_seconds: float = 0.0
    #: this rank's step time before the Drain, the lower of the median and the mean of its last
    #: steps in this group (0: not known)
    steady_step_s: float = 0.0
    bytes_received: int = 0
    steps: int = 0  # decode steps since the Prepare
    failed: str | None = None
    reported: bool = False

    @property
    def complete(self) -> bool:
        return self.next_index >= len(self.layers)

    @property
    def prestage_bytes(self) -> int:
        """Spare memory held for the pause (a survivor's staged layers)."""
        return sum(t.numel() * t.element_size() for staged in self.received.values() for t in staged)

    def words(self, now: float) -> list[int]:
        """This rank's vote at the next step boundary: [hold, failed]. It holds while its time in
        the pre-transfer is over its share, or its decode steps are behind ``1 - share`` of its
        steady pace (while that time is over ``share / PACE_STRETCH``), unless holding would make
        the layers left overrun the pacing window."""
        elapsed = now - self.started
        share = self.command.prestage_share
        spent = self.setup_seconds + self.spent
        # the steps must stay ahead of the pace through the next layer too, which decodes none (at
        # its end, a short prepare would otherwise lose a layer's worth of steps below the line)
        through_next = elapsed + self.layer_estimate()
        paced = over_share(spent, elapsed, share) or (behind_pace(self.steps, through_next, self.steady_step_s, share)
                                                      and over_share(spent, elapsed, share / PACE_STRETCH))
        hold = (not self.complete and paced
                and elapsed + self.remaining_estimate() < self.command.paced_for_s)
        return [int(hold), int(self.failed is not None)]

    def layer_estimate(self) -> float:
        """Seconds the next layer will take: this rank's mean layer so far (0 before the first)."""
        return self.spent / max(1, self.next_index)

    def remaining_estimate(self) -> float:
        """Seconds the layers left would take back to back, at this rank's mean so far."""
        return self.layer_estimate() * (len(self.layers) - self.next_index)

    def matches(self, rescale: p.Rescale) -> bool:
        """Whether ``rescale`` is the scale this preparation was made for."""
        return rescale.prepared and not rescale.spec.lost and self.command.spec == rescale.spec

    def done(self, now_at: float, now: float) -> p.PrepareDone:
        return p.PrepareDone(
            seconds=now - self.started, group_seconds=self.group_seconds, placement_seconds=self.placement_seconds,
            layers=len(self.layers), layers_total=sum(1 for plan in self.plans if plan.changes_anything),
            bytes_received=self.bytes_received,
            prestage_bytes=self.prestage_bytes, steps=self.steps, transfer_seconds=self.spent,
            steady_step_seconds=self.steady_step_s,
            started_at=self.started_at, ended_at=now_at)


class PrepareExecutor:
    """A rank's prepare sub-phase (see the module docstring): it plans the scale, forms the
    standby group and moves the pre-transferred layers, one per decode step on an old rank, all
    at once on a joining rank. It holds the :class:`Preparation` until the switch takes it."""

    def __init__(self, ctx: RankContext):
        self.ctx = ctx
        self.preparation: Preparation | None = None
        self._failed_vote = False  # this rank's Prepare failed: vote "failed" at the next step boundary

    def words(self, now: float) -> list[int]:
        """This rank's vote at the step boundary: [hold, failed] (zeros without a preparation)."""
        words = self.preparation.words(now) if self.preparation is not None else [0] * PREPARE_WORDS
        if self._failed_vote:  # this rank's Prepare failed before it had a preparation to vote with
            words[1], self._failed_vote = 1, False
        return words

    def on_prepare(self, command: p.Prepare, steady_step_s: float) -> None:
        """The prepare sub-phase of draining, at this agreed step on every rank of the old group:
        stop the drained EPLB, plan the rescale, form the standby group; the pre-transfer then
        goes a layer per step (:meth:`advance`). ``steady_step_s``: the pace before the Drain."""
        ctx = self.ctx
        if not ctx.eplb.drained:
            raise RuntimeError("prepare before the drain finished: a transfer is still in flight")
        self.discard()
        started_at, started = time.monotonic(), time.perf_counter()
        with ctx.busy(p.WorkerMode.DRAINING):  # joining the thread, the rendezvous: busy, not silent
            if not ctx.eplb.stop_worker(timeout=ctx.spec.collective_timeout_s):
                raise TimeoutError("the async EPLB thread did not stop in time")
            try:
                self._prepare_serving_rank(command, started_at, started)
                if self.preparation is not None:  # decoding waited for all of this: the pacing counts it
                    self.preparation.setup_seconds = time.perf_counter() - started
                    self.preparation.steady_step_s = steady_step_s
            except Exception as exc:  # noqa: BLE001 - the scale fails; the serving group must not break for it
                self._failed_vote = True  # voted at the next step boundary: every rank drops its preparation
                self.discard()
                ctx.report(p.WorkerError, step=ctx.step, where="prepare", error_type=type(exc).__name__,
                           message=f"prepare failed: {exc}", traceback=traceback.format_exc(),
                           seq=command.seq)

    def _prepare_serving_rank(self, command: p.Prepare, started_at: float, started: float) -> None:
        """An old rank's part of Prepare: the plan, the standby group, what the joining ranks need."""
        ctx, spec = self.ctx, command.spec
        new_rank = spec.mapping[ctx.rank]
        scale_up = spec.execute_on == "new"
        standby: StandbyGroup | None = None
        try:
            base = ctx.eplb.placement
            mark = time.perf_counter()
            placement = next_placement(spec, base, base.physical_to_logical, ctx.eplb.window.total(), ctx.spec.eplb,
                                       ctx.in_group().hosts)
            # a scale up runs on the standby group: planned once it formed, with its hosts (as the joining ranks do)
            plans = None if scale_up else layer_plans(spec, base.physical_to_logical, placement, ctx.in_group().hosts)
            placement_seconds = time.perf_counter() - mark
            mark = time.perf_counter()
            standby = self._form_standby(command, new_rank) if new_rank >= 0 else None
            if plans is None:
                plans = layer_plans(spec, base.physical_to_logical, placement,
                                    standby.hosts if standby is not None else ())
            if scale_up:
                assert standby is not None
                # the joining ranks learn the maps from the lowest survivor, and a Hugging Face
                # model's replicated weights too, over the standby group
                payload: list[Any] = [{"base": base.physical_to_logical, "placement": placement.physical_to_logical}]
                dist.broadcast_object_list(payload, group=standby.pg, group_src=spec.source)
                if ctx.decoder is not None and spec.joining:
                    ctx.model.sync_non_expert(src=spec.source, group=standby.pg, timeout=ctx.spec.collective_timeout_s)
            group_seconds = time.perf_counter() - mark
            self.preparation = self._preparation(command, new_rank if scale_up else ctx.rank, new_rank, standby, base,
                                                 placement, plans, started_at, started)
        except BaseException:
            if standby is not None and self.preparation is None:
                self._drop_standby(standby)
            raise
        self.preparation.placement_seconds, self.preparation.group_seconds = placement_seconds, group_seconds
        self._comm_for_prepare(command)

    def prepare_joining(self, command: p.Prepare) -> None:
        """A joining rank's prepare: the standby group, the maps, its model, then every
        pre-transferred layer straight into its fresh weights, as the old group sends them."""
        ctx = self.ctx
        started_at, started = time.monotonic(), time.perf_counter()
        with ctx.busy(p.WorkerMode.STANDBY):
            prep = self._join_standby(command, started_at, started)
            weights = ctx.prepared_weights
            assert weights is not None and prep.standby is not None
            standby_pg = prep.standby.pg
            # the old group sends a layer when its share allows: wait for each as long as a standby rank waits
            wait_s = max(1.0, ctx.spec.standby_timeout_s)
            for index, layer in enumerate(prep.layers):
                ctx.progress = ("pre-transfer", index, len(prep.layers))
                self._wait_for_layer_start(command.spec.generation, index, wait_s)
                ctx.faults.mid_prestage(index)
                ctx.faults.before_layer(layer)
                mark = time.perf_counter()
                stats = execute_layer(prep.plans[layer], ctx.rank, None, weights[layer], group=standby_pg,
                                      timeout=wait_s, max_ops_per_batch=ctx.spec.eplb.max_ops_per_batch, layer=layer,
                                      reload_fn=ctx.canonical(layer), communicator=ctx.comm,
                                      migration_batching=ctx.spec.eplb.enable_migration_batching, start_together=True)
                prep.spent += time.perf_counter() - mark
                prep.bytes_received += stats.bytes_received
                prep.next_index = index + 1
            ctx.progress = None
        self.preparation = prep
        ctx.done(command, prep.done(time.monotonic(), time.perf_counter()))

    def _join_standby(self, command: p.Prepare, started_at: float, started: float) -> Preparation:
        """A joining rank forms the standby group, learns the maps from the lowest survivor and
        builds its model (on the old maps, as rank 0 of the old group: the same slots per rank;
        the new placement is installed at adoption)."""
        ctx, spec = self.ctx, command.spec
        mark = time.perf_counter()
        standby = self._form_standby(command, ctx.rank)
        payload: list[Any] = [None]
        dist.broadcast_object_list(payload, group=standby.pg, group_src=spec.source)
        base = Placement.from_physical_to_logical(payload[0]["base"], ctx.sizes.num_logical_experts)
        placement = Placement.from_physical_to_logical(payload[0]["placement"], ctx.sizes.num_logical_experts)
        ctx.model = build_model(ctx.spec.shape, base, 0, spec.old_size, seed=ctx.spec.seed,
                                timeout=ctx.spec.collective_timeout_s, joining=True)
        ctx.model.replace_weights([])
        ctx.start_decoder()
        if ctx.decoder is not None:
            ctx.non_expert_sync = ctx.model.sync_non_expert(src=spec.source, group=standby.pg,
                                                            timeout=ctx.spec.collective_timeout_s)
        group_seconds = time.perf_counter() - mark
        plans = layer_plans(spec, base.physical_to_logical, placement, standby.hosts)
        prep = self._preparation(command, ctx.rank, ctx.rank, standby, base, placement, plans, started_at, started)
        prep.group_seconds = group_seconds
        self._comm_for_prepare(command)
        return prep

    def _wait_for_layer_start(self, generation: int, index: int, wait_s: float) -> None:
        """A joining rank waits here, not in a collective, until the old ranks start pre-transfer
        layer ``index`` (:meth:`_announce_layer_start`). The old ranks hold each layer for up to
        ``1 / prestage_share`` times its transfer time, longer than the standby group's collective
        timeout on a slow link; a collective waited in for that long would break the group. The
        start all-reduce (``start_together``) then meets the old ranks at the same agreed step."""
        prefix = dist.PrefixStore(f"elastic/gen{generation}/", self.ctx.store)
        key = f"{PRESTAGE_LAYER_KEY}{index}"
        deadline = time.monotonic() + wait_s
        pause = 1e-3
        while not prefix.check([key]):
            raise_if_aborted(prefix, generation)
            if time.monotonic() >= deadline:
                raise TransferTimeout(f"the old group did not start pre-transfer layer {index} within {wait_s:g}s",
                                      rank=self.ctx.rank, timeout=wait_s,
                                      waiting=f"the start of pre-transfer layer {index}")
            time.sleep(pause)
            pause = min(0.02, pause * 2)

    def _announce_layer_start(self, prep: Preparation) -> None:
        """An old rank of a scale up tells the joining ranks it starts the next pre-transfer layer
        (every old rank sets the same key; they start it at the same agreed step)."""
        spec = prep.command.spec
        if spec.execute_on == "new":
            dist.PrefixStore(f"elastic/gen{spec.generation}/", self.ctx.store).set(
                f"{PRESTAGE_LAYER_KEY}{prep.next_index}", "1")

    def advance(self, words: list[int]) -> None:
        """One decode step of an old rank's pre-transfer: the next layer, unless a rank holds
        (its share of the wall time is spent) or failed (then every rank drops the preparation
        at this same step, and the old group keeps serving)."""
        prep = self.preparation
        assert prep is not None
        prep.steps += 1
        hold, failed = words
        if failed:
            self.discard()
            return
        if prep.failed is not None:
            return
        if not prep.complete and not hold:
            self._prestage_next(prep)
        if prep.complete and prep.failed is None and not prep.reported:
            prep.reported = True
            self.ctx.done(prep.command, prep.done(time.monotonic(), time.perf_counter()))

    def _prestage_next(self, prep: Preparation) -> None:
        """Move the next pre-transferred layer: sends from the serving weights; a survivor
        receives into, and stages, the new contents of the slots it changes (it keeps serving
        from its weights until the switch)."""
        ctx = self.ctx
        layer = prep.layers[prep.next_index]
        mark = time.perf_counter()
        try:
            self._announce_layer_start(prep)
            ctx.faults.mid_prestage(prep.next_index)
            ctx.faults.before_layer(layer)
            plan = prep.plans[layer]
            weights = ctx.model.expert_weights()[layer]
            # within half a collective timeout: a rank whose peer gave up on this layer must come
            # back to the step-boundary all-reduce before its peers there time out (which would
            # break the serving group for a scale that only had to fail)
            timeout = min(ctx.spec.eplb.transfer_timeout_s, ctx.spec.collective_timeout_s / 2)
            staged = None
            if prep.new_rank >= 0 and plan.for_rank(prep.executing_rank).changed_slots:
                # the whole new layer: a copy of the serving one with the changed slots filled in
                # (kept slots copied now, not in the pause); the switch swaps it in
                staged = [t.clone() for t in weights]
                ctx.comm.add_buffer(staged, transient=True)  # received into (NIXL); it is the weights after the switch
            stats = execute_layer(plan, prep.executing_rank, weights, staged, group=prep.group, timeout=timeout,
                                  max_ops_per_batch=ctx.spec.eplb.max_ops_per_batch, layer=layer,
                                  reload_fn=ctx.canonical(layer), communicator=ctx.comm,
                                  migration_batching=ctx.spec.eplb.enable_migration_batching,
                                  # a one-sided reader (a joining rank) reads only inside this step,
                                  # which the pacing counts, not while this rank decodes
                                  start_together=True)
            if staged is not None:
                prep.received[layer] = staged
            prep.bytes_received += stats.bytes_received
            prep.next_index += 1
        except Exception as exc:  # noqa: BLE001 - the scale fails; the old group goes on serving
            prep.failed = f"layer {layer}: {type(exc).__name__}: {exc}"
            ctx.report(p.WorkerError, step=ctx.step, where="prepare", error_type=type(exc).__name__,
                       message=f"pre-transfer of layer {layer} failed: {exc}", seq=prep.command.seq)
        finally:
            prep.spent += time.perf_counter() - mark

    def _form_standby(self, command: p.Prepare, new_rank: int) -> StandbyGroup:
        spec = self.ctx.spec
        return StandbyGroup.form(self.ctx.store, command.spec.generation, new_rank, command.spec.new_size,
                                 backend=spec.backend, timeout_s=spec.collective_timeout_s,
                                 rendezvous_timeout_s=spec.join_timeout_s)

    def _preparation(self, command: p.Prepare, executing_rank: int, new_rank: int, standby: StandbyGroup | None,
                     base: Placement, placement: Placement, plans: Sequence[LayerPlan], started_at: float,
                     started: float) -> Preparation:
        """The preparation record, with the layers that move ahead (the same on every rank): the
        ranks that keep serving receive into spare memory, within the budget."""
        spec = command.spec
        if spec.execute_on == "new":
            bounded = list(spec.survivors)
        else:
            bounded = [old for old, n in enumerate(spec.mapping) if n >= 0]
        layers = prestage_layers(list(plans), self.ctx.sizes.expert_bytes, command.prestage_max_bytes, bounded)
        return Preparation(command=command, executing_rank=executing_rank, new_rank=new_rank, standby=standby,
                           base=base, placement=placement, plans=plans, layers=layers,
                           group=standby.pg if spec.execute_on == "new" and standby is not None else None,
                           started_at=started_at, started=started)

    def _comm_for_prepare(self, command: p.Prepare) -> None:
        """The pre-transfer of a scale up moves over the standby generation: bind the communicator to it."""
        ctx, generation = self.ctx, command.spec.generation
        if command.spec.execute_on == "new":
            ctx.comm.bind(generation, dist.PrefixStore(f"elastic/gen{generation}/", ctx.store))
            if ctx.model.expert_weights():
                ctx.comm.set_weights(ctx.model.expert_weights())

    def discard(self) -> None:
        """Drop a preparation (the scale failed, or a rescale that is not it came): the standby
        group is unregistered and kept referenced (a gloo group whose peer died can block in its
        teardown), the spare rows are freed. The serving group is untouched."""
        prep, self.preparation = self.preparation, None
        if prep is None:
            return
        if prep.standby is not None:
            self._drop_standby(prep.standby)
        for staged in prep.received.values():
            self.ctx.comm.remove_buffer(staged)  # deregistered before it is freed
        prep.received.clear()

    def _drop_standby(self, standby: StandbyGroup) -> None:
        """A standby group of a scale that failed: unregistered, then shut down (its gloo pairs,
        threads and sockets would otherwise stay for the life of the process, one set per failed
        scale). The serving group is another group: nothing of it waits on this one."""
        pg = standby.discard()
        mark = time.perf_counter()
        with self.ctx.busy(self.ctx.mode):  # a teardown that waits on a dead peer's failed work: busy, not silent
            shutdown_detached([pg])
        log.info("rank %d: standby group of generation %d shut down in %.3fs", self.ctx.rank, standby.generation,
                 time.perf_counter() - mark)

    def take(self, cmd: p.Rescale) -> Preparation | None:
        """The preparation a prepared rescale switches with; any other rescale drops it first."""
        if not cmd.prepared:
            self.discard()
            return None
        prep, self.preparation = self.preparation, None
        if prep is None or not prep.matches(cmd) or not prep.complete or prep.failed is not None:
            self.preparation = prep
            self.discard()
            raise RuntimeError("a prepared rescale, but this rank has no complete preparation for it")
        return prep
