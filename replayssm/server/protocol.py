"""OpenAI-compatible request/response schemas and the OpenAI error body.

Requests validate strictly (a string where a number belongs is a 400, not a silent coercion);
unknown fields are ignored so that tools sending extra OpenAI options keep working. Range checks
live in `check_sampling` so that each error names the offending parameter, as OpenAI does.
"""

from __future__ import annotations

import itertools
import re
import time
import uuid
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationInfo, field_validator

from replayssm.sampling_params import check_structured

# OpenAI caps n at 128; a larger fan-out would only let one request starve the others.
MAX_N = 128


class APIError(Exception):
    """A user-facing error turned into an OpenAI error body with this HTTP status."""

    def __init__(self, status_code: int, message: str, *, param: str | None = None,
                 code: str | None = None, type: str = "invalid_request_error"):
        super().__init__(message)
        self.status_code = status_code
        self.message = message
        self.param = param
        self.code = code
        self.type = type


class ErrorInfo(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: str | None = None


class ErrorResponse(BaseModel):
    error: ErrorInfo

    @classmethod
    def from_api_error(cls, err: APIError) -> ErrorResponse:
        return cls(error=ErrorInfo(message=err.message, type=err.type, param=err.param, code=err.code))


class _Request(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")


class StreamOptions(_Request):
    include_usage: bool = False


class SamplingRequest(_Request):
    """Fields shared by /v1/completions and /v1/chat/completions."""

    model: str
    max_tokens: int | None = None
    # None: the checkpoint's generation_config.json default, else OpenAI's (SamplingParams').
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None  # extension: 0 or -1 disables top-k
    min_p: float | None = None  # extension (vLLM)
    repetition_penalty: float | None = None  # extension (vLLM)
    n: int = 1
    stop: str | list[str] | None = None
    seed: int | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    ignore_eos: bool = False  # extension, for benchmarks that need exact lengths
    return_token_ids: bool = False  # extension: choices carry the generated token ids
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: dict[str, float] | None = None  # {token id as a string: bias in [-100, 100]}
    # Extensions (vLLM's names and meanings): see SamplingParams.
    min_tokens: int = 0
    stop_token_ids: list[int] | None = None
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    user: str | None = None
    response_format: dict[str, Any] | None = None
    # Extension, vLLM's spelling: {"regex": ...}, {"json": schema} or {"json_object": true}.
    structured_outputs: dict[str, Any] | None = None


class CompletionRequest(SamplingRequest):
    prompt: str | list[str] | list[int] | list[list[int]]
    logprobs: int | None = None
    echo: bool = False
    suffix: str | None = None
    best_of: int | None = None

    def prompts(self) -> list[str | list[int]]:
        """The prompt field normalized to a non-empty list of prompts (text or token ids)."""
        p = self.prompt
        if isinstance(p, str) or (p and isinstance(p[0], int)):
            p = [p]
        if not p or any(len(x) == 0 for x in p):
            raise APIError(400, "prompt must be non-empty", param="prompt")
        return list(p)


class TextPart(_Request):
    type: Literal["text"]
    text: str


class ChatMessage(_Request):
    role: Literal["system", "user", "assistant", "developer", "tool"]
    content: str | list[TextPart] | None = Field(default=None, validate_default=True)
    name: str | None = None

    @field_validator("content", mode="before")
    @classmethod
    def _text_only(cls, content: Any, info: ValidationInfo) -> Any:
        """Content is required except from the assistant, and only text parts are understood."""
        if content is None and info.data.get("role", "assistant") != "assistant":
            raise ValueError(f"a {info.data['role']} message needs content")
        for part in content if isinstance(content, list) else ():
            kind = part.get("type") if isinstance(part, dict) else type(part).__name__
            if kind != "text":
                raise ValueError(f"content parts of type {kind!r} are not supported (text parts only)")
        return content

    def as_template_dict(self) -> dict[str, str]:
        content = self.content
        if isinstance(content, list):
            content = "".join(part.text for part in content)
        return {"role": self.role, "content": content or ""}


class ChatCompletionRequest(SamplingRequest):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None
    tools: list[Any] | None = None
    tool_choice: Any = None
    chat_template_kwargs: dict[str, Any] | None = None  # extra variables for the chat template (vLLM)


def logit_bias_ids(req: SamplingRequest) -> dict[int, float] | None:
    """logit_bias with its keys (token ids sent as JSON strings) as ints; APIError naming logit_bias."""
    if not req.logit_bias:
        return None
    try:
        return {int(k): v for k, v in req.logit_bias.items()}
    except ValueError:
        raise APIError(400, f"logit_bias keys must be token ids, got {list(req.logit_bias)[:5]}",
                       param="logit_bias") from None


def check_sampling(req: SamplingRequest, max_tokens: int | None) -> None:
    """Range checks OpenAI makes before generating; raises APIError naming the parameter."""
    if max_tokens is not None and max_tokens <= 0:
        raise APIError(400, f"max_tokens must be at least 1, got {max_tokens}", param="max_tokens")
    if not 1 <= req.n <= MAX_N:
        raise APIError(400, f"n must be in [1, {MAX_N}], got {req.n}", param="n")
    if req.temperature is not None and not 0.0 <= req.temperature <= 2.0:
        raise APIError(400, f"temperature must be in [0, 2], got {req.temperature}", param="temperature")
    # The other sampling fields are range-checked by SamplingParams (serving.build_requests), whose
    # errors name the field.
    stops = [req.stop] if isinstance(req.stop, str) else (req.stop or [])
    if len(stops) > 4 or any(s == "" for s in stops):
        raise APIError(400, "stop must be up to 4 non-empty strings", param="stop")


def structured_of(req: SamplingRequest) -> tuple[dict[str, Any] | None, str]:
    """SamplingParams.structured for the request's response_format or structured_outputs (None:
    free text), and the field it came from; raises APIError naming that field."""
    fmt = req.response_format
    kind = None if fmt is None else fmt.get("type")
    if fmt is not None and kind not in ("text", "json_object", "json_schema"):
        raise APIError(400, 'response_format type must be "text", "json_object" or "json_schema", '
                       f"got {kind!r}", param="response_format")
    if kind in ("json_object", "json_schema") and req.structured_outputs is not None:
        raise APIError(400, "set response_format or structured_outputs, not both", param="structured_outputs")
    if kind == "json_object":
        return {"json_object": True}, "response_format"
    if kind == "json_schema":
        schema = fmt.get("json_schema")
        schema = schema.get("schema") if isinstance(schema, dict) else None
        if not isinstance(schema, dict):
            raise APIError(400, 'response_format of type "json_schema" needs json_schema.schema, an object',
                           param="response_format")
        return {"json": schema}, "response_format"
    if req.structured_outputs is None:
        return None, "structured_outputs"
    try:
        return check_structured(req.structured_outputs, "structured_outputs"), "structured_outputs"
    except ValueError as exc:
        raise APIError(400, str(exc), param="structured_outputs") from exc


# Ids need only be unique per server; one random prefix plus a counter avoids an
# os.urandom call per request (measurable at hundreds of requests per second).
_ID_PREFIX = uuid.uuid4().hex[:12]
_id_counter = itertools.count()


def new_id(prefix: str) -> str:
    return f"{prefix}-{_ID_PREFIX}{next(_id_counter):08x}"


def now_s() -> int:
    return int(time.time())


class PromptTokensDetails(BaseModel):
    cached_tokens: int = 0


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails


class CompletionLogprobs(BaseModel):
    tokens: list[str]
    token_logprobs: list[float]
    top_logprobs: list[dict[str, float]] | None = None
    text_offset: list[int]


class CompletionChoice(BaseModel):
    index: int
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: str | None = None
    token_ids: list[int] | None = None  # only with return_token_ids (new ones, when streaming)


class CompletionResponse(BaseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage | None = None


class TopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int]


class ChatTokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob] = []


class ChatLogprobs(BaseModel):
    content: list[ChatTokenLogprob]


class ChatResponseMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str


class ChatChoice(BaseModel):
    index: int
    message: ChatResponseMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None
    token_ids: list[int] | None = None


class ChatCompletionResponse(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int
    model: str
    choices: list[ChatChoice]
    usage: Usage


class ChatDelta(BaseModel):
    role: Literal["assistant"] | None = None
    content: str | None = None


class ChatChunkChoice(BaseModel):
    index: int
    delta: ChatDelta
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None
    token_ids: list[int] | None = None


class ChatCompletionChunk(BaseModel):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str
    choices: list[ChatChunkChoice]
    usage: Usage | None = None


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str = "replayssm"
    max_model_len: int


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


class TokenizeCompletionRequest(_Request):
    """POST /tokenize with a prompt (vLLM's field names)."""

    model: str | None = None
    prompt: str
    add_special_tokens: bool = True
    return_token_strs: bool = False


class TokenizeChatRequest(_Request):
    """POST /tokenize with chat messages, rendered by the checkpoint's chat template."""

    model: str | None = None
    messages: list[ChatMessage] = Field(min_length=1)
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    add_special_tokens: bool = False  # the template spells out BOS and the like itself
    return_token_strs: bool = False


class TokenizeResponse(BaseModel):
    count: int
    max_model_len: int
    tokens: list[int]
    token_strs: list[str] | None = None


class DetokenizeRequest(_Request):
    model: str | None = None
    tokens: list[int]


class DetokenizeResponse(BaseModel):
    prompt: str


class VersionResponse(BaseModel):
    version: str


# A lone surrogate reaches a parsed body only through a JSON escape (raw UTF-8 cannot encode one), so
# bodies without such an escape skip the walk over every string.
_SURROGATE_ESCAPE = re.compile(rb"\\u[dD][89a-fA-F]")


def check_text(body: bytes, data: Any) -> None:
    """Raise a 400 naming the first string of `data` (parsed from `body`) that is not valid Unicode:
    a lone surrogate such as "\\ud800" cannot be encoded, so a tokenizer or a response would fail on it."""
    if _SURROGATE_ESCAPE.search(body) is None:
        return
    path = _unencodable(data, ())
    if path is not None:
        where = ".".join(str(p) for p in path) or "body"
        raise APIError(400, f"{where}: text is not valid Unicode (a lone surrogate such as \\ud800); "
                       "send UTF-8 text", param=where if path else None)


def _unencodable(value: Any, path: tuple) -> tuple | None:
    """The path of the first string in `value` that UTF-8 cannot encode, or None."""
    if isinstance(value, str):
        try:
            value.encode("utf-8")
        except UnicodeEncodeError:
            return path
        return None
    items = value.items() if isinstance(value, dict) else enumerate(value) if isinstance(value, list) else ()
    for key, item in items:
        if isinstance(key, str) and _unencodable(key, ()) is not None:
            return path  # a bad key: name the object that holds it
        found = _unencodable(item, (*path, key))
        if found is not None:
            return found
    return None
