"""A worker process's first moments: its first group and model, or, for a rank launched ahead
of a scale-up, its weights allocated while it stands by."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

import torch

from elastic.core import protocol as p
from elastic.core.worker_spec import WorkerSpec
from elastic.worker.context import RankContext
from elastic.worker.groups import GroupGeneration
from eplb.algorithm import warm_up
from eplb.models.serving import build_model
from eplb.placement import Placement

__all__ = ["allocate_standby_weights", "initial_placement", "join_first_group", "warm_up_in_background"]


def warm_up_in_background() -> None:
    """Once per process, the placement algorithm's compiled kernels load in a thread, so the
    first rebalance or rescale does not pay for it (every later EPLBState, one per rescale,
    finds them loaded). A starting rank does it after its group is up: loading them (about
    0.5 s of CPU, part of it under the GIL) beside the group's join made a rank of four fresh
    processes on 2 cores miss a 0.5 s rendezvous (2 of 7 runs of the command-launcher start
    test). A worker forked from the preloaded forkserver finds them loaded already."""
    threading.Thread(target=warm_up, name="eplb-warm-up", daemon=True).start()


def initial_placement(spec: WorkerSpec, num_layers: int, num_logical: int) -> Placement:
    """The static placement, or the one the deployment starts from (``eplb.initial_placement``)."""
    if spec.initial_placement is None:
        return Placement.static(num_layers, num_logical, spec.num_physical)
    placement = Placement.from_physical_to_logical(torch.tensor(spec.initial_placement, dtype=torch.int64),
                                                   num_logical)
    if (placement.num_layers, placement.num_physical) != (num_layers, spec.num_physical):
        raise ValueError(f"the initial placement is [{placement.num_layers}, {placement.num_physical}], this rank "
                         f"needs [{num_layers}, {spec.num_physical}]")
    return placement


def join_first_group(ctx: RankContext, start_eplb: Callable[[], None]) -> Placement:
    """Join the first generation, load the model's weights, start the EPLB (``start_eplb``) on
    the group; reports progress meanwhile. Returns the placement it started from."""
    spec = ctx.spec
    with ctx.busy(p.WorkerMode.STARTING):
        ctx.faults.slow_prepare(ctx.set_progress)
        ctx.progress = ("joining the group", 0, 1)
        ctx.group = GroupGeneration.join(ctx.store, ctx.generation, ctx.rank, ctx.size, backend=spec.backend,
                                         timeout_s=spec.collective_timeout_s, rendezvous_timeout_s=spec.join_timeout_s)
        placement = initial_placement(spec, ctx.sizes.num_moe_layers, ctx.sizes.num_logical_experts)
        ctx.progress = ("loading weights", 0, ctx.sizes.num_moe_layers)
        ctx.model = build_model(spec.shape, placement, ctx.rank, ctx.size, seed=spec.seed,
                                timeout=spec.collective_timeout_s)
        ctx.start_decoder()
        ctx.progress = ("starting the EPLB", 0, 1)  # memory registration (NIXL) can take a while
        ctx.eplb = ctx.new_eplb(placement, ctx.rank, ctx.size)
        start_eplb()
        ctx.progress = None
    return placement


def allocate_standby_weights(ctx: RankContext) -> float:
    """Launched ahead of a scale-up: allocate the weights and fault their pages in now, while
    the old group still decodes (on the pause this is pure cost), and register them. Returns
    the seconds it took."""
    spec = ctx.spec
    ctx.mode = p.WorkerMode.STANDBY
    started = time.perf_counter()
    with ctx.busy(p.WorkerMode.STANDBY):
        ctx.faults.slow_prepare(ctx.set_progress)
        weights = ctx.prepared_weights = ctx.sizes.allocate(spec.num_physical // spec.size)
        for i, layer in enumerate(weights):
            ctx.progress = ("allocating expert weights", i, len(weights))
            for tensor in layer:
                tensor.zero_()  # touch every page: the kernel maps them now, not during the transfer
        ctx.progress = ("registering memory", 0, 1)
        ctx.comm.set_incoming(weights)  # memory registration (NIXL), also ahead of the pause
        ctx.progress = None
    return time.perf_counter() - started
