"""One EP rank: a worker process decoding the reference MoE model's load trace, or a Hugging Face
MoE model's completion requests (and synthetic batches while none runs), with its EPLB.

At every step boundary the worker runs one small MAX all-reduce carrying (a) the highest
command sequence number it has received, (b) its EPLB control words and (c) a prepare's pacing
words. Then every rank executes the same commands and makes the same EPLB decision at the same
step. The step itself decodes (routing this rank's tokens, the experts combined over the group)
and records the load per physical slot, summed over the ranks.

The loop owns a :class:`~elastic.worker.context.RankContext` and hands it to its executors: the
prepare sub-phase (:mod:`elastic.worker.prepare`) and the rescale (:mod:`elastic.worker.rescale`,
planned by :mod:`elastic.worker.rescale_plan`).

When a collective fails (a peer died or stalled past the group timeout) the worker reports the
error as data and switches to *broken* mode: no more decoding, and commands are executed as
they arrive (a recovery ``Rescale`` or ``Shutdown``) instead of at agreed step boundaries.
"""

from __future__ import annotations

import collections
import logging
import os
import statistics
import time
import traceback
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from elastic.core import protocol as p
from elastic.core.logs import configure as configure_logging
from elastic.core.worker_spec import WorkerSpec
from elastic.worker.context import RankContext
from elastic.worker.groups import connect_store, shutdown_detached
from elastic.worker.inbox import CommandInbox
from elastic.worker.injector import FaultInjector
from elastic.worker.liveness import WATCH_MARGIN_S, StepWatch
from elastic.worker.prepare import PREPARE_WORDS, PrepareExecutor
from elastic.worker.reports import eplb_report, placement_digest, placement_export, thread_names, verify_result
from elastic.worker.rescale import RescaleExecutor, UndoLog
from elastic.worker.startup import allocate_standby_weights, join_first_group, warm_up_in_background
from eplb.communicator import make_communicator
from eplb.models.serving import model_info
from eplb.state import CONTROL_WORDS
from eplb.trace import PhasedTrace

__all__ = ["BrokenGroup", "UndoLog", "Worker", "WorkerSpec", "placement_digest", "worker_main"]

log = logging.getLogger("elastic.worker.process")

#: decode steps in the steady pace a prepare keeps (``Preparation.steady_step_s``)
STEADY_STEPS = 32
#: where the step-boundary all-reduce's work words start (after the seq, the EPLB's and a prepare's words)
WORK = 1 + CONTROL_WORDS + PREPARE_WORDS


class BrokenGroup(RuntimeError):
    """A collective of the decode loop failed: the group cannot be used any more."""


