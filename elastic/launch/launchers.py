"""Launchers start and retire worker processes; the coordinator only sees this interface.

:class:`LocalLauncher` runs workers as local processes from a ``forkserver`` that has loaded
torch, the worker module and the placement kernels once (and transformers, for a Hugging Face
model: :mod:`elastic.worker.preload`), so a new worker starts in well under a second instead of
paying those imports each time.

:class:`CommandLauncher` starts each worker as a process from a command template (``ssh {host}
python -m elastic.launch.remote_worker ...``, ``ip netns exec {host} ...``) on a list of hosts, and
:class:`elastic.launch.ray.RayLauncher` as a Ray actor. Their workers share no pipe with the
coordinator: commands and reports travel through the coordinator's ``TCPStore``
(:mod:`elastic.launch.channel`), and a worker's ``pid`` in its reports is the launcher's worker id.

Hosts and ranks: a handle knows its ``host``. Before a scale, :func:`plan_mapping` asks the
launcher for the rank mapping: a launcher that chooses hosts (``command``) lays the new group
out evenly over its hosts with the ranks of a host contiguous, keeps every surviving worker on
its host (renumbering it if needed) and starts fresh workers where the layout has a gap; one
that does not choose (Ray places actors) keeps survivors' order on scale-up and, on scale-down,
retires ranks from the most loaded hosts and renumbers the survivors host by host. The group
then counts the nodes itself (:func:`elastic.worker.groups.num_nodes_of`).
"""

from __future__ import annotations

import collections
import itertools
import logging
import multiprocessing as mp
import multiprocessing.connection as mp_connection
import os
import queue
import select
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

from elastic.core.errors import InvalidRankMapping
from elastic.core.mapping import RankMapping
from elastic.core.worker_spec import WorkerSpec
from elastic.worker.process import worker_main

if TYPE_CHECKING:
    from elastic.deployment import LauncherConfig

log = logging.getLogger("elastic.launch.launchers")


class WorkerHandle(Protocol):
    rank: int
    inbox: Any
    host: str | None  # where it runs (None: not known yet)

    @property
    def pid(self) -> int:
        """The id its reports carry: the coordinator keys its workers by it."""
        ...

    def is_alive(self) -> bool: ...

    def join(self, timeout: float) -> bool: ...

    def kill(self) -> None: ...


class Launcher(Protocol):
    """What the coordinator needs from a way of running workers."""

    capacity: int  # most workers it can run at once

    def reports(self) -> Any:
        """The queue every worker's reports arrive on."""

    def launch(self, spec: WorkerSpec) -> WorkerHandle: ...

    def shutdown(self) -> None: ...

    # optional: ``plan_resize(hosts, new_size) -> RankMapping`` (see plan_mapping)


@dataclass
class LocalWorker:
    """A worker process forked by the forkserver.

    Its liveness is read from a pidfd of the worker itself, not from the forkserver's status
    pipe: if the forkserver dies (a launch that failed half-way for lack of descriptors made it
    exit), ``multiprocessing`` reports every one of its children dead with exit code 255,
    although the workers (which no longer die with it) go on serving.
    """

    rank: int
    inbox: Any
    process: mp.process.BaseProcess
    host: str = "localhost"
    outbox: Any = None  # its reports' queue (read through WorkerReports)
    pidfd: int | None = None  # readable once the worker has exited (None: no pidfd here)

    @property
    def pid(self) -> int:
        pid = self.process.pid
        assert pid is not None  # LocalLauncher.launch starts the process before it makes its LocalWorker
        return pid

    def _exited(self, timeout: float) -> bool:
        if self.pidfd is None:
            self.process.join(timeout)
            return not self.process.is_alive()
        ready, _, _ = select.select([self.pidfd], [], [], max(0.0, timeout))
        return bool(ready)

    def is_alive(self) -> bool:
        return not self._exited(0.0)

    def join(self, timeout: float) -> bool:
        return self._exited(timeout)

    def kill(self) -> None:
        if self.is_alive():
            try:
                os.kill(self.pid, signal.SIGKILL)
            except ProcessLookupError:  # it died (and was reaped by the forkserver) since is_alive()
                pass
            self._exited(5)

    def stall(self) -> None:
        """Freeze the process (SIGSTOP): alive but not answering. For fault injection."""
        os.kill(self.pid, signal.SIGSTOP)

    def release(self) -> None:
        """Close what this process holds for the worker (its pidfd)."""
        if self.pidfd is not None:
            os.close(self.pidfd)
            self.pidfd = None


