"""Workers as Ray actors: Ray places them, the coordinator scales and retires them.

Each worker is one actor (``num_cpus_per_worker`` CPUs, ``num_gpus_per_worker`` GPUs) whose
``run`` method runs :func:`elastic.launch.remote_worker.serve`, i.e. the unchanged
:func:`elastic.worker.process.worker_main` on queues carried by the coordinator's ``TCPStore``. The
workers of a generation still form their group through that store (``torch.distributed``),
so Ray only starts, places and stops processes; it carries no EP traffic.

Liveness: the ``run`` call's object ref becomes ready when the worker leaves (a ``Shutdown``,
a retirement, an exception, or the actor's death: a killed process, a lost node). ``is_alive``
asks ``ray.wait(ref, timeout=0)``, which costs no round trip to the actor, so the coordinator's
watchdog sees a dead actor as a worker that "exited unexpectedly", i.e. a worker loss. A worker
that left has its actor killed at once, so its CPUs go back to Ray.

Actors are named ``ep-<launcher>-w<id>`` in ``namespace``; :meth:`RayLauncher.actor_names`
lists the live ones (``ray.util.list_named_actors``, which needs no dashboard).
"""

from __future__ import annotations

import logging
import os
import uuid
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import ray

from elastic.core.mapping import RankMapping
from elastic.core.worker_spec import WorkerSpec
from elastic.launch.launchers import StoreChannelLauncher, plan_resize

if TYPE_CHECKING:
    from elastic.deployment import LauncherConfig

log = logging.getLogger("elastic.launch.ray")


# Ray's stub types ray.remote(**options) with task options only (no max_concurrency, an actor option),
# so mypy rejects the call and keeps seeing the undecorated class (hence the ignore on .options below).
@ray.remote(max_concurrency=2, max_restarts=0)  # type: ignore[call-overload]
class WorkerActor:
    """One EP worker. ``run`` blocks for the worker's life; ``node`` answers meanwhile."""

    def node(self) -> tuple[str, int]:
        return ray.util.get_node_ip_address(), os.getpid()

    def run(self, store_host: str, store_port: int, worker_id: int) -> int:
        from elastic.launch.remote_worker import serve

        # the group counts hosts by this name (elastic.worker.groups.host_identity)
        os.environ.setdefault("ELASTIC_EP_HOST", ray.util.get_node_ip_address())
        return serve(store_host, store_port, worker_id)


@dataclass
class RayWorker:
    rank: int
    inbox: Any
    worker_id: int
    name: str
    actor: Any
    run_ref: Any
    node_ref: Any
    launcher: RayLauncher
    _host: str | None = None
    _gone: bool = False
    exit_reason: str | None = field(default=None)

    @property
    def pid(self) -> int:
        return self.worker_id  # reports carry it (elastic.launch.channel.TaggedOutbox)

    @property
    def host(self) -> str | None:
        """The node's IP address, once the actor runs (None until then, or when it died first)."""
        if self._host is None:
            try:
                self._host = ray.get(self.node_ref, timeout=30)[0]
            except Exception:  # noqa: BLE001 - not placed yet, or dead
                return None
        return self._host

    def _left(self) -> None:
        if self._gone:
            return
        self._gone = True
        try:
            code = ray.get(self.run_ref, timeout=0)
            self.exit_reason = f"exit code {code}"
        except Exception as exc:  # noqa: BLE001 - the actor died
            self.exit_reason = f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"
        log.info("worker %d (%s) left: %s", self.worker_id, self.name, self.exit_reason)
        try:
            ray.kill(self.actor, no_restart=True)  # release its resources
        except Exception:  # noqa: BLE001
            pass

    def is_alive(self) -> bool:
        if self._gone:
            return False
        ready, _ = ray.wait([self.run_ref], timeout=0)
        if ready:
            self._left()
            return False
        return True

    def join(self, timeout: float) -> bool:
        if self._gone:
            return True
        ready, _ = ray.wait([self.run_ref], timeout=max(0.0, timeout))
        if ready:
            self._left()
        return bool(ready)

    def kill(self) -> None:
        if self._gone:
            return
        self.launcher._retire(self.worker_id)
        self._gone = True
        self.exit_reason = "killed by the launcher"
        try:
            ray.kill(self.actor, no_restart=True)
        except Exception:  # noqa: BLE001 - already dead
            pass


class RayLauncher(StoreChannelLauncher):
    """Workers as Ray actors on the cluster at ``options.address`` (or the one this process joined)."""

    def __init__(self, options: LauncherConfig, capacity: int):
        super().__init__(options, capacity)
        self._owns_ray = False
        if not ray.is_initialized():
            # no address: a new local instance ("local"), never a cluster that happens to run on this host
            ray.init(address=options.address or "local", log_to_driver=True)
            self._owns_ray = True
        self.tag = uuid.uuid4().hex[:8]

    def plan_resize(self, hosts: Sequence[str], new_size: int) -> RankMapping:
        return plan_resize(hosts, new_size, None)[0]  # Ray places new actors: no layout to follow

    def launch(self, spec: WorkerSpec) -> RayWorker:
        worker_id, inbox = self._prepare(spec, None, dict(self.options.env))
        name = f"ep-{self.tag}-w{worker_id}"
        actor = WorkerActor.options(  # type: ignore[attr-defined]  # Ray's stub: see WorkerActor
            name=name, namespace=self.options.namespace, num_cpus=self.options.num_cpus_per_worker,
            num_gpus=self.options.num_gpus_per_worker).remote()
        run_ref = actor.run.remote(spec.store_host, spec.store_port, worker_id)
        worker = RayWorker(spec.rank, inbox, worker_id, name, actor, run_ref, actor.node.remote(), self)
        log.info("started actor %s for rank %d of generation %d", name, spec.rank, spec.generation)
        self._workers.append(worker)
        return worker

    def actor_names(self) -> list[str]:
        """Names of this launcher's live worker actors, from Ray's own registry."""
        return sorted(a["name"] for a in ray.util.list_named_actors(all_namespaces=True)
                      if a["namespace"] == self.options.namespace and a["name"].startswith(f"ep-{self.tag}-"))

    def shutdown(self) -> None:
        super().shutdown()
        if self._owns_ray:
            ray.shutdown()
