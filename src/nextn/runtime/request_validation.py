"""Validation of a request at the engine's edge: the prompt (text or token ids) and its `SamplingParams` against
what the engine knows (vocabulary, max_seq_len, tokenizer). Everything here runs before the request reaches the
scheduler, so a bad request is a named `RequestError` and never a failure inside an engine step.

Prompts:
- text: a non-empty `str` that is valid Unicode (no lone surrogates such as "\\ud800": they cannot be encoded as
  UTF-8), on an engine with a tokenizer; a text too long to fit in max_seq_len whatever its tokenization
  (more than max_seq_len × the longest token's bytes) is refused before it is tokenized.
- token ids: a non-empty `list` or `tuple` of Python `int` in [0, vocab_size), shorter than max_seq_len; bool,
  float, numpy scalars, `bytes` / `bytearray` and numpy arrays are refused with a hint to convert them.
"""

from __future__ import annotations

import weakref
from typing import Any

from nextn.runtime.sampling_params import SamplingParams, SamplingParamsError


class RequestError(ValueError):
    """A request that cannot run (empty, too long, ids out of vocabulary, ...); the message names the fix."""


class RequestSamplingParamsError(RequestError, SamplingParamsError):
    """SamplingParams that do not fit this engine (top_k or ids beyond the vocabulary, max_tokens > max_seq_len)."""


_MAX_TOKEN_BYTES: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def _type_name(v: Any) -> str:
    t = type(v)
    return t.__name__ if t.__module__ == "builtins" else f"{t.__module__}.{t.__qualname__}"


def max_token_bytes(tokenizer) -> int:
    """An upper bound on the UTF-8 bytes of text one token can cover (the longest vocabulary entry, in bytes of
    its stored form, which is never shorter than the text it decodes to). Cached per tokenizer."""
    try:
        return _MAX_TOKEN_BYTES[tokenizer]
    except (KeyError, TypeError):
        pass
    try:
        vocab = tokenizer.tok.get_vocab()
        longest = max((len(t.encode("utf-8", "replace")) for t in vocab), default=1)
    except Exception:  # a tokenizer without a vocabulary listing: no pre-check, tokenization decides
        longest = 1 << 30
    try:
        _MAX_TOKEN_BYTES[tokenizer] = max(longest, 1)
    except TypeError:
        pass
    return max(longest, 1)


def prompt_token_ids(prompt: Any, tokenizer, vocab_size: int, max_seq_len: int) -> tuple[str | None, list[int]]:
    """The prompt's text (None for token ids) and token ids, checked.

    Args:
        prompt: a `str`, or a list / tuple of int token ids.
        tokenizer: the engine's `EngineTokenizer`, or None (token-id prompts only).
    Raises:
        RequestError: the problem named (empty, wrong type, lone surrogate, ids outside [0, vocab_size), too long
            for max_seq_len), with the fix.
    """
    if isinstance(prompt, str):
        if not prompt:
            raise RequestError("empty prompt: give at least one character or token id")
        try:
            prompt.encode("utf-8")
        except UnicodeEncodeError as e:
            raise RequestError(f"the prompt is not valid Unicode: it holds the lone surrogate {prompt[e.start]!r} at "
                               f"character {e.start}, which no text encoding can represent; send well-formed text "
                               "(e.g. decode bytes with errors='replace')") from None
        if tokenizer is None:
            raise RequestError("this engine has no tokenizer (its checkpoint had none): pass token-id lists")
        limit = max_seq_len * max_token_bytes(tokenizer)
        if len(prompt) > limit:
            raise RequestError(f"the prompt has {len(prompt)} characters: more than max_seq_len {max_seq_len} tokens "
                               "can hold whatever its tokenization; shorten the prompt or raise max_seq_len")
        ids = list(tokenizer.encode(prompt))
        if not ids:
            raise RequestError("the prompt tokenizes to no tokens: give text the tokenizer encodes")
    elif isinstance(prompt, (bytes, bytearray, memoryview)):
        raise RequestError(f"the prompt is a {_type_name(prompt)} object: decode it to str first "
                           "(prompt.decode('utf-8')) or pass a list of int token ids")
    elif isinstance(prompt, (list, tuple)):
        if not prompt:
            raise RequestError("empty prompt: give at least one token id")
        if len(prompt) >= max_seq_len:  # before the per-id checks: a huge list is refused at once
            raise RequestError(f"prompt has {len(prompt)} tokens but max_seq_len is {max_seq_len} (prompt plus at "
                               "least one generated token): shorten the prompt or raise max_seq_len")
        for i, t in enumerate(prompt):
            if type(t) is not int:
                hint = (" (convert with int(), or .tolist() for a numpy array)"
                        if hasattr(t, "__index__") and not isinstance(t, bool) else "")
                raise RequestError(f"token ids must be Python ints: prompt[{i}] is {_type_name(t)} {t!r:.40}{hint}")
        ids = list(prompt)
        bad = [t for t in ids if not 0 <= t < vocab_size]
        if bad:
            raise RequestError(f"token ids {bad[:5]} are outside the vocabulary [0, {vocab_size})")
    else:
        hint = " (convert with .tolist())" if hasattr(prompt, "tolist") else ""
        raise RequestError(f"a prompt must be a str or a list of int token ids, got {_type_name(prompt)}{hint}")
    if len(ids) >= max_seq_len:
        raise RequestError(f"prompt has {len(ids)} tokens but max_seq_len is {max_seq_len} (prompt plus at least one "
                           "generated token): shorten the prompt or raise max_seq_len")
    return (prompt if isinstance(prompt, str) else None), ids


def checked_sampling_params(params: Any, vocab_size: int, max_seq_len: int) -> SamplingParams:
    """`params` validated again, and against the engine (`SamplingParams.check_for_engine`).

    Raises:
        RequestSamplingParamsError: not a SamplingParams, or a field out of range for this engine (named).
    """
    if not isinstance(params, SamplingParams):
        raise RequestSamplingParamsError(f"sampling_params must be a SamplingParams, got {_type_name(params)}")
    try:
        params.check_for_engine(vocab_size, max_seq_len)
    except SamplingParamsError as e:
        raise RequestSamplingParamsError(str(e)) from None
    return params
