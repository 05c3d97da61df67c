"""OpenAI request fields at their edges, as an outside tester sent them: each answer is a 200 that
means what vLLM's means, or a 4xx in OpenAI's shape naming the field the client sent, and the
deployment keeps serving.

Real workers, real groups, real HTTP, on a ``save_pretrained`` checkpoint with an offline
word-level tokenizer that carries a chat template (as ``tests/test_openai_server.py``).
"""

from __future__ import annotations

import json

import httpx
import openai
import pytest
import torch

from elastic.coordinator import Coordinator
from elastic.deployment import DeploymentConfig
from elastic.service.api import create_app
from elastic.service.server import BackgroundServer
from tests.test_openai_server import write_chat_checkpoint

CRASH = "/v1/crash-for-the-test"  # a route that raises: what any unforeseen bug on /v1 looks like


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    path = write_chat_checkpoint(str(tmp_path_factory.mktemp("ckpt")))
    torch.set_num_threads(1)
    config = DeploymentConfig.model_validate({
        "model": {"kind": "hf", "path": path}, "ep_size": 2, "max_ep_size": 2, "heartbeat_s": 0.05,
        "eplb": {"num_redundant_experts": 4}, "timeouts": {"collective": 6, "heartbeat": 8, "worker_start": 120},
        "serving": {"background_load": False, "max_batch": 4, "max_queue": 8, "max_tokens_limit": 64}})
    with Coordinator(config) as c:
        app = create_app(c)

        def crash() -> None:
            raise RuntimeError("a bug")

        app.add_api_route(CRASH, crash, methods=["POST"])
        with BackgroundServer(app) as server, httpx.Client(base_url=server.url, timeout=120) as http:
            c.wait_for_step(3, timeout=60)
            model = http.get("/v1/models").json()["data"][0]["id"]
            yield http, model, server.url


def openai_error(r: httpx.Response, status: int, param: str | None) -> str:
    assert r.status_code == status, r.text
    error = r.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["param"] == param, r.text
    return str(error["message"])


def still_serving(http: httpx.Client, model: str) -> None:
    r = http.post("/v1/completions", json={"model": model, "prompt": [3, 4], "max_tokens": 2, "temperature": 0})
    assert r.status_code == 200 and len(r.json()["choices"][0]["token_ids"]) == 2, r.text


@pytest.mark.multiprocess
@pytest.mark.timeout(240)
def test_max_completion_tokens_on_completions_is_ignored_whatever_its_type(served):
    """vLLM's completions have no max_completion_tokens: it is ignored and named so. It was read
    from the body's extras unchecked: a string, a list or an object was a 500 (TypeError), 2.5 or
    true a length, -5 a 400 naming min_tokens."""
    http, model, _ = served
    plain = http.post("/v1/completions", json={"model": model, "prompt": "w1 w2", "max_tokens": 3, "temperature": 0})
    assert plain.status_code == 200, plain.text
    for value in ["5", [1], {"a": 1}, 2.5, True, -5, 0, 1]:
        r = http.post("/v1/completions", json={"model": model, "prompt": "w1 w2", "max_tokens": 3, "temperature": 0,
                                               "max_completion_tokens": value})
        assert r.status_code == 200, (value, r.text)
        assert r.json()["choices"][0]["token_ids"] == plain.json()["choices"][0]["token_ids"], value
        assert r.headers["x-ignored-fields"] == "max_completion_tokens"
    still_serving(http, model)


@pytest.mark.multiprocess
@pytest.mark.timeout(240)
def test_an_error_names_the_field_the_client_sent(served):
    """A conversation too long for the context names messages (it named prompt, a field chat has
    not), max_completion_tokens past the context names it (it named max_tokens), and /detokenize's
    token out of the vocabulary names tokens (it named prompt)."""
    http, model, _ = served
    long_chat = {"model": model, "messages": [{"role": "user", "content": "w1 " * 200}], "max_tokens": 4}
    assert "context" in openai_error(http.post("/v1/chat/completions", json=long_chat), 400, "messages")
    chat = {"model": model, "messages": [{"role": "user", "content": "w1"}], "max_completion_tokens": 1000}
    assert "max_completion_tokens 1000" in openai_error(http.post("/v1/chat/completions", json=chat), 400,
                                                        "max_completion_tokens")
    openai_error(http.post("/detokenize", json={"tokens": [1, 2, 10**6]}), 400, "tokens")
    # a null model on /tokenize with messages, as with a prompt, is the served one (it was a 400)
    r = http.post("/tokenize", json={"model": None, "messages": [{"role": "user", "content": "w1"}]})
    assert r.status_code == 200 and r.json()["count"] > 0, r.text
    still_serving(http, model)


