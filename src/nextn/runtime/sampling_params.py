"""`SamplingParams`, in the shape of TensorRT-LLM's and vLLM's, validated at the edge.

Every field is checked for its type and its real range when the object is made, so that a bad value is a named
error at the API boundary instead of a failure inside an engine step: ints must be Python ints (not bool, float or
numpy scalars), floats finite and in range, every size bounded. What depends on the engine (`top_k` and token ids
against the vocabulary, `max_tokens` against max_seq_len) is checked by `check_for_engine`, which the engine calls
when the request is made (`runtime/request_validation.py`).
"""

from __future__ import annotations

import math
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

#: Bounds (inclusive). Token ids and counts fit int32; seeds int64.
MAX_INT32 = 2**31 - 1
MAX_SEED = 2**63 - 1
MIN_TEMPERATURE = 1e-6  # below (and above 0): logits / temperature overflows fp32 — use 0 for greedy
MAX_TEMPERATURE = 1e6  # above: the distribution is uniform in fp32 anyway
MIN_TOP_P = 1e-6  # below: fp32 rounds the nucleus to nothing
MAX_STOP_TOKEN_IDS = 1024
MAX_N = 16  # sequences per request (each its own request in the engine)
MAX_LOGPROBS = 20  # OpenAI's top_logprobs bound
MAX_LOGIT_BIAS = 1024  # entries of logit_bias
MAX_GRAMMAR_CHARS = 65536  # a JSON schema, regex or EBNF grammar, as text


class SamplingParamsError(ValueError):
    """An invalid sampling parameter; the message names it and the valid range."""


def _type_name(v: Any) -> str:
    t = type(v)
    return t.__name__ if t.__module__ == "builtins" else f"{t.__module__}.{t.__qualname__}"


def check_int(name: str, v: Any, lo: int, hi: int) -> int:
    """`v` if it is a Python int (bool excluded) in [lo, hi]; else ValueError naming `name` and the range."""
    if type(v) is not int:
        hint = " (convert it with int())" if hasattr(v, "__index__") and not isinstance(v, bool) else ""
        raise ValueError(f"{name} must be an int, got {_type_name(v)} {v!r:.40}{hint}")
    if v < lo:
        raise ValueError(f"{name} must be ≥ {lo}, got {v}")
    if v > hi:
        raise ValueError(f"{name} must be in [{lo}, {hi}], got {v}")
    return v


def _check_float(name: str, v: Any, lo: float, hi: float) -> float:
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        raise ValueError(f"{name} must be a number (int or float), got {_type_name(v)} {v!r:.40}")
    try:
        f = float(v)
    except OverflowError:
        raise ValueError(f"{name} must be in [{lo}, {hi}], got an int too large for a float") from None
    if not math.isfinite(f):
        raise ValueError(f"{name} must be finite, got {f}")
    if f < lo:
        raise ValueError(f"{name} must be ≥ {lo:g}, got {f:g}")
    if f > hi:
        raise ValueError(f"{name} must be in [{lo:g}, {hi:g}], got {f:g}")
    return f