class Worker:
    """The decode loop of one rank: it agrees on commands at step boundaries, runs each through
    its handler (:attr:`_HANDLERS`), decodes a step, reports heartbeats; after a failed
    collective it waits, outside any group, for a recovery's Rescale or a Shutdown.

    What the rank is and holds lives in :attr:`ctx` (:class:`~elastic.worker.context.RankContext`);
    the prepare and rescale executors work on it, never on the loop."""

    def __init__(self, spec: WorkerSpec, inbox: Any, outbox: Any):
        sizes = model_info(spec.shape)
        store = connect_store(spec.store_host, spec.store_port, spec.join_timeout_s)
        self.ctx = RankContext(
            spec=spec, outbox=outbox, store=store,
            comm=make_communicator(spec.eplb.communicator, spec.backend), sizes=sizes,
            faults=FaultInjector(spec.faults, lambda: (self.ctx.rank, self.ctx.generation), store=store),
            rank=spec.rank, size=spec.size, generation=spec.generation)
        self.inbox = CommandInbox(inbox)
        self.preparer = PrepareExecutor(self.ctx)
        self.rescaler = RescaleExecutor(self.ctx, self.preparer)
        self.draining_op: p.Drain | None = None
        self.drain_started_step = 0
        self.last_heartbeat = 0.0
        self.tokens_since = 0
        # per decode step since the last heartbeat: (step, monotonic end time, wall seconds and
        # this thread's CPU seconds in eplb.control() + after_sync() + record(), 1 if a rebalance
        # was in flight)
        self.step_timings: list[tuple[int, float, float, float, int]] = []
        self._control_seconds = (0.0, 0.0)
        # the reference model decodes a synthetic load trace; a Hugging Face model decodes real
        # batches (ctx.decoder) and its router's choices are the load
        self.trace = PhasedTrace(list(spec.trace), sizes.num_moe_layers, sizes.num_logical_experts)
        self._abandoned_groups: list[Any] = []  # broken generations' groups, never torn down (see _enter_broken)
        # a step waiting on its peers keeps reporting, for at most one collective timeout and a margin
        self.step_watch = StepWatch(self._waiting_heartbeat, spec.heartbeat_s, spec.collective_timeout_s + WATCH_MARGIN_S)
        # when the last decode steps ended: the steady pace a prepare's pacing keeps
        self._step_ends: collections.deque[float] = collections.deque(maxlen=STEADY_STEPS + 1)
        self._steady_step_s = 0.0  # _steady_step_seconds() when the last Drain came
        self._admitted = False  # an Admit with requests ran at this step (the group forwards)

    # -- startup ---------------------------------------------------------------------------
    def start(self) -> None:
        ctx = self.ctx
        ctx.faults.hang_before_start()
        if ctx.spec.joining:  # a fresh rank: it joins through the rescale
            warm_up_in_background()  # while it stands by
            command = self._standby()
            if command is not None:
                ctx.faults.at_command(command)
                self.rescaler.run(command, fresh=True)
            return
        placement = join_first_group(ctx, self._resume_eplb)
        ctx.mode = p.WorkerMode.DECODING
        ctx.report(p.PhaseDone, seq=0, step=ctx.step, result=p.Started(num_physical=placement.num_physical))
        warm_up_in_background()

    def _standby(self) -> p.Rescale | None:
        """Launched ahead of a scale-up: the weights allocated while the old group still decodes,
        then wait for the Rescale (a prepared scale's Prepare first).

        Returns it, or None after a Shutdown (the scale failed before its rescale). Reports
        keep coming, so the coordinator tells a waiting rank from a dead one; a coordinator that
        never sends either is given up on after ``standby_timeout_s``.
        """
        ctx, spec = self.ctx, self.ctx.spec
        seconds = allocate_standby_weights(ctx)
        # ready: the coordinator starts the pause only now, so the old group decodes meanwhile
        ctx.report(p.PhaseDone, seq=spec.standby_seq, step=ctx.step, result=p.StandbyReady(prepare_seconds=seconds))
        deadline = time.monotonic() + spec.standby_timeout_s
        refusal = "this rank has not joined a group yet"
        command = self._wait_for_rescale(p.WorkerMode.STANDBY, refusal, spec.standby_timeout_s, accept=(p.Prepare,))
        if isinstance(command, p.Prepare):  # the scale prepares: join the standby group, receive the experts
            ctx.faults.at_command(command)
            self.preparer.prepare_joining(command)
            command = self._wait_for_rescale(p.WorkerMode.STANDBY, refusal, max(1.0, deadline - time.monotonic()))
        assert command is None or isinstance(command, p.Rescale)
        return command

    def _resume_eplb(self) -> None:
        group = self.ctx.in_group()
        self.rescaler.attach_comm(group.generation)
        # the config of this generation: num_nodes of its hosts
        self.ctx.eplb.start_worker(group.build_eplb_group(), group.generation, config=self.ctx.eplb_config(group.hosts),
                                   rebuild_group=self._rebuild_eplb_group, hosts=group.hosts)
        self.ctx.eplb.resume()

    def _rebuild_eplb_group(self) -> Any:
        """A fresh EPLB group after a failed layer (gloo closes a pair on a timeout, so every later
        layer on the old one would fail too); every rank calls this at the same agreed step."""
        old = self.ctx.in_group().eplb_group
        group = self.ctx.in_group().build_eplb_group()
        if old is not None:
            dist.destroy_process_group(old)
        return group

    # -- commands --------------------------------------------------------------------------
    def _run_commands_up_to(self, seq: int) -> bool:
        """Execute every command up to ``seq``; False when the group changed (restart the step)."""
        if self.inbox.received_seq < seq:
            self.inbox.poll(block_until=seq, timeout=self.ctx.spec.collective_timeout_s)
        while self.inbox.executed_seq < seq and not self.ctx.stopping:
            command = self.inbox.pop_next()
            self._execute(command)
            if isinstance(command, p.Rescale):
                return False  # a new group: the next step starts with its own step-boundary sync
        return True

    def _execute(self, command: p.Command) -> None:
        """Run one command (at its agreed step): the handler its type names in ``_HANDLERS``."""
        self.ctx.faults.at_command(command)
        handler = self._HANDLERS.get(type(command))
        if handler is None:
            raise TypeError(f"unknown command {command!r}")
        handler(self, command)

    def _on_drain(self, command: p.Drain) -> None:
        self.ctx.eplb.begin_drain()
        self.ctx.mode = p.WorkerMode.DRAINING
        self.draining_op = command  # reported done at the step the agreed BUSY reads 0
        self.drain_started_step = self.ctx.step
        # the pace before the operation: a joining rank's start during draining slows these steps
        self._steady_step_s = self._steady_step_seconds()

    def _on_prepare(self, command: p.Prepare) -> None:
        self.preparer.on_prepare(command, self._steady_step_s)

    def _stop_eplb_thread(self, mode: p.WorkerMode, timeout_s: float) -> None:
        with self.ctx.busy(mode):  # joining the thread (a transfer may end first): busy, not silent
            if not self.ctx.eplb.stop_worker(timeout=timeout_s):
                raise TimeoutError("the async EPLB thread did not stop in time")

    def _on_suppress(self, command: p.Suppress) -> None:
        if not self.ctx.eplb.drained:
            raise RuntimeError("suppress before the drain finished: a transfer is still in flight")
        started = time.perf_counter()
        self._stop_eplb_thread(p.WorkerMode.SUPPRESSED, self.ctx.spec.collective_timeout_s)
        self.ctx.mode = p.WorkerMode.SUPPRESSED
        joined = time.perf_counter() - started
        self.rescaler.announce(command.announced)  # a scale down follows: its placement is computed now
        self.ctx.done(command, p.SuppressDone(join_seconds=joined, threads=thread_names(),
                                              announced=command.announced is not None,
                                              placement_seconds=time.perf_counter() - started - joined))

    def _on_rescale(self, command: p.Rescale) -> None:
        self.rescaler.run(command, fresh=False)

    def _on_resume(self, command: p.Resume) -> None:
        started = time.perf_counter()
        with self.ctx.busy(p.WorkerMode.RESUMING):  # the EPLB group and memory registration: not silence
            detached, released = self.rescaler.old_generation()
            shutdown_detached(detached)  # the old generation's groups, after the pause
            self._resume_eplb()
            released.clear()  # the weight tensors the switch swapped out (deregistered by now)
        self._step_ends.clear()  # the steady pace is this group's, from its own steps
        self.ctx.mode = p.WorkerMode.DECODING
        self.ctx.done(command, p.ResumeDone(seconds=time.perf_counter() - started, threads=thread_names()))

    def _on_rebalance_now(self, command: p.RebalanceNow) -> None:
        eplb = self.ctx.eplb
        if not eplb.draining and eplb.all_idle:
            eplb.rebalance_now()
        # under way counts as started: in flight here, or still busy on another rank (agreed
        # BUSY) after this rank's own worker already finished
        under_way = eplb.in_flight is not None or not eplb.all_idle
        self.ctx.done(command, p.RebalanceAck(started=under_way or not self.ctx.spec.eplb.use_async))

    def _on_verify(self, command: p.Verify) -> None:
        self.ctx.done(command, verify_result(self.ctx))

    def _on_export_placement(self, command: p.ExportPlacement) -> None:
        self.ctx.done(command, placement_export(self.ctx))

    def _on_probe(self, command: p.Probe) -> None:
        probe = getattr(self.ctx.model, "probe", None)
        if probe is None:
            raise TypeError("the reference model has no probe batch (probes are for real models, kind: hf)")
        started = time.perf_counter()
        result = probe()
        self.ctx.done(command, p.ProbeDone(digest=result.digest, tokens=tuple(tuple(row) for row in result.tokens.tolist()),
                                           seconds=time.perf_counter() - started))

    def _on_stop_eplb(self, command: p.StopEPLB) -> None:
        self.ctx.eplb.begin_drain()  # nothing starts again until a recovery's Resume
        self._stop_eplb_thread(p.WorkerMode.HALTED, self.ctx.spec.eplb.transfer_timeout_s + self.ctx.spec.collective_timeout_s)
        self.preparer.discard()  # the scale failed: the standby group and the spare rows go
        self.ctx.mode = p.WorkerMode.HALTED
        self.ctx.done(command, p.EPLBStopped(threads=thread_names()))

    def _on_admit(self, command: p.Admit) -> None:
        if self.ctx.requests is not None:
            self.ctx.requests.admit(command.requests, self.ctx.rank)  # the requests this rank owns
            # every rank runs the same Admit at this step: all know a rank has tokens now
            self._admitted = self._admitted or bool(command.requests)

    def _on_cancel(self, command: p.Cancel) -> None:
        if self.ctx.requests is not None:
            self.ctx.requests.cancel(command.request_ids)

    def _on_shutdown(self, command: p.Shutdown) -> None:
        self.ctx.stopping = True
        self.ctx.done(command, p.ShutdownDone())

    #: one handler per command type: the whole of what a worker does with its commands
    _HANDLERS: dict[type, Callable[[Worker, Any], None]] = {
        p.Drain: _on_drain, p.Prepare: _on_prepare, p.Suppress: _on_suppress, p.Rescale: _on_rescale, p.Resume: _on_resume,
        p.RebalanceNow: _on_rebalance_now, p.Verify: _on_verify,
        p.ExportPlacement: _on_export_placement, p.Probe: _on_probe, p.StopEPLB: _on_stop_eplb,
        p.Admit: _on_admit, p.Cancel: _on_cancel, p.Shutdown: _on_shutdown,
    }

    # -- the decode loop -------------------------------------------------------------------
    def _sync(self) -> list[int]:
        self.inbox.poll()
        mark, cpu = time.perf_counter(), time.thread_time()
        words = self.ctx.eplb.control()
        self._control_seconds = (time.perf_counter() - mark, time.thread_time() - cpu)
        prepare = self.preparer.words(time.perf_counter())
        control = torch.tensor([self.inbox.received_seq, *words, *prepare, *self._work_words()], dtype=torch.int64)
        # over the data plane's shared memory once a step has set it up for this group (every rank
        # alike: see eplb.models.local_exchange), else gloo
        local = getattr(self.ctx.model, "local_exchange", None)
        exchange = local() if local is not None else None
        try:
            if exchange is not None:
                control = exchange.all_reduce_max(control, self.ctx.spec.collective_timeout_s,
                                                  "the step-boundary all-reduce")
            else:
                dist.all_reduce(control, op=dist.ReduceOp.MAX)
        except Exception as exc:  # noqa: BLE001
            raise BrokenGroup(f"step-boundary all-reduce failed at step {self.ctx.step}: {exc}") from exc
        return control.tolist()

    def _work_words(self) -> tuple[int, int]:
        """This rank's ``(holds requests, has other work that needs steps)``: MAX-reduced at the step
        boundary, they tell every rank alike whether the group is idle (:meth:`_sleep`)."""
        ctx = self.ctx
        eplb = ctx.eplb_if_any
        active = (ctx.decoder is None or ctx.spec.serving.background_load or self.draining_op is not None
                  or self.preparer.preparation is not None
                  or (eplb is not None and (eplb.in_flight is not None or not eplb.all_idle)))
        return int(bool(ctx.requests)), int(active)

    def decode_step(self) -> None:
        self.ctx.faults.at_step(self.ctx.step, steady=self.ctx.mode == p.WorkerMode.DECODING)  # a stall here is silence
        with self.step_watch.step():
            idle = self._decode_step()
        if idle:
            self._sleep()
        else:
            self._step_ends.append(time.perf_counter())

    def _sleep(self) -> None:
        """The group is idle (no request on any rank, no background load, no command at this step,
        no rebalance, drain or prepare under way): block on the command inbox, the same on every
        rank, until a command arrives (every rank receives every command, so all wake), reporting
        every ``heartbeat_s`` meanwhile. No step runs, so the step counter stands still."""
        ctx = self.ctx
        self._step_ends.clear()  # the steady pace is that of steps, not of a sleep
        self._maybe_heartbeat(0.0, None, force=True, idle=True)
        while not ctx.stopping and not self.inbox.wait(ctx.spec.heartbeat_s):
            self._maybe_heartbeat(0.0, None, force=True, idle=True)
        self._maybe_heartbeat(0.0, None, force=True)  # awake: the coordinator's view says so at once

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

    def _decode_step(self) -> bool:
        """One step; True when the group is idle and this step decoded nothing (the loop sleeps)."""
        ctx = self.ctx
        reduced = self._sync()
        executed = self.inbox.executed_seq
        self._admitted = False
        try:
            if not self._run_commands_up_to(reduced[0]) or ctx.stopping:
                return False
        except BrokenGroup:
            raise
        except Exception as exc:  # noqa: BLE001 - a failed phase leaves the group unusable
            raise BrokenGroup(f"command failed at step {ctx.step}: {type(exc).__name__}: {exc}") from exc
        stalls = len(ctx.eplb.stats.sync_stall_seconds)
        control = reduced[1 : 1 + CONTROL_WORDS]
        if ctx.eplb.commits_now(control) and ctx.faults.torn_commit(ctx.eplb.stats.layers_committed + 1):
            raise BrokenGroup(f"fault injection: the step-{ctx.step} all-reduce broke on this rank only, "
                              f"before commit {ctx.eplb.stats.layers_committed + 1} (the other ranks commit)")
        mark, cpu = time.perf_counter(), time.thread_time()
        try:
            ctx.eplb.after_sync(control)
        except Exception as exc:  # noqa: BLE001 - a sync transfer or an EPLB rebuild failed mid-step
            # ranks may now hold different layers (a sync rebalance moves layer by layer): the
            # group is no longer consistent, and recovery reads what each rank really holds
            raise BrokenGroup(f"EPLB failed at step {ctx.step}: {type(exc).__name__}: {exc}") from exc
        eplb_seconds = self._control_seconds[0] + time.perf_counter() - mark
        eplb_cpu = self._control_seconds[1] + time.thread_time() - cpu
        rebalancing = int(ctx.eplb.in_flight is not None or len(ctx.eplb.stats.sync_stall_seconds) != stalls)
        if self.draining_op is not None and ctx.eplb.drained:
            op, self.draining_op = self.draining_op, None
            ctx.done(op, p.DrainDone(layers_committed=ctx.eplb.stats.layers_committed,
                                     steps_while_draining=ctx.step - self.drain_started_step))
        if self.preparer.preparation is not None:
            self.preparer.advance(reduced[1 + CONTROL_WORDS : 1 + CONTROL_WORDS + PREPARE_WORDS])
        if self.inbox.executed_seq == executed and not any(reduced[WORK:]) and self._work_words() == (0, 0):
            return True  # the agreed words and the commands (none) are the same on every rank: all sleep
        started = time.perf_counter()
        physical, tokens = self._decode_tokens(bool(reduced[WORK]) or self._admitted)
        mark, cpu = time.perf_counter(), time.thread_time()
        if physical is not None:
            ctx.eplb.record(physical)
        self._end_step(started, physical, tokens, eplb_seconds + time.perf_counter() - mark,
                       eplb_cpu + time.thread_time() - cpu, rebalancing)
        return False

    def _decode_tokens(self, requests: bool) -> tuple[torch.Tensor | None, int]:
        """This step's tokens: ``(the router's choices per physical slot, the group's sum; tokens)``.
        ``requests``: some rank of the group holds requests (agreed: the reduced work word, or an
        Admit at this step), so every rank runs its batch's forward, an empty one included."""
        ctx = self.ctx
        if requests and ctx.requests is not None:  # one token of each of this rank's requests, reported by it
            out = self._forward_step(ctx.requests.step)
            if out.tokens:
                ctx.report(p.TokensOut, step=ctx.step, tokens=out.tokens)
            return out.physical, len(out.tokens)
        if ctx.decoder is not None and ctx.spec.serving.background_load:
            # one greedy step of the synthetic batch (attention replicated, experts combined over the group)
            batch = self._forward_step(ctx.decoder.step)
            return batch.physical, int(batch.tokens.numel())
        if ctx.decoder is not None:  # a real model with nothing to decode: keep agreeing, gently
            time.sleep(ctx.spec.serving.idle_step_s)
            return None, 0
        logical = self.trace.token_counts(ctx.step, ctx.rank)
        physical = ctx.model.route(logical)
        try:
            dist.all_reduce(physical)
        except Exception as exc:  # noqa: BLE001
            raise BrokenGroup(f"token all-reduce failed at step {ctx.step}: {exc}") from exc
        return physical, self.trace.config_at(ctx.step).tokens_per_step

    def _forward_step(self, step: Any) -> Any:
        """Run one decode step's forwards (collectives on the group); any failure breaks the group."""
        try:
            return step()
        except Exception as exc:  # noqa: BLE001 - a combine failed (a peer died or diverged)
            raise BrokenGroup(f"decode step {self.ctx.step} failed: {type(exc).__name__}: {exc}") from exc

    def _end_step(self, started: float, physical: torch.Tensor | None, tokens: int, eplb_seconds: float,
                  eplb_cpu: float, rebalancing: int) -> None:
        ctx = self.ctx
        if ctx.decoder is None:
            assert physical is not None  # the reference model always routes its trace's tokens
            ctx.model.forward(physical)
        self.tokens_since += tokens
        ctx.step += 1
        if len(self.step_timings) < 10_000:  # bounded even when heartbeats are dropped
            self.step_timings.append((ctx.step, time.monotonic(), eplb_seconds, eplb_cpu, rebalancing))
        self._maybe_heartbeat(time.perf_counter() - started, physical)
        if ctx.spec.step_delay_s:
            time.sleep(ctx.spec.step_delay_s)

    def _maybe_heartbeat(self, step_seconds: float, physical: torch.Tensor | None, force: bool = False,
                         idle: bool = False) -> None:
        ctx = self.ctx
        now = time.monotonic()
        if not force and now - self.last_heartbeat < ctx.spec.heartbeat_s:
            return
        self.last_heartbeat = now
        rank_load = 0.0
        if physical is not None:
            per_rank = physical.shape[1] // ctx.size
            rank_load = float(physical[:, ctx.rank * per_rank : (ctx.rank + 1) * per_rank].sum())
        eplb = ctx.eplb_if_any
        ctx.report(p.Heartbeat, step=ctx.step, step_seconds=step_seconds,
                   balancedness=eplb.stats.last_balancedness if eplb else 1.0,
                   tokens=self.tokens_since, state=p.WorkerMode.BROKEN if ctx.broken else ctx.mode,
                   in_flight_layer=eplb.in_flight_layer if eplb else None,
                   eplb=eplb_report(eplb.stats) if eplb else None, rank_load=rank_load,
                   requests=len(ctx.requests) if ctx.requests is not None else 0,
                   step_timings=tuple(self.step_timings), idle=idle)
        self.tokens_since = 0
        self.step_timings = []

    def _waiting_heartbeat(self, waited_s: float) -> None:
        """From :attr:`step_watch`'s thread: the step has waited ``waited_s`` on its peers so far
        (its tokens and timings go out with the step's own heartbeat, once it ends)."""
        self.ctx.report(p.Heartbeat, step=self.ctx.step, step_seconds=waited_s, waiting=True)

    # -- outside a group -------------------------------------------------------------------
    def broken_loop(self) -> None:
        """After a failed collective: execute commands as they arrive (recovery or shutdown)."""
        while not self.ctx.stopping:
            command = self._wait_for_rescale(p.WorkerMode.BROKEN, "the group is broken, only a rescale or shutdown can follow")
            if command is None:
                return
            try:
                self.rescaler.run(command, fresh=False)
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
        ctx = self.ctx
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        while deadline is None or time.monotonic() < deadline:
            command = self.inbox.next_arrival(ctx.spec.heartbeat_s)  # those received before the group broke first
            if command is None:
                self._maybe_heartbeat(0.0, None, force=True)
                continue
            if isinstance(command, (p.Rescale, *accept)):
                return command
            if isinstance(command, p.Shutdown):
                ctx.stopping = True
                ctx.done(command, p.ShutdownDone())
                return None
            if isinstance(command, p.Cancel) and ctx.requests is not None:
                ctx.requests.cancel(command.request_ids)  # the batch survives a recovery: keep it true
                continue
            if isinstance(command, p.SERVING_COMMANDS):
                continue  # no Admit out here: the coordinator re-admits what the next group misses
            ctx.report(p.WorkerError, step=ctx.step, where=where, error_type="Refused",
                       message=f"{type(command).__name__} refused: {refusal}", seq=command.seq)
        raise TimeoutError(f"{where}: no Rescale arrived within {timeout_s:.0f}s")

    def _enter_broken(self, exc: BaseException) -> None:
        """Report the failure, make sure no transfer is in flight, drop the group, wait for orders.
        A decode step the failure cut short is rolled back: this rank's requests go on after the
        recovery from their last whole step, without a replay."""
        ctx = self.ctx
        ctx.broken = True
        if ctx.requests is not None:
            ctx.requests.rollback()
        self.preparer.discard()
        ctx.report(p.WorkerError, step=ctx.step, where="decode", error_type=type(exc).__name__,
                   message=str(exc), traceback=traceback.format_exc(), seq=self.inbox.executed_seq)
        if ctx.eplb_if_any is not None and ctx.eplb_if_any.running:
            # a transfer on the EPLB group ends within its own deadline; only then may the group go.
            # That can take a while (a peer's side of the transfer is gone), so keep reporting: a
            # rank waiting here is broken, not lost.
            ctx.comm.abort(f"the group broke: {exc}")  # a polled wait (NIXL) gives up now, not at its deadline
            with ctx.busy(p.WorkerMode.BROKEN):
                stopped = ctx.eplb.stop_worker(timeout=ctx.spec.eplb.transfer_timeout_s + ctx.spec.collective_timeout_s)
            if not stopped:
                raise RuntimeError("the async EPLB thread did not stop: the group cannot be destroyed safely")
        if ctx.group is not None:
            # never torn down: destroying a gloo group whose peer failed can block until its failed
            # work times out, holding the GIL, so no heartbeat gets out and the rank looks lost
            # (torch's destroy_process_group() shuts down every registered group, the EPLB subgroup
            # too). Its groups leave torch's registry, so the next generation can form, and are
            # kept (one set per broken generation) until the process exits
            self._abandoned_groups.extend(ctx.group.abandon())
        ctx.group = None

    def run(self) -> None:
        ctx = self.ctx
        self.start()
        self.step_watch.start()
        while not ctx.stopping:
            try:
                self.decode_step()
            except BrokenGroup as exc:
                self._enter_broken(exc)
                self.broken_loop()
        self.step_watch.stop()
        stopped = ctx.eplb_if_any is None or ctx.eplb_if_any.stop_worker(timeout=ctx.spec.collective_timeout_s)
        if not stopped:
            # its thread may still be inside a transfer on the group: tearing the group down under
            # it is undefined (and gloo may block); the process exits and the OS frees the rest
            log.warning("rank %d: the async EPLB thread did not stop; leaving without destroying the group", ctx.rank)
            return
        if ctx.group is not None:
            ctx.group.destroy()
        ctx.comm.close()  # deregisters every tensor it still holds


def worker_main(spec: WorkerSpec, inbox: Any, outbox: Any) -> None:
    """Entry point of a worker process."""
    holder: dict[str, Any] = {}  # the Worker, once built: its rank and generation go with every log line

    def context() -> dict[str, Any]:
        w = holder.get("worker")
        return {"rank": spec.rank, "generation": spec.generation} if w is None else \
            {"rank": w.ctx.rank, "generation": w.ctx.generation}

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
        outbox.put(p.WorkerError(rank=spec.rank if worker is None else worker.ctx.rank,
                                 generation=spec.generation if worker is None else worker.ctx.generation,
                                 pid=os.getpid(), at=time.time(), step=0 if worker is None else worker.ctx.step,
                                 where="worker", error_type=type(exc).__name__, message=str(exc),
                                 traceback=traceback.format_exc(),
                                 # the command it had taken up: the wait for that command names this error
                                 seq=0 if worker is None else worker.inbox.executed_seq))
        raise SystemExit(1) from exc
    finally:
        if watch is not None:
            watch.stop()
