"""How one token is chosen from a request's logits: vLLM's sampling parameters, as pure functions.

The order is vLLM's: ``logit_bias``, then the ``min_tokens`` mask on stop tokens, then the
penalties (``repetition_penalty`` over the prompt and the output, ``frequency_penalty`` and
``presence_penalty`` over the output), then temperature; a sample keeps the ``top_k`` tokens,
then the ``top_p`` nucleus, then those with at least ``min_p`` times the top probability.

A request at its neutral values (no bias, no penalty, no mask) leaves the logits untouched, so
greedy decoding stays bitwise the unsharded model's ``argmax``. A sample draws from a generator
seeded by ``(seed, position)`` only: the same request gives the same tokens on every rank, on a
replay, and at any EP size.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence

import torch

from elastic.core.protocol import RequestSpec
from eplb.trace import seed_for

__all__ = ["GREEDY_BELOW", "adjusted_logits", "neutral", "sample", "filtered_probs"]

#: a temperature below this decodes greedily (vLLM's sampling epsilon)
GREEDY_BELOW = 1e-5


def neutral(spec: RequestSpec, position: int) -> bool:
    """True when nothing changes the logits at ``position`` (the greedy fast path stays bitwise)."""
    return (not spec.logit_bias and spec.repetition_penalty == 1.0 and spec.presence_penalty == 0.0
            and spec.frequency_penalty == 0.0 and (position >= spec.min_tokens or not spec.stop_token_ids))


def adjusted_logits(spec: RequestSpec, logits: torch.Tensor, generated: Sequence[int]) -> torch.Tensor:
    """``logits [V]`` after the bias, the ``min_tokens`` mask and the penalties (float64, a new tensor)."""
    out = logits.double().clone()
    vocab = out.numel()
    for token, bias in spec.logit_bias:
        if 0 <= token < vocab:
            out[token] += bias
    if len(generated) < spec.min_tokens:
        for token in spec.stop_token_ids:
            if 0 <= token < vocab:
                out[token] = float("-inf")
    if spec.repetition_penalty != 1.0:
        seen = torch.tensor(sorted({t for t in (*spec.prompt, *generated) if 0 <= t < vocab}), dtype=torch.long)
        if seen.numel():
            values = out[seen]
            out[seen] = torch.where(values > 0, values / spec.repetition_penalty, values * spec.repetition_penalty)
    if (spec.frequency_penalty or spec.presence_penalty) and generated:
        counts = Counter(t for t in generated if 0 <= t < vocab)
        ids = torch.tensor(list(counts), dtype=torch.long)
        freq = torch.tensor([float(counts[t]) for t in counts], dtype=torch.float64)
        out[ids] -= spec.frequency_penalty * freq + spec.presence_penalty
    return out


def filtered_probs(spec: RequestSpec, logits: torch.Tensor) -> torch.Tensor:
    """The sampling distribution over ``logits [V]`` (float64) at ``spec.temperature``, after top-k,
    top-p and min-p; tokens filtered out have probability 0."""
    probs = torch.softmax(logits.double() / spec.temperature, dim=-1)
    vocab = probs.numel()
    if not (0 < spec.top_k < vocab or spec.top_p < 1.0 or spec.min_p > 0.0):
        return probs
    keep = torch.ones(vocab, dtype=torch.bool)
    if 0 < spec.top_k < vocab:
        keep = torch.zeros(vocab, dtype=torch.bool)
        keep[probs.topk(spec.top_k).indices] = True
    if spec.top_p < 1.0:
        masked = torch.where(keep, probs, torch.zeros_like(probs))
        order = masked.argsort(descending=True, stable=True)
        before = masked[order].cumsum(0) - masked[order]  # the mass of the tokens ranked above each
        nucleus = torch.zeros(vocab, dtype=torch.bool)
        nucleus[order[before < spec.top_p * masked.sum()]] = True
        keep &= nucleus
    if spec.min_p > 0.0:
        keep &= probs >= spec.min_p * float(torch.where(keep, probs, torch.zeros_like(probs)).max())
    probs = torch.where(keep, probs, torch.zeros_like(probs))
    return probs / probs.sum()


def sample(spec: RequestSpec, logits: torch.Tensor, position: int) -> int:
    """A token drawn from :func:`filtered_probs` with a generator seeded by ``(spec.seed, position)``;
    the argmax when the distribution is not finite (a temperature so small it overflowed)."""
    probs = filtered_probs(spec, logits)
    if not bool(torch.isfinite(probs).all()):
        return int(logits.argmax())
    g = torch.Generator().manual_seed(seed_for(spec.seed, "sample", position))
    return int(torch.multinomial(probs, 1, generator=g))
