"""``elastic-ep status|scale|recover|rebalance|operations|placement export``: a client of a running ``elastic-ep serve``.

In the habit of ``kubectl`` and ``ray status``: a human table by default, ``--json`` for scripts,
``--url`` (or ``ELASTIC_EP_URL``) to name the server, default ``http://127.0.0.1:8000``.

Exit status: 0 on success; 1 when the operation (or the rebalance) failed; 2 for bad input (a
bad argument, or the server's 4xx naming the field); 3 when the server cannot be reached.
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path
from typing import Any, NoReturn

import typer
from rich.console import Console
from rich.table import Table

EXIT_OK, EXIT_FAILED, EXIT_INVALID, EXIT_UNREACHABLE = 0, 1, 2, 3
DEFAULT_URL = "http://127.0.0.1:8000"
TERMINAL = ("succeeded", "failed", "noop")

UrlOption = typer.Option(None, "--url", envvar="ELASTIC_EP_URL", show_default=DEFAULT_URL,
                         help="the server (elastic-ep serve)")
JsonOption = typer.Option(False, "--json", help="print the server's JSON answer instead of a table")
TimeoutOption = typer.Option(10.0, "--timeout", min=0.1, help="seconds to wait for each answer")


class Unreachable(Exception):
    pass


def _out() -> Console:
    return Console(highlight=False, soft_wrap=True, width=None if sys.stdout.isatty() else 140)


def _fail(code: int, message: str) -> NoReturn:
    Console(stderr=True, highlight=False, soft_wrap=True).print(f"error: {message}", markup=False)
    raise typer.Exit(code)


def _call(method: str, url: str | None, path: str, timeout: float, **kwargs: Any) -> tuple[int, Any]:
    import httpx

    base = (url or DEFAULT_URL).rstrip("/")
    headers = kwargs.pop("headers", {})
    key = os.environ.get("ELASTIC_EP_API_KEY")
    if key:
        headers["Authorization"] = f"Bearer {key}"
    try:
        response = httpx.request(method, base + path, timeout=timeout, headers=headers, **kwargs)
    except (httpx.InvalidURL, httpx.UnsupportedProtocol) as exc:  # an argument: was exit 3, or a traceback
        _fail(EXIT_INVALID, f"--url {base}: expected an http:// or https:// URL such as {DEFAULT_URL} ({exc})")
    except (httpx.ConnectError, httpx.ConnectTimeout) as exc:
        raise Unreachable(f"cannot reach {base}: {exc}") from exc
    except httpx.HTTPError as exc:
        raise Unreachable(f"{method} {base}{path}: {type(exc).__name__}: {exc}") from exc
    try:
        body = response.json()
    except ValueError:
        body = {"message": response.text}
    return response.status_code, body


def _request(method: str, url: str | None, path: str, timeout: float, **kwargs: Any) -> Any:
    """The JSON answer of a 2xx; a 4xx/5xx or an unreachable server ends the command with its exit code."""
    try:
        status, body = _call(method, url, path, timeout, **kwargs)
    except Unreachable as exc:
        _fail(EXIT_UNREACHABLE, str(exc))
    if status >= 400:
        message = body.get("message") if isinstance(body, dict) else str(body)
        code = EXIT_INVALID if status in (400, 401, 403, 404, 409, 422) else EXIT_FAILED
        _fail(code, f"{status} {message}")
    return body


def _print_operation(op: dict[str, Any]) -> None:
    table = Table(title=f"operation {op['id']}")
    for col in ("kind", "status", "phase", "size", "generation", "pause", "moved", "error"):
        table.add_column(col)
    pause = op.get("paused_seconds")
    table.add_row(op["kind"], op["status"], op["phase"], f"{op['from_size']} -> {op['target_size']}",
                  f"{op['generation_before']} -> {op.get('generation_after') if op.get('generation_after') is not None else '?'}",
                  "-" if pause is None else f"{pause * 1000:.0f} ms", str(op.get("bytes_moved", 0)), op.get("error") or "")
    _out().print(table)


def _finish_operation(op: dict[str, Any], as_json: bool) -> None:
    if as_json:
        print(json.dumps(op))
    else:
        _print_operation(op)
    if op["status"] == "failed":
        raise typer.Exit(EXIT_FAILED)


def _wait(url: str | None, op: dict[str, Any], timeout: float, wait_s: float) -> dict[str, Any]:
    deadline = time.monotonic() + wait_s
    while op["status"] not in TERMINAL:
        if time.monotonic() > deadline:
            _fail(EXIT_FAILED, f"operation {op['id']} still {op['status']} in {op['phase']} after {wait_s:g}s")
        time.sleep(0.2)
        op = _request("GET", url, f"/operations/{op['id']}", timeout)
    return op


def status(url: str | None = UrlOption, as_json: bool = JsonOption, timeout: float = TimeoutOption) -> None:
    """The deployment's state, generation, size, whether it serves, EPLB health, and every rank."""
    state = _request("GET", url, "/state", timeout)
    if as_json:
        print(json.dumps(state))
        return
    out = _out()
    health = state.get("eplb_health") or {}
    out.print(f"state [bold]{state['state']}[/]  generation {state['generation']}  ep_size {state['ep_size']}  "
              f"serving {'yes' if state['serving'] else 'NO'}  step {state.get('step')}  "
              f"balancedness {state.get('balancedness') if state.get('balancedness') is not None else '-'}  "
              f"eplb {health.get('status', '-')}")
    if state.get("failure_reason"):
        out.print(f"failure: {state['failure_reason']}", markup=False)
    table = Table()
    for col in ("rank", "pid", "generation", "step", "state", "progress"):
        table.add_column(col)
    for r in state.get("ranks", []):
        progress = r.get("progress")
        table.add_row(str(r["rank"]), str(r["pid"]), str(r["generation"]), str(r["step"]), str(r["state"]),
                      f"{progress[0]} {progress[1]}/{progress[2]}" if progress else "")
    out.print(table)
    if state.get("operation"):
        _print_operation(state["operation"])