@pytest.mark.multiprocess
@pytest.mark.timeout(240)
def test_absent_routes_methods_and_a_crash_on_v1_answer_in_openais_shape(served):
    """The openai client shows error.message: a 404 for /v1/embeddings, a 405 and a 500 said only
    'Error code: 404' (their body was the control plane's ``{"error": "not_found", ...}``)."""
    http, model, url = served
    assert "/v1/embeddings" in openai_error(http.post("/v1/embeddings", json={"model": model, "input": "w1"}), 404, None)
    assert "Method Not Allowed" in openai_error(http.get("/v1/completions"), 405, None)
    assert "RuntimeError: a bug" in openai_error(http.post(CRASH), 500, None)
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=60)
    with pytest.raises(openai.NotFoundError, match="/v1/embeddings"):
        client.embeddings.create(model=model, input="w1")
    # the control plane's own shape is unchanged
    assert http.get("/no-such-route").json()["error"] == "not_found"
    still_serving(http, model)


@pytest.mark.multiprocess
@pytest.mark.timeout(240)
def test_the_neutral_values_clients_send_explicitly_are_served(served):
    """OpenAI's and vLLM's defaults sent explicitly: no tools, tool_choice "none" (vLLM's default),
    response_format text. Each was a 400 'not supported'; a real tool or JSON mode still is."""
    http, model, _ = served
    chat = {"model": model, "messages": [{"role": "user", "content": "w1"}], "max_tokens": 3, "temperature": 0}
    plain = http.post("/v1/chat/completions", json=chat).json()["choices"][0]["message"]["content"]
    for extra in [{"tools": []}, {"tool_choice": "none"}, {"response_format": {"type": "text"}},
                  {"tools": [], "tool_choice": "none", "functions": [], "function_call": "none"}]:
        r = http.post("/v1/chat/completions", json={**chat, **extra})
        assert r.status_code == 200 and r.json()["choices"][0]["message"]["content"] == plain, (extra, r.text)
    tool = {"type": "function", "function": {"name": "f", "parameters": {}}}
    openai_error(http.post("/v1/chat/completions", json={**chat, "tools": [tool]}), 400, "tools")
    openai_error(http.post("/v1/chat/completions", json={**chat, "tool_choice": "auto"}), 400, "tool_choice")
    openai_error(http.post("/v1/chat/completions", json={**chat, "response_format": {"type": "json_object"}}), 400,
                 "response_format")
    still_serving(http, model)


@pytest.mark.multiprocess
@pytest.mark.timeout(240)
def test_a_negative_seed_is_served_as_vllm_serves_it(served):
    """vLLM takes any int64 seed; a negative one was a 400. The same seed gives the same tokens."""
    http, model, _ = served
    body = {"model": model, "prompt": "w1 w2", "max_tokens": 6, "temperature": 1.0, "ignore_eos": True}
    answers = [http.post("/v1/completions", json={**body, "seed": seed}) for seed in (-1, -1, -(2**63), 2**63 - 1)]
    assert all(r.status_code == 200 for r in answers), [r.text for r in answers]
    tokens = [r.json()["choices"][0]["token_ids"] for r in answers]
    assert tokens[0] == tokens[1]
    openai_error(http.post("/v1/completions", json={**body, "seed": -(2**63) - 1}), 400, "seed")
    openai_error(http.post("/v1/completions", json={**body, "seed": 2**63}), 400, "seed")


@pytest.mark.multiprocess
@pytest.mark.timeout(240)
def test_top_logprobs_without_logprobs_is_a_400_as_openais(served):
    """It was ignored without a word (no log-probabilities in the answer)."""
    http, model, _ = served
    chat = {"model": model, "messages": [{"role": "user", "content": "w1"}], "max_tokens": 2, "temperature": 0}
    assert "logprobs" in openai_error(http.post("/v1/chat/completions", json={**chat, "top_logprobs": 2}), 400,
                                      "top_logprobs")
    r = http.post("/v1/chat/completions", json={**chat, "logprobs": True, "top_logprobs": 2})
    assert r.status_code == 200 and len(r.json()["choices"][0]["logprobs"]["content"][0]["top_logprobs"]) == 2, r.text


