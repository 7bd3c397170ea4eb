"""Bounded types and checks for the fields of requests to `nextn serve` (used by `openai_protocol`).

Integers bounded to their range (token ids and counts to int32), floats finite, text valid Unicode (no lone UTF-16
surrogates, which JSON's "\\ud800" escapes can carry and no tokenizer can encode), names and stop strings short,
token-id prompts lists of real integers (not floats or bools). Each check raises ValueError with a message that
names the problem and the fix; pydantic turns it into the field's error.
"""

from __future__ import annotations

from typing import Annotated

from pydantic import AfterValidator, Field, StrictFloat, StrictInt, StrictStr

INT32_MAX = 2**31 - 1  # bound of token ids and token counts (the engine's tensors are int32/int64)
MAX_NAME_CHARS = 256  # model, user, message name
MAX_STOP_CHARS = 256  # one stop string
MAX_STOP_TOKEN_IDS = 256
MAX_PROMPTS = 128  # prompts in one /v1/completions request (each becomes one engine request)


def check_unicode(text: str) -> str:
    """`text` if it is valid Unicode, i.e. encodable as UTF-8.

    Raises:
        ValueError: a lone UTF-16 surrogate (JSON "\\ud800" without its pair), naming where it is.
    """
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        raise ValueError(f"contains a lone UTF-16 surrogate {text[e.start]!r} at character {e.start}, which is not "
                         "valid Unicode: send real characters (in JSON, \\ud800-\\udfff escapes only as "
                         "high+low pairs)") from None
    return text


Text = Annotated[StrictStr, AfterValidator(check_unicode)]
Name = Annotated[StrictStr, Field(max_length=MAX_NAME_CHARS), AfterValidator(check_unicode)]
StopText = Annotated[StrictStr, Field(max_length=MAX_STOP_CHARS), AfterValidator(check_unicode)]
TokenId = Annotated[StrictInt, Field(ge=0, le=INT32_MAX)]
TokenCount = Annotated[StrictInt, Field(ge=1, le=INT32_MAX)]
Finite = Annotated[StrictFloat, Field(allow_inf_nan=False)]


_PROMPT_FORMS = ("prompt must be a string, a list of token ids (integers in [0, vocabulary size)), a list of strings, "
                 "or a list of token-id lists")


def short(x: object, chars: int = 40) -> str:
    """`x` as text for an error message: at most `chars` characters, lone surrogates escaped."""
    text = x if isinstance(x, str) else repr(x)
    if len(text) > chars:
        text = f"{text[:chars]}… ({len(text)} characters)"
    return text.encode("utf-8", "backslashreplace").decode("utf-8")


def _kind(x: object) -> str:
    return {bool: "a bool", float: "a float", int: "an integer", str: "a string", list: "a list", dict: "an object",
            type(None): "null"}.get(type(x), type(x).__name__)


def check_prompt(v: object) -> str | list[int] | list[str] | list[list[int]]:
    """A completions prompt in one of OpenAI's four forms, with real integers (not floats or bools) as token ids.

    Raises:
        ValueError: another type, an empty list, a bad element (its index and type named), more than MAX_PROMPTS
            prompts, a token id outside [0, 2**31), or text that is not valid Unicode.
    """
    if isinstance(v, str):
        return check_unicode(v)
    if not isinstance(v, list) or not v:
        raise ValueError(f"{_PROMPT_FORMS}; got {'an empty list' if v == [] else _kind(v)}")

    def ids(xs: list, where: str) -> list[int]:
        for i, x in enumerate(xs):
            if type(x) is not int or not 0 <= x <= INT32_MAX:
                what = short(x) if type(x) is int else _kind(x)
                raise ValueError(f"{where}[{i}] is {what}, not a token id: token ids are integers in [0, vocabulary "
                                 "size), written without a decimal point")
        return xs

    first = type(v[0])
    if first is int or first is bool or first is float:
        return ids(v, "prompt")
    if len(v) > MAX_PROMPTS:
        raise ValueError(f"{len(v)} prompts in one request; at most {MAX_PROMPTS}: send them as several requests")
    for i, x in enumerate(v):
        if type(x) is not first:
            raise ValueError(f"prompt[{i}] is {_kind(x)} but prompt[0] is {_kind(v[0])}: a list of prompts holds "
                             "either strings or token-id lists")
        if first is str:
            try:
                check_unicode(x)
            except ValueError as e:
                raise ValueError(f"prompt[{i}] {e}") from None
        elif first is list:
            if not x:
                raise ValueError(f"prompt[{i}] is an empty list: give at least one token id")
            ids(x, f"prompt[{i}]")
        else:
            raise ValueError(f"{_PROMPT_FORMS}; prompt[0] is {_kind(x)}")
    return v
