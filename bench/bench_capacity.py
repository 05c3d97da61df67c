"""Capacity: CPU per token, throughput and idle CPU of a served deployment against transformers alone (issue 29).

    python -m bench.bench_capacity [--ep 2,4] [--concurrency 1,16] [--quick] [--json FILE]
                                   [--hidden 512 --layers 4 --experts 32 --top-k 2 --moe-intermediate 512]
    python -m bench.bench_capacity --skew 1 [--ep 2,4] [--redundant 4] [--skew-window 64] [--skew-interval 192]

1. Writes a random qwen3_moe checkpoint (seeded, ``save_pretrained``, no download) into a
   temporary directory; its size is set by the flags (by default 108 M parameters, where the
   reference spends most of its CPU in matrix multiplications: the share is measured and shown).
2. The reference, in this process: transformers alone, ``torch.set_num_threads(1)``, greedy
   ``generate`` on the same requests (``--requests`` seeded prompts of ``--prompt-len`` token ids,
   ``--new-tokens`` each, no EOS), 16 at once (``--ref-batch``) and 1 at a time. CPU time
   (``time.process_time``) and wall time of each.
3. The deployment, as a user runs it: ``elastic-ep serve DEPLOYMENT.yaml`` in a child process on
   the same checkpoint at each EP size of ``--ep`` (``serving.background_load: false``). Each
   concurrency of ``--concurrency`` sends the requests over HTTP (``POST /v1/completions``,
   greedy, ``ignore_eos``, token ids back), at most that many in flight (closed loop; at
   concurrency 1 only the first ``--single-requests``). CPU time is summed over every process of
   the deployment (the server, its coordinator and every worker, found as the server's
   descendants in ``/proc``, forkserver children included; every rank's pid from ``GET /state``
   must be among them), from before the first request is sent to after the last answer.
   Idle CPU: the same sum over ``--idle-s`` seconds with no request, divided by the ranks.
   Every EP size's deployment is up at once (an idle one sleeps) and their runs are interleaved:
   ``--repeats`` rounds, each serving every concurrency on every EP size in turn, then the
   reference again; a run's figures are its median round's (this machine's speed drifts by 1.5x
   over minutes: interleaving puts the sizes compared in the same minutes).
4. Checks the served tokens of every request against the reference's (1 at a time), and prints
   one table with every figure and the issue's targets (PASS/FAIL). A figure that cannot be
   measured (a failed request, a missing process) ends the bench with an error, never a blank.

With ``--skew S`` (> 0) the bench measures skewed routing with the EPLB on and off instead of steps
3's runs: each layer's router rows (``model.layers.N.mlp.gate.weight``) are scaled by Zipf-like
factors (:func:`skew_factors`) in the written checkpoint, so the reference and the deployment route
the same skewed way (how skewed is measured: the hottest expert's pairs over the mean's, from the
reference's routers and from the deployment's load window). At each EP size, a deployment with the
EPLB on (rebalancing every ``--skew-interval`` steps over a window of ``--skew-window`` steps) serves
rounds of the requests at the largest concurrency until a rebalance has finished and a whole window
and ``--skew-after-rounds`` rounds have passed after it; then one with the EPLB off
(``eplb.enabled: false``) serves as many rounds. Each round is before, during or after the first
rebalance (the on run's phases, by round, for both). Per phase: CPU/token, tokens/s, the tokens
checked, the dispatch's balancedness per step (``GET /state``'s, sampled every 0.1 s: mean over
layers of mean / max pairs per rank of the rank's last step) and over the load window at the phase's
end (``GET /placement``: the window's pairs per expert under the placement, split evenly over an
expert's replicas: the EPLB's model; the dispatch cuts an expert's pairs over its replicas only
where that lowers the busiest rank, so a step reaches it only as far as its few pairs allow),
with an estimate of a decode step's (:func:`step_ceiling`: pairs drawn from the window, cut as
the dispatch cuts them). Targets: balancedness after the first rebalance with
the EPLB on at least 0.9 (window and per step), the tokens/s after it on over off (reported), no
token unlike the reference's.

The exit status is 0 when every target measured passes.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator, Sequence
from contextlib import ExitStack, contextmanager
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from bench.common import descendants, machine_info, stat_fields, write_json

CLK_TCK = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100
#: transformers' own ops that do the model's arithmetic (the "compute" share of the reference)
MATMUL_OPS = frozenset({"aten::mm", "aten::addmm", "aten::bmm", "aten::baddbmm", "aten::_grouped_mm",
                        "aten::_scaled_dot_product_flash_attention_for_cpu"})


class BenchError(RuntimeError):
    """A figure could not be measured: the bench stops and says which."""


# -- the model and the requests -------------------------------------------------------------------

def checkpoint_config(args: argparse.Namespace) -> dict[str, Any]:
    """The qwen3_moe config of the checkpoint (every layer an MoE layer, no EOS: every request runs its length)."""
    heads = args.heads
    if args.hidden % heads:
        raise BenchError(f"--hidden {args.hidden} is not a multiple of --heads {heads}")
    return {"vocab_size": args.vocab, "hidden_size": args.hidden, "num_hidden_layers": args.layers,
            "num_attention_heads": heads, "num_key_value_heads": max(1, heads // 2), "head_dim": args.hidden // heads,
            "intermediate_size": 4 * args.moe_intermediate, "moe_intermediate_size": args.moe_intermediate,
            "num_experts": args.experts, "num_experts_per_tok": args.top_k, "decoder_sparse_step": 1,
            "mlp_only_layers": [], "max_position_embeddings": max(128, args.prompt_len + args.new_tokens),
            "tie_word_embeddings": False, "eos_token_id": None, "bos_token_id": None, "pad_token_id": None}


def write_checkpoint(directory: Path, config: dict[str, Any], seed: int, skew: float = 0.0) -> int:
    """A random (seeded) qwen3_moe checkpoint in ``directory``; returns its parameter count.
    ``skew`` > 0: each layer's router rows scaled by :func:`skew_factors` (the reference and the
    deployment load the same files, so both route the same skewed way)."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(AutoConfig.for_model("qwen3_moe", **config))
    model.generation_config.eos_token_id = None
    if skew:
        with torch.no_grad():
            for layer in range(config["num_hidden_layers"]):
                gate = model.get_parameter(f"model.layers.{layer}.mlp.gate.weight")  # [experts, hidden]
                factors = skew_factors(config["num_experts"], skew, f"{seed}-{layer}")
                gate.mul_(torch.tensor(factors, dtype=gate.dtype)[:, None])
    model.save_pretrained(directory)
    return sum(p.numel() for p in model.parameters())


def skew_factors(num_experts: int, skew: float, seed: str) -> list[float]:
    """Zipf-like scales of a layer's router rows: the expert of popularity rank ``r`` (0: the hottest)
    gets ``(r + 1) ** -skew``, and which expert has which rank is a seeded permutation (so the hot
    experts are not all on one rank of the static placement). A row scaled up has logits of a larger
    spread, so its expert wins the top-k more often: at ``skew`` 1 on the default model the hottest
    expert gets about 7x the mean share of pairs. ``skew`` 0: every factor 1.0 (the checkpoint as without)."""
    import random

    if skew < 0 or not math.isfinite(skew):
        raise BenchError(f"--skew must be a finite number >= 0, got {skew}")
    ranks = list(range(num_experts))
    random.Random(f"skew-{seed}").shuffle(ranks)
    return [(rank + 1) ** -skew for rank in ranks]


