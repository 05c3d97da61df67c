"""What a rescale does on one rank, decided without doing it: pure functions of a
:class:`~elastic.core.protocol.RescaleSpec` and the maps and load a rank holds.

The worker's executors (:mod:`elastic.worker.rescale`, :mod:`elastic.worker.prepare`) call
them: a Prepare and an announcing Suppress plan the scale ahead of its pause, a Rescale plans
what nobody planned for it. Every rank of the executing group computes the same plan from the
same spec, maps, window and hosts, so the plans agree without a message.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from elastic.core.owners import least_loaded
from elastic.core.protocol import RescaleSpec
from elastic.worker.groups import num_nodes_of
from eplb.config import EPLBConfig
from eplb.placement import Placement
from eplb.plan import LayerPlan, holders_from_mapping, plan_layer
from eplb.state import LoadWindow, placement_for

__all__ = ["RankRole", "RescalePlan", "eplb_config_for", "held_rows", "layer_plans", "next_placement",
           "plan_request_moves", "plan_rescale", "policy_hosts", "role_in"]


@dataclass(frozen=True)
class RankRole:
    """One rank's part in a rescale."""

    new_rank: int  # in the new group; -1: it leaves
    executing_rank: int  # in the group the transfers run on (the old one for a scale down)
    fresh: bool  # a joining rank: no weights, no maps of its own

    @property
    def leaves(self) -> bool:
        return self.new_rank < 0


def role_in(spec: RescaleSpec, rank: int, *, fresh: bool) -> RankRole:
    """``rank``'s role: an old rank's new rank comes from the mapping, a joining rank's is ``rank``."""
    if fresh:
        return RankRole(new_rank=rank, executing_rank=rank, fresh=True)
    if not 0 <= rank < spec.old_size:
        raise ValueError(f"rank {rank} is not in the old group of {spec.old_size}")
    new_rank = spec.mapping[rank]
    return RankRole(new_rank=new_rank, executing_rank=rank if spec.execute_on == "old" else new_rank, fresh=False)


@dataclass(frozen=True)
class RescalePlan:
    """The new placement and every layer's transfer plan, from the ``held`` rows."""

    spec: RescaleSpec
    base: Placement  # the maps the policy started from
    held: torch.Tensor  # [layers, P_old]: what each old rank's slots hold
    placement: Placement  # the new group's
    plans: tuple[LayerPlan, ...]

    @property
    def changed_layers(self) -> tuple[int, ...]:
        return tuple(layer for layer, plan in enumerate(self.plans) if plan.changes_anything)


def eplb_config_for(config: EPLBConfig, hosts: Sequence[str]) -> EPLBConfig:
    """``config`` with ``num_nodes`` derived from ``hosts``, unless the config pins it."""
    options = config.policy_options
    if options.get("num_nodes", "auto") != "auto":
        return config
    return config.model_copy(update={"policy_options": {**options, "num_nodes": num_nodes_of(tuple(hosts))}})


def policy_hosts(spec: RescaleSpec, group_hosts: Sequence[str]) -> tuple[str, ...]:
    """The hosts the policy places for: the group's, or, computed on the old group (a scale
    down), the survivors' in new rank order."""
    if spec.execute_on != "old":
        return tuple(group_hosts)
    return tuple(group_hosts[old] for _, old in sorted((new, old) for old, new in enumerate(spec.mapping) if new >= 0))


def next_placement(spec: RescaleSpec, base: Placement, held: torch.Tensor, load: torch.Tensor, config: EPLBConfig,
                   group_hosts: Sequence[str]) -> Placement:
    """The placement for the new group: same slots per rank, a policy run on ``load`` (the carried
    window's total), slot-aligned to what the surviving ranks hold (``held``), so they keep those
    slots in place. ``group_hosts``: those of the group this rank is in when it plans."""
    per_rank = base.num_physical // spec.old_size
    config = eplb_config_for(config, policy_hosts(spec, group_hosts))
    extra = {}
    if config.policy == "migration_aware" and "rank_mapping" not in config.policy_options:
        extra["rank_mapping"] = list(spec.mapping)  # experts stay with the worker that holds them
    survivors = [-1 if r in spec.lost else n for r, n in enumerate(spec.mapping)]
    return placement_for(config, load, per_rank * spec.new_size, spec.new_size, base, held=held,
                         held_mapping=survivors, **extra)