@pytest.mark.multiprocess
@pytest.mark.timeout(240)
def test_stream_options_without_stream_is_a_400_as_vllms(served):
    """They were ignored without a word: a client that asked for the usage in a last chunk got no stream."""
    http, model, _ = served
    body = {"model": model, "prompt": "w1 w2", "max_tokens": 2, "temperature": 0, "stream_options": {"include_usage": True}}
    for stream in (False, None):
        assert "stream" in openai_error(http.post("/v1/completions", json={**body, "stream": stream}), 400, "stream_options")
    chat = {"model": model, "messages": [{"role": "user", "content": "w1"}], "max_tokens": 2, "temperature": 0}
    assert "stream" in openai_error(http.post("/v1/chat/completions", json={**chat, "stream_options": {}}), 400,
                                    "stream_options")
    r = http.post("/v1/completions", json={**body, "stream": True})
    chunks = [json.loads(line[6:]) for line in r.text.splitlines() if line.startswith("data: {")]
    assert r.status_code == 200 and chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] == 2


@pytest.mark.multiprocess
@pytest.mark.timeout(240)
def test_a_clients_request_id_is_echoed_cut_on_the_completion_routes_too(served):
    """Every other route cut a client's x-request-id to 128 characters; the completion routes echoed
    it whole (10 000 characters in, 10 000 out)."""
    http, model, _ = served
    body = {"model": model, "prompt": [3], "max_tokens": 1}
    for stream in (False, True):
        r = http.post("/v1/completions", json={**body, "stream": stream}, headers={"x-request-id": "r" * 10_000})
        assert r.status_code == 200 and r.headers["x-request-id"] == "r" * 128
    assert http.post("/v1/completions", json=body, headers={"x-request-id": "mine"}).headers["x-request-id"] == "mine"


@pytest.mark.multiprocess
@pytest.mark.timeout(240)
def test_a_logit_bias_key_that_is_not_a_decimal_token_id_is_a_400(served):
    """'²' passed str.isdigit, then int() raised (a 500), as did a key of 5000 digits; '05' and '5'
    were both applied (their biases added up)."""
    http, model, _ = served
    body = {"model": model, "prompt": "w1", "max_tokens": 2}
    for bias in [{"²": 1}, {"9" * 5000: 1}, {"٣": 1}, {"5": 100, "05": -100}, {" 5": 1}]:
        openai_error(http.post("/v1/completions", json={**body, "logit_bias": bias}), 400, "logit_bias")
    r = http.post("/v1/completions", json={**body, "temperature": 0, "logit_bias": {"5": 100}})
    assert r.status_code == 200 and r.json()["choices"][0]["token_ids"][0] == 5, r.text
    still_serving(http, model)


@pytest.mark.multiprocess
@pytest.mark.timeout(240)
def test_a_number_of_thousands_of_digits_is_a_400_that_says_so(served):
    """The message was FastAPI's 'There was an error parsing the body'."""
    http, model, _ = served
    raw = b'{"model": "%s", "prompt": [1], "max_tokens": %s}' % (model.encode(), b"9" * 5000)
    r = http.post("/v1/completions", content=raw, headers={"Content-Type": "application/json"})
    assert "4300 digits" in openai_error(r, 400, None)
    still_serving(http, model)


@pytest.mark.multiprocess
@pytest.mark.timeout(240)
def test_a_body_of_unknown_fields_costs_a_short_log_line(served, caplog):
    """A 700 KB body of 40 000 unknown fields wrote a 1 MB warning line, per request."""
    http, model, _ = served
    body = {"model": model, "prompt": [3], "max_tokens": 1, **{f"ж{i}": 0 for i in range(40_000)}}
    with caplog.at_level("WARNING", logger="elastic.service.completions"):
        r = http.post("/v1/completions", json=body)
    assert r.status_code == 200 and len(r.headers["x-ignored-fields"]) <= 1024, r.text[:200]
    lines = [rec.getMessage() for rec in caplog.records if "ignored request fields" in rec.getMessage()]
    assert lines and all(len(line) < 1200 for line in lines) and "(40000)" in lines[0], [len(x) for x in lines]


def test_a_missing_api_key_on_tokenize_is_a_401_in_openais_shape():
    """/tokenize and /detokenize answered the control plane's ``{"error": "unauthorized"}``."""
    from starlette.applications import Starlette
    from starlette.testclient import TestClient

    from elastic.service.api import RequireApiKey

    with TestClient(RequireApiKey(Starlette(), key="k")) as client:
        for path in ("/tokenize", "/detokenize", "/v1/completions"):
            r = client.post(path, json={"prompt": "w1"})
            assert r.status_code == 401 and r.json()["error"]["type"] == "authentication_error", (path, r.text)
        assert client.post("/scale", json={"ep_size": 2}).json()["error"] == "unauthorized"


