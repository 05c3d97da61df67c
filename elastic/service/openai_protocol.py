"""The OpenAI / vLLM request bodies and error shape of the completion routes (pure: no server state).

The fields are those vLLM's OpenAI server accepts, with the same meaning and defaults. A field
vLLM has but this server cannot honour (:data:`UNSUPPORTED`) is a 400 naming it when set to
anything but its neutral value; a field neither knows is ignored, logged and named in the
``X-Ignored-Fields`` response header, as vLLM ignores it with a log line.
"""

from __future__ import annotations

import re
from typing import Any

from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictInt, ValidationInfo, field_validator

__all__ = ["ChatRequest", "CompletionRequest", "NEUTRAL", "OpenAIError", "SamplingFields", "StreamOptions",
           "UNSUPPORTED", "error_response"]

#: vLLM request fields this server does not implement, with the value that means "not used"
UNSUPPORTED: dict[str, Any] = {
    "suffix": None, "prompt_logprobs": None, "use_beam_search": False, "length_penalty": 1.0,
    "guided_json": None, "guided_regex": None, "guided_choice": None, "guided_grammar": None,
    "guided_decoding_backend": None, "guided_whitespace_pattern": None, "structured_outputs": None,
    "response_format": None, "tools": None, "tool_choice": None, "functions": None, "function_call": None,
    "allowed_token_ids": None, "bad_words": None, "truncate_prompt_tokens": None, "lora_request": None,
    "prompt_embeds": None, "logits_processors": None, "kv_transfer_params": None, "vllm_xargs": None,
    # chat: a template sent with the request (vLLM refuses it unless --trust-request-chat-template;
    # chat_template_kwargs' chat_template is refused too), and a last assistant message continued
    "chat_template": None, "continue_final_message": False,
}
#: other values of those fields that ask for nothing this server lacks (OpenAI's and vLLM's defaults,
#: which clients send explicitly): no tools, tool_choice "none", plain text. Each was a 400
NEUTRAL: dict[str, tuple[Any, ...]] = {
    "tools": ([],), "functions": ([],), "tool_choice": ("none",), "function_call": ("none",),
    "response_format": ({"type": "text"},), "bad_words": ([],), "allowed_token_ids": ([],),
}


TOKEN_KEY = re.compile(r"-?[0-9]{1,19}")  # a logit_bias key: a token id in decimal


class OpenAIError(Exception):
    """An error answered in OpenAI's shape: ``{"error": {"message", "type", "param", "code"}}``."""

    TYPES = {400: "invalid_request_error", 401: "authentication_error", 404: "not_found_error", 405: "invalid_request_error",
             429: "rate_limit_error", 499: "cancelled", 500: "internal_server_error", 503: "service_unavailable"}

    def __init__(self, status: int, message: str, *, param: str | None = None, code: str | None = None,
                 headers: dict[str, str] | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.code, self.headers = status, message, param, code, headers

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.TYPES.get(self.status, "error"), "param": self.param,
                          "code": self.code}}


def error_response(exc: OpenAIError) -> JSONResponse:
    return JSONResponse(exc.body(), status_code=exc.status, headers=exc.headers)


def _needs(value: Any, info: ValidationInfo, flag: str) -> Any:
    """A field that means something only with ``flag`` true: refused without it, naming both."""
    if value is not None and not info.data.get(flag):
        raise ValueError(f"{info.field_name} needs {flag}: true")
    return value


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)

    include_usage: StrictBool | None = Field(False, description="a last chunk with the usage and no choices")
    continuous_usage_stats: StrictBool | None = Field(False, description="the usage so far in every chunk")


