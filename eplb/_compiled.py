"""Compiled kernels of :mod:`eplb.algorithm` (numba): the sequential parts, one layer at a time.

Every function here is ``@numba.njit(cache=True)``: compiled on first use and cached on disk
(next to this file in ``__pycache__``, or under ``NUMBA_CACHE_DIR``), so a later process loads the
machine code instead of compiling. Inputs are plain numpy arrays; nothing here allocates per
step beyond small scratch arrays.
"""

from __future__ import annotations

import numba
import numpy as np


@numba.njit(cache=True)
def _add_replica(w, e, t, counts, slot_load, slot_expert, used, gl):  # pragma: no cover - compiled
    """One more replica of expert ``e``, in GPU ``t``'s next free slot: every replica of ``e``
    carries ``w[e] / (counts[e] + 1)`` from now on, and the GPUs holding one follow."""
    c = counts[e]
    newp = w[e] / (c + 1)
    old = w[e] / c
    for x in range(gl.shape[0]):
        for j in range(used[x]):
            if slot_expert[x, j] == e:
                slot_load[x, j] = newp
                gl[x] += newp - old
    slot_load[t, used[t]] = newp
    slot_expert[t, used[t]] = e
    used[t] += 1
    gl[t] += newp
    counts[e] = c + 1


@numba.njit(cache=True)
def _bfd_one(w, order, g, s, cap, slot_load, slot_expert):  # pragma: no cover - compiled
    """Best-fit-decreasing packing of one layer under a peak ``cap``; fills ``slot_* [G, S]``,
    returns the peak. See :func:`bfd_pack`."""
    n = w.shape[0]
    p = g * s
    gl = np.zeros(g)
    used = np.zeros(g, np.int64)
    counts = np.zeros(n, np.int64)
    pick = np.empty(g, np.int64)
    # the GPUs with a free slot, ascending by load (all empty: any order)
    srt = np.arange(g)
    pos = np.arange(g)
    m = g
    free_total = p
    for idx in range(n):
        e = order[idx]
        we = w[e]
        placed = _bfd_choose(we, gl, srt, m, min(m, free_total - (n - idx - 1)), cap, pick)
        piece = we / placed
        for j in range(placed):
            h = pick[j]
            slot_load[h, used[h]] = piece
            slot_expert[h, used[h]] = e
            used[h] += 1
            gl[h] += piece
        m = _bfd_resort(pick, placed, gl, used, s, srt, pos, m)
        counts[e] = placed
        free_total -= placed
    _bfd_fill_free(w, g, s, free_total, counts, slot_load, slot_expert, used, gl)
    return gl.max()


@numba.njit(cache=True)
def _bfd_choose(we, gl, srt, m, kk, cap, pick):  # pragma: no cover - compiled
    """Where an expert of load ``we`` goes (:func:`_bfd_one`): its replicas' GPUs in ``pick``, their count returned.
    ``srt[:m]``: the GPUs with a free slot, ascending by load; at most ``kk`` replicas."""
    if we <= 0.0:
        # zero load (the rest are too): the heaviest GPU with room (the light ones keep
        # theirs for the replicas added below)
        pick[0] = srt[m - 1]
        return 1
    if gl[srt[0]] + we <= cap:
        # one replica: the fullest GPU it fits under the cap (best fit): binary search
        a, b = 0, m  # srt[:a] fits, srt[b:] does not
        while a < b:
            mid = (a + b) // 2
            if gl[srt[mid]] + we <= cap:
                a = mid + 1
            else:
                b = mid
        pick[0] = srt[a - 1]
        return 1
    # k equal replicas fit iff the k-th lightest GPU with room takes one: the fewest such
    # k, each replica to the fullest GPU it fits (best fit again); if no k fits, the k
    # lightest GPUs, the k with the lowest peak (k = 1 included)
    placed = 0
    best_k = 1
    best_peak = gl[srt[0]] + we
    for k in range(2, kk + 1):
        pk = gl[srt[k - 1]] + we / k
        if pk <= cap:
            placed = k
            break
        if pk < best_peak:
            best_peak = pk
            best_k = k
    if placed:
        piece = we / placed
        top = placed
        while top < m and gl[srt[top]] + piece <= cap:
            top += 1
        for j in range(placed):
            pick[j] = srt[top - 1 - j]
        return placed
    for j in range(best_k):
        pick[j] = srt[j]
    return best_k


@numba.njit(cache=True)
def _bfd_resort(pick, placed, gl, used, s, srt, pos, m):  # pragma: no cover - compiled
    """Keep ``srt[:m]`` sorted (:func:`_bfd_one`): each GPU that took a replica moves right past the
    lighter ones (its load only grew); a full one leaves (moved to the end first). Returns the new ``m``."""
    for j in range(placed):
        h = pick[j]
        z = pos[h]
        full = used[h] >= s
        while z + 1 < m and (full or gl[srt[z + 1]] < gl[h]):
            srt[z] = srt[z + 1]
            pos[srt[z]] = z
            z += 1
        srt[z] = h
        pos[h] = z
        if full:
            m -= 1
    return m


@numba.njit(cache=True)
def _bfd_fill_free(w, g, s, free_total, counts, slot_load, slot_expert, used, gl):  # pragma: no cover - compiled
    """The slots left (:func:`_bfd_one`): a replica of the largest replica's expert on the heaviest GPU,
    on the lightest GPU with room that lacks it, while that lowers the peak; else a replica of the
    lightest expert (per replica) on the lightest GPU with room."""
    n = w.shape[0]
    while free_total > 0:
        h = 0
        for x in range(1, g):
            if gl[x] > gl[h]:
                h = x
        done = False
        bi = -1  # the largest replica on h
        for j in range(used[h]):
            if bi < 0 or slot_load[h, j] > slot_load[h, bi]:
                bi = j
        if bi >= 0:
            e = slot_expert[h, bi]
            newp = w[e] / (counts[e] + 1)
            t = -1
            for x in range(g):
                if used[x] < s and (t < 0 or gl[x] < gl[t]):
                    has = False
                    for j in range(used[x]):
                        if slot_expert[x, j] == e:
                            has = True
                            break
                    if not has:
                        t = x
            if t >= 0 and gl[t] + newp < gl[h]:
                _add_replica(w, e, t, counts, slot_load, slot_expert, used, gl)
                free_total -= 1
                done = True
        if not done:
            t = -1
            for x in range(g):
                if used[x] < s and (t < 0 or gl[x] < gl[t]):
                    t = x
            e = 0
            for x in range(1, n):
                if w[x] * counts[e] < w[e] * counts[x]:
                    e = x
            _add_replica(w, e, t, counts, slot_load, slot_expert, used, gl)
            free_total -= 1


@numba.njit(cache=True)
def bfd_pack(load, g, s, caps, swap_steps, stop_at):  # pragma: no cover - compiled
    """Best-fit-decreasing packings, the best of several caps per layer.

    ``load [R, L]`` float64, ``caps [K]`` peak caps as multiples of the mean GPU load. For each cap
    ``C``: experts in descending load, each to the GPU with a free slot that it fills closest to
    ``C`` without passing it (best fit); an expert that fits nowhere is split into the fewest
    equal replicas (on distinct GPUs) that fit, as far as the slots allow (every expert still to
    come keeps a slot); if none fits, the split among the lightest GPUs with the lowest peak.
    Slots left at the end take replicas of the heaviest GPU's largest replica while that lowers
    the peak (else of the lightest expert). Returns ``(slot_load [R, G, S], slot_expert [R, G, S],
    peak [R])`` of the best cap per layer."""
    r, n = load.shape
    out_load = np.zeros((r, g, s))
    out_expert = np.zeros((r, g, s), np.int64)
    peaks = np.full(r, np.inf)
    sl = np.zeros((g, s))
    se = np.zeros((g, s), np.int64)
    for i in range(r):
        w = load[i]
        order = np.argsort(-w, kind="mergesort")
        mean = w.sum() / g
        for k in range(caps.shape[0]):
            pk = _bfd_one(w, order, g, s, caps[k] * mean, sl, se)
            if swap_steps > 0:
                pk = _swap_one(sl, se, swap_steps, mean / stop_at)
            if pk < peaks[i]:
                peaks[i] = pk
                out_load[i] = sl
                out_expert[i] = se
    return out_load, out_expert, peaks