def _pidfd(pid: int) -> int | None:
    """A pidfd of ``pid`` (Linux 5.3+), or None where there is none."""
    try:
        return os.pidfd_open(pid)
    except (AttributeError, OSError):
        return None


class WorkerReports:
    """Every local worker's reports, each on a queue of its own, read as one.

    One queue shared by every worker was a trap: ``multiprocessing.Queue`` writers share a lock
    across processes, taken by each writer's feeder thread around every write. A worker killed
    (SIGKILL, a fault's ``os._exit``) while its feeder held that lock never released it, and
    every other worker's reports stopped for good: the coordinator declared all of them lost
    together with the dead one (the "living workers: none" refusals of the fault tests, about
    one full suite run in two). With a queue per worker, a dying worker can only break its own.
    """

    def __init__(self) -> None:
        self._queues: list[Any] = []
        self._closing: list[Any] = []  # removed; closed by the reading thread, never under its wait
        self._ready: collections.deque[Any] = collections.deque()
        self._lock = threading.Lock()

    def add(self, q: Any) -> None:
        with self._lock:
            self._queues.append(q)

    def remove(self, q: Any) -> None:
        with self._lock:
            if q in self._queues:
                self._queues.remove(q)
                self._closing.append(q)

    def get(self, timeout: float) -> Any:
        """The next report of any worker (``queue.Empty`` after ``timeout``). A queue whose
        worker died mid-write (a torn message) is dropped: its worker is lost anyway. Only one
        thread reads (the coordinator's reader)."""
        if self._ready:
            return self._ready.popleft()
        with self._lock:
            queues, closing, self._closing = list(self._queues), self._closing, []
        for q in closing:  # not in the wait below: closing a pipe under a wait on it is undefined
            q._reader.close()
        if not queues:
            time.sleep(timeout)
            raise queue.Empty
        for reader in mp_connection.wait([q._reader for q in queues], timeout):
            q = next(q for q in queues if q._reader is reader)
            try:
                self._ready.append(q.get_nowait())
            except queue.Empty:
                continue
            except Exception:  # noqa: BLE001 - EOF or a torn message from a dead worker
                self.remove(q)
        if self._ready:
            return self._ready.popleft()
        raise queue.Empty

    def close(self) -> None:
        with self._lock:
            queues, self._queues, self._closing = self._queues + self._closing, [], []
        for q in queues:
            q._reader.close()


# what building a Hugging Face model imports the first time (python -X importtime: in a fresh process
# with torch loaded, the first tiny deepseek_v3 took 2.8 s to build, the next architecture 0.02 s)
HF_MODULES = ("transformers", "transformers.modeling_utils", "transformers.masking_utils", "transformers.activations")


def forkserver_preload(model_kind: str) -> list[str]:
    """What the forkserver loads before its first fork, for a deployment whose model is ``model_kind``."""
    return ["elastic.worker.preload", *(HF_MODULES if model_kind == "hf" else ())]


#: every module any launcher of this process asked its forkserver to preload, in order
_PRELOADED: dict[str, None] = {}


