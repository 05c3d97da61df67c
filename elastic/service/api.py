"""The scale API: a FastAPI app over a coordinator, a background server, and ``elastic-ep serve``.

What it does better than a blocking scale call behind a global 503:

- ``POST /scale`` answers at once: **202** with the operation (id, target, phase) while the
  scale runs in the background; **200** when the size is already right (a no-op operation);
  **409** naming the operation in progress, or for a stale ``expected_generation``;
  **422** with the reason for a bad body or size. An ``idempotency_key`` (body field or
  ``Idempotency-Key`` header) makes retries safe: the same key returns the same operation.
- ``GET /operations/{id}`` shows the phase, per-phase timings, effective and pending size,
  the error (if it failed) and the ranks safe to release after a scale down.
- The control API is never globally unavailable: ``/healthz`` and ``/state`` always answer
  200 and say whether decoding is serving (only ``rescaling`` pauses it; ``draining`` and
  ``suppressed`` keep decoding). After a failure ``POST /recover`` brings the group back.
- Errors are ``{"error": code, "message": text, ...fields}`` everywhere, including 404/405/422.

``create_app(controller)`` takes a :class:`~elastic.control.coordinator.Coordinator` (or anything with
its methods). Every app gets its own Prometheus registry.
"""

from __future__ import annotations

import copy
import hmac
import logging
import os
import signal
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import uvicorn
from fastapi import FastAPI, Header, Query, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from pydantic import BaseModel, ConfigDict, Field, StrictInt, ValidationError
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
from elastic.deployment import DEFAULT_DEPLOYMENT, DeploymentConfig
from elastic.service.autoscaler import Autoscaler, AutoscalerConfig
from elastic.service.hooks import HooksConfig, ScaleHooks
from elastic.service.logs import ENV_FORMAT
from elastic.service.logs import configure as configure_logging
from elastic.service.metrics import ServingMetrics, build_registry
from elastic.service.preflight import (
    MAX_RANKS,
    BodyLimit,
    BodyTooLarge,
    InputError,
    InputProblem,
    available_memory,
    bound_problems,
    checkpoint_problems,
    hook_problems,
    memory_problems,
    policy_problems,
    read_yaml,
)

__all__ = ["BackgroundServer", "ServeConfig", "create_app", "load_serve_config", "register_cli", "serve"]

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


ERRORS = {code: {"model": ErrorBody} for code in (404, 409, 422)}


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
                if scope["path"].startswith("/v1/"):  # the serving routes answer in OpenAI's shape
                    body = {"error": {"message": message, "type": "authentication_error", "param": None,
                                      "code": "unauthorized"}}
                response = JSONResponse(body, status_code=401, headers={"WWW-Authenticate": "Bearer"})
                await response(scope, receive, send)
                return
        await self.app(scope, receive, send)


