"""OpenAI- and vLLM-compatible serving over the EP group: the routes tools and clients use.

``POST /v1/completions`` and ``POST /v1/chat/completions`` (streaming or not), ``GET /v1/models``,
``POST /tokenize``, ``POST /detokenize``, ``GET /health``, ``GET|POST /ping``, ``GET /version``.

- requests take the fields vLLM's OpenAI server takes (:mod:`elastic.service.openai_protocol`),
  with the same meaning: sampling parameters, ``n``, a list of prompts, ``echo``,
  ``stream_options``, ``ignore_eos``, ``min_tokens``, ``logit_bias``, ``return_token_ids``;
  an unknown field is ignored (logged, named in ``X-Ignored-Fields``); a vLLM field this server
  cannot honour is a 400 naming it;
- a request stops at the checkpoint's EOS token(s) unless ``ignore_eos``;
- errors have OpenAI's shape, ``{"error": {"message", "type", "param", "code"}}``: 400 for a bad
  field (named in ``param``), 404 for another model, 429 (batch and queue full) and 503 (failed,
  no recovery in time) with ``Retry-After``. A client that disconnects frees its slot.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
import uuid
from collections.abc import AsyncIterator, Callable, Iterator
from dataclasses import dataclass
from typing import Any

import anyio
from fastapi import APIRouter, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from fastapi.routing import APIRoute
from pydantic import ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException

from elastic.control.requests import Completion, RequestEngine
from elastic.core import protocol as p
from elastic.core.errors import ElasticError, InvalidCompletionRequest, ModelNotFound, Overloaded, RequestNotServed
from elastic.service.metrics import RequestTimer, ServingMetrics
from elastic.service.openai_protocol import (
    NEUTRAL,
    UNSUPPORTED,
    ChatRequest,
    CompletionRequest,
    OpenAIError,
    SamplingFields,
    error_response,
)
from elastic.service.preflight import Refusal, invalid_body, unparsable_body
from elastic.service.served_model import ServedModel, TextView
from eplb.trace import seed_for

__all__ = ["CompletionRequest", "ChatRequest", "ServedModel", "completion_routes"]

log = logging.getLogger("elastic.service.completions")

DISCONNECT_CHECK_S = 0.1  # how often a waiting request checks that its client is still there
# prompts tokenized (and chat templates rendered) at once, each on a worker thread: near the body
# limit one takes about 1 s of CPU and 170 MB at its peak, so more at once would only add memory
TOKENIZING_THREADS = 2
REQUEST_ID_CHARS = 128  # of a client's x-request-id, echoed
IGNORED_SHOWN_CHARS = 1024  # of the unknown fields' names, in X-Ignored-Fields and the log
BYTES_PER_TOKEN = 24  # the body limit of /v1: 1 MiB and max_model_len tokens of JSON ids or text for 16 prompts


# -- errors: OpenAI's shape on these routes ------------------------------------------------------

def _openai_error(exc: Exception) -> OpenAIError | None:
    if isinstance(exc, OpenAIError):
        return exc
    if isinstance(exc, RequestValidationError):
        errors = list(exc.errors())
        first = errors[0] if errors else {"loc": (), "msg": "invalid request"}
        whole = invalid_body(first)  # the body as a whole: not JSON, empty, not an object
        if whole is not None:
            return OpenAIError(400, whole, code="invalid_request")
        loc = [str(part) for part in first.get("loc", ()) if part != "body"]
        where = ".".join(loc) or "body"
        return OpenAIError(400, f"{where}: {first.get('msg', '')}", param=loc[0] if loc else None, code="invalid_request")
    if isinstance(exc, InvalidCompletionRequest):
        return OpenAIError(400, exc.message, param=exc.fields.get("field"), code=exc.code)
    if isinstance(exc, ModelNotFound):
        return OpenAIError(404, exc.message, param="model", code=exc.code)
    if isinstance(exc, RequestNotServed):
        return OpenAIError(429 if isinstance(exc, Overloaded) else 503, exc.message, code=exc.code,
                           headers={"Retry-After": str(exc.retry_after_s)})
    if isinstance(exc, StarletteHTTPException) and exc.status_code == 400:  # a body FastAPI could not parse
        return OpenAIError(400, unparsable_body(exc.__cause__, str(exc.detail)), code="invalid_request")
    if isinstance(exc, ElasticError):
        return OpenAIError(400, exc.message, code=exc.code)
    return None


class OpenAIRoute(APIRoute):
    """A route whose errors, its body's validation included, are answered in OpenAI's shape."""

    def get_route_handler(self) -> Callable[[Request], Any]:
        handler = super().get_route_handler()

        async def run(request: Request) -> Response:
            try:
                return await handler(request)
            except Exception as exc:  # noqa: BLE001 - anything this shape does not know goes to the app's handlers
                known = _openai_error(exc)
                if known is None:
                    raise
                return error_response(known)
        return run


ERRORS: dict[int | str, dict[str, Any]] = {
    400: {"description": "a bad field, named in error.param"}, 401: {"description": "no or a wrong API key"},
    404: {"description": "another model"}, 429: {"description": "the batch and the queue are full (Retry-After)"},
    503: {"description": "the deployment failed and was not recovered in time (Retry-After)"}}
STREAMED = {"description": "the completion (JSON), or with stream: server-sent events, one chunk per data line, "
                           "then data: [DONE]",
            "content": {"application/json": {"schema": {"type": "object"}},
                        "text/event-stream": {"schema": {"type": "object", "properties": {"data": {"type": "string"}},
                                                         "required": ["data"]}}}}


# -- from a body to the requests the ranks decode -------------------------------------------------

@dataclass
class Choice:
    """One choice of a request: its prompt's index, its completion and how its text reads."""

    index: int
    prompt_index: int
    completion: Completion
    view: TextView


