"""How good can a placement be? Lower bounds on the peak GPU load, and the exact optimum.

The placement problem of :mod:`eplb.algorithm`, per layer: ``L`` experts with loads ``w``,
``P`` slots on ``G`` GPUs (``S = P / G`` each). Choose replica counts ``c_e >= 1`` with
``sum c = P`` and put every replica in a slot; a replica of ``e`` carries ``w_e / c_e``. The
objective is the peak GPU load (balancedness is ``sum(w) / G / peak``, so the best balancedness
is ``sum(w) / G / OPT``).

- :func:`peak_lower_bound`: a proven lower bound on ``OPT`` that accounts for the packing
  (``S`` items per GPU), for every layer at once, in milliseconds.
- :func:`optimal_peak`: the exact optimum of one layer by integer programming (HiGHS through
  :func:`scipy.optimize.milp`), practical on reduced shapes (tens of experts, a few GPUs);
  with a time limit it returns HiGHS's dual bound, still a proven lower bound.

Both are pure (numpy in, numpy out); scipy is imported only by :func:`optimal_peak`.

Why the water-filling bound is not enough: it takes the best counts (the largest replica as
small as possible) and assumes the replicas pack perfectly. One expert carrying all the load on
64 GPUs with 320 slots gets 65 replicas of ``1/65`` each, and water-filling says balancedness
1.0; but 65 replicas on 64 GPUs put two on one GPU: the optimum is ``(1/64) / (2/65) = 0.51``.
"""

from __future__ import annotations

from typing import Any

import numpy as np

__all__ = ["peak_lower_bound", "optimal_peak", "feasible_by_counting"]

_EPS = 1e-9


def _min_counts(load: np.ndarray, t: np.ndarray) -> np.ndarray:
    """``[B, L]`` fewest replicas with every replica at most ``t [B]``: ``max(1, ceil(w / t))``
    (rounded in the lenient direction, so a bound built on it stays a bound)."""
    return np.maximum(1.0, np.ceil(load / t[:, None] - _EPS))


def feasible_by_counting(load: np.ndarray, num_replicas: int, num_gpus: int, t: np.ndarray) -> np.ndarray:
    """``[B]`` bool: can a placement of peak ``<= t`` exist, judged by necessary conditions only.

    ``False`` is a proof that the optimum is above ``t``; ``True`` proves nothing. Conditions:

    1. ``t >= sum(w) / G`` (the mean) and every replica ``<= t``, so expert ``e`` needs
       ``m_e = max(1, ceil(w_e / t))`` replicas and ``sum(m) <= P``;
    2. for ``k = 1 .. S - 1``: ``k + 1`` replicas above ``t / (k + 1)`` on one GPU exceed ``t``,
       so at most ``k * G`` replicas in the whole layer may be above ``t / (k + 1)``. An expert
       is *big* at level ``k`` with its ``m_e`` replicas (each counts ``1 / k`` of a GPU, ``m_e
       / k`` in all), or it spends ``n_e - m_e`` more slots (``n_e = ceil((k + 1) w_e / t)``)
       to make its replicas small. Which experts to make small is a knapsack over the spare
       slots ``P - sum(m)``; its fractional (LP) relaxation can only undercount the big
       replicas, so "more than ``G`` GPUs' worth of big replicas even so" proves infeasibility.

    Shapes: ``load [B, L]`` (float), ``t [B]`` -> ``[B]`` bool.
    """
    b, n = load.shape
    g = num_gpus
    s = num_replicas // g
    t = np.asarray(t, dtype=np.float64)
    ok = t * g >= load.sum(axis=1) * (1 - _EPS)
    m = _min_counts(load, np.maximum(t, 1e-300))
    spare = num_replicas - m.sum(axis=1)  # [B]
    ok &= spare >= 0
    for k in range(1, s):
        n_small = np.maximum(m, np.ceil((k + 1) * load / np.maximum(t, 1e-300)[:, None] - _EPS))
        big = n_small > m  # with m_e replicas, they are above t / (k + 1)
        cost = np.where(big, m / k, 0.0)  # GPUs' worth of big replicas
        extra = np.where(big, n_small - m, np.inf)  # slots to make e small
        # fractional knapsack: make small the experts with the most cost saved per slot first
        ratio = np.where(big, cost / extra, -1.0)
        order = np.argsort(-ratio, axis=1, kind="stable")
        ex = np.take_along_axis(extra, order, axis=1)
        co = np.take_along_axis(cost, order, axis=1)
        ex_f = np.where(np.isfinite(ex), ex, 0.0)
        before = np.cumsum(ex_f, axis=1) - ex_f  # slots used before this expert
        take = np.clip((spare[:, None] - before) / np.maximum(ex_f, 1e-300), 0.0, 1.0)
        take = np.where(np.isfinite(ex), take, 0.0)
        saved = (co * take).sum(axis=1)
        ok &= cost.sum(axis=1) - saved <= g * (1 + _EPS)
    return ok