@numba.njit(cache=True)
def _swap_one(slot_load, slot_expert, max_steps, stop_below):  # pragma: no cover - compiled
    """Swaps for one layer (``slot_* [G, S]`` in place) until the peak is at most ``stop_below``,
    no swap lowers it, or ``max_steps``: each step the heaviest GPU makes its best swap with any
    other GPU (the lowest resulting peak of the pair), never putting an expert twice on a GPU.
    Returns the peak."""
    g, s = slot_load.shape
    gl = np.zeros(g)
    lo = np.empty(g)  # each GPU's lightest and heaviest slot
    hi = np.empty(g)
    for x in range(g):
        for j in range(s):
            gl[x] += slot_load[x, j]
        _slot_range(slot_load, x, lo, hi)
    order = np.argsort(gl, kind="mergesort")  # ascending load, kept sorted below
    for _ in range(max_steps):
        h = order[g - 1]
        peak = gl[h]
        if peak <= stop_below:
            break
        bx, bi, bj = _heaviest_swap(slot_load, slot_expert, gl, order, h, peak, lo, hi)
        if bx < 0:
            break
        li, lj = slot_load[h, bi], slot_load[bx, bj]
        ei, ej = slot_expert[h, bi], slot_expert[bx, bj]
        slot_load[h, bi], slot_load[bx, bj] = lj, li
        slot_expert[h, bi], slot_expert[bx, bj] = ej, ei
        gl[h] += lj - li
        gl[bx] += li - lj
        _slot_range(slot_load, h, lo, hi)
        _slot_range(slot_load, bx, lo, hi)
        # re-sort: h got lighter (moves left; it was last), bx heavier (moves right; it is among the
        # lightest, so the search from the left finds it soon)
        _resort_from(order, gl, g - 1)
        _resort_one(order, gl, bx)
    return gl.max()


@numba.njit(cache=True)
def _slot_range(slot_load, x, lo, hi):  # pragma: no cover - compiled
    """``lo[x]`` / ``hi[x]``: the lightest and heaviest slot of GPU ``x``."""
    a = slot_load[x, 0]
    b = a
    for j in range(1, slot_load.shape[1]):
        v = slot_load[x, j]
        if v < a:
            a = v
        if v > b:
            b = v
    lo[x] = a
    hi[x] = b


@numba.njit(cache=True)
def _heaviest_swap(slot_load, slot_expert, gl, order, h, peak, lo, hi):  # pragma: no cover - compiled
    """The heaviest GPU ``h``'s best swap (:func:`_swap_one`): ``(x, i, j)``, slot ``i`` of ``h`` for slot
    ``j`` of ``x``, the lowest resulting peak of the pair below ``peak``; ``(-1, -1, -1)`` if none.
    ``lo`` / ``hi``: each GPU's lightest and heaviest slot, to skip a slot ``i`` no slot of ``x`` can
    pair with (every ``d`` at most 0, at least the gap, or too small to lower the peak below the
    best so far: the same tests as the scan's, on the extreme ``d``, so the choice is unchanged)."""
    g, s = slot_load.shape
    best = peak * (1.0 - 1e-12)
    bx, bi, bj = -1, -1, -1
    # lightest GPUs first: a swap with x leaves the pair at least at (peak + load_x) / 2, so
    # once that reaches the best swap found, no heavier GPU can beat it
    for xi in range(g - 1):
        x = order[xi]
        if 0.5 * (peak + gl[x]) >= best:
            break
        gap = peak - gl[x]
        # x ends at gl[x] + d, below best only for d < best - gl[x] (less than the gap; the margin
        # is far above rounding, so every skipped slot would have failed the scan's own test)
        room = best - gl[x] + 1e-12 * peak
        for i in range(s):
            li = slot_load[h, i]
            if li <= 0.0 or li <= lo[x] or li - hi[x] >= room or peak - (li - lo[x]) >= best:
                continue
            ei = slot_expert[h, i]
            for j in range(s):
                d = li - slot_load[x, j]
                if d <= 0.0 or d >= gap:
                    continue
                new = peak - d if peak - d > gl[x] + d else gl[x] + d
                if new >= best:
                    continue
                ej = slot_expert[x, j]
                ok = True
                for t in range(s):
                    if (t != j and slot_expert[x, t] == ei) or (t != i and slot_expert[h, t] == ej):
                        ok = False
                        break
                if ok:
                    best = new
                    bx, bi, bj = x, i, j
    return bx, bi, bj


@numba.njit(cache=True)
def _resort_one(order, gl, y):  # pragma: no cover - compiled
    """Move GPU ``y`` to its place in ``order`` (ascending ``gl``) after its load changed."""
    z = 0
    while order[z] != y:
        z += 1
    _resort_from(order, gl, z)


@numba.njit(cache=True)
def _resort_from(order, gl, z):  # pragma: no cover - compiled
    """Move the GPU at ``order[z]`` to its place in ``order`` (ascending ``gl``) after its load changed."""
    g = order.shape[0]
    y = order[z]
    while z > 0 and gl[order[z - 1]] > gl[y]:
        order[z] = order[z - 1]
        z -= 1
    while z + 1 < g and gl[order[z + 1]] < gl[y]:
        order[z] = order[z + 1]
        z += 1
    order[z] = y


@numba.njit(cache=True)
def swap_refine(slot_load, slot_expert, max_steps, stop_at):  # pragma: no cover - compiled
    """:func:`_swap_one` on every layer of ``slot_* [R, G, S]`` (in place); layer ``i`` stops at
    balancedness ``stop_at[i]``. Returns the peaks ``[R]``."""
    r, g, _ = slot_load.shape
    peaks = np.empty(r)
    for i in range(r):
        mean = slot_load[i].sum() / g
        peaks[i] = _swap_one(slot_load[i], slot_expert[i], max_steps, mean / stop_at[i])
    return peaks


@numba.njit(cache=True)
def fill_pack(item_load, item_expert, g, max_per_round):  # pragma: no cover - compiled
    """The packing of :func:`eplb.algorithm._fill_pack`: replicas ``item_* [B, P]`` in descending
    load onto ``G`` GPUs with ``S = P / G`` slots each. The first ``G`` one per GPU; then rounds of
    ``G``: a GPU's ``k``-th free slot of the round counts as its load plus ``k`` mean replicas of
    the round, and the round's replicas go, heaviest first, to the ``G`` lowest such slots (a GPU
    takes at most ``max_per_round`` of a round while the others have room for the rest). Once
    only zero loads are left, they fill the free slots in order. Returns ``(slot_load,
    slot_expert)`` ``[B, G, S]``."""
    b, p = item_load.shape
    s = p // g
    slot_load = np.zeros((b, g, s))
    slot_expert = np.zeros((b, g, s), np.int64)
    loads = np.empty(g)
    filled = np.empty(g, np.int64)
    head = np.zeros(s, np.int64)
    added = np.zeros(g)
    took = np.zeros(g, np.int64)
    for r in range(b):
        for h in range(g):
            slot_load[r, h, 0] = item_load[r, h]
            slot_expert[r, h, 0] = item_expert[r, h]
            loads[h] = item_load[r, h]
            filled[h] = 1
        for start in range(g, p, g):
            if item_load[r, start] <= 0.0:
                # only zero loads left: any free slot will do
                q = start
                for h in range(g):
                    for j in range(filled[h], s):
                        slot_load[r, h, j] = 0.0
                        slot_expert[r, h, j] = item_expert[r, q]
                        q += 1
                break
            _fill_round(item_load[r], item_expert[r], start, s, max_per_round, loads, filled, head, added, took,
                        slot_load[r], slot_expert[r])
    return slot_load, slot_expert


