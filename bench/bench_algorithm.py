"""Placement policies on families of synthetic expert loads: balance against the optimum, time, copies.

Run from the repository root (one thread; CPU time per call, ``time.thread_time``)::

    python -m bench.bench_algorithm                               # DeepSeek-V3 EP32 and EP64, every family
    python -m bench.bench_algorithm --shape ds-64 --family zipf,drift --seeds held-out
    python -m bench.bench_algorithm --ilp 2                       # + exact optima (HiGHS) on reduced shapes
    python -m bench.bench_algorithm --json out/algorithm.json

Loads. Each family is a model of real expert load (:data:`FAMILIES`): per window a popularity
``p [layers, L]``, from which the window's token counts are sampled as top-``k`` routing of
``tokens`` tokens: expert ``e`` is picked by a token with the inclusion probability
``pi_e = 1 - exp(-theta * p_e)`` (``theta`` such that ``sum(pi) = k``; this is the probability
that ``e`` is among the first ``k`` arrivals of the exponential race behind Gumbel top-``k``,
so ``pi_e <= 1`` and no expert gets more than one pick per token), and its count is
``Binomial(tokens, pi_e)``. So every family carries the sampling noise of a real window
(4096 tokens per layer per window on the DeepSeek-V3 shapes; 2048 for ``noisy``). The ``mn-1k``,
``mn-4k`` and ``mn-16k`` families sample a fixed Zipf profile as a multinomial of
``tokens * top_k`` picks at 1024, 4096 and 16384 tokens per window: only the noise changes.

Seeds. ``tune`` seeds (0, 1, 2) are the ones the algorithm's constants were chosen on;
``held-out`` seeds (1000, 1001, 1002) were never looked at while tuning. The bench prints
both; the targets are checked on ``held-out``. ``tune-12`` (seeds 0-11, the three tune seeds among
them) is for choices a 3-seed mean cannot tell apart (it scatters by about 0.001-0.002 per cell);
``--seeds tune-12`` runs it alone.

Per shape, family and seed, ``windows + 2`` consecutive windows. Each policy places from
window 0 (from the static placement), then rebalances once per window ``t = 1..windows`` from
its own previous placement, fitted to the estimate of window ``t`` (``--smoothing a``: the
adaptive exponential average :func:`eplb.estimate.smoothed_load` of windows ``0..t`` with weight
``a``, 0.3 by default, chosen on the tune seeds; ``1``: window ``t`` alone; ``migration_aware``
then gets ``noise=smoothed_noise(a)``), and is scored on that estimate (fitted) and on window ``t + 1``:

- ``bal``: balancedness (mean GPU load / max GPU load), mean over layers and windows;
  ``worst``: the worst layer of any window;
- ``opt``: the best balancedness possible, bounded from above by
  :func:`eplb.bounds.peak_lower_bound` (a proven lower bound on the peak GPU load that accounts
  for the ``S`` slots per GPU); ``bal/opt`` (mean) and ``worst/opt`` (worst layer) compare each
  layer with it. Since ``opt`` can only be too optimistic, ``bal/opt`` can only be too low;
- ``next``: balancedness of the placement on the following window (what serving sees), the
  measure of record;
- ``ceiling``: ``next`` of ``default`` fitted to the generator's *expected* load of that window
  (no online policy can expect to beat it by more than noise; on the non-stationary families it
  is an oracle that knows where the load goes); ``gap`` = ``ceiling - next``;
- ``ms``: median CPU ms of one call for all layers, the slowest of float32, bfloat16, int64
  and float64 input (``default``; the others time their own input only);
- ``copies``: (GPU, expert) pairs new on a GPU per rebalance, as a share of the slots.

``--ilp N`` also solves ``N`` sampled layers per family exactly (:func:`eplb.bounds.optimal_peak`)
on reduced shapes (32 experts on 4 GPUs with 36 slots, on 8 GPUs with 40 slots: the DeepSeek
ratios), and prints the algorithm, the counting bound and the optimum side by side.

Figures measured on the development machine are in ``docs/design.md`` (algorithm section).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from eplb.algorithm import cross_gpu_copies, rebalance_experts
from eplb.bounds import optimal_peak, peak_lower_bound
from eplb.estimate import smoothed_load, smoothed_noise
from eplb.placement import Placement
from eplb.trace import seed_for


@dataclass(frozen=True)
class Shape:
    name: str
    layers: int
    experts: int
    redundant: int
    gpus: int
    nodes: int
    groups: int
    top_k: int
    tokens: int  # tokens per layer per window

    @property
    def slots(self) -> int:
        return self.experts + self.redundant


SHAPES = {
    s.name: s
    for s in (
        Shape("small", 4, 16, 4, 4, 1, 1, top_k=2, tokens=1024),
        Shape("medium", 16, 64, 16, 8, 2, 8, top_k=4, tokens=2048),
        Shape("ds-32", 58, 256, 32, 32, 4, 8, top_k=8, tokens=4096),
        Shape("ds-64", 58, 256, 64, 64, 8, 8, top_k=8, tokens=4096),
    )
}
SEEDS = {
    "tune": (0, 1, 2),
    "held-out": (1000, 1001, 1002),
    "tune-12": tuple(range(12)),
    # the far layers' aim and recount bound were chosen on these 72 seeds (docs/design.md, issue 31)
    "tune-72": tuple(range(24)) + tuple(range(3000, 3048)),
    # ... and checked once on these, before the held-out seeds
    "fresh": tuple(range(4000, 4048)),
}
POLICIES = ("static", "default", "hierarchical", "hierarchical_spill", "migration_aware")
# the estimate's weight of the last window (eplb.estimate.smoothed_load, adaptive): chosen on the tune
# seeds 0-2, ds-32, default's next window on mn-1k, zipf, drift and burst (mean of the four):
# 1.0 (last window) 0.7624; a plain average (no adaptation) 0.5 -> 0.7667, 0.3 -> 0.7600 (drift
# losing 0.018 / 0.045); adaptive 0.5 -> 0.7682, 0.3 -> 0.7710, 0.2 -> 0.7712. 0.3 kept: tied with
# 0.2 within the seeds' scatter, and it follows a moving load sooner
DEFAULT_SMOOTHING = 0.3
DTYPES = (torch.float32, torch.bfloat16, torch.int64, torch.float64)


# --------------------------------------------------------------------------------------------
# Load families: popularity per window [W, B, L], then sampled top-k token counts
# --------------------------------------------------------------------------------------------


def _ranked(rng: np.random.Generator, by_rank: np.ndarray) -> np.ndarray:
    """``by_rank [B, L]`` (hottest first) -> the same values under a random ranking per layer."""
    perm = np.argsort(rng.random(by_rank.shape), axis=1)
    out = np.empty_like(by_rank)
    np.put_along_axis(out, perm, by_rank, axis=1)
    return out


def _zipf(rng: np.random.Generator, b: int, n: int, lo: float, hi: float) -> np.ndarray:
    s = rng.uniform(lo, hi, size=(b, 1))
    return _ranked(rng, np.arange(1, n + 1, dtype=np.float64)[None, :] ** -s)


def fam_zipf(rng, b, n, w):
    """Zipf popularity ``rank ** -s``, ``s`` uniform in [0.6, 2.0] per layer (random ranking):
    the power law measured on MoE routers, from mild to one expert far ahead. Stationary."""
    return np.broadcast_to(_zipf(rng, b, n, 0.6, 2.0), (w, b, n))


def fam_pareto(rng, b, n, w):
    """i.i.d. Pareto popularity (``x_m = 1``, tail index ``a`` uniform in [1.1, 3.0] per layer):
    heavy tails, a few experts an order of magnitude above the rest. Stationary."""
    a = rng.uniform(1.1, 3.0, size=(b, 1))
    return np.broadcast_to(rng.pareto(a, size=(b, n)) + 1.0, (w, b, n))


def fam_correlated(rng, b, n, w):
    """Log-normal popularity (sigma 1.3) whose hot set is shared across layers: the log of each
    layer's popularity is ``0.75 * z_shared + 0.66 * z_layer`` (correlation 0.75 between
    layers), as when the same tokens' topics heat the same experts in every layer. Stationary."""
    z = 0.75 * rng.standard_normal((1, n)) + np.sqrt(1 - 0.75**2) * rng.standard_normal((b, n))
    return np.broadcast_to(np.exp(1.3 * z), (w, b, n))


