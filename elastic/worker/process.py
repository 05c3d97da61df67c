"""One EP rank: a worker process running the decode loop of the reference MoE model.

At every step boundary the worker runs one small MAX all-reduce carrying (a) the highest
command sequence number it has received and (b) its EPLB control words. Then every rank
executes the same commands and makes the same EPLB decision at the same step. The step itself
routes this rank's tokens, sums tokens per physical slot over ranks (one collective, which is
also the EPLB's load recording) and runs the local experts on them.

When a collective fails (a peer died or stalled past the group timeout) the worker reports the
error as data and switches to *broken* mode: no more decoding, and commands are executed as
they arrive (a recovery ``Rescale`` or ``Shutdown``) instead of at agreed step boundaries.
"""

from __future__ import annotations

import collections
import contextlib
import functools
import logging
import os
import queue
import statistics
import threading
import time
import traceback
from collections.abc import Sequence
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from elastic.core import protocol as p
from elastic.core.worker_spec import WorkerSpec  # noqa: F401 - re-exported (it moved to core)
from elastic.service.logs import configure as configure_logging
from elastic.serving.batch import RequestBatch
from elastic.worker.groups import (
    ABORT_KEY,
    GroupGeneration,
    StandbyGroup,
    connect_store,
    num_nodes_of,
    raise_if_aborted,
    shutdown_detached,
)
from elastic.worker.injector import FaultInjector
from elastic.worker.liveness import WATCH_MARGIN_S, StepWatch
from elastic.worker.prepare import PREPARE_WORDS, Preparation
from eplb.algorithm import warm_up
from eplb.communicator import make_communicator
from eplb.config import EPLBConfig
from eplb.models.config import HFModelConfig
from eplb.models.serving import DecodeBatches, build_model, model_info
from eplb.placement import Placement
from eplb.plan import LayerPlan, holders_from_mapping, plan_layer, prestage_layers
from eplb.state import CONTROL_WORDS, EPLBState, LoadWindow, TransferHooks, placement_for
from eplb.trace import PhasedTrace
from eplb.transfer import TransferTimeout, commit_layer, execute_layer, materialize

log = logging.getLogger("elastic.worker.process")

#: set by the lowest survivor of a prepared scale down once the switch is over (the leaving ranks wait for it)
SWITCHED_KEY = "elastic-switched"
#: set (with the layer's index) by the old ranks of a prepared scale up as they start a pre-transfer layer
PRESTAGE_LAYER_KEY = "elastic-prestage-layer"
#: decode steps in the steady pace a prepare keeps (``Preparation.steady_step_s``)
STEADY_STEPS = 32


class BrokenGroup(RuntimeError):
    """A collective of the decode loop failed: the group cannot be used any more."""


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