@numba.njit(cache=True)
def _fill_round(item_load, item_expert, start, s, max_per_round, loads, filled, head, added, took,
                slot_load, slot_expert):  # pragma: no cover - compiled
    """One round of :func:`fill_pack` on one layer: the ``G`` replicas from ``start`` go, heaviest
    first, to the ``G`` lowest keys (a GPU's load plus ``k`` mean replicas for its ``k``-th free slot)."""
    g = loads.shape[0]
    tot = 0.0
    top = 0.0
    for j in range(start, start + g):
        tot += item_load[j]
    for h in range(g):
        if loads[h] > top:
            top = loads[h]
    step = max(tot / g, 1e-9 * (top + 1.0))
    room = 0
    for h in range(g):
        room += min(s - filled[h], max_per_round)
    kmax = max_per_round if room >= g else s
    # the G lowest keys: with the GPUs by load (stable), the keys of each k are in that
    # order, so merge the kmax runs (ties: the lower k first); loads change after the round
    order = np.argsort(loads, kind="mergesort")
    for k in range(kmax):
        head[k] = 0
    for i in range(g):
        bk = -1
        bkey = np.inf
        for k in range(kmax):
            x = head[k]
            while x < g and filled[order[x]] + k >= s:
                x += 1
            head[k] = x
            if x < g and loads[order[x]] + k * step < bkey:
                bkey = loads[order[x]] + k * step
                bk = k
        h = order[head[bk]]
        head[bk] += 1
        j = filled[h] + bk
        slot_load[h, j] = item_load[start + i]
        slot_expert[h, j] = item_expert[start + i]
        added[h] += item_load[start + i]
        took[h] += 1
    for h in range(g):
        loads[h] += added[h]
        filled[h] += took[h]
        added[h] = 0.0
        took[h] = 0


@numba.njit(cache=True)
def _holdings(se, n):  # pragma: no cover - compiled
    """``se [G, S]`` -> ``(cnt [n], hc [G, n])``: each expert's replicas, and its replicas on each GPU."""
    g, s = se.shape
    cnt = np.zeros(n, np.int64)
    hc = np.zeros((g, n), np.int64)
    for x in range(g):
        for t in range(s):
            cnt[se[x, t]] += 1
            hc[x, se[x, t]] += 1
    return cnt, hc


@numba.njit(cache=True)
def _fill_holdings(se, cnt, hc):  # pragma: no cover - compiled
    """:func:`_holdings` into ``cnt`` and ``hc``, which are zero (see :func:`_clear_holdings`)."""
    g, s = se.shape
    for x in range(g):
        for t in range(s):
            cnt[se[x, t]] += 1
            hc[x, se[x, t]] += 1


@numba.njit(cache=True)
def _clear_holdings(se, cnt, hc):  # pragma: no cover - compiled
    """Zero ``cnt`` and ``hc`` where :func:`_fill_holdings` of ``se`` (as it is now) wrote: cheaper
    than a new ``[G, L]`` array per layer."""
    g, s = se.shape
    for x in range(g):
        for t in range(s):
            cnt[se[x, t]] = 0
            hc[x, se[x, t]] = 0


@numba.njit(cache=True)
def copies_vs(carried, p2l, g, n):  # pragma: no cover - compiled
    """``[B]`` (GPU, expert) pairs of ``p2l [B, P]`` that ``carried [B, P]`` (``-1``: an empty slot)
    lacks, both ``g`` GPUs of ``P / g`` slots: the copies that make ``p2l`` from ``carried``."""
    b, p = p2l.shape
    s = p // g
    out = np.zeros(b, np.int64)
    mark = np.full(n, -1, np.int64)  # mark[e] = r * 2g + x: e is on GPU x of layer r (old), or + g: counted (new)
    for r in range(b):
        for x in range(g):
            old = (r * 2 + 0) * g + x
            new = (r * 2 + 1) * g + x
            for t in range(x * s, (x + 1) * s):
                e = carried[r, t]
                if e >= 0:
                    mark[e] = old
            for t in range(x * s, (x + 1) * s):
                e = p2l[r, t]
                if mark[e] != old and mark[e] != new:
                    mark[e] = new
                    out[r] += 1
    return out


@numba.njit(cache=True)
def logical_to_physical(p2l, counts, width):  # pragma: no cover - compiled
    """``[B, L * width]`` slots of each expert in ascending order, ``-1`` padded, from
    ``p2l [B, P]`` and its replica counts ``counts [B, L]`` (at most ``width`` each)."""
    b, p = p2l.shape
    n = counts.shape[1]
    out = np.empty((b, n * width), np.int64)
    nxt = np.empty(n, np.int64)
    for r in range(b):
        row = out[r]
        row[:] = -1  # one pass (a fill of all-ones bytes), then the slots over it
        for e in range(n):
            nxt[e] = e * width
        for t in range(p):
            e = p2l[r, t]
            row[nxt[e]] = t
            nxt[e] += 1
    return out


@numba.njit(cache=True)
def keep_idle(p2l, carried, idle, g):  # pragma: no cover - compiled
    """Re-seat the idle experts (``idle [R, L]``, no load) of ``p2l [R, P]`` (in place) among the
    slots they fill, each where ``carried [R, P]`` (``-1``: an empty slot) holds it when that GPU
    has such a slot, the rest in the slots left (on a GPU without that expert where one is free).
    An idle expert already on a GPU where ``carried`` holds it stays. The replica counts and every
    GPU's load stay as they are: only which zero-load expert sits in which zero-load slot changes,
    so no more of them are copies (with at most one replica of an idle expert per GPU)."""
    rows, p = p2l.shape
    n = idle.shape[1]
    s = p // g
    pool = np.zeros(n, np.int64)  # replicas of each idle expert to re-seat
    seated = np.full(n, -1, np.int64)  # the last GPU an idle expert was seated on
    held = np.full(n, -1, np.int64)  # held[e] == x: the carried placement has e on GPU x (for the GPU being read)
    for r in range(rows):
        for x in range(g):  # 0. an idle expert already where the carried placement holds it stays
            for u in range(x * s, (x + 1) * s):
                if carried[r, u] >= 0:
                    held[carried[r, u]] = r * g + x
            for t in range(x * s, (x + 1) * s):
                e = p2l[r, t]
                if idle[r, e] and held[e] != r * g + x:
                    pool[e] += 1
                    p2l[r, t] = -1  # open
                    seated[e] = -1
        for x in range(g):  # 1. where the carried placement holds them
            for u in range(x * s, (x + 1) * s):
                e = carried[r, u]
                if e < 0 or not idle[r, e] or pool[e] == 0 or seated[e] == x:
                    continue
                for t in range(x * s, (x + 1) * s):
                    if p2l[r, t] < 0:
                        p2l[r, t] = e
                        pool[e] -= 1
                        seated[e] = x
                        break
        for e in range(n):  # 2. the rest: open slots in order, on a GPU without e if one is open
            while pool[e] > 0:
                pick = -1
                for t in range(p):
                    if p2l[r, t] < 0:
                        x = t // s
                        dup = False
                        for u in range(x * s, (x + 1) * s):
                            if p2l[r, u] == e:
                                dup = True
                                break
                        if not dup:
                            pick = t
                            break
                        if pick < 0:
                            pick = -2 - t  # a slot on a GPU that holds e: only if nothing else
                if pick <= -2:
                    pick = -2 - pick
                p2l[r, pick] = e
                pool[e] -= 1
    return p2l


@numba.njit(cache=True)
def _pairwise(a, lo, n):  # pragma: no cover - compiled
    """``a[lo:lo + n].sum()`` for ``n <= 128``, added in numpy's order (its pairwise summation: eight
    partial sums), so the result is numpy's to the bit. Not recursive: a recursive function loaded
    from numba's cache crashed (numba 0.68)."""
    if n < 8:
        res = 0.0
        for i in range(n):
            res += a[lo + i]
        return res
    if n <= 128:
        r0, r1, r2, r3 = a[lo], a[lo + 1], a[lo + 2], a[lo + 3]
        r4, r5, r6, r7 = a[lo + 4], a[lo + 5], a[lo + 6], a[lo + 7]
        i = 8
        while i < n - (n % 8):
            r0 += a[lo + i]
            r1 += a[lo + i + 1]
            r2 += a[lo + i + 2]
            r3 += a[lo + i + 3]
            r4 += a[lo + i + 4]
            r5 += a[lo + i + 5]
            r6 += a[lo + i + 6]
            r7 += a[lo + i + 7]
            i += 8
        res = ((r0 + r1) + (r2 + r3)) + ((r4 + r5) + (r6 + r7))
        while i < n:
            res += a[lo + i]
            i += 1
        return res
    raise ValueError("_pairwise: more than 128 items (numpy splits them in halves; not done here)")


