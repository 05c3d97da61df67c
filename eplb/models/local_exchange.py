"""The data plane's collectives over shared memory, when every rank of the EP group is on this host.

Measured on a 2-core AMD EPYC (torch 2.13, gloo over loopback): one gloo collective of a few
bytes costs each rank 0.35-0.5 ms of CPU at 2 ranks and 0.8-2 ms at 4 ranks (mostly system time
in gloo's transport thread: epoll, futex hand-offs between three threads, ~50 system calls per
op), and a served step runs ~10 of them: at 4 ranks on 2 cores that was most of a step's CPU.

:class:`LocalExchange` does the dispatch's all_gather and the combine's all_to_all over one
shared-memory file per rank instead:

- rank ``r`` writes what it sends into its own file (two regions, used by alternate ops), then
  the op's sequence number into the region's header;
- every rank waits until every peer's header shows the op's number, then copies what it receives
  out of the peers' files. A rank that has to wait sleeps in ``poll`` on its FIFOs from the peers
  (no spinning: a rank waiting costs nothing while the peers compute), having first written the
  op it sleeps on into its own file; the rank whose post completes a sleeper's op (the last
  poster) wakes it with one byte on its FIFO. So a sleeper is woken once per op and no byte goes
  to a rank that is awake: at 4 ranks on 2 cores, writing a byte to every peer on every post cost
  8-16% of the ranks' CPU per decode step (context switches, interleaved A/B in-process, 2026-12-03).
  Should a wake-up be missed (both sides' stores unseen by the other at once), the sleep ends at a
  20 ms time-out, doubling up to 0.32 s (5 ms also ended the sleeps of ranks whose last poster was
  merely preempted between its number and its byte: 1 nap in 6 sleeps at 4 ranks on 2 cores);
- an op's region is written again two ops later, which a rank reaches only after every peer has
  finished the op (a peer posts the next op only after it has copied this one out).

Every wait keeps a deadline (a :class:`TimeoutError`), and a peer that dies closes its FIFOs,
which ends the wait at once (POLLHUP). The bytes copied are the bytes gloo would have carried, so
the results are bitwise the same. It is set up once per group (:meth:`LocalExchange.create`,
three small gloo all_gathers, a collective every rank of the group calls at the same step) and
only where every rank sees the same shared-memory directory (the same host and mount namespace)
on x86-64 (its stores are seen in order by the other cores: the data before the number).
Ops larger than the regions, and groups it cannot serve, use gloo. ``EPLB_LOCAL_EXCHANGE=0``
turns it off. The files and FIFOs are unlinked as soon as every rank has opened them (by any rank
that gets there, so a rank 0 killed then does not keep them), and a set-up that fails part way
closes what it opened. A directory left by a set-up whose ranks were all killed before that is
named after its creator's pid, and the next set-up on the host removes it.
"""

from __future__ import annotations

import mmap
import os
import platform
import secrets
import select
import shutil
import struct
import tempfile
import time
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

__all__ = ["LocalExchange", "enabled"]

#: bytes of a region's header: the op's number, then ``[offset, length]`` of each destination's bytes
HEADER = 4096
#: where, in region 0's header of a rank's own file, it writes the op it sleeps on (left there after:
#: ops only grow, so a post of a later op never takes it for a sleeper)
_ASLEEP = HEADER - 8
#: the longest nap of a wait (the first is 20 ms, doubling): a wake-up missed late in a long wait
#: (a peer's long prefill) costs at most this much
_NAP_CAP = 0.32
#: bytes of a region's data (two regions per rank); larger ops go over gloo
CAPACITY = 8 << 20
_PATH_BYTES = 256


def enabled() -> bool:
    return os.environ.get("EPLB_LOCAL_EXCHANGE", "1") != "0" and platform.machine() in ("x86_64", "AMD64")


def _gather(group: Any, send: torch.Tensor, world: int, timeout: float) -> list[torch.Tensor]:
    recv = [torch.empty_like(send) for _ in range(world)]
    try:
        work = dist.all_gather(recv, send, group=group, async_op=True)
        done = work.wait(timeout=timedelta(seconds=timeout))
    except RuntimeError as exc:  # gloo's timeout, or a peer's closed connection
        raise TimeoutError(f"the shared-memory exchange's set-up failed: {exc}") from exc
    if done is False:
        raise TimeoutError(f"the shared-memory exchange's set-up did not finish within {timeout}s")
    return recv


_PREFIX = "eplb-x-"


