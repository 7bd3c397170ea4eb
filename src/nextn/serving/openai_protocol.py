"""The OpenAI API's request and response bodies (the subset `nextn serve` implements), as pydantic models.

Shapes follow the OpenAI API reference (completions, chat completions, models, streaming chunks) and
TensorRT-LLM's `trtllm-serve` protocol module. Requests are strict: an unknown field is an error that names it,
scalars are not coerced from other JSON types ("5" is not a number), and features nextn does not implement
(`echo`, `best_of` > 1, `suffix`, images) are refused with a message instead of being silently ignored.
Extras beyond OpenAI's fields, as in vLLM and TensorRT-LLM: `top_k`, `ignore_eos`, `stop_token_ids`,
`repetition_penalty`, `min_tokens`, `guided_json` / `guided_regex` / `guided_choice` / `guided_grammar`.
Every field is bounded before it reaches the engine: integers to their range (token ids and counts to int32,
`seed` to [0, 2**63)), floats finite, token-id prompts lists of real integers (not floats or bools), text valid
Unicode (no lone surrogates such as "\\ud800", which no tokenizer can encode), names and stop strings short.
Limits that depend on the engine (vocabulary, max_seq_len, prompt characters) are checked by the server.
Refusals are `APIError`s, rendered as OpenAI's error body {"error": {"message", "type", "param", "code"}};
`validation_error` turns pydantic's errors into one such message naming every bad field.
"""

from __future__ import annotations

import re
import time
import uuid
from typing import Annotated, Any, Literal

from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from pydantic import (BaseModel, ConfigDict, Field, StrictBool, StrictInt, StrictStr, ValidationError, field_validator,
                      model_serializer)

from nextn.runtime.tokenizer import check_template_kwargs
from nextn.serving.openai_tools import MAX_TOOLS, Tool, ToolCall, ToolChoice
from nextn.serving.request_fields import (INT32_MAX, MAX_STOP_TOKEN_IDS, Finite, Name, StopText, Text, TokenCount,
                                          TokenId, check_prompt, short)

MAX_N = 16  # choices per request (each its own engine request)
Penalty = Annotated[Finite, Field(ge=-2, le=2)]

class _Request(BaseModel):
    model_config = ConfigDict(extra="forbid")


class StreamOptions(_Request):
    include_usage: StrictBool = False  # one more chunk before [DONE]: empty choices, the request's usage


class JsonSchemaFormat(_Request):
    name: Name = "response"
    description: Text | None = None
    schema_: dict[str, Any] = Field(default_factory=dict, alias="schema")  # {}: any JSON value
    strict: StrictBool | None = None


class ResponseFormat(_Request):
    """`response_format`: free text, one JSON object, or JSON that validates against `json_schema.schema`."""

    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None


class _SamplingRequest(_Request):
    """Fields shared by /v1/completions and /v1/chat/completions."""

    model: Name | None = None  # the served model name (GET /v1/models); omitted = the one model served
    max_tokens: TokenCount | None = None  # omitted: 16 (completions) / to max_seq_len (chat)
    temperature: Annotated[Finite, Field(ge=0, le=2)] | None = None  # omitted or 0 = greedy (trtllm-serve)
    top_p: Annotated[Finite, Field(gt=0, le=1)] | None = None  # nucleus mass; omitted = 1 (off)
    top_k: Annotated[StrictInt, Field(ge=0, le=INT32_MAX)] | None = None  # extra: k most likely (0 = off; ≤ vocab)
    seed: Annotated[StrictInt, Field(ge=0, lt=2**63)] | None = None  # same seed, same output
    stop: list[StopText] = Field(default_factory=list)  # ≤ 4; a string, a list, or null in the request
    stop_token_ids: list[TokenId] | None = Field(default=None, max_length=MAX_STOP_TOKEN_IDS)  # extra: end tokens
    ignore_eos: StrictBool = False  # extra: keep going past EOS (benchmarks)
    n: Annotated[StrictInt, Field(ge=1, le=MAX_N)] = 1  # choices per prompt, each its own seed stream
    stream: StrictBool = False
    stream_options: StreamOptions | None = None
    user: Name | None = None  # accepted and ignored
    presence_penalty: Penalty = 0.0
    frequency_penalty: Penalty = 0.0
    repetition_penalty: Annotated[Finite, Field(ge=0.01, le=100)] | None = None  # extra (vLLM): 1 = off
    min_tokens: Annotated[StrictInt, Field(ge=0, le=INT32_MAX)] = 0  # extra (vLLM)
    logit_bias: dict[str, Annotated[Finite, Field(ge=-100, le=100)]] | None = Field(default=None, max_length=1024)
    response_format: ResponseFormat | None = None
    guided_json: dict[str, Any] | StrictStr | None = None  # extras (vLLM): one grammar at most
    guided_regex: StrictStr | None = None
    guided_choice: list[Text] | None = Field(default=None, min_length=1, max_length=256)
    guided_grammar: StrictStr | None = None

    @field_validator("logit_bias")
    @classmethod
    def _bias_keys(cls, v: dict | None) -> dict | None:
        for k in v or {}:
            if not k.isdigit() or int(k) > INT32_MAX:
                raise ValueError(f"logit_bias keys are token ids as strings (\"42\"), got {short(k)}")
        return v

    @field_validator("stop", mode="before")
    @classmethod
    def _stop_list(cls, v: object) -> object:
        return [] if v is None else [v] if isinstance(v, str) else v

    @field_validator("stop")
    @classmethod
    def _stop(cls, v: list[str]) -> list[str]:
        if len(v) > 4 or not all(v):
            raise ValueError("stop takes at most 4 non-empty strings")
        return v


