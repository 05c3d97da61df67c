"""The server as OpenAI's and vLLM's clients see it: the official ``openai`` package, vLLM's
benchmark request bodies, EOS, ``n``, lists of prompts, chat templates, the probe routes.

Real workers, real groups, real HTTP, on a ``save_pretrained`` checkpoint with an offline
word-level tokenizer that carries a chat template and a ``generation_config.json`` EOS.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import json
import os
import threading
import time

import httpx
import openai
import pytest
import torch

from elastic.coordinator import Coordinator
from elastic.deployment import DeploymentConfig
from elastic.service.api import create_app
from elastic.service.server import BackgroundServer
from eplb.models.hf import unsharded
from tests.test_completions_text import write_tokenizer
from tests.test_hf_models import write_checkpoint

TEMPLATE = "{% for m in messages %}{{ m['content'] }} {% endfor %}{% if add_generation_prompt %}w0{% endif %}"
EOS_PROMPT = "w9 w8 w7"  # its greedy output's 4th token is made the checkpoint's EOS


class Served:
    def __init__(self, url: str, model: str, reference, tokenizer, eos: int, coordinator: Coordinator):
        self.url, self.model, self.reference, self.tokenizer, self.eos = url, model, reference, tokenizer, eos
        self.coordinator = coordinator
        self.http = httpx.Client(base_url=url, timeout=120)
        self.client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=120)

    def greedy(self, ids: list[int], n: int, *, stop_at_eos: bool = True) -> list[int]:
        tokens = self.reference.generate(torch.tensor([ids]), n)[0][0].tolist()
        if stop_at_eos and self.eos in tokens:
            tokens = tokens[: tokens.index(self.eos) + 1]
        return tokens

    def text_after(self, prompt_ids: list[int], tokens: list[int]) -> str:
        """vLLM's text: the output detokenized with the prompt as context."""
        whole = self.tokenizer.decode(prompt_ids + tokens, skip_special_tokens=True)
        return whole[len(self.tokenizer.decode(prompt_ids, skip_special_tokens=True)):]


def write_chat_checkpoint(path: str) -> str:
    """A tiny qwen3_moe checkpoint at ``path`` with the word-level tokenizer and :data:`TEMPLATE` as its
    chat template; returns ``path``."""
    write_checkpoint("qwen3_moe", path)
    write_tokenizer(path)
    config_path = os.path.join(path, "tokenizer_config.json")
    with open(config_path) as f:
        tok_config = json.load(f)
    with open(config_path, "w") as f:
        json.dump({**tok_config, "chat_template": TEMPLATE}, f)
    return path


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    path = write_chat_checkpoint(str(tmp_path_factory.mktemp("ckpt")))
    torch.set_num_threads(1)
    spec = {"kind": "hf", "path": path}
    reference = unsharded(spec)
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(path)
    eos = reference.generate(torch.tensor([tokenizer.encode(EOS_PROMPT)]), 8)[0][0].tolist()[3]
    with open(os.path.join(path, "generation_config.json"), "w") as f:
        json.dump({"eos_token_id": [eos], "_from_model_config": False}, f)
    config = DeploymentConfig.model_validate({
        "model": spec, "ep_size": 2, "max_ep_size": 2, "heartbeat_s": 0.05,
        "eplb": {"num_redundant_experts": 4}, "timeouts": {"collective": 6, "heartbeat": 8, "worker_start": 120},
        "serving": {"background_load": False, "max_batch": 4, "max_queue": 8, "max_tokens_limit": 64}})
    with Coordinator(config) as c, BackgroundServer(create_app(c)) as server:
        c.wait_for_step(3, timeout=60)
        model = httpx.get(f"{server.url}/v1/models").json()["data"][0]["id"]
        s = Served(server.url, model, reference, tokenizer, eos, c)
        yield s
        s.http.close()