@pytest.mark.timeout(60)
def test_a_full_server_answers_a_serving_route_503_in_openais_shape_with_retry_after():
    """Beyond the connection cap, with every connection answering, /v1 got uvicorn's plain-text
    'Service Unavailable' (the openai client showed 'Error code: 503' and nothing else)."""
    import socket

    from tests.test_reliability import full_server

    with full_server() as (server, address, busy, release):
        for request in (b"GET /v1/models HTTP/1.1\r\nHost: x\r\n\r\n",
                        b"POST /tokenize HTTP/1.1\r\nHost: x\r\nContent-Length: 2\r\n\r\n{}"):
            data = socket.create_connection(address)
            data.sendall(request)
            data.settimeout(5)
            answer = b""
            while chunk := data.recv(4096):  # to the end: the server closes it
                answer += chunk
            head, _, body = answer.partition(b"\r\n\r\n")
            assert head.startswith(b"HTTP/1.1 503") and b"retry-after: 1" in head.lower(), answer
            assert b"connection: close" in head.lower(), answer
            assert json.loads(body)["error"]["code"] == "server_full"
        other = socket.create_connection(address)  # a route of neither kind: uvicorn's answer, as before
        other.sendall(b"GET /elsewhere HTTP/1.1\r\nHost: x\r\n\r\n")
        other.settimeout(5)
        assert other.recv(4096).startswith(b"HTTP/1.1 503")


@pytest.mark.multiprocess
@pytest.mark.timeout(240)
def test_no_stop_string_ends_a_request_before_min_tokens_as_vllms(served):
    """vLLM checks stop strings only past min_tokens (and never one that ends within their text);
    here one stopped the request at its first token whatever min_tokens said."""
    http, model, _ = served
    body = {"model": model, "prompt": "w1 w2 w3", "temperature": 0, "ignore_eos": True}
    plain = http.post("/v1/completions", json={**body, "max_tokens": 12}).json()["choices"][0]
    first4 = http.post("/v1/completions", json={**body, "max_tokens": 4}).json()["choices"][0]["text"]
    stop = first4.split()[1]  # the second token's word: within the first 4 tokens
    early = http.post("/v1/completions", json={**body, "max_tokens": 12, "stop": [stop]}).json()["choices"][0]
    assert early["finish_reason"] == "stop" and len(early["text"]) < len(first4)
    at = plain["text"].find(stop, len(first4) - len(stop) + 1)
    expected = (plain["text"][:at], "stop") if at >= 0 else (plain["text"], "length")
    for stream in (False, True):
        r = http.post("/v1/completions", json={**body, "max_tokens": 12, "stop": [stop], "min_tokens": 4, "stream": stream})
        assert r.status_code == 200, r.text
        if stream:
            chunks = [json.loads(line[6:]) for line in r.text.splitlines() if line.startswith("data: {")]
            text = "".join(c["choices"][0]["text"] for c in chunks if c["choices"])
            reason = [c["choices"][0]["finish_reason"] for c in chunks if c["choices"] and c["choices"][0]["finish_reason"]]
            assert (text, reason[-1]) == expected, (stream, text, reason, expected)
        else:
            choice = r.json()["choices"][0]
            assert (choice["text"], choice["finish_reason"]) == expected, (choice, expected)


@pytest.mark.multiprocess
@pytest.mark.timeout(240)
def test_a_lone_surrogate_in_text_is_a_400_naming_the_field(served):
    """JSON's "\\ud800" parses to a string that is no Unicode text: the tokenizer raised a TypeError
    (a 500) on a completion's prompt, a chat message and /tokenize."""
    http, model, _ = served
    headers = {"Content-Type": "application/json"}
    cases = [
        ("/v1/completions", b'{"model": "%s", "prompt": "w1 \\ud800", "max_tokens": 2}', "prompt"),
        ("/v1/completions", b'{"model": "%s", "prompt": ["w1", "\\udc00 w2"], "max_tokens": 2, "echo": true}', "prompt"),
        ("/v1/chat/completions", b'{"model": "%s", "messages": [{"role": "user", "content": "\\ud800"}]}', "messages"),
        ("/tokenize", b'{"model": "%s", "prompt": "\\ud800"}', "prompt")]
    for path, raw, param in cases:
        r = http.post(path, content=raw % model.encode(), headers=headers)
        assert "surrogate" in openai_error(r, 400, param), (path, r.text)
    still_serving(http, model)