class CompletionRequest(_SamplingRequest):
    """POST /v1/completions: a prompt as text, token ids, or a list of either (n choices each)."""

    prompt: str | list[int] | list[str] | list[list[int]]  # checked by `_prompt` (one clear message)
    echo: Literal[False] = False  # echoing the prompt is not supported
    logprobs: Annotated[StrictInt, Field(ge=0, le=5)] | None = None  # OpenAI's legacy bound: top 5
    best_of: Literal[1] | None = None
    suffix: None = None

    @field_validator("prompt", mode="plain")
    @classmethod
    def _prompt(cls, v: object) -> str | list[int] | list[str] | list[list[int]]:
        return check_prompt(v)


class TextPart(_Request):
    type: Literal["text"]
    text: Text


class ChatMessage(_Request):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: Text | list[TextPart] | None = None  # text parts are joined; images are not supported
    name: Name | None = None
    tool_calls: list[ToolCall] | None = Field(default=None, max_length=MAX_TOOLS)  # an assistant's earlier calls
    tool_call_id: Name | None = None  # a tool result: the call it answers

    def text(self) -> str:
        if isinstance(self.content, list):
            return "".join(p.text for p in self.content)
        return self.content or ""


class ChatCompletionRequest(_SamplingRequest):
    """POST /v1/chat/completions: the messages are rendered with the tokenizer's chat template."""

    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: TokenCount | None = None  # OpenAI's newer name for max_tokens
    logprobs: StrictBool = False
    top_logprobs: Annotated[StrictInt, Field(ge=0, le=20)] | None = None  # with logprobs: true
    tools: list[Tool] | None = Field(default=None, max_length=MAX_TOOLS)
    tool_choice: ToolChoice | None = None  # default: "auto" with tools, "none" without
    parallel_tool_calls: StrictBool = True
    # more names for the chat template, as vLLM's (Qwen3: {"enable_thinking": false}); checked before any render
    chat_template_kwargs: dict[str, Any] | None = None

    @field_validator("chat_template_kwargs")
    @classmethod
    def _template_kwargs(cls, v: dict | None) -> dict | None:
        return check_template_kwargs(v) or None


# Responses ------------------------------------------------------------------------------------------------------
def _id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


class UsageInfo(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int


FinishReason = Literal["stop", "length", "tool_calls"]


class CompletionLogprobs(BaseModel):
    """The legacy completions shape: per token its text, log-probability, the top tokens and the text offset."""

    tokens: list[str] = Field(default_factory=list)
    token_logprobs: list[float] = Field(default_factory=list)
    top_logprobs: list[dict[str, float]] = Field(default_factory=list)
    text_offset: list[int] = Field(default_factory=list)


class TopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int]


class TokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob]


class ChatLogprobs(BaseModel):
    content: list[TokenLogprob]


class CompletionChoice(BaseModel):
    index: int
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: FinishReason | None = None


class CompletionResponse(BaseModel):
    id: str = Field(default_factory=lambda: _id("cmpl"))
    object: Literal["text_completion"] = "text_completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[CompletionChoice]
    usage: UsageInfo | None = None


class AssistantMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str | None
    tool_calls: list[ToolCall] | None = None

    @model_serializer
    def _set_fields(self) -> dict[str, Any]:
        out: dict[str, Any] = {"role": self.role, "content": self.content}
        if self.tool_calls:
            out["tool_calls"] = [c.model_dump() for c in self.tool_calls]
        return out