def _new_directory() -> str:
    """A fresh directory for one set-up's files (in ``/dev/shm`` where there is one), named after
    this process; first the directories of set-ups whose creator is dead are removed. ``""`` where
    none can be made (then no rank uses shared memory)."""
    base = shared_dir()
    try:
        remove_orphans(base, _PREFIX)
        directory = tempfile.mkdtemp(prefix=f"{_PREFIX}{os.getpid()}-", dir=base)
        with open(os.path.join(directory, "token"), "w") as f:
            f.write(secrets.token_hex(8))
    except OSError:
        return ""
    return directory


def shared_dir() -> str:
    """Where a host's shared-memory files go: ``/dev/shm`` where there is one, else the temp directory."""
    return "/dev/shm" if os.path.isdir("/dev/shm") else tempfile.gettempdir()


def remove_orphans(base: str, prefix: str) -> None:
    """Remove the files and directories in ``base`` named ``<prefix><pid>-...`` whose creator ``pid``
    is dead (a set-up killed between making and removing them). Raises ``OSError`` if ``base`` cannot
    be listed."""
    for name in os.listdir(base):
        pid = name[len(prefix):].split("-", 1)[0]
        if name.startswith(prefix) and pid.isdigit() and not _alive(int(pid)):
            path = os.path.join(base, name)
            if os.path.isdir(path):
                shutil.rmtree(path, ignore_errors=True)
            else:
                try:
                    os.unlink(path)
                except OSError:
                    pass


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's: alive
        return True
    return True