class GuidedDecodingParams(BaseModel):
    """A grammar every output token must keep to (TensorRT-LLM's `GuidedDecodingParams`); exactly one field set.

    Attributes:
        json_schema (`json=` when made): a JSON Schema (dict, or its JSON text): the output is one JSON value that validates against it.
        json_object: True: the output is one JSON object (OpenAI's `response_format: {"type": "json_object"}`).
        regex: the output matches this regular expression.
        grammar: an EBNF grammar (GBNF/xgrammar syntax, start rule `root`).
        choice: the output is exactly one of these strings (vLLM's `guided_choice`).
    Compiled by xgrammar (runtime/guided_decoding.py); a grammar it cannot compile is a `SamplingParamsError` when
    the request is made. Each text is at most 65,536 characters, `choice` at most 256 strings.
    """

    model_config = ConfigDict(frozen=True, extra="forbid", populate_by_name=True)

    json_schema: dict | str | None = Field(default=None, alias="json")  # `json=` as TensorRT-LLM spells it
    json_object: bool = False
    regex: str | None = None
    grammar: str | None = None
    choice: list[str] | None = None

    def __init__(self, **kwargs) -> None:
        try:
            super().__init__(**kwargs)
        except ValidationError as e:
            raise SamplingParamsError(f"invalid GuidedDecodingParams: {e.errors()[0]['msg']}") from None
        import json as _json

        set_ = [n for n in ("json_schema", "regex", "grammar", "choice") if getattr(self, n) is not None]
        set_ += ["json_object"] if self.json_object else []
        if len(set_) != 1:
            raise SamplingParamsError(f"GuidedDecodingParams takes exactly one of json (json_schema), json_object, regex, grammar, "
                                      f"choice; got {set_ or 'none'}")
        schema = self.json_schema
        text = (_json.dumps(schema) if isinstance(schema, dict) else schema or self.regex or self.grammar
                or "".join(self.choice or []))
        if len(text) > MAX_GRAMMAR_CHARS:
            raise SamplingParamsError(f"the guided-decoding {set_[0]} is {len(text)} characters; at most "
                                      f"{MAX_GRAMMAR_CHARS} are allowed")
        if self.choice is not None and not 1 <= len(self.choice) <= 256:
            raise SamplingParamsError("guided-decoding choice takes 1 to 256 strings")

    def key(self) -> str:
        """A canonical text of the grammar (the compiled-grammar cache key)."""
        return self.model_dump_json()