def fam_drift(rng, b, n, w):
    """A hot set that drifts: log-normal popularity (sigma 1.3) whose log follows an AR(1) from
    window to window, ``x' = 0.8 x + 0.6 e`` (the workload's mix shifting). Not stationary."""
    x = rng.standard_normal((b, n))
    out = np.empty((w, b, n))
    for t in range(w):
        out[t] = np.exp(1.3 * x)
        x = 0.8 * x + 0.6 * rng.standard_normal((b, n))
    return out


def fam_burst(rng, b, n, w):
    """Bursts: Zipf (``s`` in [0.6, 1.2]) where, in each window and layer with probability 1/2,
    1 to 4 random experts spike 5-30x for that window only (a batch of one kind of request).
    Not stationary."""
    base = _zipf(rng, b, n, 0.6, 1.2)
    out = np.repeat(base[None], w, axis=0)
    for t in range(w):
        for layer in np.nonzero(rng.random(b) < 0.5)[0]:
            hot = rng.choice(n, size=rng.integers(1, 5), replace=False)
            out[t, layer, hot] *= rng.uniform(5.0, 30.0, size=hot.size)
    return out


def fam_uniform(rng, b, n, w):
    """Near-uniform popularity (``1 + 0.05 * N(0, 1)``): a router trained with a strong balance
    loss; what is left is mostly sampling noise. Stationary."""
    return np.broadcast_to(np.clip(1.0 + 0.05 * rng.standard_normal((b, n)), 0.5, None), (w, b, n))


