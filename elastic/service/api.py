"""The scale API: a FastAPI app over a coordinator (``elastic-ep serve`` runs it: :mod:`elastic.service.server`).

What it does better than a blocking scale call behind a global 503:

- ``POST /scale`` answers at once: **202** with the operation (id, target, phase) while the
  scale runs in the background; **200** when the size is already right (a no-op operation);
  **409** naming the operation in progress, or for a stale ``expected_generation``;
  **422** with the reason for a bad body or size. An ``idempotency_key`` (body field or
  ``Idempotency-Key`` header) makes retries safe: the same key returns the same operation.
- ``GET /operations/{id}`` shows the phase, per-phase timings, effective and pending size,
  the error (if it failed) and the ranks safe to release after a scale down.
- The control API is never globally unavailable: ``/healthz`` and ``/state`` always answer
  200 (over the HTTP connection cap too: :mod:`elastic.service.http_guard`) and say whether
  decoding is serving (only ``rescaling`` pauses it; ``draining`` and
  ``suppressed`` keep decoding). After a failure ``POST /recover`` brings the group back.
- Errors are ``{"error": code, "message": text, ...fields}`` everywhere, including 404/405/422.

``create_app(controller)`` takes a :class:`~elastic.control.coordinator.Coordinator` (or anything with
its methods). Every app gets its own Prometheus registry.

Handlers that may wait run on bounded thread pools of their own, not on the server's shared
one, so no number of slow calls delays the others: ``/rebalance`` and ``/placement`` (they wait
on every rank, up to their ``timeout_s``) on ``control_threads`` threads, and a call that finds
them all busy gets **429** with ``Retry-After`` at once; ``/scale`` and ``/recover`` (a recovery
first waits for the workers to settle) on as many again, queued; ``/healthz``, ``/state`` and
``/metrics`` on a small pool of their own, so a liveness probe never waits on a control call.
"""

from __future__ import annotations

import functools
import hmac
import logging
import time
from collections.abc import Callable
from typing import Any

import anyio
from fastapi import FastAPI, Header, Query, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from pydantic import BaseModel, ConfigDict, Field, StrictInt
from starlette.exceptions import HTTPException as StarletteHTTPException

from elastic.control.plane import ControlPlane
from elastic.core.errors import (
    ElasticError,
    InvalidCompletionRequest,
    InvalidScaleRequest,
    InvalidTransition,
    ModelNotFound,
    Overloaded,
    RebalanceFailed,
    RequestNotServed,
    StaleGeneration,
)
from elastic.core.phases import SERVING_PHASES
from elastic.service.autoscaler import Autoscaler
from elastic.service.hooks import ScaleHooks
from elastic.service.metrics import ServingMetrics, build_registry
from elastic.service.openai_protocol import OpenAIError
from elastic.service.preflight import BodyLimit, Refusal, invalid_body, unparsable_body

__all__ = ["CONTROL_THREADS", "create_app"]

log = logging.getLogger("elastic.service.api")

SERVING_STATES = frozenset(str(phase) for phase in SERVING_PHASES)  # a controller without heartbeats
SERVING_NOTE = ("Decoding keeps running in draining, suppressed and resuming; only rescaling pauses it "
                "(the pause of each scale is its operation's paused_seconds). The control API itself never "
                "stops answering.")
KEY_PATTERN = r"^[!-~]{1,200}$"  # printable ASCII, no spaces


# -- bodies and views ---------------------------------------------------------------------------

class ScaleRequest(BaseModel):
    model_config = ConfigDict(extra="forbid", json_schema_extra={"examples": [{"ep_size": 4}]})

    ep_size: StrictInt = Field(..., ge=1, description="the EP size to scale to")
    expected_generation: StrictInt | None = Field(
        None, ge=0, description="refuse (409) unless the group is still at this generation (optimistic concurrency)")
    idempotency_key: str | None = Field(
        None, pattern=KEY_PATTERN, description="retries with the same key return the same operation")


class ErrorBody(BaseModel):
    model_config = ConfigDict(extra="allow")

    error: str = Field(description="a stable snake_case code")
    message: str = Field(description="what went wrong, for a person")


class PhaseTiming(BaseModel):
    model_config = ConfigDict(extra="allow")

    started: float
    ended: float | None = None
    seconds: float | None = None


