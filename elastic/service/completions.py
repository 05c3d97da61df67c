"""OpenAI-compatible completions over the EP group: ``POST /v1/completions`` and ``GET /v1/models``.

A subset of the OpenAI completions API, as vLLM and SGLang serve it:

- request: ``model``, ``prompt`` (token ids, or text when the checkpoint has a tokenizer),
  ``max_tokens``, ``temperature`` (0: greedy), ``seed``, ``stop`` (strings; needs a tokenizer),
  ``stop_token_ids`` (vLLM's extension), ``logprobs`` (the top n), ``stream`` (server-sent events).
  OpenAI fields this server does not implement (``n``, ``top_p``, ``echo``, penalties, ...) are
  accepted at their neutral value only; any other value, or an unknown field, is a 422 naming it;
- response: ``choices[0].token_ids`` (the generated ids), ``text`` when there is a tokenizer,
  ``logprobs``, ``finish_reason`` and ``usage``;
- refusals: 404 for another model, 422 naming the field, 429 (batch and queue full) and 503
  (failed, no recovery in time) with ``Retry-After``. A client that disconnects frees its slot.

Errors use the server's one body shape, ``{"error": code, "message": text, ...}``.
"""

from __future__ import annotations

import asyncio
import json
import os
import time
from dataclasses import dataclass
from functools import cached_property
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, StreamingResponse
from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictInt, field_validator

from elastic.control.requests import Completion, RequestEngine
from elastic.core import protocol as p
from elastic.core.errors import InvalidCompletionRequest, ModelNotFound
from eplb.models.config import HFModelConfig
from eplb.trace import seed_for

__all__ = ["CompletionRequest", "ServedModel", "completion_routes"]

POLL_S = 0.002  # how often a decoding request looks for new tokens
QUEUED_POLL_S = 0.02  # and a queued one (many may wait: they must not slow the decoding ones)
DISCONNECT_CHECK_S = 0.1


@dataclass
class ServedModel:
    """What the API needs to know of the model: its name, vocabulary, context and tokenizer."""

    spec: HFModelConfig
    name: str

    @classmethod
    def of(cls, spec: HFModelConfig, name: str | None) -> ServedModel:
        default = os.path.basename(os.path.normpath(spec.path)) if spec.path else f"{spec.architecture}-tiny-seed{spec.seed}"
        return cls(spec, name or default)

    @cached_property
    def hf_config(self) -> Any:
        from eplb.models.hf import open_source

        return open_source(self.spec).config

    @property
    def vocab_size(self) -> int:
        return int(self.hf_config.vocab_size)

    @property
    def max_model_len(self) -> int:
        return int(getattr(self.hf_config, "max_position_embeddings", 0) or 1 << 30)

    @cached_property
    def tokenizer(self) -> Any:
        """The checkpoint's tokenizer (``tokenizer.json`` or ``tokenizer_config.json`` in its
        directory), read offline; None for a random model or a checkpoint without one."""
        if self.spec.path is None or not any(os.path.exists(os.path.join(self.spec.path, f))
                                             for f in ("tokenizer.json", "tokenizer_config.json")):
            return None
        from transformers import AutoTokenizer

        return AutoTokenizer.from_pretrained(self.spec.path, local_files_only=True)

    def detokenize(self, tokens: list[int]) -> str:
        return self.tokenizer.decode(tokens) if self.tokenizer is not None else ""


def _neutral(name: str, neutral: Any):
    def check(value: Any) -> Any:
        if value is not None and value != neutral:
            raise ValueError(f"{name} is not supported here; only {neutral!r} (the default) is accepted")
        return value
    return check