def fam_sparse(rng, b, n, w):
    """Sparse: 30-75% of the experts (per layer) get no tokens at all (a narrow domain routes
    around them); the rest Zipf with ``s`` in [0.8, 1.2]. Stationary."""
    p = _zipf(rng, b, n, 0.8, 1.2)
    zero = rng.random((b, n)) < rng.uniform(0.3, 0.75, size=(b, 1))
    zero[np.arange(b), p.argmax(axis=1)] = False
    return np.broadcast_to(np.where(zero, 0.0, p), (w, b, n))


def fam_noisy(rng, b, n, w):
    """Zipf (``s`` in [0.8, 1.4]) sampled from half the tokens (2048 per layer and window): the
    window-to-window sampling noise is what a rebalance sees most. Stationary."""
    return np.broadcast_to(_zipf(rng, b, n, 0.8, 1.4), (w, b, n))


def fam_profile(rng, b, n, w):
    """A fixed Zipf profile (``s`` uniform in [0.8, 1.4] per layer, random ranking) whose windows
    are multinomial samples of ``tokens * top_k`` routed picks (the ``mn-*`` families, at 1/4, 1
    and 4 times the shape's tokens per window): only the window-to-window noise changes. Stationary."""
    return np.broadcast_to(_zipf(rng, b, n, 0.8, 1.4), (w, b, n))


@dataclass(frozen=True)
class Family:
    name: str
    make: Callable[[np.random.Generator, int, int, int], np.ndarray]
    stationary: bool
    token_share: float = 1.0  # tokens per window as a share of the shape's
    multinomial: bool = False  # windows are multinomial samples of tokens * top_k picks (else top-k inclusion)

    @property
    def doc(self) -> str:
        return " ".join((self.make.__doc__ or "").split())


FAMILIES = {
    f.name: f
    for f in (
        Family("zipf", fam_zipf, True),
        Family("pareto", fam_pareto, True),
        Family("correlated", fam_correlated, True),
        Family("drift", fam_drift, False),
        Family("burst", fam_burst, False),
        Family("uniform", fam_uniform, True),
        Family("sparse", fam_sparse, True),
        Family("noisy", fam_noisy, True, token_share=0.5),
        Family("mn-1k", fam_profile, True, token_share=0.25, multinomial=True),
        Family("mn-4k", fam_profile, True, token_share=1.0, multinomial=True),
        Family("mn-16k", fam_profile, True, token_share=4.0, multinomial=True),
    )
}


def inclusion_probabilities(popularity: np.ndarray, top_k: int) -> np.ndarray:
    """``[..., L]`` popularity -> probability that a token picks each expert among its top ``k``
    (``1 - exp(-theta * p)``, ``theta`` per row by bisection so that the row sums to ``k``)."""
    p = popularity / popularity.sum(axis=-1, keepdims=True)
    k = min(top_k, int((p > 0).sum(axis=-1).min()))
    lo = np.zeros(p.shape[:-1])
    hi = np.full(p.shape[:-1], 1.0)
    while ((1 - np.exp(-hi[..., None] * p)).sum(axis=-1) < k).any():
        hi *= 2
    for _ in range(60):
        mid = (lo + hi) / 2
        low = (1 - np.exp(-mid[..., None] * p)).sum(axis=-1) < k
        lo, hi = np.where(low, mid, lo), np.where(low, hi, mid)
    return 1 - np.exp(-hi[..., None] * p)