def _check_supported(body: SamplingFields) -> list[str]:
    """400 for a vLLM field this server cannot honour; the unknown ones, ignored, are returned."""
    extra = dict(body.model_extra or {})
    for name, neutral in UNSUPPORTED.items():
        if name in extra and extra.pop(name) not in (neutral, None, *NEUTRAL.get(name, ())):
            raise InvalidCompletionRequest(name, "not supported by this server (see README: what differs from vLLM)")
    if body.best_of is not None and body.best_of != (body.n or 1):
        raise InvalidCompletionRequest("best_of", "only best_of equal to n is supported", value=body.best_of)
    names = sorted(printable(name) for name in extra)
    if names:  # cut as the header is: a 1 MiB body of unknown fields was a 1 MB log line per request
        shown = ", ".join(names)
        log.warning("ignored request fields (%d): %s", len(names),
                    shown if len(shown) <= IGNORED_SHOWN_CHARS else shown[:IGNORED_SHOWN_CHARS] + " ...")
    return names


def printable(text: str) -> str:
    """``text`` in printable ASCII, anything else escaped (``\\u043a``, ``\\r``): a client's field
    name in a response header (latin-1, no control characters) or a log line. A name in Cyrillic
    was a 500 after the request had been decoded in full, one with a CR, LF or NUL no answer at all."""
    return "".join(ch if " " <= ch <= "~" else ch.encode("unicode_escape").decode("ascii") for ch in text)


#: ``apply_chat_template``'s own parameters: not template variables. ``chat_template`` would run a
#: Jinja template the client wrote in this process (a CPU or memory bomb: ``{{ "x" * 10**9 }}``),
#: which vLLM refuses unless started with ``--trust-request-chat-template``; the others change what
#: it returns or repeat an argument this server sets
TEMPLATE_PARAMETERS = frozenset({
    "chat_template", "conversation", "tokenize", "add_generation_prompt", "padding", "truncation", "max_length",
    "return_tensors", "return_dict", "return_assistant_tokens_mask", "tokenizer_kwargs"})


def _check_template_kwargs(kwargs: dict[str, Any]) -> None:
    """400 for a key of ``chat_template_kwargs`` that is not a template variable (nothing is rendered)."""
    bad = sorted(TEMPLATE_PARAMETERS.intersection(kwargs))
    if "chat_template" in bad:
        raise InvalidCompletionRequest("chat_template_kwargs", "a chat template sent with the request is not run "
                                       "(the checkpoint's is); remove chat_template")
    if bad:
        raise InvalidCompletionRequest("chat_template_kwargs", f"{', '.join(bad)}: not a template variable "
                                       "(this server sets how the template is applied)")


def _prompt_ids(prompt: list[int] | str, served: ServedModel, field: str = "prompt") -> list[int]:
    """``prompt``'s token ids; a 400 naming ``field`` (the request's field the ids came from)."""
    if isinstance(prompt, str):
        if served.tokenizer is None:
            raise InvalidCompletionRequest(field, "this model has no tokenizer: send the prompt as a list of token ids")
        ids = served.encode(_unicode(prompt, field))
        if not ids:
            raise InvalidCompletionRequest(field, "the text encodes to no tokens")
        return ids
    bad = next((t for t in prompt if not 0 <= t < served.vocab_size), None)
    if bad is not None:
        raise InvalidCompletionRequest(field, f"token ids must be in [0, {served.vocab_size}) (the model's vocabulary)",
                                       value=bad)
    return list(prompt)


