"""Tool calls for `nextn serve`: OpenAI's `tools` / `tool_choice`, the Hermes/Qwen2.5 call format, its grammar.

The tools reach the model through its own chat template (`tools=` as transformers' `apply_chat_template` passes
them); the model answers with calls in the format Hermes and Qwen2.5 use,

    <tool_call>
    {"name": "get_weather", "arguments": {"city": "Paris"}}
    </tool_call>

which `parse_tool_calls` turns into OpenAI's `message.tool_calls` (a block that is not valid JSON with a known
name stays text). `tool_choice: "required"` or a named function is enforced by a grammar (`tool_call_grammar`):
the output is one such block whose JSON validates against the function's parameters (xgrammar's JSON-schema
grammar between the tags), so the client always gets a call it can run.
"""

from __future__ import annotations

import json
import re
import uuid
from collections.abc import Callable
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictStr

from nextn.runtime.guided_decoding import unenforced_keywords
from nextn.serving.request_fields import Name, Text

__all__ = ["Tool", "ToolChoice", "ToolCall", "parse_tool_calls", "tool_call_grammar", "TOOL_CALL_OPEN"]

TOOL_CALL_OPEN, TOOL_CALL_CLOSE = "<tool_call>", "</tool_call>"
MAX_TOOLS = 128
_BLOCK = re.compile(re.escape(TOOL_CALL_OPEN) + r"\s*(.*?)\s*" + re.escape(TOOL_CALL_CLOSE), re.S)


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class FunctionDef(_Strict):
    name: Annotated[StrictStr, Field(min_length=1, max_length=64, pattern=r"^[A-Za-z0-9_.\-]+$")]
    description: Text | None = None
    parameters: dict[str, Any] | None = None  # a JSON Schema (object); omitted: no arguments
    strict: StrictBool | None = None


class Tool(_Strict):
    type: Literal["function"] = "function"
    function: FunctionDef


class NamedFunction(_Strict):
    name: Name


class NamedToolChoice(_Strict):
    type: Literal["function"] = "function"
    function: NamedFunction


ToolChoice = Literal["none", "auto", "required"] | NamedToolChoice


class FunctionCall(BaseModel):
    name: str
    arguments: str  # JSON text, as OpenAI sends it


class ToolCall(BaseModel):
    id: str = Field(default_factory=lambda: f"call_{uuid.uuid4().hex[:24]}")
    type: Literal["function"] = "function"
    function: FunctionCall


def _call_schema(fn: FunctionDef) -> dict:
    args = fn.parameters or {"type": "object", "properties": {}}
    return {"type": "object", "properties": {"name": {"const": fn.name}, "arguments": args},
            "required": ["name", "arguments"], "additionalProperties": False}


def tool_call_grammar(tools: list[Tool], choice: ToolChoice | None,
                      convert: Callable[[dict, str, str], str]) -> str | None:
    """The EBNF grammar (xgrammar syntax) that `choice` enforces: "required" — one call of any tool, a named
    function — one call of it; None for "auto" / "none" / no tools.

    Args:
        convert: (schema, open tag, close tag) → the EBNF of the tags around one compact JSON value valid against the
            schema; the engine's `tool_call_ebnf`, which runs xgrammar's conversion in a grammar worker under its
            time budget (a `pattern` such as `[a-z]{2000,10000}` takes seconds to minutes to convert).
    Raises:
        ValueError: a named function that is not among `tools`; a tool whose parameters the grammar would not enforce
            (`unenforced_keywords`). Whatever `convert` raises (the engine: RequestSamplingParamsError).
    """
    if not tools or choice is None or choice in ("auto", "none"):
        return None
    if isinstance(choice, NamedToolChoice):
        chosen = [t.function for t in tools if t.function.name == choice.function.name]
        if not chosen:
            raise ValueError(f"tool_choice names the function {choice.function.name!r}, which is not among the "
                             f"tools ({', '.join(t.function.name for t in tools)})")
    else:
        chosen = [t.function for t in tools]
    schema = _call_schema(chosen[0]) if len(chosen) == 1 else {"anyOf": [_call_schema(f) for f in chosen]}
    unenforced = unenforced_keywords(schema)
    if unenforced:
        raise ValueError("the tools' parameters use what the grammar cannot enforce: " + "; ".join(unenforced[:5]))
    return convert(schema, TOOL_CALL_OPEN + "\n", "\n" + TOOL_CALL_CLOSE)


