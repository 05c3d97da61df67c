"""The request batch a worker decodes: this rank's own requests, continuous batching at step boundaries.

Requests are owned by ranks: the coordinator admits each request to one rank (its
:class:`~elastic.core.protocol.RequestSpec` ``owner``), and only that rank holds it, with its KV
cache (the model's sequence state). :class:`~elastic.core.protocol.Admit` and
:class:`~elastic.core.protocol.Cancel` are broadcast and applied at an agreed step; each rank
takes the requests it owns. A request leaves by itself at its ``max_tokens`` or a stop token.

One step (:meth:`RequestBatch.step`) is ONE ``model.forward_batch`` over the rank's whole batch
(a collective on the EP group: every rank calls it in a step where any rank has tokens, an empty
batch included): the newly admitted requests are prefilled, every other one decodes a token with
its own state; the requests that finished leave. A request's logits do not depend on which
requests share the call (the data plane's batch invariance), so its tokens are the unsharded
model's for the same prompt (greedy: ``argmax``; sampled: a generator seeded by ``(seed, position)``).

A step that fails midway (a peer died in a collective) is rolled back (:meth:`rollback`): every
request gets back the state it had before the step (``forward_batch`` never changes the states it
is given, so the old object is still whole: this works for every architecture, linear attention
and sliding windows included, where cropping a newer state could not) and the half-made token is
dropped, so the batch goes on through the recovery without a replay. A scale down moves a leaving rank's
requests, states included, to survivors (:meth:`take`, :meth:`restore`).
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


def state_length(model: Any, state: Any) -> int:
    """Tokens held in a request's state (0: none yet)."""
    return 0 if state is None else int(model.state_length(state))


class RequestBatch:
    """This rank's requests (see the module docstring). ``model`` is an
    :class:`~eplb.models.hf.HFMoE` rank; :meth:`step` is a collective on the EP group."""

    def __init__(self, model: Any, max_batch: int):
        if max_batch < 1:
            raise ValueError("max_batch must be positive")
        self.model = model
        self.max_batch = max_batch
        self.running: dict[str, _Running] = {}  # admission order: the order of the batch's rows
        #: while a step runs: every request as it was before it (what :meth:`rollback` restores)
        self._before: list[tuple[_Running, int, torch.Tensor | None, Any]] | None = None

    def __len__(self) -> int:
        return len(self.running)

    def held(self) -> tuple[tuple[str, int], ...]:
        return tuple((rid, len(r.generated)) for rid, r in self.running.items())

    def admit(self, specs: tuple[RequestSpec, ...], rank: int) -> None:
        """Add the requests ``rank`` owns (prefilled at the next step); one already held is left as it is."""
        for spec in specs:
            if spec.owner == rank and spec.request_id not in self.running:
                self.running[spec.request_id] = _Running(spec)

    def cancel(self, request_ids: tuple[str, ...]) -> None:
        for rid in request_ids:
            self.running.pop(rid, None)

    def clear(self) -> None:
        self.running.clear()
        self._before = None

    def step(self) -> StepTokens:
        """One token for every request of this rank, with one forward over the batch (see the module
        docstring); an empty batch still takes part in the group's forward."""
        started = time.perf_counter()
        requests = list(self.running.items())
        self._before = [(r, len(r.generated), r.last, r.cache) for _, r in requests]
        inputs = [(torch.tensor(r.spec.prompt, dtype=torch.long) if r.cache is None or r.last is None else r.last,
                   r.cache) for _, r in requests]
        logits, states = self.model.forward_batch(inputs)
        logical, physical = self.model.take_load()
        out: list[TokenOut] = []
        for (rid, r), row, state in zip(requests, logits, states):
            r.cache = state
            position = len(r.generated)
            token, logprob, top = choose(r.spec, row, position, r.generated)
            r.generated.append(token)
            r.last = torch.tensor([token], dtype=torch.long)
            stop = token in r.spec.stop_token_ids and position + 1 > r.spec.min_tokens
            finish = "stop" if stop else "length" if position + 1 >= r.spec.max_tokens else None
            out.append(TokenOut(rid, position, token, logprob, top, finish))
            if finish is not None:
                del self.running[rid]
        self._before = None
        return StepTokens(tuple(out), logical, physical, time.perf_counter() - started)

    def rollback(self) -> int:
        """Undo a step that failed midway: every request back as it was before it (its state as it was
        then, the half-made token dropped). Returns how many were rolled back."""
        before, self._before = self._before, None
        if before is None:
            return 0
        for r, generated, last, state in before:
            del r.generated[generated:]
            r.last = last
            r.cache = state
            self.running.setdefault(r.spec.request_id, r)
        return len(before)

    # -- moving between ranks ------------------------------------------------------------------
    def export(self, request_ids: Sequence[str] | None = None) -> list[dict[str, Any]]:
        """Requests (default: all) with their states, picklable: a scale down sends them to survivors."""
        chosen = self.running if request_ids is None else {rid: self.running[rid] for rid in request_ids}
        return [{"spec": r.spec, "cache": r.cache, "last": r.last, "generated": list(r.generated)}
                for r in chosen.values()]

    def take(self, request_ids: Sequence[str]) -> list[dict[str, Any]]:
        """:meth:`export` these requests and let them go (they move to another rank)."""
        exported = self.export(request_ids)
        self.cancel(tuple(request_ids))
        return exported

    def restore(self, exported: list[dict[str, Any]]) -> None:
        """Take over requests :meth:`export` made on another rank (after those held, in their order)."""
        for e in exported:
            self.running[e["spec"].request_id] = _Running(e["spec"], e["cache"], e["last"], list(e["generated"]))
