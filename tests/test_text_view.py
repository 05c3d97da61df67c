"""The answer's text (elastic.service.served_model.TextView): a streamed answer is decoded incrementally
(tokenizers' DecodeStream), an answer read at once whole; the pieces of a stream join to the same text
as the whole decode, characters of several bytes and stop strings included, and a stream no longer
decodes its whole output at every chunk. A byte-level BPE tokenizer trained here, offline."""

from __future__ import annotations

import random

import pytest

from elastic.service.served_model import ServedModel, TextView
from eplb.models.config import HFModelConfig

CORPUS = ["héllo wörld 日本語 テキスト", "naïve café résumé", "the quick brown fox 🦊 jumps", "ünïcödé everywhere ✓"] * 20
TEXT = "prompt: naïve 日本語 🦊 café résumé ✓ done, the quick brown fox 🦊 jumps over héllo wörld ✓"


def _served(path: str) -> ServedModel:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    # a small vocabulary: the rarer characters stay split over byte tokens
    tok.train_from_iterator(CORPUS, trainers.BpeTrainer(vocab_size=300, special_tokens=["<eos>"],
                                                        initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<eos>").save_pretrained(path)
    return ServedModel(HFModelConfig.model_validate({"kind": "hf", "path": path}), "bpe")


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    return _served(str(tmp_path_factory.mktemp("bpe")))


def _streamed(view: TextView, out: list[int], sizes: list[int]) -> str:
    """What the route sends: the new text of each chunk (as _pieces does), the last chunk final."""
    sent, end = "", 0
    for size in sizes:
        end = min(len(out), end + size)
        text = view.text(out[:end], final=end == len(out))
        assert text.startswith(sent), (sent, text)
        sent = text
        if end == len(out):
            break
    return sent


def test_a_streamed_answer_joins_to_the_whole_decode_with_characters_of_several_bytes(served):
    """Every prompt cut and every output end, those inside a character included: an output that ends
    inside one (max_tokens) lost the bytes the stream held back, and a prompt that ends inside one
    sent the prompt's text as the stream's first piece (a hostile tester's finds)."""
    ids = served.encode(TEXT, add_special_tokens=False)
    assert any(served.detokenize(ids[:n]).endswith("\ufffd") for n in range(len(ids)))  # characters split over tokens
    rng = random.Random(0)
    for cut in range(1, 16):
        prompt = ids[:cut]
        for end in range(cut + 1, len(ids) + 1):
            out = ids[cut:end]
            whole = TextView(served, tuple(prompt), ()).text(out, final=True)
            if not served.detokenize(prompt).endswith("\ufffd"):
                assert whole == served.detokenize(ids[:end])[len(served.detokenize(prompt)):]
            for sizes in ([1] * len(out), [rng.randint(1, 5) for _ in out]):
                assert _streamed(TextView(served, tuple(prompt), ()), out, sizes) == whole, (cut, end)


def test_a_streamed_answer_stops_where_the_answer_read_at_once_does(served):
    ids = served.encode(TEXT, add_special_tokens=False)
    prompt, out = ids[:4], ids[4:]
    for stops, include in ((("🦊",), False), (("café", "ü"), True), (("wörld",), False), (("日",), True)):
        whole = TextView(served, tuple(prompt), stops, include_stop=include)
        text = whole.text(out, final=True)
        assert whole.matched is not None and text.endswith(whole.matched) == include
        streamed = TextView(served, tuple(prompt), stops, include_stop=include)
        assert _streamed(streamed, out, [1] * len(out)) == text and streamed.matched == whole.matched
    # the engine stops on a stop string whose last bytes the stream still holds: the last chunk shows it
    end = next(n for n in range(5, len(ids)) if "日" in served.detokenize(ids[4:n]))
    assert served.detokenize(ids[4:end]).endswith("日\ufffd")  # the token that completes 日 begins the next character
    view = TextView(served, tuple(prompt), ("日",), include_stop=True)
    assert _streamed(view, ids[4:end], [1] * (end - 4)).endswith("日") and view.matched == "日"


def test_a_stream_decodes_each_token_once_not_its_whole_output_per_chunk(served, monkeypatch):
    ids = served.encode(TEXT * 6, add_special_tokens=False)
    prompt, out = ids[:6], ids[6:]
    view = TextView(served, tuple(prompt), ("never there",))
    decoded: list[int] = []
    real = served.detokenize
    monkeypatch.setattr(served, "detokenize", lambda tokens, skip=True: decoded.append(len(tokens)) or real(tokens, skip))
    text = _streamed(view, out, [1] * len(out))
    assert text == real(ids)[len(real(prompt)):]
    assert sum(decoded) < 2 * len(out)  # the whole output decoded per chunk was len(out) ** 2 / 2 tokens


def test_a_tokenizer_that_cleans_up_spaces_after_decoding_is_decoded_whole(tmp_path):
    """transformers joins "a ," into "a," after a WordPiece decode (clean_up_tokenization_spaces), which
    a stream of pieces cannot do: such a tokenizer's stream is decoded whole, as before."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    words = ["[UNK]", "a", "b", "c", "d", ",", ".", "!", "?"]
    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.decoder = decoders.WordPiece(prefix="##", cleanup=False)
    PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="[UNK]", clean_up_tokenization_spaces=True).save_pretrained(tmp_path)
    served = ServedModel(HFModelConfig.model_validate({"kind": "hf", "path": str(tmp_path)}), "words")
    ids = served.encode("a , b . c ! d ? a", add_special_tokens=False)
    assert served.detokenize(ids) == "a, b. c! d? a"  # cleaned up
    prompt, out = ids[:1], ids[1:]
    whole = TextView(served, tuple(prompt), ()).text(out, final=True)
    assert _streamed(TextView(served, tuple(prompt), ()), out, [1] * len(out)) == whole == ", b. c! d? a"