class OperationView(BaseModel):
    model_config = ConfigDict(extra="allow")

    id: str
    kind: str = Field(description="scale | recover")
    status: str = Field(description="pending | running | succeeded | failed | noop")
    phase: str
    target_size: int
    from_size: int
    effective_size: int = Field(description="ranks serving the model now, as far as this operation goes")
    pending_size: int | None = Field(description="the size this operation is still moving to; null once it ended")
    generation_before: int
    generation_after: int | None = None
    phases: dict[str, PhaseTiming] = Field(description="per-phase monotonic start, end and seconds")
    error: str | None = None
    released_ranks: list[int] = Field(default_factory=list)
    ranks_safe_to_release: list[int] = Field(default_factory=list, description="old ranks retired by a finished scale down")
    created_at: float
    finished_at: float | None = None
    idempotency_key: str | None = None
    bytes_moved: int = 0
    paused_seconds: float | None = None
    hooks: list[dict[str, Any]] = Field(default_factory=list, description="before/after hook results")


class OperationList(BaseModel):
    operations: list[OperationView]


class StateView(BaseModel):
    model_config = ConfigDict(extra="allow")

    state: str
    generation: int
    ep_size: int
    serving: bool = Field(description="decoding runs: every rank of the serving group says so in its last heartbeat "
                          "(false in rescaling; in failed it depends on whether the group still decodes)")
    decoding_paused: bool
    note: str
    balancedness: float | None = None
    in_flight_layer: int | None = None
    operation: OperationView | None = None
    failure_reason: str | None = None
    history: list[dict[str, Any]] = Field(default_factory=list)
    autoscaler: dict[str, Any] | None = None


class Health(BaseModel):
    status: str
    state: str
    serving: bool
    generation: int
    note: str


class RebalanceResult(BaseModel):
    started: bool = Field(description="every rank confirmed a rebalance is under way: the requested one, or one already "
                          "running (false: draining or suppressed)")
    confirmed: bool = Field(True, description="false when the ranks did not all confirm within timeout_s "
                            "(the request still reaches them at their next step boundary)")
    message: str | None = None


ERRORS: dict[int, dict[str, Any]] = {code: {"model": ErrorBody} for code in (404, 409, 422)}
ERRORS[429] = {"model": ErrorBody, "description": "every control thread is busy; retry after Retry-After"}


# -- errors -------------------------------------------------------------------------------------

def _status_for(exc: ElasticError) -> int:
    if isinstance(exc, (InvalidScaleRequest, InvalidCompletionRequest)):
        return 422
    if isinstance(exc, ModelNotFound):
        return 404
    if isinstance(exc, RequestNotServed):
        return 429 if isinstance(exc, Overloaded) else 503
    if isinstance(exc, RebalanceFailed):
        return 503  # a rank failed: the deployment cannot rebalance now (GET /state says why)
    if isinstance(exc, (StaleGeneration, InvalidTransition)):
        return 409
    return 409


def _error_body(exc: ElasticError) -> dict[str, Any]:
    body = exc.to_dict()
    if isinstance(exc, StaleGeneration):
        body["message"] = (f"expected_generation={exc.expected} but the group is at generation {exc.actual}: "
                           f"re-read GET /state and decide again")
        body["current_generation"] = exc.actual
    return body


def _error(status: int, code: str, message: str, **fields: Any) -> JSONResponse:
    return JSONResponse({"error": code, "message": message, **fields}, status_code=status)


