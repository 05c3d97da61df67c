"""The vocabulary a layer's network phase is spoken in, shared by the executor
(:mod:`eplb.transfer`) and the communicators (:mod:`eplb.communicator`): the ops of one rank, the
exchange of one layer, and the errors. Neither of those modules imports the other's internals
through here, so they form no import cycle: ``transfer`` uses ``communicator``, both use this.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from eplb.plan import Transfer

__all__ = ["LayerExchange", "TransferError", "TransferOp", "TransferTimeout", "describe_ops", "global_rank",
           "pending_ops"]


class TransferError(RuntimeError):
    """A layer's transfer failed (a peer's connection broke, a reload failed, ...).

    Fields: ``layer`` (index or None), ``rank`` (the raising group rank), ``peers`` (group
    ranks involved in what failed), ``timeout`` (seconds, when a deadline applied),
    ``waiting`` (a description of what was being waited for), ``cause`` (the original error
    text, if any).
    """

    def __init__(
        self,
        message: str,
        *,
        layer: int | None = None,
        rank: int | None = None,
        peers: Sequence[int] = (),
        timeout: float | None = None,
        waiting: str = "",
        cause: str = "",
    ):
        self.message = message
        self.layer = layer
        self.rank = rank
        self.peers = tuple(sorted(set(peers)))
        self.timeout = timeout
        self.waiting = waiting
        self.cause = cause
        super().__init__(self._describe())

    def _describe(self) -> str:
        where = f"layer {self.layer}" if self.layer is not None else "layer ?"
        if self.rank is not None:
            where += f", rank {self.rank}"
        text = f"{where}: {self.message}"
        if self.peers:
            text += f"; peers {list(self.peers)}"
        if self.waiting:
            text += f"; waiting for {self.waiting}"
        if self.cause:
            text += f" ({self.cause})"
        return text

    def __reduce__(self):
        kwargs = dict(layer=self.layer, rank=self.rank, peers=self.peers, timeout=self.timeout,
                      waiting=self.waiting, cause=self.cause)
        return (_rebuild_error, (type(self), self.message, kwargs))


class TransferTimeout(TransferError, TimeoutError):
    """A wait of a layer's transfer passed its deadline (a peer stuck, slow or gone)."""


def _rebuild_error(cls, message, kwargs):
    return cls(message, **kwargs)


@dataclass(frozen=True)
class TransferOp:
    """One weight tensor of one :class:`~eplb.plan.Transfer`, as one rank sees it.

    ``index`` is the op's position in the layer's global op list (``transfer.index * T + weight``),
    identical on every rank; ``batch`` the global batch it is posted in (identical on every rank,
    :func:`eplb.transfer.op_batches`); ``peer`` is the other side (group rank); ``tensor`` is the local
    side: the source slot for a send, the destination slot for a receive (a view of the
    caller's buffer, possibly non-contiguous).
    """

    index: int
    is_send: bool
    peer: int
    transfer: Transfer
    weight: int
    tensor: torch.Tensor
    batch: int


@dataclass(frozen=True)
class LayerExchange:
    """The network phase of one layer on one rank, handed to a :class:`~eplb.communicator.Communicator`.

    ``sends``/``recvs`` are this rank's ops in global op order. ``num_ops`` is the size of the
    global op list (the same on every rank), ``max_ops_per_batch`` the chunk size it is cut into;
    two-sided communicators post one batch (``TransferOp.batch``, of ``num_batches``) at a time.
    ``migration_batching``: the batches follow the plan's migration rounds (one peer per direction
    per rank and batch). ``deadline`` (``time.monotonic()``) bounds every wait; ``timeout``
    is the layer's limit in seconds, for messages. ``start_together``: no rank starts moving
    bytes before every rank of the group has entered the layer (equal on every rank). A
    two-sided communicator always does; a one-sided one (NIXL) otherwise reads as soon as the
    reader enters, which a scale's pre-transfer must not allow: its old ranks time-box each
    layer inside one decode step, and a read outside that step is decoding time no one counted.
    """

    layer: int | None
    rank: int
    group: Any
    sends: tuple[TransferOp, ...]
    recvs: tuple[TransferOp, ...]
    num_ops: int
    max_ops_per_batch: int
    timeout: float
    deadline: float
    num_batches: int = 0
    migration_batching: bool = False
    start_together: bool = False

    @property
    def is_idle(self) -> bool:
        return not (self.sends or self.recvs)


def global_rank(group, group_rank: int) -> int:
    """``group_rank`` of ``group`` as a rank of the default group (what ``P2POp`` takes)."""
    if group is None or group is dist.GroupMember.WORLD:
        return group_rank
    return dist.get_global_rank(group, group_rank)


def describe_ops(ops: Sequence[TransferOp]) -> str:
    """A short text naming the first ops (for error messages)."""
    parts = []
    for op in ops[:6]:
        t = op.transfer
        if op.is_send:
            parts.append(f"send of expert {t.expert} to rank {op.peer}")
        else:
            parts.append(f"recv of expert {t.expert} from rank {op.peer}")
    if len(ops) > 6:
        parts.append(f"... {len(ops) - 6} more ops")
    return ", ".join(dict.fromkeys(parts))


def pending_ops(ops: list[TransferOp], works: list) -> list[TransferOp]:
    """The ops whose work has not completed (all of them for a coalesced backend)."""
    if len(works) != len(ops):  # a coalesced backend: one work for the whole chunk
        return list(ops)
    out = []
    for op, work in zip(ops, works):
        try:
            done = work.is_completed()
        except Exception:  # noqa: BLE001
            done = False
        if not done:
            out.append(op)
    return out or list(ops)