class CompletionRequest(BaseModel):
    """The body of ``POST /v1/completions``."""

    # strict: JSON false is not a number, nor 1.0 an integer (a fuzzer's finds)
    model_config = ConfigDict(extra="forbid", strict=True, json_schema_extra={
        "examples": [{"model": "qwen3_moe-tiny-seed0", "prompt": [1, 2, 3, 4], "max_tokens": 8, "temperature": 0}]})

    model: str = Field(..., min_length=1, max_length=512, description="the served model's name (GET /v1/models)")
    prompt: list[StrictInt] | str = Field(..., description="token ids, or text when the model has a tokenizer")
    max_tokens: StrictInt = Field(16, ge=1, description="tokens to generate (at most serving.max_tokens_limit)")
    temperature: float = Field(1.0, ge=0.0, le=2.0, allow_inf_nan=False, description="0: greedy")
    seed: StrictInt | None = Field(None, ge=0, lt=2**63, description="the sampling seed (default: from the request id)")
    stop: str | list[str] | None = Field(None, description="stop strings (needs a tokenizer); the text ends before them")
    stop_token_ids: list[StrictInt] | None = Field(None, max_length=64, description="tokens that end the request")
    logprobs: StrictInt | None = Field(None, ge=0, le=20, description="log-probabilities of the top n tokens too")
    stream: StrictBool = False
    user: str | None = Field(None, max_length=256)
    n: StrictInt | None = None
    best_of: StrictInt | None = None
    top_p: float | None = None
    echo: StrictBool | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None

    _n = field_validator("n")(_neutral("n", 1))
    _best_of = field_validator("best_of")(_neutral("best_of", 1))
    _top_p = field_validator("top_p")(_neutral("top_p", 1.0))
    _echo = field_validator("echo")(_neutral("echo", False))
    _presence = field_validator("presence_penalty")(_neutral("presence_penalty", 0.0))
    _frequency = field_validator("frequency_penalty")(_neutral("frequency_penalty", 0.0))

    @field_validator("prompt")
    @classmethod
    def _prompt(cls, value: list[int] | str) -> list[int] | str:
        if len(value) == 0:
            raise ValueError("the prompt is empty")
        return value

    @field_validator("stop")
    @classmethod
    def _stop(cls, value: str | list[str] | None) -> str | list[str] | None:
        stops = [value] if isinstance(value, str) else value or []
        if len(stops) > 16 or any(not s for s in stops):
            raise ValueError("at most 16 non-empty stop strings")
        return value


class ModelList(BaseModel):
    object: str = "list"
    data: list[dict[str, Any]]


def _spec_of(body: CompletionRequest, served: ServedModel, request_id: str) -> tuple[p.RequestSpec, tuple[str, ...]]:
    """The request as the ranks decode it, or an error naming the field (nothing is queued)."""
    if body.model != served.name:
        raise ModelNotFound(body.model, served.name)
    if isinstance(body.prompt, str):
        if served.tokenizer is None:
            raise InvalidCompletionRequest("prompt", "this model has no tokenizer: send the prompt as a list of token ids")
        prompt = [int(t) for t in served.tokenizer.encode(body.prompt)]
        if not prompt:
            raise InvalidCompletionRequest("prompt", "the text encodes to no tokens")
    else:
        prompt = list(body.prompt)
    vocab = served.vocab_size
    bad = next((t for t in prompt if not 0 <= t < vocab), None)
    if bad is not None:
        raise InvalidCompletionRequest("prompt", f"token ids must be in [0, {vocab}) (the model's vocabulary)", value=bad)
    if len(prompt) >= served.max_model_len:
        raise InvalidCompletionRequest("prompt", f"{len(prompt)} tokens leave no room in the model's context of "
                                       f"{served.max_model_len}")
    if len(prompt) + body.max_tokens > served.max_model_len:
        raise InvalidCompletionRequest("max_tokens", f"the prompt's {len(prompt)} tokens plus max_tokens {body.max_tokens} "
                                       f"exceed the model's context of {served.max_model_len}")
    stops = tuple([body.stop] if isinstance(body.stop, str) else body.stop or [])
    if stops and served.tokenizer is None:
        raise InvalidCompletionRequest("stop", "stop strings need a tokenizer; use stop_token_ids")
    stop_ids = tuple(body.stop_token_ids or ())
    bad = next((t for t in stop_ids if not 0 <= t < vocab), None)
    if bad is not None:
        raise InvalidCompletionRequest("stop_token_ids", f"token ids must be in [0, {vocab})", value=bad)
    seed = body.seed if body.seed is not None else seed_for(0, "request", request_id) % (2**63)
    spec = p.RequestSpec(request_id=request_id, prompt=tuple(prompt), max_tokens=body.max_tokens,
                         temperature=body.temperature, seed=seed, stop_token_ids=stop_ids, logprobs=body.logprobs)
    return spec, stops


def _logprobs(c: Completion, served: ServedModel, start: int, end: int) -> dict[str, Any] | None:
    if c.spec.logprobs is None:
        return None
    def name(token: int) -> str:
        return served.detokenize([token]) if served.tokenizer is not None else str(token)
    return {"tokens": [name(t) for t in c.tokens[start:end]], "token_ids": c.tokens[start:end],
            "token_logprobs": c.logprobs[start:end],
            "top_logprobs": [{name(t): v for t, v in top} for top in c.top_logprobs[start:end]]}


def _text(c: Completion, served: ServedModel) -> str:
    text = served.detokenize(c.tokens)
    return text[: c.text_end] if c.text_end is not None else text


def _finish_reason(c: Completion) -> str | None:
    return {"cancelled": "abort"}.get(c.status, c.finish_reason)