def create_app(controller: ControlPlane, *, autoscaler: Autoscaler | None = None, hooks: ScaleHooks | None = None,
               title: str = "elastic-ep", api_key: str | None = None) -> FastAPI:
    """The scale API over ``controller`` (a :class:`~elastic.control.coordinator.Coordinator`); with
    ``api_key``, every request that changes something must present it (:class:`RequireApiKey`)."""
    app = FastAPI(title=title, version="1", description=__doc__.split("\n\n")[1] if __doc__ else "")
    registry = build_registry(controller, autoscaler)
    serving_metrics = ServingMetrics(registry)  # exported (at 0) even without a model to serve: one dashboard
    app.state.controller, app.state.autoscaler, app.state.hooks, app.state.registry = controller, autoscaler, hooks, registry
    body_limits: dict[str, int] = {}  # a path prefix's own limit (/v1/: the model's context, set by its routes)
    app.add_middleware(BodyLimit, prefixes=body_limits)  # an oversized body is refused before it is read and parsed
    if api_key:
        app.add_middleware(RequireApiKey, key=api_key)  # outermost: checked before the body is read

    def view(op: dict[str, Any]) -> dict[str, Any]:
        out = dict(op)
        out["ranks_safe_to_release"] = list(op.get("released_ranks") or []) if op.get("status") == "succeeded" else []
        out["hooks"] = hooks.results(op["id"]) if hooks is not None else []
        return out

    def get_op(op_id: str) -> dict[str, Any] | None:
        return controller.get_operation(op_id)

    # -- error handlers: one body shape everywhere ----------------------------------------------
    @app.exception_handler(RequestValidationError)
    async def _invalid(request: Request, exc: RequestValidationError) -> JSONResponse:
        errors = _validation_errors(list(exc.errors()))
        first = errors[0] if errors else {"loc": [], "msg": "invalid request"}
        where = ".".join(first["loc"]) or "request"
        return _error(422, "invalid_request", f"{where}: {first['msg']}", errors=errors)

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        if exc.status_code == 400:  # FastAPI could not parse the body (e.g. not UTF-8): an invalid body, like the rest
            cause = exc.__cause__
            if isinstance(cause, BodyTooLarge):  # a chunked body past the limit (elastic.service.preflight.BodyLimit)
                return _error(422, "invalid_request", str(cause), errors=[])
            if isinstance(cause, RecursionError):
                return _error(422, "invalid_request", "body: JSON nested too deeply; send a flat object", errors=[])
            return _error(422, "invalid_request", f"body: {exc.detail}", errors=[])
        codes = {404: "not_found", 405: "method_not_allowed"}
        body = {"error": codes.get(exc.status_code, "http_error"),
                "message": f"{request.method} {request.url.path}: {exc.detail}"}
        return JSONResponse(body, status_code=exc.status_code, headers=getattr(exc, "headers", None))

    @app.exception_handler(ElasticError)
    async def _elastic(request: Request, exc: ElasticError) -> JSONResponse:
        headers = {"Retry-After": str(exc.retry_after_s)} if isinstance(exc, RequestNotServed) else None
        return JSONResponse(_error_body(exc), status_code=_status_for(exc), headers=headers)

    @app.exception_handler(Exception)
    async def _crash(request: Request, exc: Exception) -> JSONResponse:
        log.exception("%s %s failed", request.method, request.url.path)
        return _error(500, "internal_error", f"{type(exc).__name__}: {exc}")

    # -- scale --------------------------------------------------------------------------------
    @app.post("/scale", status_code=202, response_model=OperationView, tags=["scale"],
              responses={200: {"model": OperationView, "description": "already at that size: a no-op operation"},
                         202: {"description": "accepted: the scale runs in the background; poll GET /operations/{id}"},
                         409: {"model": ErrorBody, "description": "another operation is in progress (named), the "
                               "machine is failed, or expected_generation is stale"},
                         422: {"model": ErrorBody, "description": "invalid body or size"}})
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

    @app.post("/recover", status_code=202, response_model=OperationView, tags=["scale"],
              responses={409: {"model": ErrorBody, "description": "not failed, or an operation is in progress "
                               "(answered at once)"},
                         422: {"model": ErrorBody, "description": "nothing to recover with: no worker of the last "
                               "consistent generation is alive, or too few for a valid group"}})
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
                         422: ERRORS[422]})
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
                        422: ERRORS[422]})
    def placement(timeout_s: float = Query(30.0, ge=1, le=300, description="how long to wait for the ranks (they "
                                           "answer at their next step boundary)")) -> Any:
        """The current placement and the recorded load window, as a placement file."""
        try:
            return controller.export_placement(timeout=timeout_s)
        except ElasticError as exc:
            if isinstance(exc, InvalidTransition):
                raise  # 409: not running
            return _error(503, "placement_unavailable", str(exc))

    # -- reading ------------------------------------------------------------------------------
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
    def state() -> Any:
        """State, generation, EP size, balancedness, in-flight layer, serving, history tail."""
        return state_view()

    @app.get("/healthz", response_model=Health, tags=["state"])
    def healthz() -> Any:
        """Always 200 while the control plane runs; ``serving`` says whether decoding runs."""
        current = controller.machine.state.value
        serving = controller.snapshot().get("serving", current in SERVING_STATES)
        return {"status": "ok", "state": current, "serving": serving,
                "generation": controller.machine.generation, "note": SERVING_NOTE}

    @app.get("/metrics", response_class=PlainTextResponse, tags=["state"],
             responses={200: {"content": {"text/plain": {"schema": {"type": "string"}}},
                              "description": "Prometheus text exposition"}})
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

    if controller.requests is not None:
        from elastic.service.completions import RequestIdHeader, completion_routes

        app.include_router(completion_routes(controller, serving_metrics, body_limits))
        app.add_middleware(RequestIdHeader)  # x-request-id on every response

    # -- autoscaler ---------------------------------------------------------------------------
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

    return app


# -- running it ---------------------------------------------------------------------------------