def _unicode(text: str, field: str) -> str:
    """``text``, or a 400 naming ``field`` when it holds a lone surrogate (JSON's ``"\\ud800"`` is
    valid JSON but no Unicode text: the tokenizer raised a TypeError, a 500)."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise InvalidCompletionRequest(field, f"not Unicode text: a lone surrogate ({text[exc.start]!a}) at character "
                                       f"{exc.start}") from None
    return text


def _max_tokens(body: SamplingFields, prompt: list[int], served: ServedModel, limit: int) -> int:
    # the declared fields only: an unknown one (max_completion_tokens on /v1/completions, as vLLM's
    # completions have none) is ignored, as X-Ignored-Fields says; read as an attribute of the
    # model's extras it was used unchecked (a string was a 500, 2.5 or true a length)
    source = "messages" if isinstance(body, ChatRequest) else "prompt"
    if len(prompt) >= served.max_model_len:
        raise InvalidCompletionRequest(source, f"{len(prompt)} tokens leave no room in the model's context of "
                                       f"{served.max_model_len}")
    field, wanted = "max_tokens", body.max_tokens
    if isinstance(body, ChatRequest) and body.max_completion_tokens is not None:
        field, wanted = "max_completion_tokens", body.max_completion_tokens
    if wanted is None:
        return min(limit, served.max_model_len - len(prompt))
    if len(prompt) + wanted > served.max_model_len:
        raise InvalidCompletionRequest(field, f"the prompt's {len(prompt)} tokens plus {field} {wanted} "
                                       f"exceed the model's context of {served.max_model_len}")
    return wanted


def _stop_ids(body: SamplingFields, served: ServedModel) -> tuple[int, ...]:
    stop_ids = tuple(body.stop_token_ids or ())
    bad = next((t for t in stop_ids if not 0 <= t < served.vocab_size), None)
    if bad is not None:
        raise InvalidCompletionRequest("stop_token_ids", f"token ids must be in [0, {served.vocab_size})", value=bad)
    eos = () if body.ignore_eos else tuple(t for t in served.eos_token_ids if t not in stop_ids)
    return stop_ids + eos


def _logit_bias(body: SamplingFields, served: ServedModel) -> tuple[tuple[int, float], ...]:
    bias = tuple(sorted((int(k), float(v)) for k, v in (body.logit_bias or {}).items()))
    bad = next((t for t, _ in bias if not 0 <= t < served.vocab_size), None)
    if bad is not None:
        raise InvalidCompletionRequest("logit_bias", f"token ids must be in [0, {served.vocab_size})", value=bad)
    return bias


def _specs(body: SamplingFields, prompts: list[list[int]], served: ServedModel, engine: RequestEngine,
           logprobs: int | None) -> list[tuple[int, p.RequestSpec]]:
    """``(prompt index, spec)`` of every choice, ``n`` per prompt; raises naming a bad field (nothing queued)."""
    if body.model != served.name:
        raise ModelNotFound(body.model, served.name)
    n = body.n or 1
    room = engine.config.max_batch + engine.config.max_queue
    if n * len(prompts) > room:
        raise InvalidCompletionRequest("n", f"{n} choices for {len(prompts)} prompts: more than the "
                                       f"{room} requests the server holds (serving.max_batch + max_queue)")
    stops = tuple([body.stop] if isinstance(body.stop, str) else body.stop or [])
    if stops and served.tokenizer is None:
        raise InvalidCompletionRequest("stop", "stop strings need a tokenizer; use stop_token_ids")
    stop_ids, bias = _stop_ids(body, served), _logit_bias(body, served)
    out = []
    for i, prompt in enumerate(prompts):
        max_tokens = _max_tokens(body, prompt, served, engine.config.max_tokens_limit)
        if (body.min_tokens or 0) > max_tokens:  # as vLLM: never more tokens than max_tokens
            raise InvalidCompletionRequest("min_tokens", f"must be at most max_tokens ({max_tokens})",
                                           value=body.min_tokens)
        for j in range(n):
            rid = engine.new_id()
            seed = (body.seed if j == 0 else seed_for(body.seed, "choice", j)) if body.seed is not None else seed_for(
                0, "request", rid)
            out.append((i, p.RequestSpec(
                request_id=rid, prompt=tuple(prompt), max_tokens=max_tokens,
                temperature=1.0 if body.temperature is None else body.temperature, seed=seed % (2**63),
                stop_token_ids=stop_ids, logprobs=logprobs, min_tokens=body.min_tokens or 0,
                top_p=1.0 if body.top_p is None else body.top_p, top_k=max(0, body.top_k or 0),
                min_p=body.min_p or 0.0, repetition_penalty=body.repetition_penalty or 1.0,
                presence_penalty=body.presence_penalty or 0.0, frequency_penalty=body.frequency_penalty or 0.0,
                logit_bias=bias)))
    return out


def _submit(engine: RequestEngine, served: ServedModel, body: SamplingFields,
            specs: list[tuple[int, p.RequestSpec]]) -> list[Choice]:
    """Queue every choice, or none (the engine checks the room for all of them at once)."""
    stops = tuple([body.stop] if isinstance(body.stop, str) else body.stop or [])
    skip = body.skip_special_tokens is not False
    views = [TextView(served, spec.prompt, stops, skip, spec.min_tokens, body.include_stop_str_in_output is True)
             for _, spec in specs]
    # the engine ends a request on a stop string in the text the answer shows (with the prompt as
    # context, special tokens as asked): decoded alone, " w5" at the output's start was never seen,
    # the request went on to max_tokens and answered "" with finish_reason length
    queued = engine.submit_all([spec for _, spec in specs], stop=stops,
                               texts=[view.decoded for view in views] if stops and served.tokenizer is not None else None)
    return [Choice(index, prompt_index, c, view)
            for index, ((prompt_index, spec), c, view) in enumerate(zip(specs, queued, views))]


def _finish_reason(c: Completion) -> str | None:
    return {"cancelled": "abort"}.get(c.status, c.finish_reason)


def _stop_reason(ch: Choice, body: SamplingFields) -> str | int | None:
    """vLLM's ``stop_reason``: the stop string or the ``stop_token_ids`` token that ended the choice;
    None for EOS or a length (it was always None)."""
    c = ch.completion
    if _finish_reason(c) != "stop":
        return None
    if ch.view.matched is not None:
        return ch.view.matched
    last = c.tokens[-1] if c.tokens else None
    return last if last is not None and last in (body.stop_token_ids or ()) else None


def _usage(choices: list[Choice]) -> dict[str, int]:
    prompt = sum(len(ch.completion.spec.prompt) for ch in choices if ch.index == _first_of(choices, ch.prompt_index))
    completion = sum(len(ch.completion.tokens) for ch in choices)
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}


def _first_of(choices: list[Choice], prompt_index: int) -> int:
    return next(ch.index for ch in choices if ch.prompt_index == prompt_index)


# -- waiting for tokens ---------------------------------------------------------------------------

class Wakeups:
    """Wakes the handlers that wait for tokens when the engine reports a change, instead of each
    polling (16 requests polling every 2 ms cost the server 0.13 cores at 270 tokens/s)."""

    def __init__(self, engine: RequestEngine):
        self._events: set[asyncio.Event] = set()
        self._loop: asyncio.AbstractEventLoop | None = None
        engine.watch(self._from_engine)

    def _from_engine(self) -> None:  # the engine's threads
        loop = self._loop
        if loop is None or not self._events:
            return
        try:
            loop.call_soon_threadsafe(self._set_all)
        except RuntimeError:  # the loop closed (shutdown)
            pass

    def _set_all(self) -> None:
        for event in self._events:
            event.set()

    async def wait(self, event: asyncio.Event, timeout: float) -> None:
        """Until the engine reports a change (or ``timeout``); the event is clear after."""
        try:
            await asyncio.wait_for(event.wait(), timeout)
        except TimeoutError:
            pass
        event.clear()

    @contextlib.contextmanager
    def waiter(self) -> Iterator[asyncio.Event]:
        self._loop = asyncio.get_running_loop()
        event = asyncio.Event()
        self._events.add(event)
        try:
            yield event
        finally:
            self._events.discard(event)


async def _wait_all(engine: RequestEngine, wakeups: Wakeups, choices: list[Choice], request: Request,
                    timer: RequestTimer | None) -> bool:
    """Until every choice is done; False when the client went away (each then cancelled)."""
    last_check = time.monotonic()
    try:
        with wakeups.waiter() as event:
            while not all(ch.completion.done for ch in choices):
                await wakeups.wait(event, DISCONNECT_CHECK_S)
                if timer is not None:
                    timer.update(choices)
                if time.monotonic() - last_check > DISCONNECT_CHECK_S:
                    last_check = time.monotonic()
                    if await request.is_disconnected():
                        for ch in choices:
                            engine.cancel(ch.completion.id)
                        return False
    except asyncio.CancelledError:
        for ch in choices:
            engine.cancel(ch.completion.id)
        raise
    if timer is not None:
        timer.update(choices)
    return True


def _raise_failed(choices: list[Choice]) -> None:
    for ch in choices:
        if ch.completion.status == "failed" and ch.completion.error is not None:
            raise ch.completion.error


# -- the routes -------------------------------------------------------------------------------------

def _prompts(prompt: Any, served: ServedModel) -> tuple[list[list[int]], list[str | None]]:
    """Every prompt's ids, and its text when given as text."""
    many = isinstance(prompt, list) and len(prompt) > 0 and isinstance(prompt[0], (list, str))
    items = list(prompt) if many else [prompt]
    return [_prompt_ids(x, served) for x in items], [x if isinstance(x, str) else None for x in items]