def peak_lower_bound(load: np.ndarray, num_replicas: int, num_gpus: int, upper: np.ndarray | None = None, iters: int = 40) -> np.ndarray:
    """``[B]`` proven lower bound on the smallest achievable peak GPU load of each layer.

    Bisection on ``t`` between the mean GPU load (a bound) and ``upper`` (a peak that some
    placement reaches, e.g. the algorithm's; default ``sum(w)``), keeping ``lo`` at a ``t`` that
    :func:`feasible_by_counting` proves infeasible (or the mean): the conditions only get easier
    as ``t`` grows, so the optimum is above ``lo``. Also at least the water-filling bound (it is
    condition 1 of the same test). ``load [B, L]`` -> ``[B]``.
    """
    load = np.asarray(load, dtype=np.float64)
    mean = load.sum(axis=1) / num_gpus
    lo = mean.copy()
    hi = load.sum(axis=1) if upper is None else np.maximum(np.asarray(upper, dtype=np.float64), mean)
    for _ in range(iters):
        mid = (lo + hi) / 2
        ok = feasible_by_counting(load, num_replicas, num_gpus, mid)
        hi = np.where(ok, mid, hi)
        lo = np.where(ok, lo, mid)
    return lo


def optimal_peak(
    load: np.ndarray, num_replicas: int, num_gpus: int, *, upper: float | None = None, time_limit: float = 10.0
) -> tuple[float, float, bool]:
    """Exact optimum of one layer by a mixed-integer program (HiGHS via ``scipy.optimize.milp``).

    ``load [L]`` -> ``(best_peak, lower_bound, optimal)``: the best peak HiGHS found (``upper``
    when it found none better within ``time_limit``), its proven lower bound (equal to the best
    when ``optimal``), and whether optimality was proven. The LP relaxation of this model is the
    mean GPU load, so proofs come only on small layers (a few experts and GPUs); larger ones
    return good placements and the mean as the bound.

    Model: binary ``y[e, c]`` (expert ``e`` has ``c`` replicas, ``c`` up to ``P - L + 1``),
    integer ``x[e, c, g]`` (replicas of ``e`` on GPU ``g`` when it has ``c``), ``T`` the peak:

    - ``sum_c y[e, c] = 1``; ``sum_g x[e, c, g] = c * y[e, c]``;
    - ``sum_{e, c} x[e, c, g] = S`` (every GPU full);
    - ``sum_{e, c} (w_e / c) x[e, c, g] <= T``; minimize ``T``.

    ``c`` ranges are cut by counting: with ``upper`` (a peak some placement reaches) an expert
    needs ``c >= w_e / upper``. GPU loads are ordered (``load_g >= load_{g+1}``) to break the
    symmetry of identical GPUs.
    """
    from scipy.optimize import Bounds, LinearConstraint, milp

    w = np.asarray(load, dtype=np.float64).ravel()
    n, g, p, s = w.size, num_gpus, num_replicas, num_replicas // num_gpus
    total = w.sum()
    if total <= 0:
        return 0.0, 0.0, True
    scale = 1.0 / total  # solve in units of the layer total (better conditioned)
    ws = w * scale
    up = (upper if upper is not None else total) * scale
    extra = p - n
    # (e, c): an expert needs c >= w_e / upper replicas, and has at most one plus the extra slots
    options = [(e, c) for e in range(n) for c in range(max(1, int(np.ceil(ws[e] / up - 1e-9))), extra + 2)]
    n_opt = len(options)
    # variables: y[o] (n_opt), x[o, g] (n_opt * g), T
    n_var = n_opt + n_opt * g + 1
    ti = n_var - 1
    a, lo_b, hi_b = _peak_constraints(ws, options, g, s)
    cost = np.zeros(n_var)
    cost[ti] = 1.0
    integrality = np.ones(n_var)
    integrality[ti] = 0
    ub = np.concatenate([np.ones(n_opt), np.repeat([c for _, c in options], g).astype(float), [up * (1 + 1e-9)]])
    lb = np.concatenate([np.zeros(n_opt + n_opt * g), [ws.sum() / g]])
    res = milp(
        cost,
        constraints=LinearConstraint(a.tocsr(), lo_b, hi_b),
        integrality=integrality,
        bounds=Bounds(lb, ub),
        options={"time_limit": time_limit, "disp": False, "mip_rel_gap": 1e-6},
    )
    best = float(res.x[ti]) / scale if res.x is not None else (upper if upper is not None else total)
    dual = getattr(res, "mip_dual_bound", None)
    bound = float(dual) / scale if dual is not None and np.isfinite(dual) else w.sum() / g
    optimal = res.status == 0
    if optimal:
        bound = min(bound, best) if dual is not None else best
    return best, bound, optimal