@dataclass(frozen=True)
class Windows:
    """One family and seed: sampled int64 token counts ``[layers, experts]`` per window, and the
    generator's expected counts (float64) of each window."""

    loads: list[torch.Tensor]
    expected: list[torch.Tensor]


def family_windows(family: Family, shape: Shape, windows: int, seed: int) -> Windows:
    """``windows + 2`` windows of one family and seed (samples and expectations)."""
    rng = np.random.default_rng(seed_for(seed, family.name, shape.layers, shape.experts))
    pop = family.make(rng, shape.layers, shape.experts, windows + 2)
    tokens = max(1, int(shape.tokens * family.token_share))
    if family.multinomial:
        p = pop / pop.sum(axis=-1, keepdims=True)
        picks = tokens * shape.top_k
        loads = [np.stack([rng.multinomial(picks, p[t, layer]) for layer in range(shape.layers)]) for t in range(windows + 2)]
        expected = [picks * p[t] for t in range(windows + 2)]
    else:
        pi = inclusion_probabilities(pop, shape.top_k)
        loads = [rng.binomial(tokens, pi[t]) for t in range(windows + 2)]
        expected = [tokens * pi[t] for t in range(windows + 2)]
    return Windows([torch.from_numpy(x.astype(np.int64)) for x in loads],
                   [torch.from_numpy(np.asarray(x, dtype=np.float64)) for x in expected])


def family_loads(family: Family, shape: Shape, windows: int, seed: int) -> list[torch.Tensor]:
    """``windows + 2`` int64 token-count loads ``[layers, experts]`` of one family and seed."""
    return family_windows(family, shape, windows, seed).loads


# --------------------------------------------------------------------------------------------
# Runs
# --------------------------------------------------------------------------------------------


def _call(policy: str, load: torch.Tensor, shape: Shape, previous: torch.Tensor | None,
          options: dict[str, Any] | None = None) -> torch.Tensor:
    if policy == "static":
        return Placement.static(shape.layers, shape.experts, shape.slots).physical_to_logical
    opts = options if policy == "migration_aware" and options else {}
    return rebalance_experts(load, shape.slots, shape.groups, shape.nodes, shape.gpus, policy=policy, previous=previous, **opts)[0]


def _gpu_peak(p2l: torch.Tensor, load: torch.Tensor, gpus: int) -> np.ndarray:
    p = p2l.numpy()
    w = load.double().numpy()
    counts = np.zeros_like(w)
    np.add.at(counts, (np.arange(p.shape[0])[:, None], p), 1.0)
    per_slot = np.take_along_axis(w / np.maximum(counts, 1), p, axis=1)
    return per_slot.reshape(p.shape[0], gpus, -1).sum(axis=2).max(axis=1)


def _bal(p2l: torch.Tensor, load: torch.Tensor, gpus: int) -> np.ndarray:
    """``[layers]`` balancedness of ``p2l`` on ``load``."""
    peak = _gpu_peak(p2l, load, gpus)
    mean = load.double().sum(dim=1).numpy() / gpus
    return np.where(peak > 0, mean / np.maximum(peak, 1e-300), 1.0)


def estimates(loads: list[torch.Tensor], smoothing: float) -> list[torch.Tensor]:
    """The load each rebalance is fitted to: the last window (``smoothing`` 1) or the
    exponential average :func:`eplb.estimate.smoothed_load` of the windows so far."""
    if smoothing >= 1.0:
        return list(loads)
    out: list[torch.Tensor] = []
    for ld in loads:
        out.append(smoothed_load(out[-1] if out else None, ld, smoothing))
    return out


def _timed(policy: str, x: torch.Tensor, shape: Shape, cur: torch.Tensor, options: dict[str, Any], repeat: int) -> list[float]:
    """Median-free: the fastest of ``repeat`` calls, ms, per input dtype (``default``: four dtypes)."""
    dtypes = DTYPES if policy == "default" else (x.dtype,)
    per_dtype = []
    for dt in dtypes:
        xd = x.to(dt) if dt != x.dtype else x
        times = []
        for _ in range(max(1, repeat)):
            c0 = time.thread_time()
            _call(policy, xd, shape, cur, options)
            times.append(time.thread_time() - c0)
        per_dtype.append(1000 * min(times))
    return per_dtype


