"""A load generator for ``/v1/completions``: Poisson arrivals, streaming clients, latency by phase.

``elastic-ep loadgen URL`` sends seeded random prompts (token ids) at ``--rate`` requests per
second (Poisson; ``0``: a closed loop of ``--concurrency`` clients), at most ``--concurrency``
in flight, for ``--duration`` seconds, each streamed (server-sent events), greedy. A 429 or 503
(before or during the stream) is retried after its ``Retry-After``: it counts as *retried*, and
as *failed* only when the retries run out or the answer is anything else.

The report splits time to first token (TTFT) and inter-token latency (ITL) by what the server
was doing, read from ``GET /timeline`` after the run: *scale* (a scale operation), *recovery*
(from a failure to the recovered group), *rebalance*, or *steady*. An ITL gap belongs to every
window it overlaps (recovery first, then scale, then rebalance). It writes ``loadgen.json``
(summary and every request) and ``loadgen.png`` (per-token latency over time, phases shaded).

``--check DEPLOYMENT.yaml`` builds the unsharded model of that deployment in this process and
checks every request's tokens against its greedy output for the same prompt.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import math
import random
import threading
import time
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import httpx
import typer

__all__ = ["LoadConfig", "RequestRecord", "run_load", "summarize", "label_gaps"]

PHASES = ("recovery", "scale", "rebalance")  # an overlap goes to the first that matches


@dataclass(frozen=True)
class LoadConfig:
    url: str
    rate: float = 4.0  # requests per second (Poisson); 0: closed loop
    concurrency: int = 8
    duration_s: float = 30.0
    prompt_len: tuple[int, int] = (4, 16)
    max_tokens: tuple[int, int] = (16, 32)
    seed: int = 0
    model: str | None = None
    max_retries: int = 30
    timeout_s: float = 120.0
    api_key: str | None = None


@dataclass
class RequestRecord:
    index: int
    prompt: list[int]
    max_tokens: int
    sent_at: float = 0.0  # wall clock of the first attempt
    status: str = "pending"  # ok | failed
    retries: int = 0
    error: str | None = None
    tokens: list[int] = field(default_factory=list)
    token_times: list[float] = field(default_factory=list)  # wall clock of each token's arrival
    first_token_at: float | None = None
    attempt_started_at: float = 0.0
    replays: int = 0
    finish_reason: str | None = None


class Retryable(Exception):
    def __init__(self, message: str, after: float):
        super().__init__(message)
        self.after = after


async def _attempt(client: httpx.AsyncClient, cfg: LoadConfig, model: str, rec: RequestRecord) -> None:
    body = {"model": model, "prompt": rec.prompt, "max_tokens": rec.max_tokens, "temperature": 0, "stream": True,
            "ignore_eos": True}  # every request runs its max_tokens, as vLLM's benchmark asks
    rec.attempt_started_at = time.time()
    tokens: list[int] = []
    times: list[float] = []
    async with client.stream("POST", f"{cfg.url}/v1/completions", json=body, timeout=cfg.timeout_s) as response:
        if response.status_code in (429, 503):
            await response.aread()
            raise Retryable(f"HTTP {response.status_code}", float(response.headers.get("Retry-After", "1")))
        if response.status_code != 200:
            text = (await response.aread()).decode(errors="replace")
            raise RuntimeError(f"HTTP {response.status_code}: {text[:300]}")
        async for line in response.aiter_lines():
            if not line.startswith("data: "):
                continue
            data = line[len("data: "):]
            if data == "[DONE]":
                break
            chunk = json.loads(data)
            if "error" in chunk:
                error = chunk["error"]
                if error.get("retry_after_s") is not None:
                    raise Retryable(f"stream error: {error.get('message')}", float(error["retry_after_s"]))
                raise RuntimeError(f"stream error: {error}")
            now = time.time()
            choice = chunk["choices"][0]
            for token in choice.get("token_ids") or []:
                tokens.append(int(token))
                times.append(now)
            if choice.get("finish_reason"):
                rec.finish_reason = choice["finish_reason"]
                rec.replays = int(chunk.get("elastic_ep", {}).get("replays", 0))
    rec.tokens, rec.token_times = tokens, times
    rec.first_token_at = times[0] if times else None


async def _one(client: httpx.AsyncClient, cfg: LoadConfig, model: str, rec: RequestRecord) -> None:
    rec.sent_at = time.time()
    while True:
        try:
            await _attempt(client, cfg, model, rec)
            rec.status = "ok" if rec.finish_reason in ("length", "stop") else "failed"
            if rec.status == "failed":
                rec.error = f"finished with {rec.finish_reason!r}"
            return
        except Retryable as exc:
            if rec.retries >= cfg.max_retries:
                rec.status, rec.error = "failed", f"{exc} after {rec.retries} retries"
                return
            rec.retries += 1
            await asyncio.sleep(min(max(exc.after, 0.05), 5.0))
        except (httpx.HTTPError, RuntimeError, ValueError) as exc:
            rec.status, rec.error = "failed", f"{type(exc).__name__}: {exc}"
            return


def make_requests(cfg: LoadConfig, vocab_size: int) -> Iterator[RequestRecord]:
    """The seeded requests, one at a time, as long as the load asks for them."""
    rng = random.Random(cfg.seed)
    for i in itertools.count():
        n = rng.randint(*cfg.prompt_len)
        yield RequestRecord(i, [rng.randrange(vocab_size) for _ in range(n)], rng.randint(*cfg.max_tokens))


async def run_load(cfg: LoadConfig, stop: threading.Event | None = None
                   ) -> tuple[list[RequestRecord], dict[str, Any], float, float]:
    """Send the load for ``cfg.duration_s`` (or until ``stop`` is set: no new request, the ones in
    flight finish); returns ``(records, the server's timeline, started, ended)`` (wall clock)."""
    headers = {"Authorization": f"Bearer {cfg.api_key}"} if cfg.api_key else {}
    limits = httpx.Limits(max_connections=cfg.concurrency + 4, max_keepalive_connections=cfg.concurrency + 4)
    async with httpx.AsyncClient(headers=headers, limits=limits, timeout=cfg.timeout_s) as client:
        listing = (await client.get(f"{cfg.url}/v1/models")).json()["data"][0]
        model = cfg.model or listing["id"]
        vocab = int(listing.get("vocab_size") or 32)
        rng = random.Random(cfg.seed + 1)
        records: list[RequestRecord] = []  # the requests sent
        gate = asyncio.Semaphore(cfg.concurrency)
        tasks: list[asyncio.Task] = []
        started = time.time()
        end = started + cfg.duration_s

        async def guarded(rec: RequestRecord) -> None:
            try:
                await _one(client, cfg, model, rec)
            finally:
                gate.release()

        def over() -> bool:
            return time.time() >= end or (stop is not None and stop.is_set())

        for rec in make_requests(cfg, vocab):
            if over():
                break
            if cfg.rate > 0:
                await asyncio.sleep(rng.expovariate(cfg.rate))
                if over():
                    break
            while not over():  # wait for a free slot, but no longer than the load lasts
                try:
                    await asyncio.wait_for(gate.acquire(), timeout=0.1)
                    break
                except TimeoutError:
                    continue
            else:
                break
            records.append(rec)
            tasks.append(asyncio.create_task(guarded(rec)))
        await asyncio.gather(*tasks)
        ended = time.time()
        timeline = (await client.get(f"{cfg.url}/timeline")).json()
    return records, timeline, started, ended


# -- the report -------------------------------------------------------------------------------------

def _windows(timeline: dict[str, Any], until: float) -> dict[str, list[tuple[float, float]]]:
    out: dict[str, list[tuple[float, float]]] = {k: [] for k in PHASES}
    for w in timeline.get("windows", []):
        kind = {"recover": "recovery", "failure": "recovery"}.get(w["kind"], w["kind"])
        if kind in out and w.get("started_at") is not None:
            out[kind].append((float(w["started_at"]), float(w.get("ended_at") or until)))
    return out


def label_gaps(start: float, end: float, windows: dict[str, list[tuple[float, float]]]) -> str:
    """What the server was doing during ``[start, end]``: the first phase whose window it overlaps."""
    for kind in PHASES:
        if any(a <= end and start <= b for a, b in windows.get(kind, [])):
            return kind
    return "steady"


def _pct(values: list[float], q: float) -> float | None:
    if not values:
        return None
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, math.ceil(q * len(ordered)) - 1))]