def _peak_constraints(ws: np.ndarray, options: list[tuple[int, int]], g: int, s: int) -> tuple[Any, np.ndarray, np.ndarray]:
    """The rows of :func:`optimal_peak`'s model over ``[y (options), x (options x g), T]``: one count per
    expert, replicas placed = count chosen, ``s`` slots per GPU, GPU load <= T, GPU loads ordered."""
    from scipy.sparse import lil_matrix

    n, n_opt = ws.size, len(options)
    n_var = n_opt + n_opt * g + 1
    ti = n_var - 1
    rows = n + n_opt + g + g + (g - 1)
    a = lil_matrix((rows, n_var))
    lo_b = np.zeros(rows)
    hi_b = np.zeros(rows)
    r = 0
    for e in range(n):  # one count per expert
        for o, (ee, _) in enumerate(options):
            if ee == e:
                a[r, o] = 1.0
        lo_b[r] = hi_b[r] = 1.0
        r += 1
    for o, (_, c) in enumerate(options):  # replicas placed = count chosen
        a[r, o] = -float(c)
        for gg in range(g):
            a[r, n_opt + o * g + gg] = 1.0
        r += 1
    for gg in range(g):  # S slots per GPU
        for o in range(n_opt):
            a[r, n_opt + o * g + gg] = 1.0
        lo_b[r] = hi_b[r] = float(s)
        r += 1
    for gg in range(g):  # GPU load <= T
        for o, (e, c) in enumerate(options):
            a[r, n_opt + o * g + gg] = ws[e] / c
        a[r, ti] = -1.0
        lo_b[r], hi_b[r] = -np.inf, 0.0
        r += 1
    for gg in range(g - 1):  # symmetry: load_g >= load_{g+1}
        for o, (e, c) in enumerate(options):
            a[r, n_opt + o * g + gg] = ws[e] / c
            a[r, n_opt + o * g + gg + 1] = -ws[e] / c
        lo_b[r], hi_b[r] = 0.0, np.inf
        r += 1
    return a, lo_b, hi_b