def preload_in_forkserver(modules: list[str]) -> list[str]:
    """Add ``modules`` to what this process's forkserver preloads when it (re)starts; the list
    only grows. A process has one forkserver, read at its start: a deployment of a reference model
    set up after a Hugging Face one must not narrow the list, or a forkserver restarted later (the
    next launch restarts one that died) would fork Hugging Face workers without transformers."""
    _PRELOADED.update(dict.fromkeys(modules))
    mp.get_context("forkserver").set_forkserver_preload(list(_PRELOADED))
    return list(_PRELOADED)


class LocalLauncher:
    """Workers as processes on this machine."""

    def __init__(self, capacity: int | None = None, preload: list[str] | None = None):
        self.capacity = capacity if capacity is not None else max(8, os.cpu_count() or 1)
        self._ctx = mp.get_context("forkserver")
        # read once, when this process's forkserver starts (at the first launch); a forkserver
        # already running keeps what it loaded
        self.preload = preload if preload is not None else forkserver_preload("reference")  # what this deployment needs
        preload_in_forkserver(self.preload)
        self._reports = WorkerReports()
        self._workers: list[LocalWorker] = []

    def reports(self) -> Any:
        return self._reports

    def launch(self, spec: WorkerSpec) -> LocalWorker:
        """Start a worker. A launch that fails (``EMFILE``, ``ENOMEM``) raises and leaves nothing
        behind: its queues are closed, the running workers are untouched (they do not depend on the
        forkserver), and a forkserver that died of it is started again by the next launch."""
        inbox, outbox = self._ctx.Queue(), self._ctx.Queue()
        process = self._ctx.Process(target=worker_main, args=(spec, inbox, outbox),
                                    name=f"ep-worker-g{spec.generation}-r{spec.rank}", daemon=True)
        try:
            process.start()
        except BaseException:
            for q in (inbox, outbox):
                q.cancel_join_thread()
                q.close()
            raise
        # the worker holds the write end now: without this process's copy, a worker that dies
        # mid-write gives its reader EOF instead of a read that waits for the rest forever
        outbox._writer.close()  # type: ignore[attr-defined]  # multiprocessing.Queue keeps its ends private
        self._reports.add(outbox)
        worker = LocalWorker(spec.rank, inbox, process, outbox=outbox, pidfd=_pidfd(process.pid or 0))
        self._workers.append(worker)
        return worker

    def forget(self, handle: LocalWorker) -> None:
        """The worker has exited and the coordinator is done with it: release its queues (each a
        feeder thread and a pipe) and its handle."""
        if handle in self._workers:
            self._workers.remove(handle)
        handle.inbox.cancel_join_thread()  # nobody reads it any more: never block on its buffer
        handle.inbox.close()
        if handle.outbox is not None:
            self._reports.remove(handle.outbox)
        handle.release()
        try:
            handle.process.close()
        except ValueError:  # the forkserver has not passed its exit status on yet: the GC closes it
            pass

    def shutdown(self) -> None:
        """Kill the workers still running and release what this process holds for every one (its
        queues' pipes and feeder threads, its pidfd): a process that runs one deployment after
        another keeps no descriptor or thread of the last one."""
        for worker in list(self._workers):
            worker.kill()
            self.forget(worker)
        self._reports.close()


# -- hosts and rank mappings ---------------------------------------------------------------------

def balanced_layout(hosts: Sequence[tuple[str, int | None]], size: int) -> list[str]:
    """The host of each rank of a group of ``size``: hosts filled evenly (within their slots),
    in host order, the ranks of a host contiguous. ``hosts`` are ``(name, slots or None)``."""
    counts = [0] * len(hosts)
    for _ in range(size):
        free = [i for i, (_, slots) in enumerate(hosts) if slots is None or counts[i] < slots]
        if not free:
            raise ValueError(f"{size} workers do not fit the hosts' slots {[s for _, s in hosts]}")
        counts[min(free, key=lambda i: (counts[i], i))] += 1
    return [name for (name, _), count in zip(hosts, counts) for _ in range(count)]