def _validation_errors(errors: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [{"loc": [str(part) for part in e.get("loc", ())], "msg": str(e.get("msg", "")), "type": str(e.get("type", ""))}
            for e in errors]


# -- the pools the handlers run on ---------------------------------------------------------------

CONTROL_THREADS = 8  # /rebalance and /placement at once (more get 429); /scale and /recover too (queued)
READ_THREADS = 4  # /healthz, /state, /metrics: never behind a control call


def _on_pool(threads: int, *, refuse_when_full: bool) -> Callable[[Callable[..., Any]], Any]:
    """Run a blocking handler on a pool of ``threads`` threads of its own, not the server's shared one.

    FastAPI reads the parameters from the wrapped function (``functools.wraps``); the wrapper is a
    coroutine, so the event loop only hands the call over. With ``refuse_when_full``, a call that
    finds every thread taken is answered 429 at once instead of queueing behind them (the place is
    taken without an await, so no burst of callers can all see a free one)."""
    limiter = anyio.CapacityLimiter(threads)
    admitted = anyio.CapacityLimiter(threads) if refuse_when_full else None

    def wrap(handler: Callable[..., Any]) -> Callable[..., Any]:
        @functools.wraps(handler)
        async def run(*args: Any, **kwargs: Any) -> Any:
            call = functools.partial(handler, *args, **kwargs)
            if admitted is None:
                return await anyio.to_thread.run_sync(call, limiter=limiter)
            borrower = object()
            try:
                admitted.acquire_on_behalf_of_nowait(borrower)
            except anyio.WouldBlock:
                return JSONResponse({"error": "busy", "message": f"all {threads} control calls are in progress; "
                                     "retry shortly"}, status_code=429, headers={"Retry-After": "1"})
            try:
                return await anyio.to_thread.run_sync(call, limiter=limiter)
            finally:
                admitted.release_on_behalf_of(borrower)
        return run
    return wrap


# -- the app ------------------------------------------------------------------------------------

class RequireApiKey:
    """ASGI middleware: every request that changes something (any method but GET, HEAD, OPTIONS)
    must carry ``Authorization: Bearer KEY``, as vLLM's ``--api-key`` asks, and so must every ``/v1/``
    route, reads included; otherwise 401 and nothing is read or done. Reading the control plane
    (state, metrics, operations) stays open."""

    SAFE = frozenset({"GET", "HEAD", "OPTIONS"})

    def __init__(self, app: Any, key: str):
        self.app = app
        self._expected = f"Bearer {key}".encode()

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] == "http" and (scope["method"] not in self.SAFE or scope["path"].startswith("/v1/")):
            given = dict(scope.get("headers") or ()).get(b"authorization", b"")
            if not hmac.compare_digest(given, self._expected):
                message = (f"{scope['method']} {scope['path']} needs the header 'Authorization: Bearer <api key>' "
                           "(serve --api-key or ELASTIC_EP_API_KEY)")
                body: dict[str, Any] = {"error": "unauthorized", "message": message}
                if _openai_path(scope["path"]):  # the serving routes answer in OpenAI's shape (/tokenize too)
                    body = {"error": {"message": message, "type": "authentication_error", "param": None,
                                      "code": "unauthorized"}}
                response = JSONResponse(body, status_code=401, headers={"WWW-Authenticate": "Bearer"})
                await response(scope, receive, send)
                return
        await self.app(scope, receive, send)


def create_app(controller: ControlPlane, *, autoscaler: Autoscaler | None = None, hooks: ScaleHooks | None = None,
               title: str = "elastic-ep", api_key: str | None = None, control_threads: int = CONTROL_THREADS) -> FastAPI:
    """The scale API over ``controller`` (a :class:`~elastic.control.coordinator.Coordinator`); with
    ``api_key``, every request that changes something must present it (:class:`RequireApiKey`).
    At most ``control_threads`` control calls run at once (module docstring)."""
    app = FastAPI(title=title, version="1", description=__doc__.split("\n\n")[1] if __doc__ else "")
    control = _on_pool(control_threads, refuse_when_full=True)
    operations = _on_pool(control_threads, refuse_when_full=False)
    reads = _on_pool(READ_THREADS, refuse_when_full=False)
    registry = build_registry(controller, autoscaler)
    serving_metrics = ServingMetrics(registry)  # exported (at 0) even without a model to serve: one dashboard
    app.state.controller, app.state.autoscaler, app.state.hooks, app.state.registry = controller, autoscaler, hooks, registry
    body_limits: dict[str, int] = {}  # a path prefix's own limit (/v1/: the model's context, set by its routes)
    body_refusals: dict[str, Refusal] = {}  # a path prefix's own refusal of a body past it (/v1/: OpenAI's shape)
    app.add_middleware(BodyLimit, prefixes=body_limits, refusals=body_refusals)  # an oversized body is refused before it is read and parsed
    if api_key:
        app.add_middleware(RequireApiKey, key=api_key)  # outermost: checked before the body is read

    view = functools.partial(_operation_view, hooks)
    _add_error_handlers(app)
    _add_operation_routes(app, controller, view, operations=operations, control=control)
    _add_state_routes(app, controller, view, autoscaler, registry, reads=reads)
    if controller.requests is not None:
        from elastic.service.completions import RequestIdHeader, completion_routes

        app.include_router(completion_routes(controller, serving_metrics, body_limits, body_refusals))
        app.add_middleware(RequestIdHeader)  # x-request-id on every response

    _add_autoscaler_routes(app, autoscaler)
    return app


