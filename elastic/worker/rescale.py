"""A rescale on one rank: the plan (:mod:`elastic.worker.rescale_plan`) carried out.

Two shapes, as :attr:`RescaleSpec.execute_on <elastic.core.protocol.RescaleSpec>` says:

- ``"old"`` (a scale down): every expert a leaving rank holds that the new placement needs is
  sent over the old group, then the leaving ranks' requests with their KV caches (to the least
  loaded survivors), and only then is the group replaced (a prepared one switches to its
  standby group; the leaving ranks wait for that switch before they free their memory);
- ``"new"`` (a scale up, a recovery): the new group forms first (or the standby group is swapped
  in), the lowest survivor shares the state the group starts from, then experts move over it.

A surviving rank overwrites only the slots that change, keeping their old contents in an
:class:`UndoLog`, so a rescale that fails before adoption puts the weights back and the old
placement still matches them.

Requests stay with the rank that owns them: survivors keep theirs (a recovery's first rolled back
to their last whole step by the decode loop), joining ranks start empty, and after the rescale
rank 0 reports what every rank of the new group holds (:class:`~elastic.core.protocol.RequestsHeld`).
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from elastic.core import protocol as p
from elastic.worker.context import RankContext
from elastic.worker.groups import ABORT_KEY, GroupGeneration, StandbyGroup
from elastic.worker.prepare import Preparation, PrepareExecutor
from elastic.worker.reports import placement_digest
from elastic.worker.rescale_plan import RankRole, diverged_layers, held_rows, layer_plans, next_placement, plan_request_moves, role_in
from eplb.models.serving import build_model
from eplb.placement import Placement
from eplb.plan import LayerPlan
from eplb.state import LoadWindow
from eplb.transfer import commit_layer, execute_layer, materialize

__all__ = ["SWITCHED_KEY", "RescaleExecutor", "UndoLog"]

#: set by the lowest survivor of a prepared scale down once the switch is over (the leaving ranks wait for it)
SWITCHED_KEY = "elastic-switched"


class UndoLog:
    """What a rescale overwrote in a surviving rank's weights, so a rescale that fails before
    adoption puts the slots back and the old placement matches the weights again."""

    def __init__(self) -> None:
        # (layer, local slots, their previous contents: one [len(slots), ...] tensor per weight tensor)
        self._saved: list[tuple[int, torch.Tensor, list[torch.Tensor]]] = []

    def save(self, layer: int, slots: Sequence[int], weights: list[torch.Tensor]) -> None:
        """Keep the current contents of ``slots`` of one layer before they are overwritten."""
        if slots:
            index = torch.tensor(list(slots), dtype=torch.int64)
            self._saved.append((layer, index, [t.index_select(0, index) for t in weights]))

    def replay(self, weights: list[list[torch.Tensor]]) -> None:
        """Put back everything saved (newest first) and forget it."""
        for layer, index, saved in reversed(self._saved):
            for tensor, value in zip(weights[layer], saved):
                tensor.index_copy_(0, index, value)
        self._saved.clear()

    def __len__(self) -> int:
        return len(self._saved)


@dataclass
class _Moved:
    """What the redistribution left: the new weights (None: a leaving rank), bytes received, the undo log."""

    placement: Placement
    weights: list[list[torch.Tensor]] | None
    received: int
    undo: UndoLog
    timing: dict[str, Any] = field(default_factory=dict)


class RescaleExecutor:
    """Carries out the Rescale commands of one rank, and keeps what outlives one: the plan an
    announcing Suppress made, the old generation's groups and weights until Resume."""

    def __init__(self, ctx: RankContext, preparer: PrepareExecutor):
        self.ctx = ctx
        self.preparer = preparer
        # (announced scale down, maps then, its placement and layer plans), from Suppress to Rescale
        self._announced: tuple[p.RescaleSpec, Placement, Placement, Sequence[LayerPlan]] | None = None
        self._detached: list[Any] = []  # the old generation's groups after a switch, shut down at Resume
        self._released: list[Any] = []  # weight tensors a switch swapped out, freed at Resume
        self._exchange_again = False  # a prepared switch swapped weight tensors: the communicator exchanges anew

    # -- around the pause --------------------------------------------------------------------
    def announce(self, spec: p.RescaleSpec | None) -> None:
        """A Suppress: plan the announced scale down now, while the ranks still decode (a prepared
        scale planned at Prepare)."""
        self._announced = None
        if spec is not None and self.preparer.preparation is None:
            ctx = self.ctx
            base = ctx.eplb.placement
            placement = next_placement(spec, base, base.physical_to_logical, ctx.eplb.window.total(), ctx.spec.eplb,
                                       ctx.in_group().hosts)
            plans = layer_plans(spec, base.physical_to_logical, placement, ctx.in_group().hosts)
            self._announced = (spec, base, placement, plans)

    def old_generation(self) -> tuple[list[Any], list[Any]]:
        """At Resume: the detached groups to shut down and the swapped-out weights to free (handed over)."""
        detached, self._detached = self._detached, []
        released, self._released = self._released, []
        return detached, released

    def attach_comm(self, generation: int) -> None:
        """The communicator follows the group generation: NIXL forgets the peers of the previous
        one and exchanges metadata through this one's store at its first transfer. After a
        prepared switch, which swapped staged layers in for weight tensors its peers may have
        learned at the pre-transfer's exchange, every rank of the generation exchanges again,
        under keys of its own (the earlier exchange's keys are still in the store)."""
        ctx = self.ctx
        prefix = f"elastic/gen{generation}/"
        if self._exchange_again:
            self._exchange_again = False
            ctx.comm.bind(-1)  # forget this generation's peers and exchange
            prefix += "after-switch/"
        ctx.comm.bind(generation, dist.PrefixStore(prefix, ctx.store))
        ctx.comm.set_weights(ctx.model.expert_weights())  # registrations follow the tensors

    # -- the rescale -------------------------------------------------------------------------
    def run(self, cmd: p.Rescale, *, fresh: bool) -> None:
        """Redistribute experts as ``cmd.spec`` says and move to its generation."""
        with self.ctx.busy(p.WorkerMode.RESCALING):
            self._run(cmd, fresh=fresh)

    def _run(self, cmd: p.Rescale, *, fresh: bool) -> None:
        ctx = self.ctx
        started = time.perf_counter()
        if ctx.eplb_if_any is not None and ctx.eplb_if_any.running:
            raise RuntimeError("rescale while the async EPLB worker runs: suppress it first")
        role = role_in(cmd.spec, ctx.rank, fresh=fresh)
        prep = self.preparer.take(cmd)  # a prepared scale: the standby group and what moved ahead
        if not cmd.spec.keep_requests and ctx.requests is not None:
            ctx.requests.clear()  # the coordinator replays every request from its prompt
        # group destroy + rendezvous; redistribution (wall, and this process's CPU incl. gloo threads)
        timing: dict[str, Any] = {"group_seconds": 0.0, "transfer_seconds": 0.0, "transfer_cpu_seconds": 0.0,
                                  "prepared": prep is not None}
        if cmd.spec.execute_on == "old":
            outcome = self._on_old_group(cmd, role, prep, started, timing)
        else:
            outcome = self._on_new_group(cmd, role, prep, started, timing)
        if outcome is None:
            return  # this rank left
        moved, held, diverged, started = outcome
        mark = time.perf_counter()
        self._adopt(role.new_rank, cmd, moved.placement, moved.weights)
        timing["adopt_seconds"] = time.perf_counter() - mark
        ctx.broken = False
        ctx.mode = p.WorkerMode.RESUMING
        self._report_held(cmd)
        ctx.report(p.PhaseDone, seq=cmd.seq, operation_id=cmd.operation_id, step=ctx.step, result=p.RescaleDone(
            retired=False, bytes_received=moved.received, seconds=time.perf_counter() - started,
            digest=placement_digest(ctx.eplb.placement), num_physical=ctx.eplb.placement.num_physical,
            placement_before=held.tolist(), diverged_layers=diverged,
            placement_after=ctx.eplb.placement.physical_to_logical.tolist(), timing=timing))

    def _report_held(self, cmd: p.Rescale) -> None:
        """What the new group decodes, gathered from every rank: rank 0 lists it (the coordinator
        learns who holds what and re-admits what no rank holds)."""
        ctx = self.ctx
        if ctx.requests is None:
            return
        gathered: list[Any] = [None] * cmd.spec.new_size
        dist.all_gather_object(gathered, ctx.requests.held())
        if ctx.rank == 0:
            held = tuple((rid, generated, rank) for rank, mine in enumerate(gathered) for rid, generated in mine)
            ctx.report(p.RequestsHeld, seq=cmd.seq, held=held)

    def _move_requests(self, cmd: p.Rescale) -> int:
        """A scale down, over the old group: the leaving ranks' requests, with their KV caches, go to
        the least loaded survivors (:func:`~elastic.worker.rescale_plan.plan_request_moves`, the
        same plan on every rank); nothing replays. Returns how many this rank took over."""
        ctx = self.ctx
        if ctx.requests is None:
            return 0
        mine = [(rid, ctx.requests.running[rid].spec.in_flight(generated)) for rid, generated in ctx.requests.held()]
        held: list[Any] = [None] * cmd.spec.old_size
        dist.all_gather_object(held, mine)
        moves = plan_request_moves(cmd.spec, held)
        leaving = [rid for rid, _ in mine if rid in moves]
        sent: list[Any] = [None] * cmd.spec.old_size
        dist.all_gather_object(sent, ctx.requests.take(leaving) if leaving else [])
        taken = [e for batch in sent for e in batch if moves.get(e["spec"].request_id) == ctx.rank]
        ctx.requests.restore(taken)
        return len(taken)

    def _on_old_group(self, cmd: p.Rescale, role: RankRole, prep: Preparation | None, started: float,
                      timing: dict[str, Any]) -> tuple[_Moved, torch.Tensor, tuple[int, ...], float] | None:
        """A scale down: every expert a leaving rank holds that the new placement needs is sent
        out over the old group, and only then is the group replaced. Drained: every rank
        committed the same layers, so its own maps are everyone's."""
        ctx = self.ctx
        base = ctx.eplb.placement
        held = base.physical_to_logical
        announced = self._prepared_plan(prep, base) if prep is not None else self._announced_plan(cmd.spec, base)
        timing["announced"] = announced is not None  # placement and plans made at Suppress (or Prepare)
        moved = self._move_experts(cmd, base, held, ctx.rank, timing, announced, prep)
        mark = time.perf_counter()
        timing["requests_moved"] = self._move_requests(cmd)  # the leaving ranks' requests, to survivors
        timing["requests_seconds"] = time.perf_counter() - mark
        mark = time.perf_counter()
        if role.leaves:
            # reported first: its teardown pauses nobody (the survivors decode on without it)
            self._retire(cmd, started, moved.received, timing)
            if prep is not None:
                # and it waits for the survivors' switch: freeing this process's memory while they
                # copy slots in place slowed their copies 1.4-1.7x on 2 cores (measured)
                self._await_switch(cmd)
            self._destroy_group()
            return None
        try:
            if prep is not None:
                assert prep.standby is not None
                self._switch_to(prep.standby)
                dist.barrier()  # every survivor holds the new placement before any adopts it
                if role.new_rank == 0:  # the leaving ranks may go now
                    dist.PrefixStore(f"elastic/gen{cmd.spec.generation}/", ctx.store).set(SWITCHED_KEY, "1")
            else:
                self._destroy_group()
                ctx.group = self._join(cmd, role.new_rank)
        except BaseException:
            self._undo(moved.undo)  # the weights go back to the old placement this rank still has
            raise
        timing["group_seconds"] = time.perf_counter() - mark
        return moved, held, (), started

    def _on_new_group(self, cmd: p.Rescale, role: RankRole, prep: Preparation | None, started: float,
                      timing: dict[str, Any]) -> tuple[_Moved, torch.Tensor, tuple[int, ...], float] | None:
        """A scale up or a recovery: form the new group first (a prepared one formed in draining:
        the pause only swaps it in), agree on the state it starts from, then move over it."""
        ctx = self.ctx
        mark = time.perf_counter()
        if prep is not None:
            assert prep.standby is not None
            self._switch_to(prep.standby)
        else:
            self._destroy_group()
            if role.leaves:
                timing["group_seconds"] = time.perf_counter() - mark
                self._retire(cmd, started, 0, timing)
                return None
            ctx.group = self._join(cmd, role.new_rank)
        timing["group_seconds"] = time.perf_counter() - mark
        if prep is None:
            ctx.non_expert_sync = None
        mark = time.perf_counter()
        base, held, source_started = self._share_state(cmd, role, started, prepared=prep is not None)
        timing["share_seconds"] = time.perf_counter() - mark  # step, maps, window
        if role.fresh:
            # a joining rank waited, standing by, while the old group still decoded: its part of the
            # pause starts when the old group stopped (the lowest survivor's start, as it said)
            timing["waited_seconds"] = max(0.0, source_started - started)
            started = source_started
        if ctx.non_expert_sync is not None:  # a Hugging Face model's replicated weights, from a peer
            timing["non_expert_bytes"] = ctx.non_expert_sync["bytes"]
            timing["non_expert_seconds"] = ctx.non_expert_sync["seconds"]
        diverged = diverged_layers(held, base.physical_to_logical)
        announced = self._prepared_plan(prep, base) if prep is not None else None
        moved = self._move_experts(cmd, base, held, role.new_rank, timing, announced, prep)
        return moved, held, diverged, started

    def _join(self, cmd: p.Rescale, new_rank: int) -> GroupGeneration:
        spec = self.ctx.spec
        return GroupGeneration.join(self.ctx.store, cmd.spec.generation, new_rank, cmd.spec.new_size,
                                    backend=spec.backend, timeout_s=spec.collective_timeout_s,
                                    rendezvous_timeout_s=spec.join_timeout_s)

    def _switch_to(self, standby: StandbyGroup) -> None:
        """The standby group becomes this rank's group; the old generation's groups are detached
        (shut down at Resume, after the pause)."""
        if self.ctx.eplb_if_any is not None:
            self.ctx.eplb_if_any.release_group()
        self.ctx.group, detached = standby.install()
        self._detached.extend(detached)

    # -- the plan ----------------------------------------------------------------------------
    def _prepared_plan(self, prep: Preparation, base: Placement) -> tuple[Placement, Sequence[LayerPlan]]:
        """The placement and plans made at Prepare; the maps must not have changed since."""
        if not prep.base.equals(base):
            raise RuntimeError("the placement changed between Prepare and the rescale (the EPLB was off)")
        return prep.placement, prep.plans

    def _announced_plan(self, spec: p.RescaleSpec, base: Placement) -> tuple[Placement, Sequence[LayerPlan]] | None:
        """The placement and layer plans computed at Suppress for this very scale down, if nothing
        changed since (same mapping and size, same maps: the EPLB was off); None otherwise."""
        announced, self._announced = self._announced, None
        if announced is None:
            return None
        plan, maps, placement, plans = announced
        if (plan.mapping, plan.new_size) != (spec.mapping, spec.new_size) or spec.lost or not maps.equals(base):
            return None
        return placement, plans

    def _share_state(self, cmd: p.Rescale, role: RankRole, started: float,
                     prepared: bool = False) -> tuple[Placement, torch.Tensor, float]:
        """Agree on the state the new group starts from; returns ``(base placement, held rows, when the
        lowest survivor began its rescale, on this rank's clock)``.

        The lowest surviving rank sends step, placement and load window to every rank of the
        new group: its placement is the *base* the policy starts from. What the weights hold
        may differ from it: after a peer died mid-all-reduce some survivors may have committed
        an async layer that others did not. So each survivor also contributes its own maps, and
        the *held* rows (``[layers, P]``) take each survivor's slots from that survivor's own
        placement (:func:`~elastic.worker.rescale_plan.held_rows`): the transfer plan moves
        experts from where they really are (an expert no survivor holds is reloaded). A
        survivor's own placement stays untouched until it adopts the new one, so a failed
        attempt leaves its maps matching its weights.
        """
        ctx, spec = self.ctx, cmd.spec
        payload: list[Any] = [self._source_state(cmd, started) if role.new_rank == spec.source else None]
        dist.broadcast_object_list(payload, src=spec.source)
        state = payload[0]
        source_started = time.perf_counter() - state["elapsed"]  # on this rank's clock, to a broadcast's latency
        own: list[Any] = [None] * spec.new_size
        base = Placement.from_physical_to_logical(state["p2l"], ctx.sizes.num_logical_experts)
        if prepared:
            # drained, the EPLB off since Prepare: every survivor holds the base maps (checked here,
            # locally; a survivor whose maps differ fails the rescale and the others roll back)
            if not role.fresh and not ctx.eplb.placement.equals(base):
                raise RuntimeError("this survivor's maps differ from the lowest survivor's after a drain")
        else:
            dist.all_gather_object(own, None if role.fresh else (ctx.rank, ctx.eplb.placement.physical_to_logical))
        ctx.step = state["step"]
        held = held_rows(base.physical_to_logical, own, spec.old_size)
        self._take_state(cmd, role, base, state, prepared)
        return base, held, source_started

    def _source_state(self, cmd: p.Rescale, started: float) -> dict[str, Any]:
        """What the lowest survivor sends every rank of the new group."""
        ctx = self.ctx
        return {
            "elapsed": time.perf_counter() - started,  # since this rank stopped decoding for the rescale
            "batch_index": ctx.decoder.batch_index if ctx.decoder is not None else -1,
            "step": ctx.step,
            "p2l": ctx.eplb.placement.physical_to_logical,
            "window": ctx.eplb.window.state(),
            "stats": ctx.eplb.stats,
            "steps_since_rebalance": ctx.eplb.steps_since_rebalance,
        }

    def _take_state(self, cmd: p.Rescale, role: RankRole, base: Placement, state: dict[str, Any],
                    prepared: bool) -> None:
        """Every rank of the new group takes the lowest survivor's window, rebalance countdown and decode state (each
        keeps its own requests; a joining rank starts with none);
        a joining rank builds its model and EPLB state here (unless it prepared)."""
        ctx, spec = self.ctx, cmd.spec
        if role.fresh:
            if not prepared:  # a prepared joining rank built its model at Prepare
                # nothing read from disk: experts arrive by the rescale's plan, a Hugging Face model's
                # other weights from the lowest survivor (below); built on the old maps (as rank 0
                # of the old group: the same slots per rank), the new placement installed at adoption
                ctx.model = build_model(ctx.spec.shape, base, 0, spec.old_size, seed=ctx.spec.seed,
                                        timeout=ctx.spec.collective_timeout_s, joining=True)
                ctx.model.replace_weights([])
                ctx.start_decoder()
            ctx.eplb = ctx.new_eplb(base, role.new_rank, spec.new_size)
            ctx.eplb.carry_over(LoadWindow.from_state(state["window"]), state["stats"], state["steps_since_rebalance"])
        else:
            # the countdown to the next scheduled rebalance too: a survivor's own may be a step off
            # (a torn commit: the rank that broke skipped the step's EPLB decision the others made),
            # and then one rank would start the next rebalance alone, fold one window more into its
            # load estimate and from then on commit other layers than its peers (wrong weights)
            ctx.eplb.carry_over(LoadWindow.from_state(state["window"]),
                                steps_since_rebalance=state["steps_since_rebalance"])
        if ctx.decoder is not None:
            ctx.decoder.batch_index = state["batch_index"]  # every rank goes on with the same batches
            if spec.joining and not prepared:  # fresh ranks: the replicated weights from a survivor
                ctx.non_expert_sync = ctx.model.sync_non_expert(src=spec.source, group=None,
                                                                timeout=ctx.spec.collective_timeout_s)

    # -- moving the experts ------------------------------------------------------------------
    def _move_experts(self, cmd: p.Rescale, base: Placement, held: torch.Tensor, executing_rank: int,
                      timing: dict[str, Any], announced: tuple[Placement, Sequence[LayerPlan]] | None = None,
                      prep: Preparation | None = None) -> _Moved:
        """The new placement (unless ``announced`` with its plans), the redistribution and the
        all-or-nothing barrier, timed into ``timing``. With ``prep``, its layers moved ahead of
        the pause and are only finished here."""
        ctx = self.ctx
        mark, cpu = time.perf_counter(), time.process_time()
        if announced is None:
            placement = next_placement(cmd.spec, base, held, ctx.eplb.window.total(), ctx.spec.eplb,
                                       ctx.in_group().hosts)
            plans: Sequence[LayerPlan] = layer_plans(cmd.spec, held, placement, ctx.in_group().hosts)
        else:
            placement, plans = announced
        timing["placement_seconds"] = time.perf_counter() - mark
        moved, networked, copied = self._redistribute(cmd, held, placement, executing_rank, plans, prep)
        timing["copy_bytes"] = copied
        timing["prestaged_layers"] = 0 if prep is None else len(prep.layers)
        barrier = time.perf_counter()
        if networked or (prep is not None and cmd.spec.execute_on == "new"):
            # every rank's transfers are done before anyone tears the group down or adopts;
            # without network transfers, the next rendezvous (or Resume) is that meeting point
            self._barrier_or_undo(moved.undo)
        timing["barrier_seconds"] = time.perf_counter() - barrier
        timing["transfer_seconds"] = time.perf_counter() - mark
        timing["transfer_cpu_seconds"] = time.process_time() - cpu
        return moved

    def _redistribute(self, cmd: p.Rescale, held: torch.Tensor, placement: Placement, executing_rank: int,
                      plans: Sequence[LayerPlan], prestaged: Preparation | None) -> tuple[_Moved, bool, int]:
        """Move every layer from the ``held`` rows (``[layers, P_old]``: what each old rank's slots
        hold) to ``placement``; returns ``(what moved, networked, bytes copied locally)``,
        ``networked`` being whether any rank moved anything over the network in this call (the
        plan is global, so every rank gets the same answer).

        A surviving rank keeps its weight tensors (slots per rank do not change): each layer is
        received into a one-layer staging buffer and only the changed slots are written in
        place, after the layer's sends are done. Their previous contents go to an undo log, so a
        rescale that fails later is rolled back (:meth:`_undo`) and the old placement still
        matches the weights. A fresh rank allocates its weights. The layers of ``prestaged``
        crossed the network before the pause: a survivor makes their staging from its received
        rows (the whole new layer, swapped in), a joining rank already holds them, a leaving rank
        sent them.
        """
        ctx, spec = self.ctx, cmd.spec
        ahead = set(prestaged.layers) if prestaged is not None else set()
        my_new_rank = executing_rank if spec.execute_on == "new" else spec.mapping[ctx.rank]
        old_weights = ctx.model.expert_weights() if ctx.model.expert_weights() else None
        in_place = my_new_rank >= 0 and old_weights is not None
        networked = any(plan.num_transfers for layer, plan in enumerate(plans) if layer not in ahead)
        if not networked and (in_place or my_new_rank < 0) and all(
                plan.for_rank(executing_rank).is_idle or (layer in ahead and not in_place)
                for layer, plan in enumerate(plans)):
            # nothing moves anywhere, nothing here changes
            return _Moved(placement, old_weights if in_place else None, 0, UndoLog()), False, 0
        staging: list[torch.Tensor] = []
        weights: list[list[torch.Tensor]] | None = None
        if in_place:
            assert old_weights is not None
            # a new list: a staged whole layer replaces its entry, and the model's list stays as it
            # was until adoption (the in-place layers are the same tensors)
            weights = list(old_weights)
            staging = [torch.empty_like(t) for t in old_weights[0]]
        elif my_new_rank >= 0:
            weights = self._fresh_weights(held.shape[1] // spec.old_size)
        self._comm_for_rescale(cmd, None if in_place else weights, staging if in_place else None)
        moved = _Moved(placement, weights, 0, UndoLog())
        try:
            copied = self._move_layers(moved, plans, executing_rank, old_weights, staging, in_place, prestaged)
        except BaseException:
            self._undo(moved.undo)
            raise
        return moved, networked, copied

    def _fresh_weights(self, per_rank: int) -> list[list[torch.Tensor]]:
        """A joining rank's weights: those it allocated standing by, if they fit."""
        prepared, self.ctx.prepared_weights = self.ctx.prepared_weights, None
        fits = prepared is not None and all(t.shape[0] == per_rank for layer in prepared for t in layer)
        return prepared if prepared is not None and fits else self.ctx.model.allocate(per_rank)

    def _move_layers(self, moved: _Moved, plans: Sequence[LayerPlan], executing_rank: int,
                     old_weights: list[list[torch.Tensor]] | None, staging: list[torch.Tensor], in_place: bool,
                     prestaged: Preparation | None) -> int:
        """Each layer in turn (see :meth:`_redistribute`); returns the bytes copied locally."""
        ctx, weights = self.ctx, moved.weights
        ahead = set(prestaged.layers) if prestaged is not None else set()
        rows = prestaged.received if prestaged is not None else {}
        timeout = timedelta(seconds=ctx.spec.eplb.transfer_timeout_s)
        copied = 0
        for layer, plan in enumerate(plans):
            ctx.faults.mid_rescale(layer)
            rank_plan = plan.for_rank(executing_rank)
            old_layer = None if old_weights is None else old_weights[layer]
            if layer in ahead:
                # a joining rank received it into its weights, a leaving one sent it; a survivor
                # swaps in its staged whole layer at adoption: the serving tensors stay as they are
                staged = rows.get(layer)
                if in_place and staged is not None:
                    assert weights is not None
                    weights[layer] = staged
                continue
            target = staging if in_place else ([] if weights is None else weights[layer])
            stats = execute_layer(plan, executing_rank, old_layer, target, group=None, timeout=timeout,
                                  max_ops_per_batch=ctx.spec.eplb.max_ops_per_batch, layer=layer,
                                  reload_fn=ctx.canonical(layer), communicator=ctx.comm,
                                  migration_batching=ctx.spec.eplb.enable_migration_batching)
            moved.received += stats.bytes_received
            if in_place:
                assert weights is not None
                moved.undo.save(layer, rank_plan.changed_slots, weights[layer])
                commit_layer(rank_plan, staging, weights[layer])
                copied += 2 * len(rank_plan.changed_slots) * ctx.sizes.expert_bytes  # the undo copy and the commit
            elif weights is not None:
                materialize(rank_plan, old_layer, weights[layer])
        return copied

    def _comm_for_rescale(self, cmd: p.Rescale, incoming: Any, staging: Any) -> None:
        """Before a rescale's first transfer: bind the executing generation; register the weights a
        fresh rank fills (``incoming``, published with the metadata) or a survivor's staging."""
        ctx = self.ctx
        executing = cmd.spec.generation if cmd.spec.execute_on == "new" else ctx.generation
        ctx.comm.bind(executing, dist.PrefixStore(f"elastic/gen{executing}/", ctx.store))
        if ctx.model.expert_weights():
            ctx.comm.set_weights(ctx.model.expert_weights())
        ctx.comm.set_incoming(incoming)
        if staging is not None:
            ctx.comm.add_buffer(staging, transient=True)

    # -- leaving, failing, adopting ----------------------------------------------------------
    def _destroy_group(self) -> None:
        """Tear down this generation's groups. On a healthy group the EPLB subgroup's last
        reference goes with them: its gloo teardown (closing pairs, joining threads, 20-40 ms)
        belongs to replacing the group, not to whatever later line drops the reference. A broken
        group was abandoned when it broke, never torn down (see ``Worker._enter_broken``)."""
        ctx = self.ctx
        if ctx.group is not None:
            if ctx.eplb_if_any is not None:
                ctx.eplb_if_any.release_group()
            ctx.group.destroy()

    def _await_switch(self, cmd: p.Rescale) -> None:
        """A leaving rank of a prepared scale down waits (at most a collective timeout) until the
        survivors' switch is over or abandoned, then leaves."""
        prefix = dist.PrefixStore(f"elastic/gen{cmd.spec.generation}/", self.ctx.store)
        deadline = time.monotonic() + self.ctx.spec.collective_timeout_s
        while time.monotonic() < deadline:
            try:
                if prefix.check([SWITCHED_KEY]) or prefix.check([ABORT_KEY]):
                    return
            except Exception:  # noqa: BLE001 - the coordinator (and its store) is gone: leave
                return
            time.sleep(0.005)

    def _retire(self, cmd: p.Rescale, started: float, bytes_moved: int, timing: dict[str, Any]) -> None:
        """This rank has no place in the new group: report it and leave the decode loop."""
        ctx = self.ctx
        ctx.report(p.PhaseDone, seq=cmd.seq, operation_id=cmd.operation_id, step=ctx.step, result=p.RescaleDone(
            retired=True, bytes_received=bytes_moved, seconds=time.perf_counter() - started, timing=timing))
        ctx.stopping = True

    def _barrier_or_undo(self, undo: UndoLog) -> None:
        try:
            dist.barrier()
        except BaseException:
            self._undo(undo)
            raise

    def _undo(self, undo: UndoLog) -> None:
        """Put back the slot contents a failed rescale overwrote."""
        undo.replay(self.ctx.model.expert_weights())

    def _adopt(self, new_rank: int, cmd: p.Rescale, placement: Placement, weights: Any) -> None:
        ctx, spec = self.ctx, cmd.spec
        ctx.rank, ctx.size, ctx.generation = new_rank, spec.new_size, spec.generation
        ctx.model.install_placement(placement, new_rank, spec.new_size)
        ctx.comm.adopt_incoming()  # registrations follow the tensors (old ones deregistered first)
        # tensors a switch swapped out are freed at Resume, not here: giving back a few GiB is kernel
        # work that would lengthen the pause
        self._released.append(ctx.model.expert_weights())
        ctx.model.replace_weights(weights)
        self._exchange_again = cmd.prepared  # the same on every rank of the generation
        if ctx.decoder is not None:
            ctx.decoder.state = None  # a joining rank has no KV cache: every rank starts the next batch
            # router counts a failed forward left behind (a survivor's) would enter this rank's load
            # window only: windows, and then the placements rebalances compute, would differ by rank
            ctx.model.take_load()
        # the EPLB stays off until Resume restarts it on the new group; a broken group's EPLB
        # subgroup is released now (a healthy one went with its group)
        ctx.eplb.adopt(placement, new_rank, spec.new_size)