def plan_resize(hosts: Sequence[str], new_size: int, layout: Sequence[str] | None = None
                ) -> tuple[RankMapping, dict[int, str]]:
    """The rank mapping from a group whose rank ``r`` runs on ``hosts[r]`` to one of ``new_size``.

    With ``layout`` (the host of each new rank), every host keeps its surviving workers in rank
    order, the rest of that host's new ranks are fresh workers there, and workers beyond a host's
    share retire (highest first). Without it, scale-up adds fresh ranks on top and scale-down
    retires the highest ranks of the most loaded hosts; survivors are renumbered host by host.
    Returns the mapping and the host of every joining new rank (where ``layout`` says).
    """
    old_size = len(hosts)
    if layout is not None:
        by_host: dict[str, list[int]] = {}
        for old, host in enumerate(hosts):
            by_host.setdefault(host, []).append(old)
        old_to_new, joining = [-1] * old_size, {}
        taken: dict[str, int] = {}
        for new, host in enumerate(layout):
            olds = by_host.get(host, [])
            k = taken.get(host, 0)
            taken[host] = k + 1
            if k < len(olds):
                old_to_new[olds[k]] = new
            else:
                joining[new] = host
        try:
            return RankMapping(tuple(old_to_new), new_size), joining
        except InvalidRankMapping:  # no worker survives on the layout's hosts: keep the ones we have
            pass
    if new_size >= old_size:
        return RankMapping.for_resize(old_size, new_size), {}
    order = list(dict.fromkeys(hosts))
    ranks = {host: [r for r in range(old_size) if hosts[r] == host] for host in order}
    for _ in range(old_size - new_size):
        host = max(reversed(order), key=lambda h: len(ranks[h]))  # ties: the later host gives up a rank
        ranks[host].pop()
    survivors = [r for host in order for r in ranks[host]]
    old_to_new = [-1] * old_size
    for new, old in enumerate(survivors):
        old_to_new[old] = new
    return RankMapping(tuple(old_to_new), new_size), {}


def plan_mapping(launcher: Any, handles: Sequence[Any], old_size: int, new_size: int) -> RankMapping:
    """The mapping for a scale ``old_size -> new_size``; ``handles`` are the live workers by rank.

    Launchers without ``plan_resize`` (and groups whose hosts are not all known) get
    :meth:`RankMapping.for_resize`.
    """
    plan = getattr(launcher, "plan_resize", None)
    hosts = [getattr(h, "host", None) for h in handles]
    if plan is None or len(hosts) != old_size or any(h is None for h in hosts):
        return RankMapping.for_resize(old_size, new_size)
    return plan(hosts, new_size)


# -- launchers whose workers talk through the store ---------------------------------------------

class _LazyReports:
    """The reports queue of a store-channel launcher; empty until the first worker was launched."""

    def __init__(self) -> None:
        self.queue: Any = None
        self.ready = threading.Event()

    def get(self, block: bool = True, timeout: float | None = None) -> Any:
        if self.queue is None:
            if not block or not self.ready.wait(timeout):
                raise queue.Empty
        try:
            return self.queue.get(block=block, timeout=timeout)
        except queue.Empty:
            raise
        except RuntimeError as exc:  # the store connection failed: the watchdog sees the silence
            log.warning("reading reports from the store failed: %s", exc)
            time.sleep(timeout or 0.1)
            raise queue.Empty from exc