def hot_over_mean(load: Any) -> list[float]:
    """Per layer of ``load [layers, experts]`` (pairs per expert): the hottest expert's pairs over the
    mean expert's (1.0 when even; the number of experts when one expert gets every pair)."""
    out = []
    for row in load.tolist():
        total = sum(row)
        if total <= 0:
            raise BenchError("a layer with no routed pairs: its skew cannot be measured")
        out.append(max(row) * len(row) / total)
    return out


def reference_routing(model_dir: Path, prompts: list[list[int]]) -> Any:
    """``[layers, experts]``: the pairs the reference's routers send to each expert over the prompts'
    prefill (a forward hook on every ``mlp.gate``, which returns ``(logits, scores, indices)``)."""
    import torch

    torch.set_num_threads(1)
    model = _load_reference(model_dir)
    config = model.config
    counts = torch.zeros(config.num_hidden_layers, config.num_experts, dtype=torch.int64)
    hooks = []
    for layer in range(config.num_hidden_layers):
        def count(_module: Any, _inputs: Any, output: Any, layer: int = layer) -> None:
            counts[layer] += torch.bincount(output[2].flatten(), minlength=config.num_experts)
        hooks.append(model.get_submodule(f"model.layers.{layer}.mlp.gate").register_forward_hook(count))
    try:
        with torch.inference_mode():
            model(torch.tensor(prompts), attention_mask=torch.ones(len(prompts), len(prompts[0]), dtype=torch.int64))
    finally:
        for hook in hooks:
            hook.remove()
    return counts


def make_prompts(n: int, length: int, vocab: int, seed: int) -> list[list[int]]:
    """``n`` seeded prompts of ``length`` token ids."""
    import random

    rng = random.Random(seed)
    return [[rng.randrange(vocab) for _ in range(length)] for _ in range(n)]


# -- CPU time of a process tree (Linux /proc) ---------------------------------------------------------

def process_cpu(pid: int) -> tuple[tuple[int, int], float] | None:
    """``((pid, start time), CPU seconds)``: user + system of the process and its reaped children."""
    fields = stat_fields(pid)
    if fields is None:
        return None
    utime, stime, cutime, cstime = (int(fields[i]) for i in (11, 12, 13, 14))
    return (pid, int(fields[19])), (utime + stime + cutime + cstime) / CLK_TCK


def tree_cpu(root: int) -> dict[tuple[int, int], float]:
    """CPU seconds of every process of the tree under ``root``, by (pid, start time)."""
    out = {}
    for pid in descendants(root):
        got = process_cpu(pid)
        if got is not None:
            out[got[0]] = got[1]
    return out


def cpu_between(before: dict[tuple[int, int], float], after: dict[tuple[int, int], float]) -> float:
    """CPU seconds the tree spent between two snapshots (a process started in between counts whole)."""
    return sum(seconds - before.get(key, 0.0) for key, seconds in after.items())


# -- the reference: transformers alone ------------------------------------------------------------

@dataclass(frozen=True)
class RunFigures:
    """One measured run: CPU seconds, wall seconds and tokens generated."""

    cpu_s: float
    wall_s: float
    tokens: int

    @property
    def cpu_per_token_ms(self) -> float:
        return 1e3 * self.cpu_s / self.tokens

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / self.wall_s

    def as_dict(self) -> dict[str, float]:
        return asdict(self) | {"cpu_per_token_ms": self.cpu_per_token_ms, "tokens_per_s": self.tokens_per_s}


def reference(model_dir: Path, prompts: list[list[int]], new_tokens: int, batch: int
              ) -> tuple[RunFigures, list[list[int]]]:
    """Greedy ``generate`` of transformers in this process at one thread, ``batch`` prompts at a time."""
    import torch

    torch.set_num_threads(1)
    model = _load_reference(model_dir)
    outputs: list[list[int]] = []
    with torch.inference_mode():
        _generate(model, torch.tensor(prompts[:1]), 2)  # warm-up
        cpu, wall = time.process_time(), time.perf_counter()
        for i in range(0, len(prompts), batch):
            ids = torch.tensor(prompts[i:i + batch])
            out = _generate(model, ids, new_tokens)
            outputs += [row[ids.shape[1]:].tolist() for row in out]
        figures = RunFigures(time.process_time() - cpu, time.perf_counter() - wall, sum(len(o) for o in outputs))
    return figures, outputs


def _generate(model: Any, ids: Any, new_tokens: int) -> Any:
    """Greedy ``generate`` of every prompt whole: an explicit all-ones attention mask (with none,
    transformers masks every prompt token equal to the pad id as padding)."""
    import torch

    return model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new_tokens, do_sample=False,
                          pad_token_id=0)


def _load_reference(model_dir: Path) -> Any:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype="float32").eval()
    model.generation_config.eos_token_id = None
    return model


def matmul_share(model_dir: Path, prompts: list[list[int]], new_tokens: int) -> float:
    """The share of the reference's operator time in matrix multiplications (torch profiler, one batch)."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    torch.set_num_threads(1)
    model = _load_reference(model_dir)
    with torch.inference_mode(), profile(activities=[ProfilerActivity.CPU]) as prof:
        _generate(model, torch.tensor(prompts), new_tokens)
    events = prof.key_averages()
    total = sum(e.self_cpu_time_total for e in events)
    return sum(e.self_cpu_time_total for e in events if e.key in MATMUL_OPS) / total if total else math.nan


# -- the deployment: elastic-ep serve, as a user runs it ----------------------------------------------

def deployment_yaml(model_dir: Path, ep: int, args: argparse.Namespace, eplb_on: bool | None = None
                    ) -> dict[str, Any]:
    """The deployment's config. ``eplb_on`` (the skewed runs): the EPLB on or off (``eplb.enabled``),
    rebalancing every ``--skew-interval`` steps over a window of ``--skew-window`` steps; None: the
    EPLB's defaults (a rebalance every 3000 steps: none in the runs)."""
    eplb: dict[str, Any] = {"num_redundant_experts": args.redundant, "use_async": True}
    if eplb_on is not None:
        eplb |= {"enabled": eplb_on, "step_interval": args.skew_interval, "window_size": args.skew_window}
    return {"ep_size": ep, "max_ep_size": ep, "model": {"kind": "hf", "path": str(model_dir)},
            "eplb": eplb,
            "serving": {"max_batch": max(args.concurrency), "max_queue": 4 * len(args.prompts_all),
                        "background_load": False, "max_tokens_limit": max(1024, args.new_tokens)},
            "timeouts": {"worker_start": 600}}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@dataclass
class Deployment:
    """A running ``elastic-ep serve``: its URL, server process, model name and rank pids."""

    url: str
    process: subprocess.Popen
    model: str = ""
    rank_pids: tuple[int, ...] = ()

    def cpu(self) -> dict[tuple[int, int], float]:
        """A CPU snapshot of the whole deployment; fails when a rank is not in the server's tree."""
        snapshot = tree_cpu(self.process.pid)
        pids = {pid for pid, _ in snapshot}
        missing = [pid for pid in self.rank_pids if pid not in pids]
        if missing or self.process.poll() is not None:
            raise BenchError(f"rank pids {missing} not under the server (pid {self.process.pid}, "
                             f"exit {self.process.poll()}): their CPU would not be counted")
        return snapshot


