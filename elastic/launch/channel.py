"""A queue carried by the coordinator's ``TCPStore``: commands and reports for workers on other hosts.

A worker started by a command (``ssh host python -m elastic.launch.remote_worker ...``) or as a Ray
actor shares no memory and no pipe with the coordinator, but it reaches the coordinator's
``TCPStore`` anyway (the group rendezvous needs it). :class:`StoreQueue` carries a queue
through that store, with the ``put`` / ``get(block, timeout)`` interface of
``multiprocessing.Queue``, so :func:`elastic.worker.process.worker_main` runs unchanged on either.

Layout under a queue's prefix ``P`` (all keys are plain store keys):

- ``P/tail``: a counter; a producer takes the next number with ``add(P/tail, 1)``;
- ``P/<n>``: the pickled item number ``n`` (1, 2, ...), deleted once read.

Any number of producers, one consumer (it keeps the read position). Taking a number and
writing the item are two store calls, so a producer killed between them leaves a hole; the
consumer skips a hole once later items exist and the hole has stayed empty for
``hole_timeout_s``. Waiting polls ``check`` (tens of microseconds on a LAN) with a short
back-off instead of the store's blocking ``wait``, which cannot be left early without noise.

The store is unauthenticated and items are pickles: like ``torch.distributed`` itself, run it
on a network that only the deployment's machines reach (see the README).
"""

from __future__ import annotations

import dataclasses
import pickle
import queue
import threading
import time
from datetime import timedelta
from typing import Any

import torch.distributed as dist

__all__ = ["StoreQueue", "TaggedOutbox", "connect"]


def connect(host: str, port: int, timeout_s: float = 60.0) -> dist.TCPStore:
    """A client connection to a ``TCPStore`` (one per queue end: a store client serializes its calls)."""
    return dist.TCPStore(host, port, is_master=False, timeout=timedelta(seconds=timeout_s), use_libuv=True)


class StoreQueue:
    """A FIFO queue under ``prefix`` in a ``TCPStore``; ``put`` from anywhere, ``get`` from one reader.

    A producer takes a number (``add`` on the tail) and then writes the item under it. A number
    taken but never written is a *hole*: with ``hole_timeout_s`` set, the reader skips one after
    that long (a queue of many producers, any of which may die between the two calls: the
    reports). With ``None`` it never skips: a slow producer is waited for, and the reader's own
    deadline decides (a queue of one producer that sends commands in order: an inbox).
    """

    def __init__(self, store: dist.Store, prefix: str, *, poll_s: float = 0.02, hole_timeout_s: float | None = 2.0):
        self.store = store
        self.prefix = prefix.rstrip("/")
        self.poll_s = poll_s
        self.hole_timeout_s = hole_timeout_s
        self._head = 0  # the last item read
        self._hole_since: float | None = None
        self._tail_checked = 0.0
        self._lock = threading.Lock()  # one reader at a time (the read position)

    def _key(self, n: int) -> str:
        return f"{self.prefix}/{n}"

    # -- producer ------------------------------------------------------------------------------
    def put(self, item: Any, block: bool = True, timeout: float | None = None) -> None:
        data = pickle.dumps(item, protocol=pickle.HIGHEST_PROTOCOL)
        n = self.store.add(f"{self.prefix}/tail", 1)
        self.store.set(self._key(n), data)  # type: ignore[arg-type]  # torch's stub says str; Store.set takes bytes

    def put_nowait(self, item: Any) -> None:
        self.put(item)

    # -- consumer ------------------------------------------------------------------------------
    def _try_get(self) -> tuple[bool, Any]:
        key = self._key(self._head + 1)
        if self.store.check([key]):
            data = self.store.get(key)
            self.store.delete_key(key)
            self._head += 1
            self._hole_since = None
            return True, pickle.loads(data)
        # a hole: the number was taken but never written (its producer died in between). Looked
        # for at most every 0.2 s, so an idle poll costs one store call
        if self.hole_timeout_s is None:
            return False, None
        now = time.monotonic()
        if now - self._tail_checked < 0.2 and self._hole_since is None:
            return False, None
        self._tail_checked = now
        tail = self.store.add(f"{self.prefix}/tail", 0)
        if tail > self._head + 1:
            if self._hole_since is None:
                self._hole_since = now
            elif now - self._hole_since > self.hole_timeout_s:
                self._head += 1
                self._hole_since = None
                return self._try_get()
        return False, None

    def get(self, block: bool = True, timeout: float | None = None) -> Any:
        """The next item; ``queue.Empty`` when none came within ``timeout`` (or at once without ``block``)."""
        deadline = None if timeout is None else time.monotonic() + timeout
        pause = 0.001
        with self._lock:
            while True:
                found, item = self._try_get()
                if found:
                    return item
                if not block:
                    raise queue.Empty
                now = time.monotonic()
                if deadline is not None and now >= deadline:
                    raise queue.Empty
                sleep = min(pause, self.poll_s) if deadline is None else min(pause, self.poll_s, deadline - now)
                time.sleep(max(sleep, 0.0))
                pause *= 2

    def get_nowait(self) -> Any:
        return self.get(block=False)

    def qsize(self) -> int:
        """Items written and not yet read (approximate while producers write)."""
        return max(0, self.store.add(f"{self.prefix}/tail", 0) - self._head)

    def close(self) -> None:
        pass


class TaggedOutbox:
    """Puts reports with ``pid`` replaced by the launcher's worker id.

    The coordinator keys workers by the ``pid`` of their reports; process ids of different hosts
    can collide, so a remote worker reports under the id its launcher gave it.
    """

    def __init__(self, inner: Any, worker_id: int):
        self.inner = inner
        self.worker_id = worker_id

    def put(self, item: Any, block: bool = True, timeout: float | None = None) -> None:
        if dataclasses.is_dataclass(item) and not isinstance(item, type) and hasattr(item, "pid"):
            item = dataclasses.replace(item, pid=self.worker_id)
        self.inner.put(item)