def completion_routes(controller: Any) -> APIRouter:
    """The ``/v1`` routes over ``controller.requests`` (a :class:`RequestEngine`)."""
    engine: RequestEngine = controller.requests
    served = ServedModel.of(controller.config.model, controller.config.serving.model_name)
    engine.detokenize = served.detokenize if served.tokenizer is not None else None
    router = APIRouter(tags=["completions"])
    created = int(time.time())

    @router.get("/v1/models", response_model=ModelList)
    def models() -> Any:
        """The model this deployment serves."""
        return {"object": "list", "data": [{"id": served.name, "object": "model", "created": created,
                                            "owned_by": "elastic-ep", "max_model_len": served.max_model_len,
                                            "vocab_size": served.vocab_size}]}

    def body_of(c: Completion, model: str) -> dict[str, Any]:
        return {
            "id": c.id, "object": "text_completion", "created": int(time.time()), "model": model,
            "choices": [{"index": 0, "text": _text(c, served), "token_ids": list(c.tokens),
                         "logprobs": _logprobs(c, served, 0, len(c.tokens)), "finish_reason": _finish_reason(c)}],
            "usage": {"prompt_tokens": len(c.spec.prompt), "completion_tokens": len(c.tokens),
                      "total_tokens": len(c.spec.prompt) + len(c.tokens)},
            "elastic_ep": {"replays": c.replays},
        }

    @router.post("/v1/completions", responses={
        200: {"description": "the completion (JSON), or with stream: server-sent events, one completion chunk per "
                             "data line, then data: [DONE]",
              "content": {"application/json": {"schema": {"type": "object"}},
                          # each event: its data line is one completion chunk as JSON, or [DONE]
                          "text/event-stream": {"schema": {"type": "object", "properties": {"data": {"type": "string"}},
                                                           "required": ["data"]}}}},
        404: {"description": "another model"}, 422: {"description": "a bad field, named"},
        429: {"description": "the batch and the queue are full (Retry-After)"},
        503: {"description": "the deployment failed and was not recovered in time (Retry-After)"}})
    async def completions(body: CompletionRequest, request: Request) -> Any:
        """Generate ``max_tokens`` tokens (fewer at a stop) for one prompt; ``stream`` sends them as they come."""
        request_id = engine.new_id()
        spec, stops = _spec_of(body, served, request_id)
        c = engine.submit(spec, stop=stops)  # Overloaded / ServiceUnavailable: 429 / 503 with Retry-After
        if body.stream:
            return StreamingResponse(_stream(c, body.model, request), media_type="text/event-stream",
                                     headers={"Cache-Control": "no-cache", "X-Request-Id": c.id})
        try:
            last_check = time.monotonic()
            while not c.done:
                await asyncio.sleep(QUEUED_POLL_S if c.status == "queued" else POLL_S)
                if time.monotonic() - last_check > DISCONNECT_CHECK_S:
                    last_check = time.monotonic()
                    if await request.is_disconnected():
                        engine.cancel(c.id)
                        return JSONResponse({"error": "cancelled", "message": "the client went away"}, status_code=499)
        except asyncio.CancelledError:
            engine.cancel(c.id)
            raise
        if c.status == "failed" and c.error is not None:
            raise c.error
        return body_of(c, body.model)

    async def _stream(c: Completion, model: str, request: Request):
        sent = 0
        sent_text = ""
        finished = False
        try:
            while True:
                done = c.done
                end = len(c.tokens)
                if c.status == "failed" and c.error is not None:
                    yield f"data: {json.dumps({'error': c.error.to_dict()})}\n\n"
                    finished = True
                    break
                if end > sent or done:
                    text = _text(c, served) if served.tokenizer is not None else ""
                    chunk = {"id": c.id, "object": "text_completion", "created": int(time.time()), "model": model,
                             "choices": [{"index": 0, "text": text[len(sent_text):], "token_ids": c.tokens[sent:end],
                                          "logprobs": _logprobs(c, served, sent, end),
                                          "finish_reason": _finish_reason(c) if done else None}]}
                    if done:
                        chunk["usage"] = {"prompt_tokens": len(c.spec.prompt), "completion_tokens": end,
                                          "total_tokens": len(c.spec.prompt) + end}
                        chunk["elastic_ep"] = {"replays": c.replays}
                    sent, sent_text = end, text
                    yield f"data: {json.dumps(chunk)}\n\n"
                if done:
                    finished = True
                    break
                await asyncio.sleep(QUEUED_POLL_S if c.status == "queued" else POLL_S)
            yield "data: [DONE]\n\n"
        finally:
            if not finished:  # the client went away mid-stream: its slot is freed
                engine.cancel(c.id)

    return router
