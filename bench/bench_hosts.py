"""Cross-host expert bytes of a scale and a rebalance on two hosts, with and without the
same-host sender preference of :func:`eplb.plan.plan_layer` (``hosts=``). Pure: no process,
no network; the plans are the ones the workers would make.

    python -m bench.bench_hosts [--layers 16] [--experts 16] [--slots 10] [--json bench-hosts.json]

The layout is the namespace two-host setup's (``tests/test_scaleout.py``): 2 ranks on hosts
``[h0, h1]``, scaled to 4 on ``[h0, h0, h1, h1]`` (old ranks 0 and 1 become new ranks 0 and 2),
a rebalance on the 4 ranks, and back to 2 (one survivor per host). Placements come from the
``default`` policy (replicas anywhere) and from ``hierarchical`` with 2 nodes and 4 groups (the
namespace test's policy: an expert's replicas on one host), on a seeded skewed load (the
worker's own ``placement_for``, slot-aligned to what the ranks hold), plans from
``holders_from_mapping`` and ``plan_layer`` exactly as the worker calls them, once without hosts
and once with the executing group's hosts. A transfer is cross-host when its sender and
receiver are on different hosts; bytes = transfers x expert bytes (``3 * hidden *
intermediate`` bf16 values).
"""

from __future__ import annotations

import argparse
import sys
from typing import Any

import torch
from rich.console import Console
from rich.table import Table

from bench.common import fmt_bytes, write_json
from eplb.config import EPLBConfig
from eplb.placement import Placement
from eplb.plan import LayerPlan, holders_from_mapping, plan_layer
from eplb.state import placement_for

HOSTS_2 = ("h0", "h1")
HOSTS_4 = ("h0", "h0", "h1", "h1")


def _load(layers: int, experts: int, seed: int) -> torch.Tensor:
    """A skewed load per layer: a Zipf-like profile over a seeded permutation of the experts."""
    gen = torch.Generator().manual_seed(seed)
    ranks = torch.arange(1, experts + 1, dtype=torch.float64)
    out = torch.empty(layers, experts, dtype=torch.int64)
    for layer in range(layers):
        profile = 10_000 / ranks ** 1.1
        out[layer] = profile[torch.randperm(experts, generator=gen)].round().to(torch.int64)
    return out


def _cross(plans: list[LayerPlan], hosts: tuple[str, ...]) -> tuple[int, int]:
    transfers = sum(plan.num_transfers for plan in plans)
    return transfers, sum(1 for plan in plans for t in plan.transfers if hosts[t.src] != hosts[t.dst])


def _plans(held: torch.Tensor, new: Placement, per_rank: int, mapping: list[int], new_size: int, execute_on: str,
           hosts: tuple[str, ...] | None) -> list[LayerPlan]:
    old_holder, new_holder = holders_from_mapping(mapping, new_size, execute_on)  # type: ignore[arg-type]
    return [plan_layer(held[layer], new.physical_to_logical[layer], per_rank, per_rank, old_holder, new_holder,
                       hosts=hosts) for layer in range(held.shape[0])]


def run(args: argparse.Namespace) -> dict[str, Any]:
    L, E, S = args.layers, args.experts, args.slots  # noqa: N806 - the model's usual names
    expert_bytes = 3 * args.hidden * args.intermediate * 2
    out: dict[str, Any] = {"settings": vars(args), "expert_bytes": expert_bytes, "cases": []}
    for policy, num_nodes in (("default", 1), ("hierarchical", 2)):
        config = EPLBConfig(policy=policy)

        def place(load, size, old, held=None, held_mapping=None, config=config, num_nodes=num_nodes):
            cfg = config.model_copy(update={"policy_options": {"num_groups": 2 * num_nodes, "num_nodes": num_nodes}})
            return placement_for(cfg, load, S * size, size, old, held=held, held_mapping=held_mapping)

        start = Placement.static(L, E, S * 2)
        two = place(_load(L, E, args.seed), 2, start)
        steps = []
        # 2 -> 4 on the new group: old ranks 0, 1 become new ranks 0, 2
        mapping_up = [0, 2]
        four = place(_load(L, E, args.seed + 1), 4, two, held=two.physical_to_logical, held_mapping=mapping_up)
        steps.append(("scale 2->4", two.physical_to_logical, four, mapping_up, 4, "new", HOSTS_4))
        # a rebalance on the 4 ranks, after the load drifted
        four_b = place(_load(L, E, args.seed + 2), 4, four)
        steps.append(("rebalance on 4", four.physical_to_logical, four_b, [0, 1, 2, 3], 4, "new", HOSTS_4))
        # 4 -> 2 on the old group: one survivor per host
        mapping_down = [0, -1, 1, -1]
        back = place(_load(L, E, args.seed + 3), 2, four_b, held=four_b.physical_to_logical, held_mapping=mapping_down)
        steps.append(("scale 4->2", four_b.physical_to_logical, back, mapping_down, 2, "old", HOSTS_4))
        for name, held, new, mapping, size, execute_on, hosts in steps:
            plain = _plans(held, new, S, mapping, size, execute_on, None)
            placed = _plans(held, new, S, mapping, size, execute_on, hosts)
            total, cross_plain = _cross(plain, hosts)
            total_placed, cross_placed = _cross(placed, hosts)
            assert total == total_placed  # the preference changes senders, never what moves
            out["cases"].append({
                "policy": policy, "step": name, "transfers": total, "bytes": total * expert_bytes,
                "cross_host_transfers_plain": cross_plain, "cross_host_transfers_same_host": cross_placed,
                "cross_host_bytes_plain": cross_plain * expert_bytes,
                "cross_host_bytes_same_host": cross_placed * expert_bytes,
                "max_sends_plain": max(max(p.sends_per_rank().values()) for p in plain),
                "max_sends_same_host": max(max(p.sends_per_rank().values()) for p in placed),
            })
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--layers", type=int, default=16)
    parser.add_argument("--experts", type=int, default=16, help="logical experts")
    parser.add_argument("--slots", type=int, default=10, help="expert slots per rank (2 ranks hold every expert)")
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--intermediate", type=int, default=512)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", default=None)
    args = parser.parse_args(argv)
    if 2 * args.slots < args.experts:
        parser.error("2 ranks must hold every expert: --slots >= --experts / 2")
    result = run(args)
    table = Table(title="cross-host expert transfers on two hosts: plain senders vs same-host senders")
    for column in ("policy", "step", "transfers", "moved", "cross-host (plain)", "cross-host (same host)",
                   "cut", "max sends/rank (plain -> same host)"):
        table.add_column(column, justify="right")
    for c in result["cases"]:
        before, after = c["cross_host_transfers_plain"], c["cross_host_transfers_same_host"]
        cut = f"{1 - after / before:.0%}" if before else "-"
        table.add_row(c["policy"], c["step"], str(c["transfers"]), fmt_bytes(c["bytes"]),
                      f"{before} ({fmt_bytes(c['cross_host_bytes_plain'])})",
                      f"{after} ({fmt_bytes(c['cross_host_bytes_same_host'])})", cut,
                      f"{c['max_sends_plain']} -> {c['max_sends_same_host']}")
    Console(width=170).print(table)
    write_json(args.json, result)
    return 0


if __name__ == "__main__":
    sys.exit(main())