def scale(ep_size: int = typer.Argument(..., min=1, help="the EP size to scale to"),
          wait: bool = typer.Option(False, "--wait", help="wait until the operation ends"),
          wait_s: float = typer.Option(600.0, "--wait-timeout", min=1, help="with --wait: give up after this long"),
          expected_generation: int | None = typer.Option(None, "--expected-generation", min=0),
          idempotency_key: str | None = typer.Option(None, "--idempotency-key"),
          url: str | None = UrlOption, as_json: bool = JsonOption, timeout: float = TimeoutOption) -> None:
    """Start a scale to EP_SIZE ranks (exit 1 if it fails; with --wait, once it ended)."""
    body: dict[str, Any] = {"ep_size": ep_size}
    if expected_generation is not None:
        body["expected_generation"] = expected_generation
    if idempotency_key is not None:
        body["idempotency_key"] = idempotency_key
    op = _request("POST", url, "/scale", timeout, json=body)
    if wait:
        op = _wait(url, op, timeout, wait_s)
    _finish_operation(op, as_json)


def recover(wait: bool = typer.Option(False, "--wait", help="wait until the recovery ends"),
            wait_s: float = typer.Option(600.0, "--wait-timeout", min=1),
            url: str | None = UrlOption, as_json: bool = JsonOption, timeout: float = TimeoutOption) -> None:
    """Rebuild a consistent group from the living workers after a failure."""
    op = _request("POST", url, "/recover", timeout)
    if wait:
        op = _wait(url, op, timeout, wait_s)
    _finish_operation(op, as_json)