class Worker:
    def __init__(self, spec: WorkerSpec, inbox: Any, outbox: Any):
        self.spec = spec
        self.inbox = inbox
        self.outbox = outbox
        self.rank = spec.rank
        self.size = spec.size
        self.generation = spec.generation
        self.step = 0
        self.received_seq = 0  # the end of the gap-free run of command seqs received (see _take)
        self.executed_seq = 0
        self.pending: dict[int, p.Command] = {}
        self.broken = False
        self.stopping = False
        self.mode = p.WorkerMode.STARTING
        self.progress: tuple[str, int, int] | None = None  # a long preparation's (what, done, total)
        self.draining_op: p.Drain | None = None
        self.last_heartbeat = 0.0
        self.tokens_since = 0
        # per decode step since the last heartbeat: (step, monotonic end time, wall seconds and
        # this thread's CPU seconds in eplb.control() + after_sync() + record(), 1 if a rebalance
        # was in flight)
        self.step_timings: list[tuple[int, float, float, float, int]] = []
        self._control_seconds = (0.0, 0.0)
        self.sizes = model_info(spec.shape)
        # the reference model decodes a synthetic load trace; a Hugging Face model decodes real
        # batches (self.decoder) and its router's choices are the load
        self.trace = PhasedTrace(list(spec.trace), self.sizes.num_moe_layers, self.sizes.num_logical_experts)
        self.decoder: DecodeBatches | None = None  # synthetic batches while no request runs (background load)
        self.requests: RequestBatch | None = None  # completion requests (elastic.serving)
        self.non_expert_sync: dict[str, float] | None = None  # bytes and seconds of the last peer copy (joining ranks)
        self._abandoned_groups: list[Any] = []  # broken generations' groups, never torn down (see _enter_broken)
        # a step waiting on its peers keeps reporting, for at most one collective timeout and a margin
        self.step_watch = StepWatch(self._waiting_heartbeat, spec.heartbeat_s, spec.collective_timeout_s + WATCH_MARGIN_S)
        self.store = connect_store(spec.store_host, spec.store_port, spec.join_timeout_s)
        self.comm = make_communicator(spec.eplb.communicator, spec.backend)  # moves expert weights
        self.group: GroupGeneration | None = None
        # the model and the EPLB state exist once this rank is in a group (a joining rank gets
        # them at its first rescale); ``eplb``/``model`` raise before that, ``_eplb``/``_model`` tell
        self._model: Any = None  # ReferenceMoE or eplb.models.hf.HFMoE (both MixtureOfExperts)
        self._eplb: EPLBState | None = None
        self.faults = FaultInjector(spec.faults, lambda: (self.rank, self.generation))
        self._prepared_weights: list[list[torch.Tensor]] | None = None  # a joining rank's, allocated while standing by
        # (announced scale down, maps then, its placement and layer plans), from Suppress to Rescale
        self._announced: tuple[p.RescaleSpec, Placement, Placement, list[LayerPlan]] | None = None
        self.preparation: Preparation | None = None  # a scale's prepare sub-phase, from its Prepare to the switch
        # when the last decode steps ended: the steady pace a prepare's pacing keeps
        self._step_ends: collections.deque[float] = collections.deque(maxlen=STEADY_STEPS + 1)
        self._steady_step_s = 0.0  # _steady_step_seconds() when the last Drain came
        self._prepare_failed = False  # this rank's Prepare failed: vote "failed" at the next step boundary
        self._detached: list[Any] = []  # the old generation's groups after a switch, shut down at Resume
        self._released: list[Any] = []  # weight tensors a switch swapped out, freed at Resume
        self._exchange_again = False  # a prepared switch swapped weight tensors: the communicator exchanges anew

    @property
    def eplb(self) -> EPLBState:
        if self._eplb is None:
            raise RuntimeError(f"rank {self.rank} has no EPLB state yet: it has not joined a group")
        return self._eplb

    @eplb.setter
    def eplb(self, state: EPLBState) -> None:
        self._eplb = state

    @property
    def model(self) -> Any:
        if self._model is None:
            raise RuntimeError(f"rank {self.rank} has no model yet: it has not joined a group")
        return self._model

    @model.setter
    def model(self, model: Any) -> None:
        self._model = model

    def _in_group(self) -> GroupGeneration:
        if self.group is None:
            raise RuntimeError(f"rank {self.rank} is in no group")
        return self.group

    # -- reporting -------------------------------------------------------------------------
    def _base(self) -> dict[str, Any]:
        return {"rank": self.rank, "generation": self.generation, "pid": os.getpid(), "at": time.time()}

    def report(self, cls: type, **fields: Any) -> None:
        self.outbox.put(cls(**self._base(), **fields))

    def _eplb_event(self, kind: str, data: dict[str, Any]) -> None:
        self.report(p.WorkerEvent, step=self.step, kind=kind, data=data)

    # -- faults (tests and scenarios only) -----------------------------------------------
    def _apply_commit_faults(self, reduced: list[int]) -> None:
        if self.eplb.commits_now(reduced) and self.faults.torn_commit(self.eplb.stats.layers_committed + 1):
            raise BrokenGroup(f"fault injection: the step-{self.step} all-reduce broke on this rank only, "
                              f"before commit {self.eplb.stats.layers_committed + 1} (the other ranks commit)")

    def _hooks(self) -> TransferHooks:
        verify = self.model.verify_staged if self.spec.eplb.verify_transfers else None
        return TransferHooks(before_layer=self.faults.before_layer, after_fill=self.faults.after_fill,
                             verify_staged=(lambda *a: verify(*a)) if verify else None)

    def _set_progress(self, progress: tuple[str, int, int] | None) -> None:
        self.progress = progress

    # -- startup ---------------------------------------------------------------------------
    def start(self) -> None:
        spec = self.spec
        self.faults.hang_before_start()
        if spec.joining:  # a fresh rank: it joins through the rescale
            self._warm_up_in_background()  # while it stands by
            command = self._standby()
            if command is not None:
                self.faults.at_command(command)
                self._rescale(command, fresh=True)
            return
        with self._busy(p.WorkerMode.STARTING):
            self.faults.slow_prepare(self._set_progress)
            self.progress = ("joining the group", 0, 1)
            self.group = GroupGeneration.join(self.store, self.generation, self.rank, self.size,
                                              backend=spec.backend, timeout_s=spec.collective_timeout_s,
                                              rendezvous_timeout_s=spec.join_timeout_s)
            placement = self._initial_placement()
            self.progress = ("loading weights", 0, self.sizes.num_moe_layers)
            self.model = build_model(spec.shape, placement, self.rank, self.size, seed=spec.seed,
                                     timeout=spec.collective_timeout_s)
            self._start_decoder()
            self.progress = ("starting the EPLB", 0, 1)  # memory registration (NIXL) can take a while
            self.eplb = EPLBState(spec.eplb, self.model, placement, self.rank, self.size, on_event=self._eplb_event,
                                  hooks=self._hooks(), communicator=self.comm)
            self._resume_eplb()
            self.progress = None
        self.mode = p.WorkerMode.DECODING
        self.report(p.PhaseDone, seq=0, step=self.step, result=p.Started(num_physical=placement.num_physical))
        self._warm_up_in_background()

    @staticmethod
    def _warm_up_in_background() -> None:
        """Once per process, the placement algorithm's compiled kernels load in a thread, so the
        first rebalance or rescale does not pay for it (every later EPLBState, one per rescale,
        finds them loaded). A starting rank does it after its group is up: loading them (about
        0.5 s of CPU, part of it under the GIL) beside the group's join made a rank of four fresh
        processes on 2 cores miss a 0.5 s rendezvous (2 of 7 runs of the command-launcher start
        test). A worker forked from the preloaded forkserver finds them loaded already."""
        threading.Thread(target=warm_up, name="eplb-warm-up", daemon=True).start()

    def _initial_placement(self) -> Placement:
        """The static placement, or the one the deployment starts from (``eplb.initial_placement``)."""
        spec = self.spec
        if spec.initial_placement is None:
            return Placement.static(self.sizes.num_moe_layers, self.sizes.num_logical_experts, spec.num_physical)
        placement = Placement.from_physical_to_logical(torch.tensor(spec.initial_placement, dtype=torch.int64),
                                                       self.sizes.num_logical_experts)
        if (placement.num_layers, placement.num_physical) != (self.sizes.num_moe_layers, spec.num_physical):
            raise ValueError(f"the initial placement is [{placement.num_layers}, {placement.num_physical}], this rank "
                             f"needs [{self.sizes.num_moe_layers}, {spec.num_physical}]")
        return placement

    def _standby(self) -> p.Rescale | None:
        """Launched ahead of a scale-up: allocate the weights and fault their pages in now, while
        the old group still decodes (on the pause this is pure cost), then wait for the Rescale.

        Returns it, or None after a Shutdown (the scale failed before its rescale). Reports
        keep coming, so the coordinator tells a waiting rank from a dead one; a coordinator that
        never sends either is given up on after ``standby_timeout_s``.
        """
        spec = self.spec
        self.mode = p.WorkerMode.STANDBY
        started = time.perf_counter()
        with self._busy(p.WorkerMode.STANDBY):
            self.faults.slow_prepare(self._set_progress)
            self._prepared_weights = self.sizes.allocate(spec.num_physical // spec.size)
            for i, layer in enumerate(self._prepared_weights):
                self.progress = ("allocating expert weights", i, len(self._prepared_weights))
                for tensor in layer:
                    tensor.zero_()  # touch every page: the kernel maps them now, not during the transfer
            self.progress = ("registering memory", 0, 1)
            self.comm.set_incoming(self._prepared_weights)  # memory registration (NIXL), also ahead of the pause
            self.progress = None
        # ready: the coordinator starts the pause only now, so the old group decodes meanwhile
        self.report(p.PhaseDone, seq=spec.standby_seq, step=self.step,
                    result=p.StandbyReady(prepare_seconds=time.perf_counter() - started))
        deadline = time.monotonic() + spec.standby_timeout_s
        refusal = "this rank has not joined a group yet"
        command = self._wait_for_rescale(p.WorkerMode.STANDBY, refusal, spec.standby_timeout_s, accept=(p.Prepare,))
        if isinstance(command, p.Prepare):  # the scale prepares: join the standby group, receive the experts
            self.faults.at_command(command)
            self._prepare_joining(command)
            command = self._wait_for_rescale(p.WorkerMode.STANDBY, refusal, max(1.0, deadline - time.monotonic()))
        assert command is None or isinstance(command, p.Rescale)
        return command

    def _resume_eplb(self) -> None:
        group = self._in_group()
        self._attach_comm(group.generation)
        # the config of this generation: num_nodes of its hosts
        self.eplb.start_worker(group.build_eplb_group(), group.generation, config=self._eplb_config(group.hosts),
                               rebuild_group=self._rebuild_eplb_group, hosts=group.hosts)
        self.eplb.resume()

    def _rebuild_eplb_group(self) -> Any:
        """A fresh EPLB group after a failed layer (gloo closes a pair on a timeout, so every later
        layer on the old one would fail too); every rank calls this at the same agreed step."""
        old = self._in_group().eplb_group
        group = self._in_group().build_eplb_group()
        if old is not None:
            dist.destroy_process_group(old)
        return group

    # -- commands --------------------------------------------------------------------------
    def _take(self, command: p.Command) -> None:
        """File a received command. ``received_seq`` is the end of the gap-free run received:
        every command up to it is here (or done), so agreeing on it never names a missing one."""
        if command.seq <= self.executed_seq or command.seq in self.pending:
            return  # a duplicate delivery
        self.pending[command.seq] = command
        while self.received_seq + 1 in self.pending:
            self.received_seq += 1

    def _poll_inbox(self, block_until: int | None = None, timeout: float = 0.0) -> None:
        """Move commands from the queue to ``pending``; with ``block_until``, wait (at most
        ``timeout``) until every command up to that seq is here. Never skips a number."""
        deadline = time.monotonic() + timeout
        while True:
            waiting = block_until is not None and self.received_seq < block_until
            try:
                command = self.inbox.get(block=waiting, timeout=max(0.0, deadline - time.monotonic()) if waiting else None)
            except queue.Empty:
                if block_until is not None and self.received_seq < block_until:
                    raise TimeoutError(f"command {self.received_seq + 1} (of up to {block_until}, agreed by the group) "
                                       f"did not arrive within {timeout:.1f}s") from None
                return
            self._take(command)

    def _run_commands_up_to(self, seq: int) -> bool:
        """Execute every command up to ``seq``; False when the group changed (restart the step)."""
        if self.received_seq < seq:
            self._poll_inbox(block_until=seq, timeout=self.spec.collective_timeout_s)
        while self.executed_seq < seq and not self.stopping:
            command = self.pending.pop(self.executed_seq + 1)
            self.executed_seq = command.seq
            self._execute(command)
            if isinstance(command, p.Rescale):
                return False  # a new group: the next step starts with its own step-boundary sync
        return True

    def _execute(self, command: p.Command) -> None:
        """Run one command (at its agreed step): the handler its type names in ``_HANDLERS``."""
        self.faults.at_command(command)
        handler = self._HANDLERS.get(type(command))
        if handler is None:
            raise TypeError(f"unknown command {command!r}")
        handler(self, command)

    def _on_drain(self, command: p.Drain) -> None:
        self.eplb.begin_drain()
        self.mode = p.WorkerMode.DRAINING
        self.draining_op = command  # reported done at the step the agreed BUSY reads 0
        self.drain_started_step = self.step
        # the pace before the operation: a joining rank's start during draining slows these steps
        self._steady_step_s = self._steady_step_seconds()

    def _on_prepare(self, command: p.Prepare) -> None:
        """The prepare sub-phase of draining, at this agreed step on every rank of the old group
        (:mod:`elastic.worker.prepare`): stop the drained EPLB, plan the rescale, form the
        standby group; the pre-transfer then goes a layer per step (:meth:`_advance_preparation`)."""
        if not self.eplb.drained:
            raise RuntimeError("prepare before the drain finished: a transfer is still in flight")
        self._discard_preparation()
        started_at, started = time.monotonic(), time.perf_counter()
        new_rank = command.spec.mapping[self.rank]
        scale_up = command.spec.execute_on == "new"
        with self._busy(p.WorkerMode.DRAINING):  # joining the thread, the rendezvous: busy, not silent
            if not self.eplb.stop_worker(timeout=self.spec.collective_timeout_s):
                raise TimeoutError("the async EPLB thread did not stop in time")
            try:
                self._prepare_serving_rank(command, new_rank, scale_up, started_at, started)
                if self.preparation is not None:  # decoding waited for all of this: the pacing counts it
                    self.preparation.setup_seconds = time.perf_counter() - started
                    self.preparation.steady_step_s = self._steady_step_s
            except Exception as exc:  # noqa: BLE001 - the scale fails; the serving group must not break for it
                self._prepare_failed = True  # voted at the next step boundary: every rank drops its preparation
                self._discard_preparation()
                self.report(p.WorkerError, step=self.step, where="prepare", error_type=type(exc).__name__,
                            message=f"prepare failed: {exc}", traceback=traceback.format_exc(), fatal=False,
                            seq=command.seq)

    def _prepare_serving_rank(self, command: p.Prepare, new_rank: int, scale_up: bool, started_at: float,
                              started: float) -> None:
        """An old rank's part of Prepare: the plan, the standby group, what the joining ranks need."""
        standby: StandbyGroup | None = None
        try:
            base = self.eplb.placement
            mark = time.perf_counter()
            rescale = command.spec
            placement = self._next_placement(rescale, base, base.physical_to_logical)
            # a scale up runs on the standby group: planned once it formed, with its hosts (as the joining ranks do)
            plans = None if scale_up else self._layer_plans(rescale, base.physical_to_logical, placement)
            placement_seconds = time.perf_counter() - mark
            mark = time.perf_counter()
            standby = self._form_standby(command, new_rank) if new_rank >= 0 else None
            if plans is None:
                plans = self._layer_plans(rescale, base.physical_to_logical, placement,
                                          hosts=standby.hosts if standby is not None else ())
            if scale_up:
                assert standby is not None
                # the joining ranks learn the maps from the lowest survivor, and a Hugging Face
                # model's replicated weights too, over the standby group
                payload: list[Any] = [{"base": base.physical_to_logical, "placement": placement.physical_to_logical}]
                source = command.spec.source
                dist.broadcast_object_list(payload, group=standby.pg, group_src=source)
                if self.decoder is not None and command.spec.joining:
                    self.model.sync_non_expert(src=source, group=standby.pg, timeout=self.spec.collective_timeout_s)
            group_seconds = time.perf_counter() - mark
            self.preparation = self._preparation(command, new_rank if scale_up else self.rank, new_rank, standby, base,
                                                 placement, plans, started_at, started)
        except BaseException:
            if standby is not None and self.preparation is None:
                self._drop_standby(standby)
            raise
        self.preparation.placement_seconds, self.preparation.group_seconds = placement_seconds, group_seconds
        self._comm_for_prepare(command)

    def _prepare_joining(self, command: p.Prepare) -> None:
        """A joining rank's prepare: the standby group, the maps, its model, then every
        pre-transferred layer straight into its fresh weights, as the old group sends them."""
        started_at, started = time.monotonic(), time.perf_counter()
        spec = self.spec
        with self._busy(p.WorkerMode.STANDBY):
            mark = time.perf_counter()
            standby = self._form_standby(command, self.rank)
            payload: list[Any] = [None]
            source = command.spec.source
            dist.broadcast_object_list(payload, group=standby.pg, group_src=source)
            base = Placement.from_physical_to_logical(payload[0]["base"], self.sizes.num_logical_experts)
            placement = Placement.from_physical_to_logical(payload[0]["placement"], self.sizes.num_logical_experts)
            # built on the old maps (as rank 0 of the old group: the same slots per rank); the new
            # placement is installed at adoption
            self.model = build_model(spec.shape, base, 0, len(command.spec.mapping), seed=spec.seed,
                                     timeout=spec.collective_timeout_s, joining=True)
            self.model.replace_weights([])
            self._start_decoder()
            if self.decoder is not None:
                self.non_expert_sync = self.model.sync_non_expert(src=source, group=standby.pg,
                                                                  timeout=spec.collective_timeout_s)
            group_seconds = time.perf_counter() - mark
            rescale = command.spec
            plans = self._layer_plans(rescale, base.physical_to_logical, placement, hosts=standby.hosts)
            prep = self._preparation(command, self.rank, self.rank, standby, base, placement, plans, started_at, started)
            prep.group_seconds = group_seconds
            self._comm_for_prepare(command)
            weights = self._prepared_weights
            assert weights is not None
            # the old group sends a layer when its share allows: wait for each as long as a standby rank waits
            wait_s = max(1.0, spec.standby_timeout_s)
            for index, layer in enumerate(prep.layers):
                self.progress = ("pre-transfer", index, len(prep.layers))
                self._wait_for_layer_start(command.spec.generation, index, wait_s)
                self.faults.mid_prestage(index)
                self.faults.before_layer(layer)
                mark = time.perf_counter()
                stats = execute_layer(plans[layer], self.rank, None, weights[layer], group=standby.pg, timeout=wait_s,
                                      max_ops_per_batch=spec.eplb.max_ops_per_batch, layer=layer,
                                      reload_fn=functools.partial(self._canonical, layer), communicator=self.comm,
                                      migration_batching=spec.eplb.enable_migration_batching, start_together=True)
                prep.spent += time.perf_counter() - mark
                prep.bytes_received += stats.bytes_received
                prep.next_index = index + 1
            self.progress = None
        self.preparation = prep
        self._done(command, prep.done(time.monotonic(), time.perf_counter()))

    def _wait_for_layer_start(self, generation: int, index: int, wait_s: float) -> None:
        """A joining rank waits here, not in a collective, until the old ranks start pre-transfer
        layer ``index`` (:meth:`_announce_layer_start`). The old ranks hold each layer for up to
        ``1 / prestage_share`` times its transfer time, longer than the standby group's collective
        timeout on a slow link; a collective waited in for that long would break the group. The
        start all-reduce (``start_together``) then meets the old ranks at the same agreed step."""
        prefix = dist.PrefixStore(f"elastic/gen{generation}/", self.store)
        key = f"{PRESTAGE_LAYER_KEY}{index}"
        deadline = time.monotonic() + wait_s
        pause = 1e-3
        while not prefix.check([key]):
            raise_if_aborted(prefix, generation)
            if time.monotonic() >= deadline:
                raise TransferTimeout(f"the old group did not start pre-transfer layer {index} within {wait_s:g}s",
                                      rank=self.rank, timeout=wait_s, waiting=f"the start of pre-transfer layer {index}")
            time.sleep(pause)
            pause = min(0.02, pause * 2)

    def _announce_layer_start(self, prep: Preparation) -> None:
        """An old rank of a scale up tells the joining ranks it starts the next pre-transfer layer
        (every old rank sets the same key; they start it at the same agreed step)."""
        if prep.command.spec.execute_on == "new":
            dist.PrefixStore(f"elastic/gen{prep.command.spec.generation}/", self.store).set(
                f"{PRESTAGE_LAYER_KEY}{prep.next_index}", "1")

    def _advance_preparation(self, words: list[int]) -> None:
        """One decode step of an old rank's pre-transfer: the next layer, unless a rank holds
        (its share of the wall time is spent) or failed (then every rank drops the preparation
        at this same step, and the old group keeps serving)."""
        prep = self.preparation
        assert prep is not None
        prep.steps += 1
        hold, failed = words
        if failed:
            self._discard_preparation()
            return
        if prep.failed is not None:
            return
        if not prep.complete and not hold:
            self._prestage_next(prep)
        if prep.complete and prep.failed is None and not prep.reported:
            prep.reported = True
            self._done(prep.command, prep.done(time.monotonic(), time.perf_counter()))

    def _prestage_next(self, prep: Preparation) -> None:
        """Move the next pre-transferred layer: sends from the serving weights; a survivor
        receives into, and stages, the new contents of the slots it changes (it keeps serving
        from its weights until the switch)."""
        layer = prep.layers[prep.next_index]
        mark = time.perf_counter()
        try:
            self._announce_layer_start(prep)
            self.faults.mid_prestage(prep.next_index)
            self.faults.before_layer(layer)
            plan = prep.plans[layer]
            weights = self.model.expert_weights()[layer]
            rank_plan = plan.for_rank(prep.executing_rank)
            # within half a collective timeout: a rank whose peer gave up on this layer must come
            # back to the step-boundary all-reduce before its peers there time out (which would
            # break the serving group for a scale that only had to fail)
            timeout = min(self.spec.eplb.transfer_timeout_s, self.spec.collective_timeout_s / 2)
            staged = None
            if prep.new_rank >= 0 and rank_plan.changed_slots:
                # the whole new layer: a copy of the serving one with the changed slots filled in
                # (kept slots copied now, not in the pause); the switch swaps it in
                staged = [t.clone() for t in weights]
                self.comm.add_buffer(staged, transient=True)  # received into (NIXL); it is the weights after the switch
            stats = execute_layer(plan, prep.executing_rank, weights, staged, group=prep.group, timeout=timeout,
                                  max_ops_per_batch=self.spec.eplb.max_ops_per_batch, layer=layer,
                                  reload_fn=functools.partial(self._canonical, layer), communicator=self.comm,
                                  migration_batching=self.spec.eplb.enable_migration_batching,
                                  # a one-sided reader (a joining rank) reads only inside this step,
                                  # which the pacing counts, not while this rank decodes
                                  start_together=True)
            if staged is not None:
                prep.received[layer] = staged
            prep.bytes_received += stats.bytes_received
            prep.next_index += 1
        except Exception as exc:  # noqa: BLE001 - the scale fails; the old group goes on serving
            prep.failed = f"layer {layer}: {type(exc).__name__}: {exc}"
            self.report(p.WorkerError, step=self.step, where="prepare", error_type=type(exc).__name__,
                        message=f"pre-transfer of layer {layer} failed: {exc}", fatal=False, seq=prep.command.seq)
        finally:
            prep.spent += time.perf_counter() - mark

    def _form_standby(self, command: p.Prepare, new_rank: int) -> StandbyGroup:
        return StandbyGroup.form(self.store, command.spec.generation, new_rank, command.spec.new_size, backend=self.spec.backend,
                                 timeout_s=self.spec.collective_timeout_s, rendezvous_timeout_s=self.spec.join_timeout_s)

    def _preparation(self, command: p.Prepare, executing_rank: int, new_rank: int, standby: StandbyGroup | None,
                     base: Placement, placement: Placement, plans: list[LayerPlan], started_at: float,
                     started: float) -> Preparation:
        """The preparation record, with the layers that move ahead (the same on every rank): the
        ranks that keep serving receive into spare memory, within the budget."""
        if command.spec.execute_on == "new":
            bounded = list(command.spec.survivors)
        else:
            bounded = [old for old, n in enumerate(command.spec.mapping) if n >= 0]
        layers = prestage_layers(plans, self.sizes.expert_bytes, command.prestage_max_bytes, bounded)
        return Preparation(command=command, executing_rank=executing_rank, new_rank=new_rank, standby=standby,
                           base=base, placement=placement, plans=plans, layers=layers,
                           group=standby.pg if command.spec.execute_on == "new" and standby is not None else None,
                           started_at=started_at, started=started)

    def _comm_for_prepare(self, command: p.Prepare) -> None:
        """The pre-transfer of a scale up moves over the standby generation: bind the communicator to it."""
        if command.spec.execute_on == "new":
            self.comm.bind(command.spec.generation, dist.PrefixStore(f"elastic/gen{command.spec.generation}/", self.store))
            if self.model.expert_weights():
                self.comm.set_weights(self.model.expert_weights())

    def _discard_preparation(self) -> None:
        """Drop a preparation (the scale failed, or a rescale that is not it came): the standby
        group is unregistered and kept referenced (a gloo group whose peer died can block in its
        teardown), the spare rows are freed. The serving group is untouched."""
        prep, self.preparation = self.preparation, None
        if prep is None:
            return
        if prep.standby is not None:
            self._drop_standby(prep.standby)
        for staged in prep.received.values():
            self.comm.remove_buffer(staged)  # deregistered before it is freed
        prep.received.clear()

    def _drop_standby(self, standby: StandbyGroup) -> None:
        """A standby group of a scale that failed: unregistered, then shut down (its gloo pairs,
        threads and sockets would otherwise stay for the life of the process, one set per failed
        scale). The serving group is another group: nothing of it waits on this one."""
        pg = standby.discard()
        mark = time.perf_counter()
        with self._busy(self.mode):  # a teardown that waits on a dead peer's failed work: busy, not silent
            shutdown_detached([pg])
        log.info("rank %d: standby group of generation %d shut down in %.3fs", self.rank, standby.generation,
                 time.perf_counter() - mark)

    def _take_preparation(self, cmd: p.Rescale) -> Preparation | None:
        """The preparation a prepared rescale switches with; any other rescale drops it first."""
        if not cmd.prepared:
            self._discard_preparation()
            return None
        prep, self.preparation = self.preparation, None
        if prep is None or not prep.matches(cmd) or not prep.complete or prep.failed is not None:
            self.preparation = prep
            self._discard_preparation()
            raise RuntimeError("a prepared rescale, but this rank has no complete preparation for it")
        return prep

    def _switch_to(self, standby: StandbyGroup) -> None:
        """The standby group becomes this rank's group; the old generation's groups are detached
        (shut down at Resume, after the pause)."""
        if self._eplb is not None:
            self._eplb.release_group()
        self.group, detached = standby.install()
        self._detached.extend(detached)

    def _on_suppress(self, command: p.Suppress) -> None:
        if not self.eplb.drained:
            raise RuntimeError("suppress before the drain finished: a transfer is still in flight")
        started = time.perf_counter()
        with self._busy(p.WorkerMode.SUPPRESSED):  # joining the thread: busy, not silent
            if not self.eplb.stop_worker(timeout=self.spec.collective_timeout_s):
                raise TimeoutError("the async EPLB thread did not stop in time")
        self.mode = p.WorkerMode.SUPPRESSED
        joined = time.perf_counter() - started
        self._announced = None
        announced = command.announced
        if announced is not None and self.preparation is None:  # a scale down follows: its placement is computed now
            base = self.eplb.placement
            placement = self._next_placement(announced, base, base.physical_to_logical)
            plans = self._layer_plans(announced, base.physical_to_logical, placement)
            self._announced = (announced, base, placement, plans)
        self._done(command, p.SuppressDone(join_seconds=joined, threads=_thread_names(), announced=command.announced is not None,
                                           placement_seconds=time.perf_counter() - started - joined))

    def _on_rescale(self, command: p.Rescale) -> None:
        self._rescale(command, fresh=False)

    def _on_resume(self, command: p.Resume) -> None:
        started = time.perf_counter()
        with self._busy(p.WorkerMode.RESUMING):  # the EPLB group and memory registration: not silence
            shutdown_detached(self._detached)  # the old generation's groups, after the pause
            self._resume_eplb()
            self._released.clear()  # the weight tensors the switch swapped out (deregistered by now)
        self._step_ends.clear()  # the steady pace is this group's, from its own steps
        self.mode = p.WorkerMode.DECODING
        self._done(command, p.ResumeDone(seconds=time.perf_counter() - started, threads=_thread_names()))

    def _on_rebalance_now(self, command: p.RebalanceNow) -> None:
        if not self.eplb.draining and self.eplb.all_idle:
            self.eplb.rebalance_now()
        # under way counts as started: in flight here, or still busy on another rank (agreed
        # BUSY) after this rank's own worker already finished
        under_way = self.eplb.in_flight is not None or not self.eplb.all_idle
        self._done(command, p.RebalanceAck(started=under_way or not self.spec.eplb.use_async))

    def _on_verify(self, command: p.Verify) -> None:
        self._done(command, self._verify())

    def _on_export_placement(self, command: p.ExportPlacement) -> None:
        placement, window = self.eplb.placement, self.eplb.window
        self._done(command, p.PlacementExport(
            physical_to_logical=tuple(tuple(row) for row in placement.physical_to_logical.tolist()),
            logical_load=tuple(tuple(row) for row in window.total().tolist()), window_steps=window.filled,
            digest=placement_digest(placement), size=self.size))

    def _on_probe(self, command: p.Probe) -> None:
        probe = getattr(self.model, "probe", None)
        if probe is None:
            raise TypeError("the reference model has no probe batch (probes are for real models, kind: hf)")
        started = time.perf_counter()
        result = probe()
        self._done(command, p.ProbeDone(digest=result.digest, tokens=tuple(tuple(row) for row in result.tokens.tolist()),
                                        seconds=time.perf_counter() - started))

    def _on_stop_eplb(self, command: p.StopEPLB) -> None:
        self.eplb.begin_drain()  # nothing starts again until a recovery's Resume
        with self._busy(p.WorkerMode.HALTED):  # joining the thread (a transfer may end first): busy, not silent
            if not self.eplb.stop_worker(timeout=self.spec.eplb.transfer_timeout_s + self.spec.collective_timeout_s):
                raise TimeoutError("the async EPLB thread did not stop in time")
        self._discard_preparation()  # the scale failed: the standby group and the spare rows go
        self.mode = p.WorkerMode.HALTED
        self._done(command, p.EPLBStopped(threads=_thread_names()))

    def _on_admit(self, command: p.Admit) -> None:
        if self.requests is not None:
            self.requests.admit(command.requests)

    def _on_cancel(self, command: p.Cancel) -> None:
        if self.requests is not None:
            self.requests.cancel(command.request_ids)

    def _on_shutdown(self, command: p.Shutdown) -> None:
        self.stopping = True
        self._done(command, p.ShutdownDone())

    #: one handler per command type: the whole of what a worker does with its commands
    _HANDLERS: dict[type, Any] = {
        p.Drain: _on_drain, p.Prepare: _on_prepare, p.Suppress: _on_suppress, p.Rescale: _on_rescale, p.Resume: _on_resume,
        p.RebalanceNow: _on_rebalance_now, p.Verify: _on_verify,
        p.ExportPlacement: _on_export_placement, p.Probe: _on_probe, p.StopEPLB: _on_stop_eplb,
        p.Admit: _on_admit, p.Cancel: _on_cancel, p.Shutdown: _on_shutdown,
    }

    def _done(self, command: p.Command, result: p.Result) -> None:
        assert isinstance(result, p.RESULT_OF[type(command)]), (command, result)
        self.report(p.PhaseDone, seq=command.seq, operation_id=command.operation_id, step=self.step, result=result)

    def _verify(self) -> p.VerifyResult:
        placement = self.eplb.placement
        from torch.distributed import distributed_c10d

        return p.VerifyResult(
            threads=tuple(_thread_names()),
            process_groups=len(distributed_c10d._world.pg_map),
            rss_bytes=_rss_bytes(),
            expert_weight_bytes=sum(t.numel() * t.element_size() for layer in self.model.expert_weights() for t in layer),
            staging_bytes=sum(t.numel() * t.element_size() for t in self.eplb.staging),
            mismatched=tuple(self.model.verify()),
            digest=placement_digest(placement),
            replica_min=int(placement.replica_count.min()),
            num_physical=placement.num_physical,
            size=self.size,
            communicator=self.comm.stats(),
            hosts=tuple(self.group.hosts) if self.group is not None else (),
            num_nodes=self.eplb.config.policy_options.get("num_nodes", 1),
        )

    # -- rescale ---------------------------------------------------------------------------
    @contextlib.contextmanager
    def _busy(self, what: p.WorkerMode):
        """While a long blocking phase runs (rendezvous, loading, transfers), a thread keeps
        reporting liveness, and ``self.progress`` when set, so the coordinator can tell "busy"
        from "gone" and a slow load from a stuck one; a frozen process still falls silent."""
        done = threading.Event()

        def beat() -> None:
            while True:
                self.report(p.Heartbeat, step=self.step, state=what, progress=self.progress,
                            balancedness=self._eplb.stats.last_balancedness if self._eplb else 1.0)
                if done.wait(self.spec.heartbeat_s):
                    return

        thread = threading.Thread(target=beat, name=f"busy-heartbeat-{what}", daemon=True)
        thread.start()
        try:
            yield
        finally:
            done.set()
            thread.join()

    def _rescale(self, cmd: p.Rescale, *, fresh: bool) -> None:
        with self._busy(p.WorkerMode.RESCALING):
            self._rescale_blocking(cmd, fresh=fresh)

    def _rescale_blocking(self, cmd: p.Rescale, *, fresh: bool) -> None:
        """Redistribute experts by ``cmd.spec.mapping`` and move to generation ``cmd.spec.generation``."""
        started = time.perf_counter()
        if self._eplb is not None and self._eplb.running:
            raise RuntimeError("rescale while the async EPLB worker runs: suppress it first")
        new_rank = cmd.spec.mapping[self.rank] if not fresh else self.rank
        prep = self._take_preparation(cmd)  # a prepared scale: the standby group and what moved ahead
        if not cmd.spec.keep_requests and self.requests is not None:
            self.requests.clear()  # a recovery: the coordinator replays every request from its prompt
        # group destroy + rendezvous; redistribution (wall, and this process's CPU incl. gloo threads)
        timing: dict[str, Any] = {"group_seconds": 0.0, "transfer_seconds": 0.0, "transfer_cpu_seconds": 0.0,
                                  "prepared": prep is not None}
        if cmd.spec.execute_on == "old":
            # scale down: every expert a leaving rank holds that the new placement needs is
            # sent out over the old group, and only then is the group replaced.
            # Drained: every rank committed the same layers, so its own maps are everyone's.
            base, diverged = self.eplb.placement, []
            held = base.physical_to_logical
            announced = self._prepared_plan(prep, base) if prep is not None else self._announced_plan(cmd.spec, base)
            timing["announced"] = announced is not None  # placement and plans made at Suppress (or Prepare)
            new_placement, new_weights, bytes_moved, undo = self._move_experts(cmd, base, held, self.rank, timing,
                                                                               announced, prep)
            mark = time.perf_counter()
            if new_rank < 0:
                # reported first: its teardown pauses nobody (the survivors decode on without it)
                self._retire(cmd, started, bytes_moved, timing)
                if prep is not None:
                    # and it waits for the survivors' switch: freeing this process's memory while they
                    # copy slots in place slowed their copies 1.4-1.7x on 2 cores (measured)
                    self._await_switch(cmd)
                self._destroy_group()
                return
            try:
                if prep is not None:
                    assert prep.standby is not None
                    self._switch_to(prep.standby)
                    dist.barrier()  # every survivor holds the new placement before any adopts it
                    if new_rank == 0:  # the leaving ranks may go now
                        dist.PrefixStore(f"elastic/gen{cmd.spec.generation}/", self.store).set(SWITCHED_KEY, "1")
                else:
                    self._destroy_group()
                    self.group = self._join(cmd, new_rank)
            except BaseException:
                self._undo(undo)  # the weights go back to the old placement this rank still has
                raise
            timing["group_seconds"] = time.perf_counter() - mark
        else:
            # scale up or recovery: form the new group first, then move over it
            mark = time.perf_counter()
            if prep is not None:
                assert prep.standby is not None
                self._switch_to(prep.standby)  # formed in draining: the pause only swaps it in
            else:
                self._destroy_group()
                if new_rank < 0:
                    timing["group_seconds"] = time.perf_counter() - mark
                    self._retire(cmd, started, 0, timing)
                    return
                self.group = self._join(cmd, new_rank)
            timing["group_seconds"] = time.perf_counter() - mark
            if prep is None:
                self.non_expert_sync = None
            mark = time.perf_counter()
            base, held, source_started = self._share_state(cmd, new_rank, fresh, started, prepared=prep is not None)
            timing["share_seconds"] = time.perf_counter() - mark  # step, maps, window, request batch
            if fresh:
                # a joining rank waited, standing by, while the old group still decoded: its part of the
                # pause starts when the old group stopped (the lowest survivor's start, as it said)
                timing["waited_seconds"] = max(0.0, source_started - started)
                started = source_started
            if self.non_expert_sync is not None:  # a Hugging Face model's replicated weights, from a peer
                timing["non_expert_bytes"] = self.non_expert_sync["bytes"]
                timing["non_expert_seconds"] = self.non_expert_sync["seconds"]
            # layers where some survivor's slots hold what the base maps do not (a torn commit)
            diverged = sorted({int(x) for x in (held != base.physical_to_logical).any(dim=1).nonzero().flatten()})
            announced = self._prepared_plan(prep, base) if prep is not None else None
            new_placement, new_weights, bytes_moved, undo = self._move_experts(cmd, base, held, new_rank, timing,
                                                                               announced, prep)
        mark = time.perf_counter()
        self._adopt(new_rank, cmd, new_placement, new_weights)
        timing["adopt_seconds"] = time.perf_counter() - mark
        self.broken = False
        self.mode = p.WorkerMode.RESUMING
        if new_rank == 0 and self.requests is not None:  # what the new group decodes: the coordinator re-admits the rest
            self.report(p.RequestsHeld, seq=cmd.seq, held=self.requests.held())
        self.report(p.PhaseDone, seq=cmd.seq, operation_id=cmd.operation_id, step=self.step, result=p.RescaleDone(
            retired=False, bytes_received=bytes_moved, seconds=time.perf_counter() - started,
            digest=placement_digest(self.eplb.placement), num_physical=self.eplb.placement.num_physical,
            placement_before=held.tolist(), diverged_layers=tuple(diverged),
            placement_after=self.eplb.placement.physical_to_logical.tolist(), timing=timing))

    def _join(self, cmd: p.Rescale, new_rank: int) -> GroupGeneration:
        spec = self.spec
        return GroupGeneration.join(self.store, cmd.spec.generation, new_rank, cmd.spec.new_size, backend=spec.backend,
                                    timeout_s=spec.collective_timeout_s, rendezvous_timeout_s=spec.join_timeout_s)

    def _move_experts(self, cmd: p.Rescale, base: Placement, held: torch.Tensor, executing_rank: int,
                      timing: dict[str, Any], announced: tuple[Placement, list[LayerPlan]] | None = None,
                      prep: Preparation | None = None):
        """The new placement (unless ``announced`` with its plans), the redistribution and the
        all-or-nothing barrier, timed into ``timing``; returns ``(placement, weights, bytes, undo log)``.
        With ``prep``, its layers moved ahead of the pause and are only finished here."""
        mark, cpu = time.perf_counter(), time.process_time()
        new_placement, plans = announced or (self._next_placement(cmd.spec, base, held), None)
        timing["placement_seconds"] = time.perf_counter() - mark
        weights, received, undo, networked, copied = self._redistribute(cmd, held, new_placement, executing_rank,
                                                                        plans=plans, prestaged=prep)
        timing["copy_bytes"] = copied
        timing["prestaged_layers"] = 0 if prep is None else len(prep.layers)
        barrier = time.perf_counter()
        if networked or (prep is not None and cmd.spec.execute_on == "new"):
            # every rank's transfers are done before anyone tears the group down or adopts;
            # without network transfers, the next rendezvous (or Resume) is that meeting point
            self._barrier_or_undo(undo)
        timing["barrier_seconds"] = time.perf_counter() - barrier
        timing["transfer_seconds"] = time.perf_counter() - mark
        timing["transfer_cpu_seconds"] = time.process_time() - cpu
        return new_placement, weights, received, undo

    def _prepared_plan(self, prep: Preparation, base: Placement) -> tuple[Placement, list[LayerPlan]]:
        """The placement and plans made at Prepare; the maps must not have changed since."""
        if not prep.base.equals(base):
            raise RuntimeError("the placement changed between Prepare and the rescale (the EPLB was off)")
        return prep.placement, prep.plans

    def _share_state(self, cmd: p.Rescale, new_rank: int, fresh: bool, started: float,
                     prepared: bool = False) -> tuple[Placement, torch.Tensor, float]:
        """Agree on the state the new group starts from; returns ``(base placement, held rows, when the
        lowest survivor began its rescale, on this rank's clock)``.

        The lowest surviving rank sends step, placement and load window to every rank of the
        new group: its placement is the *base* the policy starts from. What the weights hold
        may differ from it: after a peer died mid-all-reduce some survivors may have committed
        an async layer that others did not. So each survivor also contributes its own maps, and
        the *held* rows (``[layers, P]``) take each survivor's slots from that survivor's own
        placement: the transfer plan moves experts from where they really are (an expert no
        survivor holds is reloaded). A survivor's own placement stays untouched until it adopts
        the new one, so a failed attempt leaves its maps matching its weights.
        """
        survivors = cmd.spec.survivors
        source = min(survivors)
        payload: list[Any] = [None]
        if new_rank == source:
            payload = [{
                "elapsed": time.perf_counter() - started,  # since this rank stopped decoding for the rescale
                "batch_index": self.decoder.batch_index if self.decoder is not None else -1,
                "step": self.step,
                "p2l": self.eplb.placement.physical_to_logical,
                "window": self.eplb.window.state(),
                "stats": self.eplb.stats,
                "steps_since_rebalance": self.eplb.steps_since_rebalance,
                # the request batch with its KV caches: a joining rank goes on decoding it
                "requests": self.requests.export() if cmd.spec.keep_requests and self.requests is not None else [],
            }]
        dist.broadcast_object_list(payload, src=source)
        state = payload[0]
        source_started = time.perf_counter() - state["elapsed"]  # on this rank's clock, to a broadcast's latency
        own: list[Any] = [None] * cmd.spec.new_size
        base = Placement.from_physical_to_logical(state["p2l"], self.sizes.num_logical_experts)
        if prepared:
            # drained, the EPLB off since Prepare: every survivor holds the base maps (checked here,
            # locally; a survivor whose maps differ fails the rescale and the others roll back)
            if not fresh and not self.eplb.placement.equals(base):
                raise RuntimeError("this survivor's maps differ from the lowest survivor's after a drain")
        else:
            dist.all_gather_object(own, None if fresh else (self.rank, self.eplb.placement.physical_to_logical))
        self.step = state["step"]
        held = base.physical_to_logical.clone()
        per_rank = held.shape[1] // len(cmd.spec.mapping)
        for entry in own:
            if entry is not None:
                old_rank, rows = entry
                held[:, old_rank * per_rank : (old_rank + 1) * per_rank] = rows[:, old_rank * per_rank : (old_rank + 1) * per_rank]
        if fresh:
            if not prepared:  # a prepared joining rank built its model at Prepare
                # nothing read from disk: experts arrive by the rescale's plan, a Hugging Face model's
                # other weights from the lowest survivor (below)
                # built on the old maps (as rank 0 of the old group: the same slots per rank); the new
                # placement is installed at adoption
                self.model = build_model(self.spec.shape, base, 0, len(cmd.spec.mapping), seed=self.spec.seed,
                                         timeout=self.spec.collective_timeout_s, joining=True)
                self.model.replace_weights([])
                self._start_decoder()
            self.eplb = EPLBState(self.spec.eplb, self.model, base, new_rank, cmd.spec.new_size, on_event=self._eplb_event,
                                  hooks=self._hooks(), communicator=self.comm)
            self.eplb.carry_over(LoadWindow.from_state(state["window"]), state["stats"], state["steps_since_rebalance"])
        else:
            self.eplb.carry_over(LoadWindow.from_state(state["window"]))
        if self.requests is not None:
            self.requests.restore(state["requests"])  # every rank of the new group, the same batch
        if self.decoder is not None:
            self.decoder.batch_index = state["batch_index"]  # every rank goes on with the same batches
            if cmd.spec.new_size > len(survivors) and not prepared:  # fresh ranks: the replicated weights from a survivor
                self.non_expert_sync = self.model.sync_non_expert(src=source, group=None,
                                                                  timeout=self.spec.collective_timeout_s)
        return base, held, source_started

    def _announced_plan(self, cmd: p.RescaleSpec, base: Placement) -> tuple[Placement, list[LayerPlan]] | None:
        """The placement and layer plans computed at Suppress for this very scale down, if nothing
        changed since (same mapping and size, same maps: the EPLB was off); None otherwise."""
        announced, self._announced = self._announced, None
        if announced is None:
            return None
        plan, maps, placement, plans = announced
        if (plan.mapping, plan.new_size) != (cmd.mapping, cmd.new_size) or cmd.lost or not maps.equals(base):
            return None
        return placement, plans

    def _layer_plans(self, cmd: p.RescaleSpec, held: torch.Tensor, new_placement: Placement,
                     hosts: tuple[str, ...] | None = None) -> list[LayerPlan]:
        """Every layer's transfer plan from the ``held`` rows to ``new_placement`` (pure), senders
        on the receiver's host first. ``hosts``: those of the executing group, the same list on
        every rank of it; default: this rank's group's (the executing group everywhere but at a
        scale up's Prepare, where the standby group's are passed)."""
        per_rank = held.shape[1] // len(cmd.mapping)
        old_holder, new_holder = holders_from_mapping(list(cmd.mapping), cmd.new_size, cmd.execute_on, frozenset(cmd.lost))
        hosts = self._in_group().hosts if hosts is None else hosts
        return [plan_layer(held[layer], new_placement.physical_to_logical[layer], per_rank, per_rank, old_holder, new_holder,
                           hosts=hosts or None)
                for layer in range(held.shape[0])]

    def _next_placement(self, cmd: p.RescaleSpec, old: Placement, held: torch.Tensor) -> Placement:
        """The placement for the new group: same slots per rank, a policy run on the carried window,
        slot-aligned to what the surviving ranks hold (``held``), so they keep those slots in place."""
        per_rank = old.num_physical // len(cmd.mapping)
        hosts = self._in_group().hosts
        if cmd.execute_on == "old":  # computed on the old group: the hosts of the survivors, in new rank order
            hosts = tuple(hosts[old] for _, old in sorted((new, old) for old, new in enumerate(cmd.mapping) if new >= 0))
        config = self._eplb_config(hosts)
        extra = {}
        if config.policy == "migration_aware" and "rank_mapping" not in config.policy_options:
            extra["rank_mapping"] = list(cmd.mapping)  # experts stay with the worker that holds them
        survivors = [-1 if r in cmd.lost else n for r, n in enumerate(cmd.mapping)]
        return placement_for(config, self.eplb.window.total(), per_rank * cmd.new_size, cmd.new_size, old,
                             held=held, held_mapping=survivors, **extra)

    def _redistribute(self, cmd: p.Rescale, held: torch.Tensor, new_placement: Placement, executing_rank: int,
                      plans: list[LayerPlan] | None = None, prestaged: Preparation | None = None):
        """Move every layer from the ``held`` rows (``[layers, P_old]``: what each old rank's slots
        hold) to the new placement; returns ``(weights, bytes received, undo log, networked, bytes
        copied locally)``, ``networked`` being whether any rank moved anything over the network in
        this call (the plan is global, so every rank gets the same answer).

        A surviving rank keeps its weight tensors (slots per rank do not change): each layer is
        received into a one-layer staging buffer and only the changed slots are written in
        place, after the layer's sends are done. Their previous contents go to an undo log, so a
        rescale that fails later is rolled back (:meth:`_undo`) and the old placement still
        matches the weights. A fresh rank allocates its weights. ``plans`` are the layer plans
        when already computed (:meth:`_layer_plans`). The layers of ``prestaged`` crossed the
        network before the pause: a survivor makes their staging from its received rows
        (the whole new layer, swapped in), a joining rank already holds them, a leaving rank sent them.
        """
        per_rank = held.shape[1] // len(cmd.spec.mapping)
        plans = self._layer_plans(cmd.spec, held, new_placement) if plans is None else plans
        ahead = set(prestaged.layers) if prestaged is not None else set()
        rows = prestaged.received if prestaged is not None else {}
        my_new_rank = executing_rank if cmd.spec.execute_on == "new" else cmd.spec.mapping[self.rank]
        old_weights = self.model.expert_weights() if self.model.expert_weights() else None
        in_place = my_new_rank >= 0 and old_weights is not None
        networked = any(plan.num_transfers for layer, plan in enumerate(plans) if layer not in ahead)
        if not networked and (in_place or my_new_rank < 0) and all(
                plan.for_rank(executing_rank).is_idle or (layer in ahead and not in_place)
                for layer, plan in enumerate(plans)):
            # nothing moves anywhere, nothing here changes
            return old_weights if in_place else None, 0, UndoLog(), False, 0
        staging: list[torch.Tensor] = []
        weights: list[list[torch.Tensor]] | None = None
        if in_place:
            assert old_weights is not None
            # a new list: a staged whole layer replaces its entry, and the model's list stays as it
            # was until adoption (the in-place layers are the same tensors)
            weights = list(old_weights)
            staging = [torch.empty_like(t) for t in old_weights[0]]
        else:
            if my_new_rank >= 0:
                prepared, self._prepared_weights = self._prepared_weights, None
                fits = prepared is not None and all(t.shape[0] == per_rank for layer in prepared for t in layer)
                weights = prepared if fits else self.model.allocate(per_rank)
        undo = UndoLog()
        self._comm_for_rescale(cmd, None if in_place else weights, staging if in_place else None)
        received = copied = 0
        expert_bytes = self.sizes.expert_bytes
        timeout = timedelta(seconds=self.spec.eplb.transfer_timeout_s)
        try:
            for layer in range(held.shape[0]):
                self.faults.mid_rescale(layer)
                plan = plans[layer]
                rank_plan = plan.for_rank(executing_rank)
                old_layer = None if old_weights is None else old_weights[layer]
                if layer in ahead:
                    # a joining rank received it into its weights, a leaving one sent it; a survivor
                    # copies the new contents of its changed slots in place (and their undo copy)
                    staged = rows.get(layer)
                    if in_place and staged is not None:
                        assert weights is not None
                        weights[layer] = staged  # swapped in at adoption: the serving tensors stay as they are
                    continue
                else:
                    target = staging if in_place else ([] if weights is None else weights[layer])
                    stats = execute_layer(
                        plan, executing_rank, old_layer, target,
                        group=None, timeout=timeout, max_ops_per_batch=self.spec.eplb.max_ops_per_batch, layer=layer,
                        reload_fn=functools.partial(self._canonical, layer),
                        communicator=self.comm, migration_batching=self.spec.eplb.enable_migration_batching,
                    )
                    received += stats.bytes_received
                if in_place:
                    assert weights is not None
                    undo.save(layer, rank_plan.changed_slots, weights[layer])
                    commit_layer(rank_plan, staging, weights[layer])
                    copied += 2 * len(rank_plan.changed_slots) * expert_bytes  # the undo copy and the commit
                elif weights is not None:
                    materialize(rank_plan, old_layer, weights[layer])
        except BaseException:
            self._undo(undo)
            raise
        return weights, received, undo, networked, copied

    def _canonical(self, layer: int, expert: int) -> list[torch.Tensor]:
        """The checkpoint's weights of one expert (what an expert lost with its rank is reloaded from)."""
        return self.model.canonical_expert(layer, expert)

    def _attach_comm(self, generation: int) -> None:
        """The communicator follows the group generation: NIXL forgets the peers of the previous
        one and exchanges metadata through this one's store at its first transfer. After a
        prepared switch, which swapped staged layers in for weight tensors its peers may have
        learned at the pre-transfer's exchange, every rank of the generation exchanges again,
        under keys of its own (the earlier exchange's keys are still in the store)."""
        prefix = f"elastic/gen{generation}/"
        if self._exchange_again:
            self._exchange_again = False
            self.comm.bind(-1)  # forget this generation's peers and exchange
            prefix += "after-switch/"
        self.comm.bind(generation, dist.PrefixStore(prefix, self.store))
        self.comm.set_weights(self.model.expert_weights())  # registrations follow the tensors

    def _comm_for_rescale(self, cmd: p.Rescale, incoming, staging) -> None:
        """Before a rescale's first transfer: bind the executing generation; register the weights a
        fresh rank fills (``incoming``, published with the metadata) or a survivor's staging."""
        executing = cmd.spec.generation if cmd.spec.execute_on == "new" else self.generation
        self.comm.bind(executing, dist.PrefixStore(f"elastic/gen{executing}/", self.store))
        if self.model.expert_weights():
            self.comm.set_weights(self.model.expert_weights())
        self.comm.set_incoming(incoming)
        if staging is not None:
            self.comm.add_buffer(staging, transient=True)

    def _destroy_group(self) -> None:
        """Tear down this generation's groups. On a healthy group the EPLB subgroup's last
        reference goes with them: its gloo teardown (closing pairs, joining threads, 20-40 ms)
        belongs to replacing the group, not to whatever later line drops the reference. A broken
        group was abandoned when it broke, never torn down (see :meth:`_enter_broken`)."""
        if self.group is not None:
            if self._eplb is not None:
                self._eplb.release_group()
            self.group.destroy()

    def _await_switch(self, cmd: p.Rescale) -> None:
        """A leaving rank of a prepared scale down waits (at most a collective timeout) until the
        survivors' switch is over or abandoned, then leaves."""
        prefix = dist.PrefixStore(f"elastic/gen{cmd.spec.generation}/", self.store)
        deadline = time.monotonic() + self.spec.collective_timeout_s
        while time.monotonic() < deadline:
            try:
                if prefix.check([SWITCHED_KEY]) or prefix.check([ABORT_KEY]):
                    return
            except Exception:  # noqa: BLE001 - the coordinator (and its store) is gone: leave
                return
            time.sleep(0.005)

    def _retire(self, cmd: p.Rescale, started: float, bytes_moved: int, timing: dict[str, float]) -> None:
        """This rank has no place in the new group: report it and leave the decode loop."""
        self.report(p.PhaseDone, seq=cmd.seq, operation_id=cmd.operation_id, step=self.step, result=p.RescaleDone(
            retired=True, bytes_received=bytes_moved, seconds=time.perf_counter() - started, timing=timing))
        self.stopping = True

    def _barrier_or_undo(self, undo: UndoLog) -> None:
        try:
            dist.barrier()
        except BaseException:
            self._undo(undo)
            raise

    def _undo(self, undo: UndoLog) -> None:
        """Put back the slot contents a failed rescale overwrote."""
        undo.replay(self.model.expert_weights())

    def _eplb_config(self, hosts: tuple[str, ...]) -> EPLBConfig:
        """The EPLB config with ``num_nodes`` derived from the group's hosts, unless the config pins it."""
        options = self.spec.eplb.policy_options
        if options.get("num_nodes", "auto") != "auto":
            return self.spec.eplb
        return self.spec.eplb.model_copy(update={"policy_options": {**options, "num_nodes": num_nodes_of(hosts)}})

    def _adopt(self, new_rank: int, cmd: p.Rescale, placement: Placement, weights) -> None:
        self.rank, self.size, self.generation = new_rank, cmd.spec.new_size, cmd.spec.generation
        self.model.install_placement(placement, new_rank, cmd.spec.new_size)
        self.comm.adopt_incoming()  # registrations follow the tensors (old ones deregistered first)
        # tensors a switch swapped out are freed at Resume, not here: giving back a few GiB is kernel
        # work that would lengthen the pause
        self._released.append(self.model.expert_weights())
        self.model.replace_weights(weights)
        self._exchange_again = cmd.prepared  # the same on every rank of the generation
        if self.decoder is not None:
            self.decoder.state = None  # a joining rank has no KV cache: every rank starts the next batch
            # router counts a failed forward left behind (a survivor's) would enter this rank's load
            # window only: windows, and then the placements rebalances compute, would differ by rank
            self.model.take_load()
        # the EPLB stays off until Resume restarts it on the new group; a broken group's EPLB
        # subgroup is released now (a healthy one went with its group)
        self.eplb.adopt(placement, new_rank, cmd.spec.new_size)

    # -- the decode loop -------------------------------------------------------------------
    def _sync(self) -> list[int]:
        self._poll_inbox()
        mark, cpu = time.perf_counter(), time.thread_time()
        words = self.eplb.control()
        self._control_seconds = (time.perf_counter() - mark, time.thread_time() - cpu)
        prepare = self.preparation.words(time.perf_counter()) if self.preparation is not None else [0] * PREPARE_WORDS
        if self._prepare_failed:  # this rank's Prepare failed before it had a preparation to vote with
            prepare[1], self._prepare_failed = 1, False
        control = torch.tensor([self.received_seq, *words, *prepare], dtype=torch.int64)
        try:
            dist.all_reduce(control, op=dist.ReduceOp.MAX)
        except Exception as exc:  # noqa: BLE001
            raise BrokenGroup(f"step-boundary all-reduce failed at step {self.step}: {exc}") from exc
        return control.tolist()

    def decode_step(self) -> None:
        self.faults.at_step(self.step, steady=self.mode == p.WorkerMode.DECODING)  # a stall here is silence
        with self.step_watch.step():
            self._decode_step()
        self._step_ends.append(time.perf_counter())

    def _steady_step_seconds(self) -> float:
        """The step time of the last steps (taken at a Drain: the pace the operation's prepare
        keeps); 0: too few. The lower of the median and the mean: the first steps after a resume
        and a rebalance's steps are slow outliers that would make the mean lenient, and ranks
        sharing cores can alternate fast and slow steps, which makes the median lenient."""
        ends = list(self._step_ends)
        if len(ends) < 8:
            return 0.0
        gaps = [b - a for a, b in zip(ends, ends[1:])]
        return min(statistics.median(gaps), statistics.fmean(gaps))

    def _decode_step(self) -> None:
        reduced = self._sync()
        try:
            if not self._run_commands_up_to(reduced[0]) or self.stopping:
                return
        except BrokenGroup:
            raise
        except Exception as exc:  # noqa: BLE001 - a failed phase leaves the group unusable
            raise BrokenGroup(f"command failed at step {self.step}: {type(exc).__name__}: {exc}") from exc
        stalls = len(self.eplb.stats.sync_stall_seconds)
        self._apply_commit_faults(reduced[1 : 1 + CONTROL_WORDS])
        mark, cpu = time.perf_counter(), time.thread_time()
        try:
            self.eplb.after_sync(reduced[1 : 1 + CONTROL_WORDS])
        except Exception as exc:  # noqa: BLE001 - a sync transfer or an EPLB rebuild failed mid-step
            # ranks may now hold different layers (a sync rebalance moves layer by layer): the
            # group is no longer consistent, and recovery reads what each rank really holds
            raise BrokenGroup(f"EPLB failed at step {self.step}: {type(exc).__name__}: {exc}") from exc
        eplb_seconds = self._control_seconds[0] + time.perf_counter() - mark
        eplb_cpu = self._control_seconds[1] + time.thread_time() - cpu
        rebalancing = int(self.eplb.in_flight is not None or len(self.eplb.stats.sync_stall_seconds) != stalls)
        if self.draining_op is not None and self.eplb.drained:
            op, self.draining_op = self.draining_op, None
            self._done(op, p.DrainDone(layers_committed=self.eplb.stats.layers_committed,
                                       steps_while_draining=self.step - self.drain_started_step))
        if self.preparation is not None:
            self._advance_preparation(reduced[1 + CONTROL_WORDS : 1 + CONTROL_WORDS + PREPARE_WORDS])
        started = time.perf_counter()
        physical: torch.Tensor | None
        if self.requests:
            physical, tokens = self._decode_requests()
        elif self.decoder is not None and self.spec.serving.background_load:
            physical, tokens = self._decode_batch()
        elif self.decoder is not None:  # a real model with nothing to decode: keep agreeing, gently
            physical, tokens = None, 0
            time.sleep(self.spec.serving.idle_step_s)
        else:
            logical = self.trace.token_counts(self.step, self.rank)
            physical = self.model.route(logical)
            try:
                dist.all_reduce(physical)
            except Exception as exc:  # noqa: BLE001
                raise BrokenGroup(f"token all-reduce failed at step {self.step}: {exc}") from exc
            tokens = self.trace.config_at(self.step).tokens_per_step
        mark, cpu = time.perf_counter(), time.thread_time()
        if physical is not None:
            self.eplb.record(physical)
        eplb_seconds += time.perf_counter() - mark
        eplb_cpu += time.thread_time() - cpu
        if self.decoder is None:
            assert physical is not None  # the reference model always routes its trace's tokens
            self.model.forward(physical)
        self.tokens_since += tokens
        self.step += 1
        if len(self.step_timings) < 10_000:  # bounded even when heartbeats are dropped
            self.step_timings.append((self.step, time.monotonic(), eplb_seconds, eplb_cpu, rebalancing))
        self._maybe_heartbeat(time.perf_counter() - started, physical)
        if self.spec.step_delay_s:
            time.sleep(self.spec.step_delay_s)

    def _start_decoder(self) -> None:
        """A Hugging Face model decodes real batches: completion requests, and seeded synthetic
        prompts while none runs (greedy, with its KV cache)."""
        if isinstance(self.spec.shape, HFModelConfig):
            self.decoder = DecodeBatches(self.model, batch=4, prompt_len=8, max_new_tokens=16, seed=self.spec.seed)
            self.requests = RequestBatch(self.model, self.spec.serving.max_batch)

    def _decode_requests(self) -> tuple[torch.Tensor | None, int]:
        """One token of every request (a collective); rank 0 reports the tokens to the coordinator."""
        assert self.requests is not None
        out = self._forward_step(self.requests.step)
        if self.rank == 0 and out.tokens:
            self.report(p.TokensOut, step=self.step, tokens=out.tokens)
        return out.physical, len(out.tokens)

    def _decode_batch(self) -> tuple[torch.Tensor, int]:
        """One greedy step of the batch on every rank (attention replicated, experts combined over
        the group): ``(the router's choices per physical slot, already the group's; tokens)``."""
        assert self.decoder is not None
        out = self._forward_step(self.decoder.step)
        return out.physical, int(out.tokens.numel())

    def _forward_step(self, step: Any) -> Any:
        """Run one decode step's forwards (collectives on the group); any failure breaks the group."""
        try:
            return step()
        except Exception as exc:  # noqa: BLE001 - a combine failed (a peer died or diverged)
            raise BrokenGroup(f"decode step {self.step} failed: {type(exc).__name__}: {exc}") from exc

    def _maybe_heartbeat(self, step_seconds: float, physical: torch.Tensor | None, force: bool = False) -> None:
        if self.faults.drops_heartbeat(self.step):
            return
        now = time.monotonic()
        if not force and now - self.last_heartbeat < self.spec.heartbeat_s:
            return
        self.last_heartbeat = now
        rank_load = 0.0
        if physical is not None:
            per_rank = physical.shape[1] // self.size
            rank_load = float(physical[:, self.rank * per_rank : (self.rank + 1) * per_rank].sum())
        eplb = self._eplb
        self.report(p.Heartbeat, step=self.step, step_seconds=step_seconds,
                    balancedness=eplb.stats.last_balancedness if eplb else 1.0,
                    tokens=self.tokens_since, state=p.WorkerMode.BROKEN if self.broken else self.mode,
                    in_flight_layer=eplb.in_flight_layer if eplb else None,
                    eplb=eplb.stats.as_dict() if eplb else {}, rank_load=rank_load,
                    requests=len(self.requests) if self.requests is not None else 0,
                    step_timings=tuple(self.step_timings))
        self.tokens_since = 0
        self.step_timings = []

    def _waiting_heartbeat(self, waited_s: float) -> None:
        """From :attr:`step_watch`'s thread: the step has waited ``waited_s`` on its peers so far
        (its tokens and timings go out with the step's own heartbeat, once it ends)."""
        if not self.faults.drops_heartbeat(self.step):
            self.report(p.Heartbeat, step=self.step, step_seconds=waited_s, waiting=True)

    def broken_loop(self) -> None:
        """After a failed collective: execute commands as they arrive (recovery or shutdown)."""
        while not self.stopping:
            command = self._wait_for_rescale(p.WorkerMode.BROKEN, "the group is broken, only a rescale or shutdown can follow")
            if command is None:
                return
            try:
                self._rescale(command, fresh=False)
            except Exception as exc:  # noqa: BLE001 - stay broken, report, wait for the next order
                self._enter_broken(exc)
                continue
            return

    def _wait_for_rescale(self, where: str, refusal: str, timeout_s: float | None = None,
                          accept: tuple[type, ...] = ()) -> Any:
        """Outside any group (broken, or standing by before joining): take orders as they arrive,
        reporting meanwhile so the coordinator tells waiting from gone. Returns the next Rescale
        (or command of a type in ``accept``), or None after a Shutdown; any other command is
        refused (``refusal`` says why). With ``timeout_s``, a coordinator that sends neither is
        given up on (TimeoutError)."""
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        while deadline is None or time.monotonic() < deadline:
            if self.pending:  # commands received before the group broke come first
                command = self.pending.pop(min(self.pending))
            else:
                try:
                    command = self.inbox.get(timeout=self.spec.heartbeat_s)
                except queue.Empty:
                    self._maybe_heartbeat(0.0, None, force=True)
                    continue
            if command.seq <= self.executed_seq:
                continue  # already acted on before the group broke
            self.received_seq = max(self.received_seq, command.seq)
            self.executed_seq = command.seq
            if isinstance(command, (p.Rescale, *accept)):
                return command
            if isinstance(command, p.Shutdown):
                self.stopping = True
                self._done(command, p.ShutdownDone())
                return None
            if isinstance(command, p.SERVING_COMMANDS):
                continue  # no batch out here: the coordinator re-admits what the next group misses
            self.report(p.WorkerError, step=self.step, where=where, error_type="Refused", fatal=False,
                        message=f"{type(command).__name__} refused: {refusal}", seq=command.seq)
        raise TimeoutError(f"{where}: no Rescale arrived within {timeout_s:.0f}s")

    def _enter_broken(self, exc: BaseException) -> None:
        """Report the failure, make sure no transfer is in flight, drop the group, wait for orders."""
        self.broken = True
        self._discard_preparation()
        self.report(p.WorkerError, step=self.step, where="decode", error_type=type(exc).__name__,
                    message=str(exc), traceback=traceback.format_exc(), fatal=False, seq=self.executed_seq)
        if self._eplb is not None and self._eplb.running:
            # a transfer on the EPLB group ends within its own deadline; only then may the group go.
            # That can take a while (a peer's side of the transfer is gone), so keep reporting: a
            # rank waiting here is broken, not lost.
            self.comm.abort(f"the group broke: {exc}")  # a polled wait (NIXL) gives up now, not at its deadline
            with self._busy(p.WorkerMode.BROKEN):
                stopped = self.eplb.stop_worker(timeout=self.spec.eplb.transfer_timeout_s + self.spec.collective_timeout_s)
            if not stopped:
                raise RuntimeError("the async EPLB thread did not stop: the group cannot be destroyed safely")
        if self.group is not None:
            # never torn down: destroying a gloo group whose peer failed can block until its failed
            # work times out, holding the GIL, so no heartbeat gets out and the rank looks lost
            # (torch's destroy_process_group() shuts down every registered group, the EPLB subgroup
            # too). Its groups leave torch's registry, so the next generation can form, and are
            # kept (one set per broken generation) until the process exits
            self._abandoned_groups.extend(self.group.abandon())
        self.group = None

    def run(self) -> None:
        self.start()
        self.step_watch.start()
        while not self.stopping:
            try:
                self.decode_step()
            except BrokenGroup as exc:
                self._enter_broken(exc)
                self.broken_loop()
        self.step_watch.stop()
        stopped = self._eplb is None or self._eplb.stop_worker(timeout=self.spec.collective_timeout_s)
        if not stopped:
            # its thread may still be inside a transfer on the group: tearing the group down under
            # it is undefined (and gloo may block); the process exits and the OS frees the rest
            log.warning("rank %d: the async EPLB thread did not stop; leaving without destroying the group", self.rank)
            return
        if self.group is not None:
            self.group.destroy()
        self.comm.close()  # deregisters every tensor it still holds


def _thread_names() -> tuple[str, ...]:
    return tuple(sorted(t.name for t in threading.enumerate()))


def _rss_bytes() -> int:
    """Resident memory of this process now (Linux ``/proc/self/statm``), 0 where unknown."""
    try:
        with open("/proc/self/statm") as statm:
            return int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except OSError:
        return 0


def placement_digest(placement: Placement) -> str:
    import hashlib

    return hashlib.blake2b(placement.physical_to_logical.numpy().tobytes(), digest_size=8).hexdigest()


def worker_main(spec: WorkerSpec, inbox: Any, outbox: Any) -> None:
    """Entry point of a worker process."""
    holder: dict[str, Any] = {}  # the Worker, once built: its rank and generation go with every log line

    def context() -> dict[str, Any]:
        w = holder.get("worker")
        return {"rank": spec.rank, "generation": spec.generation} if w is None else \
            {"rank": w.rank, "generation": w.generation}

    configure_logging(None, os.environ.get("ELASTIC_EP_WORKER_LOG", "WARNING"), context=context)
    torch.set_num_threads(1)
    from elastic.worker.lifetime import watch_coordinator

    watch = watch_coordinator(spec.coordinator_pid)  # a killed coordinator leaves no worker decoding
    worker = None
    try:
        worker = Worker(spec, inbox, outbox)
        holder["worker"] = worker
        worker.run()
    except BaseException as exc:  # noqa: BLE001 - the coordinator must hear about every death
        outbox.put(p.WorkerError(rank=spec.rank if worker is None else worker.rank,
                                 generation=spec.generation if worker is None else worker.generation,
                                 pid=os.getpid(), at=time.time(), step=0 if worker is None else worker.step,
                                 where="worker", error_type=type(exc).__name__, message=str(exc),
                                 traceback=traceback.format_exc(), fatal=True,
                                 # the command it had taken up: the wait for that command names this error
                                 seq=0 if worker is None else worker.executed_seq))
        raise SystemExit(1) from exc
    finally:
        if watch is not None:
            watch.stop()