def summarize(records: list[RequestRecord], timeline: dict[str, Any], started: float, ended: float) -> dict[str, Any]:
    windows = _windows(timeline, ended)
    ttft: dict[str, list[float]] = {}
    itl: dict[str, list[float]] = {}
    for r in records:
        if r.status != "ok" or not r.token_times:
            continue
        ttft.setdefault(label_gaps(r.attempt_started_at, r.token_times[0], windows), []).append(r.token_times[0] - r.attempt_started_at)
        for a, b in zip(r.token_times, r.token_times[1:]):
            itl.setdefault(label_gaps(a, b, windows), []).append(b - a)
    tokens = sum(len(r.tokens) for r in records if r.status == "ok")

    def table(samples: dict[str, list[float]]) -> dict[str, Any]:
        return {k: {"n": len(v), "p50_ms": 1e3 * (_pct(v, 0.5) or 0), "p99_ms": 1e3 * (_pct(v, 0.99) or 0),
                    "max_ms": 1e3 * max(v)} for k, v in sorted(samples.items())}

    return {
        "requests": len(records), "ok": sum(r.status == "ok" for r in records),
        "failed": sum(r.status == "failed" for r in records), "retried": sum(r.retries > 0 for r in records),
        "retries": sum(r.retries for r in records), "replayed": sum(r.replays > 0 for r in records),
        "tokens": tokens, "seconds": ended - started, "tokens_per_s": tokens / max(1e-9, ended - started),
        "ttft": table(ttft), "itl": table(itl),
        "windows": {k: len(v) for k, v in windows.items()},
        "errors": sorted({r.error for r in records if r.error})[:10],
    }