@numba.njit(cache=True)
def _mean_over_peak(per, gl, g, s):  # pragma: no cover - compiled
    """Mean GPU load over the peak, the GPUs' loads ``gl [g]`` summed from ``per`` (each slot's
    load, ``s`` slots a GPU) as numpy sums them (:func:`_pairwise`); 1 where the peak is 0."""
    peak = -np.inf
    for x in range(g):
        gl[x] = _pairwise(per, x * s, s)
        if gl[x] > peak:
            peak = gl[x]
    mean = _pairwise(gl, 0, g) / g
    return mean / max(peak, 1e-300) if peak > 0 else 1.0


@numba.njit(cache=True)
def balancedness(p2l, load, g):  # pragma: no cover - compiled
    """``[B]`` mean GPU load over the peak of ``p2l [B, P]`` on ``load [B, L]`` (float64; 1 where the
    peak is 0), as numpy computes it (``eplb.algorithm._balancedness``), bit for bit; at most 128
    GPUs and 128 slots per GPU (:func:`_pairwise`)."""
    b, p = p2l.shape
    n = load.shape[1]
    s = p // g
    out = np.empty(b)
    cnt = np.zeros(n, np.int64)
    per = np.empty(p)
    gl = np.empty(g)
    for r in range(b):
        for t in range(p):
            cnt[p2l[r, t]] += 1
        if s < 8:  # a GPU's slots added one after another, as _pairwise adds fewer than 8
            peak = -np.inf
            for x in range(g):
                acc = 0.0
                for t in range(x * s, (x + 1) * s):
                    acc += load[r, p2l[r, t]] / max(cnt[p2l[r, t]], 1)
                gl[x] = acc
                if acc > peak:
                    peak = acc
            mean = _pairwise(gl, 0, g) / g
            out[r] = mean / max(peak, 1e-300) if peak > 0 else 1.0
        else:
            for t in range(p):
                per[t] = load[r, p2l[r, t]] / max(cnt[p2l[r, t]], 1)
            out[r] = _mean_over_peak(per, gl, g, s)
        for t in range(p):
            cnt[p2l[r, t]] = 0
    return out


@numba.njit(cache=True)
def gate_draws(real, z, noise_var):  # pragma: no cover - compiled
    """``[K, B, L]`` next windows drawn around ``real [B, L]`` (float64): ``max(real + z * sqrt(noise_var
    * real), 0)`` with the normals ``z [K, B, L]`` (float32), as numpy computes it
    (``eplb.algorithm._MoveGate``) elementwise, so equal to the bit, without its temporaries."""
    k, b, n = z.shape
    out = np.empty((k, b, n))
    sd = np.empty(n)
    for r in range(b):
        for e in range(n):
            sd[e] = np.sqrt(noise_var * real[r, e])
        for d in range(k):
            for e in range(n):
                v = real[r, e] + np.float64(z[d, r, e]) * sd[e]
                out[d, r, e] = v if v >= 0.0 else 0.0
    return out


@numba.njit(cache=True)
def on_draws(p2l, draws, g):  # pragma: no cover - compiled
    """``[B]`` mean over ``draws [K, B, L]`` (float64) of the balancedness of ``p2l [B, P]``, as numpy
    computes it (``eplb.algorithm._on_draws``); at most 128 GPUs, 128 slots per GPU and 128 draws
    (:func:`_pairwise`). numpy's own sums over the slots run in an order that depends on its
    gathered array's layout (one after another with several draws), so the two may differ in the
    last bits."""
    k, b, n = draws.shape
    p = p2l.shape[1]
    s = p // g
    out = np.empty(b)
    cnt = np.zeros(n, np.int64)
    per = np.empty(p)
    gl = np.empty(g)
    bal = np.empty(k)
    inv = np.empty(p)
    for r in range(b):
        for t in range(p):
            cnt[p2l[r, t]] += 1
        for t in range(p):  # each slot's share of its expert, once per layer
            inv[t] = 1.0 / max(cnt[p2l[r, t]], 1)
        for d in range(k):
            if s < 8:  # a GPU's slots added one after another, as _pairwise adds fewer than 8
                peak = -np.inf
                for x in range(g):
                    acc = 0.0
                    for t in range(x * s, (x + 1) * s):
                        acc += draws[d, r, p2l[r, t]] * inv[t]
                    gl[x] = acc
                    if acc > peak:
                        peak = acc
                mean = _pairwise(gl, 0, g) / g
                bal[d] = mean / max(peak, 1e-300) if peak > 0 else 1.0
                continue
            for t in range(p):
                per[t] = draws[d, r, p2l[r, t]] * inv[t]
            bal[d] = _mean_over_peak(per, gl, g, s)
        out[r] = _pairwise(bal, 0, k) / k
        for t in range(p):
            cnt[p2l[r, t]] = 0
    return out


@numba.njit(cache=True)
def take_counts(slot_expert, load, target):  # pragma: no cover - compiled
    """Replace moves (one copy each) that give every layer of ``slot_expert [R, G, S]`` (in place)
    the replica counts ``target [R, L]`` (same total): each step the short expert with the largest
    load per replica gains a replica in a slot of an expert with more than its target, on a GPU
    that does not hold it, choosing the slot whose move leaves the lowest peak and, among peaks
    equal to 1e-12 of it (sums in another order differ in the last bits), the lowest sum of
    squared GPU loads. An expert no such slot can take stays short. Returns the moves per layer.

    Kept between steps: the short and the surplus experts (ascending; an expert only ever leaves
    either list), each surplus expert's rise of load per replica, and each expert's holders (GPUs
    ascending, each once), and each GPU's load (summed again only where a move changed a slot or an
    expert's load per replica: elsewhere the same sum of the same terms, to the bit)."""
    rows, g, s = slot_expert.shape
    n = load.shape[1]
    moves = np.zeros(rows, np.int64)
    cnt = np.zeros(n, np.int64)
    hc = np.zeros((g, n), np.int64)
    pl = np.empty(n)
    stuck = np.zeros(n, np.bool_)
    gle = np.empty(g)
    gsum = np.empty(g)  # each GPU's load, sum of pl over its slots in slot order
    m1 = np.empty(n)
    i1 = np.empty(n, np.int64)
    m2 = np.empty(n)
    ssf = np.empty(n)
    top = np.empty(g, np.int64)
    rs = np.empty(n)  # a surplus expert's rise of load per replica once it loses one
    sur = np.empty(n, np.int64)  # the surplus experts, ascending
    short = np.empty(n, np.int64)  # the short experts, ascending
    hl = np.empty((n, g), np.int64)  # each expert's holders, GPUs ascending
    hn = np.zeros(n, np.int64)
    sl = np.empty(g * s, np.int64)  # the slots of surplus experts, x * S + k ascending (_best_take)
    for r in range(rows):
        w = load[r]
        se = slot_expert[r]
        tr = target[r]
        _fill_holdings(se, cnt, hc)
        ns = 0
        nsh = 0
        for x in range(n):
            stuck[x] = False
            hn[x] = 0
            if cnt[x] > 0:
                pl[x] = w[x] / cnt[x]
            if cnt[x] > tr[x]:
                rs[x] = w[x] / (cnt[x] - 1) - w[x] / cnt[x]
                sur[ns] = x
                ns += 1
            elif cnt[x] < tr[x]:
                short[nsh] = x
                nsh += 1
        nsl = 0
        for x in range(g):
            for k in range(s):
                f = se[x, k]
                if cnt[f] > tr[f]:
                    sl[nsl] = x * s + k
                    nsl += 1
                if hn[f] == 0 or hl[f, hn[f] - 1] != x:
                    hl[f, hn[f]] = x
                    hn[f] += 1
        for x in range(g):
            gsum[x] = _gpu_load(pl, se, x)
        while True:
            e = -1
            best = -1.0
            for q in range(nsh):
                x = short[q]
                if not stuck[x] and pl[x] > best:
                    best = pl[x]
                    e = x
            if e < 0:
                break
            per_e = pl[e]
            new_e = w[e] / (cnt[e] + 1)
            for x in range(g):  # the GPU loads once e has one more replica (not yet placed)
                gle[x] = gsum[x] - (per_e - new_e) * hc[x, e]
            _surplus_peaks(hc, gle, m1, i1, m2, ssf, top, rs, sur, ns, cnt, hl, hn)
            bx, bk, nsl = _best_take(tr, cnt, pl, hc, se, gle, m1, i1, m2, ssf, e, new_e, rs, sl, nsl)
            if bx < 0:
                stuck[e] = True
                continue
            f = se[bx, bk]
            se[bx, bk] = e
            cnt[e] += 1
            cnt[f] -= 1
            pl[e] = w[e] / cnt[e]
            pl[f] = w[f] / cnt[f]
            hc[bx, e] += 1
            hc[bx, f] -= 1
            moves[r] += 1
            _hl_insert(hl, hn, e, bx)  # bx did not hold e
            if hc[bx, f] == 0:
                _hl_remove(hl, hn, f, bx)
            gsum[bx] = _gpu_load(pl, se, bx)  # the loads that changed: bx's, and every holder of e or f
            for z in range(hn[e]):
                gsum[hl[e, z]] = _gpu_load(pl, se, hl[e, z])
            for z in range(hn[f]):
                gsum[hl[f, z]] = _gpu_load(pl, se, hl[f, z])
            if cnt[e] == tr[e]:
                nsh = _list_remove(short, nsh, e)
            if cnt[f] == tr[f]:
                ns = _list_remove(sur, ns, f)
            else:
                rs[f] = w[f] / (cnt[f] - 1) - w[f] / cnt[f]
        _clear_holdings(se, cnt, hc)
    return moves


