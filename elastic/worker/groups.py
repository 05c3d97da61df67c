"""Process-group generations on ``torch.distributed``.

Every generation of the EP group has its own key prefix in the shared ``TCPStore``
(``elastic/gen{k}/``), so a group being formed never sees an earlier generation's keys. The
default (decode) group of a generation carries the step's collectives; the EPLB group, made
with ``new_group`` over the same ranks, carries the async worker's point-to-point traffic so
it never interleaves with the decode loop's collectives.

Every rank also publishes its host (:func:`host_identity`) under the generation's prefix, so
every rank knows the host of every rank of the generation. :func:`num_nodes_of` derives the node
count the hierarchical EPLB policy is given: the distinct hosts, when every host's ranks are a
contiguous block of equal size (the policy's node ``n`` is ranks ``[n*G/N, (n+1)*G/N)``);
otherwise 1 (flat balancing), since a node count that does not match the rank layout would
place "node-local" replicas on other hosts.
"""

from __future__ import annotations

import logging
import os
import socket
import time
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any

import torch.distributed as dist
from torch.distributed import distributed_c10d

log = logging.getLogger("elastic.worker.groups")


def host_identity() -> str:
    """The name of the host this process runs on: ``ELASTIC_EP_HOST`` (launchers set it), else the hostname."""
    return os.environ.get("ELASTIC_EP_HOST") or socket.gethostname()


def num_nodes_of(hosts: list[str] | tuple[str, ...]) -> int:
    """Node count for the hierarchical policy from the host of each rank (1 if the layout does not fit)."""
    if not hosts:
        return 1
    blocks: list[tuple[str, int]] = []
    for host in hosts:
        if blocks and blocks[-1][0] == host:
            blocks[-1] = (host, blocks[-1][1] + 1)
        else:
            blocks.append((host, 1))
    names = [name for name, _ in blocks]
    if len(set(names)) != len(names) or len({count for _, count in blocks}) != 1:
        return 1  # a host's ranks are not contiguous, or hosts hold different numbers of ranks
    return len(blocks)


def open_store(bind_host: str, port: int) -> dist.TCPStore:
    """Host the coordinator's ``TCPStore`` on ``bind_host:port`` (port 0: any free port).

    ``0.0.0.0`` or ``::`` listen on every address (the store's own default); any other address
    is bound first and the listening socket handed to the store, so the store is reachable on
    that address only.
    """
    if bind_host in ("", "0.0.0.0", "::", "*"):
        return dist.TCPStore(bind_host or "0.0.0.0", port, is_master=True, wait_for_workers=False, use_libuv=True)
    family, kind, proto, _, address = socket.getaddrinfo(bind_host, port, type=socket.SOCK_STREAM)[0]
    sock = socket.socket(family, kind, proto)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(address)
        sock.listen(1024)
        bound_port = sock.getsockname()[1]
    except OSError as exc:
        sock.close()
        raise OSError(f"cannot listen on {bind_host}:{port} for the TCPStore: {exc}") from exc
    fd = sock.detach()  # the store owns the socket from here on
    return dist.TCPStore(bind_host, bound_port, is_master=True, wait_for_workers=False, use_libuv=True,
                         master_listen_fd=fd)


def connect_store(host: str, port: int, timeout_s: float) -> dist.TCPStore:
    return dist.TCPStore(host, port, is_master=False, timeout=timedelta(seconds=timeout_s), use_libuv=True)


ABORT_KEY = "elastic-abort"


class RendezvousAborted(RuntimeError):
    """The coordinator abandoned the generation this rank was joining."""


def raise_if_aborted(prefix: dist.Store, generation: int) -> None:
    """Raise :class:`RendezvousAborted` if the coordinator gave generation ``generation`` up
    (``prefix``: that generation's store prefix)."""
    if prefix.check([ABORT_KEY]):
        raise RendezvousAborted(f"generation {generation}: {prefix.get(ABORT_KEY).decode()}")


def abort_generation(store: dist.Store, generation: int, reason: str) -> None:
    """Tell every rank still waiting to join ``generation`` to give up (the attempt failed)."""
    dist.PrefixStore(f"elastic/gen{generation}/", store).set(ABORT_KEY, reason)