def rebalance(url: str | None = UrlOption, as_json: bool = JsonOption,
              timeout: float = typer.Option(30.0, "--timeout", min=0.1, max=300)) -> None:
    """Ask every rank to start a rebalance at its next step boundary."""
    result = _request("POST", url, f"/rebalance?timeout_s={timeout}", timeout + 5)
    if as_json:
        print(json.dumps(result))
    else:
        _out().print(f"started {result.get('started')}  confirmed {result.get('confirmed')}"
                     + (f"  ({result['message']})" if result.get("message") else ""))
    if not result.get("started"):
        raise typer.Exit(EXIT_FAILED)


def operations(operation_id: str | None = typer.Argument(None, help="one operation (default: the recent ones)"),
               limit: int = typer.Option(20, "--limit", min=1, max=1000),
               url: str | None = UrlOption, as_json: bool = JsonOption, timeout: float = TimeoutOption) -> None:
    """The recent operations, newest first, or one of them."""
    if operation_id is not None:
        _finish_operation(_request("GET", url, f"/operations/{operation_id}", timeout), as_json)
        return
    ops = _request("GET", url, f"/operations?limit={limit}", timeout)["operations"]
    if as_json:
        print(json.dumps(ops))
        return
    table = Table(title="operations, newest first")
    for col in ("id", "kind", "status", "phase", "size", "pause", "error"):
        table.add_column(col)
    for op in ops:
        pause = op.get("paused_seconds")
        table.add_row(op["id"], op["kind"], op["status"], op["phase"], f"{op['from_size']} -> {op['target_size']}",
                      "-" if pause is None else f"{pause * 1000:.0f} ms", op.get("error") or "")
    _out().print(table)


def placement_export(output: Path | None = typer.Option(None, "--output", "-o", help="write the placement file here "
                                                       "[default: print it on stdout]", show_default=False),
                     url: str | None = UrlOption,
                     as_json: bool = typer.Option(False, "--json", help="with -o: print a JSON summary, not a line"),
                     timeout: float = typer.Option(30.0, "--timeout", min=1, max=300,
                                                   help="seconds to wait for the ranks")) -> None:
    """Save the current placement and load window (a file for eplb.initial_placement)."""
    document = _request("GET", url, f"/placement?timeout_s={timeout}", timeout + 5)
    if not isinstance(document, dict) or not isinstance(document.get("physical_to_logical"), list):
        _fail(EXIT_FAILED, f"the server's answer is not a placement file: {str(document)[:200]}")
    text = json.dumps(document, indent=1) + "\n"
    if output is None:
        sys.stdout.write(text)
        return
    try:
        partial = output.with_name(output.name + ".partial")
        partial.write_text(text)
        partial.replace(output)  # a reader never sees half a file
    except OSError as exc:
        _fail(EXIT_INVALID, f"cannot write {output}: {exc.strerror or exc}")
    model = document.get("model") or {}
    summary = {"file": str(output), "ep_size": document.get("ep_size"), "num_physical": document.get("num_physical"),
               "num_moe_layers": model.get("num_moe_layers"), "num_logical_experts": model.get("num_logical_experts"),
               "window_steps": (document.get("load_window") or {}).get("steps"), "digest": document.get("digest"),
               "generation": document.get("generation"), "step": document.get("step")}
    if as_json:
        print(json.dumps(summary))
    else:
        _out().print(f"wrote {output}: ep_size {summary['ep_size']}, {summary['num_moe_layers']} layers x "
                     f"{summary['num_physical']} slots, load window of {summary['window_steps']} steps, "
                     f"digest {summary['digest']} (generation {summary['generation']}, step {summary['step']})",
                     markup=False)


def register(app: typer.Typer) -> None:
    """Add the client commands to the ``elastic-ep`` app."""
    for command in (status, scale, recover, rebalance, operations):
        app.command()(command)
    placement = typer.Typer(help="Static placements: save the current one (start from it with eplb.initial_placement).",
                            no_args_is_help=True, add_completion=False)
    placement.command("export")(placement_export)
    app.add_typer(placement, name="placement")