@contextmanager
def serve(model_dir: Path, ep: int, args: argparse.Namespace, workdir: Path,
          samples: Path | None = None, eplb_on: bool | None = None) -> Iterator[Deployment]:
    """``elastic-ep serve`` on a free port until the block ends; every process of it is gone afterwards.
    With ``samples``, every process of it runs the stack sampler (``bench/capacity_sampler``) into it.
    ``eplb_on``: see :func:`deployment_yaml`."""
    import yaml

    name = f"ep{ep}" if eplb_on is None else f"ep{ep}-eplb-{'on' if eplb_on else 'off'}"
    config = workdir / f"{name}.yaml"
    config.write_text(yaml.safe_dump(deployment_yaml(model_dir, ep, args, eplb_on)))
    port = _free_port()
    log = open(workdir / f"serve-{name}.log", "wb")
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "GLOO_SOCKET_IFNAME": os.environ.get("GLOO_SOCKET_IFNAME", "lo")}
    if samples is not None:
        samples.mkdir(parents=True, exist_ok=True)
        sampler = str(Path(__file__).resolve().parent / "capacity_sampler")
        env |= {"ELASTIC_EP_SAMPLE_DIR": str(samples),
                "PYTHONPATH": os.pathsep.join(filter(None, [sampler, os.environ.get("PYTHONPATH")]))}
    process = subprocess.Popen([sys.executable, "-m", "elastic.cli", "serve", str(config), "--port", str(port),
                                "--log-level", "warning"], stdout=log, stderr=subprocess.STDOUT, env=env,
                               start_new_session=True)
    deployment = Deployment(f"http://127.0.0.1:{port}", process)
    try:
        _wait_ready(deployment, ep, args.start_timeout, workdir / f"serve-{name}.log")
        yield deployment
    finally:
        _stop(process)
        log.close()


def _wait_ready(d: Deployment, ep: int, timeout: float, log: Path) -> None:
    import httpx

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if d.process.poll() is not None:
            raise BenchError(f"elastic-ep serve exited with {d.process.returncode}: {log.read_text()[-2000:]}")
        try:
            state = httpx.get(f"{d.url}/state", timeout=5).json()
            if state.get("state") == "running" and len(state.get("ranks", [])) == ep and \
                    httpx.get(f"{d.url}/health", timeout=5).status_code == 200:
                d.model = str(httpx.get(f"{d.url}/v1/models", timeout=5).json()["data"][0]["id"])
                d.rank_pids = tuple(int(r["pid"]) for r in sorted(state["ranks"], key=lambda r: int(r["rank"])))
                return
        except (httpx.HTTPError, ValueError, KeyError):
            pass
        time.sleep(1.0)
    raise BenchError(f"elastic-ep serve at EP {ep} not ready within {timeout:.0f} s: {log.read_text()[-2000:]}")


def _stop(process: subprocess.Popen) -> None:
    """SIGTERM the server (it stops its workers), then SIGKILL whatever of its tree is left."""
    tree = descendants(process.pid)
    if process.poll() is None:
        process.send_signal(signal.SIGTERM)
        try:
            process.wait(60)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait(30)
    for pid in tree:
        if stat_fields(pid) is not None and pid != process.pid:
            try:
                os.kill(pid, signal.SIGKILL)
            except OSError:
                pass


# -- the client ---------------------------------------------------------------------------------------

async def _complete(client: Any, d: Deployment, prompt: list[int], max_tokens: int) -> list[int]:
    body = {"model": d.model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True,
            "return_token_ids": True}
    response = await client.post(f"{d.url}/v1/completions", json=body)
    if response.status_code != 200:
        raise BenchError(f"a request failed: HTTP {response.status_code}: {response.text[:300]}")
    choice = response.json()["choices"][0]
    if choice.get("finish_reason") != "length" or choice.get("token_ids") is None:
        raise BenchError(f"a request ended with {choice.get('finish_reason')!r} (token_ids "
                         f"{'present' if choice.get('token_ids') is not None else 'absent'})")
    return [int(t) for t in choice["token_ids"]]


async def _send_all(d: Deployment, prompts: list[list[int]], max_tokens: int, concurrency: int) -> list[list[int]]:
    import httpx

    gate = asyncio.Semaphore(concurrency)
    limits = httpx.Limits(max_connections=concurrency + 2, max_keepalive_connections=concurrency + 2)
    async with httpx.AsyncClient(limits=limits, timeout=1800.0) as client:
        async def one(prompt: list[int]) -> list[int]:
            async with gate:
                return await _complete(client, d, prompt, max_tokens)
        return list(await asyncio.gather(*(one(p) for p in prompts)))


def cpu_by_process(d: Deployment, before: dict[tuple[int, int], float], after: dict[tuple[int, int], float],
                   seconds: float) -> dict[str, float]:
    """Cores each part of the deployment used between two snapshots: rank N, the server, other (forkserver...)."""
    names = {pid: f"rank {r}" for r, pid in enumerate(d.rank_pids)} | {d.process.pid: "server"}
    by: dict[str, float] = {}
    for key, cpu in after.items():
        name = names.get(key[0], "other")
        by[name] = by.get(name, 0.0) + (cpu - before.get(key, 0.0)) / seconds
    return by


def served_run(d: Deployment, prompts: list[list[int]], max_tokens: int, concurrency: int
               ) -> tuple[RunFigures, list[list[int]], dict[str, float]]:
    """The requests at ``concurrency`` in flight: the deployment's CPU over the run, wall time, tokens;
    the outputs; the cores by process."""
    before, wall = d.cpu(), time.perf_counter()
    outputs = asyncio.run(_send_all(d, prompts, max_tokens, concurrency))
    seconds = time.perf_counter() - wall
    after = d.cpu()
    figures = RunFigures(cpu_between(before, after), seconds, sum(len(o) for o in outputs))
    return figures, outputs, cpu_by_process(d, before, after, seconds)


def idle_cores(d: Deployment, seconds: float) -> tuple[float, dict[str, float]]:
    """Cores the whole deployment uses with no request, over ``seconds``; and by process."""
    before, wall = d.cpu(), time.perf_counter()
    time.sleep(seconds)
    after = d.cpu()
    elapsed = time.perf_counter() - wall
    return cpu_between(before, after) / elapsed, cpu_by_process(d, before, after, elapsed)


def mismatches(served: Sequence[list[int]], expected: Sequence[list[int]]) -> list[int]:
    """Indices of the requests whose tokens differ from the expected ones."""
    if len(served) > len(expected):
        raise BenchError(f"{len(served)} served requests against {len(expected)} reference outputs")
    return [i for i, (s, e) in enumerate(zip(served, expected)) if s != e]