@dataclass
class GroupGeneration:
    """The process groups of one generation, as seen by one rank."""

    generation: int
    rank: int
    size: int
    backend: str
    timeout_s: float
    eplb_group: Any = None
    hosts: tuple[str, ...] = field(default_factory=tuple)  # host of every rank of this generation

    @property
    def num_nodes(self) -> int:
        return num_nodes_of(self.hosts)

    @classmethod
    def join(cls, store: dist.Store, generation: int, rank: int, size: int, *, backend: str = "gloo",
             timeout_s: float = 30.0, rendezvous_timeout_s: float | None = None) -> GroupGeneration:
        """Form this generation's default group (a rendezvous: returns once all ``size`` ranks joined).

        The rendezvous has its own deadline (``rendezvous_timeout_s``, default ``timeout_s``),
        separate from the collective timeout: a peer may still be breaking out of a collective
        of the previous generation (up to one collective timeout) before it arrives.
        """
        if dist.is_initialized():
            raise RuntimeError("a process group is still alive: destroy the old generation first")
        prefix = _arrive(store, generation, rank, size,
                         timeout_s if rendezvous_timeout_s is None else rendezvous_timeout_s)
        # torch names groups by a per-process counter, and the name is in every store key of the
        # group's rendezvous. destroy_process_group() resets it, but an init_process_group that failed
        # (a peer died mid-rendezvous) leaves it advanced: this rank would then wait on other keys than
        # a fresh process joining the same generation, and every later attempt would time out. No group
        # is alive here (checked above), so the counter of a consistent process is 0 now.
        distributed_c10d._world.group_count = 0
        dist.init_process_group(backend, store=prefix, rank=rank, world_size=size,
                                timeout=timedelta(seconds=timeout_s))
        # every rank wrote its host before the rendezvous completed: these reads do not wait
        hosts = _hosts(prefix, size)
        log.debug("rank %d joined generation %d of size %d on hosts %s", rank, generation, size, hosts)
        return cls(generation, rank, size, backend, timeout_s, hosts=hosts)

    def abandon(self) -> list[Any]:
        """After a peer failed: take every group of this generation (the default one, the EPLB
        subgroup) out of torch's registry without shutting any down, and return them. A gloo
        group whose peer died can block in its teardown until its failed work times out, holding
        the GIL; the caller keeps the returned groups until the process exits."""
        world = distributed_c10d._world
        groups = list(world.pg_map)
        for pg in reversed(groups):  # subgroups first, the default one last
            _unregister(pg)
        self.eplb_group = None
        return groups

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


def _arrive(store: dist.Store, generation: int, rank: int, size: int, wait_s: float) -> dist.PrefixStore:
    """The generation's rendezvous gate: returns its store once all ``size`` ranks arrived.

    Every rank writes its host, then increments an arrival counter; the last one opens the gate
    and the others poll it (20 ms) until ``wait_s``, giving up at once when the coordinator
    writes the generation's abort key.
    """
    prefix = dist.PrefixStore(f"elastic/gen{generation}/", store)
    prefix.set(f"elastic-host/{rank}", host_identity())
    if prefix.add("elastic-arrived", 1) == size:
        prefix.set("elastic-all-arrived", "1")
    deadline = time.monotonic() + wait_s
    while not prefix.check(["elastic-all-arrived"]):
        raise_if_aborted(prefix, generation)  # the coordinator gave this attempt up
        if time.monotonic() > deadline:
            arrived = prefix.add("elastic-arrived", 0)
            raise TimeoutError(f"generation {generation}: {arrived} of {size} ranks arrived within {wait_s:.0f}s")
        time.sleep(0.02)
    return prefix


def _hosts(prefix: dist.PrefixStore, size: int) -> tuple[str, ...]:
    # every rank wrote its host before the rendezvous completed: these reads do not wait
    return tuple(prefix.get(f"elastic-host/{r}").decode() for r in range(size))