class StoreChannelLauncher:
    """Shared by the command and Ray launchers: launch records, inboxes and reports in the store."""

    def __init__(self, options: LauncherConfig, capacity: int):
        self.options = options
        self.capacity = capacity
        self._ids = itertools.count(1)
        self._store: Any = None
        self._address: tuple[str, int] | None = None
        self._reports = _LazyReports()
        self._lock = threading.Lock()
        self._workers: list[Any] = []

    def reports(self) -> Any:
        return self._reports

    def _attach(self, host: str, port: int) -> None:
        from elastic.launch.channel import StoreQueue, connect
        from elastic.launch.remote_worker import REPORTS_PREFIX

        with self._lock:
            if self._store is not None:
                if self._address != (host, port):
                    raise RuntimeError(f"this launcher serves the store at {self._address}, not {(host, port)}")
                return
            self._store = connect(host, port)
            self._address = (host, port)
            self._reports.queue = StoreQueue(connect(host, port), REPORTS_PREFIX)
            self._reports.ready.set()

    def _prepare(self, spec: WorkerSpec, host: str | None, env: dict[str, str]) -> tuple[int, Any]:
        """Write the launch record of a new worker; returns its id and its inbox."""
        from elastic.launch.channel import StoreQueue
        from elastic.launch.remote_worker import inbox_prefix, launch_key, launch_record

        self._attach(spec.store_host, spec.store_port)
        worker_id = next(self._ids)
        self._store.set(launch_key(worker_id), launch_record(spec, env, host))
        return worker_id, StoreQueue(self._store, inbox_prefix(worker_id))

    def _retire(self, worker_id: int) -> None:
        """Ask a remote worker to exit (its watcher polls this key)."""
        from elastic.launch.remote_worker import kill_key

        try:
            if self._store is not None:
                self._store.set(kill_key(worker_id), "1")
        except Exception:  # noqa: BLE001 - the store is gone: so is the worker's reason to live
            pass

    def forget(self, handle: Any) -> None:
        """The coordinator is done with the worker: drop its handle and its keys in the store
        (launch record, inbox), all but its kill key, which is set and stays.

        "Done" means its handle ended, not that the process did: a worker cut off by a network
        partition is still running on its host, and once the partition heals it reads the store
        again. Its kill key is the only thing that tells it to leave then; deleting it with the
        record stranded such workers for good. A kill key is a few bytes per retired worker.
        """
        from elastic.launch.remote_worker import kill_key, worker_prefix

        if handle in self._workers:
            self._workers.remove(handle)
        store = self._store
        if store is None:
            return
        prefix, kill = worker_prefix(handle.worker_id), kill_key(handle.worker_id)
        try:
            store.set(kill, "1")
            for key in store.list_keys():
                if key.startswith(prefix) and key != kill:
                    store.delete_key(key)
        except Exception:  # noqa: BLE001 - the store is going away: nothing left to clean
            pass

    def shutdown(self) -> None:
        for worker in self._workers:
            worker.kill()
        self._workers.clear()


def _store_address(host: str, port: int) -> str:
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


@dataclass
class CommandWorker:
    rank: int
    inbox: Any
    host: str
    worker_id: int
    process: subprocess.Popen
    launcher: CommandLauncher

    @property
    def pid(self) -> int:
        return self.worker_id  # reports carry it (elastic.launch.channel.TaggedOutbox)

    def is_alive(self) -> bool:
        return self.process.poll() is None

    def join(self, timeout: float) -> bool:
        try:
            self.process.wait(timeout)
        except subprocess.TimeoutExpired:
            return False
        return True

    def kill(self) -> None:
        if self.process.poll() is None:
            self.launcher._retire(self.worker_id)
            self.process.kill()
            try:
                self.process.wait(5)
            except subprocess.TimeoutExpired:
                pass


def live_hosts(hosts: Sequence[tuple[str, int | None]], lost: set[str] | frozenset[str]) -> list[tuple[str, int | None]]:
    """The hosts a layout may use: every one not lost. Refuses (``ValueError``) when none is left."""
    live = [h for h in hosts if h[0] not in lost]
    if not live:
        raise ValueError(f"every host is lost ({', '.join(sorted(lost))}): no host to place a worker on until "
                         "one is reachable again")
    return live


def note_lost_worker(launcher: Any, handle: Any) -> None:
    """Tell a launcher that chooses hosts that ``handle``'s worker was lost (its host may be gone)."""
    mark = getattr(launcher, "host_lost", None)
    host = getattr(handle, "host", None)
    if mark is not None and host is not None:
        mark(host)


