"""Process-group generations on ``torch.distributed``.

Every generation of the EP group has its own key prefix in the shared ``TCPStore``
(``elastic/gen{k}/``), so a group being formed never sees an earlier generation's keys. The
default (decode) group of a generation carries the step's collectives; the EPLB group, made
with ``new_group`` over the same ranks, carries the async worker's point-to-point traffic so
it never interleaves with the decode loop's collectives.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch.distributed as dist

log = logging.getLogger("elastic.groups")


def backend_for(device: str) -> str:
    return "nccl" if device == "cuda" else "gloo"


def connect_store(host: str, port: int, timeout_s: float) -> dist.TCPStore:
    return dist.TCPStore(host, port, is_master=False, timeout=timedelta(seconds=timeout_s), use_libuv=True)


@dataclass
class GroupGeneration:
    """The process groups of one generation, as seen by one rank."""

    generation: int
    rank: int
    size: int
    backend: str
    timeout_s: float
    eplb_group: Any = None

    @classmethod
    def join(cls, store: dist.Store, generation: int, rank: int, size: int, *, backend: str = "gloo",
             timeout_s: float = 30.0) -> "GroupGeneration":
        """Form this generation's default group (a rendezvous: returns once all ``size`` ranks joined)."""
        if dist.is_initialized():
            raise RuntimeError("a process group is still alive: destroy the old generation first")
        prefix = dist.PrefixStore(f"elastic/gen{generation}/", store)
        dist.init_process_group(backend, store=prefix, rank=rank, world_size=size,
                                timeout=timedelta(seconds=timeout_s))
        log.debug("rank %d joined generation %d of size %d", rank, generation, size)
        return cls(generation, rank, size, backend, timeout_s)

    def build_eplb_group(self) -> Any:
        """A dedicated group over every rank for the EPLB's point-to-point traffic (collective call)."""
        self.eplb_group = dist.new_group(list(range(self.size)), timeout=timedelta(seconds=self.timeout_s),
                                         backend=self.backend)
        return self.eplb_group

    def destroy(self) -> None:
        """Tear down every group of this generation. The caller guarantees no transfer is in flight."""
        if dist.is_initialized():
            dist.destroy_process_group()
        self.eplb_group = None
