"""Transfer communicators: how one layer's expert tensors cross the network.

:func:`eplb.transfer.execute_layer` expands a rank's part of a plan into
:class:`~eplb.transfer.TransferOp` records and hands them, one :class:`~eplb.transfer.LayerExchange`
per layer, to a communicator: *queue* the layer's sends and receives (or reads), *execute*
them, *wait* for them with the layer's deadline. Local fan-out, copies and reloads stay in the
executor. Three implementations:

================  ==========================================================================
``gloo``          :class:`TorchCommunicator` on a gloo group: ``batch_isend_irecv``, globally
                  chunked (two-sided: every sender posts its sends). The default on CPU.
``nccl``          The same class and code path on an NCCL group (GPU hosts). Not testable on a
                  CPU-only machine.
``nixl``          :class:`NixlCommunicator`: receivers *read* remote experts one-sided with
                  NIXL (UCX) into their staging buffer; senders do nothing but have their
                  weights registered. The end of a layer is agreed with a small all-reduce
                  whose wait has the layer's deadline. UCX moves CPU memory too, so it runs
                  without a GPU.
================  ==========================================================================

:func:`make_communicator` picks one from ``EPLBConfig.communicator``: ``auto`` prefers NIXL
when it is installed, then NCCL when the group backend is NCCL, then gloo.

Lifecycle (no-ops for the two-sided communicators), driven by the worker:

- :meth:`Communicator.bind` ``(generation, store)`` when a group generation forms: NIXL forgets
  every peer of the previous generation and will exchange metadata through ``store`` (that
  generation's ``PrefixStore``) at the generation's first transfer, so forming a group never
  waits on it.
- :meth:`Communicator.set_weights` names the expert weights peers read from (per layer, a list of
  ``[slots, ...]`` tensors); :meth:`Communicator.add_buffer` a staging buffer receivers read into.
- A rescale that reallocates weights registers the new tensors with
  :meth:`Communicator.set_incoming` before its first transfer (they are receive targets, and
  are published with the generation's metadata), then :meth:`Communicator.adopt_incoming` makes
  them the weights and deregisters the old ones, on every rank at the same point, so the peers'
  view flips with them and the generation needs no second exchange.
- :meth:`Communicator.remove_buffer` / :meth:`Communicator.close` deregister; registered tensors
  are referenced by the communicator until deregistered, so their memory is never freed while
  registered.
"""

from __future__ import annotations

import importlib
import importlib.util
import logging
import os
import pickle
import socket
import threading
import time
import uuid
from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any, TypedDict

import torch
import torch.distributed as dist

from eplb.exchange import (
    LayerExchange,
    TransferError,
    TransferOp,
    TransferTimeout,
    describe_ops,
    global_rank,
    pending_ops,
)

log = logging.getLogger("eplb.communicator")

__all__ = [
    "COMMUNICATORS",
    "Communicator",
    "CommunicatorUnavailable",
    "NixlCommunicator",
    "TorchCommunicator",
    "make_communicator",
    "nixl_available",
    "resolve_communicator",
]

#: the names ``EPLBConfig.communicator`` accepts
COMMUNICATORS = ("auto", "gloo", "nccl", "nixl")


class _ErrorFields(TypedDict):
    """The keyword fields of a :class:`TransferError` (and :class:`TransferTimeout`), built once for both."""

    layer: int | None
    rank: int | None
    peers: Sequence[int]
    timeout: float | None
    waiting: str
    cause: str


class CommunicatorUnavailable(RuntimeError):
    """The configured communicator cannot run here (NIXL not installed, wrong backend)."""


# ---------------------------------------------------------------------------------------------
# choosing

#: the longest sleep of a wait at the start of a layer (``LayerExchange.start_together``): how late
#: such a wait may notice an abort, or that its peers arrived
_START_POLL_S = 0.005


@dataclass
class _Backoff:
    """The pause between two looks of a polling wait: none before the second look, then ``first``,
    doubling up to ``cap``, and never past the wait's deadline (the NIXL communicator's waits: on
    its reads, its all-reduces and the store, each checking the abort and the deadline between looks)."""

    first: float
    cap: float
    pause: float = 0.0

    def sleep(self, deadline: float) -> None:
        time.sleep(min(self.pause, max(deadline - time.monotonic(), 0.0)))
        self.pause = min(self.cap, self.pause * 2 or self.first)
_NIXL_MODULES = ("nixl", "nixl_cu13", "nixl_cu12")  # the meta package first: it picks the CUDA build


def nixl_available() -> bool:
    """Whether a NIXL Python package is installed (``pip install 'elastic-ep[nixl]'``)."""
    return any(importlib.util.find_spec(name) is not None for name in _NIXL_MODULES)


def _nixl_api() -> Any:
    errors = []
    for name in _NIXL_MODULES:
        if importlib.util.find_spec(name) is None:
            continue
        try:
            api = importlib.import_module(f"{name}._api")
        except ImportError as exc:  # e.g. the meta package without a matching CUDA build
            errors.append(f"{name}: {exc}")
            continue
        if not os.environ.get("NIXL_LOG_LEVEL"):  # NIXL logs every agent start at INFO on stdout
            logging.getLogger("nixl").setLevel(logging.WARNING)
        return api
    detail = "; ".join(errors) if errors else "no nixl package is installed"
    raise CommunicatorUnavailable(f"NIXL cannot be imported ({detail}); install it with pip install 'elastic-ep[nixl]'")