def _operation_view(hooks: ScaleHooks | None, op: dict[str, Any]) -> dict[str, Any]:
    """An operation as the API shows it: with the ranks safe to release and its hooks' results."""
    out = dict(op)
    out["ranks_safe_to_release"] = list(op.get("released_ranks") or []) if op.get("status") == "succeeded" else []
    out["hooks"] = hooks.results(op["id"]) if hooks is not None else []
    return out


def _add_error_handlers(app: FastAPI) -> None:
    # one body shape everywhere ----------------------------------------------
    @app.exception_handler(RequestValidationError)
    async def _invalid(request: Request, exc: RequestValidationError) -> JSONResponse:
        raw = list(exc.errors())
        errors = _validation_errors(raw)
        first = errors[0] if errors else {"loc": [], "msg": "invalid request"}
        where = ".".join(first["loc"]) or "request"
        message = (invalid_body(raw[0]) if raw else None) or f"{where}: {first['msg']}"
        return _error(422, "invalid_request", message, errors=errors)

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        if exc.status_code == 400:  # FastAPI could not parse the body (e.g. not UTF-8): an invalid body, like the rest
            # a chunked body past the limit (elastic.service.preflight.BodyLimit), JSON nested too deeply, not UTF-8
            return _error(422, "invalid_request", unparsable_body(exc.__cause__, str(exc.detail)), errors=[])
        codes = {404: "not_found", 405: "method_not_allowed"}
        code, message = codes.get(exc.status_code, "http_error"), f"{request.method} {request.url.path}: {exc.detail}"
        body: dict[str, Any] = {"error": code, "message": message}
        if _openai_path(request.url.path):  # an absent route (/v1/embeddings) or method: the openai client shows why
            body = OpenAIError(exc.status_code, message, code=code).body()
        return JSONResponse(body, status_code=exc.status_code, headers=getattr(exc, "headers", None))

    @app.exception_handler(ElasticError)
    async def _elastic(request: Request, exc: ElasticError) -> JSONResponse:
        headers = {"Retry-After": str(exc.retry_after_s)} if isinstance(exc, RequestNotServed) else None
        return JSONResponse(_error_body(exc), status_code=_status_for(exc), headers=headers)

    @app.exception_handler(Exception)
    async def _crash(request: Request, exc: Exception) -> JSONResponse:
        log.exception("%s %s failed", request.method, request.url.path)
        if _openai_path(request.url.path):
            return JSONResponse(OpenAIError(500, f"{type(exc).__name__}: {exc}", code="internal_error").body(), status_code=500)
        return _error(500, "internal_error", f"{type(exc).__name__}: {exc}")


#: the serving routes (vLLM's and OpenAI's), whose every error has OpenAI's shape
OPENAI_PATHS = ("/v1/", "/tokenize", "/detokenize")


def _openai_path(path: str) -> bool:
    return path.startswith(OPENAI_PATHS[0]) or path in OPENAI_PATHS[1:]