class CommandLauncher(StoreChannelLauncher):
    """Each worker a process from ``options.template``, on ``options.hosts`` (filled evenly).

    A host whose worker was lost is *lost* (:meth:`host_lost`): layouts leave it out, so a
    recovery's fresh ranks go where capacity is alive, until the host is seen again. It is seen
    again when a probe succeeds: before a layout, every lost host not probed in the last
    ``PROBE_EVERY_S`` is probed by running the command template with ``--probe`` appended (the
    worker's command line then only connects to the coordinator's store and exits 0); a host that
    answers is back at once."""

    PROBE_EVERY_S = 5.0
    PROBE_TIMEOUT_S = 5.0

    def __init__(self, options: LauncherConfig, capacity: int):
        super().__init__(options, capacity)
        self._planned: dict[int, str] = {}
        self.lost: set[str] = set()
        self._probed: dict[str, float] = {}  # host -> when it was last probed (monotonic)

    def host_lost(self, host: str) -> None:
        if host not in self.lost and any(h.name == host for h in self.options.hosts):
            log.warning("host %s lost a worker: no new worker goes there until a probe reaches it", host)
            self.lost.add(host)
            self._probed.pop(host, None)

    def _probe(self, host: Any) -> bool:
        if self._address is None:
            return True  # nothing launched yet, so nothing was lost through this store
        store_host, store_port = self._address
        fields = dict(host=host.name, store=_store_address(store_host, store_port), store_host=store_host,
                      store_port=store_port, worker_id=0, python=sys.executable)
        argv = [arg.format(**fields) for arg in self.options.template] + ["--probe"]
        try:
            done = subprocess.run(argv, stdin=subprocess.DEVNULL, capture_output=True, timeout=self.PROBE_TIMEOUT_S)
        except (OSError, subprocess.TimeoutExpired) as exc:
            log.info("probe of host %s: %s", host.name, exc)
            return False
        if done.returncode != 0:
            log.info("probe of host %s exited %d: %s", host.name, done.returncode,
                     done.stderr.decode(errors="replace").strip()[-300:])
        return done.returncode == 0

    def _seen_again(self) -> None:
        now = time.monotonic()
        for host in self.options.hosts:
            if host.name in self.lost and now - self._probed.get(host.name, -1e9) >= self.PROBE_EVERY_S:
                self._probed[host.name] = now
                if self._probe(host):
                    log.info("host %s answered its probe: it takes workers again", host.name)
                    self.lost.discard(host.name)

    def layout(self, size: int) -> list[str]:
        if self.lost:
            self._seen_again()
        return balanced_layout(live_hosts([(h.name, h.slots) for h in self.options.hosts], self.lost), size)

    def plan_resize(self, hosts: Sequence[str], new_size: int) -> RankMapping:
        mapping, joining = plan_resize(hosts, new_size, self.layout(new_size))
        self._planned = dict(joining)
        return mapping

    def launch(self, spec: WorkerSpec) -> CommandWorker:
        host_name = self._planned.pop(spec.rank, None) if spec.joining else None
        if host_name is None:
            host_name = self.layout(spec.size)[spec.rank]
        host = next(h for h in self.options.hosts if h.name == host_name)
        env = {**self.options.env, **host.env}
        worker_id, inbox = self._prepare(spec, host.name, env)
        fields = dict(host=host.name, store=_store_address(spec.store_host, spec.store_port),
                      store_host=spec.store_host, store_port=spec.store_port, worker_id=worker_id,
                      python=sys.executable)
        argv = [arg.format(**fields) for arg in self.options.template]
        log.info("starting worker %d (rank %d, generation %d) on %s: %s", worker_id, spec.rank, spec.generation,
                 host.name, " ".join(argv))
        process = subprocess.Popen(argv, stdin=subprocess.DEVNULL, start_new_session=True)
        worker = CommandWorker(spec.rank, inbox, host.name, worker_id, process, self)
        self._workers.append(worker)
        return worker