def plot(records: list[RequestRecord], timeline: dict[str, Any], started: float, ended: float, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    windows = _windows(timeline, ended)
    fig, ax = plt.subplots(figsize=(11, 4))
    colors = {"recovery": "#d62728", "scale": "#1f77b4", "rebalance": "#2ca02c"}
    for kind, spans in windows.items():
        for i, (a, b) in enumerate(spans):
            ax.axvspan(a - started, b - started, color=colors[kind], alpha=0.15 if kind != "rebalance" else 0.07,
                       label=kind if i == 0 else None)
    xs, ys = [], []
    for r in records:
        for a, b in zip([r.attempt_started_at, *r.token_times], r.token_times):
            xs.append(b - started)
            ys.append(1e3 * (b - a))
    ax.scatter(xs, ys, s=3, color="black", label="token latency (TTFT, then ITL)")
    failed = [r.sent_at - started for r in records if r.status == "failed"]
    if failed:
        ax.scatter(failed, [max(ys or [1])] * len(failed), marker="x", color="red", label="failed request")
    ax.set_yscale("log")
    ax.set_xlabel("seconds since the load started")
    ax.set_ylabel("ms since the previous token")
    ax.legend(loc="upper right", fontsize=8)
    ax.set_title("elastic-ep loadgen: per-token latency, phases shaded")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def check_tokens(records: list[RequestRecord], model_spec: Any) -> dict[str, Any]:
    """Every ok request's tokens against the unsharded model's greedy output for its prompt."""
    import torch

    from eplb.models.hf import unsharded

    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # the workers' thread count: the bits depend on it
    try:
        model = unsharded(model_spec)
        mismatched = []
        checked = 0
        for r in records:
            if r.status != "ok":
                continue
            expected, _ = model.generate(torch.tensor([r.prompt]), r.max_tokens)
            checked += 1
            if expected[0, : len(r.tokens)].tolist() != r.tokens or len(r.tokens) != r.max_tokens:
                mismatched.append(r.index)
    finally:
        torch.set_num_threads(threads)
    return {"checked": checked, "identical": checked - len(mismatched), "mismatched": mismatched}


def write_report(records: list[RequestRecord], timeline: dict[str, Any], started: float, ended: float, out: Path,
                 extra: dict[str, Any] | None = None) -> dict[str, Any]:
    out.mkdir(parents=True, exist_ok=True)
    summary = {**summarize(records, timeline, started, ended), **(extra or {})}
    (out / "loadgen.json").write_text(json.dumps({"summary": summary, "timeline": timeline,
                                                  "requests": [asdict(r) for r in records]}, indent=1))
    plot(records, timeline, started, ended, out / "loadgen.png")
    return summary


def format_summary(summary: dict[str, Any]) -> str:
    lines = [f"requests {summary['requests']}: ok {summary['ok']}, failed {summary['failed']}, "
             f"retried {summary['retried']} ({summary['retries']} retries), replayed {summary['replayed']}; "
             f"{summary['tokens']} tokens in {summary['seconds']:.1f}s = {summary['tokens_per_s']:.1f} tokens/s"]
    for name in ("ttft", "itl"):
        for phase, row in summary[name].items():
            lines.append(f"  {name:4s} {phase:9s} n={row['n']:6d}  p50 {row['p50_ms']:8.1f} ms  p99 {row['p99_ms']:8.1f} ms  "
                         f"max {row['max_ms']:8.1f} ms")
    if "check" in summary:
        c = summary["check"]
        lines.append(f"  tokens identical to the unsharded model: {c['identical']}/{c['checked']}"
                     + (f" (mismatched: {c['mismatched'][:10]})" if c["mismatched"] else ""))
    for error in summary.get("errors", []):
        lines.append(f"  error: {error}")
    return "\n".join(lines)


# -- the command ------------------------------------------------------------------------------------

def _span(value: str, name: str) -> tuple[int, int]:
    try:
        lo, _, hi = value.partition(":")
        span = (int(lo), int(hi or lo))
    except ValueError:
        raise typer.BadParameter(f"{name}: give N or MIN:MAX (got {value!r})") from None
    if span[0] < 1 or span[1] < span[0]:
        raise typer.BadParameter(f"{name}: need 1 <= MIN <= MAX (got {value!r})")
    return span


def loadgen(
    url: str = typer.Argument(..., help="the server, e.g. http://127.0.0.1:8000"),
    rate: float = typer.Option(4.0, min=0, help="requests per second, Poisson arrivals (0: closed loop)"),
    concurrency: int = typer.Option(8, min=1, help="requests in flight at most"),
    duration: float = typer.Option(30.0, min=0.1, help="seconds to send for"),
    prompt_len: str = typer.Option("4:16", help="prompt tokens, N or MIN:MAX"),
    max_tokens: str = typer.Option("16:32", help="tokens per request, N or MIN:MAX"),
    seed: int = typer.Option(0, help="seeds the prompts and the arrivals"),
    out: Path = typer.Option(Path("out/loadgen"), help="where loadgen.json and loadgen.png go"),
    check: Path | None = typer.Option(None, help="a deployment file: check every request's tokens "
                                                  "against its unsharded model's greedy output"),
    json_out: bool = typer.Option(False, "--json", help="print the summary as JSON"),
) -> None:
    """Send completion requests to a running ``elastic-ep serve`` and report what they saw."""
    import os

    try:  # an argument: a URL httpx cannot send to was a traceback (InvalidURL) or exit 3 after the run's set-up
        httpx.Request("GET", url.rstrip("/") + "/v1/models")
    except (httpx.InvalidURL, httpx.UnsupportedProtocol) as exc:
        typer.echo(f"error: URL {url}: expected an http:// or https:// URL such as http://127.0.0.1:8000 ({exc})", err=True)
        raise typer.Exit(2) from None
    if not url.lower().startswith(("http://", "https://")):
        typer.echo(f"error: URL {url}: expected an http:// or https:// URL such as http://127.0.0.1:8000", err=True)
        raise typer.Exit(2)
    cfg = LoadConfig(url=url.rstrip("/"), rate=rate, concurrency=concurrency, duration_s=duration,
                     prompt_len=_span(prompt_len, "--prompt-len"), max_tokens=_span(max_tokens, "--max-tokens"),
                     seed=seed, api_key=os.environ.get("ELASTIC_EP_API_KEY"))
    model_spec = None
    if check is not None:
        from elastic.service.preflight import InputError
        from elastic.service.server import load_serve_config

        try:
            model_spec = load_serve_config(check).deployment.model
        except InputError as exc:
            typer.echo(f"error: --check {check}: {exc}", err=True)
            raise typer.Exit(2) from None
    try:
        records, timeline, started, ended = asyncio.run(run_load(cfg))
    except httpx.HTTPError as exc:
        typer.echo(f"error: cannot reach {cfg.url}: {exc}", err=True)
        raise typer.Exit(3) from None
    extra = {"check": check_tokens(records, model_spec)} if model_spec is not None else {}
    summary = write_report(records, timeline, started, ended, out, extra)
    typer.echo(json.dumps(summary, indent=1) if json_out else format_summary(summary))
    typer.echo(f"wrote {out / 'loadgen.json'} and {out / 'loadgen.png'}", err=True)
    bad = summary["failed"] or (extra and extra["check"]["mismatched"])
    raise typer.Exit(1 if bad else 0)


def register(app: Any) -> None:
    app.command()(loadgen)