def _unregister(pg: Any) -> None:
    """Take one process group out of torch's registry without shutting it down."""
    world = distributed_c10d._world
    name = world.pg_names.pop(pg, None)
    for table in (world.pg_map, world.pg_group_ranks, world.pg_backend_config, world.pg_coalesce_state,
                  world.pg_to_tag):
        table.pop(pg, None)
    for groups in world.tags_to_pg.values():
        while pg in groups:
            groups.remove(pg)
    if name is not None:
        distributed_c10d._unregister_process_group(name)
    if world.default_pg is pg:
        distributed_c10d._update_default_pg(None)


@dataclass
class StandbyGroup:
    """The next generation's default group, formed while the current one still decodes.

    A scale's prepare sub-phase (``draining``) forms it on the ranks of the new group, so the
    pause does not pay for the rendezvous and the gloo/NCCL connections. Until the switch it is
    a registered, non-default group: transfers of the pre-transfer name it explicitly, and every
    collective without a group still runs on the serving generation. :meth:`install` swaps it
    in as the default group; :meth:`discard` drops it when the scale fails (the serving group
    is untouched).

    torch keeps one default group per process, and ``destroy_process_group()`` shuts down every
    registered group, the standby one included; so the switch moves the serving generation's
    groups out of torch's registry (``detached``) instead, and they are shut down after the
    pause (:func:`shutdown_detached`). This reaches into ``torch.distributed.distributed_c10d``
    internals (``_new_process_group_helper``, ``_world``), pinned with torch 2.13 and covered by
    ``tests/test_prepare.py``.
    """

    generation: int
    rank: int
    size: int
    backend: str
    timeout_s: float
    pg: Any
    hosts: tuple[str, ...] = ()

    @classmethod
    def form(cls, store: dist.Store, generation: int, rank: int, size: int, *, backend: str = "gloo",
             timeout_s: float = 30.0, rendezvous_timeout_s: float | None = None) -> StandbyGroup:
        """Rendezvous on the generation's prefix and connect the group (returns once all ``size`` ranks joined)."""
        prefix = _arrive(store, generation, rank, size, timeout_s if rendezvous_timeout_s is None else rendezvous_timeout_s)
        # an explicit name (not torch's per-process counter), the same on every rank however many
        # groups each made before: the name is in every store key of the group's own rendezvous
        pg, _ = distributed_c10d._new_process_group_helper(
            size, rank, [], backend, prefix, distributed_c10d.GroupName(f"elastic-gen{generation}"),
            timeout=timedelta(seconds=timeout_s), group_desc=f"standby generation {generation}")
        distributed_c10d._world.pg_group_ranks[pg] = {r: r for r in range(size)}
        log.debug("rank %d formed standby generation %d of size %d", rank, generation, size)
        return cls(generation, rank, size, backend, timeout_s, pg, hosts=_hosts(prefix, size))

    def install(self) -> tuple[GroupGeneration, list[Any]]:
        """Make this the default group. Returns it as a :class:`GroupGeneration` and the serving
        generation's groups, taken out of torch's registry but not shut down (no transfer may
        be in flight on them; shut them down after the pause with :func:`shutdown_detached`)."""
        world = distributed_c10d._world
        detached = [pg for pg in list(world.pg_map) if pg is not self.pg]
        for pg in detached:
            _unregister(pg)
        distributed_c10d._update_default_pg(self.pg)
        world.pg_group_ranks[self.pg] = {r: r for r in range(self.size)}
        # as after init_process_group: the groups made next (the EPLB subgroup) get the same
        # counter-based names on every rank, fresh or not
        world.group_count = 1
        return GroupGeneration(self.generation, self.rank, self.size, self.backend, self.timeout_s,
                               hosts=self.hosts), detached

    def discard(self) -> Any:
        """The scale failed before the switch: unregister the group and return it. The caller keeps
        the reference (a gloo group whose peer died can block in its teardown)."""
        _unregister(self.pg)
        return self.pg


def shutdown_detached(groups: list[Any]) -> None:
    """Shut down groups :meth:`StandbyGroup.install` detached (subgroups first, as torch does)."""
    for pg in reversed(groups):
        try:
            pg.shutdown()
        except Exception as exc:  # noqa: BLE001 - a group of a generation that is gone anyway
            log.debug("shutting down a detached group: %s", exc)
    groups.clear()