class ChatChoice(BaseModel):
    index: int
    message: AssistantMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: FinishReason | None = None


class ChatCompletionResponse(BaseModel):
    id: str = Field(default_factory=lambda: _id("chatcmpl"))
    object: Literal["chat.completion"] = "chat.completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[ChatChoice]
    usage: UsageInfo


class DeltaMessage(BaseModel):
    """A chat stream delta: only the fields that are set ({"role": "assistant", "content": ""} first, then text)."""

    role: Literal["assistant"] | None = None
    content: str | None = None
    tool_calls: list[dict[str, Any]] | None = None  # OpenAI's streamed calls: index, id, type, function

    @model_serializer
    def _set_fields(self) -> dict[str, Any]:
        return {k: v for k, v in (("role", self.role), ("content", self.content), ("tool_calls", self.tool_calls))
                if v is not None}


class ChatStreamChoice(BaseModel):
    index: int
    delta: DeltaMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: FinishReason | None = None


class ChatCompletionChunk(BaseModel):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str
    choices: list[ChatStreamChoice]
    usage: UsageInfo | None = None


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int = Field(default_factory=lambda: int(time.time()))
    owned_by: str = "nextn"
    max_model_len: int  # max_seq_len: prompt plus completion tokens


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


class ErrorInfo(BaseModel):
    message: str
    type: str = "invalid_request_error"
    param: str | None = None
    code: str | None = None


class ErrorResponse(BaseModel):
    """OpenAI's error body: {"error": {"message", "type", "param", "code"}}."""

    error: ErrorInfo


# Errors ---------------------------------------------------------------------------------------------------------
UNSUPPORTED_FIELDS = {"echo", "best_of", "suffix"}
_UNION_TAG = re.compile(r"^(str|int|float|bool|none|list\[.*\]|dict\[.*\]|function-.*)$")  # pydantic union members


class APIError(Exception):
    """A request the server refuses: HTTP status, a message naming the problem and the fix, the field.

    The message is made valid Unicode (lone surrogates from the request escaped), so the body always encodes.
    """

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None,
                 type_: str = "invalid_request_error") -> None:
        message = message.encode("utf-8", "backslashreplace").decode("utf-8")
        super().__init__(message)
        self.status, self.info = status, ErrorInfo(message=message, type=type_, param=param, code=code)

    def response(self, headers: dict[str, str] | None = None) -> JSONResponse:
        return JSONResponse(ErrorResponse(error=self.info).model_dump(), status_code=self.status, headers=headers)


MAX_FIELDS_NAMED = 5  # fields one validation message lists; the rest are counted


def validation_error(exc: RequestValidationError | ValidationError) -> APIError:
    """Pydantic's request validation errors as one OpenAI error: each field, what is wrong, how to fix it."""
    by_field: dict[str, tuple[list[str], str]] = {}  # field → (what is wrong, the value sent)
    for err in exc.errors():
        if err["type"] == "json_invalid":
            detail = err.get("ctx", {}).get("error", err["msg"])
            return APIError(400, f"malformed JSON body ({detail}): send one JSON object", code="invalid_json")
        if err["type"] == "model_type" and len(err["loc"]) <= 1:
            return APIError(400, f"the body is {short(err['input'])}, not a JSON object: send one JSON object with "
                            "the request's fields", code="invalid_json")
        loc = [short(x) for x in err["loc"][1 if isinstance(exc, RequestValidationError) else 0:]
               if not _UNION_TAG.match(str(x))]  # drop "body" and union members
        if err["type"] == "extra_forbidden":
            msg = "unknown or unsupported field: remove it (nextn serve implements the OpenAI fields in its docs)"
        elif loc and loc[0] in UNSUPPORTED_FIELDS:
            msg = "not supported by nextn serve: omit it"
        else:
            msg = err["msg"].removeprefix("Value error, ")
        got = "" if err["type"] in ("missing", "value_error", "extra_forbidden") else f" (got {short(err['input'])})"
        msgs, _ = by_field.setdefault(".".join(loc) or "body", ([], got))
        if msg not in msgs:
            msgs.append(msg)
    named = list(by_field.items())[:MAX_FIELDS_NAMED]
    message = "; ".join(f"{f}: {' or '.join(m)}{got}" for f, (m, got) in named)
    if len(by_field) > len(named):
        message += f"; and {len(by_field) - len(named)} more fields"
    first = next(iter(by_field), "body")
    return APIError(400, f"invalid request: {message}", first.split(".")[0])