@pytest.mark.multiprocess
@pytest.mark.timeout(240)
def test_the_openai_client_gets_completions_streamed_or_not_with_text_in_context(served):
    prompt = "w5 w17 w3 w99"
    ids = served.tokenizer.encode(prompt)
    expected = served.greedy(ids, 8)
    answer = served.client.completions.create(model=served.model, prompt=prompt, max_tokens=8, temperature=0,
                                              logprobs=1)
    choice = answer.choices[0]
    assert choice.token_ids == expected and choice.text == served.text_after(ids, expected)  # type: ignore[attr-defined]
    assert served.tokenizer.decode(ids + expected) == prompt + choice.text  # the prompt and the text join
    assert choice.logprobs.text_offset == [sum(len(t) for t in choice.logprobs.tokens[:i]) for i in range(len(expected))]
    assert answer.usage.prompt_tokens == len(ids) and answer.usage.completion_tokens == len(expected)
    chunks = list(served.client.completions.create(model=served.model, prompt=prompt, max_tokens=8, temperature=0,
                                                   stream=True, stream_options={"include_usage": True}))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == choice.text
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == len(expected)
    echoed = served.client.completions.create(model=served.model, prompt=prompt, max_tokens=8, temperature=0, echo=True)
    assert echoed.choices[0].text == prompt + choice.text


@pytest.mark.multiprocess
@pytest.mark.timeout(240)
def test_the_openai_client_gets_chat_completions_from_the_chat_template_streamed_or_not(served):
    messages = [{"role": "user", "content": "w4 w5 w6"}]
    ids = served.tokenizer.encode(served.tokenizer.apply_chat_template(messages, tokenize=False,
                                                                       add_generation_prompt=True),
                                  add_special_tokens=False)
    expected = served.greedy(ids, 6)
    answer = served.client.chat.completions.create(model=served.model, messages=messages, max_tokens=6, temperature=0)
    assert answer.choices[0].message.role == "assistant"
    assert answer.choices[0].message.content == served.text_after(ids, expected)
    assert answer.usage.prompt_tokens == len(ids)
    chunks = list(served.client.chat.completions.create(model=served.model, messages=messages, max_tokens=6,
                                                        temperature=0, stream=True))
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == answer.choices[0].message.content
    assert chunks[-1].choices[0].finish_reason == answer.choices[0].finish_reason
    # without max_tokens a chat answer goes on to EOS or the context, as vLLM's (it was cut at 16 tokens)
    untold = served.http.post("/v1/chat/completions", json={"model": served.model, "messages": messages,
                                                             "temperature": 0, "ignore_eos": True}).json()
    assert untold["usage"]["completion_tokens"] == min(64, 128 - len(ids)), untold  # serving.max_tokens_limit 64
    assert untold["choices"][0]["finish_reason"] == "length"


@pytest.mark.multiprocess
@pytest.mark.timeout(120)
def test_an_error_reaches_the_openai_client_with_its_message_and_changes_nothing(served):
    before = served.coordinator.requests.stats()
    with pytest.raises(openai.BadRequestError) as bad:
        served.client.completions.create(model=served.model, prompt="w1", max_tokens=4, temperature=7)
    assert bad.value.status_code == 400 and "temperature" in str(bad.value) and bad.value.body["param"] == "temperature"
    with pytest.raises(openai.NotFoundError) as missing:
        served.client.completions.create(model="gpt-4", prompt="w1", max_tokens=4)
    assert "gpt-4" in str(missing.value) and served.model in str(missing.value)
    with pytest.raises(openai.BadRequestError) as unsupported:
        served.client.completions.create(model=served.model, prompt="w1", max_tokens=4, suffix="w2")
    assert "suffix" in str(unsupported.value)
    # an unknown field is ignored and named in a header, as vLLM ignores it
    r = served.http.post("/v1/completions", json={"model": served.model, "prompt": "w1", "max_tokens": 2,
                                                  "temperature": 0, "ignore_eos": True, "frobnicate": 1})
    assert r.status_code == 200 and r.headers["x-ignored-fields"] == "frobnicate"
    # named in printable ASCII, whatever the name (one in Cyrillic was a 500, one with CR LF or NUL no answer)
    r = served.http.post("/v1/completions", json={"model": served.model, "prompt": "w1", "max_tokens": 2,
                                                  "ключ": 1, "a\r\nSet-Cookie: x=1": 2, "b\x00": 3})
    assert r.status_code == 200, r.text
    assert r.headers["x-ignored-fields"] == "\\u043a\\u043b\\u044e\\u0447,a\\r\\nSet-Cookie: x=1,b\\x00"
    assert "set-cookie" not in r.headers
    after = served.coordinator.requests.stats()
    assert (after["running"], after["queued"]) == (before["running"], before["queued"])