def median_run(runs: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """The run of median CPU per token among a concurrency's repeats (the lower middle of an even
    count), with every repeat's CPU per token and tokens/s beside it, and every repeat's mismatched
    requests (none may differ in any)."""
    ordered = sorted(runs, key=lambda r: r["cpu_per_token_ms"])
    chosen = dict(ordered[(len(ordered) - 1) // 2])
    chosen["repeats"] = [{"cpu_per_token_ms": r["cpu_per_token_ms"], "tokens_per_s": r["tokens_per_s"]} for r in runs]
    chosen["mismatched"] = sorted({i for r in runs for i in r["mismatched"]})
    return chosen


def measure_eps(model_dir: Path, args: argparse.Namespace, expected: list[list[int]], workdir: Path
                ) -> tuple[dict[int, dict[str, Any]], list[RunFigures]]:
    """Every EP size's deployment up at once (an idle one sleeps: 0.01 cores a rank), each one's idle
    CPU, then ``--repeats`` rounds; in each round every deployment serves every concurrency's run in
    turn (the EP sizes ascending in even rounds, descending in odd ones), and the reference runs
    after it. A run's figures are the median repeat's (:func:`median_run`): this machine's speed
    drifts by 1.5x over minutes, and interleaving puts the EP sizes' runs in the same minutes.
    Returns the figures per EP size and the reference's runs."""
    out: dict[int, dict[str, Any]] = {ep: {"ep": ep, "runs": {}} for ep in args.ep}
    raw: dict[int, dict[int, list[dict[str, Any]]]] = {ep: {c: [] for c in args.concurrency} for ep in args.ep}
    references: list[RunFigures] = []
    with ExitStack() as stack:
        deployments: dict[int, tuple[Deployment, Path | None]] = {}
        for ep in args.ep:
            samples = workdir / f"samples-ep{ep}" if args.profile else None
            d = stack.enter_context(serve(model_dir, ep, args, workdir, samples))
            asyncio.run(_send_all(d, args.prompts_all[:2], 4, 2))  # warm-up: the first requests' set-up
            deployments[ep] = (d, samples)
        time.sleep(args.settle_s)
        for ep, (d, _) in deployments.items():
            idle, by_process = idle_cores(d, args.idle_s)
            out[ep] |= {"idle_cores": idle, "idle_cores_per_rank": idle / ep, "idle_by_process": by_process,
                        "processes": len(d.cpu())}
            print(f"EP {ep}, idle: {idle:.3f} cores ({_cores(by_process)})", file=sys.stderr)
        for round_ in range(args.repeats):
            for ep in (args.ep if round_ % 2 == 0 else list(reversed(args.ep))):
                d, samples = deployments[ep]
                for concurrency in args.concurrency:
                    prompts = args.prompts_all if concurrency > 1 else args.prompts_all[:args.single_requests]
                    profiled = samples is not None and concurrency == max(args.concurrency) and round_ == args.repeats - 1
                    if profiled:
                        (samples / "on").touch()  # type: ignore[operator]
                    figures, outputs, by_process = served_run(d, prompts, args.new_tokens, concurrency)
                    raw[ep][concurrency].append(figures.as_dict() | {
                        "requests": len(prompts), "cores_by_process": by_process,
                        "mismatched": mismatches(outputs, expected)})
                    print(f"EP {ep}, concurrency {concurrency}, round {round_ + 1}: {figures.tokens_per_s:.1f} tokens/s, "
                          f"{figures.cpu_per_token_ms:.2f} ms CPU/token ({_cores(by_process)})", file=sys.stderr)
                    if profiled:
                        out[ep]["profile"] = _collect_profile(d, samples)  # type: ignore[arg-type]
            # the reference again after each round, so every ratio is taken to the reference's runs around the served ones
            again, _ = reference(model_dir, args.prompts_all, args.new_tokens, args.ref_batch)
            references.append(again)
    for ep in args.ep:
        out[ep]["runs"] = {c: median_run(raw[ep][c]) for c in args.concurrency}
    return out, references


# -- skewed routing, EPLB on and off (--skew) ----------------------------------------------------------

class StatePoller:
    """``GET /state`` every ``period`` seconds on a thread: one sample per decode step seen (the step of
    the slowest rank, the balancedness of the last step each rank recorded (the lowest), the finished
    rebalances, the layers committed and the layer in flight)."""

    def __init__(self, url: str, period: float = 0.1) -> None:
        import threading

        self.url, self.period = url, period
        self.samples: dict[int, dict[str, Any]] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="state-poller", daemon=True)
        self.errors = 0

    def __enter__(self) -> StatePoller:
        self._thread.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self._stop.set()
        self._thread.join(30)

    def _run(self) -> None:
        import httpx

        with httpx.Client(timeout=10) as client:
            while not self._stop.wait(self.period):
                try:
                    state = client.get(f"{self.url}/state").json()
                except (httpx.HTTPError, ValueError):
                    self.errors += 1
                    continue
                if state.get("balancedness") is None:
                    continue
                step = int(state["step"])
                self.samples.setdefault(step, {"step": step, "balancedness": float(state["balancedness"]),
                                               "rebalances": int(state.get("rebalances") or 0),
                                               "layers_committed": int(state.get("layers_committed") or 0),
                                               "in_flight_layer": state.get("in_flight_layer")})

    def done_step(self, rebalances: int) -> int | None:
        """The first step seen with ``rebalances`` finished (the rebalance ended at or before it)."""
        steps = [s["step"] for s in self.samples.values() if s["rebalances"] >= rebalances]
        return min(steps) if steps else None


def window_figures(document: dict[str, Any]) -> dict[str, Any]:
    """From a placement file (``GET /placement``): the balancedness of its load window under its placement
    (mean over layers of mean rank load / max rank load, an expert's pairs split evenly over its replicas:
    the EPLB's model. The dispatch sends a step's pairs of an expert whole to the replica on the least
    loaded rank, or spreads them where that lowers the busiest rank; the window keeps pairs per
    logical expert, not per slot), the window's steps, and its skew (the hottest
    expert's pairs over the mean's, per layer)."""
    from eplb.placement import Placement
    from eplb.placement_file import parse_placement

    parsed = parse_placement(document)
    if parsed.window_steps < 1 or float(parsed.logical_load.sum()) <= 0:
        raise BenchError("the deployment's load window is empty: no balancedness to read")
    placement = Placement.from_physical_to_logical(parsed.physical_to_logical, parsed.num_logical_experts)
    per_layer = placement.balancedness(parsed.logical_load, parsed.ep_size)
    return {"balancedness": float(per_layer.mean()), "layers": [float(b) for b in per_layer],
            "steps": parsed.window_steps, "step": int(document.get("step", -1)),
            "hot_over_mean": hot_over_mean(parsed.logical_load), "replicas": parsed.num_physical}


def step_ceiling(document: dict[str, Any], tokens: int, top_k: int, draws: int = 200, seed: int = 0) -> float:
    """The per-step balancedness a placement file's placement can reach on its window's load: steps of
    ``tokens * top_k`` pairs, each drawn on its own in proportion to the window's pairs per expert (the
    window's shares exactly; a token's k experts are distinct in the model, which this leaves out),
    every expert's pairs cut over its replicas as the dispatch does (:func:`eplb.models.dispatch.assign`);
    mean over ``draws`` steps and the layers. Below 1.0 from sampling alone: a decode step of 16 tokens
    at top-2 is 32 pairs for all the ranks."""
    import torch

    from eplb.models.dispatch import assign
    from eplb.placement import Placement
    from eplb.placement_file import parse_placement

    parsed = parse_placement(document)
    placement = Placement.from_physical_to_logical(parsed.physical_to_logical, parsed.num_logical_experts)
    generator = torch.Generator().manual_seed(seed)
    total = 0.0
    for layer in range(parsed.num_moe_layers):
        load = parsed.logical_load[layer].double()
        if float(load.sum()) <= 0:
            raise BenchError(f"layer {layer}'s window has no pairs: no step to draw")
        picks = torch.multinomial(load.expand(draws, -1), tokens * top_k, replacement=True, generator=generator)
        counts = torch.zeros(draws, parsed.num_logical_experts, dtype=torch.int64).scatter_add_(
            1, picks, torch.ones(draws, tokens * top_k, dtype=torch.int64))
        for row in counts:
            per_slot = assign(row[None], placement.logical_to_physical[layer], placement.replica_count[layer],
                              placement.num_physical, parsed.ep_size)[0]
            per_rank = per_slot.view(parsed.ep_size, -1).sum(1).double()
            total += float(per_rank.mean() / per_rank.max())
    return total / (draws * parsed.num_moe_layers)


def phase_of_rounds(rounds: list[dict[str, Any]]) -> list[str]:
    """Each round's phase: ``before`` (the placement at its end still the start's: no rebalance
    finished, no layer committed, none in flight), ``after`` (it started with a rebalance finished),
    ``during`` (the others: a rebalance committed or in flight in it)."""
    out = []
    for r in rounds:
        if r["rebalances_start"] >= 1:
            out.append("after")
        elif r["rebalances_end"] == 0 and r["layers_committed_end"] == 0 and r["in_flight_end"] is None:
            out.append("before")
        else:
            out.append("during")
    return out


def phase_figures(rounds: list[dict[str, Any]], phases: list[str], phase: str,
                  samples: dict[int, dict[str, Any]]) -> dict[str, Any]:
    """The rounds of ``phase`` together: CPU, wall and tokens summed; the sampled steps' mean
    balancedness (steps inside those rounds); the window balancedness at the phase's last round's end."""
    chosen = [r for r, ph in zip(rounds, phases) if ph == phase]
    if not chosen:
        raise BenchError(f"no round {phase} the first rebalance: run more rounds (--skew-max-rounds) or rebalance "
                         "sooner (--skew-interval)")
    figures = RunFigures(sum(r["cpu_s"] for r in chosen), sum(r["wall_s"] for r in chosen),
                         sum(r["tokens"] for r in chosen))
    steps = [s["balancedness"] for s in samples.values()
             if any(r["step_start"] < s["step"] <= r["step_end"] for r in chosen)]
    if not steps:
        raise BenchError(f"no /state sample of a step {phase} the first rebalance")
    rates = sorted(r["tokens"] / r["wall_s"] for r in chosen)
    return figures.as_dict() | {
        "rounds": len(chosen), "requests": sum(r["requests"] for r in chosen),
        "round_tokens_per_s": {"min": rates[0], "median": statistics.median(rates), "max": rates[-1]},
        "mismatched": [i for r in chosen for i in r["mismatched"]],
        "step_balancedness": sum(steps) / len(steps), "sampled_steps": len(steps),
        "window": chosen[-1]["window"]}


def _get_json(d: Deployment, path: str, timeout: float = 60.0) -> dict[str, Any]:
    import httpx

    response = httpx.get(f"{d.url}{path}", timeout=timeout)
    if response.status_code != 200:
        raise BenchError(f"GET {path}: HTTP {response.status_code}: {response.text[:300]}")
    return dict(response.json())


def measure_skew(model_dir: Path, ep: int, eplb_on: bool, args: argparse.Namespace, expected: list[list[int]],
                 workdir: Path, phases: list[str] | None = None) -> dict[str, Any]:
    """Rounds of the requests at the largest concurrency on a deployment with the EPLB on (until a
    rebalance has finished, and a whole load window and ``--skew-after-rounds`` rounds have passed
    after it) or off (``phases``: as many
    rounds as the EPLB-on run, each with its phase). Per round: its figures, the tokens checked, and
    the window balancedness at its end (``GET /placement``); every step's balancedness sampled from
    ``GET /state`` meanwhile."""
    concurrency = max(args.concurrency)
    rounds: list[dict[str, Any]] = []
    with serve(model_dir, ep, args, workdir, eplb_on=eplb_on) as d, StatePoller(d.url) as poller:
        asyncio.run(_send_all(d, args.prompts_all[:2], 4, 2))  # warm-up
        while True:
            start = _get_json(d, "/state")
            figures, outputs, _ = served_run(d, args.prompts_all, args.new_tokens, concurrency)
            document = _get_json(d, "/placement")
            window = window_figures(document) | {"step_ceiling": step_ceiling(document, concurrency, args.top_k)}
            end = _get_json(d, "/state")
            rounds.append(figures.as_dict() | {
                "requests": len(outputs), "mismatched": mismatches(outputs, expected),
                "step_start": int(start["step"]), "step_end": int(end["step"]),
                "rebalances_start": int(start.get("rebalances") or 0), "rebalances_end": int(end.get("rebalances") or 0),
                "layers_committed_end": int(end.get("layers_committed") or 0),
                "in_flight_end": end.get("in_flight_layer"), "window": window})
            print(f"EP {ep}, skew {args.skew}, EPLB {'on' if eplb_on else 'off'}, round {len(rounds)}: steps "
                  f"{rounds[-1]['step_start']}-{rounds[-1]['step_end']}, {figures.tokens_per_s:.1f} tokens/s, "
                  f"window balancedness {window['balancedness']:.3f}, rebalances {rounds[-1]['rebalances_end']}",
                  file=sys.stderr)
            if phases is not None:
                if len(rounds) == len(phases):
                    break
                continue
            done = poller.done_step(rounds[-1]["rebalances_end"]) if rounds[-1]["rebalances_end"] else None
            if done is not None and rounds[-1]["in_flight_end"] is None and \
                    rounds[-1]["step_end"] - done >= args.skew_window and "before" in phase_of_rounds(rounds) and \
                    phase_of_rounds(rounds).count("after") >= args.skew_after_rounds:
                break
            if len(rounds) >= args.skew_max_rounds:
                raise BenchError(f"EP {ep}, EPLB on: no rebalance with a whole window after it in {len(rounds)} "
                                 f"rounds (steps up to {rounds[-1]['step_end']}, rebalances {rounds[-1]['rebalances_end']}"
                                 f"): raise --skew-max-rounds or lower --skew-interval")
        samples = dict(poller.samples)
    if phases is None:
        phases = phase_of_rounds(rounds)
    out: dict[str, Any] = {"eplb": eplb_on, "rounds": rounds, "phases": phases, "samples": len(samples),
                           "rebalances": rounds[-1]["rebalances_end"], "requests": sum(r["requests"] for r in rounds),
                           "mismatched": [i for r in rounds for i in r["mismatched"]]}  # every round, during too
    for phase in ("before", "after"):
        out[phase] = phase_figures(rounds, phases, phase, samples)
    return out


def run_skew(model_dir: Path, args: argparse.Namespace, expected: list[list[int]], workdir: Path
             ) -> dict[int, dict[str, Any]]:
    """EPLB on, then off with the on run's rounds and phases, at each EP size."""
    out: dict[int, dict[str, Any]] = {}
    for ep in args.ep:
        on = measure_skew(model_dir, ep, True, args, expected, workdir)
        off = measure_skew(model_dir, ep, False, args, expected, workdir, phases=on["phases"])
        out[ep] = {"on": on, "off": off}
        for name, data in (("on", on), ("off", off)):
            b, a = data["before"], data["after"]
            print(f"EP {ep}, EPLB {name}: balancedness window {b['window']['balancedness']:.3f} -> "
                  f"{a['window']['balancedness']:.3f}, per step {b['step_balancedness']:.3f} -> "
                  f"{a['step_balancedness']:.3f} (est. {a['window']['step_ceiling']:.3f}); tokens/s "
                  f"{b['tokens_per_s']:.1f} -> {a['tokens_per_s']:.1f} (rounds' median "
                  f"{b['round_tokens_per_s']['median']:.1f} -> {a['round_tokens_per_s']['median']:.1f})", file=sys.stderr)
    return out


def _cores(by_process: dict[str, float]) -> str:
    return ", ".join(f"{name} {cores:.2f} cores" for name, cores in sorted(by_process.items()))


# -- where the time goes (--profile) -------------------------------------------------------------------

def _collect_profile(d: Deployment, samples: Path) -> dict[str, Any]:
    """Stop the samplers, wait for their last dump, and summarize each rank's main thread and the server."""
    (samples / "on").unlink()
    time.sleep(1.5)
    roles = {pid: f"rank {r}" for r, pid in enumerate(d.rank_pids)} | {d.process.pid: "server"}
    out: dict[str, Any] = {}
    for pid, role in roles.items():
        path = samples / f"{pid}.json"
        if not path.exists():
            raise BenchError(f"--profile: no samples from {role} (pid {pid}) in {samples}")
        records = json.loads(path.read_text())
        out[role] = summarize_samples(records, None if role == "server" else "MainThread")
        print(format_profile(role, out[role]), file=sys.stderr)
    return out


#: innermost frames of a thread blocked with nothing to do (a lock, a poll): left out of the shares
WAITING_FRAMES = frozenset({"threading.py:wait", "threading.py:_wait_for_tstate_lock", "selectors.py:select",
                            "queues.py:get", "connection.py:poll", "connection.py:_recv", "socket.py:accept"})


def summarize_samples(records: list[list[Any]], thread: str | None, top: int = 15) -> dict[str, Any]:
    """From ``[thread, stack (outermost first), count]`` records: the share of samples spent waiting
    (``WAITING_FRAMES``), and of the others the share per innermost frame (self) and per frame
    anywhere in the stack (inclusive, without the frames in nearly every sample: the loop's callers)."""
    from collections import Counter

    own, anywhere = Counter(), Counter()  # type: ignore[var-annotated]
    total = waiting = 0
    for name, stack, count in records:
        if thread is not None and name != thread:
            continue
        total += count
        if stack and stack[-1] in WAITING_FRAMES:
            waiting += count
            continue
        own[stack[-1] if stack else "?"] += count
        for frame in set(stack):
            anywhere[frame] += count
    if not total:
        raise BenchError(f"no stack samples of thread {thread}")
    busy = max(1, total - waiting)
    inclusive = [(f, c / busy) for f, c in anywhere.most_common() if c / busy < 0.9][:top]
    return {"samples": total, "waiting": waiting / total, "self": [(f, c / busy) for f, c in own.most_common(top)],
            "inclusive": inclusive}


def format_profile(role: str, summary: dict[str, Any]) -> str:
    lines = [f"{role}: {summary['samples']} samples, {summary['waiting']:.0%} waiting; of the others, "
             "self (innermost frame):"]
    lines += [f"  {share:6.1%}  {frame}" for frame, share in summary["self"]]
    lines.append("  inclusive (frame anywhere in the stack):")
    lines += [f"  {share:6.1%}  {frame}" for frame, share in summary["inclusive"]]
    return "\n".join(lines)


# -- targets ------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class Target:
    name: str
    value: float
    limit: float | None  # None: a figure the issue asks for without a limit (always ok)
    at_most: bool  # value <= limit (else value >= limit)

    @property
    def ok(self) -> bool:
        if self.limit is None:
            return True
        return self.value <= self.limit if self.at_most else self.value >= self.limit


def _node(figures: dict[str, Any], *path: Any) -> Any:
    node: Any = figures
    for key in path:
        if not isinstance(node, dict) or key not in node:
            raise BenchError(f"figure {'/'.join(map(str, path))} was not measured")
        node = node[key]
    return node


def _figure(figures: dict[str, Any], *path: Any) -> float:
    value = float(_node(figures, *path))
    if not math.isfinite(value):
        raise BenchError(f"figure {'/'.join(map(str, path))} is {value}")
    return value


def targets(figures: dict[str, Any], eps: Sequence[int], concurrencies: Sequence[int]) -> list[Target]:
    """The issue's targets that this run's EP sizes and concurrencies measure (a missing figure raises).

    ``figures``: ``{"reference": {"batched"|"single": {cpu_per_token_ms, tokens_per_s}}, "ep": {ep: {"runs":
    {concurrency: {cpu_per_token_ms, tokens_per_s, mismatched, ...}}, "idle_cores_per_rank"}}}``.
    """
    def run(size: int, concurrency: int, name: str) -> float:
        return _figure(figures, "ep", size, "runs", concurrency, name)

    out: list[Target] = []
    if 16 in concurrencies:
        ref_cpu = _figure(figures, "reference", "batched", "cpu_per_token_ms")
        for size, factor in ((2, 2.0), (4, 3.0)):
            if size in eps:
                out.append(Target(f"CPU/token at 16, EP {size} / reference (x)",
                                  run(size, 16, "cpu_per_token_ms") / ref_cpu, factor, True))
        if 2 in eps and 4 in eps:
            out.append(Target("CPU/token at 16, EP 4 / EP 2 (x)",
                              run(4, 16, "cpu_per_token_ms") / run(2, 16, "cpu_per_token_ms"), 1.5, True))
            out.append(Target("  the same, median of each round's own ratio (x)",
                              statistics.median(paired_ratios(figures, 4, 2, 16)), None, True))
        if 2 in eps:
            out.append(Target("tokens/s at 16, EP 2 / reference (x)", run(2, 16, "tokens_per_s")
                              / _figure(figures, "reference", "batched", "tokens_per_s"), 0.5, False))
        if 2 in eps and 1 in concurrencies:
            out.append(Target("tokens/s at 16 / at 1, EP 2 (x)",
                              run(2, 16, "tokens_per_s") / run(2, 1, "tokens_per_s"), 4.0, False))
    for size in eps:
        out.append(Target(f"idle, EP {size} (cores per rank)", _figure(figures, "ep", size, "idle_cores_per_rank"),
                          0.05, True))
        wrong = sum(len(_mismatched(figures, size, c)) for c in concurrencies)
        out.append(Target(f"requests with tokens unlike the reference, EP {size}", wrong, 0, True))
    return out


def paired_ratios(figures: dict[str, Any], top: int, bottom: int, concurrency: int) -> list[float]:
    """Each round's CPU per token at EP ``top`` over EP ``bottom`` (the two ran in the same minutes:
    the machine's drift between rounds cancels out of each)."""
    def per_round(size: int) -> list[float]:
        repeats = _node(figures, "ep", size, "runs", concurrency, "repeats")
        if not repeats:
            raise BenchError(f"figure ep/{size}/runs/{concurrency}/repeats was not measured")
        return [float(r["cpu_per_token_ms"]) for r in repeats]

    ratios = [a / b for a, b in zip(per_round(top), per_round(bottom))]
    if not all(math.isfinite(r) for r in ratios):
        raise BenchError(f"a round's EP {top} / EP {bottom} is not finite: {ratios}")
    return ratios


def skew_targets(figures: dict[str, Any], eps: Sequence[int]) -> list[Target]:
    """The skewed-routing target at each EP size (a missing figure raises): the dispatch's balancedness
    after the first rebalance with the EPLB on, over the load window and per step (>= 0.9); the tokens/s
    after it, EPLB on over off (no limit in the issue), and before it (both runs on the static placement:
    how far apart two runs are by noise alone); and no request with tokens unlike the reference.

    ``figures``: ``{"skew": {ep: {"on"|"off": {"before"|"after": {tokens_per_s, step_balancedness,
    sampled_steps, mismatched, window: {balancedness, steps}}}}}}``."""
    out: list[Target] = []
    for size in eps:
        steps = int(_figure(figures, "skew", size, "on", "after", "window", "steps"))
        sampled = int(_figure(figures, "skew", size, "on", "after", "sampled_steps"))
        ceiling = _figure(figures, "skew", size, "on", "after", "window", "step_ceiling")
        out.append(Target(f"dispatch balancedness, skewed, EPLB on, EP {size}: window of {steps} steps after the "
                          "1st rebalance", _figure(figures, "skew", size, "on", "after", "window", "balancedness"),
                          0.9, False))
        out.append(Target(f"dispatch balancedness, skewed, EPLB on, EP {size}: per step after the 1st rebalance "
                          f"(mean of {sampled} sampled steps; est. of a decode step drawn from the window {ceiling:.3f})",
                          _figure(figures, "skew", size, "on", "after", "step_balancedness"), 0.9, False))
        for phase, what in (("after", "after the 1st rebalance"),
                            ("before", "before it (the same placement: the runs' noise)")):
            out.append(Target(f"tokens/s {what}, skewed, EPLB on / off, EP {size} (x, medians of the rounds)",
                              _figure(figures, "skew", size, "on", phase, "round_tokens_per_s", "median")
                              / _figure(figures, "skew", size, "off", phase, "round_tokens_per_s", "median"),
                              None, False))
        wrong = 0
        for mode in ("on", "off"):  # every round's requests, the rounds during the rebalance too
            try:
                wrong += len(figures["skew"][size][mode]["mismatched"])
            except (KeyError, TypeError) as exc:
                raise BenchError(f"the output check of EP {size}, EPLB {mode} was not made") from exc
        out.append(Target(f"requests with tokens unlike the reference, skewed, EP {size}", wrong, 0, True))
    return out


def _mismatched(figures: dict[str, Any], size: int, concurrency: int) -> list[int]:
    try:
        return list(figures["ep"][size]["runs"][concurrency]["mismatched"])
    except (KeyError, TypeError) as exc:
        raise BenchError(f"the output check of EP {size} at concurrency {concurrency} was not made") from exc


# -- the table ----------------------------------------------------------------------------------------

def _fmt(value: float, digits: int = 2) -> str:
    if not math.isfinite(value):
        raise BenchError(f"a figure is {value}")
    return f"{value:,.{digits}f}"


def print_table(figures: dict[str, Any], checks: list[Target], eps: Sequence[int], concurrencies: Sequence[int],
                caption: str = "") -> None:
    """Every figure, then the targets (a second header row names their columns), in one table.
    With ``figures["skew"]`` (``--skew``): the skewed runs' rows (EPLB on and off, before and after
    the first rebalance) with their balancedness in place of the idle column."""
    from rich.console import Console
    from rich.table import Table

    skewed = "skew" in figures
    table = Table(title=f"capacity: {figures['model']['summary']}", caption=caption)
    middle = ("balancedness, window", "balancedness, per step") if skewed else ("idle (cores/rank)",)
    columns = ("", "CPU/token (ms)", "tokens/s", "x reference CPU/token", *middle, "tokens unlike ref.")
    for column in columns:
        table.add_column(column, justify="left" if not column else "right")
    ref = figures["reference"]
    ref_cpu = ref["batched"]["cpu_per_token_ms"]
    for key in ("batched", "single"):
        row = ref[key]
        table.add_row(f"transformers, 1 process, 1 thread, batch {row['batch']}", _fmt(row["cpu_per_token_ms"]),
                      _fmt(row["tokens_per_s"], 1), _fmt(row["cpu_per_token_ms"] / ref_cpu), *["-"] * len(middle), "-")
    for size in eps if not skewed else ():
        data = figures["ep"][size]
        for c in concurrencies:
            run = data["runs"][c]
            table.add_row(f"elastic-ep EP {size}, {c} concurrent", _fmt(run["cpu_per_token_ms"]),
                          _fmt(run["tokens_per_s"], 1), _fmt(run["cpu_per_token_ms"] / ref_cpu),
                          _fmt(data["idle_cores_per_rank"], 3), f"{len(run['mismatched'])} of {run['requests']}")
    for size in eps if skewed else ():
        for mode in ("on", "off"):
            for phase in ("before", "after"):
                run = figures["skew"][size][mode][phase]
                table.add_row(f"elastic-ep EP {size}, {max(concurrencies)} concurrent, skew {figures['skew_s']:g}, "
                              f"EPLB {mode}: {phase} the 1st rebalance, {run['rounds']} rounds",
                              _fmt(run["cpu_per_token_ms"]),
                              f"{_fmt(run['tokens_per_s'], 1)} (median {_fmt(run['round_tokens_per_s']['median'], 1)})",
                              _fmt(run["cpu_per_token_ms"] / ref_cpu),
                              f"{_fmt(run['window']['balancedness'], 3)} ({run['window']['steps']} steps)",
                              f"{_fmt(run['step_balancedness'], 3)} ({run['sampled_steps']}; est. "
                              f"{_fmt(run['window']['step_ceiling'], 3)})",
                              f"{len(run['mismatched'])} of {run['requests']}")
    table.add_section()
    blank = [""] * (len(columns) - 4)
    table.add_row("[bold]target[/bold]", "[bold]measured[/bold]", "[bold]limit[/bold]", *blank, "[bold]verdict[/bold]")
    for t in checks:
        limit = "-" if t.limit is None else f"{'<=' if t.at_most else '>='} {t.limit:g}"
        verdict = "(reported)" if t.limit is None else "[green]PASS[/green]" if t.ok else "[red]FAIL[/red]"
        table.add_row(t.name, _fmt(t.value, 3), limit, *blank, verdict)
    Console(width=200 if skewed else 150).print(table)


# -- main ---------------------------------------------------------------------------------------------

def parse_args(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--ep", default="2,4", help="EP sizes to serve")
    ap.add_argument("--concurrency", default="1,16", help="requests in flight")
    ap.add_argument("--quick", action="store_true", help="a smaller model and fewer requests (a smoke run)")
    ap.add_argument("--hidden", type=int, default=512)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--experts", type=int, default=32)
    ap.add_argument("--top-k", type=int, default=2)
    ap.add_argument("--moe-intermediate", type=int, default=512)
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--vocab", type=int, default=4096)
    ap.add_argument("--redundant", type=int, default=4, help="redundant expert slots (must divide over every EP size)")
    ap.add_argument("--requests", type=int, default=16, help="requests of each run at concurrency > 1")
    ap.add_argument("--single-requests", type=int, default=4, help="requests of the run at concurrency 1")
    ap.add_argument("--prompt-len", type=int, default=32)
    ap.add_argument("--new-tokens", type=int, default=32)
    ap.add_argument("--ref-batch", type=int, default=16, help="the reference's batch (16 at once) beside 1 at a time")
    ap.add_argument("--repeats", type=int, default=3, help="rounds of every concurrency's run on every EP size, "
                    "interleaved; a run's figures are the median round's")
    ap.add_argument("--idle-s", type=float, default=10.0)
    ap.add_argument("--settle-s", type=float, default=2.0, help="wait after the warm-up before the idle measure")
    ap.add_argument("--start-timeout", type=float, default=900.0)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--profile", action="store_true",
                    help="sample every process's Python stacks during the largest concurrency's run and print "
                         "where each rank's decode thread and the server spend their time")
    ap.add_argument("--skew", type=float, default=0.0,
                    help="skewed routing: scale each layer's router rows by Zipf-like factors (rank r: (r+1)^-SKEW) and "
                         "measure EPLB on against off instead of the runs above (0: the checkpoint as without)")
    ap.add_argument("--skew-window", type=int, default=None, help="--skew: eplb.window_size (default 64, --quick 32)")
    ap.add_argument("--skew-interval", type=int, default=None,
                    help="--skew: eplb.step_interval (default 3 windows: one rebalance in the run)")
    ap.add_argument("--skew-after-rounds", type=int, default=4, help="--skew: fewest rounds after the first "
                    "rebalance (its tokens/s)")
    ap.add_argument("--skew-max-rounds", type=int, default=40, help="--skew: most rounds of the requests to wait "
                    "for a rebalance and a whole window after it")
    ap.add_argument("--keep", type=Path, default=None, help="write the checkpoint, configs and server logs here")
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    if args.quick:
        args.hidden, args.layers, args.experts, args.moe_intermediate, args.vocab = 128, 2, 16, 128, 512
        args.requests, args.single_requests, args.new_tokens, args.idle_s = 16, 2, 16, 4.0
    if args.skew_window is None:
        args.skew_window = 32 if args.quick else 64
    if args.skew_interval is None:
        args.skew_interval = 3 * args.skew_window
    if args.skew and args.skew_interval <= args.skew_window:
        raise SystemExit(f"--skew-interval {args.skew_interval} must exceed --skew-window {args.skew_window}: the "
                         "window before the first rebalance would not be whole")
    if args.repeats < 1:
        raise SystemExit(f"--repeats must be at least 1, got {args.repeats}")
    args.ep = [int(x) for x in args.ep.split(",")]
    args.concurrency = [int(x) for x in args.concurrency.split(",")]
    bad = [e for e in args.ep if e < 1 or (args.experts + args.redundant) % e]
    if bad:
        raise SystemExit(f"--ep {bad}: {args.experts} experts + {args.redundant} redundant slots do not divide over it")
    args.prompts_all = make_prompts(args.requests, args.prompt_len, args.vocab, args.seed + 1)
    return args


def run(args: argparse.Namespace, workdir: Path) -> dict[str, Any]:
    """Every measure of the bench; returns the figures."""
    model_dir = workdir / "checkpoint"
    config = checkpoint_config(args)
    params = write_checkpoint(model_dir, config, args.seed, args.skew)
    summary = (f"qwen3_moe {params / 1e6:.0f} M params, hidden {args.hidden}, {args.layers} layers, {args.experts} "
               f"experts top-{args.top_k}, moe_intermediate {args.moe_intermediate}; {args.requests} requests of "
               f"{args.prompt_len} + {args.new_tokens} tokens")
    if args.skew:
        summary += (f"; skewed routing {args.skew:g}, {args.redundant} redundant slots, EPLB every "
                    f"{args.skew_interval} steps over {args.skew_window}")
    figures: dict[str, Any] = {"model": {"summary": summary, "parameters": params, "config": config},
                               "reference": {}, "ep": {}, "machine": machine_info()}
    batch_figures, expected = reference(model_dir, args.prompts_all, args.new_tokens, 1)
    batched, batched_out = reference(model_dir, args.prompts_all, args.new_tokens, args.ref_batch)
    figures["reference"] = {"batched": batched.as_dict() | {"batch": args.ref_batch},
                            "single": batch_figures.as_dict() | {"batch": 1}}
    figures["reference_batched_unlike_single"] = mismatches(batched_out, expected)
    figures["reference_matmul_share"] = matmul_share(model_dir, args.prompts_all[:args.ref_batch], args.new_tokens)
    print(f"reference: batch {args.ref_batch} {batched.tokens_per_s:.1f} tokens/s, "
          f"{batched.cpu_per_token_ms:.2f} ms CPU/token; batch 1 {batch_figures.tokens_per_s:.1f} tokens/s; "
          f"matmul share {figures['reference_matmul_share']:.2f}", file=sys.stderr)
    if args.skew:
        counts = reference_routing(model_dir, args.prompts_all)
        figures["skew_s"] = args.skew
        figures["reference_hot_over_mean"] = hot_over_mean(counts)
        print(f"skew {args.skew}: the reference's routers over the prompts' prefill: hottest expert / mean "
              f"{', '.join(f'{x:.2f}' for x in figures['reference_hot_over_mean'])} (per layer)", file=sys.stderr)
        figures["skew"] = run_skew(model_dir, args, expected, workdir)
        return figures
    figures["ep"], again = measure_eps(model_dir, args, expected, workdir)
    runs = [batched, *again]
    figures["reference"]["batched_runs"] = [r.cpu_per_token_ms for r in runs]
    figures["reference"]["batched"] |= {
        "cpu_per_token_ms": statistics.fmean(r.cpu_per_token_ms for r in runs),
        "tokens_per_s": statistics.fmean(r.tokens_per_s for r in runs)}
    return figures


def skew_caption(figures: dict[str, Any], eps: Sequence[int]) -> str:
    """How skewed the routing was (the hottest expert's pairs over the mean's, mean over layers): the
    reference's routers over the prompts' prefill and each deployment's last load window."""
    def mean(xs: Sequence[float]) -> float:
        return sum(xs) / len(xs)

    parts = [f"Skew (hottest expert's pairs / mean, mean over layers): reference routers "
             f"{_fmt(mean(figures['reference_hot_over_mean']))}"]
    for size in eps:
        for mode in ("on", "off"):
            parts.append(f"EP {size} EPLB {mode} window {_fmt(mean(figures['skew'][size][mode]['after']['window']['hot_over_mean']))}")
    return "; ".join(parts) + (". Balancedness: mean over layers of mean/max pairs per rank; window: the EPLB's "
                               "load window (GET /placement) under the placement, an expert's pairs split evenly over its replicas "
                               "(the EPLB's model); per step: GET /state's, sampled (how many steps, "
                               "prefill steps among them); est.: a decode step of as many tokens as requests in "
                               "flight, its pairs drawn from that window's load, split over the placement's replicas "
                               "as the dispatch does (what sampling alone leaves). tokens/s: the phase's total, and "
                               "the median of its rounds (other jobs share the cores).")


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    os.environ["HF_HUB_OFFLINE"] = "1"
    load_before = os.getloadavg()
    with tempfile.TemporaryDirectory(prefix="bench-capacity-") as tmp:
        workdir = args.keep or Path(tmp)
        workdir.mkdir(parents=True, exist_ok=True)
        figures = run(args, workdir)
    checks = skew_targets(figures, args.ep) if args.skew else targets(figures, args.ep, args.concurrency)
    caption = (f"CPU: every process of the deployment (server, coordinator, ranks). Reference: "
               f"{100 * figures['reference_matmul_share']:.0f}% of its operator time in matrix multiplications; "
               f"batch {args.ref_batch} and 1 differ on {len(figures['reference_batched_unlike_single'])} requests. "
               + (f"Batch {args.ref_batch}: the mean of {len(figures['reference']['batched_runs'])} runs, before the "
                  f"served runs and after each round of them "
                  f"({', '.join(_fmt(x) for x in figures['reference']['batched_runs'])} ms CPU/token). "
                  if "batched_runs" in figures["reference"] else "") +
               f"Load average {load_before[0]:.1f} before, {os.getloadavg()[0]:.1f} after.")
    if not args.skew and 16 in args.concurrency and {2, 4} <= set(args.ep):
        caption += (" EP 4 / EP 2 CPU/token by round: "
                    + ", ".join(_fmt(r) for r in paired_ratios(figures, 4, 2, 16)) + ".")
    if args.skew:
        caption += " " + skew_caption(figures, args.ep)
    print_table(figures, checks, args.ep, args.concurrency, caption)
    write_json(args.json, {"args": {k: v for k, v in vars(args).items() if k != "prompts_all"} | {"keep": str(args.keep)},
                           "figures": json.loads(json.dumps(figures, default=str)),
                           "targets": [asdict(t) | {"ok": t.ok} for t in checks], "load_average": load_before})
    return 0 if all(t.ok for t in checks) else 1


if __name__ == "__main__":
    sys.exit(main())
