"""What a worker is launched with: its :class:`WorkerSpec`, from the deployment's config."""

from __future__ import annotations

from typing import Any

from elastic.core.worker_spec import WorkerSpec
from elastic.deployment import DeploymentConfig

__all__ = ["worker_spec"]


def worker_spec(config: DeploymentConfig, rank: int, size: int, generation: int, *, store_port: int,
                joining: bool = False, standby_seq: int = 0, faults: tuple[Any, ...] = (),
                initial_placement: tuple[tuple[int, ...], ...] | None = None) -> WorkerSpec:
    """The spec of rank ``rank`` of a group of ``size`` (generation ``generation``); ``joining``: it
    stands by for a scale-up until its Rescale (``standby_seq`` numbers its "ready" report)."""
    t = config.timeouts
    return WorkerSpec(
        rank=rank, size=size, generation=generation, store_host=config.store_advertise_host, store_port=store_port,
        shape=config.model, eplb=config.eplb, trace=tuple((ph.start_step, ph.trace) for ph in config.trace),
        seed=config.seed, num_physical=config.slots_per_rank * size, backend=config.backend,
        # a peer waits a moment longer than worker_start for a rank that never shows up, so the
        # coordinator names the hung rank (lost at worker_start) before the peer's rendezvous fails
        collective_timeout_s=t.collective, join_timeout_s=t.worker_start + 2.0,
        heartbeat_s=config.heartbeat_s, step_delay_s=config.step_delay_s, joining=joining, standby_seq=standby_seq,
        serving=config.serving,
        # standing by lasts through draining and suppressed (the scale fails past those)
        standby_timeout_s=t.worker_start + t.draining + t.suppressed,
        faults=tuple(faults), initial_placement=initial_placement,
    )