def resolve_communicator(choice: str = "auto", backend: str = "gloo") -> str:
    """The communicator ``choice`` means on a group of ``backend``: ``gloo``, ``nccl`` or ``nixl``.

    ``auto``: NIXL when installed, else NCCL when the backend is NCCL, else gloo. An explicit
    choice that cannot work here raises :class:`CommunicatorUnavailable`.
    """
    if choice not in COMMUNICATORS:
        raise ValueError(f"unknown communicator {choice!r}; expected one of {COMMUNICATORS}")
    if choice == "auto":
        if nixl_available():
            return "nixl"
        return "nccl" if backend == "nccl" else "gloo"
    if choice == "nixl" and not nixl_available():
        raise CommunicatorUnavailable("communicator 'nixl' is configured but NIXL is not installed "
                                      "(pip install 'elastic-ep[nixl]')")
    if choice in ("gloo", "nccl") and choice != backend:
        raise CommunicatorUnavailable(f"communicator {choice!r} needs process groups of that backend, "
                                      f"but the deployment's backend is {backend!r}")
    return choice


def make_communicator(choice: str = "auto", backend: str = "gloo") -> Communicator:
    """A new communicator for ``choice`` (see :func:`resolve_communicator`)."""
    name = resolve_communicator(choice, backend)
    if name == "nixl":
        return NixlCommunicator()
    return TorchCommunicator(name)


# ---------------------------------------------------------------------------------------------
# the interface

class Communicator(ABC):
    """Moves one layer's transfers; see the module docstring for the lifecycle calls."""

    name: str = "?"
    #: True when every rank of the group must call ``exchange`` for every layer, idle or not
    #: (the communicator ends each layer with a collective)
    collective_per_layer: bool = False

    def bind(self, generation: int, store: Any | None = None) -> None:
        """A new group generation formed; ``store`` is that generation's store (a ``PrefixStore``)."""

    def abort(self, reason: str) -> None:
        """The group broke: a transfer wait in progress (on another thread) should give up now,
        not at its deadline, so that thread can be joined. Only waits this side polls can: NIXL's
        do, a gloo or NCCL wait runs out its deadline. Cleared by :meth:`bind` of another generation
        or by :meth:`clear_abort`."""

    def clear_abort(self) -> None:
        """The waits of an aborted layer have given up (its thread was joined): later layers of
        the same generation may wait again (the EPLB rebuilt its run after a failed layer)."""

    def set_weights(self, weights: Sequence[Sequence[torch.Tensor] | None]) -> None:
        """The expert weights peers read from: per layer, the ``[slots, ...]`` tensors (or None)."""

    def set_incoming(self, weights: Sequence[Sequence[torch.Tensor] | None] | None) -> None:
        """Weights a rescale fills (receive targets) that become the weights at :meth:`adopt_incoming`."""

    def adopt_incoming(self) -> None:
        """The rescale is over: incoming weights are now the weights (every rank of the group calls
        it at the same point) and transient buffers are released."""

    def add_buffer(self, tensors: Sequence[torch.Tensor], *, transient: bool = False) -> None:
        """A staging buffer receives land in; a ``transient`` one (a rescale's) is released at the
        next :meth:`adopt_incoming` or :meth:`bind` of another generation."""

    def remove_buffer(self, tensors: Sequence[torch.Tensor]) -> None:
        """The staging buffer is about to be freed."""

    @abstractmethod
    def exchange(self, x: LayerExchange) -> None:
        """Queue, execute and wait for this rank's ops of one layer; raise TransferTimeout/TransferError."""

    def close(self) -> None:
        """Release everything (deregister memory, forget peers)."""

    def stats(self) -> dict[str, Any]:
        return {"name": self.name}


# ---------------------------------------------------------------------------------------------
# gloo / NCCL: two-sided batch_isend_irecv on the group's own backend