def _add_operation_routes(app: FastAPI, controller: ControlPlane, view: Callable[[dict[str, Any]], dict[str, Any]], *,
                          operations: Callable[..., Any], control: Callable[..., Any]) -> None:
    """/scale and /operations (then the other control routes)."""
    def get_op(op_id: str) -> dict[str, Any] | None:  # looked up per call: a controller may lack it until used
        return controller.get_operation(op_id)

    # -- scale --------------------------------------------------------------------------------
    @app.post("/scale", status_code=202, response_model=OperationView, tags=["scale"],
              responses={200: {"model": OperationView, "description": "already at that size: a no-op operation"},
                         202: {"description": "accepted: the scale runs in the background; poll GET /operations/{id}"},
                         409: {"model": ErrorBody, "description": "another operation is in progress (named), the "
                               "machine is failed, or expected_generation is stale"},
                         422: {"model": ErrorBody, "description": "invalid body or size"}})
    @operations
    def scale(body: ScaleRequest,
              idempotency_key_header: str | None = Header(None, alias="Idempotency-Key", pattern=KEY_PATTERN,
                                                          description="same as the body's idempotency_key")) -> Any:
        """Start a scale to ``ep_size`` ranks and answer at once."""
        key = body.idempotency_key
        if idempotency_key_header is not None:
            if key is not None and key != idempotency_key_header:
                return _error(422, "invalid_request", "the Idempotency-Key header and the body's idempotency_key differ",
                              field="idempotency_key")
            key = idempotency_key_header
        asked = time.time()
        op = controller.scale(body.ep_size, expected_generation=body.expected_generation, idempotency_key=key, wait=False)
        data = get_op(op.id) or op.to_dict()
        replayed = key is not None and data["created_at"] < asked
        if replayed and (data["kind"] != "scale" or data["target_size"] != body.ep_size):
            return _error(422, "idempotency_key_reused",
                          f"idempotency key {key!r} was used for operation {data['id']} (scale to {data['target_size']}); "
                          f"use a new key for a different request", operation_id=data["id"], field="idempotency_key")
        headers = {"Location": f"/operations/{data['id']}"}
        if replayed:
            headers["Idempotency-Replayed"] = "true"
        return JSONResponse(OperationView.model_validate(view(data)).model_dump(mode="json"),
                            status_code=200 if data["status"] == "noop" else 202, headers=headers)

    @app.get("/operations/{operation_id}", response_model=OperationView, tags=["scale"], responses={404: ERRORS[404]})
    def get_operation(operation_id: str) -> Any:
        """One operation: phase, per-phase timings, sizes, error, ranks safe to release."""
        data = get_op(operation_id)
        if data is None:
            return _error(404, "operation_not_found", f"no operation {operation_id!r}", operation_id=operation_id)
        return view(data)

    @app.get("/operations", response_model=OperationList, tags=["scale"], responses={422: ERRORS[422]})
    def list_operations(limit: int = Query(50, ge=1, le=1000, description="newest first")) -> Any:
        """Recent operations, newest first."""
        ops = controller.list_operations(limit)
        return {"operations": [view(op) for op in ops]}

    _add_control_routes(app, controller, view, operations=operations, control=control)


def _add_control_routes(app: FastAPI, controller: ControlPlane, view: Callable[[dict[str, Any]], dict[str, Any]], *,
                        operations: Callable[..., Any], control: Callable[..., Any]) -> None:
    """/recover, /rebalance and /placement."""
    def get_op(op_id: str) -> dict[str, Any] | None:  # looked up per call: a controller may lack it until used
        return controller.get_operation(op_id)

    @app.post("/recover", status_code=202, response_model=OperationView, tags=["scale"],
              responses={409: {"model": ErrorBody, "description": "not failed, or an operation is in progress "
                               "(answered at once)"},
                         422: {"model": ErrorBody, "description": "nothing to recover with: no worker of the last "
                               "consistent generation is alive, or too few for a valid group"}})
    @operations
    def recover() -> Any:
        """After a failure: rebuild a consistent group from the living workers (202, in the background)."""
        op = controller.recover(wait=False)
        data = get_op(op.id) or op.to_dict()
        return JSONResponse(OperationView.model_validate(view(data)).model_dump(mode="json"), status_code=202,
                            headers={"Location": f"/operations/{data['id']}"})

    @app.post("/rebalance", response_model=RebalanceResult, tags=["scale"],
              responses={202: {"model": RebalanceResult, "description": "sent, but not confirmed by every rank in time"},
                         409: {"model": ErrorBody, "description": "not running"},
                         503: {"model": ErrorBody, "description": "a rank failed or was lost: the error names it"},
                         422: ERRORS[422], 429: ERRORS[429]})
    @control
    def rebalance(timeout_s: float = Query(30.0, gt=0, le=300, description="how long to wait for the ranks")) -> Any:
        """Start a rebalance on every rank at the next step boundary (200 once every rank confirmed)."""
        try:
            return {"started": bool(controller.rebalance(timeout=timeout_s)), "confirmed": True}
        except ElasticError as exc:
            if isinstance(exc, (InvalidTransition, RebalanceFailed)):
                raise
            # the command is on its way to every rank; what is missing is their confirmation
            return JSONResponse({"started": False, "confirmed": False, "message": str(exc)}, status_code=202)

    @app.get("/placement", tags=["state"],
             responses={200: {"description": "a placement file (JSON, eplb.placement_file): the placement every rank "
                              "routes with and the load window; eplb.initial_placement starts a deployment from it"},
                        409: {"model": ErrorBody, "description": "not running: an operation is moving experts, or the "
                              "deployment failed"},
                        503: {"model": ErrorBody, "description": "the ranks did not all answer (the error names why)"},
                        422: ERRORS[422], 429: ERRORS[429]})
    @control
    def placement(timeout_s: float = Query(30.0, ge=1, le=300, description="how long to wait for the ranks (they "
                                           "answer at their next step boundary)")) -> Any:
        """The current placement and the recorded load window, as a placement file."""
        try:
            return controller.export_placement(timeout=timeout_s)
        except ElasticError as exc:
            if isinstance(exc, InvalidTransition):
                raise  # 409: not running
            return _error(503, "placement_unavailable", str(exc))



