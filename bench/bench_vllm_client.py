"""vLLM's own benchmark client against ``elastic-ep serve``, beside ``elastic-ep loadgen``.

    python -m bench.bench_vllm_client [--deployment examples/hf.yaml] [--vllm 0.33.0]

1. Takes vLLM's benchmark request code from its published distribution at run time, into a
   temporary directory (nothing of it is vendored or committed): ``pip download`` of vLLM, then
   ``vllm/benchmarks/lib/endpoint_request_func.py`` (``vllm bench serve``'s client: the
   ``openai`` backend's ``async_request_openai_completions``) and its three dependencies
   (``aiohttp``, ``regex``, ``tqdm``, ``pip install --target``). vLLM's source distribution
   cannot be fetched with ``pip download`` without building its metadata (which needs its build
   toolchain), so the script unpacks the same module from the wheel; ``--sdist FILE`` uses a
   source archive you downloaded instead.
2. Starts ``elastic-ep serve DEPLOYMENT`` on a free port.
3. Runs vLLM's client the way ``vllm bench serve --backend openai --ignore-eos`` does (streaming,
   ``stream_options.include_usage``, ``repetition_penalty``, ``ignore_eos``; greedy through
   ``extra_body``): ``--requests`` seeded token-id prompts, at most ``--concurrency`` in flight,
   and reports vLLM's output throughput (the usage's ``completion_tokens`` summed, over the
   benchmark's duration), mean TTFT and ITL.
4. Runs ``elastic-ep loadgen`` closed-loop with the same concurrency, prompt and output lengths,
   and prints both throughputs and their ratio.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import tempfile
import time
import zipfile
from pathlib import Path

import httpx

MODULE = "vllm/benchmarks/lib/endpoint_request_func.py"

DRIVER = r'''
import asyncio, importlib.util, json, random, sys, time
import aiohttp
spec = importlib.util.spec_from_file_location("endpoint_request_func", sys.argv[1])
erf = importlib.util.module_from_spec(spec); spec.loader.exec_module(erf)
url, model, n, conc, plen, olen, vocab, seed = sys.argv[2], sys.argv[3], *map(int, sys.argv[4:10])
rng = random.Random(seed)
inputs = [erf.RequestFuncInput(prompt=[rng.randrange(vocab) for _ in range(plen)], api_url=url + "/v1/completions",
                               prompt_len=plen, output_len=olen, model=model, ignore_eos=True,
                               extra_body={"temperature": 0.0}) for _ in range(n)]
async def main():
    sem = asyncio.Semaphore(conc)
    async with aiohttp.ClientSession(timeout=erf.AIOHTTP_TIMEOUT) as session:
        async def one(i):
            async with sem:
                return await erf.async_request_openai_completions(i, session)
        start = time.perf_counter()
        outs = await asyncio.gather(*(one(i) for i in inputs))
        return outs, time.perf_counter() - start
outs, duration = asyncio.run(main())
ok = [o for o in outs if o.success]
itl = [x for o in ok for x in o.itl]
print(json.dumps({"completed": len(ok), "failed": len(outs) - len(ok), "errors": sorted({o.error[:200] for o in outs if not o.success})[:3],
                  "duration_s": duration, "output_tokens": sum(o.output_tokens for o in ok),
                  "output_throughput": sum(o.output_tokens for o in ok) / duration,
                  "mean_ttft_ms": 1000 * sum(o.ttft for o in ok) / max(1, len(ok)),
                  "mean_itl_ms": 1000 * sum(itl) / max(1, len(itl))}))
'''


def fetch_client(version: str, tmp: Path, sdist: Path | None) -> Path:
    """vLLM's benchmark request module, unpacked into ``tmp``, with its dependencies in ``tmp/deps``."""
    target = tmp / "endpoint_request_func.py"
    if sdist is not None:
        import tarfile

        with tarfile.open(sdist) as tar:
            member = next(m for m in tar.getmembers() if m.name.endswith(MODULE))
            target.write_bytes(tar.extractfile(member).read())  # type: ignore[union-attr]
    else:
        subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary", ":all:",
                        f"vllm=={version}", "-d", str(tmp / "dist"), "-q"], check=True, timeout=900)
        wheel = next((tmp / "dist").glob("vllm-*.whl"))
        with zipfile.ZipFile(wheel) as z:
            target.write_bytes(z.read(MODULE))
    subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--target", str(tmp / "deps"),
                    "aiohttp", "regex", "tqdm"], check=True, timeout=900)
    return target


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def wait_ready(url: str, timeout: float = 300) -> str:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                return str(httpx.get(f"{url}/v1/models", timeout=5).json()["data"][0]["id"])
        except httpx.HTTPError:
            pass
        time.sleep(1)
    raise TimeoutError(f"{url} not ready within {timeout}s")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--deployment", default="examples/hf.yaml")
    parser.add_argument("--vllm", default="0.33.0", help="the vLLM version whose client runs")
    parser.add_argument("--sdist", type=Path, help="a vLLM source archive to take the client from instead")
    parser.add_argument("--requests", type=int, default=64)
    parser.add_argument("--concurrency", type=int, default=4)
    parser.add_argument("--prompt-len", type=int, default=8)
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--loadgen-duration", type=float, default=30.0)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="vllm-bench-") as tmp_name:
        tmp = Path(tmp_name)
        module = fetch_client(args.vllm, tmp, args.sdist)
        url = f"http://127.0.0.1:{free_port()}"
        server = subprocess.Popen([sys.executable, "-m", "elastic.cli", "serve", args.deployment, "--port", url.rsplit(":", 1)[1],
                                   "--log-level", "warning"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        try:
            model = wait_ready(url)
            vocab = int(httpx.get(f"{url}/v1/models").json()["data"][0].get("vocab_size", 128))
            env = {**os.environ, "PYTHONPATH": str(tmp / "deps")}
            run = subprocess.run([sys.executable, "-c", DRIVER, str(module), url, model, str(args.requests),
                                  str(args.concurrency), str(args.prompt_len), str(args.max_tokens), str(vocab), "0"],
                                 env=env, capture_output=True, text=True, timeout=1800)
            if run.returncode != 0:
                raise SystemExit(f"vLLM's client failed: {run.stderr[-2000:]}")
            vllm = json.loads(run.stdout.strip().splitlines()[-1])
            lg = subprocess.run([sys.executable, "-m", "elastic.cli", "loadgen", url, "--rate", "0",
                                 "--concurrency", str(args.concurrency), "--duration", str(args.loadgen_duration),
                                 "--prompt-len", str(args.prompt_len), "--max-tokens", str(args.max_tokens),
                                 "--out", str(tmp / "loadgen"), "--json"], capture_output=True, text=True, timeout=1800)
            summary = json.loads(lg.stdout[: lg.stdout.rindex("}") + 1])
        finally:
            server.terminate()
            server.wait(30)
    print(json.dumps({"vllm_client": vllm, "loadgen": {k: summary[k] for k in ("ok", "failed", "tokens", "seconds",
                                                                               "tokens_per_s") if k in summary}},
                     indent=1))
    print(f"output throughput: vLLM's client {vllm['output_throughput']:.1f} tok/s, elastic-ep loadgen "
          f"{summary['tokens_per_s']:.1f} tok/s (ratio {vllm['output_throughput'] / summary['tokens_per_s']:.3f})")


if __name__ == "__main__":
    main()