def _content(message: Any) -> dict[str, Any]:
    """A chat message for the template: text parts joined into one string."""
    out = message.model_dump(exclude_none=True)
    if isinstance(message.content, list):
        texts = [part.get("text") for part in message.content if part.get("type") == "text"]
        if len(texts) != len(message.content) or not all(isinstance(t, str) for t in texts):
            raise InvalidCompletionRequest("messages", "only text content parts are supported")
        out["content"] = "".join(str(t) for t in texts)
    return out


class Routes:
    """The routes of one served model over the coordinator's :class:`RequestEngine`."""

    def __init__(self, controller: Any, engine: RequestEngine, served: ServedModel, metrics: ServingMetrics | None):
        self.controller, self.engine, self.served, self.metrics = controller, engine, served, metrics
        self.wakeups = Wakeups(engine)
        self.created = int(time.time())
        self.tokenizing = anyio.CapacityLimiter(TOKENIZING_THREADS)

    async def _off_the_loop(self, fn: Callable[..., Any], *args: Any) -> Any:
        """``fn(*args)`` on one of ``TOKENIZING_THREADS`` worker threads (waiting for one without
        blocking): tokenizing is CPU work, and the event loop answers every route meanwhile."""
        return await anyio.to_thread.run_sync(fn, *args, limiter=self.tokenizing)

    def router(self) -> APIRouter:
        r = APIRouter(tags=["completions"], route_class=OpenAIRoute)
        r.add_api_route("/v1/models", self.models, methods=["GET"], responses=ERRORS)
        r.add_api_route("/v1/completions", self.completions, methods=["POST"], responses={200: STREAMED, **ERRORS})
        r.add_api_route("/v1/chat/completions", self.chat, methods=["POST"], responses={200: STREAMED, **ERRORS})
        r.add_api_route("/tokenize", self.tokenize, methods=["POST"], responses=ERRORS)
        r.add_api_route("/detokenize", self.detokenize, methods=["POST"], responses=ERRORS)
        r.add_api_route("/health", self.health, methods=["GET"], responses={503: {"description": "cannot decode"}})
        for method in ("GET", "POST"):
            r.add_api_route("/ping", self.health, methods=[method], operation_id=f"ping_{method.lower()}",
                            responses={503: {"description": "cannot decode"}})
        r.add_api_route("/version", self.version, methods=["GET"])
        return r

    # -- probes ----------------------------------------------------------------------------------
    def models(self) -> dict[str, Any]:
        """The model this deployment serves."""
        return {"object": "list", "data": [{
            "id": self.served.name, "object": "model", "created": self.created, "owned_by": "elastic-ep",
            "root": self.served.root, "parent": None, "max_model_len": self.served.max_model_len,
            "vocab_size": self.served.vocab_size}]}

    def health(self) -> Response:
        """200 while the deployment decodes or an operation pauses it; 503 when failed."""
        health = self.engine.gate.serving_health()
        return Response(status_code=200 if health in ("ok", "paused") else 503)

    def version(self) -> dict[str, str]:
        from importlib.metadata import version

        return {"version": version("elastic-ep")}

    async def tokenize(self, body: dict[str, Any]) -> dict[str, Any]:
        """``{"prompt": text}`` or ``{"messages": [...]}`` to token ids (vLLM's ``/tokenize``)."""
        result: dict[str, Any] = await self._off_the_loop(self._tokenize, body)
        return result

    def _tokenize(self, body: dict[str, Any]) -> dict[str, Any]:
        self._need_tokenizer("prompt")
        self._same_model(body)
        if "messages" in body:
            try:
                chat = ChatRequest.model_validate({**body, "model": self.served.name})  # its model checked above
            except ValidationError as exc:  # a 400 naming the field, as on /v1/chat/completions (it was a 500)
                raise RequestValidationError(exc.errors()) from None
            ids = self._chat_ids(chat)
        else:
            if not isinstance(body.get("prompt"), str):
                raise InvalidCompletionRequest("prompt", "a string")
            ids = self.served.encode(_unicode(body["prompt"], "prompt"),
                                     add_special_tokens=body.get("add_special_tokens", True) is not False)
        return {"count": len(ids), "max_model_len": self.served.max_model_len, "tokens": ids}

    async def detokenize(self, body: dict[str, Any]) -> dict[str, Any]:
        """``{"tokens": [ids]}`` to text (vLLM's ``/detokenize``)."""
        result: dict[str, Any] = await self._off_the_loop(self._detokenize, body)
        return result

    def _detokenize(self, body: dict[str, Any]) -> dict[str, Any]:
        self._need_tokenizer("tokens")
        self._same_model(body)
        tokens = body.get("tokens")
        if not isinstance(tokens, list) or not all(isinstance(t, int) and not isinstance(t, bool) for t in tokens):
            raise InvalidCompletionRequest("tokens", "a list of token ids")
        _prompt_ids(tokens or [0], self.served, "tokens")
        return {"prompt": self.served.detokenize(tokens)}

    def _same_model(self, body: dict[str, Any]) -> None:
        """As vLLM's /tokenize and /detokenize: a body that names another model is a 404."""
        if body.get("model") is not None and body["model"] != self.served.name:
            raise ModelNotFound(str(body["model"]), self.served.name)

    def _need_tokenizer(self, field: str) -> None:
        if self.served.tokenizer is None:
            raise InvalidCompletionRequest(field, "this model has no tokenizer")

    def _chat_ids(self, body: ChatRequest) -> list[int]:
        return self.served.encode(_unicode(self._chat_text(body), "messages"), add_special_tokens=False)

    def _chat_text(self, body: ChatRequest) -> str:
        messages = [_content(m) for m in body.messages]
        kwargs = body.chat_template_kwargs or {}
        _check_template_kwargs(kwargs)
        try:
            return self.served.chat_prompt(messages, body.add_generation_prompt is not False, kwargs)
        except ValueError as exc:
            raise InvalidCompletionRequest("messages", str(exc)) from None
        except Exception as exc:  # noqa: BLE001 - a template's own error (jinja) names what it wanted
            raise InvalidCompletionRequest("messages", f"the chat template failed: {exc}") from None

    # -- completions -----------------------------------------------------------------------------
    def _start(self, body: SamplingFields, prompts: list[list[int]], logprobs: int | None,
               request: Request) -> tuple[list[Choice], dict[str, str], RequestTimer | None]:
        ignored = _check_supported(body)
        choices = _submit(self.engine, self.served, body, _specs(body, prompts, self.served, self.engine, logprobs))
        # the client's own id, cut as RequestIdHeader cuts it on every other route (it was echoed whole)
        headers = {"X-Request-Id": (request.headers.get("x-request-id") or "")[:REQUEST_ID_CHARS] or choices[0].completion.id}
        if ignored:
            headers["X-Ignored-Fields"] = ",".join(ignored)[:IGNORED_SHOWN_CHARS]
        timer = self.metrics.timer() if self.metrics is not None else None
        return choices, headers, timer

    async def _finish(self, choices: list[Choice], request: Request, timer: RequestTimer | None) -> JSONResponse | None:
        """Wait for every choice; an error response when the client left or a choice failed."""
        if not await _wait_all(self.engine, self.wakeups, choices, request, timer):
            return error_response(OpenAIError(499, "the client went away", code="cancelled"))
        _raise_failed(choices)
        if timer is not None:
            timer.finish(choices)
        return None

    async def completions(self, body: CompletionRequest, request: Request) -> Any:
        """Generate up to ``max_tokens`` tokens for every prompt, ``n`` choices each; ``stream``
        sends them as they come."""
        if body.echo and body.logprobs is not None:
            raise InvalidCompletionRequest("echo", "echo with logprobs needs the prompt's log-probabilities, which this "
                                           "server does not compute")
        # tokenizing is CPU work (1 s for a 1 MiB text prompt): on a thread, not the event loop, which
        # answers every other request (/healthz and /scale too) meanwhile
        prompts, texts = await self._off_the_loop(_prompts, body.prompt, self.served)
        choices, headers, timer = self._start(body, prompts, body.logprobs, request)
        echoes = [self._echo(texts[ch.prompt_index], prompts[ch.prompt_index]) if body.echo else "" for ch in choices]
        if body.stream:
            events = self._completion_events(body, choices, echoes, request, timer)
            return StreamingResponse(events, media_type="text/event-stream", headers={"Cache-Control": "no-cache", **headers})
        failed = await self._finish(choices, request, timer)
        if failed is not None:
            return failed
        out = []
        for ch, echo in zip(choices, echoes):
            c = ch.completion
            choice = {"index": ch.index, "text": echo + ch.view.text(c.tokens, final=True), "token_ids": list(c.tokens),
                      "logprobs": self._logprobs(c, 0, len(c.tokens), len(echo)),
                      "finish_reason": _finish_reason(c), "stop_reason": _stop_reason(ch, body)}
            if body.return_token_ids:
                choice["prompt_token_ids"] = list(c.spec.prompt)
            out.append(choice)
        return JSONResponse({"id": choices[0].completion.id, "object": "text_completion", "created": int(time.time()),
                             "model": body.model, "choices": out, "usage": _usage(choices),
                             "elastic_ep": {"replays": max(ch.completion.replays for ch in choices)}}, headers=headers)

    def _echo(self, text: str | None, prompt: list[int]) -> str:
        return text if text is not None else self.served.detokenize(prompt)

    def _logprobs(self, c: Completion, start: int, end: int, offset: int) -> dict[str, Any] | None:
        if c.spec.logprobs is None:
            return None
        names = [self.served.token_text(t) for t in c.tokens[start:end]]
        offsets = [offset + sum(len(n) for n in names[:i]) for i in range(len(names))]
        return {"tokens": names, "token_ids": c.tokens[start:end], "token_logprobs": c.logprobs[start:end],
                "top_logprobs": [{self.served.token_text(t): v for t, v in top} for top in c.top_logprobs[start:end]],
                "text_offset": offsets}

    async def _completion_events(self, body: CompletionRequest, choices: list[Choice], echoes: list[str],
                                 request: Request, timer: RequestTimer | None) -> AsyncIterator[str]:
        base = {"id": choices[0].completion.id, "object": "text_completion", "model": body.model}
        offsets = [len(e) for e in echoes]
        for ch, echo in zip(choices, echoes):
            if echo:
                yield sse({**base, "created": int(time.time()), "choices": [{
                    "index": ch.index, "text": echo, "token_ids": [], "logprobs": None, "finish_reason": None}]})
        async for ch, piece, start, end, done in self._pieces(choices, body, timer):
            c = ch.completion
            chunk = {**base, "created": int(time.time()), "choices": [{
                "index": ch.index, "text": piece, "token_ids": c.tokens[start:end],
                "logprobs": self._logprobs(c, start, end, offsets[ch.index]),
                "finish_reason": _finish_reason(c) if done else None, "stop_reason": _stop_reason(ch, body) if done else None}]}
            offsets[ch.index] += len(piece)
            if done:
                chunk["elastic_ep"] = {"replays": c.replays}
            yield sse(_with_usage(chunk, body, choices))
        async for event in self._tail(body, base, choices, timer):
            yield event

    async def _tail(self, body: SamplingFields, base: dict[str, Any], choices: list[Choice],
                    timer: RequestTimer | None) -> AsyncIterator[str]:
        failed = next((ch.completion.error for ch in choices if ch.completion.error is not None), None)
        if failed is not None:
            err = _openai_error(failed)
            assert err is not None
            body_ = err.body()
            body_["error"]["retry_after_s"] = getattr(failed, "retry_after_s", None)
            yield sse(body_)
        elif body.stream_options is not None and body.stream_options.include_usage:
            yield sse({**base, "created": int(time.time()), "choices": [], "usage": _usage(choices)})
        if timer is not None and failed is None:
            timer.finish(choices)
        yield "data: [DONE]\n\n"

    async def _pieces(self, choices: list[Choice], body: SamplingFields,
                      timer: RequestTimer | None) -> AsyncIterator[tuple[Choice, str, int, int, bool]]:
        """``(choice, new text, first token, end token, done)`` as tokens come, until every choice
        is done or one failed; the choices left are cancelled if the stream ends early."""
        sent = [0] * len(choices)
        sent_text = [""] * len(choices)
        over = [False] * len(choices)
        try:
            with self.wakeups.waiter() as event:
                while not all(over):
                    if timer is not None:
                        timer.update(choices)
                    for ch in choices:
                        c = ch.completion
                        if over[ch.index]:
                            continue
                        if c.status == "failed":
                            return
                        done, end = c.done, len(c.tokens)
                        if end > sent[ch.index] or done:
                            text = ch.view.text(c.tokens[:end], final=done)
                            piece = text[len(sent_text[ch.index]):] if text.startswith(sent_text[ch.index]) else ""
                            yield ch, piece, sent[ch.index], end, done
                            sent[ch.index], sent_text[ch.index] = end, sent_text[ch.index] + piece
                            over[ch.index] = done
                    if not all(over):
                        await self.wakeups.wait(event, DISCONNECT_CHECK_S)
        finally:
            for ch in choices:
                if not ch.completion.done:  # the client went away mid-stream: its slot is freed
                    self.engine.cancel(ch.completion.id)

    # -- chat ------------------------------------------------------------------------------------
    async def chat(self, body: ChatRequest, request: Request) -> Any:
        """The messages rendered with the tokenizer's chat template, completed; ``stream`` sends
        ``chat.completion.chunk`` deltas."""
        self._need_tokenizer("messages")
        ids: list[int] = await self._off_the_loop(self._chat_ids, body)  # the template and the tokenizer
        if not ids:
            raise InvalidCompletionRequest("messages", "the rendered conversation encodes to no tokens")
        logprobs = (body.top_logprobs or 0) if body.logprobs else None
        choices, headers, timer = self._start(body, [_prompt_ids(ids, self.served, "messages")], logprobs, request)
        if body.stream:
            events = self._chat_events(body, choices, timer)
            return StreamingResponse(events, media_type="text/event-stream", headers={"Cache-Control": "no-cache", **headers})
        failed = await self._finish(choices, request, timer)
        if failed is not None:
            return failed
        out = [{"index": ch.index, "message": {"role": "assistant", "content": ch.view.text(ch.completion.tokens, final=True)},
                "logprobs": self._chat_logprobs(ch.completion, 0, len(ch.completion.tokens)),
                "finish_reason": _finish_reason(ch.completion), "stop_reason": _stop_reason(ch, body)} for ch in choices]
        return JSONResponse({"id": "chat" + choices[0].completion.id, "object": "chat.completion",
                             "created": int(time.time()), "model": body.model, "choices": out, "usage": _usage(choices)},
                            headers=headers)

    def _chat_logprobs(self, c: Completion, start: int, end: int) -> dict[str, Any] | None:
        if c.spec.logprobs is None:
            return None
        def entry(token: int, logprob: float | None) -> dict[str, Any]:
            name = self.served.token_text(token)
            return {"token": name, "logprob": logprob, "bytes": list(name.encode())}
        return {"content": [{**entry(t, lp), "top_logprobs": [entry(a, v) for a, v in top]}
                            for t, lp, top in zip(c.tokens[start:end], c.logprobs[start:end], c.top_logprobs[start:end])]}

    async def _chat_events(self, body: ChatRequest, choices: list[Choice], timer: RequestTimer | None) -> AsyncIterator[str]:
        base = {"id": "chat" + choices[0].completion.id, "object": "chat.completion.chunk", "model": body.model}
        for ch in choices:
            yield sse({**base, "created": int(time.time()), "choices": [{
                "index": ch.index, "delta": {"role": "assistant", "content": ""}, "logprobs": None, "finish_reason": None}]})
        async for ch, piece, start, end, done in self._pieces(choices, body, timer):
            c = ch.completion
            yield sse(_with_usage({**base, "created": int(time.time()), "choices": [{
                "index": ch.index, "delta": {"content": piece} if piece or not done else {},
                "logprobs": self._chat_logprobs(c, start, end), "finish_reason": _finish_reason(c) if done else None,
                "stop_reason": _stop_reason(ch, body) if done else None}]},
                body, choices))
        async for event in self._tail(body, base, choices, timer):
            yield event