class SamplingParams(BaseModel):
    """How to decode one request.

    Attributes:
        max_tokens: tokens to generate at most, in [1, 2**31 − 1]; the engine also requires ≤ max_seq_len.
        temperature: 0 = greedy (argmax); in [1e-6, 1e6] samples from softmax(logits / temperature). With
            speculative decoding, drafts are then accepted by rejection sampling, which keeps the target's
            distribution exactly.
        top_k: keep the k most likely tokens (0 = off); the engine requires ≤ its vocabulary size.
        top_p: keep the smallest set of most likely tokens whose probability reaches top_p, in [1e-6, 1]
            (1.0 = off).
        seed: the request's random seed in [0, 2**63 − 1]; same seed → same output whatever else is in the batch.
            None: drawn at submission.
        end_id: the end-of-sequence token; None = the engine's EOS. The engine requires an id in its vocabulary.
        stop_token_ids: more tokens that end the request (emitted, then stop); at most 1024, each in the vocabulary.
        ignore_eos: keep going past EOS (benchmarks: exactly `max_tokens` tokens).
        detokenize: fill `.text` when the engine has a tokenizer.
        n: sequences to generate for the prompt, in [1, 16]; each is its own request sharing the prompt's KV blocks
            through the prefix cache, sequence i seeded `seed + i` (one drawn seed when `seed` is None).
        presence_penalty, frequency_penalty: in [−2, 2], OpenAI's: a logit minus presence · [token already
            generated] minus frequency · (times generated). 0 = off.
        repetition_penalty: in [0.01, 100] (1 = off): a token already in the prompt or output has its logit divided
            by it when positive, multiplied when not (HF / vLLM).
        min_tokens: the end-of-sequence and stop tokens are masked until this many tokens are generated (≤
            max_tokens).
        logit_bias: {token id: bias in [−100, 100]} added to the logits, at most 1,024 entries.
        logprobs: None = off; k in [0, 20]: each output token's log-probability and the k most likely tokens'
            (`CompletionOutput.logprobs`), from the processed distribution (penalties, bias, grammar and
            temperature applied; before top-k / top-p).
        guided_decoding: a `GuidedDecodingParams` grammar the output keeps to.
        Every one of these is applied at each verified position from the state before it (drafts included), so
        speculative decoding stays lossless with them (speculative/logits_processing.py).
    Raises:
        SamplingParamsError (a ValueError): a field of the wrong type or out of range, or an unknown field; the
            message names each and its valid range.
    """

    model_config = ConfigDict(frozen=True, extra="forbid")

    max_tokens: int = 32
    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int | None = None
    end_id: int | None = None
    stop_token_ids: list[int] = Field(default_factory=list)
    ignore_eos: bool = False
    detokenize: bool = True
    n: int = 1
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    min_tokens: int = 0
    logit_bias: dict[int, float] = Field(default_factory=dict)
    logprobs: int | None = None
    guided_decoding: GuidedDecodingParams | None = None

    def __init__(self, **kwargs) -> None:
        try:
            super().__init__(**kwargs)
        except ValidationError as e:
            msgs = "; ".join(_message(err) for err in e.errors())
            raise SamplingParamsError(f"invalid SamplingParams: {msgs}") from None

    # Types and ranges are checked before pydantic's coercion ("mode before"), so "3", 3.0 or True never pass as 3.
    @field_validator("max_tokens", mode="before")
    @classmethod
    def _max_tokens(cls, v: Any) -> int:
        return check_int("max_tokens", v, 1, MAX_INT32)

    @field_validator("temperature", mode="before")
    @classmethod
    def _temperature(cls, v: Any) -> float:
        f = _check_float("temperature", v, 0.0, MAX_TEMPERATURE)
        if 0 < f < MIN_TEMPERATURE:
            raise ValueError(f"temperature must be 0 (greedy) or in [{MIN_TEMPERATURE:g}, {MAX_TEMPERATURE:g}], "
                             f"got {f:g}: use 0 for greedy decoding")
        return f

    @field_validator("top_k", mode="before")
    @classmethod
    def _top_k(cls, v: Any) -> int:
        return check_int("top_k (0 = off)", v, 0, MAX_INT32)

    @field_validator("top_p", mode="before")
    @classmethod
    def _top_p(cls, v: Any) -> float:
        return _check_float("top_p (1 = off)", v, MIN_TOP_P, 1.0)

    @field_validator("seed", mode="before")
    @classmethod
    def _seed(cls, v: Any) -> int | None:
        return None if v is None else check_int("seed", v, 0, MAX_SEED)

    @field_validator("end_id", mode="before")
    @classmethod
    def _end_id(cls, v: Any) -> int | None:
        return None if v is None else check_int("end_id", v, 0, MAX_INT32)

    @field_validator("stop_token_ids", mode="before")
    @classmethod
    def _stop_token_ids(cls, v: Any) -> list[int]:
        if not isinstance(v, (list, tuple)):
            raise ValueError(f"stop_token_ids must be a list of ints, got {_type_name(v)}")
        if len(v) > MAX_STOP_TOKEN_IDS:
            raise ValueError(f"stop_token_ids holds {len(v)} ids; at most {MAX_STOP_TOKEN_IDS} are allowed")
        return [check_int(f"stop_token_ids[{i}]", t, 0, MAX_INT32) for i, t in enumerate(v)]

    @field_validator("n", mode="before")
    @classmethod
    def _n(cls, v: Any) -> int:
        return check_int("n", v, 1, MAX_N)

    @field_validator("presence_penalty", "frequency_penalty", mode="before")
    @classmethod
    def _penalty(cls, v: Any, info) -> float:
        return _check_float(info.field_name, v, -2.0, 2.0)

    @field_validator("repetition_penalty", mode="before")
    @classmethod
    def _repetition(cls, v: Any) -> float:
        return _check_float("repetition_penalty (1 = off)", v, 0.01, 100.0)

    @field_validator("min_tokens", mode="before")
    @classmethod
    def _min_tokens(cls, v: Any) -> int:
        return check_int("min_tokens", v, 0, MAX_INT32)

    @field_validator("logprobs", mode="before")
    @classmethod
    def _logprobs(cls, v: Any) -> int | None:
        return None if v is None else check_int("logprobs (top tokens per position)", v, 0, MAX_LOGPROBS)

    @field_validator("logit_bias", mode="before")
    @classmethod
    def _logit_bias(cls, v: Any) -> dict[int, float]:
        if v is None:
            return {}
        if not isinstance(v, dict):
            raise ValueError(f"logit_bias must be a dict {{token id: bias}}, got {_type_name(v)}")
        if len(v) > MAX_LOGIT_BIAS:
            raise ValueError(f"logit_bias holds {len(v)} entries; at most {MAX_LOGIT_BIAS} are allowed")
        return {check_int("logit_bias token id", k, 0, MAX_INT32): _check_float(f"logit_bias[{k}]", b, -100.0, 100.0)
                for k, b in v.items()}

    @field_validator("guided_decoding", mode="before")
    @classmethod
    def _guided(cls, v: Any) -> GuidedDecodingParams | None:
        if v is None or isinstance(v, GuidedDecodingParams):
            return v
        if isinstance(v, dict):
            return GuidedDecodingParams(**v)
        raise ValueError(f"guided_decoding must be a GuidedDecodingParams or a dict, got {_type_name(v)}")

    @property
    def needs_processing(self) -> bool:
        """Whether the step must process this request's logits (penalties, bias, min_tokens or a grammar)."""
        return bool(self.presence_penalty or self.frequency_penalty or self.repetition_penalty != 1.0
                    or self.min_tokens or self.logit_bias or self.guided_decoding is not None)

    @field_validator("ignore_eos", "detokenize", mode="before")
    @classmethod
    def _bool(cls, v: Any, info) -> bool:
        if type(v) is not bool:
            raise ValueError(f"{info.field_name} must be True or False, got {_type_name(v)} {v!r:.40}")
        return v

    def check_for_engine(self, vocab_size: int, max_seq_len: int) -> None:
        """The checks that need the engine: `top_k` ≤ vocab_size, `end_id` / `stop_token_ids` in [0, vocab_size),
        `max_tokens` ≤ max_seq_len. Every field is validated again first (an object built with `model_construct`
        or `model_copy(update=...)` skips validation).

        Raises:
            SamplingParamsError: the field named, with the engine's limit.
        """
        try:
            again = SamplingParams(**{name: getattr(self, name) for name in type(self).model_fields})
        except AttributeError as e:
            raise SamplingParamsError(f"invalid SamplingParams: {e}") from None
        problems = []
        if again.top_k > vocab_size:
            problems.append(f"top_k={again.top_k} exceeds the vocabulary size {vocab_size} (use 0 to turn top-k off)")
        if again.end_id is not None and again.end_id >= vocab_size:
            problems.append(f"end_id={again.end_id} is outside the vocabulary [0, {vocab_size})")
        bad = [t for t in again.stop_token_ids if t >= vocab_size]
        if bad:
            problems.append(f"stop_token_ids {bad[:5]} are outside the vocabulary [0, {vocab_size})")
        bad = [t for t in again.logit_bias if t >= vocab_size]
        if bad:
            problems.append(f"logit_bias token ids {bad[:5]} are outside the vocabulary [0, {vocab_size})")
        if again.min_tokens > again.max_tokens:
            problems.append(f"min_tokens={again.min_tokens} exceeds max_tokens={again.max_tokens}")
        if again.max_tokens > max_seq_len:
            problems.append(f"max_tokens={again.max_tokens} exceeds max_seq_len {max_seq_len} (prompt plus output): "
                            f"lower max_tokens to at most {max_seq_len} minus the prompt length")
        if problems:
            raise SamplingParamsError("invalid SamplingParams for this engine: " + "; ".join(problems))


def _message(err: dict) -> str:
    loc = ".".join(map(str, err["loc"])) or "SamplingParams"
    if err["type"] == "extra_forbidden":
        return f"unknown field {loc!r}; valid fields: {', '.join(SamplingParams.model_fields)}"
    msg = err["msg"].removeprefix("Value error, ")
    return msg if msg.startswith(loc.split("[")[0]) else f"{loc}: {msg}"