_FENCED = re.compile(r"^\s*(?:```(?:json)?\s*)?(\{.*\})\s*(?:```)?\s*$", re.S)


def parse_tool_calls(text: str, tools: list[Tool]) -> tuple[str | None, list[ToolCall]]:
    """(the text outside the calls, or None when nothing but calls; the calls) of a model's answer. A block that is
    not JSON {"name": <one of the tools>, "arguments": {...}} is kept as text. An answer that is nothing but one
    such JSON object (bare or in a ```json fence, as small Qwen2.5 models write a call) is a call too."""
    names = {t.function.name for t in tools}
    if TOOL_CALL_OPEN not in text:
        m = _FENCED.match(text)
        obj = _call_object(m.group(1), names) if m else None
        if obj is not None:
            return None, [_tool_call(obj)]
        return text, []
    calls, kept, last = [], [], 0
    for m in _BLOCK.finditer(text):
        obj = _call_object(m.group(1), names)
        if obj is None:
            continue
        kept.append(text[last:m.start()])
        last = m.end()
        calls.append(_tool_call(obj))
    kept.append(text[last:])
    content = "".join(kept).strip()
    return (content or None) if calls else text, calls


def _call_object(raw: str, names: set[str]) -> dict | None:
    try:
        obj = json.loads(raw)
    except json.JSONDecodeError:
        return None
    ok = isinstance(obj, dict) and obj.get("name") in names and isinstance(obj.get("arguments", {}), dict)
    return obj if ok else None


def _tool_call(obj: dict) -> ToolCall:
    return ToolCall(function=FunctionCall(name=obj["name"], arguments=json.dumps(obj.get("arguments", {}),
                                                                                 ensure_ascii=False)))


def open_tool_call(text: str) -> int:
    """Where tool calls may begin in streamed text: the index of the first `<tool_call>`, or of a suffix that could
    grow into one (text from there is held back until the choice ends); len(text) when none. An answer that opens
    with `{` or a code fence may be a bare call (`parse_tool_calls`): all of it is held back."""
    i = text.find(TOOL_CALL_OPEN)
    if i >= 0:
        return i
    head = text.lstrip()
    if head.startswith(("{", "```")) or (head and "```".startswith(head)):
        return 0
    for k in range(min(len(TOOL_CALL_OPEN) - 1, len(text)), 0, -1):
        if TOOL_CALL_OPEN.startswith(text[-k:]):
            return len(text) - k
    return len(text)


def message_for_template(role: str, content: str | None, tool_calls: list[ToolCall] | None,
                         tool_call_id: str | None, name: str | None, arguments_as_text: bool = False) -> dict:
    """A chat message as chat templates expect it: an assistant's calls with their arguments as objects
    (transformers' convention; as the JSON text with `arguments_as_text`), a tool result with its call id."""
    msg: dict[str, Any] = {"role": role, "content": content}
    if tool_calls:
        msg["tool_calls"] = [{"type": "function", "id": c.id, "function": {
            "name": c.function.name,
            "arguments": c.function.arguments if arguments_as_text else _loads_or_text(c.function.arguments)}}
            for c in tool_calls]
    if tool_call_id:
        msg["tool_call_id"] = tool_call_id
    if name:
        msg["name"] = name
    return msg


def _loads_or_text(arguments: str) -> Any:
    try:
        return json.loads(arguments)
    except json.JSONDecodeError:
        return arguments