class LocalExchange:
    """Collectives of one EP group over shared memory (see the module docstring)."""

    def __init__(self, group: Any, rank: int, world: int, maps: list[mmap.mmap], incoming: dict[int, int],
                 outgoing: dict[int, int]):
        self.group, self.rank, self.world = group, rank, world
        self._maps = maps
        self._buffers = [torch.frombuffer(m, dtype=torch.uint8) for m in maps]
        self._incoming, self._outgoing = incoming, outgoing  # peer -> FIFO fd
        self._peer_of_fd = {fd: peer for peer, fd in incoming.items()}
        self._poller = select.poll()
        for fd in incoming.values():
            self._poller.register(fd, select.POLLIN | select.POLLHUP | select.POLLERR)
        self._gone: set[int] = set()
        self.ops = 0
        self.closed = False

    # -- set-up ---------------------------------------------------------------------------------
    @classmethod
    def create(cls, group: Any, rank: int, world: int, timeout: float) -> LocalExchange | None:
        """Set up over ``group`` (a collective of every rank); ``None`` where any rank cannot use it
        (then every rank gets ``None``, and the group's collectives stay on gloo). A set-up that
        fails part way (a peer dead or late: :class:`TimeoutError`) leaves no file and no
        descriptor on this rank; a directory left by a set-up whose rank 0 was killed is removed
        by the next set-up on this host (its name carries its creator's pid)."""
        usable = enabled() and 8 + 16 * world <= _ASLEEP
        directory = ""
        maps: list[mmap.mmap] = []
        incoming: dict[int, int] = {}
        outgoing: dict[int, int] = {}
        ok = False
        try:
            if rank == 0 and usable:
                directory = _new_directory()
            raw = directory.encode()
            send = torch.zeros(_PATH_BYTES + 8, dtype=torch.uint8)
            if len(raw) <= _PATH_BYTES:
                send[: len(raw)] = torch.tensor(list(raw), dtype=torch.uint8)
            send[-1] = int(usable)
            everyone = _gather(group, send, world, timeout)
            directory = bytes(everyone[0][:_PATH_BYTES].tolist()).rstrip(b"\0").decode()
            if not all(int(g[-1]) for g in everyone):  # turned off on some rank: none uses it
                return None
            made = cls._phase(lambda: cls._make_own(directory, rank, world, incoming), group, world, timeout)
            ok = made and cls._phase(lambda: cls._open_peers(directory, rank, world, maps, outgoing), group, world,
                                     timeout)
        finally:
            if directory:  # every rank has opened what it needs, or given up (any rank may be the one left)
                shutil.rmtree(directory, ignore_errors=True)
            if not ok:
                for fd in (*incoming.values(), *outgoing.values()):
                    os.close(fd)
                for m in maps:
                    m.close()
        return cls(group, rank, world, maps, incoming, outgoing) if ok else None

    @staticmethod
    def _phase(step: Any, group: Any, world: int, timeout: float) -> bool:
        """Run ``step`` here; True when it worked on every rank (an all_gather of the outcomes)."""
        try:
            step()
            mine = 1
        except (OSError, ValueError):
            mine = 0
        flags = _gather(group, torch.tensor([mine], dtype=torch.int64), world, timeout)
        return all(int(f[0]) == 1 for f in flags)

    @staticmethod
    def _make_own(directory: str, rank: int, world: int, incoming: dict[int, int]) -> None:
        if not directory or not os.path.exists(os.path.join(directory, "token")):
            raise OSError("the shared-memory directory is not visible here (another host or namespace)")
        path = os.path.join(directory, f"rank{rank}")
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        try:
            os.posix_fallocate(fd, 0, 2 * (HEADER + CAPACITY))  # the pages now, or ENOSPC now (never SIGBUS later)
        finally:
            os.close(fd)
        for peer in range(world):
            if peer != rank:
                fifo = os.path.join(directory, f"fifo{peer}to{rank}")
                os.mkfifo(fifo, 0o600)
                incoming[peer] = os.open(fifo, os.O_RDONLY | os.O_NONBLOCK)

    @staticmethod
    def _open_peers(directory: str, rank: int, world: int, maps: list[mmap.mmap], outgoing: dict[int, int]) -> None:
        for peer in range(world):
            fd = os.open(os.path.join(directory, f"rank{peer}"), os.O_RDWR)
            try:
                maps.append(mmap.mmap(fd, 2 * (HEADER + CAPACITY)))
            finally:
                os.close(fd)
            if peer != rank:
                outgoing[peer] = os.open(os.path.join(directory, f"fifo{rank}to{peer}"), os.O_WRONLY | os.O_NONBLOCK)

    def close(self) -> None:
        if self.closed:
            return
        self.closed = True
        for fd in (*self._incoming.values(), *self._outgoing.values()):
            try:
                os.close(fd)
            except OSError:
                pass
        self._buffers = []
        for m in self._maps:
            try:
                m.close()
            except BufferError:  # a tensor view still exported: the mapping goes with the process
                pass

    def __del__(self) -> None:  # a model dropped with its exchange (a rescale builds a new one): free the fds
        try:
            self.close()
        except Exception:  # noqa: BLE001 - never raise from a finalizer
            pass

    # -- ops ------------------------------------------------------------------------------------
    @staticmethod
    def fits(nbytes: int) -> bool:
        """Whether an op whose largest sender sends ``nbytes`` goes over shared memory (decided
        from what every rank knows alike, so all ranks take the same path)."""
        return nbytes <= CAPACITY

    @staticmethod
    def _region(op: int) -> int:
        """Where op ``op``'s region starts in a rank's file (two regions, alternate ops)."""
        return (op & 1) * (HEADER + CAPACITY)

    def _post(self, chunks: list[tuple[int, int]], data: torch.Tensor | None, op: int) -> None:
        """Write this rank's bytes ``data`` (``chunks[r]``: offset and length of destination ``r``'s
        part; one chunk for everyone in an all_gather), then the op's number, then wake each peer
        asleep on this op whose wait this post ends (see :meth:`_wait`)."""
        base = self._region(op)
        mine = self._maps[self.rank]
        if data is not None and data.numel():
            self._buffers[self.rank][base + HEADER : base + HEADER + data.numel()].copy_(data)
        if chunks:
            struct.pack_into(f"{2 * len(chunks)}q", mine, base + 8, *(v for c in chunks for v in c))
        struct.pack_into("q", mine, base, op)  # after the data: a peer that sees the number sees the bytes
        # a peer not asleep on this op finds the number itself
        asleep = [(peer, fd) for peer, fd in self._outgoing.items()
                  if struct.unpack_from("q", self._maps[peer], _ASLEEP)[0] == op]
        if not asleep:
            return
        posted = [struct.unpack_from("q", m, base)[0] == op for m in self._maps]
        for peer, fd in asleep:
            # one that still waits on another peer is woken by that peer's post (the last poster
            # wakes; two at once both do)
            if not all(posted[r] for r in range(self.world) if r != peer):
                continue
            try:
                os.write(fd, b"\0")
            except BlockingIOError:  # the pipe is full of wake-ups the peer has not read: it will look anyway
                pass
            except BrokenPipeError:
                self._gone.add(peer)

    def _wait(self, op: int, timeout: float, what: str) -> None:
        """Until every peer has posted ``op``; a :class:`TimeoutError` at the deadline or when a peer is gone.

        Before it sleeps, a rank writes the op it sleeps on into its own file (:data:`_ASLEEP`) and
        looks at the peers' numbers once more; a poster that then sees every other rank's number wakes
        it with a byte on its FIFO. So a rank is woken once per op it sleeps on, by the last poster,
        and no byte is written to a rank that is not asleep. Should both sides' stores sit unseen at
        once, the sleep ends at a time-out (first 20 ms, then twice as long each time, at most
        :data:`_NAP_CAP`)."""
        deadline = time.monotonic() + timeout
        pending = [p for p in range(self.world) if p != self.rank]
        mine, nap = self._maps[self.rank], 0.02
        while True:
            pending = [p for p in pending if struct.unpack_from("q", self._maps[p], self._region(op))[0] != op]
            if not pending:
                return
            gone = self._gone.intersection(pending)
            if gone:
                raise TimeoutError(f"rank {min(gone)} of the group is gone (its connection closed) during {what}")
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError(f"{what} did not finish within {timeout}s: ranks {pending} had not sent theirs")
            if struct.unpack_from("q", mine, _ASLEEP)[0] != op:  # first sleep on this op: say so, look again
                struct.pack_into("q", mine, _ASLEEP, op)
                continue
            for fd, _ in self._poller.poll(max(1, int(min(left, nap) * 1000) + 1)):
                try:
                    if not os.read(fd, 4096):
                        self._gone.add(self._peer_of_fd[fd])
                        self._poller.unregister(fd)
                except BlockingIOError:
                    pass
            nap = min(2 * nap, _NAP_CAP)

    def all_gather(self, payload: torch.Tensor, timeout: float, what: str) -> list[torch.Tensor]:
        """Every rank's ``payload`` (the same shape and dtype on every rank), in rank order."""
        flat = payload.contiguous().view(torch.uint8).reshape(-1)
        n = flat.numel()
        self.ops += 1
        op = self.ops
        self._post([], flat, op)
        self._wait(op, timeout, what)
        out = []
        for r in range(self.world):
            if r == self.rank:
                got = flat.clone()
            else:
                base = self._region(op) + HEADER
                got = self._buffers[r][base : base + n].clone()
            out.append(got.view(payload.dtype).reshape(payload.shape))
        return out

    def all_gather_rows(self, payload: torch.Tensor, rows: list[int], timeout: float, what: str) -> torch.Tensor:
        """The first ``rows[r]`` rows of rank ``r``'s ``payload [n, W]`` (bytes, ``n >= rows[rank]``), of
        every rank in rank order, in one tensor ``[sum(rows), W]``: an all_gather of payloads padded to
        the largest row count, then the real rows cut out and joined, but only the real rows are
        copied (once in, once out)."""
        width = payload.shape[1]
        flat = payload.contiguous().reshape(-1)
        self.ops += 1
        op = self.ops
        self._post([], flat[: rows[self.rank] * width], op)
        self._wait(op, timeout, what)
        out = torch.empty(sum(rows), width, dtype=torch.uint8)
        into, at = out.view(-1), 0
        base = self._region(op) + HEADER
        for r, m in enumerate(rows):
            if m:
                n = m * width
                into[at : at + n].copy_(flat[:n] if r == self.rank else self._buffers[r][base : base + n])
                at += n
        return out

    def all_reduce_max(self, tensor: torch.Tensor, timeout: float, what: str) -> torch.Tensor:
        """The elementwise maximum of every rank's ``tensor`` (an all_gather, then the max here)."""
        return torch.stack(self.all_gather(tensor, timeout, what)).amax(dim=0)

    def all_to_all(self, payload: torch.Tensor, send: list[int], receive: list[int], timeout: float,
                   what: str) -> torch.Tensor:
        """``payload [n, W]`` bytes: rows ``send[r]`` to rank ``r`` (in rank order); returns the rows
        received, ``receive[r]`` from rank ``r``, in rank order (``all_to_all_single``'s contract)."""
        width = payload.shape[1]
        chunks, offset = [], 0
        for rows in send:
            chunks.append((offset, rows * width))
            offset += rows * width
        flat = payload.contiguous().reshape(-1)
        self.ops += 1
        op = self.ops
        self._post(chunks, flat, op)
        self._wait(op, timeout, what)
        out = torch.empty(sum(receive), width, dtype=torch.uint8)
        at = 0
        for r in range(self.world):
            nbytes = receive[r] * width
            if r == self.rank:
                start, length = chunks[r]
                part = flat[start : start + length]
            else:
                base = self._region(op)
                start, length = struct.unpack_from("2q", self._maps[r], base + 8 + 16 * self.rank)
                part = self._buffers[r][base + HEADER + start : base + HEADER + start + length]
            if length != nbytes:
                raise RuntimeError(f"{what}: rank {r} sent {length} bytes here, {nbytes} were expected")
            if nbytes:
                out.view(-1)[at : at + nbytes].copy_(part)
            at += nbytes
        return out
