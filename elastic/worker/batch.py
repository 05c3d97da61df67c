"""The request batch a worker decodes: continuous batching at step boundaries, identical on every rank.

Every rank of the EP group holds the same :class:`RequestBatch` (attention is replicated): the
coordinator's :class:`~elastic.core.protocol.Admit` and :class:`~elastic.core.protocol.Cancel`
commands change it at an agreed step, and a request leaves by itself at the same step
everywhere (its ``max_tokens``, or a stop token: both follow from tokens every rank computed
bit for bit alike).

One step (:meth:`RequestBatch.step`):

1. every request admitted since the last step is prefilled (its first token is chosen);
2. every other running request decodes one token with its own KV cache;
3. the requests that finished leave the batch.

Each request runs its own forward (batch size 1), in admission order. So its bits never
depend on which other requests share the batch, and its tokens equal the unsharded model's
for the same prompt (greedy: ``argmax``; sampled: a generator seeded by ``(seed, position)``):
batch invariance, bought with one forward per request per step. The experts inside each forward
still run across the whole EP group.

The batch moves with the group: :meth:`export` and :meth:`restore` carry every request with its
KV cache to a joining rank (a scale never restarts a request from its prompt).
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from elastic.core import sampling
from elastic.core.protocol import RequestSpec, TokenOut
from elastic.core.sampling import GREEDY_BELOW

__all__ = ["GREEDY_BELOW", "RequestBatch", "StepTokens"]


@dataclass
class _Running:
    spec: RequestSpec
    cache: Any = None  # the model's KV cache (None until prefilled)
    last: torch.Tensor | None = None  # [1] the token to feed next
    generated: list[int] = field(default_factory=list)


@dataclass(frozen=True)
class StepTokens:
    tokens: tuple[TokenOut, ...]
    logical: torch.Tensor | None  # [layers, L] the router's choices over this step's forwards (None: no forward)
    physical: torch.Tensor | None  # [layers, P]
    seconds: float


def choose(spec: RequestSpec, logits: torch.Tensor, position: int,
           generated: Sequence[int] = ()) -> tuple[int, float | None, tuple[tuple[int, float], ...]]:
    """The token at ``position`` from ``logits [V]`` (``generated``: the tokens before it): greedy at
    temperature 0, else a seeded sample, after the request's sampling parameters
    (:mod:`elastic.core.sampling`); with its log-probability and the top ``spec.logprobs``
    alternatives when asked for (of the model's own distribution, as vLLM reports them)."""
    adjusted = logits if sampling.neutral(spec, position) else sampling.adjusted_logits(spec, logits, generated)
    if spec.temperature < GREEDY_BELOW:
        token = int(adjusted.argmax())
    else:
        # float64: logits / a small temperature stay finite (float32 overflowed to NaN probabilities,
        # which broke the group on every rank at once)
        token = sampling.sample(spec, adjusted, position)
    if spec.logprobs is None:
        return token, None, ()
    logp = torch.log_softmax(logits.float(), dim=-1)
    top: tuple[tuple[int, float], ...] = ()
    if spec.logprobs > 0:
        values, ids = logp.topk(min(spec.logprobs, logp.numel()))
        top = tuple((int(i), float(v)) for i, v in zip(ids, values))
    return token, float(logp[token]), top


class RequestBatch:
    """The requests one EP group decodes (see the module docstring). ``model`` is an
    :class:`~eplb.models.hf.HFMoE` rank; every method that runs a forward is a collective."""

    def __init__(self, model: Any, max_batch: int):
        if max_batch < 1:
            raise ValueError("max_batch must be positive")
        self.model = model
        self.max_batch = max_batch
        self.running: dict[str, _Running] = {}  # admission order: every rank steps them in this order

    def __len__(self) -> int:
        return len(self.running)

    def held(self) -> tuple[tuple[str, int], ...]:
        return tuple((rid, len(r.generated)) for rid, r in self.running.items())

    def admit(self, specs: tuple[RequestSpec, ...]) -> None:
        """Add requests (prefilled at the next step). One already held is left as it is; past
        ``max_batch`` the rest wait for the coordinator to admit them again (it never sends more)."""
        for spec in specs:
            if spec.request_id not in self.running and len(self.running) < self.max_batch:
                self.running[spec.request_id] = _Running(spec)

    def cancel(self, request_ids: tuple[str, ...]) -> None:
        for rid in request_ids:
            self.running.pop(rid, None)

    def clear(self) -> None:
        self.running.clear()

    def step(self) -> StepTokens:
        """One token for every request (see the module docstring)."""
        started = time.perf_counter()
        out: list[TokenOut] = []
        for rid, r in list(self.running.items()):
            if r.cache is None:
                logits, r.cache = self.model.next_logits(torch.tensor([r.spec.prompt], dtype=torch.long), None)
            else:
                assert r.last is not None  # prefilled: a token to feed
                logits, r.cache = self.model.next_logits(r.last[:, None], r.cache)
            position = len(r.generated)
            token, logprob, top = choose(r.spec, logits[0], position, r.generated)
            r.generated.append(token)
            r.last = torch.tensor([token], dtype=torch.long)
            stop = token in r.spec.stop_token_ids and position + 1 > r.spec.min_tokens
            finish = "stop" if stop else "length" if position + 1 >= r.spec.max_tokens else None
            out.append(TokenOut(rid, position, token, logprob, top, finish))
            if finish is not None:
                del self.running[rid]
        logical = physical = None
        if out:
            logical, physical = self.model.take_load()
        return StepTokens(tuple(out), logical, physical, time.perf_counter() - started)

    # -- moving with the group -----------------------------------------------------------------
    def export(self) -> list[dict[str, Any]]:
        """Every request with its KV cache, picklable (the rescale's state broadcast carries it)."""
        return [{"spec": r.spec, "cache": r.cache, "last": r.last, "generated": list(r.generated)}
                for r in self.running.values()]

    def restore(self, exported: list[dict[str, Any]]) -> None:
        """Take over a batch :meth:`export` made on another rank (in the same order)."""
        self.running = {e["spec"].request_id: _Running(e["spec"], e["cache"], e["last"], list(e["generated"]))
                        for e in exported}
