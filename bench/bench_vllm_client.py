"""``vllm bench serve`` (vLLM's own serving benchmark) against ``elastic-ep serve``, beside ``elastic-ep loadgen``.

    python -m bench.bench_vllm_client [--vllm 0.33.0] [--requests 48] [--concurrency 4]

1. Fetches vLLM's **source distribution** at run time (nothing of it is vendored or committed):
   its URL and sha256 from PyPI's JSON API (``/pypi/vllm/VERSION/json``, the ``sdist`` entry),
   downloaded with urllib, checked against that sha256, cached under ``--cache-dir``; then
   unpacks its ``vllm/`` Python package (no build: nothing of vLLM is compiled, and its compiled
   extensions, ``vllm._C`` and the like, are never imported; the script checks). ``--sdist FILE``
   takes an archive you downloaded instead.
2. Installs, with ``pip install --no-deps --target`` into the cache, the third-party packages that
   importing ``vllm.benchmarks.serve`` needs beyond this project's environment (which gives it
   torch, transformers, numpy, pillow, pyyaml, regex, tqdm, pydantic): :data:`VLLM_DEPS`,
   pinned. They are wheels from PyPI (aiohttp, pyzmq, msgspec, xgrammar, ... some of them
   compiled); vLLM's import chain reaches them through its datasets module.
3. Writes a ``save_pretrained`` checkpoint (``examples/hf.yaml``'s model: tiny random qwen3_moe,
   seed 0) with a word-level tokenizer over its whole vocabulary, and starts ``elastic-ep serve``
   on it (``examples/hf.yaml``'s deployment, the checkpoint as its model).
4. Runs vLLM's serve benchmark unchanged, the way ``vllm bench serve`` does: its
   ``add_cli_args`` on vLLM's ``FlexibleArgumentParser``, then its ``main``, with
   ``--backend openai --dataset-name random --ignore-eos --temperature 0`` and the checkpoint as
   ``--tokenizer`` (the ``vllm`` CLI's top level is not used: it imports vLLM's whole server).
   It reports vLLM's own figures (from its ``--save-result`` file).
5. Runs ``elastic-ep loadgen`` closed-loop with the same concurrency, prompt and output lengths,
   and prints both output throughputs and their ratio.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import socket
import statistics
import subprocess
import sys
import tarfile
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any
from urllib.parse import urljoin

import httpx

PYPI_JSON = "https://pypi.org/pypi/vllm/{version}/json"
PYPI_PROJECT_JSON = "https://pypi.org/pypi/vllm/json"
#: what ``import vllm.benchmarks.serve`` (vLLM 0.33.0's sdist) needs beyond the project's venv
VLLM_DEPS = (
    "aiohappyeyeballs==2.7.1", "aiohttp==3.14.5", "aiosignal==1.4.0", "apache-tvm-ffi==0.1.15.post2",
    "cachetools==8.0.2", "cbor2==6.3.0", "cloudpickle==3.1.3", "einops==0.8.2", "frozenlist==1.8.0",
    "llguidance==1.9.1", "msgspec==0.23.0", "multidict==7.2.1", "openai-harmony==0.0.8",
    "partial-json-parser==0.2.1.1.post7", "propcache==0.5.4", "psutil==7.2.2", "py-cpuinfo==9.0.0",
    "pybase64==1.5.1", "pyzmq==27.3.0", "uvloop==0.23.0", "xgrammar==0.2.9", "yarl==1.25.1",
)

# exactly what vLLM's ``vllm bench serve`` subcommand runs (BenchmarkServingSubcommand): add_cli_args, then main
DRIVER = r'''
import sys
from vllm.utils.argparse_utils import FlexibleArgumentParser
from vllm.benchmarks.serve import add_cli_args, main
compiled = sorted(n for n, m in list(sys.modules.items())
                  if n.split(".")[0] == "vllm" and not str(getattr(m, "__file__", None) or ".py").endswith(".py"))
assert not compiled, f"a compiled part of vLLM was imported: {compiled}"
parser = FlexibleArgumentParser(description="vllm bench serve")
add_cli_args(parser)
main(parser.parse_args(sys.argv[1:]))
'''


def fetch_sdist(version: str, cache: Path) -> tuple[Path, dict[str, Any]]:
    """vLLM's source archive of ``version``, downloaded once into ``cache`` and checked against PyPI's sha256."""
    meta_url, files = release_files(version)
    sdists = [u for u in files if u["packagetype"] == "sdist"]
    if not sdists:
        raise SystemExit(f"vLLM {version} has no source distribution on PyPI")
    entry = sdists[0]
    url, sha256 = urljoin(meta_url, entry["url"]), entry["digests"]["sha256"]
    target = cache / entry["filename"]
    if not (target.exists() and _sha256(target) == sha256):
        part = target.with_suffix(".part")
        print(f"downloading {url} ({entry['size'] / 2**20:.0f} MiB)", flush=True)
        with urllib.request.urlopen(url, timeout=600) as r, open(part, "wb") as f:
            while chunk := r.read(1 << 20):
                f.write(chunk)
        if _sha256(part) != sha256:
            part.unlink()
            raise SystemExit(f"{url}: sha256 differs from PyPI's {sha256}")
        part.rename(target)
    return target, {"url": url, "sha256": sha256, "filename": entry["filename"], "size": entry["size"]}


def release_files(version: str) -> tuple[str, list[dict[str, Any]]]:
    """PyPI's file entries of vLLM ``version``: its release's JSON, else the project's ``releases`` (some mirrors
    serve only the project's)."""
    for meta_url in (PYPI_JSON.format(version=version), PYPI_PROJECT_JSON):
        try:
            with urllib.request.urlopen(meta_url, timeout=120) as r:
                meta = json.load(r)
        except urllib.error.HTTPError as e:
            if e.code == 404:
                continue
            raise
        files = meta["urls"] if meta_url != PYPI_PROJECT_JSON else meta.get("releases", {}).get(version)
        if files:
            return meta_url, list(files)
    raise SystemExit(f"vLLM {version} is not on PyPI ({PYPI_JSON.format(version=version)})")


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 20):
            h.update(chunk)
    return h.hexdigest()