@numba.njit(cache=True)
def _list_remove(lst, m, v):  # pragma: no cover - compiled
    """``v`` leaves the first ``m`` entries of ``lst`` (order kept); returns the new length."""
    z = 0
    while lst[z] != v:
        z += 1
    for q in range(z, m - 1):
        lst[q] = lst[q + 1]
    return m - 1


@numba.njit(cache=True)
def _hl_insert(hl, hn, e, x):  # pragma: no cover - compiled
    """GPU ``x`` joins expert ``e``'s holders (ascending)."""
    z = hn[e]
    while z > 0 and hl[e, z - 1] > x:
        hl[e, z] = hl[e, z - 1]
        z -= 1
    hl[e, z] = x
    hn[e] += 1


@numba.njit(cache=True)
def _hl_remove(hl, hn, f, x):  # pragma: no cover - compiled
    """GPU ``x`` leaves expert ``f``'s holders."""
    z = 0
    while hl[f, z] != x:
        z += 1
    for q in range(z, hn[f] - 1):
        hl[f, q] = hl[f, q + 1]
    hn[f] -= 1


@numba.njit(cache=True)
def _surplus_peaks(hc, gle, m1, i1, m2, ssf, top, rs, sur, ns, cnt, hl, hn):  # pragma: no cover - compiled
    """For :func:`take_counts`: per surplus expert ``f`` (``sur [ns]``), its holders' loads once it
    loses a replica: the highest two GPU loads (``m1``, ``m2``; where the highest is, ``i1``, the
    lowest such GPU on a tie), so a candidate slot's GPU can be left out, and the change of the sum
    of squared GPU loads (``ssf``). Only ``f``'s holders change: they are met in ascending order
    (``hl [L, *]``, ``hn``: as a sum over all GPUs adds them), and the others' highest two are the
    first two non-holders of the GPUs ordered by load (``top``, as many as needed). ``rs[f]``: the
    rise of ``f``'s load per replica."""
    g = gle.shape[0]
    most = 0
    for q in range(ns):
        f = sur[q]
        a1 = -np.inf
        a2 = -np.inf
        j1 = -1
        acc = 0.0
        rise = rs[f]
        if cnt[f] > most:
            most = cnt[f]
        for z in range(hn[f]):
            x = hl[f, z]
            v = gle[x] + rise * hc[x, f]
            acc += v * v - gle[x] * gle[x]
            if v > a1 or (v == a1 and x < j1):
                a2 = a1
                a1 = v
                j1 = x
            elif v > a2:
                a2 = v
        m1[f] = a1
        m2[f] = a2
        i1[f] = j1
        ssf[f] = acc
    # the heaviest GPUs by load (ties: the lower index first), enough to pass every holder
    m = min(g, most + 2)
    c = 0
    for x in range(g):
        v = gle[x]
        if c == m and v <= gle[top[m - 1]]:
            continue
        j = c if c < m else m - 1
        while j > 0 and gle[top[j - 1]] < v:
            top[j] = top[j - 1]
            j -= 1
        top[j] = x
        if c < m:
            c += 1
    for q in range(ns):
        f = sur[q]
        taken = 0
        for j in range(c):
            x = top[j]
            if hc[x, f] > 0:
                continue
            v = gle[x]
            if v > m1[f] or (v == m1[f] and x < i1[f]):
                m2[f] = m1[f]
                m1[f] = v
                i1[f] = x
            elif v > m2[f]:
                m2[f] = v
            taken += 1
            if taken == 2:
                break


@numba.njit(cache=True)
def _best_take(target, cnt, pl, hc, se, gle, m1, i1, m2, ssf, e, new_e, rs, sl, nsl):  # pragma: no cover - compiled
    """For :func:`take_counts`: the slot ``(x, k)`` of a surplus expert, on a GPU without ``e``, whose
    move to ``e`` leaves the lowest peak (ties: the lowest sum of squares); ``(-1, -1)`` if none.
    ``rs``: each surplus expert's rise of load per replica (:func:`_surplus_peaks`). ``sl [nsl]``:
    the slots ``x * S + k`` that held a surplus expert at the last step, ascending (the order of a
    scan of every slot); those that no longer do leave it (a slot's expert only ever stops being
    in surplus). Returns ``(x, k, the list's new length)``."""
    s = se.shape[1]
    bpeak = np.inf
    bload = np.inf
    bx = -1
    bk = -1
    kept = 0
    for z in range(nsl):
        q = sl[z]
        x = q // s
        k = q - x * s
        f = se[x, k]
        if cnt[f] <= target[f]:
            continue
        sl[kept] = q
        kept += 1
        if hc[x, e] > 0:
            continue
        per_f = pl[f]
        rise = rs[f]
        here = gle[x] - per_f + new_e + rise * (hc[x, f] - 1)
        others = m2[f] if i1[f] == x else m1[f]
        pk = max(here, others)
        tie = abs(pk - bpeak) <= 1e-12 * max(abs(bpeak), 1.0)
        if not tie and pk >= bpeak:  # neither lower nor tied: its sum of squares does not matter
            continue
        old = gle[x] + rise * hc[x, f]
        dss = ssf[f] - (old * old - gle[x] * gle[x]) + (here * here - gle[x] * gle[x])
        if (pk < bpeak and not tie) or (tie and dss < bload):
            bpeak = pk
            bload = dss
            bx = x
            bk = k
    return bx, bk, kept


@numba.njit(cache=True)
def _add_greedily(w, counts, allowed, cap, left):  # pragma: no cover - compiled
    """``left`` more replicas, one at a time, each to the allowed expert with the largest load per
    replica ``w / counts`` under ``cap`` (the lowest id on a tie); ``counts`` in place. Stops
    early when no expert can take one."""
    for _ in range(left):
        best = -np.inf
        pick = -1
        for e in range(w.shape[0]):
            if allowed[e] and counts[e] < cap and w[e] / counts[e] > best:
                best = w[e] / counts[e]
                pick = e
        if pick < 0:
            return
        counts[pick] += 1

