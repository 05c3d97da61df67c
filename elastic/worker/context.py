"""What a rank's executors share: its spec and connections, and the state they change.

The decode loop (:class:`elastic.worker.process.Worker`) owns one :class:`RankContext` and hands
it to its executors (:class:`elastic.worker.prepare.PrepareExecutor`,
:class:`elastic.worker.rescale.RescaleExecutor`); they never see the loop itself.
"""

from __future__ import annotations

import contextlib
import functools
import os
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch

from elastic.core import protocol as p
from elastic.core.worker_spec import WorkerSpec
from elastic.worker.batch import RequestBatch
from elastic.worker.groups import GroupGeneration
from elastic.worker.injector import FaultInjector
from elastic.worker.rescale_plan import eplb_config_for
from eplb.config import EPLBConfig
from eplb.models.config import HFModelConfig
from eplb.models.serving import DecodeBatches
from eplb.state import EPLBState, TransferHooks

__all__ = ["RankContext"]


@dataclass(eq=False)
class RankContext:
    """One rank: where it stands (rank, generation, step, mode), what it holds (group, model,
    EPLB state, request batch) and how it speaks (reports to the coordinator)."""

    spec: WorkerSpec
    outbox: Any  # the report queue to the coordinator
    store: Any  # the coordinator's TCPStore
    comm: Any  # eplb.communicator: moves expert weights
    faults: FaultInjector
    sizes: Any  # eplb.models.serving.model_info of the spec's model
    rank: int
    size: int
    generation: int
    step: int = 0
    mode: p.WorkerMode = p.WorkerMode.STARTING
    progress: tuple[str, int, int] | None = None  # a long preparation's (what, done, total)
    broken: bool = False
    stopping: bool = False
    group: GroupGeneration | None = None
    decoder: DecodeBatches | None = None  # synthetic batches while no request runs (background load)
    requests: RequestBatch | None = None  # completion requests (elastic.worker.batch)
    #: a joining rank's expert weights, allocated while it stands by (taken by its rescale)
    prepared_weights: list[list[torch.Tensor]] | None = None
    non_expert_sync: dict[str, float] | None = None  # bytes and seconds of the last peer copy (joining ranks)
    #: the model and the EPLB state exist once this rank is in a group (a joining rank gets them at
    #: its first rescale): ``model``/``eplb`` raise before that, ``eplb_if_any`` tells
    model_if_any: Any = None  # ReferenceMoE or eplb.models.hf.HFMoE (both MixtureOfExperts)
    eplb_if_any: EPLBState | None = None

    @property
    def eplb(self) -> EPLBState:
        if self.eplb_if_any is None:
            raise RuntimeError(f"rank {self.rank} has no EPLB state yet: it has not joined a group")
        return self.eplb_if_any

    @eplb.setter
    def eplb(self, state: EPLBState) -> None:
        self.eplb_if_any = state

    @property
    def model(self) -> Any:
        if self.model_if_any is None:
            raise RuntimeError(f"rank {self.rank} has no model yet: it has not joined a group")
        return self.model_if_any

    @model.setter
    def model(self, model: Any) -> None:
        self.model_if_any = model

    def in_group(self) -> GroupGeneration:
        if self.group is None:
            raise RuntimeError(f"rank {self.rank} is in no group")
        return self.group

    # -- reporting ---------------------------------------------------------------------------
    def report(self, cls: type, **fields: Any) -> None:
        if self.silenced(fields.get("result")):
            return  # a silenced rank (faults.DropHeartbeats) sends nothing at all
        self.outbox.put(cls(rank=self.rank, generation=self.generation, pid=os.getpid(), at=time.time(), **fields))

    def silenced(self, result: Any = None) -> bool:
        """Whether a report is dropped (``faults.DropHeartbeats``). The fault silences a rank that
        serves, from its step on: the start (the busy heartbeats while it joins its first group, and
        the ``Started`` result that ends it) is reported even with ``from_step`` 0, so the start
        completes and the rank is lost at its heartbeat deadline, like a kill at that step; a start
        that reports nothing is ``HangBeforeStart``."""
        if self.mode is p.WorkerMode.STARTING or isinstance(result, p.Started):
            return False
        return self.faults.drops_heartbeat(self.step)

    def done(self, command: p.Command, result: p.Result) -> None:
        """Report that ``command`` is done, with its result type."""
        assert isinstance(result, p.RESULT_OF[type(command)]), (command, result)
        self.report(p.PhaseDone, seq=command.seq, operation_id=command.operation_id, step=self.step, result=result)

    def eplb_event(self, kind: str, data: dict[str, Any]) -> None:
        self.report(p.WorkerEvent, step=self.step, kind=kind, data=data)

    def set_progress(self, progress: tuple[str, int, int] | None) -> None:
        self.progress = progress

    @contextlib.contextmanager
    def busy(self, what: p.WorkerMode) -> Iterator[None]:
        """While a long blocking phase runs (rendezvous, loading, transfers), a thread keeps
        reporting liveness, and ``progress`` when set, so the coordinator can tell "busy" from
        "gone" and a slow load from a stuck one; a frozen process still falls silent."""
        done = threading.Event()

        def beat() -> None:
            while True:
                self.report(p.Heartbeat, step=self.step, state=what, progress=self.progress,
                            balancedness=self.eplb_if_any.stats.last_balancedness if self.eplb_if_any else 1.0)
                if done.wait(self.spec.heartbeat_s):
                    return

        thread = threading.Thread(target=beat, name=f"busy-heartbeat-{what}", daemon=True)
        thread.start()
        try:
            yield
        finally:
            done.set()
            thread.join()

    # -- the model and the EPLB --------------------------------------------------------------
    def hooks(self) -> TransferHooks:
        verify = self.model.verify_staged if self.spec.eplb.verify_transfers else None
        return TransferHooks(before_layer=self.faults.before_layer, after_fill=self.faults.after_fill,
                             verify_staged=(lambda *a: verify(*a)) if verify else None)

    def new_eplb(self, placement: Any, rank: int, size: int) -> EPLBState:
        """This rank's EPLB state over ``placement`` (the model must be built)."""
        return EPLBState(self.spec.eplb, self.model, placement, rank, size, on_event=self.eplb_event,
                         hooks=self.hooks(), communicator=self.comm)

    def start_decoder(self) -> None:
        """A Hugging Face model decodes real batches: completion requests, and seeded synthetic
        prompts while none runs (greedy, with its KV cache)."""
        if isinstance(self.spec.shape, HFModelConfig):
            self.decoder = DecodeBatches(self.model, batch=4, prompt_len=8, max_new_tokens=16, seed=self.spec.seed)
            self.requests = RequestBatch(self.model, self.spec.serving.max_batch)

    def canonical(self, layer: int) -> Any:
        """The checkpoint's weights of one layer's experts, by expert (what an expert lost with
        its rank is reloaded from): a ``reload_fn`` for :func:`eplb.transfer.execute_layer`."""
        return functools.partial(self.model.canonical_expert, layer)

    def eplb_config(self, hosts: tuple[str, ...]) -> EPLBConfig:
        """The EPLB config with ``num_nodes`` derived from ``hosts``, unless the config pins it."""
        return eplb_config_for(self.spec.eplb, hosts)