def run_seed(policies: list[str], shape: Shape, win: Windows, repeat: int, smoothing: float = 1.0) -> dict[str, dict[str, list]]:
    """Every policy over the windows of one seed; raw per-window, per-layer figures. Each
    rebalance ``t`` is fitted to the estimate of window ``t`` (:func:`estimates`) and scored on
    it (fitted: ``bal``, ``opt``) and on window ``t + 1`` (next); ``ceiling``: ``default`` fitted to the generator's
    expected load of window ``t + 1``, scored on that window."""
    loads, g = win.loads, shape.gpus
    est = estimates(loads, smoothing)
    options: dict[str, Any] = {} if smoothing >= 1.0 else {"noise": smoothed_noise(smoothing)}
    bound: list[np.ndarray | None] = [None] * len(loads)
    ceiling = [_bal(_call("default", win.expected[t + 1], shape, None), loads[t + 1], g) for t in range(1, len(loads) - 1)]
    out: dict[str, dict[str, list]] = {}
    for policy in policies:
        rec: dict[str, list] = {k: [] for k in ("bal", "ratio", "opt", "next", "ceiling", "copies", "cpu")}
        cur = _call(policy, est[0], shape, Placement.static(shape.layers, shape.experts, shape.slots).physical_to_logical, options)
        for t in range(1, len(loads) - 1):
            rec["cpu"].append(_timed(policy, est[t], shape, cur, options, repeat))
            new = _call(policy, est[t], shape, cur, options)
            peak = _gpu_peak(new, est[t], g)  # fitted: on the load it was fitted to
            if bound[t] is None:  # the bound needs a reachable peak to start from: any policy's
                bound[t] = peak_lower_bound(est[t].double().numpy(), shape.slots, g, upper=peak)
            lb = np.minimum(bound[t], peak)
            mean = est[t].double().sum(dim=1).numpy() / g
            rec["bal"].append(_bal(new, est[t], g))
            rec["ratio"].append(np.where(peak > 0, lb / np.maximum(peak, 1e-300), 1.0))
            rec["opt"].append(np.where(lb > 0, mean / np.maximum(lb, 1e-300), 1.0))
            rec["next"].append(_bal(new, loads[t + 1], g))
            rec["ceiling"].append(ceiling[t - 1])
            rec["copies"].append(cross_gpu_copies(cur, new, g).double().numpy() / shape.slots)
            cur = new
        out[policy] = rec
    return out