@numba.njit(cache=True)
def _greedy_level(w, base, room, extra, steps):  # pragma: no cover - compiled
    """The level ``t`` (bisected ``steps`` times from ``max(w) + 1`` down) at which the replicas
    greedy replication adds above ``base``, ``min(max(floor(w / t) - base, 0), room)`` each (every
    marginal load per replica above ``t``), fit in ``extra``."""
    lo = 0.0
    hi = w.max() + 1.0
    for _ in range(steps):
        mid = (lo + hi) / 2
        m = max(mid, 1e-300)
        added = 0.0
        for e in range(w.shape[0]):
            added += min(max(np.floor(w[e] / m) - base[e], 0.0), room[e])
        if added <= extra:
            hi = mid
        else:
            lo = mid
    return hi


@numba.njit(cache=True)
def replica_counts(load, num_slots, cap):  # pragma: no cover - compiled
    """Greedy replication's counts ``[X, n]`` (each extra slot to the expert with the largest
    load per replica, the lowest id on a tie, at most ``cap`` each; ``cap * n >= num_slots``):
    bisect for the level above which every marginal ``w / k`` is taken, then take the few left
    one at a time. The arithmetic of :func:`eplb.algorithm._replica_counts`, one row at a time."""
    rows, n = load.shape
    counts = np.ones((rows, n), np.int64)
    everyone = np.ones(n, np.bool_)
    none = np.zeros(n, np.int64)
    room = np.full(n, cap - 1, np.int64)
    for r in range(rows):
        w = load[r]
        hi = _greedy_level(w, none, room, num_slots - n, 14)
        left = num_slots
        for e in range(n):
            counts[r, e] = 1 + np.int64(min(max(np.floor(w[e] / hi), 0.0), room[e]))
            left -= counts[r, e]
        _add_greedily(w, counts[r], everyone, cap, left)
    return counts


@numba.njit(cache=True)
def add_replicas(load, counts, extra, allowed, cap):  # pragma: no cover - compiled
    """``counts [R, L]`` plus ``extra [R]`` replicas as greedy replication would add them (each to
    the allowed expert with the largest load per replica, at most ``cap`` each); a new array.
    The arithmetic of :func:`eplb.algorithm._add_replicas`, one row at a time."""
    rows, n = load.shape
    out = counts.copy()
    room = np.zeros(n, np.int64)
    for r in range(rows):
        w = load[r]
        if extra[r] <= 0:
            continue
        for e in range(n):
            room[e] = max(0, cap - counts[r, e]) if allowed[r, e] else 0
        hi = _greedy_level(w, counts[r], room, extra[r], 12)
        left = extra[r]
        for e in range(n):
            out[r, e] = counts[r, e] + np.int64(min(max(np.floor(w[e] / hi) - counts[r, e], 0.0), room[e]))
            left -= out[r, e] - counts[r, e]
        _add_greedily(w, out[r], allowed[r], cap, left)
    return out


@numba.njit(cache=True)
def repair_counts(load, counts, half, num_gpus, max_iters):  # pragma: no cover - compiled
    """Replica trades (in place) until at most ``num_gpus`` replicas weigh more than ``half [R]``
    (half a GPU's mean load): the arithmetic of :func:`eplb.algorithm._repair_counts`, one row at
    a time (a row's trades depend on that row alone)."""
    rows, n = load.shape
    for r in range(rows):
        w = load[r]
        c = counts[r]
        h = half[r]
        for _ in range(max_iters):
            above = 0
            for e in range(n):
                if w[e] / c[e] > h:
                    above += c[e]
            if above <= num_gpus:
                break
            recv = -1
            best = -np.inf
            for e in range(n):
                per = w[e] / c[e]
                if per > h and w[e] / (c[e] + 1) <= h and c[e] < num_gpus:
                    v = c[e] + per / max(2.0 * h, 1e-300)
                    if v > best:
                        best = v
                        recv = e
            if recv < 0:
                break
            don = -1
            low = np.inf
            for e in range(n):
                grown = w[e] / max(c[e] - 1, 1)
                if e != recv and c[e] >= 2 and grown <= 1.6 * h and grown < low:
                    low = grown
                    don = e
            if don < 0:
                break
            if w[don] / c[don] > h:
                d_big = 1
            elif low > h:
                d_big = 1 - c[don]
            else:
                d_big = 0
            if c[recv] + d_big <= 0:
                break
            c[recv] += 1
            c[don] -= 1
    return counts


@numba.njit(cache=True)
def _layer_loads(pl, se, gl):  # pragma: no cover - compiled
    """GPU loads ``gl [G]`` of one layer ``se [G, S]`` with load per replica ``pl [L]`` (``w / cnt``)."""
    g, s = se.shape
    for x in range(g):
        acc = 0.0
        for k in range(s):
            acc += pl[se[x, k]]
        gl[x] = acc


@numba.njit(cache=True)
def _sift(order, pos, gl, y):  # pragma: no cover - compiled
    """Move GPU ``y`` to its place in ``order`` (ascending ``gl``, ties by index: a stable argsort)
    after its load changed, every other GPU in place; ``pos`` is the inverse of ``order``."""
    g = order.shape[0]
    z = pos[y]
    v = gl[y]
    while z > 0 and (gl[order[z - 1]] > v or (gl[order[z - 1]] == v and order[z - 1] > y)):
        order[z] = order[z - 1]
        pos[order[z]] = z
        z -= 1
    while z + 1 < g and (gl[order[z + 1]] < v or (gl[order[z + 1]] == v and order[z + 1] < y)):
        order[z] = order[z + 1]
        pos[order[z]] = z
        z += 1
    order[z] = y
    pos[y] = z


@numba.njit(cache=True)
def _heaviest_lightest(gl, order, k, light):  # pragma: no cover - compiled
    """From ``order`` (GPUs by ascending ``gl``, ties by index): the heaviest GPU ``h`` (the lowest
    index on a tie, as ``np.argmax``), and ``light [k]``, the ``k`` lightest in ascending load, ties
    by index, ``h`` where it lands replaced by the lightest."""
    g = order.shape[0]
    z = g - 1
    top = gl[order[z]]
    while z > 0 and gl[order[z - 1]] == top:
        z -= 1
    h = order[z]
    for j in range(k):
        light[j] = order[j] if order[j] != h else order[0]
    return h


