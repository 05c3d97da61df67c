"""The dense weights of an EP group's ranks on one host, in one copy of physical memory.

Every rank runs the model's dense layers (attention, routers, norms, embeddings, lm_head) for its
own few rows each step, so each reads all the dense weights every step: at 4 ranks on 2 cores
(the bench's model, 4-row decode steps) that read is a fixed cost per rank and step that EP 4
doubles against EP 2. Ranks that hold their own copies read four different copies through one
L3; mapped from one file (``MAP_PRIVATE``: a rank that writes a weight later, a
``sync_non_expert``, gets its own copy of the pages it writes, the others keep theirs), the ranks,
which run the same layer at about the same time, find each other's reads in the cache.

:func:`share_dense` is a collective of the group, run where its shared-memory exchange is set up
(:meth:`~eplb.models.hf.HFMoE._attach_local`: every rank of the group on this host). Rank 0 writes
its parameters' bytes (every storage whole, at page-aligned offsets: the same alignment mod 64 as
torch's allocator, so MKL takes the same paths) into a fresh file; every rank maps it and takes a
tensor's mapped copy only where the bytes are its own, with the same shape, strides and dtype (so
every output is bitwise what it was); then the file is unlinked. Any failure leaves the rank's own
weights. ``EPLB_SHARED_WEIGHTS=0`` turns it off.
"""

from __future__ import annotations

import mmap
import os
import tempfile
from typing import Any

import torch
from torch import nn

from eplb.models.local_exchange import _gather, remove_orphans, shared_dir

__all__ = ["MIN_BYTES", "share_dense"]

#: tensors smaller than this stay where they are (norms, biases: a page each for a few cache lines)
MIN_BYTES = 4096
_PAGE = 4096
_PATH_BYTES = 256


def enabled() -> bool:
    return os.environ.get("EPLB_SHARED_WEIGHTS", "1") != "0"


def _candidates(model: nn.Module) -> list[nn.Parameter]:
    """The dense parameters worth sharing, in name order (the same on every rank of a group): each
    the only tensor on a storage it covers whole (a view's neighbours would not follow it)."""
    seen: set[int] = set()
    out = []
    for name, p in sorted(model.named_parameters(remove_duplicate=True)):
        if ".experts." in f".{name}" or id(p) in seen or p.device.type != "cpu":
            continue
        seen.add(id(p))
        storage = p.untyped_storage()
        if storage.nbytes() < MIN_BYTES or p.storage_offset() != 0 or storage.nbytes() != p.numel() * p.element_size():
            continue
        out.append(p)
    return out


def _layout(params: list[nn.Parameter]) -> tuple[list[int], int]:
    offsets, at = [], 0
    for p in params:
        offsets.append(at)
        at += -(-p.untyped_storage().nbytes() // _PAGE) * _PAGE
    return offsets, at


def _raw(p: torch.Tensor) -> torch.Tensor:
    """The bytes of ``p``'s storage, in storage order (uint8, 1-D; no copy)."""
    return torch.empty(0, dtype=torch.uint8).set_(p.untyped_storage())


_PREFIX = "eplb-w-"


def _write(path_dir: str, params: list[nn.Parameter], offsets: list[int], total: int) -> str:
    """A fresh file of ``params``' bytes at ``offsets`` (its path), or ``""`` where it cannot be written."""
    path = ""
    try:
        remove_orphans(path_dir, _PREFIX)  # files of set-ups whose rank 0 died between writing and unlinking
        fd, path = tempfile.mkstemp(prefix=f"{_PREFIX}{os.getpid()}-", dir=path_dir)
        try:
            os.ftruncate(fd, total)
            for p, at in zip(params, offsets):
                data = memoryview(_raw(p).numpy().data)
                while data:
                    done = os.pwrite(fd, data, at)
                    data, at = data[done:], at + done
        finally:
            os.close(fd)
    except OSError:
        if path:
            os.unlink(path)
        return ""
    return path


def _map(path: str, total: int, params: list[nn.Parameter], offsets: list[int]
         ) -> tuple[mmap.mmap | None, dict[int, nn.Parameter]]:
    """The file mapped copy-on-write, and each parameter's mapped copy where its bytes are the same."""
    try:
        fd = os.open(path, os.O_RDONLY)
        try:
            mapped = mmap.mmap(fd, total, flags=mmap.MAP_PRIVATE, prot=mmap.PROT_READ | mmap.PROT_WRITE)
        finally:
            os.close(fd)
    except (OSError, ValueError):
        return None, {}
    taken: dict[int, nn.Parameter] = {}
    for p, at in zip(params, offsets):
        count = p.untyped_storage().nbytes() // p.element_size()
        copy = torch.frombuffer(mapped, dtype=p.dtype, count=count, offset=at).as_strided(p.shape, p.stride())
        if torch.equal(_raw(copy), _raw(p)):  # bytes, not values: -0.0 and NaNs compare as they are
            taken[id(p)] = nn.Parameter(copy, requires_grad=p.requires_grad)
    return mapped, taken


def share_dense(model: nn.Module, group: Any, rank: int, world: int, timeout: float, *,
                first_group: bool = True) -> tuple[mmap.mmap | None, int]:
    """Map the group's dense weights from one file (see the module docstring); a collective of
    ``group``. Returns the mapping (kept while the weights read it) and how many parameters now read
    it (``None, 0`` where sharing is off, the file could not be written or read, or this is not the
    deployment's first group on rank 0: ``first_group`` False).

    Once per deployment: rank 0 writes the file only at its first group's first step, so a group
    formed by a rescale (whose rank 0 is a survivor, which has served before) writes nothing and its
    ranks keep what they read (the survivors the first group's mapping, a new rank its own weights).
    Writing and mapping it took 40-70 ms of wall time on the bench's model (30 MB of dense weights, 2
    and 4 ranks), more with a larger model: at every rescale it would lengthen the step after it."""
    params = _candidates(model) if enabled() else []
    offsets, total = _layout(params)
    path = ""
    if rank == 0 and total and first_group:
        path = _write(shared_dir(), params, offsets, total)
    send = torch.zeros(_PATH_BYTES + 8, dtype=torch.uint8)
    raw_path = path.encode()
    if len(raw_path) <= _PATH_BYTES:
        send[: len(raw_path)] = torch.tensor(list(raw_path), dtype=torch.uint8)
    send[_PATH_BYTES:] = torch.tensor([total], dtype=torch.int64).view(torch.uint8)
    mapped: mmap.mmap | None = None
    taken: dict[int, nn.Parameter] = {}
    try:
        everyone = _gather(group, send, world, timeout)
        path = bytes(everyone[0][:_PATH_BYTES].tolist()).rstrip(b"\0").decode()
        if path and total and torch.equal(everyone[0][_PATH_BYTES:], send[_PATH_BYTES:]):  # rank 0's layout's size
            mapped, taken = _map(path, total, params, offsets)
        _gather(group, torch.ones(1, dtype=torch.int64), world, timeout)  # every rank has opened it (or given up)
    finally:
        if rank == 0 and path:
            try:
                os.unlink(path)
            except OSError:
                pass
    if not taken:
        return None, 0
    for module in model.modules():
        for name, p in list(module._parameters.items()):
            if p is not None and id(p) in taken:
                module._parameters[name] = taken[id(p)]
    return mapped, len(taken)