def layer_plans(spec: RescaleSpec, held: torch.Tensor, placement: Placement,
                hosts: Sequence[str]) -> tuple[LayerPlan, ...]:
    """Every layer's transfer plan from the ``held`` rows to ``placement``, senders on the
    receiver's host first. ``hosts``: those of the executing group, the same list on every rank."""
    per_rank = held.shape[1] // spec.old_size
    old_holder, new_holder = holders_from_mapping(list(spec.mapping), spec.new_size, spec.execute_on,
                                                  frozenset(spec.lost))
    return tuple(plan_layer(held[layer], placement.physical_to_logical[layer], per_rank, per_rank, old_holder,
                            new_holder, hosts=tuple(hosts) or None)
                 for layer in range(held.shape[0]))


def held_rows(base: torch.Tensor, own: Sequence[tuple[int, torch.Tensor] | None], old_size: int) -> torch.Tensor:
    """What the old ranks' slots really hold: ``base`` (``[layers, P_old]``, the lowest
    survivor's maps), each survivor's own slots taken from its own maps (``own``: ``(old rank,
    its maps)`` per rank of the new group, None for a joining one). After a peer died
    mid-all-reduce, some survivors may have committed a layer the others did not."""
    held = base.clone()
    per_rank = held.shape[1] // old_size
    for entry in own:
        if entry is not None:
            old_rank, rows = entry
            mine = slice(old_rank * per_rank, (old_rank + 1) * per_rank)
            held[:, mine] = rows[:, mine]
    return held


def diverged_layers(held: torch.Tensor, base: torch.Tensor) -> tuple[int, ...]:
    """Layers where some survivor's slots hold what the base maps do not (a torn commit)."""
    return tuple(sorted({int(x) for x in (held != base).any(dim=1).nonzero().flatten()}))


def plan_rescale(spec: RescaleSpec, placement: Placement, window: LoadWindow | torch.Tensor, *, config: EPLBConfig,
                 hosts: Sequence[str], held: torch.Tensor | None = None,
                 transfer_hosts: Sequence[str] | None = None) -> RescalePlan:
    """The whole plan: the new placement from ``placement`` (the base maps) and the load
    ``window``, and every layer's transfers from ``held`` (default: the base maps).
    ``hosts``: the planning rank's group's; ``transfer_hosts``: the executing group's, if
    another (a scale up prepared on the old group moves over the standby one)."""
    held = placement.physical_to_logical if held is None else held
    load = window.total() if isinstance(window, LoadWindow) else window
    new = next_placement(spec, placement, held, load, config, hosts)
    plans = layer_plans(spec, held, new, hosts if transfer_hosts is None else transfer_hosts)
    return RescalePlan(spec=spec, base=placement, held=held, placement=new, plans=plans)


def plan_request_moves(spec: RescaleSpec, held: Sequence[Sequence[tuple[str, int]]]) -> dict[str, int]:
    """Where a scale down's leaving ranks' requests go: ``held[old_rank]`` lists that rank's
    requests as ``(request id, tokens in flight)``; each request of a rank that leaves (alive, not
    lost) goes to the least loaded survivor (:func:`least_loaded`, surviving old ranks by their
    new rank). Returns ``request id -> old rank of the survivor`` (empty when nobody leaves)."""
    if len(held) != spec.old_size:
        raise ValueError(f"held lists {len(held)} ranks, the old group has {spec.old_size}")
    survivors = sorted((new, old) for old, new in enumerate(spec.mapping) if new >= 0 and old not in spec.lost)
    leaving = [(rid, load) for old, new in enumerate(spec.mapping) if new < 0 and old not in spec.lost
               for rid, load in held[old]]
    if not leaving:
        return {}
    if not survivors:
        raise ValueError(f"no rank survives mapping {spec.mapping}: the requests have nowhere to go")
    loads = [sum(load for _, load in held[old]) for _, old in survivors]
    chosen = least_loaded(loads, [load for _, load in leaving])
    return {rid: survivors[i][1] for (rid, _), i in zip(leaving, chosen)}