class SamplingFields(BaseModel):
    """The fields completions and chat completions share (vLLM's ``SamplingParams``)."""

    # strict: JSON false is not a number, nor 1.0 an integer (a fuzzer's finds); extra fields are
    # kept (model_extra) so the route can name them, and ignored
    model_config = ConfigDict(extra="allow", strict=True)

    model: str = Field(..., min_length=1, max_length=512, description="the served model's name (GET /v1/models)")
    max_tokens: StrictInt | None = Field(16, ge=1, description="tokens to generate (None: what the context leaves, "
                                                               "up to serving.max_tokens_limit)")
    temperature: float | None = Field(None, ge=0.0, le=2.0, allow_inf_nan=False, description="0: greedy (default 1)")
    top_p: float | None = Field(None, gt=0.0, le=1.0, allow_inf_nan=False, description="the nucleus kept")
    top_k: StrictInt | None = Field(None, ge=-1, description="the most likely k kept (0 or -1: all)")
    min_p: float | None = Field(None, ge=0.0, le=1.0, allow_inf_nan=False,
                                description="tokens below min_p times the top probability dropped")
    repetition_penalty: float | None = Field(None, gt=0.0, le=10.0, allow_inf_nan=False,
                                             description="divides the logits of prompt and output tokens (>1)")
    presence_penalty: float | None = Field(None, ge=-2.0, le=2.0, allow_inf_nan=False)
    frequency_penalty: float | None = Field(None, ge=-2.0, le=2.0, allow_inf_nan=False)
    logit_bias: dict[str, float] | None = Field(None, max_length=300, description="token id -> bias in [-100, 100]")
    # vLLM's range (int64, negative included); -1 and 2**63 - 1 are the same seed here
    seed: StrictInt | None = Field(None, ge=-(2**63), lt=2**63,
                                   description="the sampling seed, an int64 (default: from the request id)")
    stop: str | list[str] | None = Field(None, description="stop strings (needs a tokenizer); the text ends before them")
    stop_token_ids: list[StrictInt] | None = Field(None, max_length=64, description="tokens that end the request")
    ignore_eos: StrictBool | None = Field(False, description="go on past the model's EOS token")
    min_tokens: StrictInt | None = Field(0, ge=0, description="no stop (EOS, stop_token_ids, stop strings) before this many tokens")
    n: StrictInt | None = Field(1, ge=1, le=16, description="choices per prompt")
    best_of: StrictInt | None = Field(None, ge=1, le=16, description="accepted only equal to n")
    stream: StrictBool | None = False
    stream_options: StreamOptions | None = None
    user: str | None = Field(None, max_length=256)
    skip_special_tokens: StrictBool | None = True
    include_stop_str_in_output: StrictBool | None = Field(False, description="the stop string that ended the text kept")

    @field_validator("stop")
    @classmethod
    def _stop(cls, value: str | list[str] | None) -> str | list[str] | None:
        stops = [value] if isinstance(value, str) else value or []
        if any(not s for s in stops):
            raise ValueError("a stop string is empty")
        if len(stops) > 16:
            raise ValueError(f"at most 16 stop strings, got {len(stops)}")
        return value

    # as vLLM's ("Stream options can only be defined when `stream=True`"): they were ignored without a word
    _stream_options = field_validator("stream_options")(classmethod(lambda cls, v, info: _needs(v, info, "stream")))

    @field_validator("logit_bias")
    @classmethod
    def _bias(cls, value: dict[str, float] | None) -> dict[str, float] | None:
        seen: dict[int, str] = {}
        for key, bias in (value or {}).items():
            # ASCII digits, at most 19 (int64): str.isdigit took '²' (then int() raised: a 500) and
            # int() refuses 4300 digits and more (a 500 too)
            if not TOKEN_KEY.fullmatch(key):
                raise ValueError(f"keys are token ids (decimal digits), got {key[:32]!r}")
            token = int(key)
            if token in seen:
                raise ValueError(f"token {token} is given twice ({seen[token]!r} and {key!r})")
            seen[token] = key
            if not -100.0 <= bias <= 100.0:
                raise ValueError(f"biases are in [-100, 100], got {bias!r} for token {key}")
        return value


class CompletionRequest(SamplingFields):
    """The body of ``POST /v1/completions``."""

    model_config = ConfigDict(extra="allow", strict=True, json_schema_extra={
        "examples": [{"model": "qwen3_moe-tiny-seed0", "prompt": [1, 2, 3, 4], "max_tokens": 8, "temperature": 0}]})

    prompt: list[StrictInt] | list[list[StrictInt]] | str | list[str] = Field(
        ..., description="token ids or text (with a tokenizer); a list of them: one choice per prompt")
    logprobs: StrictInt | None = Field(None, ge=0, le=20, description="log-probabilities of the top n tokens too")
    echo: StrictBool | None = Field(False, description="the prompt's text before the completion's")
    return_token_ids: StrictBool | None = Field(None, description="prompt_token_ids in every choice too")

    @field_validator("prompt")
    @classmethod
    def _prompt(cls, value: Any) -> Any:
        if len(value) == 0 or (isinstance(value, list) and any(len(v) == 0 for v in value if isinstance(v, (list, str)))):
            raise ValueError("the prompt is empty")
        if isinstance(value, list) and len(value) > 0 and isinstance(value[0], (list, str)) and len(value) > 16:
            raise ValueError("at most 16 prompts in one request")
        return value


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow", strict=True)

    role: str = Field(..., min_length=1, max_length=64)
    content: str | list[dict[str, Any]] | None = None


class ChatRequest(SamplingFields):
    """The body of ``POST /v1/chat/completions``."""

    model_config = ConfigDict(extra="allow", strict=True, json_schema_extra={
        "examples": [{"model": "qwen3_moe-tiny-seed0", "messages": [{"role": "user", "content": "hi"}]}]})

    messages: list[ChatMessage] = Field(..., min_length=1, max_length=256)
    # vLLM's and OpenAI's chat default: no cap but the context (completions default to 16)
    max_tokens: StrictInt | None = Field(None, ge=1, description="tokens to generate (default: what the context "
                                                                 "leaves, up to serving.max_tokens_limit)")
    max_completion_tokens: StrictInt | None = Field(None, ge=1, description="OpenAI's newer name of max_tokens")
    logprobs: StrictBool | None = Field(False, description="the chosen tokens' log-probabilities")
    top_logprobs: StrictInt | None = Field(None, ge=0, le=20, description="and the top n alternatives")
    add_generation_prompt: StrictBool | None = True
    chat_template_kwargs: dict[str, Any] | None = None

    # as OpenAI's and vLLM's: top_logprobs needs logprobs (it was ignored without a word)
    _top_logprobs = field_validator("top_logprobs")(classmethod(lambda cls, v, info: _needs(v, info, "logprobs")))
