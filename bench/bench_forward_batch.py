"""The data plane alone: CPU per generated token of ``HFMoE.forward_batch`` against transformers.

    python -m bench.bench_forward_batch [--requests 16 --prompt-len 32 --new-tokens 32]
                                        [--hidden 512 --layers 4 --experts 32 --top-k 2 --moe-intermediate 512]
                                        [--ep 2] [--profile] [--json FILE]

One thread per process (``torch.set_num_threads(1)``), a random qwen3_moe model (seeded), greedy:

- ``transformers``: the same model's own batched ``generate`` of every request at once (its own
  experts implementation), in this process;
- ``forward_batch EP 1``: one :meth:`~eplb.models.hf.HFMoE.forward_batch` per step over all the
  requests (the prompts packed in the first step), in this process;
- ``per-request loop EP 1``: one ``forward_batch`` per request per step (what serving did before);
- ``forward_batch EP N``: N gloo processes, each owning ``requests / N`` of the requests, the
  experts exchanged by all_to_all; CPU summed over the processes.

Every run's tokens are checked against ``forward_batch EP 1``'s (bitwise: the data plane's
promise). ``--profile`` adds torch.profiler's split of the EP 1 batched run: matrix
multiplications, other ops, and what is left (Python and dispatch).
"""

from __future__ import annotations

import argparse
import os
import tempfile
import time
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from bench.common import write_json

MATMUL_OPS = frozenset({"aten::mm", "aten::addmm", "aten::bmm", "aten::baddbmm", "aten::_grouped_mm",
                        "aten::_scaled_dot_product_flash_attention_for_cpu", "aten::linear", "aten::matmul"})


def spec_of(args: argparse.Namespace) -> dict[str, Any]:
    heads = 8
    return {"architecture": "qwen3_moe", "seed": 0, "config": {
        "vocab_size": args.vocab, "hidden_size": args.hidden, "num_hidden_layers": args.layers,
        "num_attention_heads": heads, "num_key_value_heads": heads // 2, "head_dim": args.hidden // heads,
        "intermediate_size": 4 * args.moe_intermediate, "moe_intermediate_size": args.moe_intermediate,
        "num_experts": args.experts, "num_experts_per_tok": args.top_k, "max_position_embeddings": 256}}


def prompts_of(args: argparse.Namespace) -> torch.Tensor:
    g = torch.Generator().manual_seed(1)
    return torch.randint(0, args.vocab, (args.requests, args.prompt_len), generator=g)


def decode(model: Any, prompts: torch.Tensor, new_tokens: int, per_request: bool = False) -> torch.Tensor:
    """Greedy tokens ``[B, new_tokens]`` with one forward_batch per step (or per request per step)."""
    inputs: list[tuple[torch.Tensor, Any]] = [(p, None) for p in prompts]
    out = []
    for _ in range(new_tokens):
        if per_request:
            results = [model.forward_batch([one]) for one in inputs]
            logits = torch.cat([r[0] for r in results])
            states = [r[1][0] for r in results]
        else:
            logits, states = model.forward_batch(inputs)
        tokens = logits.argmax(-1)
        out.append(tokens)
        inputs = [(t[None], s) for t, s in zip(tokens, states)]
    return torch.stack(out, 1) if out else torch.empty(prompts.shape[0], 0, dtype=torch.long)


def timed(fn) -> tuple[Any, float, float]:
    cpu, wall = time.process_time(), time.perf_counter()
    result = fn()
    return result, time.process_time() - cpu, time.perf_counter() - wall


def _rank(rank: int, world: int, args: argparse.Namespace, store: str, queue: Any) -> None:
    try:
        _run_rank(rank, world, args, store, queue)
    except BaseException as exc:  # the parent waits on the queue: tell it, or it waits for nothing
        queue.put((rank, f"rank {rank} failed: {type(exc).__name__}: {exc}"))
        raise


def _run_rank(rank: int, world: int, args: argparse.Namespace, store: str, queue: Any) -> None:
    from eplb.models.hf import HFMoE, describe
    from eplb.placement import Placement

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world)
    spec = spec_of(args)
    layers = describe(spec).num_moe_layers
    model = HFMoE(spec, Placement.static(layers, args.experts, args.experts), rank, world, timeout=120)
    mine = prompts_of(args)[rank::world]
    decode(model, mine[:1], 2)  # warm-up
    model.time_cpu()
    model.take_cpu_split()
    dist.barrier()
    tokens, cpu, wall = timed(lambda: decode(model, mine, args.new_tokens))
    queue.put((rank, tokens, cpu, wall, model.take_dispatch_balance(), model.take_cpu_split()))
    dist.barrier()
    dist.destroy_process_group()


def run_ep(args: argparse.Namespace, world: int) -> dict[str, Any]:
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    with tempfile.TemporaryDirectory() as tmp:
        store = os.path.join(tmp, "store")
        procs = [ctx.Process(target=_rank, args=(r, world, args, store, queue)) for r in range(world)]
        for p in procs:
            p.start()
        results = sorted(queue.get(timeout=1800) for _ in range(world))
        failed = [r[1] for r in results if isinstance(r[1], str)]
        if failed:
            for p in procs:
                p.kill()
            raise RuntimeError("; ".join(failed))
        for p in procs:
            p.join(60)
    tokens = torch.empty(args.requests, args.new_tokens, dtype=torch.long)
    for rank, t, *_ in results:
        tokens[rank::world] = t
    return {"tokens": tokens, "cpu": sum(r[2] for r in results), "wall": max(r[3] for r in results),
            "balance": results[0][4], "per_rank": [{"cpu_s": r[2], **r[5]} for r in results]}


