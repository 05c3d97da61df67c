"""What a rank reports about itself on request: its verification, its placement, its threads."""

from __future__ import annotations

import hashlib
import os
import threading

from elastic.core import protocol as p
from elastic.worker.context import RankContext
from eplb.placement import Placement
from eplb.state import EPLBStats

__all__ = ["eplb_report", "placement_digest", "placement_export", "rss_bytes", "thread_names", "verify_result"]


def eplb_report(stats: EPLBStats) -> p.EPLBReport:
    """A frozen copy of the EPLB's statistics for a heartbeat."""
    failure = stats.last_failure
    return p.EPLBReport(
        rebalances_started=stats.rebalances_started, rebalances_finished=stats.rebalances_finished,
        rebalances_failed=stats.rebalances_failed, rebalances_skipped=stats.rebalances_skipped,
        layers_committed=stats.layers_committed, bytes_moved=stats.bytes_moved, watchdog_stalls=stats.watchdog_stalls,
        restarts=stats.restarts, last_balancedness=stats.last_balancedness,
        balancedness_before=stats.balancedness_before,
        layer_balancedness=dict(stats.layer_balancedness) if stats.layer_balancedness is not None else None,
        last_rebalance_seconds=stats.last_rebalance_seconds,
        last_failure=None if failure is None else p.EPLBFailure(failure.layer, failure.error_type, failure.message),
        placement_seconds=stats.placement_seconds, sync_stall_seconds=tuple(stats.sync_stall_seconds),
        health=stats.health.value, last_error=stats.last_error)


def thread_names() -> tuple[str, ...]:
    return tuple(sorted(t.name for t in threading.enumerate()))


def rss_bytes() -> int:
    """Resident memory of this process now (Linux ``/proc/self/statm``), 0 where unknown."""
    try:
        with open("/proc/self/statm") as statm:
            return int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except OSError:
        return 0


def placement_digest(placement: Placement) -> str:
    return hashlib.blake2b(placement.physical_to_logical.numpy().tobytes(), digest_size=8).hexdigest()


def verify_result(ctx: RankContext) -> p.VerifyResult:
    """Every local slot checked against the canonical weights, and what this rank holds."""
    from torch.distributed import distributed_c10d

    placement = ctx.eplb.placement
    return p.VerifyResult(
        threads=thread_names(),
        process_groups=len(distributed_c10d._world.pg_map),
        rss_bytes=rss_bytes(),
        expert_weight_bytes=sum(t.numel() * t.element_size() for layer in ctx.model.expert_weights() for t in layer),
        staging_bytes=sum(t.numel() * t.element_size() for t in ctx.eplb.staging),
        mismatched=tuple(ctx.model.verify()),
        digest=placement_digest(placement),
        replica_min=int(placement.replica_count.min()),
        num_physical=placement.num_physical,
        size=ctx.size,
        communicator=ctx.comm.stats(),
        hosts=tuple(ctx.group.hosts) if ctx.group is not None else (),
        num_nodes=ctx.eplb.config.policy_options.get("num_nodes", 1),
    )


def placement_export(ctx: RankContext) -> p.PlacementExport:
    """The committed placement and the load window's total."""
    placement, window = ctx.eplb.placement, ctx.eplb.window
    return p.PlacementExport(
        physical_to_logical=tuple(tuple(row) for row in placement.physical_to_logical.tolist()),
        logical_load=tuple(tuple(row) for row in window.total().tolist()), window_steps=window.filled,
        digest=placement_digest(placement), size=ctx.size)