@pytest.mark.multiprocess
@pytest.mark.timeout(240)
def test_a_stop_string_at_the_outputs_start_ends_the_request_there(served):
    """The answer's text is decoded with the prompt as context (" w56 ..."); the engine searched stop
    strings in the output decoded alone ("w56 ..."): " w56" was never seen there, the request went on
    to max_tokens and answered text "" with finish_reason length and 10 completion tokens."""
    http, model, _ = served
    body = {"model": model, "prompt": "w1 w2 w3", "temperature": 0, "ignore_eos": True, "max_tokens": 10}
    plain = http.post("/v1/completions", json=body).json()["choices"][0]
    assert plain["text"].startswith(" ")
    stop = " " + plain["text"].split()[0]
    r = http.post("/v1/completions", json={**body, "stop": [stop]}).json()
    assert (r["choices"][0]["text"], r["choices"][0]["finish_reason"]) == ("", "stop"), r
    assert r["usage"]["completion_tokens"] == 1 and r["choices"][0]["token_ids"] == plain["token_ids"][:1]
    streamed = http.post("/v1/completions", json={**body, "stop": [stop], "stream": True,
                                                  "stream_options": {"include_usage": True}})
    chunks = [json.loads(line[6:]) for line in streamed.text.splitlines() if line.startswith("data: {")]
    assert [c["choices"][0]["finish_reason"] for c in chunks if c["choices"]][-1] == "stop"
    assert chunks[-1]["usage"]["completion_tokens"] == 1


@pytest.mark.multiprocess
@pytest.mark.timeout(240)
def test_include_stop_str_in_output_keeps_the_stop_string_and_a_requests_template_is_refused(served):
    """vLLM's include_stop_str_in_output was ignored (the text ended before the stop string), and a
    top-level chat_template or continue_final_message were ignored: the answer silently came from
    another prompt than the one asked for."""
    http, model, _ = served
    body = {"model": model, "prompt": "w1 w2 w3", "temperature": 0, "ignore_eos": True, "max_tokens": 10}
    plain = http.post("/v1/completions", json=body).json()["choices"][0]["text"]
    stop = plain.split()[2]
    cut = http.post("/v1/completions", json={**body, "stop": [stop]}).json()["choices"][0]
    assert cut["text"] == plain[: plain.index(stop)] and cut["finish_reason"] == "stop"
    for stream in (False, True):
        r = http.post("/v1/completions", json={**body, "stop": [stop, "zzz"], "include_stop_str_in_output": True,
                                               "stream": stream})
        assert r.status_code == 200 and "x-ignored-fields" not in r.headers, r.text
        if stream:
            text = "".join(json.loads(line[6:])["choices"][0]["text"] for line in r.text.splitlines()
                           if line.startswith("data: {"))
        else:
            text = r.json()["choices"][0]["text"]
        assert text == plain[: plain.index(stop) + len(stop)], (stream, text, plain)
    chat = {"model": model, "messages": [{"role": "user", "content": "w1"}], "max_tokens": 2}
    openai_error(http.post("/v1/chat/completions", json={**chat, "chat_template": "w7 w7"}), 400, "chat_template")
    openai_error(http.post("/v1/chat/completions", json={**chat, "continue_final_message": True}), 400,
                 "continue_final_message")
    r = http.post("/v1/chat/completions", json={**chat, "chat_template": None, "continue_final_message": False})
    assert r.status_code == 200, r.text


@pytest.mark.multiprocess
@pytest.mark.timeout(240)
def test_stop_reason_names_the_stop_string_or_token_that_ended_a_choice(served):
    """vLLM's stop_reason: the stop string, or the stop_token_ids token; None for a length. It was
    always None."""
    http, model, _ = served
    body = {"model": model, "prompt": "w1 w2 w3", "temperature": 0, "ignore_eos": True, "max_tokens": 10}
    plain = http.post("/v1/completions", json=body).json()["choices"][0]
    assert plain["stop_reason"] is None and plain["finish_reason"] == "length"
    stop, token = plain["text"].split()[2], plain["token_ids"][1]
    for stream in (False, True):
        for extra, reason in (({"stop": ["zzz", stop]}, stop), ({"stop_token_ids": [token]}, token)):
            r = http.post("/v1/completions", json={**body, **extra, "stream": stream})
            if stream:
                last = [json.loads(line[6:]) for line in r.text.splitlines() if line.startswith("data: {")][-1]
                assert last["choices"][0]["stop_reason"] == reason, (extra, last)
            else:
                assert r.json()["choices"][0]["stop_reason"] == reason, (extra, r.text)
    chat = {"model": model, "messages": [{"role": "user", "content": "w1"}], "max_tokens": 10, "temperature": 0,
            "ignore_eos": True}
    said = http.post("/v1/chat/completions", json=chat).json()["choices"][0]["message"]["content"]
    word = said.split()[1]
    r = http.post("/v1/chat/completions", json={**chat, "stop": [word]}).json()["choices"][0]
    assert (r["finish_reason"], r["stop_reason"]) == ("stop", word), r