class BackgroundServer:
    """uvicorn on a thread (port 0: the OS picks one). For tests and for engines that embed the API."""

    def __init__(self, app: Any, host: str = "127.0.0.1", port: int = 0, log_level: str = "warning"):
        self.config = uvicorn.Config(app, host=host, port=port, log_level=log_level, lifespan="off",
                                     timeout_graceful_shutdown=2)
        self.server = uvicorn.Server(self.config)
        self._thread: threading.Thread | None = None

    def start(self, timeout: float = 10.0) -> BackgroundServer:
        self._thread = threading.Thread(target=self.server.run, name="api-server", daemon=True)
        self._thread.start()
        deadline = time.monotonic() + timeout
        while not self.server.started:
            if not self._thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError(f"the API server did not start within {timeout}s")
            time.sleep(0.01)
        return self

    @property
    def port(self) -> int:
        return self.server.servers[0].sockets[0].getsockname()[1]

    @property
    def url(self) -> str:
        return f"http://{self.config.host}:{self.port}"

    def stop(self, timeout: float = 5.0) -> None:
        self.server.should_exit = True
        if self._thread is not None:
            self._thread.join(timeout)

    def __enter__(self) -> BackgroundServer:
        return self.start()

    def __exit__(self, *exc: Any) -> None:
        self.stop()