@numba.njit(cache=True)
def _best_replace(w, cnt, pl, hc, hold, se, gl, h, light, pref, prefer_share, base, f_peak):  # pragma: no cover - compiled
    """:func:`improve`'s best replace move of one step: ``(estimate, slot on h, candidate)``;
    ``-1`` for none (no candidate, or with ``pref`` none that lowers the peak). ``hold [L, *]``:
    the GPU of each replica of each expert (the first ``cnt`` entries); ``base / f_peak``: scratch
    ``[len(light) * S]``."""
    g, s = se.shape
    peak = gl[h]
    nl = light.shape[0]
    # per candidate slot: what its GPU and the other holders of its expert f carry once f loses it
    for j in range(nl):
        x = light[j]
        for t in range(s):
            q = j * s + t
            f = se[x, t]
            cf, wf = cnt[f], w[f]
            lq = pl[f]
            base[q] = gl[x] - lq
            f_peak[q] = np.inf
            if cf >= 2:
                # the heaviest holder of f other than x (GPUs counted once; the lowest index
                # first on a tie, as a scan of the GPUs in order finds it)
                m1, i1, m2 = -np.inf, -1, -np.inf
                for k in range(cf):
                    y = hold[f, k]
                    if y == i1:
                        continue
                    v = gl[y]
                    if v > m1 or (v == m1 and y < i1):
                        m2, m1, i1 = m1, v, y
                    elif v > m2:
                        m2 = v
                top = m2 if i1 == x else m1
                f_peak[q] = top + min(wf / (cf - 1) - lq, 1e300)
    best_est, chosen, best_adj, bi, bq = np.inf, np.inf, np.inf, -1, -1
    use_pref = pref.shape[0] > 0
    thr = peak * (1 - 1e-12)
    c = prefer_share * peak
    # candidates that cannot beat the best so far are skipped (est >= h_new and est >= f_peak[q],
    # exactly, and adj is monotone in est), so the choice is the one of the full scan
    for i in range(s):
        e = se[h, i]
        we, ce = w[e], cnt[e]
        h_new = peak - pl[e] + we / (ce + 1)
        share = we / (ce + 1)
        pen_e = 1.0 if use_pref and ce >= pref[e] else 0.0
        if use_pref:
            if h_new >= thr or h_new + c * pen_e >= best_adj:
                continue
        elif h_new >= best_est:
            continue
        for j in range(nl):
            x = light[j]
            if hc[x, e] > 0:
                continue
            for t in range(s):
                q = j * s + t
                if not use_pref:
                    if f_peak[q] >= best_est:
                        continue
                    est = max(max(h_new, base[q] + share), f_peak[q])
                    if est < best_est:
                        best_est, bi, bq = est, i, q
                else:
                    if f_peak[q] >= thr:
                        continue
                    est = max(max(h_new, base[q] + share), f_peak[q])
                    if est < thr:
                        f = se[x, t]
                        pen = pen_e + (1.0 if cnt[f] <= pref[f] else 0.0)
                        adj = est + c * pen
                        if adj < best_adj:
                            best_adj, chosen, bi, bq = adj, est, i, q
    return (chosen if use_pref else best_est), bi, bq


@numba.njit(cache=True)
def _best_swap(pl, hc, se, gl, h, light, bound):  # pragma: no cover - compiled
    """:func:`improve`'s best swap of one step: ``(estimate, slot on h, candidate)``, among those
    whose estimate is below ``bound`` (none: ``(bound, -1, -1)``)."""
    s = se.shape[1]
    peak = gl[h]
    best, bi, bq = bound, -1, -1
    # skipped: a slot i with peak - le >= best (d <= le), a GPU x with (peak + gl[x]) / 2 >= best
    # (less a margin for rounding): neither can beat the best so far, so the choice is unchanged
    for i in range(s):
        e = se[h, i]
        le = pl[e]
        if peak - le >= best:
            continue
        for j in range(light.shape[0]):
            x = light[j]
            if hc[x, e] > 0:
                continue
            glx = gl[x]
            if 0.5 * (peak + glx) * (1.0 - 1e-12) >= best:
                continue
            for t in range(s):
                f = se[x, t]
                if hc[h, f] > 0:
                    continue
                d = le - pl[f]
                est = max(peak - d, glx + d)
                if est < best:
                    best, bi, bq = est, i, j * s + t
    return best, bi, bq