def profile_split(model: Any, prompts: torch.Tensor, new_tokens: int) -> dict[str, float]:
    """CPU seconds of one batched run, split by torch.profiler's shares of the profiled wall time
    (matrix multiplications, other aten ops, the rest: Python, transformers and dispatch)."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU]) as prof:
        cpu, wall = time.process_time(), time.perf_counter()
        decode(model, prompts, new_tokens)
        cpu, wall = time.process_time() - cpu, time.perf_counter() - wall
    events = prof.key_averages()
    matmul = sum(e.self_cpu_time_total for e in events if e.key in MATMUL_OPS) / 1e6
    ops = sum(e.self_cpu_time_total for e in events if e.key.startswith("aten::")) / 1e6
    return {"cpu_s": cpu, "matmul_s": cpu * matmul / wall, "other_ops_s": cpu * (ops - matmul) / wall,
            "python_and_dispatch_s": cpu * max(0.0, 1 - ops / wall)}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    for flag, default in (("--requests", 16), ("--prompt-len", 32), ("--new-tokens", 32), ("--hidden", 512),
                          ("--layers", 4), ("--experts", 32), ("--top-k", 2), ("--moe-intermediate", 512),
                          ("--vocab", 4096), ("--ep", 2)):
        ap.add_argument(flag, type=int, default=default)
    ap.add_argument("--profile", action="store_true")
    ap.add_argument("--no-loop", action="store_true", help="skip the per-request loop (the slowest run)")
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    from eplb.models.hf import unsharded

    model = unsharded(spec_of(args))
    prompts = prompts_of(args)
    tokens_out = args.requests * args.new_tokens
    rows: dict[str, dict[str, Any]] = {}
    decode(model, prompts[:2], 2)  # warm-up
    model.time_cpu()
    model.take_cpu_split()
    ours, cpu, wall = timed(lambda: decode(model, prompts, args.new_tokens))
    rows["forward_batch EP 1"] = {"cpu": cpu, "wall": wall, "same": True, "per_rank": [{"cpu_s": cpu, **model.take_cpu_split()}]}
    if not args.no_loop:
        loop, cpu, wall = timed(lambda: decode(model, prompts, args.new_tokens, per_request=True))
        rows["per-request loop EP 1"] = {"cpu": cpu, "wall": wall, "same": torch.equal(loop, ours)}
    rows["transformers generate"] = _transformers(model, prompts, args)
    ep = run_ep(args, args.ep)
    rows[f"forward_batch EP {args.ep}"] = {"cpu": ep["cpu"], "wall": ep["wall"], "same": torch.equal(ep["tokens"], ours),
                                          "dispatch_balance": ep["balance"], "per_rank": ep["per_rank"]}
    ref = rows["transformers generate"]["cpu"] / tokens_out
    print(f"qwen3_moe hidden {args.hidden}, {args.layers} layers, {args.experts} experts top-{args.top_k}, "
          f"moe_intermediate {args.moe_intermediate}; {args.requests} requests x ({args.prompt_len} prompt + "
          f"{args.new_tokens} new); 1 thread per process")
    print(f"{'run':28} {'CPU ms/token':>13} {'x transformers':>15} {'wall s':>8}  tokens")
    for name, r in rows.items():
        r["cpu_ms_per_token"] = 1e3 * r["cpu"] / tokens_out
        print(f"{name:28} {r['cpu_ms_per_token']:13.3f} {r['cpu'] / tokens_out / ref:15.2f} {r['wall']:8.2f}  "
              f"{'identical' if r['same'] else 'DIFFERENT'}")
    for name, r in rows.items():
        for rank, split in enumerate(r.get("per_rank", [])):
            print(f"  {name} rank {rank}: CPU s " + ", ".join(f"{k} {v:.3f}" for k, v in split.items()))
    if args.profile:
        rows["profile forward_batch EP 1"] = split = profile_split(model, prompts, args.new_tokens)
        print("profile of forward_batch EP 1 (s): " + ", ".join(f"{k} {v:.3f}" for k, v in split.items()))
    if args.json:
        write_json(args.json, {"args": vars(args), "runs": rows})
    return 0 if all(r.get("same", True) for r in rows.values()) else 1


def _transformers(model: Any, prompts: torch.Tensor, args: argparse.Namespace) -> dict[str, Any]:
    """transformers' own batched greedy generate of the same model (its own experts implementation)."""
    from transformers import AutoModelForCausalLM

    theirs = AutoModelForCausalLM.from_config(model.model.config).eval()
    theirs.load_state_dict(model.model.state_dict())
    theirs.set_experts_implementation(None) if hasattr(theirs, "set_experts_implementation") else None
    theirs.generation_config.eos_token_id = None
    ones = torch.ones_like(prompts)

    def run() -> torch.Tensor:
        with torch.no_grad():
            return theirs.generate(prompts, attention_mask=ones, max_new_tokens=args.new_tokens, do_sample=False,
                                   min_new_tokens=args.new_tokens)

    theirs.generate(prompts[:2], attention_mask=ones[:2], max_new_tokens=2, do_sample=False)  # warm-up
    _, cpu, wall = timed(run)
    return {"cpu": cpu, "wall": wall, "same": True}


if __name__ == "__main__":
    raise SystemExit(main())
