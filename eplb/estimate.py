"""The load the next window will bring, estimated from the windows so far.

A placement is fitted to an estimate of the load and serves the next window. The last window
alone carries its own sampling noise (a token count ``c`` varies by about ``sqrt(c)`` from
window to window), and a placement fitted to it is fitted to that noise too. An exponential
average of the windows, ``e_t = a * w_t + (1 - a) * e_{t-1}``, keeps the noise of ``a / (2 - a)``
windows' worth (``a = 1``: the last window) at the price of following a moving load with a lag of
``(1 - a) / a`` windows. ``a`` is chosen on the bench's tune seeds (``docs/design.md``).

Pure: tensors in, tensors out.
"""

from __future__ import annotations

import torch

__all__ = ["smoothed_load", "smoothed_noise"]


def _check_weight(weight: float) -> float:
    if isinstance(weight, bool) or not isinstance(weight, (int, float)) or not 0.0 < float(weight) <= 1.0:
        raise ValueError(f"the smoothing weight must be a number in (0, 1], got {weight!r}")
    return float(weight)


_CHI2_MEDIAN = 0.4549  # median of a chi-squared variable with one degree of freedom


def smoothed_load(previous: torch.Tensor | None, window: torch.Tensor, weight: float, *, adaptive: bool = True) -> torch.Tensor:
    """``a * window + (1 - a) * previous`` as float64 (``window`` alone when ``previous`` is
    ``None``, or when its shape differs: a model of another shape starts over).

    ``window`` ``[layers, experts]`` is the last window's load in token counts (any real or
    integer dtype); ``previous`` the estimate this returned for the window before. ``a`` is
    ``weight``, or with ``adaptive`` per layer ``min(1, weight * D)`` where ``D >= 1`` says how far
    the window moved from the estimate beyond sampling noise: the median over the layer's experts
    of ``(window - previous) ** 2 / (smoothed_noise(weight) * mean)``, over its value for pure
    noise (a median, so a few experts' one-window spike does not count as the load moving). A
    layer whose hot set moved follows its last window; a stationary one keeps the average."""
    a = _check_weight(weight)
    w = window.detach().to("cpu", torch.float64)
    if previous is None or previous.shape != w.shape or a == 1.0:
        return w.clone()
    prev = previous.detach().to("cpu", torch.float64)
    weights = torch.full((w.shape[0], 1), a, dtype=torch.float64)
    if adaptive and w.shape[1] > 0:
        scale = (smoothed_noise(a) * ((w + prev) / 2).clamp(min=1.0))
        moved = ((w - prev) ** 2 / scale).median(dim=1).values / _CHI2_MEDIAN
        weights = (a * moved.clamp(min=1.0)).clamp(max=1.0).unsqueeze(1)
    return weights * w + (1.0 - weights) * prev


def smoothed_noise(weight: float) -> float:
    """Variance of (next window - estimate), per unit of load, for token counts of a stationary
    load: the next window's own ``1`` plus the estimate's ``a / (2 - a)``, i.e. ``2 / (2 - a)``
    (``2`` for the last window alone). ``migration_aware`` takes it as its ``noise`` option to
    judge which gains beat the noise."""
    a = _check_weight(weight)
    return 2.0 / (2.0 - a)