def _with_usage(chunk: dict[str, Any], body: SamplingFields, choices: list[Choice]) -> dict[str, Any]:
    """``stream_options.continuous_usage_stats``: the usage so far in every chunk (vLLM's)."""
    if body.stream_options is not None and body.stream_options.continuous_usage_stats:
        chunk["usage"] = _usage(choices)
    return chunk


def sse(data: Any) -> str:
    return f"data: {json.dumps(data)}\n\n"


#: the paths of these routes, for the body limit (a prompt /v1 takes can be tokenized too)
PREFIXES = ("/v1/", "/tokenize", "/detokenize")


def _oversized(message: str) -> tuple[int, dict[str, Any]]:
    """An oversized body on these routes: 400 in OpenAI's shape, as every other bad body here."""
    return 400, OpenAIError(400, message, code="invalid_request").body()


def completion_routes(controller: Any, metrics: ServingMetrics | None = None, body_limits: dict[str, int] | None = None,
                      body_refusals: dict[str, Refusal] | None = None) -> APIRouter:
    """The OpenAI routes over ``controller.requests`` (a :class:`RequestEngine`); ``body_limits``
    and ``body_refusals`` (the app's :class:`~elastic.service.preflight.BodyLimit` tables) get the
    limit of these routes (it follows the model's context) and their refusal (OpenAI's shape)."""
    engine: RequestEngine = controller.requests
    served = ServedModel.of(controller.config.model, controller.config.serving.model_name)
    engine.detokenize = served.detokenize if served.tokenizer is not None else None
    limit = (1 << 20) + 16 * served.max_model_len * BYTES_PER_TOKEN
    for prefix in PREFIXES:
        if body_limits is not None:
            body_limits[prefix] = max(body_limits.get(prefix, 0), limit)
        if body_refusals is not None:
            body_refusals[prefix] = _oversized
    return Routes(controller, engine, served, metrics).router()


class RequestIdHeader:
    """ASGI middleware: every response carries ``x-request-id``, the request's own when it sent one
    (as vLLM echoes it), else a fresh id; a route that set one (a completion's id) keeps it."""

    def __init__(self, app: Any):
        self.app = app

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        given = dict(scope.get("headers") or ()).get(b"x-request-id")
        rid = given[:REQUEST_ID_CHARS] if given else f"req-{uuid.uuid4().hex[:20]}".encode()

        async def tagged(message: Any) -> None:
            if message["type"] == "http.response.start":
                headers = list(message.get("headers") or [])
                if not any(k.lower() == b"x-request-id" for k, _ in headers):
                    message = {**message, "headers": [*headers, (b"x-request-id", rid)]}
            await send(message)

        await self.app(scope, receive, tagged)
