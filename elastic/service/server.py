"""The API server process: ``elastic-ep serve``, its config file, its signals, and a server on a thread.

:mod:`elastic.service.api` builds the app (routes, bodies, errors); this module runs it:

- :func:`load_serve_config` reads a serve config (a ``DeploymentConfig`` plus optional
  ``autoscaler:`` and ``hooks:`` sections) and runs the pre-flight checks;
- :func:`serve` starts the deployment and the API, and stops both gracefully on SIGTERM/SIGINT;
- :func:`register_cli` adds ``serve`` to the command line;
- :class:`BackgroundServer` runs the API on a thread (tests, embedding).

Both servers run with :class:`~elastic.service.http_guard.HttpLimits`: a request deadline, a
keep-alive timeout and a connection cap, so idle or half-sent connections cannot use up the
process's file descriptors.
"""

from __future__ import annotations

import copy
import errno
import gc
import logging
import os
import signal
import socket
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import uvicorn
from pydantic import BaseModel, ConfigDict, ValidationError

from elastic.core.errors import ElasticError
from elastic.deployment import DEFAULT_DEPLOYMENT, DeploymentConfig
from elastic.service.api import create_app
from elastic.service.autoscaler import Autoscaler, AutoscalerConfig
from elastic.service.hooks import HooksConfig, ScaleHooks
from elastic.service.http_guard import HttpLimits
from elastic.service.logs import ENV_FORMAT
from elastic.service.logs import configure as configure_logging
from elastic.service.preflight import (
    MAX_RANKS,
    InputError,
    InputProblem,
    available_memory,
    bound_problems,
    hook_problems,
    host_problems,
    memory_problems,
    policy_problems,
    read_yaml,
)

__all__ = ["BackgroundServer", "HttpLimits", "ServeConfig", "StopRequested", "load_serve_config", "register_cli",
           "serve"]

log = logging.getLogger("elastic.service.api")  # the name operators' log filters already use


class BackgroundServer:
    """uvicorn on a thread (port 0: the OS picks one). For tests and for engines that embed the API."""

    def __init__(self, app: Any, host: str = "127.0.0.1", port: int = 0, log_level: str = "warning",
                 limits: HttpLimits | None = None):
        self.limits = limits or HttpLimits()
        self.config = uvicorn.Config(app, host=host, port=port, log_level=log_level, lifespan="off",
                                     timeout_graceful_shutdown=2, **self.limits.uvicorn_options())
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
        problems = (policy_problems(loaded.deployment) + memory_problems(loaded.deployment, available=available)
                    + host_problems(loaded.deployment))
    # a checkpoint directory (model.path) was checked by DeploymentConfig's validation above
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
          log_level: str = "info", shutdown_timeout_s: float = 5.0, api_key: str | None = None,
          limits: HttpLimits | None = None) -> None:
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
                                                      timeout_graceful_shutdown=2,
                                                      **(limits or HttpLimits()).uvicorn_options()), coordinator)
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


def port_problem(host: str, port: int) -> str | None:
    """Why ``serve`` cannot listen on ``host:port``, or None: the address bound (and let go) the
    way uvicorn binds it, before any worker starts. A port in use was found only once the
    deployment was up (its workers started, then stopped: 20-90 s for a tiny model on 2 cores).
    Port 0 (any free port) binds too: it checks the host (one that is not of this machine, or no
    address at all, was found only once the deployment was up, as a port in use was)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    try:
        with socket.socket(family, socket.SOCK_STREAM) as sock:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            sock.bind((host, port))
    except OSError as exc:
        fix = ("another --port, or stop what listens on it" if exc.errno in (errno.EADDRINUSE, errno.EACCES) else
               "an address of this machine for --host (127.0.0.1, or 0.0.0.0 for every interface)")
        return f"--host {host} --port {port}: cannot listen there ({exc.strerror or exc}); fix: {fix}"
    return None


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
        if log_level.lower() not in uvicorn.config.LOG_LEVELS:  # uvicorn's KeyError came once the workers ran
            typer.echo(f"error: --log-level: expected one of {', '.join(uvicorn.config.LOG_LEVELS)}, got {log_level!r}",
                       err=True)
            raise typer.Exit(2)
        problem = port_problem(host, port)  # before any worker starts, as the checks above
        if problem is not None:
            typer.echo(f"error: {problem}", err=True)
            raise typer.Exit(2)
        scaler = loaded.autoscaler
        if observe_only and scaler is not None:
            scaler = scaler.model_copy(update={"observe_only": True})
        if log_format not in ("text", "json"):
            typer.echo(f"error: --log-format: expected text or json, got {log_format!r}", err=True)
            raise typer.Exit(2)
        os.environ[ENV_FORMAT] = log_format  # workers inherit it (the forkserver starts after this)
        configure_logging(log_format, logging.INFO, context=_serving_context)
        logging.getLogger("transitions").setLevel(logging.WARNING)  # the machine logs each transition itself
        try:
            serve(loaded.deployment, host, port, autoscaler=scaler, hooks=loaded.hooks, log_level=log_level,
                  api_key=api_key)
        except ElasticError as exc:  # the workers did not start (a checkpoint's weights, a hung worker): shut down
            typer.echo(f"error: the deployment did not start: {' '.join(str(exc).split())}", err=True)
            raise typer.Exit(1) from None
        # the deployment is down: the process only exits now. Its heap (torch, transformers, the
        # unsharded reference model) is large, and the interpreter's last garbage collections
        # walked it for 6-10 s on 2 busy cores before the process was gone (measured on a
        # served qwen3_moe); nothing left needs collecting, so they skip it
        gc.freeze()