def summarize(raw: list[dict[str, dict[str, list]]], policy: str) -> dict[str, Any]:
    """Aggregate one policy over seeds: means over layers and windows, worst layers."""
    cat = {k: np.concatenate([np.concatenate(r[policy][k]) if k != "cpu" else np.asarray(r[policy][k]).ravel()
                              for r in raw]) for k in ("bal", "ratio", "opt", "next", "ceiling", "copies")}
    cpu = np.concatenate([np.asarray(r[policy]["cpu"]) for r in raw])  # [windows, dtypes]
    allowed = cat["opt"] >= 0.90 - 1e-12
    return {
        "balancedness": float(cat["bal"].mean()),
        "worst_layer": float(cat["bal"].min()),
        "worst_where_opt_allows_0.90": float(cat["bal"][allowed].min()) if allowed.any() else None,
        "opt_balancedness": float(cat["opt"].mean()),
        "opt_worst_layer": float(cat["opt"].min()),
        "bal_over_opt": float(cat["ratio"].mean()),
        "worst_over_opt": float(cat["ratio"].min()),
        "next_balancedness": float(cat["next"].mean()),
        "ceiling": float(cat["ceiling"].mean()),
        "next_gap": float(cat["ceiling"].mean() - cat["next"].mean()),
        "cpu_ms_per_dtype": [float(np.median(cpu[:, i])) for i in range(cpu.shape[1])],
        "cpu_ms": float(np.median(cpu, axis=0).max()),
        "copies_share": float(cat["copies"].mean()),
        "rebalances": int(cat["bal"].size // raw[0][policy]["bal"][0].size),
    }


def check_targets(results: dict) -> list[dict[str, Any]]:
    """The issue's targets, on the held-out seeds, every family."""
    out = []

    def add(what: str, value: float | None, op: str, bound: float) -> None:
        if value is None:
            out.append({"target": what, "value": None, "bound": f"{op} {bound}", "ok": None})
            return
        ok = value >= bound - 1e-12 if op == ">=" else value <= bound + 1e-12
        out.append({"target": what, "value": round(value, 4), "bound": f"{op} {bound}", "ok": ok})

    for shape_name, by_family in results.get("held-out", {}).items():
        need = {"ds-32": 0.99, "ds-64": 0.97}.get(shape_name)
        for fam, rows in by_family.items():
            d = rows.get("default")
            if d:
                add(f"{shape_name} {fam} default bal/opt mean", d["bal_over_opt"], ">=", 0.99)
                add(f"{shape_name} {fam} default bal/opt worst layer", d["worst_over_opt"], ">=", 0.95)
                if need is not None:
                    if d["opt_balancedness"] >= need:
                        add(f"{shape_name} {fam} default mean", d["balancedness"], ">=", need)
                    add(f"{shape_name} {fam} default worst layer (where opt >= 0.90)", d["worst_where_opt_allows_0.90"], ">=", 0.90)
                    add(f"{shape_name} {fam} default CPU ms, slowest dtype", d["cpu_ms"], "<=", 10.0)
            m = rows.get("migration_aware")
            stationary = FAMILIES[fam].stationary
            for name, row in (("default", d), ("migration_aware", m)):
                if row and stationary:
                    add(f"{shape_name} {fam} {name} next-window gap to the ceiling", row["next_gap"], "<=", 0.02)
            if m and d:
                add(f"{shape_name} {fam} migration_aware CPU ms", m["cpu_ms"], "<=", 20.0)
                if stationary:
                    add(f"{shape_name} {fam} migration_aware copies share", m["copies_share"], "<=", 0.03)
                if fam == "drift":
                    ratio = m["copies_share"] / max(d["copies_share"], 1e-12)
                    add(f"{shape_name} {fam} migration_aware copies / default's", ratio, "<=", 0.25)
                add(f"{shape_name} {fam} migration_aware next - default next", m["next_balancedness"] - d["next_balancedness"],
                    ">=", -0.005 if stationary else -0.01)
    return out


def run_ilp(families: list[str], layers: int, time_limit: float) -> list[dict[str, Any]]:
    """Exact optima on reduced shapes for ``layers`` sampled layers per family (held-out seed)."""
    rows = []
    for name, gpus, slots in (("mini-32", 4, 36), ("mini-64", 8, 40)):
        shape = Shape(name, layers, 32, slots - 32, gpus, 1, 1, top_k=2, tokens=512)
        for fam in families:
            load = family_loads(FAMILIES[fam], shape, 0, SEEDS["held-out"][0])[0]
            p2l = rebalance_experts(load, slots, 1, 1, gpus)[0]
            peak = _gpu_peak(p2l, load, gpus)
            lb = peak_lower_bound(load.double().numpy(), slots, gpus, upper=peak)
            mean = load.double().sum(dim=1).numpy() / gpus
            for layer in range(layers):
                best, proven, optimal = optimal_peak(
                    load[layer].double().numpy(), slots, gpus, upper=float(peak[layer]), time_limit=time_limit
                )
                rows.append({
                    "shape": name, "family": fam, "layer": layer,
                    "default": float(mean[layer] / peak[layer]) if peak[layer] > 0 else 1.0,
                    "ilp_best": float(mean[layer] / best) if best > 0 else 1.0,
                    "ilp_upper": float(mean[layer] / proven) if proven > 0 else 1.0,
                    "counting_bound": float(mean[layer] / lb[layer]) if lb[layer] > 0 else 1.0,
                    "proven": bool(optimal),
                })
    return rows


def _parse_list(value: str, known: tuple[str, ...], what: str) -> list[str]:
    items = list(known) if value == "all" else [v.strip() for v in value.split(",") if v.strip()]
    bad = [v for v in items if v not in known]
    if bad or not items:
        raise SystemExit(f"unknown {what} {', '.join(bad) or value!r}; known: {', '.join(known)}, all")
    return items


def _run_shape(console: Any, results: dict[str, Any], args: argparse.Namespace, seed_set: str, shape: Any,
               families: list[str], policies: list[str]) -> None:
    """One seed set on one shape: every family and policy, a table row each, kept in ``results``."""
    from rich.table import Table

    table = Table(title=f"{seed_set} seeds {_seed_text(SEEDS[seed_set])}: {shape.name}, {shape.layers} layers, {shape.experts} "
                  f"experts, {shape.slots} slots, {shape.gpus} GPUs, {shape.nodes} nodes, top-{shape.top_k}, "
                  f"{shape.tokens} tokens/window, {args.windows} rebalances per seed")
    for col in ("family", "policy", "bal/opt", "worst/opt", "bal", "worst", "opt", "next", "ceiling", "gap", "cpu ms", "copies"):
        table.add_column(col, justify="left" if col in ("family", "policy") else "right")
    notes: list[str] = []
    for fam in families:
        raw = [run_seed(policies, shape, family_windows(FAMILIES[fam], shape, args.windows, seed), args.repeat, args.smoothing)
               for seed in SEEDS[seed_set]]
        for policy in policies:
            row = summarize(raw, policy)
            results.setdefault(seed_set, {}).setdefault(shape.name, {}).setdefault(fam, {})[policy] = row
            table.add_row(
                fam, policy, f"{row['bal_over_opt']:.4f}", f"{row['worst_over_opt']:.3f}",
                f"{row['balancedness']:.4f}", f"{row['worst_layer']:.3f}", f"{row['opt_balancedness']:.4f}",
                f"{row['next_balancedness']:.4f}", f"{row['ceiling']:.4f}", f"{row['next_gap']:+.4f}",
                f"{row['cpu_ms']:.1f}", f"{100 * row['copies_share']:.1f}%",
            )
        table.add_section()
        if "migration_aware" in policies and len(raw) >= 6:
            diff = _per_seed_next_difference(raw)
            results[seed_set][shape.name][fam]["migration_aware"]["next_vs_default_per_seed"] = diff.tolist()
            blocks = diff[: diff.size // 3 * 3].reshape(-1, 3).mean(axis=1)
            notes.append(f"  {fam}: migration_aware next - default next per seed ({diff.size} seeds): "
                         f"mean {diff.mean():+.4f}, sd {diff.std(ddof=1):.4f}, worst seed {diff.min():+.4f}, "
                         f"three-seed blocks {blocks.min():+.4f} to {blocks.max():+.4f}")
    console.print(table)
    for line in notes:
        console.print(line)
    if "default" in policies:
        by_dtype = np.array([results[seed_set][shape.name][f]["default"]["cpu_ms_per_dtype"] for f in families])
        console.print(f"  {shape.name} default CPU ms per call, median per family, slowest family: "
                      + ", ".join(f"{str(dt).removeprefix('torch.')} {v:.1f}" for dt, v in zip(DTYPES, by_dtype.max(axis=0))))


def _seed_text(seeds: tuple[int, ...]) -> str:
    """``(0, 1, 2, 7)`` -> ``0-2, 7``."""
    runs: list[list[int]] = []
    for x in seeds:
        if runs and x == runs[-1][-1] + 1:
            runs[-1].append(x)
        else:
            runs.append([x])
    return ", ".join(f"{r[0]}-{r[-1]}" if len(r) > 1 else str(r[0]) for r in runs)


def _per_seed_next_difference(raw: list[dict[str, dict[str, list]]]) -> np.ndarray:
    """``[seeds]`` ``migration_aware``'s mean next-window balance less ``default``'s, per seed: how much
    a cell of a few seeds can scatter (a three-seed cell's mean varies by the per-seed sd / sqrt(3))."""
    return np.array([np.concatenate(r["migration_aware"]["next"]).mean() - np.concatenate(r["default"]["next"]).mean()
                     for r in raw])


def _print_targets(console: Any, targets: list[dict[str, Any]]) -> None:
    from rich.table import Table

    if targets:
        t = Table(title="targets (held-out seeds)")
        for col in ("target", "value", "bound", "ok"):
            t.add_column(col)
        for row in targets:
            t.add_row(row["target"], str(row["value"]), row["bound"], {True: "yes", False: "NO", None: "n/a"}[row["ok"]])
        console.print(t)
        failed = [r for r in targets if r["ok"] is False]
        console.print(f"targets met: {sum(r['ok'] is True for r in targets)} / {len(targets)}; not met: {len(failed)}")


def _print_ilp(console: Any, ilp_rows: list[dict[str, Any]]) -> None:
    from rich.table import Table

    if ilp_rows:
        t = Table(title="exact optima on reduced shapes (held-out seed; balancedness)")
        for col in ("shape", "family", "layer", "default", "ILP best", "ILP proven upper", "counting bound", "proven"):
            t.add_column(col)
        for r in ilp_rows:
            t.add_row(r["shape"], r["family"], str(r["layer"]), f"{r['default']:.4f}", f"{r['ilp_best']:.4f}",
                      f"{r['ilp_upper']:.4f}", f"{r['counting_bound']:.4f}", "yes" if r["proven"] else "no")
        console.print(t)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.bench_algorithm", description=__doc__.splitlines()[0])
    ap.add_argument("--shape", default="ds-32,ds-64", help=f"comma list of {', '.join(SHAPES)}, or all (default: ds-32,ds-64)")
    ap.add_argument("--family", "--trace", dest="family", default="all", help=f"comma list of {', '.join(FAMILIES)}, or all")
    ap.add_argument("--policy", default="default,migration_aware", help=f"comma list of {', '.join(POLICIES)}, or all")
    ap.add_argument("--seeds", default="tune,held-out", help=f"comma list of {', '.join(SEEDS)} (default tune,held-out; targets: held-out)")
    ap.add_argument("--windows", type=int, default=4, help="rebalances per seed, each from the previous placement (default 4)")
    ap.add_argument("--repeat", type=int, default=2, help="timed calls per window and dtype; the fastest counts (default 2)")
    ap.add_argument("--smoothing", type=float, default=DEFAULT_SMOOTHING,
                    help="weight of the last window in the load estimate (eplb.estimate.smoothed_load); 1: the last "
                         f"window alone (default {DEFAULT_SMOOTHING})")
    ap.add_argument("--ilp", type=int, default=0, help="also solve this many layers per family exactly on reduced shapes")
    ap.add_argument("--ilp-time", type=float, default=20.0, help="HiGHS time limit per layer, s (default 20)")
    ap.add_argument("--json", type=Path, help="write every number here")
    args = ap.parse_args(argv)
    if args.windows < 1:
        raise SystemExit("--windows must be >= 1")
    if not 0.0 < args.smoothing <= 1.0:
        raise SystemExit("--smoothing must be in (0, 1]")
    shapes = _parse_list(args.shape, tuple(SHAPES), "shape")
    families = _parse_list(args.family, tuple(FAMILIES), "family")
    policies = _parse_list(args.policy, POLICIES, "policy")
    seed_sets = _parse_list(args.seeds, tuple(SEEDS), "seed set")
    if "migration_aware" in policies and "default" not in policies:
        policies.insert(0, "default")  # its copies are measured against default's
    torch.set_num_threads(1)

    from rich.console import Console

    console = Console(width=max(Console().width, 140))
    results: dict[str, dict[str, dict[str, dict[str, Any]]]] = {}
    started = time.perf_counter()
    for seed_set in seed_sets:
        for shape_name in shapes:
            _run_shape(console, results, args, seed_set, SHAPES[shape_name], families, policies)
    targets = check_targets(results)
    _print_targets(console, targets)
    ilp_rows = run_ilp(families, args.ilp, args.ilp_time) if args.ilp else []
    _print_ilp(console, ilp_rows)
    elapsed = time.perf_counter() - started
    console.print(f"{elapsed:.1f} s; reproduce: python -m bench.bench_algorithm --shape {','.join(shapes)} "
                  f"--family {','.join(families)} --policy {','.join(policies)} --seeds {','.join(seed_sets)} "
                  f"--windows {args.windows} --smoothing {args.smoothing}" + (f" --ilp {args.ilp}" if args.ilp else ""))
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        payload = {
            "config": {"shapes": {s: SHAPES[s].__dict__ for s in shapes}, "families": {f: FAMILIES[f].doc for f in families},
                       "policies": policies, "seeds": {s: SEEDS[s] for s in seed_sets}, "windows": args.windows,
                       "smoothing": args.smoothing,
                       "threads": torch.get_num_threads()},
            "results": results, "targets": targets, "ilp": ilp_rows, "elapsed_s": elapsed,
        }
        args.json.write_text(json.dumps(payload, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