@pytest.mark.multiprocess
@pytest.mark.timeout(120)
def test_a_body_that_is_not_a_request_gets_a_400_in_openais_shape_saying_what_is_wrong(served):
    """Bodies refused before their fields are read (not JSON, nested too deeply, not UTF-8, too large,
    not an object) are answered like every other bad body of these routes: 400 in OpenAI's shape,
    with a message that names the problem (they were "There was an error parsing the body", a
    character position as the param, or a 422 in the control plane's shape)."""
    before = served.coordinator.requests.stats()
    json_type = {"content-type": "application/json"}
    limit = (1 << 20) + 16 * 128 * 24  # the /v1 limit at max_model_len 128

    def chunks():
        for _ in range(12):
            yield b"x" * (limit // 10)

    cases = [
        ("/v1/completions", b'{"model": "m", "prompt": [1, 2,}', json_type, "body: not valid JSON at character 31 (Expecting value)"),
        ("/v1/completions", b'{"prompt": ' + b"[" * 5000 + b"]" * 5000 + b"}", json_type, "JSON nested too deeply"),
        ("/v1/chat/completions", b'{"model": "\xff\xfe"}', json_type,
         "not UTF-8"),
        ("/v1/completions", b'{"model": "m", "prompt": "' + b"w1 " * (limit // 3) + b'"}', json_type,
         "larger than the 1.0 MiB"),
        ("/v1/completions", chunks(), json_type, "larger than the 1.0 MiB"),
        ("/v1/completions", json.dumps({"model": served.model, "prompt": "w1"}).encode(), {"content-type": "text/plain"},
         "Content-Type: application/json"),
        ("/v1/completions", b"", json_type, "body: empty"),
        ("/tokenize", b'{"prompt": "' + b"w1 " * 30_000 + b'"}', json_type, None),  # a prompt /v1 takes (90 KB)
    ]
    for path, content, headers, message in cases:
        r = served.http.post(path, content=content, headers=headers)
        if message is None:
            assert r.status_code == 200 and r.json()["count"] == 30_000, r.text[:300]
            continue
        assert r.status_code == 400, (path, message, r.status_code, r.text[:300])
        error = r.json()["error"]
        assert message in error["message"] and error["type"] == "invalid_request_error", (message, error)
        assert error["param"] is None, error
    # fields vLLM refuses: min_tokens past max_tokens, an empty stop string; another model on /tokenize
    base = {"model": served.model, "prompt": "w1", "max_tokens": 2, "temperature": 0}
    r = served.http.post("/v1/completions", json={**base, "min_tokens": 5})
    assert r.status_code == 400 and r.json()["error"]["param"] == "min_tokens", r.text
    assert "at most max_tokens (2)" in r.json()["error"]["message"]
    r = served.http.post("/v1/completions", json={**base, "stop": ["w3", ""]})
    assert r.status_code == 400 and "a stop string is empty" in r.json()["error"]["message"], r.text
    # a chat template sent with the request is not run (it was: a Jinja template of the client's, in the server)
    chat = {"messages": [{"role": "user", "content": "w1"}], "chat_template_kwargs": {"chat_template": "w7 w7 w7"}}
    for path, body in (("/v1/chat/completions", {"model": served.model, "max_tokens": 2, **chat}), ("/tokenize", chat)):
        r = served.http.post(path, json=body)
        assert r.status_code == 400 and r.json()["error"]["param"] == "chat_template_kwargs", r.text
        assert "remove chat_template" in r.json()["error"]["message"]
    r = served.http.post("/tokenize", json={**chat, "chat_template_kwargs": {"tokenize": True, "enable_thinking": True}})
    assert r.status_code == 400 and "tokenize: not a template variable" in r.json()["error"]["message"], r.text
    r = served.http.post("/tokenize", json={**chat, "chat_template_kwargs": {"enable_thinking": True}})  # a variable
    assert r.status_code == 200 and r.json()["tokens"] == served.tokenizer.encode("w1 w0"), r.text
    r = served.http.post("/tokenize", json={"messages": 34})  # was a 500 (the chat body's validation error)
    assert r.status_code == 400 and r.json()["error"]["param"] == "messages", r.text
    assert "valid list" in r.json()["error"]["message"]
    for path, body in (("/tokenize", {"model": "gpt-4", "prompt": "w1"}), ("/detokenize", {"model": "gpt-4", "tokens": [3]})):
        r = served.http.post(path, json=body)
        assert r.status_code == 404 and "gpt-4" in r.json()["error"]["message"], r.text
    after = served.coordinator.requests.stats()
    assert (after["running"], after["queued"], after["ok"]) == (before["running"], before["queued"], before["ok"])


@pytest.mark.multiprocess
@pytest.mark.timeout(120)
def test_prompts_are_tokenized_off_the_event_loop(served, monkeypatch):
    """Tokenizing takes about 1 s for a prompt near the 1 MiB body limit: on the event loop, four
    clients posting such prompts held /healthz, /state and /scale for 5-6 s (measured, from 7 ms)."""
    from elastic.service.served_model import ServedModel

    on_the_loop: list[int] = []
    encode = ServedModel.encode
    at_once = [0, 0]  # now, most
    lock = threading.Lock()

    def watched(self, text, add_special_tokens=True):
        try:
            asyncio.get_running_loop()
            on_the_loop.append(len(text))
        except RuntimeError:  # no event loop in this thread: a worker thread
            pass
        with lock:
            at_once[0] += 1
            at_once[1] = max(at_once)
        try:
            if len(text) > 1000:
                time.sleep(0.3)  # a long prompt's tokenizing, long enough that the requests below overlap
            return encode(self, text, add_special_tokens)
        finally:
            with lock:
                at_once[0] -= 1

    monkeypatch.setattr(ServedModel, "encode", watched)
    big = "w1 " * 100_000
    r = served.http.post("/v1/completions", json={"model": served.model, "prompt": big, "max_tokens": 2})
    assert r.status_code == 400 and "100000 tokens leave no room" in r.json()["error"]["message"], r.text[:300]
    r = served.http.post("/v1/chat/completions", json={"model": served.model, "max_tokens": 2,
                                                       "messages": [{"role": "user", "content": big}]})
    assert r.status_code == 400 and "leave no room" in r.json()["error"]["message"], r.text[:300]
    for path, body in (("/v1/completions", {"prompt": ["w1 w2", "w3"]}),
                       ("/v1/chat/completions", {"messages": [{"role": "user", "content": "w4"}]})):
        r = served.http.post(path, json={"model": served.model, "max_tokens": 2, "temperature": 0, **body})
        assert r.status_code == 200, r.text
    assert on_the_loop == [], f"prompts of {on_the_loop} characters were tokenized on the event loop"
    # and at most two at once (each ~170 MB at its peak near the body limit): six clients, /tokenize too
    paths = ["/v1/completions", "/v1/chat/completions", "/tokenize"] * 2
    bodies = {"/v1/completions": {"model": served.model, "prompt": big, "max_tokens": 2},
              "/v1/chat/completions": {"model": served.model, "max_tokens": 2,
                                       "messages": [{"role": "user", "content": big}]},
              "/tokenize": {"prompt": big}}
    at_once[1] = 0
    with concurrent.futures.ThreadPoolExecutor(len(paths)) as pool:
        answers = list(pool.map(lambda path: httpx.post(served.url + path, json=bodies[path], timeout=60), paths))
    assert sorted(r.status_code for r in answers) == [200, 200, 400, 400, 400, 400], [r.text[:200] for r in answers]
    assert at_once[1] == 2, f"{at_once[1]} prompts tokenized at once"


@pytest.mark.multiprocess
@pytest.mark.timeout(180)
def test_a_request_stops_at_the_checkpoints_eos_unless_it_ignores_it(served):
    ids = served.tokenizer.encode(EOS_PROMPT)
    full = served.greedy(ids, 8, stop_at_eos=False)
    assert full[3] == served.eos
    body = {"model": served.model, "prompt": EOS_PROMPT, "max_tokens": 8, "temperature": 0}
    stopped = served.http.post("/v1/completions", json=body).json()["choices"][0]
    assert stopped["token_ids"] == full[:4] and stopped["finish_reason"] == "stop"
    ignored = served.http.post("/v1/completions", json={**body, "ignore_eos": True}).json()["choices"][0]
    assert ignored["token_ids"] == full and ignored["finish_reason"] == "length"
    at_least = served.http.post("/v1/completions", json={**body, "min_tokens": 6}).json()["choices"][0]
    assert len(at_least["token_ids"]) >= 6 and served.eos not in at_least["token_ids"][:6]


@pytest.mark.multiprocess
@pytest.mark.timeout(180)
def test_n_choices_with_a_seed_repeat_and_a_list_of_prompts_gets_a_choice_each(served):
    body = {"model": served.model, "prompt": "w1 w2 w3", "max_tokens": 6, "temperature": 1.0, "seed": 5, "n": 2,
            "ignore_eos": True, "top_k": 40, "top_p": 0.95, "repetition_penalty": 1.2}
    first = served.http.post("/v1/completions", json=body).json()
    again = served.http.post("/v1/completions", json=body).json()
    tokens = [c["token_ids"] for c in first["choices"]]
    assert [c["index"] for c in first["choices"]] == [0, 1] and len(tokens[0]) == 6
    assert tokens == [c["token_ids"] for c in again["choices"]]
    assert tokens[0] != tokens[1]  # each choice samples with its own seed
    prompts = ["w10 w11", "w20 w21 w22"]
    many = served.client.completions.create(model=served.model, prompt=prompts, max_tokens=5, temperature=0)
    for choice, prompt in zip(many.choices, prompts):
        ids = served.tokenizer.encode(prompt)
        assert choice.token_ids == served.greedy(ids, 5)  # type: ignore[attr-defined]
    assert [c.index for c in many.choices] == [0, 1]
    assert many.usage.prompt_tokens == sum(len(served.tokenizer.encode(p)) for p in prompts)


def vllm_benchmark_body(model: str, prompt: str, output_len: int) -> dict:
    """What ``vllm bench serve --backend openai --ignore-eos --temperature 0`` posts to /v1/completions: vLLM
    0.33.0's ``async_request_openai_completions`` (its sdist's ``vllm/benchmarks/lib/endpoint_request_func.py``),
    field for field and in its order: its payload, then ``ignore_eos``, then the sampling parameters given."""
    return {"model": model, "prompt": prompt, "repetition_penalty": 1.0, "max_tokens": output_len, "logprobs": None,
            "stream": True, "stream_options": {"include_usage": True}, "ignore_eos": True, "temperature": 0.0}


@pytest.mark.multiprocess
@pytest.mark.timeout(180)
def test_vllm_benchmark_request_bodies_are_served_with_usage_and_every_token(served):
    for prompt in ("w3 w4 w5 w6 w7", EOS_PROMPT):
        events = []
        with served.http.stream("POST", "/v1/completions", json=vllm_benchmark_body(served.model, prompt, 10),
                                headers={"x-request-id": "bench-1230946b-0"}) as r:  # no key: no Authorization
            assert r.status_code == 200 and r.headers["x-request-id"] == "bench-1230946b-0"
            events = [line[6:] for line in r.iter_lines() if line.startswith("data: ")]
        assert events[-1] == "[DONE]"
        chunks = [json.loads(e) for e in events[:-1]]
        ids = served.tokenizer.encode(prompt)
        expected = served.greedy(ids, 10, stop_at_eos=False)  # ignore_eos: every token asked for
        assert [t for c in chunks if c["choices"] for t in c["choices"][0]["token_ids"]] == expected
        assert "".join(c["choices"][0]["text"] for c in chunks if c["choices"]) == served.text_after(ids, expected)
        assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] == 10
    body = {**vllm_benchmark_body(served.model, "w1 w2", 4), "stream_options": {"continuous_usage_stats": True}}
    with served.http.stream("POST", "/v1/completions", json=body) as r:
        chunks = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: {")]
    assert [c["usage"]["completion_tokens"] for c in chunks][-1] == 4  # the usage so far, in every chunk
    assert all("usage" in c for c in chunks)


@pytest.mark.multiprocess
@pytest.mark.timeout(120)
def test_the_probe_routes_metrics_request_ids_and_a_body_past_64_kib(served):
    http = served.http
    assert http.get("/health").status_code == 200 and http.post("/ping").status_code == 200
    assert http.get("/version").json()["version"]
    model = http.get("/v1/models").json()["data"][0]
    assert model["root"] and model["max_model_len"] == 128
    tokens = http.post("/tokenize", json={"prompt": "w1 w2"}).json()
    assert tokens["tokens"] == served.tokenizer.encode("w1 w2") and tokens["count"] == 2
    assert http.post("/detokenize", json={"tokens": tokens["tokens"]}).json()["prompt"] == "w1 w2"
    for r in (http.get("/state"), http.get("/v1/models"), http.post("/tokenize", json={})):
        assert r.headers.get("x-request-id"), r.url
    assert http.get("/state", headers={"x-request-id": "mine"}).headers["x-request-id"] == "mine"
    # a body past the control plane's 64 KiB limit is taken on /v1 (the limit follows max_model_len)
    padded = json.dumps({"model": served.model, "prompt": "w1", "max_tokens": 3, "temperature": 0,
                         "ignore_eos": True}).replace(",", "," + " " * 20_000)
    assert len(padded) > 64 << 10
    r = http.post("/v1/completions", content=padded, headers={"content-type": "application/json"})
    assert r.status_code == 200, r.text
    from prometheus_client.parser import text_string_to_metric_families

    samples = {s.name: s.value for f in text_string_to_metric_families(http.get("/metrics").text) for s in f.samples}
    for name in ("elastic_ep_request_time_to_first_token_seconds_count", "elastic_ep_request_e2e_seconds_count",
                 "elastic_ep_request_inter_token_seconds_count", "elastic_ep_prompt_tokens_total",
                 "elastic_ep_generation_tokens_total"):
        assert samples[name] > 0, name


@pytest.mark.multiprocess
@pytest.mark.timeout(120)
def test_an_api_key_guards_every_v1_route_reads_included(served):
    with BackgroundServer(create_app(served.coordinator, api_key="sesame")) as guarded:
        assert httpx.get(f"{guarded.url}/v1/models").status_code == 401
        assert httpx.get(f"{guarded.url}/state").status_code == 200  # the control plane's reads stay open
        client = openai.OpenAI(base_url=f"{guarded.url}/v1", api_key="sesame", max_retries=0)
        assert client.models.list().data[0].id == served.model
        with pytest.raises(openai.AuthenticationError) as refused:
            openai.OpenAI(base_url=f"{guarded.url}/v1", api_key="wrong", max_retries=0).models.list()
        assert "Authorization: Bearer" in str(refused.value)  # the client shows the message