def _add_state_routes(app: FastAPI, controller: ControlPlane, view: Callable[[dict[str, Any]], dict[str, Any]],
                      autoscaler: Autoscaler | None, registry: Any, *, reads: Callable[..., Any]) -> None:
    """/state, /healthz, /metrics and /timeline."""
    def state_view() -> dict[str, Any]:
        snap = dict(controller.snapshot())
        snap.setdefault("serving", snap["state"] in SERVING_STATES)  # a controller without heartbeats
        snap["decoding_paused"] = not snap["serving"]
        snap["note"] = SERVING_NOTE
        if snap.get("operation") is not None:
            snap["operation"] = view(snap["operation"])
        snap["autoscaler"] = autoscaler.status() if autoscaler is not None else None
        return snap

    @app.get("/state", response_model=StateView, tags=["state"])
    @reads
    def state() -> Any:
        """State, generation, EP size, balancedness, in-flight layer, serving, history tail."""
        return state_view()

    @app.get("/healthz", response_model=Health, tags=["state"])
    @reads
    def healthz() -> Any:
        """Always 200 while the control plane runs; ``serving`` says whether decoding runs."""
        current = controller.machine.state.value
        serving = controller.snapshot().get("serving", current in SERVING_STATES)
        return {"status": "ok", "state": current, "serving": serving,
                "generation": controller.machine.generation, "note": SERVING_NOTE}

    @app.get("/metrics", response_class=PlainTextResponse, tags=["state"],
             responses={200: {"content": {"text/plain": {"schema": {"type": "string"}}},
                              "description": "Prometheus text exposition"}})
    @reads
    def metrics() -> PlainTextResponse:
        """Prometheus metrics (read from the coordinator at scrape time)."""
        return PlainTextResponse(generate_latest(registry), media_type=CONTENT_TYPE_LATEST)

    @app.get("/timeline", tags=["state"])
    def timeline() -> Any:
        """Scales, recoveries (from the failure to the group's return) and rebalances, with wall-clock
        ``started_at``/``ended_at`` (seconds since the epoch) and a scale's ``pause``: what a load
        generator splits its latencies by."""
        windows = controller.timeline_windows()
        return {"now": time.time(), "windows": sorted((dict(w) for w in windows), key=lambda w: w["started_at"])}



def _add_autoscaler_routes(app: FastAPI, autoscaler: Autoscaler | None) -> None:
    """/autoscaler and its enable / disable (404 without one)."""
    def need_autoscaler() -> Autoscaler | JSONResponse:
        if autoscaler is None:
            return _error(404, "no_autoscaler", "this server runs without an autoscaler (add an autoscaler: section)")
        return autoscaler

    @app.get("/autoscaler", tags=["autoscaler"], responses={404: ERRORS[404]})
    def autoscaler_status() -> Any:
        """The autoscaler: on/off, mode, bounds, the last decision and recent ones."""
        found = need_autoscaler()
        return found if isinstance(found, JSONResponse) else found.status()

    @app.post("/autoscaler/enable", tags=["autoscaler"], responses={404: ERRORS[404]})
    def autoscaler_enable() -> Any:
        found = need_autoscaler()
        if isinstance(found, JSONResponse):
            return found
        found.enable()
        return found.status()

    @app.post("/autoscaler/disable", tags=["autoscaler"], responses={404: ERRORS[404]})
    def autoscaler_disable() -> Any:
        found = need_autoscaler()
        if isinstance(found, JSONResponse):
            return found
        found.disable()
        return found.status()