class TorchCommunicator(Communicator):
    """``torch.distributed`` point-to-point on the group's backend (gloo on CPU, NCCL on GPUs).

    ``name=None`` accepts whatever backend the group has (what :func:`execute_layer` uses when
    given no communicator); ``"gloo"``/``"nccl"`` check the group's backend on first use.
    The global op list is cut into batches identically on every rank (``TransferOp.batch``:
    chunks of ``max_ops_per_batch``, by migration round when ``migration_batching``); each
    batch's own ops are posted with one ``batch_isend_irecv`` and waited for with the layer's
    deadline (see :mod:`eplb.transfer`).
    """

    def __init__(self, name: str | None = None):
        if name not in (None, "gloo", "nccl"):
            raise ValueError(f"TorchCommunicator runs on gloo or nccl, not {name!r}")
        self.name = name or "torch"
        self._expected = name
        self._checked: set[int] = set()
        self.layers = 0
        self.bytes_sent = 0
        self.bytes_received = 0

    def _check_backend(self, group: Any) -> None:
        if self._expected is None or id(group) in self._checked:
            return
        backend = str(dist.get_backend(group)).lower()
        if self._expected not in backend:
            raise CommunicatorUnavailable(f"communicator {self._expected!r} used on a {backend!r} group")
        self._checked.add(id(group))

    def exchange(self, x: LayerExchange) -> None:
        if x.is_idle:
            return
        self._check_backend(x.group)
        chunks: dict[int, list[tuple[TransferOp, torch.Tensor, torch.Tensor | None]]] = {}
        for op in x.sends:
            t = op.tensor if op.tensor.is_contiguous() else op.tensor.contiguous()
            chunks.setdefault(op.batch, []).append((op, t, None))
        for op in x.recvs:
            buf, target = (op.tensor, None) if op.tensor.is_contiguous() else (torch.empty_like(op.tensor), op.tensor)
            chunks.setdefault(op.batch, []).append((op, buf, target))
        num_chunks = x.num_batches
        me, limit, layer = x.rank, x.timeout, x.layer
        for c in sorted(chunks):
            entries = sorted(chunks[c], key=lambda e: e[0].index)
            ops = [e[0] for e in entries]
            p2p = [dist.P2POp(dist.isend if op.is_send else dist.irecv, buf, global_rank(x.group, op.peer), x.group)
                   for op, buf, _ in entries]
            try:
                works = dist.batch_isend_irecv(p2p)
            except RuntimeError as exc:
                raise TransferError(
                    f"posting chunk {c + 1}/{num_chunks} failed", layer=layer, rank=me,
                    peers=[op.peer for op in ops], timeout=limit, waiting=describe_ops(ops), cause=str(exc),
                ) from exc
            for work in works:
                remaining = x.deadline - time.monotonic()
                try:
                    # timedelta(0) would mean "no timeout": never pass less than a millisecond.
                    ok = work.wait(timeout=timedelta(seconds=max(remaining, 1e-3)))
                except RuntimeError as exc:
                    pending = pending_ops(ops, works)
                    kwargs = _ErrorFields(layer=layer, rank=me, peers=[op.peer for op in pending], timeout=limit,
                                          waiting=describe_ops(pending), cause=str(exc).splitlines()[0][:300])
                    if "timed out" in str(exc).lower() or "timeout" in str(exc).lower():
                        raise TransferTimeout(
                            f"transfer chunk {c + 1}/{num_chunks} not done within {limit:g}s", **kwargs
                        ) from exc
                    raise TransferError(f"transfer chunk {c + 1}/{num_chunks} failed", **kwargs) from exc
                if ok is False:
                    pending = pending_ops(ops, works)
                    raise TransferTimeout(
                        f"transfer chunk {c + 1}/{num_chunks} not done within {limit:g}s", layer=layer, rank=me,
                        peers=[op.peer for op in pending], timeout=limit, waiting=describe_ops(pending),
                    )
            for _, buf, target in entries:
                if target is not None:
                    target.copy_(buf)
        self.layers += 1
        self.bytes_sent += sum(op.tensor.numel() * op.tensor.element_size() for op in x.sends)
        self.bytes_received += sum(op.tensor.numel() * op.tensor.element_size() for op in x.recvs)

    def stats(self) -> dict[str, Any]:
        return {"name": self.name, "layers": self.layers, "bytes_sent": self.bytes_sent,
                "bytes_received": self.bytes_received}


# ---------------------------------------------------------------------------------------------
# NIXL: one-sided reads over UCX

def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def _device_of(t: torch.Tensor) -> tuple[str, int]:
    """NIXL memory type and device id of a tensor."""
    return ("VRAM", t.get_device()) if t.is_cuda else ("DRAM", 0)


