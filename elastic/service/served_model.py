"""What the completion routes know of the served model: name, vocabulary, context, tokenizer, EOS.

Text is detokenized the way vLLM returns it: incrementally, with the last prompt tokens as
context (so ``prompt + text`` joins, and a SentencePiece first token keeps its space), with
special tokens skipped.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from functools import cached_property
from typing import Any

from elastic.control.requests import StopSearch
from eplb.models.config import HFModelConfig

__all__ = ["ServedModel", "TextView"]

CONTEXT_TOKENS = 6  # the prompt tokens decoded before the output (a word's pieces, a leading space)


@dataclass
class ServedModel:
    """What the API needs to know of the model: its name, vocabulary, context and tokenizer."""

    spec: HFModelConfig
    name: str

    @classmethod
    def of(cls, spec: HFModelConfig, name: str | None) -> ServedModel:
        default = os.path.basename(os.path.normpath(spec.path)) if spec.path else f"{spec.architecture}-tiny-seed{spec.seed}"
        return cls(spec, name or default)

    @cached_property
    def hf_config(self) -> Any:
        from eplb.models.hf import open_source

        return open_source(self.spec).config

    @property
    def vocab_size(self) -> int:
        return int(self.hf_config.vocab_size)

    @property
    def max_model_len(self) -> int:
        return int(getattr(self.hf_config, "max_position_embeddings", 0) or 1 << 30)

    @property
    def root(self) -> str:
        return self.spec.path or self.name

    @cached_property
    def eos_token_ids(self) -> tuple[int, ...]:
        """The checkpoint's EOS ids: ``generation_config.json``'s ``eos_token_id`` (one or several),
        else the config's; none for a random model without either."""
        found: Any = None
        if self.spec.path is not None:
            path = os.path.join(self.spec.path, "generation_config.json")
            if os.path.exists(path):
                with open(path) as f:
                    found = json.load(f).get("eos_token_id")
        if found is None:
            found = getattr(self.hf_config, "eos_token_id", None)
        ids = [found] if isinstance(found, int) else list(found or [])
        return tuple(int(t) for t in ids if isinstance(t, int) and 0 <= t < self.vocab_size)

    @cached_property
    def tokenizer(self) -> Any:
        """The checkpoint's tokenizer (``tokenizer.json`` or ``tokenizer_config.json`` in its
        directory), read offline; None for a random model or a checkpoint without one."""
        if self.spec.path is None or not any(os.path.exists(os.path.join(self.spec.path, f))
                                             for f in ("tokenizer.json", "tokenizer_config.json")):
            return None
        from transformers import AutoTokenizer

        return AutoTokenizer.from_pretrained(self.spec.path, local_files_only=True)

    def detokenize(self, tokens: list[int], skip_special: bool = True) -> str:
        return self.tokenizer.decode(tokens, skip_special_tokens=skip_special) if self.tokenizer is not None else ""

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return [int(t) for t in self.tokenizer.encode(text, add_special_tokens=add_special_tokens)]

    def token_text(self, token: int) -> str:
        return self.detokenize([token], skip_special=False) if self.tokenizer is not None else str(token)

    def chat_prompt(self, messages: list[dict[str, Any]], add_generation_prompt: bool, kwargs: dict[str, Any]) -> str:
        """The messages rendered with the tokenizer's chat template; ValueError when there is none."""
        if self.tokenizer is None or not getattr(self.tokenizer, "chat_template", None):
            raise ValueError("this model's tokenizer has no chat template (chat_template in tokenizer_config.json): "
                             "use /v1/completions")
        return str(self.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=add_generation_prompt,
                                                      **kwargs))


class TextView:
    """The text of one choice's tokens, detokenized with the prompt's last tokens as context, cut
    before the first stop string when the request stopped on one.

    A streamed answer's chunks are decoded incrementally (``tokenizers``' ``DecodeStream``, as vLLM's
    fast detokenizer: each token's new text once, where decoding the whole output again at every
    chunk cost ``O(n)`` a chunk on the server's loop); its last chunk, and an answer read at once,
    whole (what a stream holds back, a character's incomplete bytes, shows there as the answer read
    at once shows it). A tokenizer without a ``tokenizers`` backend, one that cleans up spaces after
    decoding (which a stream cannot), and a prompt whose last tokens end inside a character are
    decoded whole at every chunk."""

    def __init__(self, served: ServedModel, prompt: tuple[int, ...], stops: tuple[str, ...], skip_special: bool = True,
                 min_tokens: int = 0, include_stop: bool = False):
        self.served, self.stops, self.skip = served, stops, skip_special
        self.include_stop = include_stop  # vLLM's include_stop_str_in_output: the text ends after the stop string
        self.context = list(prompt[-CONTEXT_TOKENS:])
        self.prefix = served.detokenize(self.context, skip_special) if served.tokenizer is not None else ""
        self.search = StopSearch(stops, min_tokens)
        self.matched: str | None = None  # the stop string that ended the text, once found
        self._stream: Any = None  # the DecodeStream of a streamed answer, once its first chunk is asked for
        self._fed = 0  # the output tokens it has taken
        self._streamed = ""  # the text they gave

    def _incremental(self, tokens: list[int]) -> str | None:
        """``tokens``' text from the stream (taking the new ones); None where it cannot serve."""
        tokenizer = self.served.tokenizer
        backend = getattr(tokenizer, "backend_tokenizer", None)
        if (backend is None or getattr(tokenizer, "clean_up_tokenization_spaces", False) or len(tokens) < self._fed
                or self.prefix.endswith("\ufffd")):  # a prompt that ends inside a character: its text is not the prefill's
            return None
        if self._stream is None:
            from tokenizers.decoders import DecodeStream

            self._stream = DecodeStream(ids=self.context, skip_special_tokens=self.skip)
        pieces = [self._streamed]
        for token in tokens[self._fed:]:
            pieces.append(self._stream.step(backend, token) or "")
        self._fed, self._streamed = len(tokens), "".join(pieces)
        return self._streamed

    def decoded(self, tokens: list[int]) -> str:
        """``tokens``' text after the prompt's, stop strings not applied."""
        full = self.served.detokenize(self.context + tokens, self.skip)
        return full[len(self.prefix):] if full.startswith(self.prefix) else self.served.detokenize(tokens, self.skip)

    def text(self, tokens: list[int], *, final: bool) -> str:
        if self.served.tokenizer is None:
            return ""
        # the last chunk decoded whole: a stream holds back a character's incomplete bytes (and the
        # stop string they may end), which the answer read at once shows
        streamed = self._incremental(tokens) if not final else None
        text = streamed if streamed is not None else self.decoded(tokens)
        hit = self.search.find(text, tokens, self.decoded)
        if hit is not None:
            at, self.matched = hit
            return text[: at + len(self.matched)] if self.include_stop else text[:at]
        if not final:  # a stop string may be forming, or a character's bytes be incomplete: hold them back
            hold = max((len(s) - 1 for s in self.stops), default=0)
            text = text[: max(0, len(text) - hold)]  # (a text shorter than that: none of it; a negative end wrapped)
            text = text.rstrip("\ufffd")
        return text
