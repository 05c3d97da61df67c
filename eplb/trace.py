"""Seeded synthetic load traces: how many tokens each logical expert gets, per layer and step.

Loads are token counts from top-k routing: every token picks ``top_k`` *distinct* experts,
sampled without replacement from the step's expert probabilities (Gumbel top-k, which is
exactly Plackett-Luce sampling). The same ``(seed, step, rank)`` always gives the same
counts, whatever was sampled before, so every process can replay any part of a trace.

Kinds:

- ``zipf``: per layer a fixed random ranking of experts with weights ``1 / (i + 1) ** s``;
  the exponent ``s`` of each layer is spread evenly over ``zipf_exponent`` (a range).
- ``drift``: Zipf, but the ranking is redrawn every ``drift_period`` steps (hot experts move).
- ``burst``: Zipf plus, for ``burst_length`` steps every ``burst_every`` steps, ``burst_experts``
  experts whose weight is multiplied by ``burst_factor``.
- ``uniform``: every expert equally likely.

Pure: no I/O.
"""

from __future__ import annotations

import hashlib
from typing import Literal

import torch
from pydantic import BaseModel, ConfigDict, Field, model_validator

__all__ = ["TraceConfig", "LoadTrace", "PhasedTrace", "seed_for"]


def seed_for(*parts: int | str) -> int:
    """A stable 63-bit seed from any parts (Python's ``hash`` is salted per process)."""
    digest = hashlib.blake2b("/".join(map(str, parts)).encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") & ((1 << 63) - 1)


class TraceConfig(BaseModel):
    """One load regime. Scenarios chain several of them as phases."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    kind: Literal["zipf", "drift", "burst", "uniform"] = "zipf"
    zipf_exponent: tuple[float, float] = Field((0.6, 1.4), description="per-layer exponents spread over [lo, hi]")
    top_k: int = Field(2, ge=1)
    tokens_per_step: int = Field(64, ge=1, description="tokens each rank routes per step")
    drift_period: int = Field(50, ge=1)
    burst_experts: int = Field(2, ge=1)
    burst_factor: float = Field(20.0, ge=1.0)
    burst_every: int = Field(100, ge=1)
    burst_length: int = Field(10, ge=1)
    seed: int = 0

    @model_validator(mode="after")
    def _check(self) -> TraceConfig:
        lo, hi = self.zipf_exponent
        if not (0.0 <= lo <= hi):
            raise ValueError(f"zipf_exponent must be a range 0 <= lo <= hi, got {self.zipf_exponent}")
        if self.burst_length > self.burst_every:
            raise ValueError("burst_length must not exceed burst_every")
        return self


class LoadTrace:
    """A trace for one model shape. ``probabilities(step)`` is ``[layers, L]``; counts are int64."""

    def __init__(self, config: TraceConfig, num_layers: int, num_logical: int):
        if config.top_k > num_logical:
            raise ValueError(f"top_k={config.top_k} exceeds the {num_logical} logical experts")
        self.config = config
        self.num_layers = num_layers
        self.num_logical = num_logical
        self._rankings: dict[int, torch.Tensor] = {}
        lo, hi = config.zipf_exponent
        self._exponents = (torch.linspace(lo, hi, num_layers, dtype=torch.float64) if num_layers > 1
                           else torch.tensor([lo], dtype=torch.float64))

    def _ranking(self, epoch: int) -> torch.Tensor:
        """``[layers, L]``: expert ids from hottest to coldest for this epoch (cached)."""
        cached = self._rankings.get(epoch)
        if cached is not None:
            return cached
        if len(self._rankings) > 8:
            self._rankings.clear()
        self._rankings[epoch] = ranking = self._draw_ranking(epoch)
        return ranking

    def _draw_ranking(self, epoch: int) -> torch.Tensor:
        g = torch.Generator().manual_seed(seed_for(self.config.seed, "ranking", epoch))
        return torch.stack([torch.randperm(self.num_logical, generator=g) for _ in range(self.num_layers)])

    def probabilities(self, step: int) -> torch.Tensor:
        cfg = self.config
        if cfg.kind == "uniform":
            return torch.full((self.num_layers, self.num_logical), 1.0 / self.num_logical, dtype=torch.float64)
        epoch = step // cfg.drift_period if cfg.kind == "drift" else 0
        ranking = self._ranking(epoch)
        positions = torch.arange(1, self.num_logical + 1, dtype=torch.float64)
        by_position = positions.unsqueeze(0) ** -self._exponents.unsqueeze(1)  # [layers, L]
        weights = torch.empty_like(by_position).scatter_(1, ranking, by_position)
        if cfg.kind == "burst" and step % cfg.burst_every < cfg.burst_length:
            g = torch.Generator().manual_seed(seed_for(cfg.seed, "burst", step // cfg.burst_every))
            hot = torch.stack([torch.randperm(self.num_logical, generator=g)[: cfg.burst_experts] for _ in range(self.num_layers)])
            weights.scatter_(1, hot, torch.gather(weights, 1, hot) * cfg.burst_factor)
            # a burst expert also rises to at least the hottest expert's level times the factor
            peak = weights.max(dim=1, keepdim=True).values
            weights.scatter_(1, hot, torch.maximum(torch.gather(weights, 1, hot), peak))
        return weights / weights.sum(dim=1, keepdim=True)

    def token_counts(self, step: int, rank: int = 0, tokens: int | None = None) -> torch.Tensor:
        """``[layers, L]`` int64: top-k routed token counts of one rank's batch at ``step``."""
        tokens = self.config.tokens_per_step if tokens is None else tokens
        g = torch.Generator().manual_seed(seed_for(self.config.seed, "tokens", step, rank))
        logp = self.probabilities(step).log().to(torch.float32)  # [layers, L]
        u = torch.rand(self.num_layers, tokens, self.num_logical, generator=g).clamp_(1e-12, 1.0)
        scores = logp.unsqueeze(1) - torch.log(-torch.log(u))  # Gumbel-perturbed log-probs
        chosen = scores.topk(self.config.top_k, dim=2).indices  # [layers, tokens, k], distinct per token
        counts = torch.zeros(self.num_layers, self.num_logical, dtype=torch.int64)
        ones = torch.ones(1, dtype=torch.int64).expand(self.num_layers, chosen[0].numel())
        counts.scatter_add_(1, chosen.reshape(self.num_layers, -1), ones)
        return counts

    def window_load(self, start_step: int, num_steps: int, num_ranks: int = 1) -> torch.Tensor:
        """``[layers, L]`` int64: tokens over ``num_steps`` steps and ``num_ranks`` ranks."""
        return _window_load(self, start_step, num_steps, num_ranks)


def _window_load(trace: LoadTrace | PhasedTrace, start_step: int, num_steps: int, num_ranks: int) -> torch.Tensor:
    total = torch.zeros(trace.num_layers, trace.num_logical, dtype=torch.int64)
    for step in range(start_step, start_step + num_steps):
        for rank in range(num_ranks):
            total += trace.token_counts(step, rank)
    return total


class PhasedTrace:
    """Several regimes one after another: phase ``i`` applies from ``starts[i]`` on.

    Same interface as :class:`LoadTrace` (``probabilities``, ``token_counts``, ``window_load``).
    """

    def __init__(self, phases: list[tuple[int, TraceConfig]], num_layers: int, num_logical: int):
        if not phases or phases[0][0] != 0:
            raise ValueError("the first trace phase must start at step 0")
        starts = [start for start, _ in phases]
        if starts != sorted(set(starts)):
            raise ValueError(f"trace phase starts must be strictly increasing, got {starts}")
        self.starts = starts
        self.traces = [LoadTrace(cfg, num_layers, num_logical) for _, cfg in phases]
        self.num_layers, self.num_logical = num_layers, num_logical

    def _at(self, step: int) -> LoadTrace:
        index = max(i for i, start in enumerate(self.starts) if start <= step)
        return self.traces[index]

    def config_at(self, step: int) -> TraceConfig:
        return self._at(step).config

    def probabilities(self, step: int) -> torch.Tensor:
        return self._at(step).probabilities(step)

    def token_counts(self, step: int, rank: int = 0, tokens: int | None = None) -> torch.Tensor:
        return self._at(step).token_counts(step, rank, tokens)

    def window_load(self, start_step: int, num_steps: int, num_ranks: int = 1) -> torch.Tensor:
        return _window_load(self, start_step, num_steps, num_ranks)