@dataclass
class _Region:
    """Tensors registered (or to be registered) with the agent, as one unit."""

    by_layer: list[list[torch.Tensor] | None] | None  # weights: per layer; a buffer: None
    tensors: list[torch.Tensor]
    transient: bool = False
    registered: list[Any] = field(default_factory=list)  # the agent's registration lists

    @property
    def nbytes(self) -> int:
        return sum(_nbytes(t) for t in self.tensors)

    def same_tensors(self, tensors: Sequence[torch.Tensor]) -> bool:
        return len(tensors) == len(self.tensors) and all(a is b for a, b in zip(tensors, self.tensors))

    def table(self) -> list[list[tuple[int, int, int, int, str, int]] | None] | None:
        """What peers need to read a slot: per layer, per tensor (addr, bytes, slot bytes, slots, mem, dev)."""
        if self.by_layer is None:
            return None
        out: list[list[tuple[int, int, int, int, str, int]] | None] = []
        for layer in self.by_layer:
            if not layer:
                out.append(None)
                continue
            row = []
            for t in layer:
                slots = t.shape[0] if t.dim() else 0
                mem, dev = _device_of(t)
                row.append((t.data_ptr(), _nbytes(t), _nbytes(t) // slots if slots else 0, slots, mem, dev))
            out.append(row)
        return out


def _flatten(weights: Sequence[Sequence[torch.Tensor] | None] | None) -> tuple[list[list[torch.Tensor] | None], list[torch.Tensor]]:
    by_layer: list[list[torch.Tensor] | None] = []
    flat: list[torch.Tensor] = []
    for layer in weights or ():
        if not layer:
            by_layer.append(None)
            continue
        tensors = list(layer)
        for t in tensors:
            if not t.is_contiguous():
                raise ValueError("NIXL registers contiguous weight tensors only (a slot is read as one block)")
        by_layer.append(tensors)
        flat.extend(t for t in tensors if t.numel())
    return by_layer, flat


@dataclass
class _Peer:
    agent: str
    weights: Any  # the peer's table of readable weights (see _Region.table)
    incoming: Any


class _NixlMemory:
    """The NIXL agent of one communicator and the memory it has registered with it: the weights,
    the incoming weights of a scale, and staging buffers (see :class:`NixlCommunicator`). Not
    locked: the communicator calls it under its own lock."""

    def __init__(self, agent_name: str, backends: list[str], progress_thread: bool):
        self.agent_name, self._backends, self.progress_thread = agent_name, backends, progress_thread
        self.agent: Any = None
        self._api: Any = None
        self.weights: _Region | None = None
        self.incoming: _Region | None = None
        self.buffers: list[_Region] = []
        self.registrations = 0
        self.deregistrations = 0

    def get_agent(self) -> Any:
        if self.agent is None:
            self._api = _nixl_api()
            config = self._api.nixl_agent_config(enable_prog_thread=self.progress_thread, backends=self._backends)
            agent = self._api.nixl_agent(self.agent_name, config)
            missing = [b for b in self._backends if b not in agent.backends]
            if missing:  # NIXL only warns when a backend plugin is missing
                raise CommunicatorUnavailable(f"NIXL started without the {missing} backend(s) "
                                              f"(plugins found: {agent.get_plugin_list()})")
            self.agent = agent
            log.debug("NIXL agent %s created", self.agent_name)
        return self.agent

    def register(self, region: _Region) -> None:
        if region.registered or not region.tensors:
            return
        agent = self.get_agent()
        by_device: dict[tuple[str, int], list[torch.Tensor]] = {}
        for t in region.tensors:
            by_device.setdefault(_device_of(t), []).append(t)
        for tensors in by_device.values():
            descs = agent.register_memory(tensors)
            if descs is None:
                raise ValueError("NIXL could not describe the tensors to register (contiguous, one device?)")
            region.registered.append(descs)
        self.registrations += 1

    def deregister(self, region: _Region | None) -> None:
        if region is None or self.agent is None:
            return
        for descs in region.registered:
            self.agent.deregister_memory(descs)
        if region.registered:
            self.deregistrations += 1
        region.registered = []

    def ensure_registered(self) -> None:
        for region in (self.weights, self.incoming, *self.buffers):
            if region is not None:
                self.register(region)

    def drop_transient(self) -> None:
        for region in self.buffers:
            if region.transient:
                self.deregister(region)
        self.buffers = [r for r in self.buffers if not r.transient]

    def set_weights(self, weights: Sequence[Sequence[torch.Tensor] | None], *, exchanged: bool) -> None:
        by_layer, flat = _flatten(weights)
        if self.weights is not None and self.weights.same_tensors(flat):
            self.weights.by_layer = by_layer
            return
        if exchanged:
            raise RuntimeError("the weights were replaced after this generation's NIXL metadata exchange: "
                               "peers would read freed memory (use set_incoming/adopt_incoming, or bind "
                               "a new generation first)")
        if self.weights is not None:
            self.deregister(self.weights)
        self.weights = _Region(by_layer, flat)
        self.register(self.weights)

    def set_incoming(self, weights: Sequence[Sequence[torch.Tensor] | None] | None) -> None:
        by_layer, flat = _flatten(weights) if weights is not None else (None, None)
        if flat is not None and self.incoming is not None and self.incoming.same_tensors(flat):
            return  # registered ahead (a joining rank standing by): keep the registration
        if self.incoming is not None:
            self.deregister(self.incoming)
        self.incoming = None
        if flat is not None:
            self.incoming = _Region(by_layer, flat)
            self.register(self.incoming)

    def adopt_incoming(self) -> None:
        """The incoming weights become the weights (the old ones deregistered); transient buffers go."""
        self.drop_transient()
        if self.incoming is not None:
            old, self.weights, self.incoming = self.weights, self.incoming, None
            self.deregister(old)

    def add_buffer(self, tensors: Sequence[torch.Tensor], *, transient: bool = False) -> None:
        flat = [t for t in tensors if t.numel()]
        for t in flat:
            if not t.is_contiguous():
                raise ValueError("NIXL registers contiguous staging tensors only")
        if any(r.same_tensors(flat) for r in self.buffers):
            return
        self.buffers.append(_Region(None, flat, transient))
        self.register(self.buffers[-1])

    def remove_buffer(self, tensors: Sequence[torch.Tensor]) -> None:
        flat = [t for t in tensors if t.numel()]
        keep = []
        for region in self.buffers:
            if region.same_tensors(flat):
                self.deregister(region)
            else:
                keep.append(region)
        self.buffers = keep

    def held(self) -> list[_Region]:
        return [r for r in (self.weights, self.incoming, *self.buffers) if r is not None]

    def release(self) -> None:
        """Deregister everything and let go of the agent."""
        if self.agent is not None:
            for region in self.held():
                self.deregister(region)
        self.weights = self.incoming = None
        self.buffers = []
        self.agent = None


class NixlCommunicator(Communicator):
    """Receivers pull remote experts with one-sided NIXL reads into their staging buffer.

    - One agent per process (created at the first registration), named uniquely (host, pid,
      random).
    - Registration is local and immediate: tensors named by :meth:`set_weights`,
      :meth:`set_incoming` and :meth:`add_buffer` are registered at once (a worker does it when
      a generation starts), so a transfer only pays the exchange; tensors that stay the same
      across generations are not registered again. A tensor is deregistered before the
      communicator lets go of it (:meth:`set_weights` with other tensors, :meth:`adopt_incoming`,
      :meth:`remove_buffer`, :meth:`close`), and referenced until then, so never freed while
      registered.
    - Metadata exchange: at the first transfer after :meth:`bind`, each rank publishes its
      agent metadata and the table of its weights (and incoming weights) under
      ``nixl/md/{rank}`` of the generation's store, waits for every peer's (with the layer's
      deadline) and loads them. Once per generation: ``stats()["exchanges_by_generation"]``.
    - A layer: check that this rank's sends come from its registered weights, post one read
      request per peer (local staging slot <- remote weight slot), poll them until done or the
      deadline (with ``migration_batching``: one migration round after another, so a receiver
      reads from one peer at a time; rounds are not synchronized across receivers, which would
      cost a collective per round, so a sender may still serve two readers that drifted into
      different rounds), then a MAX all-reduce of per-rank failure flags on the layer's group
      (``async_op=True``, waited for until the deadline): a sender learns that its readers are
      done (it may then change its weights) and every rank learns whether any rank failed.
    - Progress: UCX serves a peer's reads only while this side's worker is progressed. NIXL's
      progress thread does that but polls (measured 0.25-0.5 of a core per idle process on the
      2-core test machine, in every worker, all the time), so by default there is none and the
      layer's own waits drive progress: polling the reads, and polling the end-of-layer
      all-reduce (``work.is_completed()`` with ``get_new_notifs()``, which progresses the UCX
      worker) until the deadline. ``progress_thread=True`` keeps NIXL's thread and waits with
      ``work.wait(timeout=remaining)``.
    """

    name = "nixl"
    collective_per_layer = True

    def __init__(self, *, agent_name: str | None = None, backends: Sequence[str] = ("UCX",),
                 progress_thread: bool = False):
        self.agent_name = agent_name or f"eplb-{socket.gethostname()}-{os.getpid()}-{uuid.uuid4().hex[:8]}"
        self._mem = _NixlMemory(self.agent_name, list(backends), progress_thread)
        self._lock = threading.RLock()
        # stats() reads the peers, the generation and the exchange counts together under this
        # one (never held across a wait): a status read during an exchange sees it before or after
        self._view = threading.Lock()
        self._generation: int | None = None
        self._aborted: str | None = None  # why waits give up at once (abort), until the next generation
        self._store: Any = None
        self._exchanged = False
        self._peers: dict[int, _Peer] = {}
        self._loaded: set[str] = set()  # remote agents loaded into our agent (kept across generations)
        self._metadata: dict[str, bytes] = {}  # the last metadata each loaded remote agent published
        self._leaked: list[Any] = []  # transfer handles that could not be released (kept alive)
        # counters (exposed by stats())
        self.exchanges_by_generation: dict[int, int] = {}
        self.peers_learned = 0
        self.peers_forgotten = 0
        self.remote_reloads = 0  # known peers' agents loaded again because our view of them was stale
        self.layers = 0
        self.reads = 0
        self.read_requests = 0  # posted read requests (one per peer per layer, or per peer per round)
        self.bytes_read = 0
        self.read_seconds = 0.0
        self.start_wait_seconds = 0.0  # waiting for the group to enter a layer (start_together)
        self.agree_seconds = 0.0
        self.exchange_seconds = 0.0

    # -- lifecycle ----------------------------------------------------------------------------
    def abort(self, reason: str) -> None:
        self._aborted = reason  # no lock: a layer in flight holds it; its polls read this

    def clear_abort(self) -> None:
        self._aborted = None

    def _check_aborted(self, x: LayerExchange, peers: Sequence[int], waiting: str) -> None:
        if self._aborted is not None:
            raise TransferError(f"NIXL layer aborted: {self._aborted}", layer=x.layer, rank=x.rank, peers=peers,
                                timeout=x.timeout, waiting=waiting)

    def bind(self, generation: int, store: Any | None = None) -> None:
        with self._lock:
            if generation == self._generation:
                return
            self._aborted = None
            self._forget_peers()
            self._mem.drop_transient()
            with self._view:
                self._generation = generation
            self._store = None if store is None else dist.PrefixStore("nixl/", store)
            self._exchanged = False

    def _forget_peers(self) -> None:
        """Drop this generation's peer table (a new generation exchanges again). The remote agents
        stay loaded: a peer that is in the next generation too is loaded again over its old
        connection (:meth:`_release_departed` lets go of the others)."""
        with self._view:
            self.peers_forgotten += len(self._peers)
            self._peers = {}

    def _release_departed(self, staying: set[str]) -> None:
        """Unload the remote agents not in ``staying`` (retired or dead peers).

        A remote agent is never unloaded and loaded again while its process lives: NIXL's
        ``remove_remote_agent`` leaves its UCX connection's socket open, and loading the agent
        again opens another, so a surviving rank held one more TCP connection to every other
        survivor per group generation (38 -> 99 fds over 20 scale cycles). Loading the metadata of
        an agent already loaded updates it (new registrations) over the same connection."""
        for name in sorted(self._loaded - staying):
            try:
                self._agent.remove_remote_agent(name)
            except Exception as exc:  # noqa: BLE001 - a peer already gone is forgotten anyway
                log.debug("unloading NIXL peer %s: %s", name, exc)
            self._loaded.discard(name)
            self._metadata.pop(name, None)

    @property
    def _agent(self) -> Any:
        return self._mem.agent

    @property
    def _weights(self) -> _Region | None:
        return self._mem.weights

    def set_weights(self, weights: Sequence[Sequence[torch.Tensor] | None]) -> None:
        with self._lock:
            self._mem.set_weights(weights, exchanged=self._exchanged)

    def set_incoming(self, weights: Sequence[Sequence[torch.Tensor] | None] | None) -> None:
        with self._lock:
            self._mem.set_incoming(weights)

    def adopt_incoming(self) -> None:
        with self._lock:
            self._mem.adopt_incoming()
            # every rank adopts at the same point: flip the peers' view the same way (a peer that
            # published no incoming weights kept its tensors, written in place)
            for peer in self._peers.values():
                if peer.incoming is not None:
                    peer.weights, peer.incoming = peer.incoming, None

    def add_buffer(self, tensors: Sequence[torch.Tensor], *, transient: bool = False) -> None:
        with self._lock:
            self._mem.add_buffer(tensors, transient=transient)

    def remove_buffer(self, tensors: Sequence[torch.Tensor]) -> None:
        with self._lock:
            self._mem.remove_buffer(tensors)

    def close(self) -> None:
        with self._lock:
            if self._mem.agent is not None:
                self._forget_peers()
                self._release_departed(set())
            self._mem.release()
            self._exchanged = False

    # -- the metadata exchange --------------------------------------------------------------
    def _exchange_metadata(self, x: LayerExchange, size: int) -> None:
        if self._store is None:
            raise ValueError("the NIXL communicator is not bound to a generation's store: call bind(generation, store)")
        started = time.monotonic()
        agent = self._mem.get_agent()
        me = x.rank
        info = {"agent": self.agent_name, "md": agent.get_agent_metadata(),
                "weights": None if self._weights is None else self._weights.table(),
                "incoming": None if self._mem.incoming is None else self._mem.incoming.table()}
        self._store.set(f"md/{me}", pickle.dumps(info))
        others = [r for r in range(size) if r != me]
        keys = [f"md/{r}" for r in others]
        if keys:
            # polled, not one blocking store wait: an abort (the group broke) ends it now, not at the
            # layer's deadline, and the store's client is not held for the whole wait
            backoff, cause = _Backoff(first=1e-3, cap=0.02), "the deadline passed"
            while True:
                try:
                    missing = [r for r in others if not self._store.check([f"md/{r}"])]
                except Exception as exc:  # noqa: BLE001 - the store raises its own error types
                    missing, cause = others, str(exc).splitlines()[0][:300] or type(exc).__name__
                    break
                if not missing:
                    break
                self._check_aborted(x, missing, f"the agent metadata of ranks {missing}")
                if time.monotonic() >= x.deadline:
                    break
                backoff.sleep(x.deadline)
            if missing:
                raise TransferTimeout(
                    "NIXL metadata exchange not done within the deadline", layer=x.layer, rank=me,
                    peers=missing, timeout=x.timeout,
                    waiting=f"the agent metadata of ranks {missing} (generation {self._generation})",
                    cause=cause,
                )
        self._forget_peers()
        learned: dict[int, _Peer] = {}
        try:
            infos = {r: pickle.loads(self._store.get(f"md/{r}")) for r in others}
            self._release_departed({i["agent"] for i in infos.values()})
            for r, peer_info in infos.items():
                agent.add_remote_agent(peer_info["md"])  # a known agent: its metadata updated, same connection
                self._loaded.add(peer_info["agent"])
                self._metadata[peer_info["agent"]] = peer_info["md"]
                learned[r] = _Peer(peer_info["agent"], peer_info["weights"], peer_info["incoming"])
        except BaseException:
            with self._view:
                self._peers = learned  # what was added is forgotten the usual way, at the next bind
            raise
        self._exchanged = True
        gen = -1 if self._generation is None else self._generation
        with self._view:
            self._peers = learned
            self.peers_learned += len(learned)
            self.exchanges_by_generation[gen] = self.exchanges_by_generation.get(gen, 0) + 1
            self.exchange_seconds += time.monotonic() - started

    # -- one layer ----------------------------------------------------------------------------
    def _check_sends(self, x: LayerExchange) -> str:
        """'' when every send's source lies in this rank's registered weights, else the reason."""
        if not x.sends:
            return ""
        layer = x.layer
        assert layer is not None  # exchange() refuses a LayerExchange without a layer index
        by_layer = self._weights.by_layer if self._weights is not None else None
        tensors = by_layer[layer] if by_layer is not None and layer < len(by_layer) else None
        if not tensors:
            return f"layer {layer}: this rank sends but registered no weights for the layer (set_weights)"
        for op in x.sends:
            base = tensors[op.weight]
            addr = op.tensor.data_ptr()
            if not (base.data_ptr() <= addr and addr + _nbytes(op.tensor) <= base.data_ptr() + _nbytes(base)):
                return (f"layer {layer}: the source of {describe_ops([op])} is not inside the registered weights "
                        "(the weights were replaced without set_weights)")
        return ""

    def _read_requests(self, x: LayerExchange,
                       ops: Sequence[TransferOp]) -> dict[int, tuple[list[TransferOp], list[tuple], list[tuple], str]]:
        """Per peer: (ops, local descriptors, remote descriptors, mem type)."""
        out: dict[int, tuple[list[TransferOp], list[tuple], list[tuple], str]] = {}
        layer = x.layer
        assert layer is not None  # exchange() refuses a LayerExchange without a layer index
        for op in ops:
            peer = self._peers.get(op.peer)
            if peer is None:
                raise TransferError("no NIXL metadata for a peer", layer=x.layer, rank=x.rank, peers=[op.peer],
                                    waiting=describe_ops([op]))
            table = peer.weights
            row = table[layer] if table is not None and layer < len(table) else None
            if not row:
                raise TransferError(f"rank {op.peer} published no weights for layer {x.layer}", layer=x.layer,
                                    rank=x.rank, peers=[op.peer], waiting=describe_ops([op]))
            addr, _, slot_bytes, slots, mem, dev = row[op.weight]
            dst = op.tensor
            if not dst.is_contiguous():
                raise ValueError("NIXL reads into contiguous staging slots only")
            if _nbytes(dst) != slot_bytes or op.transfer.src_slot >= slots:
                raise TransferError(
                    f"remote slot {op.transfer.src_slot} of tensor {op.weight} on rank {op.peer} has {slot_bytes} "
                    f"bytes ({slots} slots); the staging slot has {_nbytes(dst)}", layer=x.layer, rank=x.rank,
                    peers=[op.peer])
            local_mem, local_dev = _device_of(dst)
            if local_mem != mem:
                raise TransferError(f"reading {mem} on rank {op.peer} into {local_mem} is not supported",
                                    layer=x.layer, rank=x.rank, peers=[op.peer])
            entry = out.setdefault(op.peer, ([], [], [], mem))
            entry[0].append(op)
            entry[1].append((dst.data_ptr(), _nbytes(dst), local_dev))
            entry[2].append((addr + op.transfer.src_slot * slot_bytes, slot_bytes, dev))
        return out

    def _initialize_read(self, local: list[tuple], remote: list[tuple], mem: str, name: str) -> Any:
        """A read request from agent ``name``; its agent is loaded again once if NIXL does not find the
        remote descriptors in our view of it.

        Loading the metadata of an agent already loaded adds its new registrations to our view
        but keeps the ones it dropped, and NIXL then fails to find a descriptor that lies in a
        new registration when a dropped one starts inside it before the descriptor
        (``createXferReq``: ``NIXL_ERR_NOT_FOUND``): a peer whose weights a switch moved over
        memory where it had registered something else (a scale cycle in 4-12 of a served
        model's). Loaded again from the metadata it published for this generation, the view
        holds only its current registrations. Only then: a reload costs the connection's socket
        (see :meth:`_release_departed`)."""
        agent = self._agent

        def initialize() -> Any:
            return agent.initialize_xfer("READ", agent.get_xfer_descs(local, mem), agent.get_xfer_descs(remote, mem), name)

        try:
            return initialize()
        except Exception as exc:  # noqa: BLE001 - NIXL's own error types
            if "NOT_FOUND" not in f"{type(exc).__name__} {exc}" or name not in self._metadata:
                raise
        log.info("NIXL: reloading peer agent %s (its registrations moved over ones it dropped)", name)
        agent.remove_remote_agent(name)
        agent.add_remote_agent(self._metadata[name])
        self.remote_reloads += 1
        return initialize()

    def _read(self, x: LayerExchange) -> str:
        """Post and wait for every read of the layer; '' on success, else the reason (or raise a timeout).

        All at once (one request per peer), or with ``migration_batching`` one migration round
        after another: the reads of a round come from one peer, so this receiver reads from one
        peer at a time."""
        groups: dict[int, list[TransferOp]] = {}
        for op in x.recvs:
            groups.setdefault(op.batch if x.migration_batching else 0, []).append(op)
        for batch in sorted(groups):
            failed = self._read_ops(x, groups[batch])
            if failed:
                return failed
        return ""

    def _read_ops(self, x: LayerExchange, ops: Sequence[TransferOp]) -> str:
        """Post and wait for ``ops``' reads (one request per peer); '' on success, else the reason."""
        agent = self._agent
        handles: dict[int, tuple[Any, list[TransferOp]]] = {}
        failed = ""
        try:
            try:
                requests = self._read_requests(x, ops)
            except (TransferError, ValueError) as exc:  # told to every rank by the all-reduce
                return str(exc)
            for peer, (ops, local, remote, mem) in sorted(requests.items()):
                try:  # NIXL raises its own errors (nixlNotFoundError...): the layer fails, told to every rank
                    handle = self._initialize_read(local, remote, mem, self._peers[peer].agent)
                except Exception as exc:  # noqa: BLE001
                    failed = f"posting the NIXL read from rank {peer} failed: {type(exc).__name__}: {exc}"
                    break
                handles[peer] = (handle, ops)
                self.read_requests += 1
                try:
                    posted = agent.transfer(handle)
                except Exception as exc:  # noqa: BLE001
                    posted, failed = "ERR", f": {type(exc).__name__}: {exc}"
                if posted == "ERR":
                    failed = f"posting the NIXL read from rank {peer} failed{failed}"
                    break
            backoff = _Backoff(first=2e-5, cap=1e-3)
            while handles and not failed:
                for peer in list(handles):
                    try:
                        state = agent.check_xfer_state(handles[peer][0])
                    except Exception as exc:  # noqa: BLE001
                        state, failed = "ERR", f": {type(exc).__name__}: {exc}"
                    if state == "DONE":
                        handle, ops = handles.pop(peer)
                        self.reads += len(ops)
                        self.bytes_read += sum(_nbytes(op.tensor) for op in ops)
                        agent.release_xfer_handle(handle)
                    elif state == "ERR":
                        failed = f"the NIXL read from rank {peer} failed ({describe_ops(handles[peer][1])}){failed}"
                        break
                if handles and not failed:
                    self._check_aborted(x, sorted(handles), "NIXL reads")
                    if time.monotonic() >= x.deadline:
                        pending = [op for _, ops in handles.values() for op in ops]
                        raise TransferTimeout(
                            f"NIXL reads not done within {x.timeout:g}s", layer=x.layer, rank=x.rank,
                            peers=sorted(handles), timeout=x.timeout, waiting=describe_ops(pending))
                    backoff.sleep(x.deadline)
        finally:
            for handle, _ in handles.values():  # not done: cancel if possible, else keep it alive
                try:
                    agent.release_xfer_handle(handle)
                except Exception:  # noqa: BLE001
                    self._leaked.append(handle)
        return failed

    def _agree(self, x: LayerExchange, size: int, failed: bool) -> list[int]:
        """MAX all-reduce of per-rank failure flags, waited for until the layer's deadline."""
        flags = torch.zeros(size, dtype=torch.int32)
        if str(dist.get_backend(x.group)).lower() == "nccl":
            flags = flags.cuda()
        flags[x.rank] = int(failed)
        try:
            work = dist.all_reduce(flags, op=dist.ReduceOp.MAX, group=x.group, async_op=True)
            if self._mem.progress_thread:
                ok = work.wait(timeout=timedelta(seconds=max(x.deadline - time.monotonic(), 1e-3)))
            else:
                ok = self._wait_progressing(work, x)
        except TransferError:
            raise  # aborted: already says why
        except RuntimeError as exc:
            others = [r for r in range(size) if r != x.rank]
            kwargs = _ErrorFields(layer=x.layer, rank=x.rank, peers=others, timeout=x.timeout,
                                  waiting="the end-of-layer all-reduce (a peer has not finished the layer)",
                                  cause=str(exc).splitlines()[0][:300])
            if "timed out" in str(exc).lower() or "timeout" in str(exc).lower():
                raise TransferTimeout(f"NIXL layer not agreed within {x.timeout:g}s", **kwargs) from exc
            raise TransferError("NIXL end-of-layer all-reduce failed", **kwargs) from exc
        if ok is False:
            raise TransferTimeout(f"NIXL layer not agreed within {x.timeout:g}s", layer=x.layer, rank=x.rank,
                                  peers=[r for r in range(size) if r != x.rank], timeout=x.timeout,
                                  waiting="the end-of-layer all-reduce")
        return [r for r, v in enumerate(flags.cpu().tolist()) if v]

    def _start_together(self, x: LayerExchange, size: int) -> None:
        """Wait until every rank of the group has entered the layer (``x.start_together``), or
        raise :class:`TransferTimeout` at the layer's deadline (:meth:`abort`: TransferError).

        Nobody reads before this returns, so nothing needs UCX progress meanwhile, and the wait
        polls coarsely: a joining rank of a scale waits here for most of its pre-transfer (its
        layers come one decode step at a time, at the old group's pace), and a 1 ms poll would
        take that CPU from the ranks that decode."""
        flags = torch.zeros(1, dtype=torch.int32)
        if str(dist.get_backend(x.group)).lower() == "nccl":
            flags = flags.cuda()
        others = [r for r in range(size) if r != x.rank]
        try:
            work = dist.all_reduce(flags, op=dist.ReduceOp.MAX, group=x.group, async_op=True)
            backoff = _Backoff(first=1e-4, cap=_START_POLL_S)
            while not work.is_completed():
                self._check_aborted(x, others, "the other ranks to enter the layer")
                if time.monotonic() >= x.deadline:
                    raise TransferTimeout(f"the ranks did not all enter the layer within {x.timeout:g}s",
                                          layer=x.layer, rank=x.rank, peers=others, timeout=x.timeout,
                                          waiting="the start-of-layer all-reduce")
                backoff.sleep(x.deadline)
            work.wait()
        except TransferError:
            raise  # aborted or timed out: already says why
        except RuntimeError as exc:
            raise TransferError("NIXL start-of-layer all-reduce failed", layer=x.layer, rank=x.rank, peers=others,
                                timeout=x.timeout, waiting="the start-of-layer all-reduce",
                                cause=str(exc).splitlines()[0][:300]) from exc

    def _wait_progressing(self, work: Any, x: LayerExchange) -> bool:
        """Wait for ``work`` until the layer's deadline while driving UCX progress (no progress
        thread): peers may still be reading from this rank, and UCX serves them only when
        progressed. False at the deadline; the completed work's own error is raised by ``wait``;
        :meth:`abort` ends it at once (TransferError)."""
        backoff = _Backoff(first=2e-5, cap=1e-3)
        others = [r for r in range(dist.get_world_size(x.group)) if r != x.rank]
        while not work.is_completed():
            self._check_aborted(x, others, "the end-of-layer all-reduce")
            if time.monotonic() >= x.deadline:
                return False
            self._agent.get_new_notifs()  # NIXL's UCX backend progresses its worker here
            backoff.sleep(x.deadline)
        work.wait()
        return True

    def exchange(self, x: LayerExchange) -> None:
        if x.layer is None:
            raise ValueError("NIXL transfers need the layer index (execute_layer(..., layer=i))")
        with self._lock:
            size = dist.get_world_size(x.group)
            self._mem.ensure_registered()
            if not self._exchanged:
                self._exchange_metadata(x, size)
            started = time.monotonic()
            if x.start_together and size > 1:
                self._start_together(x, size)
                self.start_wait_seconds += time.monotonic() - started
                started = time.monotonic()
            failed = self._check_sends(x)
            if not failed:
                failed = self._read(x)
            self.read_seconds += time.monotonic() - started
            started = time.monotonic()
            failed_ranks = self._agree(x, size, bool(failed)) if size > 1 else ([x.rank] if failed else [])
            self.agree_seconds += time.monotonic() - started
            self.layers += 1
            if failed:
                raise TransferError(failed, layer=x.layer, rank=x.rank,
                                    peers=sorted({op.peer for op in x.recvs} | set(failed_ranks) - {x.rank}),
                                    timeout=x.timeout)
            if failed_ranks:
                raise TransferError(f"ranks {failed_ranks} failed their part of the layer", layer=x.layer,
                                    rank=x.rank, peers=failed_ranks, timeout=x.timeout)

    def stats(self) -> dict[str, Any]:
        # not the transfer lock: a layer in flight holds it for up to its deadline
        held = self._mem.held()
        regions = [r for r in held if r.registered]
        with self._view:
            view = {"generation": self._generation, "exchanges": sum(self.exchanges_by_generation.values()),
                    "exchanges_by_generation": dict(self.exchanges_by_generation),
                    "peers": sorted(self._peers), "peers_learned": self.peers_learned,
                    "peers_forgotten": self.peers_forgotten, "remote_agents": len(self._loaded),
                    "remote_reloads": self.remote_reloads}
        return {
            "name": self.name, "agent": self.agent_name, **view,
            "registered_regions": len(regions), "registered_bytes": sum(r.nbytes for r in regions),
            # named but not registered yet (registration waits for the next transfer)
            "pending_bytes": sum(r.nbytes for r in held if not r.registered),
            "registrations": self._mem.registrations, "deregistrations": self._mem.deregistrations,
            "layers": self.layers, "reads": self.reads, "read_requests": self.read_requests,
            "bytes_read": self.bytes_read,
            "read_seconds": self.read_seconds, "agree_seconds": self.agree_seconds,
            "start_wait_seconds": self.start_wait_seconds,
            "exchange_seconds": self.exchange_seconds, "leaked_handles": len(self._leaked),
        }