class ServeConfig(BaseModel):
    """A serve config file: a DeploymentConfig plus optional ``autoscaler:`` and ``hooks:`` sections."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    deployment: DeploymentConfig
    autoscaler: AutoscalerConfig | None = None
    hooks: HooksConfig | None = None


def _config_problem(err: Any) -> InputProblem:
    """One pydantic error of a serve config as a key path (in the file's own terms) and a message."""
    where = ""
    previous = None
    for part in err["loc"]:
        if part == "deployment" or (previous == "model" and part in ("reference", "hf")):  # not keys of the file
            previous = part
            continue
        previous = part
        where = f"{where}[{part}]" if isinstance(part, int) else (f"{where}.{part}" if where else str(part))
    if err["type"] == "extra_forbidden":
        return InputProblem(where, "unknown key; remove it or check its spelling")
    message = str(err["msg"]).removeprefix("Value error, ")
    given = err.get("input")
    if err["type"] not in ("value_error", "missing") and not isinstance(given, (dict, list)):
        shown = repr(given)
        message += f", got {shown if len(shown) <= 60 else shown[:57] + '...'}"
    return InputProblem(where, message)


DEFAULT_SOURCE = "<default deployment>"


def _with_overrides(raw: dict[str, Any], overrides: dict[str, Any], *, default: bool) -> dict[str, Any]:
    """Command-line values over a config: dotted keys (``eplb.num_redundant_experts``) set nested ones.

    On the embedded default deployment a new ``ep_size`` also gets room to scale (``max_ep_size``
    at least twice it) and redundant slots that divide over it, unless those are given too, so
    ``serve --ep-size 3`` just works; a file's own values are never changed behind its back.
    """
    out: dict[str, Any] = {key: dict(value) if isinstance(value, dict) else value for key, value in raw.items()}
    for dotted, value in overrides.items():
        if value is None:
            continue
        *parents, leaf = dotted.split(".")
        target = out
        for part in parents:
            inner = target.setdefault(part, {})
            if not isinstance(inner, dict):  # the file's own value is wrong: validation names it
                break
            target = inner
        else:
            target[leaf] = value
    size = overrides.get("ep_size")
    if default and isinstance(size, int) and size >= 1:
        if overrides.get("max_ep_size") is None:
            out["max_ep_size"] = min(max(out["max_ep_size"], 2 * size), MAX_RANKS)
        if overrides.get("eplb.num_redundant_experts") is None:
            experts = out["model"]["num_experts"]
            redundant = out["eplb"]["num_redundant_experts"]
            out["eplb"]["num_redundant_experts"] = redundant + (-(experts + redundant)) % size
    return out


def load_serve_config(path: str | Path | None, *, overrides: dict[str, Any] | None = None,
                      available: Callable[[], int | None] = available_memory) -> ServeConfig:
    """Read a YAML serve config (``None``: the embedded default deployment, :data:`DEFAULT_DEPLOYMENT`),
    lay ``overrides`` over it and run the pre-flight checks (:mod:`elastic.service.preflight`).

    Raises :class:`~elastic.service.preflight.InputError` (a ``ValueError``) with one line per problem,
    each naming the file and the key path: unreadable, too large, not UTF-8, not YAML, a bad
    field, a number out of bounds, a worker that would not fit its memory budget, a hook
    command whose program is missing.
    """
    if path is None:
        source, raw = DEFAULT_SOURCE, copy.deepcopy(DEFAULT_DEPLOYMENT)
    else:
        path = Path(path)
        source = str(path)
        raw = read_yaml(path)
    if raw is None:
        raw = {}
    if not isinstance(raw, dict):
        raise InputError(source, [InputProblem("", f"expected a mapping of DeploymentConfig fields, got "
                                                    f"{type(raw).__name__}")])
    raw = _with_overrides(raw, overrides or {}, default=path is None)
    sections = {"autoscaler": raw.pop("autoscaler", None), "hooks": raw.pop("hooks", None)}
    try:  # one validation, so every bad field of every section is reported at once
        loaded = ServeConfig.model_validate({"deployment": raw, **{k: v for k, v in sections.items() if v is not None}})
    except ValidationError as exc:
        raise InputError(source, [_config_problem(e) for e in exc.errors()]) from None
    problems = [p if not p.path.startswith("deployment") else InputProblem(p.path.removeprefix("deployment").lstrip("."),
                                                                            p.message)
                for p in bound_problems(loaded)]
    if not problems:
        problems = policy_problems(loaded.deployment) + memory_problems(loaded.deployment, available=available)
    checkpoint = getattr(loaded.deployment.model, "path", None)  # a model served from a checkpoint directory
    if isinstance(checkpoint, str):
        problems += checkpoint_problems(checkpoint, key="model.path")
    if loaded.hooks is not None:
        problems += hook_problems(loaded.hooks)
    if problems:
        raise InputError(source, problems)
    return loaded


class StopRequested(Exception):
    """SIGTERM or SIGINT while ``serve`` was starting the deployment."""


class _EndRequestsFirst(uvicorn.Server):
    """uvicorn's server, whose graceful shutdown first ends every completion request with a 503
    (``Retry-After``; a stream gets an error event), so no client is cut off mid-answer when
    uvicorn's grace period cancels what is still open."""

    def __init__(self, config: uvicorn.Config, coordinator: Any):
        super().__init__(config)
        self.coordinator = coordinator

    async def shutdown(self, sockets: Any = None) -> None:
        engine = getattr(self.coordinator, "requests", None)
        if engine is not None:
            engine.stop()
        await super().shutdown(sockets=sockets)


class _StopSignals:
    """SIGTERM and SIGINT stop ``serve`` gracefully, whatever it is doing when they arrive.

    uvicorn handles both while it runs, but when it returns it raises the signal again with the
    handler it found. With Python's defaults SIGTERM would then end the process on the spot,
    before the coordinator shut down (the workers and the forkserver went on decoding). Here:
    a signal while the deployment starts interrupts the start (``StopRequested``); one that
    comes after uvicorn was handed the server (``server`` set: the re-raised one, or one just
    before uvicorn took the signals) tells the server to exit; during the shutdown nothing
    changes (the shutdown is bounded).
    """

    SIGNALS = (signal.SIGTERM, signal.SIGINT)

    def __init__(self) -> None:
        self.server: Any = None  # the uvicorn server, once it is about to run
        self.stopping = False
        self._previous: dict[int, Any] = {}

    def _handle(self, sig: int, frame: Any) -> None:
        name = signal.Signals(sig).name
        if self.server is not None:
            self.server.should_exit = True  # uvicorn checks it after its startup too: no signal is lost
        elif not self.stopping:
            self.stopping = True  # one interruption: the shutdown that follows runs to its end
            raise StopRequested(name)
        log.info("%s: the deployment is stopping", name)

    def __enter__(self) -> _StopSignals:
        if threading.current_thread() is threading.main_thread():  # only the main thread may set handlers
            self._previous = {sig: signal.signal(sig, self._handle) for sig in self.SIGNALS}
        return self

    def __exit__(self, *exc: Any) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)


def serve(config: DeploymentConfig, host: str = "127.0.0.1", port: int = 8000, *,
          autoscaler: AutoscalerConfig | None = None, hooks: HooksConfig | None = None,
          log_level: str = "info", shutdown_timeout_s: float = 5.0, api_key: str | None = None) -> None:
    """Start the workers, the autoscaler (if configured) and the API; serve until SIGTERM or SIGINT.

    Either signal stops it gracefully: the server stops answering (open requests get 2 s), the
    autoscaler stops, and :meth:`Coordinator.shutdown` retires the workers (``Shutdown``, then a
    kill of any left after ``shutdown_timeout_s``), closes the store and joins its threads; the
    forkserver ends with the process. Returns normally (exit status 0) after such a stop.
    """
    from elastic.control.coordinator import Coordinator

    coordinator = Coordinator(config)  # starts nothing yet: a signal now ends the process as usual
    _SERVING["coordinator"] = coordinator
    scaler: Autoscaler | None = None
    with _StopSignals() as signals:
        try:
            coordinator.start()
            scale_hooks = ScaleHooks.from_config(hooks).install(coordinator) if hooks is not None else None
            if autoscaler is not None:
                scaler = Autoscaler(coordinator, autoscaler).start()
            app = create_app(coordinator, autoscaler=scaler, hooks=scale_hooks, api_key=api_key)
            server = _EndRequestsFirst(uvicorn.Config(app, host=host, port=port, log_level=log_level,
                                                      timeout_graceful_shutdown=2), coordinator)
            signals.server = server  # from here a signal makes uvicorn return
            server.run()
        except StopRequested as exc:
            log.info("%s while starting: shutting down", exc)
        finally:
            signals.stopping = True
            started = time.monotonic()
            if scaler is not None:
                scaler.stop()
            coordinator.shutdown(timeout=shutdown_timeout_s)
            log.info("deployment shut down in %.1fs", time.monotonic() - started)