def unpack_package(sdist: Path, cache: Path) -> Path:
    """The sdist's ``vllm/`` package, unpacked (once) under ``cache``: the directory to put on ``sys.path``."""
    root = cache / (sdist.name.removesuffix(".tar.gz") + "-src")
    done = root / ".complete"
    if not done.exists():
        with tarfile.open(sdist) as tar:
            members = [m for m in tar.getmembers() if m.name.split("/")[1:2] == ["vllm"]]
            if not members:
                raise SystemExit(f"{sdist}: no vllm/ package in it")
            tar.extractall(root, members=members, filter="data")
        done.touch()
    (top,) = {m.split("/")[0] for m in os.listdir(root) if not m.startswith(".")}
    return root / top


def install_deps(cache: Path) -> Path:
    deps = cache / "deps"
    done = deps / (hashlib.sha256(" ".join(VLLM_DEPS).encode()).hexdigest()[:16] + ".complete")
    if not done.exists():
        subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--upgrade", "--target", str(deps),
                        *VLLM_DEPS], check=True, timeout=1800)
        done.touch()
    return deps


def write_checkpoint(path: Path) -> None:
    """``examples/hf.yaml``'s model saved with ``save_pretrained``, and a word-level tokenizer over its vocabulary."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    from eplb.models.config import HFModelConfig
    from eplb.models.hf import RandomSource

    source = RandomSource(HFModelConfig(architecture="qwen3_moe", seed=0))
    source.build().save_pretrained(path)
    vocab = {"[UNK]": 0, "[PAD]": 1, **{f"w{i}": i for i in range(2, source.config.vocab_size)}}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.decoder = decoders.WordPiece(prefix="##", cleanup=False)  # joins the words with spaces
    PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="[UNK]", pad_token="[PAD]").save_pretrained(path)


def write_deployment(path: Path, checkpoint: Path) -> None:
    import yaml

    spec = yaml.safe_load(Path("examples/hf.yaml").read_text())
    spec["model"] = {"kind": "hf", "path": str(checkpoint)}
    path.write_text(yaml.safe_dump(spec))


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def wait_ready(url: str, server: subprocess.Popen, timeout: float = 300) -> str:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if server.poll() is not None:
            raise SystemExit(f"elastic-ep serve exited with {server.returncode}")
        try:
            if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                return str(httpx.get(f"{url}/v1/models", timeout=5).json()["data"][0]["id"])
        except httpx.HTTPError:
            pass
        time.sleep(1)
    raise TimeoutError(f"{url} not ready within {timeout}s")


def run_vllm(args: argparse.Namespace, src: Path, deps: Path, url: str, model: str, checkpoint: Path,
             out: Path, filename: str) -> dict[str, Any]:
    """vLLM's serve benchmark against ``url``; its own result file's figures."""
    cli = ["--backend", "openai", "--base-url", url, "--model", model, "--tokenizer", str(checkpoint),
           "--dataset-name", "random", "--random-input-len", str(args.prompt_len),
           "--random-output-len", str(args.max_tokens), "--random-range-ratio", "0",
           "--num-prompts", str(args.requests), "--max-concurrency", str(args.concurrency),
           "--request-rate", "inf", "--ignore-eos", "--temperature", "0", "--seed", "0",
           "--disable-tqdm", "--save-result", "--result-dir", str(out), "--result-filename", filename]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(src), str(deps)])}
    env.pop("OPENAI_API_KEY", None)  # no Authorization header: serve runs without --api-key
    print("vllm bench serve " + " ".join(cli), flush=True)
    run = subprocess.run([sys.executable, "-c", DRIVER, *cli], env=env, text=True, timeout=3600)
    if run.returncode != 0:
        raise SystemExit(f"vLLM's serve benchmark exited with {run.returncode}")
    return dict(json.loads((out / filename).read_text()))


def run_loadgen(args: argparse.Namespace, url: str, out: Path) -> dict[str, Any]:
    lg = subprocess.run([sys.executable, "-m", "elastic.cli", "loadgen", url, "--rate", "0",
                         "--concurrency", str(args.concurrency), "--duration", str(args.loadgen_duration),
                         "--prompt-len", str(args.prompt_len), "--max-tokens", str(args.max_tokens),
                         "--out", str(out), "--json"], capture_output=True, text=True, timeout=3600)
    if lg.returncode != 0:
        raise SystemExit(f"elastic-ep loadgen exited with {lg.returncode}: {lg.stderr[-2000:]}")
    return dict(json.loads(lg.stdout[: lg.stdout.rindex("}") + 1]))


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    parser.add_argument("--vllm", default="0.33.0", help="the vLLM version whose benchmark runs")
    parser.add_argument("--sdist", type=Path, help="a vLLM source archive you downloaded, instead of PyPI's")
    parser.add_argument("--cache-dir", type=Path, default=Path.home() / ".cache" / "elastic-ep" / "vllm-bench")
    parser.add_argument("--requests", type=int, default=48)
    parser.add_argument("--concurrency", type=int, default=4)
    parser.add_argument("--prompt-len", type=int, default=8)
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--loadgen-duration", type=float, default=30.0)
    parser.add_argument("--rounds", type=int, default=2, help="vLLM's benchmark and loadgen, alternated")
    parser.add_argument("--out", type=Path, help="keep vLLM's result file and loadgen's report here")
    return parser.parse_args()


def main() -> None:
    args = parse_args()
    cache = args.cache_dir / args.vllm
    cache.mkdir(parents=True, exist_ok=True)
    if args.sdist is not None:
        sdist, fetched = args.sdist, {"filename": str(args.sdist), "sha256": _sha256(args.sdist)}
    else:
        sdist, fetched = fetch_sdist(args.vllm, cache)
    src, deps = unpack_package(sdist, cache), install_deps(cache)
    with tempfile.TemporaryDirectory(prefix="vllm-bench-") as tmp_name:
        tmp = Path(tmp_name)
        out = args.out or tmp
        out.mkdir(parents=True, exist_ok=True)
        write_checkpoint(tmp / "ckpt")
        write_deployment(tmp / "deployment.yaml", tmp / "ckpt")
        url = f"http://127.0.0.1:{free_port()}"
        server = subprocess.Popen([sys.executable, "-m", "elastic.cli", "serve", str(tmp / "deployment.yaml"),
                                   "--port", url.rsplit(":", 1)[1], "--log-level", "warning"],
                                  stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        try:
            model = wait_ready(url, server)
            rounds = []
            for i in range(args.rounds):  # alternated, so a change in the machine's load shows as a spread
                rounds.append((run_vllm(args, src, deps, url, model, tmp / "ckpt", out, f"vllm-{i}.json"),
                               run_loadgen(args, url, out / f"loadgen-{i}")))
        finally:
            server.terminate()
            server.wait(60)
    report(fetched, rounds)


def report(fetched: dict[str, Any], rounds: list[tuple[dict[str, Any], dict[str, Any]]]) -> None:
    keys = ("completed", "failed", "duration", "total_output_tokens", "output_throughput", "request_throughput",
            "mean_ttft_ms", "mean_itl_ms")
    print(json.dumps({"fetched": fetched, "rounds": [
        {"vllm_bench_serve": {k: v.get(k) for k in keys},
         "loadgen": {k: lg[k] for k in ("ok", "failed", "tokens", "seconds", "tokens_per_s") if k in lg}}
        for v, lg in rounds]}, indent=1))
    v = [r[0]["output_throughput"] for r in rounds]
    lg = [r[1]["tokens_per_s"] for r in rounds]
    for name, xs in (("vllm bench serve", v), ("elastic-ep loadgen", lg)):
        spread = (max(xs) - min(xs)) / (sum(xs) / len(xs))
        print(f"{name}: {', '.join(f'{x:.1f}' for x in xs)} output tok/s (mean {sum(xs) / len(xs):.1f}, "
              f"spread {100 * spread:.0f}%)")
    ratios = sorted(a / b for a, b in zip(v, lg))  # each round's pair ran back to back: the drift of the load cancels
    print(f"vLLM's / loadgen's: per round {', '.join(f'{r:.2f}' for r in ratios)} (sorted), median "
          f"{statistics.median(ratios):.3f}; "
          f"ratio of the means {sum(v) / sum(lg):.3f}")


if __name__ == "__main__":
    main()