@numba.njit(cache=True)
def improve(slot_expert, load, target_peak, budget, max_steps, width, prefer, prefer_share, trace):  # pragma: no cover - compiled
    """``migration_aware``'s greedy moves, per layer of ``slot_expert [R, G, S]`` (in place), until
    the peak is at most ``target_peak [R]``, the layer's ``budget [R]`` of copies is spent, no move
    lowers the peak or ``max_steps`` moves are made. Each step, the heaviest GPU ``h`` against the
    ``width`` lightest: a replace (1 copy: a slot of a light GPU whose expert ``f`` has >= 2
    replicas takes an expert of ``h`` the GPU lacks) or a swap (2 copies), the largest drop of the
    peak per copy on an estimate of the touched GPUs' loads; with ``prefer [R, L]`` (``[R, 0]``:
    none) a replace that copies an expert with no fewer replicas than preferred, or evicts one with
    no more, ranks as if ``prefer_share`` of the peak higher, each (among those that lower the
    peak). A move is kept only if every GPU it changed ends below the old peak, recomputed exactly.
    With ``trace [R, T, 2]`` (``T`` 0: none), ``trace[r, j]`` is the peak and the copies made after
    ``j`` moves (``j`` 0: the start; left as given after the last move), the last column after the
    last move where there were more (so a target it does not reach costs at most its copies): the
    path does not depend on ``target_peak`` or ``budget``, which only stop it, so a looser target
    stops at a prefix of it. Returns the copies made per layer."""
    rows, g, s = slot_expert.shape
    n = load.shape[1]
    k = max(1, min(width, g - 1))
    made = np.zeros(rows, np.int64)
    gl = np.empty(g)
    gl_new = np.empty(g)
    base = np.empty(k * s)
    f_peak = np.empty(k * s)
    light = np.empty(k, np.int64)
    order = np.empty(g, np.int64)
    pos = np.empty(g, np.int64)
    cnt = np.zeros(n, np.int64)
    hc = np.zeros((g, n), np.int64)
    pl = np.empty(n)
    hold = np.empty((n, max(1, g * s - n + 1)), np.int64)  # an expert has at most P - L + 1 replicas
    for r in range(rows):
        w = load[r]
        se = slot_expert[r]
        pref = prefer[r]
        left = budget[r]
        if not np.isfinite(target_peak[r]) or left < 1:
            continue
        _fill_holdings(se, cnt, hc)
        for e in range(n):
            if cnt[e] > 0:
                pl[e] = w[e] / cnt[e]
            cnt[e] = 0
        for y in range(g):  # the holder lists, cnt counted again
            for t in range(s):
                e = se[y, t]
                hold[e, cnt[e]] = y
                cnt[e] += 1
        _layer_loads(pl, se, gl)
        order[:] = np.argsort(gl, kind="mergesort")  # kept sorted as loads change (_sift)
        for z in range(g):
            pos[order[z]] = z
        if trace.shape[1] > 0:
            trace[r, 0, 0] = gl[order[g - 1]]
            trace[r, 0, 1] = 0.0
        for step in range(max_steps):
            h = _heaviest_lightest(gl, order, k, light)
            peak = gl[h]
            if peak <= target_peak[r] * (1 + 1e-12):
                break
            est_r, ri, rq = _best_replace(w, cnt, pl, hc, hold, se, gl, h, light, pref, prefer_share, base, f_peak)
            gain_r = peak - est_r if ri >= 0 else -np.inf
            gain_s = -np.inf
            si, sq = -1, -1
            if left >= 2:
                # a swap is taken only if gain_s / 2 > gain_r: any estimate at or above this
                # bound loses to the replace (a margin far above rounding), so it bounds the scan
                bound = peak - 2.0 * gain_r + 1e-12 * max(peak, 1.0) if ri >= 0 else np.inf
                est_s, si, sq = _best_swap(pl, hc, se, gl, h, light, bound)
                gain_s = peak - est_s if si >= 0 else -np.inf
            swap = gain_s / 2 > gain_r
            if (gain_s if swap else gain_r) <= 1e-12 * max(peak, 1.0):
                break
            i, q = (si, sq) if swap else (ri, rq)
            x, t = light[q // s], q % s
            e, f = se[h, i], se[x, t]
            if not _apply_move(w, cnt, pl, hc, hold, se, gl, gl_new, h, i, x, t, swap, peak):
                break  # undone, and this layer stops
            # the GPU loads after the move, as _layer_loads computes them: the GPUs _moved_loads
            # summed again take their new loads one at a time, each put in its place in order
            _take_load(gl, gl_new, order, pos, h)
            _take_load(gl, gl_new, order, pos, x)
            if not swap:
                for z in range(cnt[e]):
                    _take_load(gl, gl_new, order, pos, hold[e, z])
                for z in range(cnt[f]):
                    _take_load(gl, gl_new, order, pos, hold[f, z])
            cost = 2 if swap else 1
            left -= cost
            made[r] += cost
            if trace.shape[1] > 1:
                col = min(step + 1, trace.shape[1] - 1)
                trace[r, col, 0] = gl[order[g - 1]]
                trace[r, col, 1] = made[r]
            if left < 1:
                break
        _clear_holdings(se, cnt, hc)
    return made


@numba.njit(cache=True)
def _take_load(gl, gl_new, order, pos, y):  # pragma: no cover - compiled
    """GPU ``y`` takes its load from ``gl_new`` and its place in ``order`` (:func:`_sift`)."""
    if gl[y] != gl_new[y]:
        gl[y] = gl_new[y]
        _sift(order, pos, gl, y)


@numba.njit(cache=True)
def _hold_swap(hold, cnt, e, a, b):  # pragma: no cover - compiled
    """One replica of ``e`` in ``hold`` moves from GPU ``a`` to GPU ``b``."""
    for k in range(cnt[e]):
        if hold[e, k] == a:
            hold[e, k] = b
            return


@numba.njit(cache=True)
def _hold_drop(hold, cnt, e, a):  # pragma: no cover - compiled
    """One replica of ``e`` on GPU ``a`` leaves ``hold`` (the last entry takes its place; ``cnt``
    is decreased by the caller)."""
    last = cnt[e] - 1
    for k in range(cnt[e]):
        if hold[e, k] == a:
            hold[e, k] = hold[e, last]
            return


@numba.njit(cache=True)
def _gpu_load(pl, se, y):  # pragma: no cover - compiled
    """GPU ``y``'s load, summed as :func:`_layer_loads` sums it."""
    acc = 0.0
    for k in range(se.shape[1]):
        acc += pl[se[y, k]]
    return acc


@numba.njit(cache=True)
def _moved_loads(pl, se, hold, cnt, gl, gl_new, h, x, e, f, swap, peak):  # pragma: no cover - compiled
    """``gl_new``: the loads of the GPUs a move changed, summed again (``h``, ``x`` and, for a
    replace, every holder of ``e`` and ``f``; the others' loads are unchanged, bit for bit, and
    ``gl_new`` is not written there). Returns whether the move is kept: ``h``'s load changed and
    no GPU whose load changed ends at or above ``peak``."""
    tol = 1e-9 * max(peak, 1.0)
    top = peak * (1 - 1e-12)
    gl_new[h] = _gpu_load(pl, se, h)
    ok = abs(gl_new[h] - gl[h]) > tol
    ok &= _below(gl, gl_new, h, tol, top)
    gl_new[x] = _gpu_load(pl, se, x)
    ok &= _below(gl, gl_new, x, tol, top)
    if not swap:
        for k in range(cnt[e]):
            y = hold[e, k]
            gl_new[y] = _gpu_load(pl, se, y)
            ok &= _below(gl, gl_new, y, tol, top)
        for k in range(cnt[f]):
            y = hold[f, k]
            gl_new[y] = _gpu_load(pl, se, y)
            ok &= _below(gl, gl_new, y, tol, top)
    return ok


@numba.njit(cache=True)
def _below(gl, gl_new, y, tol, top):  # pragma: no cover - compiled
    """GPU ``y``'s new load is unchanged (within ``tol``) or below ``top``."""
    return not (abs(gl_new[y] - gl[y]) > tol and gl_new[y] >= top)


@numba.njit(cache=True)
def _apply_move(w, cnt, pl, hc, hold, se, gl, gl_new, h, i, x, t, swap, peak):  # pragma: no cover - compiled
    """For :func:`improve`: slot ``t`` of GPU ``x`` takes the expert in slot ``i`` of ``h`` (and gives
    its own back, a ``swap``); kept (True) only if every GPU it changed ends below the old ``peak``,
    recomputed exactly, else undone (False). ``pl`` (load per replica, ``w / cnt``) and ``hold``
    (each expert's holders) are kept up to date."""
    e, f = se[h, i], se[x, t]
    se[x, t] = e
    if swap:
        se[h, i] = f
        _hold_swap(hold, cnt, e, h, x)
        _hold_swap(hold, cnt, f, x, h)
    else:
        hold[e, cnt[e]] = x
        _hold_drop(hold, cnt, f, x)
        cnt[e] += 1
        cnt[f] -= 1
        pl[e] = w[e] / cnt[e]
        pl[f] = w[f] / cnt[f]
    ok = _moved_loads(pl, se, hold, cnt, gl, gl_new, h, x, e, f, swap, peak)
    if not ok:  # undo
        se[x, t] = f
        if swap:
            se[h, i] = e
            _hold_swap(hold, cnt, e, x, h)
            _hold_swap(hold, cnt, f, h, x)
        else:
            _hold_drop(hold, cnt, e, x)
            hold[f, cnt[f]] = x
            cnt[e] -= 1
            cnt[f] += 1
            pl[e] = w[e] / cnt[e]
            pl[f] = w[f] / cnt[f]
        return False
    hc[x, e] += 1
    hc[x, f] -= 1
    if swap:
        hc[h, f] += 1
        hc[h, e] -= 1
    return True


@numba.njit(cache=True)
def sorted_items(per, order, counts, p):  # pragma: no cover - compiled
    """The replicas ``[B, P]`` in descending load, ``(item_load, item_expert)``, from each expert's load
    per replica ``per [B, L]``, its order ``order [B, L]`` (numpy's ``argsort(-per)``: ties as numpy
    breaks them) and its replicas ``counts [B, L]``: expert ``order[r, k]`` repeated ``counts`` times,
    as ``eplb.algorithm._sorted_items`` built them with ``np.repeat`` (``p``: the replicas of a layer)."""
    b, n = per.shape
    item_load = np.empty((b, p))
    item_expert = np.empty((b, p), np.int64)
    for r in range(b):
        q = 0
        for k in range(n):
            e = order[r, k]
            v = per[r, e]
            for _ in range(counts[r, e]):
                item_load[r, q] = v
                item_expert[r, q] = e
                q += 1
    return item_load, item_expert


@numba.njit(cache=True)
def moved_counts(load, counts, slot_load, slot_expert, rows, gpu_load, top, above):  # pragma: no cover - compiled
    """``eplb.algorithm._moved_counts`` on the layers ``rows`` of ``slot_* [B, G, S]``: for the heaviest
    GPU, and the next ones in ``top [R, W]`` (numpy's order of ``-gpu_load``) while above ``above [R]``,
    the expert of its largest replica that may gain one (fewer than ``G`` replicas, none lost) gains
    one, and the expert that loses least by giving one (smallest ``w / (c - 1)``, not gained) gives
    it. ``load [R, L]`` and ``counts [R, L]`` are the rows' own; the same choices, first maxima and
    minima, as the numpy version. Returns ``(counts [R, L], moved [R])``."""
    nr, n = load.shape
    g = slot_load.shape[1]
    s = slot_load.shape[2]
    width = top.shape[1]
    c = counts.copy()
    moved = np.zeros(nr, np.bool_)
    gained = np.zeros(n, np.bool_)
    lost = np.zeros(n, np.bool_)
    for i in range(nr):
        row = rows[i]
        for e in range(n):
            gained[e] = False
            lost[e] = False
        for j in range(width):
            h = top[i, j]
            # the largest replica of h whose expert may gain one (np.argmax: the first maximum)
            best = -1.0
            k_best = 0
            for k in range(s):
                e = slot_expert[row, h, k]
                v = slot_load[row, h, k] if (c[i, e] < g and not lost[e]) else -1.0
                if k == 0 or v > best:
                    best = v
                    k_best = k
            recv = slot_expert[row, h, k_best]
            # the donor: the smallest w / (c - 1) among experts with two replicas or more, not
            # gained, not the receiver (np.argmin: the first minimum; all inf -> 0, then refused)
            don = 0
            low = np.inf
            for e in range(n):
                if c[i, e] >= 2 and not gained[e] and e != recv:
                    w = load[i, e] / max(c[i, e] - 1, 1)
                else:
                    w = np.inf
                if e == 0 or w < low:
                    low = w
                    don = e
            go = best >= 0 and np.isfinite(low)
            if j > 0:
                go = go and gpu_load[i, h] > above[i]
            if go:
                c[i, recv] += 1
                c[i, don] -= 1
                gained[recv] = True
                lost[don] = True
                moved[i] = True
    return c, moved