#: the coordinator that ``serve`` runs, for the log context
_SERVING: dict[str, Any] = {}


def _serving_context() -> dict[str, Any]:
    coordinator = _SERVING.get("coordinator")
    if coordinator is None:
        return {}
    op = coordinator._current
    return {"generation": coordinator.machine.generation,
            "operation_id": op.id if op is not None and not op.terminal else None}


def register_cli(app: Any) -> None:
    """Add ``serve CONFIG [--host] [--port]`` to a typer app."""
    import typer

    @app.command("serve")
    def serve_command(
        config: Path | None = typer.Argument(None, help="YAML: DeploymentConfig fields, optional autoscaler: and "
                                             "hooks: sections [default: 2 local ranks of a tiny model]",
                                             show_default=False),
        host: str = typer.Option("127.0.0.1", help="address to listen on"),
        port: int = typer.Option(8000, min=0, max=65535, help="port to listen on"),
        ep_size: int | None = typer.Option(None, "--ep-size", help="EP ranks at start (overrides the config)"),
        max_ep_size: int | None = typer.Option(None, "--max-ep-size", help="most ranks a scale may reach"),
        num_experts: int | None = typer.Option(None, "--num-experts", help="logical experts per layer"),
        redundant: int | None = typer.Option(None, "--num-redundant-experts", help="redundant expert slots"),
        max_memory: str | None = typer.Option(None, "--max-memory", help="memory one worker may use, e.g. 8GiB"),
        initial_placement: str | None = typer.Option(None, "--initial-placement", help="start from this placement "
                                                     "file (elastic-ep placement export writes one)"),
        observe_only: bool = typer.Option(False, "--observe-only", help="the autoscaler only logs what it would do"),
        log_level: str = typer.Option("info", help="uvicorn log level"),
        log_format: str = typer.Option("text", "--log-format", help="text, or json: one object per line with "
                                       "generation, operation id and rank (workers too)"),
        api_key: str | None = typer.Option(None, "--api-key", envvar="ELASTIC_EP_API_KEY", show_default=False,
                                           help="require 'Authorization: Bearer KEY' on every request that changes "
                                                "something (POST); reading stays open"),
    ) -> None:
        """Run a deployment with the scale API (and the autoscaler, when configured).

        Without CONFIG it runs the embedded default deployment: 2 local ranks of a tiny model, async EPLB.
        The flags override the file or the default.
        """
        overrides = {"ep_size": ep_size, "max_ep_size": max_ep_size, "model.num_experts": num_experts,
                     "eplb.num_redundant_experts": redundant, "max_memory": max_memory,
                     "eplb.initial_placement": initial_placement}
        try:  # every pre-flight check runs here, before any worker starts
            loaded = load_serve_config(config, overrides=overrides)
        except InputError as exc:
            for line in exc.lines():
                typer.echo(f"error: {line}", err=True)
            raise typer.Exit(2) from None
        scaler = loaded.autoscaler
        if observe_only and scaler is not None:
            scaler = scaler.model_copy(update={"observe_only": True})
        if log_format not in ("text", "json"):
            typer.echo(f"error: --log-format: expected text or json, got {log_format!r}", err=True)
            raise typer.Exit(2)
        os.environ[ENV_FORMAT] = log_format  # workers inherit it (the forkserver starts after this)
        configure_logging(log_format, logging.INFO, context=_serving_context)
        logging.getLogger("transitions").setLevel(logging.WARNING)  # the machine logs each transition itself
        serve(loaded.deployment, host, port, autoscaler=scaler, hooks=loaded.hooks, log_level=log_level, api_key=api_key)
