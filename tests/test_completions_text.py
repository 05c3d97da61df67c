"""Text completions from a checkpoint directory with a tokenizer: text in, text out, stop strings.

The checkpoint is written the way a user has one (``save_pretrained`` of the model and of a
tokenizer, both offline: a word-level tokenizer built with the ``tokenizers`` library).
"""

from __future__ import annotations

import httpx
import pytest
import torch

from elastic.coordinator import Coordinator
from elastic.deployment import DeploymentConfig
from elastic.service.api import create_app
from elastic.service.server import BackgroundServer
from eplb.models.hf import unsharded
from tests.test_hf_models import write_checkpoint

WORDS = [f"w{i}" for i in range(126)]  # with [UNK] and [PAD]: the tiny models' 128-token vocabulary


def write_tokenizer(path: str) -> None:
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"[UNK]": 0, "[PAD]": 1, **{w: i + 2 for i, w in enumerate(WORDS)}}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    from tokenizers import decoders

    tok.decoder = decoders.WordPiece(prefix="##", cleanup=False)  # joins words with spaces
    PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="[UNK]", pad_token="[PAD]").save_pretrained(path)


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    path = str(tmp_path_factory.mktemp("ckpt"))
    write_checkpoint("qwen3_moe", path)
    write_tokenizer(path)
    spec = {"kind": "hf", "path": path}
    config = DeploymentConfig.model_validate({
        "model": spec, "ep_size": 2, "max_ep_size": 2, "heartbeat_s": 0.05,
        "eplb": {"num_redundant_experts": 4}, "timeouts": {"collective": 6, "heartbeat": 8, "worker_start": 120},
        "serving": {"background_load": False}})
    torch.set_num_threads(1)
    reference = unsharded(spec)
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(path)
    with Coordinator(config) as c, BackgroundServer(create_app(c)) as server, \
            httpx.Client(base_url=server.url, timeout=120) as client:
        c.wait_for_step(3, timeout=60)
        model = client.get("/v1/models").json()["data"][0]["id"]
        yield client, model, reference, tokenizer


def greedy(reference, ids: list[int], n: int) -> list[int]:
    tokens, _ = reference.generate(torch.tensor([ids]), n)
    return tokens[0].tolist()


@pytest.mark.multiprocess
@pytest.mark.timeout(180)
def test_a_text_prompt_is_tokenized_and_the_answer_carries_text(served):
    client, model, reference, tokenizer = served
    prompt = "w5 w17 w3 w99"
    r = client.post("/v1/completions", json={"model": model, "prompt": prompt, "max_tokens": 8, "temperature": 0})
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    ids = tokenizer.encode(prompt)
    assert choice["token_ids"] == greedy(reference, ids, 8)
    # detokenized with the prompt as context (as vLLM does): the prompt and the text join
    assert prompt + choice["text"] == tokenizer.decode(ids + choice["token_ids"], skip_special_tokens=True)
    assert choice["text"].strip()
    assert r.json()["usage"]["prompt_tokens"] == len(ids)


@pytest.mark.multiprocess
@pytest.mark.timeout(180)
def test_a_stop_string_cuts_the_text_before_it_and_frees_the_slot(served):
    client, model, reference, tokenizer = served
    prompt = "w1 w2 w3"
    expected = greedy(reference, tokenizer.encode(prompt), 12)
    ids = tokenizer.encode(prompt)
    text = tokenizer.decode(ids + expected, skip_special_tokens=True)[len(tokenizer.decode(ids, skip_special_tokens=True)):]
    stop = tokenizer.decode(expected[3:5])  # a string the output reaches after a few tokens
    r = client.post("/v1/completions", json={"model": model, "prompt": prompt, "max_tokens": 12, "temperature": 0,
                                             "stop": [stop]})
    choice = r.json()["choices"][0]
    assert choice["finish_reason"] == "stop"
    assert choice["text"] == text[: text.find(stop)] and stop not in choice["text"]
    assert len(choice["token_ids"]) < 12
