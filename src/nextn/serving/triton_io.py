"""Triton request parsing and response tensors for nextn's Python-backend model, in TensorRT-LLM's names.

Plain numpy in and out, no `triton_python_backend_utils`: `model.py` (`triton_model.py`) stays a thin adapter and this
module is unit-tested without a server. Names, dtypes and dims follow TensorRT-LLM's Triton models
(TensorRT-LLM's `triton_backend/all_models/inflight_batcher_llm/`): the `ensemble`'s text interface (`text_input`,
`max_tokens`, `stream`, `temperature`, `top_k`, `top_p`, `seed`, `end_id` → `text_output`) and the `tensorrt_llm`
model's token-id interface (`input_ids`, `input_lengths`, `request_output_len`, `streaming`, `runtime_top_k`,
`runtime_top_p` → `output_ids`, `sequence_length`), with its speculative-decoding statistics. Dims exclude the batch
dimension (the config has `max_batch_size` > 0, so every tensor arrives as [1, *dims]: one prompt per request).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import numpy as np

from nextn.runtime.outputs import RequestOutput
from nextn.runtime.sampling_params import SamplingParams, SamplingParamsError
from nextn.runtime.tokenizer import ChatTemplateError, EngineTokenizer
from nextn.serving import PROMPT_CHARS_PER_TOKEN


class TritonRequestError(ValueError):
    """A request the model cannot run (missing/duplicated/ill-typed input, bad value); the message says which."""


@dataclass(frozen=True)
class TensorSpec:
    """One input or output of the model's config.pbtxt.

    Attributes:
        name: the tensor name (TensorRT-LLM's).
        data_type: the Triton config type, e.g. "TYPE_INT32".
        dims: the shape without the batch dimension (-1 = variable).
        optional: an input the client may leave out.
    """

    name: str
    data_type: str
    dims: tuple[int, ...]
    optional: bool = False


# Every input is optional to Triton because the text and token-id interfaces share one model; `parse_request`
# enforces exactly one prompt and one output length.
INPUTS = (
    TensorSpec("text_input", "TYPE_STRING", (1,), True),
    TensorSpec("input_ids", "TYPE_INT32", (-1,), True),
    TensorSpec("input_lengths", "TYPE_INT32", (1,), True),
    TensorSpec("max_tokens", "TYPE_INT32", (1,), True),
    TensorSpec("request_output_len", "TYPE_INT32", (1,), True),
    TensorSpec("stream", "TYPE_BOOL", (1,), True),
    TensorSpec("streaming", "TYPE_BOOL", (1,), True),
    TensorSpec("temperature", "TYPE_FP32", (1,), True),
    TensorSpec("top_k", "TYPE_INT32", (1,), True),
    TensorSpec("runtime_top_k", "TYPE_INT32", (1,), True),
    TensorSpec("top_p", "TYPE_FP32", (1,), True),
    TensorSpec("runtime_top_p", "TYPE_FP32", (1,), True),
    TensorSpec("seed", "TYPE_UINT64", (1,), True),
    TensorSpec("end_id", "TYPE_INT32", (1,), True),
    TensorSpec("presence_penalty", "TYPE_FP32", (1,), True),
    TensorSpec("frequency_penalty", "TYPE_FP32", (1,), True),
    TensorSpec("repetition_penalty", "TYPE_FP32", (1,), True),
    TensorSpec("min_tokens", "TYPE_INT32", (1,), True),
    TensorSpec("return_log_probs", "TYPE_BOOL", (1,), True),
    # TensorRT-LLM's guided decoding: guide type "json" (any JSON object), "json_schema", "regex" or "ebnf_grammar",
    # and the guide text
    TensorSpec("guided_decoding_guide_type", "TYPE_STRING", (1,), True),
    TensorSpec("guided_decoding_guide", "TYPE_STRING", (1,), True),
    # nextn's extension (TensorRT-LLM's ensemble has none): text_input is one user message, rendered with the chat
    # template the engine stores (the GGUF's tokenizer.chat_template, or the HF tokenizer's).
    TensorSpec("apply_chat_template", "TYPE_BOOL", (1,), True),
)
KV_FREE_BLOCKS = "kv_cache_free_blocks"  # nextn's extension, filled only when the client requests it
OUTPUTS = (
    TensorSpec("text_output", "TYPE_STRING", (-1,)),
    TensorSpec("output_ids", "TYPE_INT32", (-1, -1)),  # [beams = 1, tokens]
    TensorSpec("sequence_length", "TYPE_INT32", (-1,)),  # [beams = 1]
    TensorSpec("acceptance_rate", "TYPE_FP32", (1,)),
    TensorSpec("total_accepted_draft_tokens", "TYPE_INT32", (1,)),
    TensorSpec("total_draft_tokens", "TYPE_INT32", (1,)),
    TensorSpec("output_log_probs", "TYPE_FP32", (-1, -1)),  # [beams = 1, tokens], with return_log_probs
    TensorSpec(KV_FREE_BLOCKS, "TYPE_INT32", (1,)),
)
_GUIDE_TYPES = {"json": "json_object", "json_schema": "json", "regex": "regex", "ebnf_grammar": "grammar"}
INPUT_NAMES = tuple(s.name for s in INPUTS)

# Two spellings of one parameter: the ensemble's (text) name first, then the tensorrt_llm model's.
_ALIASES = {"max_tokens": "request_output_len", "stream": "streaming", "top_k": "runtime_top_k",
            "top_p": "runtime_top_p"}
_KINDS = {"TYPE_STRING": ("OSU", "bytes"), "TYPE_INT32": ("iu", "an integer"), "TYPE_UINT64": ("iu", "an integer"),
          "TYPE_FP32": ("fc", "a float"), "TYPE_BOOL": ("b", "a bool")}
_SPECS = {s.name: s for s in INPUTS}


@dataclass(frozen=True)
class ParsedRequest:
    """What one Triton request asks for.

    Attributes:
        prompt: the text (`text_input`) or the token ids (`input_ids`).
        sampling_params: validated `SamplingParams`.
        streaming: one response per engine step (decoupled models only).
        apply_chat_template: render the text prompt as one user message with the model's chat template
            (`render_prompt`).
    """

    prompt: str | list[int]
    sampling_params: SamplingParams
    streaming: bool
    apply_chat_template: bool = False


def parse_request(inputs: Mapping[str, np.ndarray], decoupled: bool, vocab_size: int | None = None,
                  max_seq_len: int | None = None) -> ParsedRequest:
    """Turn a request's input tensors into a prompt and `SamplingParams`.

    Args:
        inputs: input name → array as the Python backend gives it ([1, *dims], or [*dims] without a batch dimension).
        decoupled: whether the model may send several responses (streaming allowed).
        vocab_size: the engine's vocabulary: token ids, `end_id` and `top_k` are checked against it (None: not).
        max_seq_len: the engine's max prompt + completion tokens: a longer prompt is refused before it is tokenized
            or copied (text over PROMPT_CHARS_PER_TOKEN × max_seq_len characters; None: not checked here).
    Raises:
        TritonRequestError: unknown input, no prompt or two, no output length, both spellings of a parameter, batch
            size ≠ 1, wrong dtype, `input_lengths` ≠ len(input_ids), undecodable text, a prompt too long, token ids
            or `end_id` outside the vocabulary, `top_k` > the vocabulary, streaming on a non-decoupled model, or an
            invalid sampling value (the message names the input and the valid range).
    """
    unknown = sorted(set(inputs) - set(INPUT_NAMES))
    if unknown:
        raise TritonRequestError(f"unknown inputs {unknown}; this model takes {list(INPUT_NAMES)}")
    for name, value in inputs.items():
        _check_dtype(name, np.asarray(value))
    args = {name: _pick(inputs, name) for name in _ALIASES}
    prompt = _prompt(inputs, vocab_size, max_seq_len)
    if args["max_tokens"] is None:
        raise TritonRequestError("missing input: give max_tokens (or request_output_len), the tokens to generate")
    streaming = bool(args["stream"]) if args["stream"] is not None else False
    if streaming and not decoupled:
        raise TritonRequestError("streaming needs a decoupled model (nextn triton-repo --decoupled); this one answers "
                                 "each request with one response")
    params = {"max_tokens": int(args["max_tokens"])}
    for key in ("temperature", "seed", "end_id"):
        if key in inputs:
            params[key] = _scalar(inputs, key)
    for key in ("top_k", "top_p"):
        if args[key] is not None:
            params[key] = args[key]
    for key in ("presence_penalty", "frequency_penalty", "repetition_penalty", "min_tokens"):
        if key in inputs:
            params[key] = _scalar(inputs, key)
    floats = ("temperature", "top_p", "presence_penalty", "frequency_penalty", "repetition_penalty")
    params = {k: (float(v) if k in floats else int(v)) for k, v in params.items()}
    if "return_log_probs" in inputs and bool(_scalar(inputs, "return_log_probs")):
        params["logprobs"] = 0
    params.update(_guided(inputs))
    if params.get("end_id") == -1:  # TensorRT-LLM's convention: end_id -1 = no end token, stop at max_tokens only
        del params["end_id"]
        params["ignore_eos"] = True
    if vocab_size is not None:
        if params.get("top_k", 0) > vocab_size:
            raise TritonRequestError(f"top_k={params['top_k']} exceeds the vocabulary size {vocab_size}: give 0 (off) "
                                     f"to {vocab_size}")
        if not 0 <= params.get("end_id", 0) < vocab_size:
            raise TritonRequestError(f"end_id={params['end_id']} is outside the vocabulary [0, {vocab_size}): give a "
                                     "token id of this model, or leave end_id out for the model's EOS")
    try:
        sampling_params = SamplingParams(**params)
    except SamplingParamsError as e:
        raise TritonRequestError(str(e)) from None
    chat = "apply_chat_template" in inputs and bool(_scalar(inputs, "apply_chat_template"))
    if chat and not isinstance(prompt, str):
        raise TritonRequestError("apply_chat_template renders text_input; input_ids are sent to the model as they are")
    return ParsedRequest(prompt, sampling_params, streaming, chat)


def _guided(inputs: Mapping[str, np.ndarray]) -> dict:
    """{"guided_decoding": {...}} from TensorRT-LLM's guide type and guide, or {}."""
    if "guided_decoding_guide_type" not in inputs:
        if "guided_decoding_guide" in inputs:
            raise TritonRequestError("guided_decoding_guide needs guided_decoding_guide_type (json, json_schema, "
                                     "regex or ebnf_grammar)")
        return {}
    kind = _text(inputs, "guided_decoding_guide_type")
    if kind not in _GUIDE_TYPES:
        raise TritonRequestError(f"guided_decoding_guide_type {kind[:40]!r} is not one of {sorted(_GUIDE_TYPES)}")
    if kind == "json":
        return {"guided_decoding": {"json_object": True}}
    if "guided_decoding_guide" not in inputs:
        raise TritonRequestError(f"guided_decoding_guide_type {kind} needs guided_decoding_guide (the schema, regex "
                                 "or grammar text)")
    return {"guided_decoding": {_GUIDE_TYPES[kind]: _text(inputs, "guided_decoding_guide")}}


def _text(inputs: Mapping[str, np.ndarray], name: str) -> str:
    value = _scalar(inputs, name)
    try:
        return value.decode("utf-8") if isinstance(value, bytes) else str(value)
    except UnicodeDecodeError:
        raise TritonRequestError(f"{name} is not valid UTF-8") from None


def render_prompt(parsed: ParsedRequest, tokenizer: EngineTokenizer | None) -> str | list[int]:
    """The prompt to submit: `parsed.prompt`, or with `apply_chat_template` its chat-template token ids (the text as
    one user message, `EngineTokenizer.apply_chat_template`; equal to transformers' with add_generation_prompt).

    Raises:
        TritonRequestError: apply_chat_template on an engine without a tokenizer or without a chat template, or the
            template rejected the message.
    """
    if not parsed.apply_chat_template:
        return parsed.prompt
    if tokenizer is None:
        raise TritonRequestError("apply_chat_template needs a tokenizer and this engine has none: send input_ids")
    try:
        return tokenizer.apply_chat_template([{"role": "user", "content": parsed.prompt}])
    except ChatTemplateError as e:
        raise TritonRequestError(str(e)) from None


def response_tensors(output: RequestOutput, delta: bool, kv_free_blocks: int | None = None) -> dict[str, np.ndarray]:
    """The output tensors of one response, each with a leading batch dimension of 1.

    Args:
        output: a per-step (streaming) or final output of `LLM.generate_async`.
        delta: send what this step added (`token_ids_diff` / `text_diff`) instead of everything so far.
        kv_free_blocks: free KV-cache blocks to report as `kv_cache_free_blocks` (None: left out).
    Returns:
        text_output [1, 1] (bytes), output_ids [1, 1, T] int32, sequence_length [1, 1] int32 (= T),
        acceptance_rate [1, 1] fp32 (accepted / proposed drafts so far), total_accepted_draft_tokens and
        total_draft_tokens [1, 1] int32; with `return_log_probs`, output_log_probs [1, 1, T] fp32.
    """
    c = output.outputs[0]
    ids = c.token_ids_diff if delta else c.token_ids
    text = c.text_diff if delta else c.text
    tensors = {
        "text_output": np.array([[(text or "").encode("utf-8")]], dtype=np.object_),
        "output_ids": np.array(list(ids), dtype=np.int32).reshape(1, 1, -1),
        "sequence_length": np.array([[len(ids)]], dtype=np.int32),
        "acceptance_rate": np.array([[c.draft_acceptance_rate]], dtype=np.float32),
        "total_accepted_draft_tokens": np.array([[c.num_accepted_draft_tokens]], dtype=np.int32),
        "total_draft_tokens": np.array([[c.num_draft_tokens]], dtype=np.int32),
    }
    if c.logprobs is not None:
        lps = c.logprobs[len(c.token_ids) - len(ids):] if delta else c.logprobs
        tensors["output_log_probs"] = np.array([e.logprob for e in lps], dtype=np.float32).reshape(1, 1, -1)
    if kv_free_blocks is not None:
        tensors[KV_FREE_BLOCKS] = np.array([[kv_free_blocks]], dtype=np.int32)
    return tensors


# Helpers ---------------------------------------------------------------------------------------------------------
def _check_dtype(name: str, value: np.ndarray) -> None:
    kinds, what = _KINDS[_SPECS[name].data_type]
    if value.dtype.kind not in kinds:
        raise TritonRequestError(f"input {name} must be {what} ({_SPECS[name].data_type}), got numpy {value.dtype}")


def _unbatch(name: str, value: np.ndarray, ndim: int) -> np.ndarray:
    """Drop the batch dimension of a [1, *dims] tensor (one prompt per request)."""
    if value.ndim == ndim + 1:
        if value.shape[0] != 1:
            raise TritonRequestError(f"input {name} has batch size {value.shape[0]}: nextn takes one prompt per "
                                     "request (send concurrent requests instead; they share engine steps)")
        value = value[0]
    if value.ndim != ndim:
        raise TritonRequestError(f"input {name} has shape {list(value.shape)}; expected [1, {'-1' if ndim else ''}]")
    return value


def _scalar(inputs: Mapping[str, np.ndarray], name: str):
    value = np.asarray(inputs[name])
    if value.size != 1:
        raise TritonRequestError(f"input {name} must hold one value per request, got shape {list(value.shape)}")
    item = value.reshape(-1)[0]
    return item.item() if isinstance(item, np.generic) else item


def _pick(inputs: Mapping[str, np.ndarray], name: str):
    """The value of a parameter given under either spelling (`name` or its tensorrt_llm alias), or None."""
    alias = _ALIASES[name]
    if name in inputs and alias in inputs:
        raise TritonRequestError(f"give either {name} or {alias} (the same parameter), not both")
    key = name if name in inputs else alias if alias in inputs else None
    return None if key is None else _scalar(inputs, key)


def _too_long(what: str, max_seq_len: int) -> TritonRequestError:
    return TritonRequestError(f"the prompt has {what} but max_seq_len is {max_seq_len} (prompt plus at least one "
                              "generated token): shorten the prompt")


def _prompt(inputs: Mapping[str, np.ndarray], vocab_size: int | None, max_seq_len: int | None) -> str | list[int]:
    if ("text_input" in inputs) == ("input_ids" in inputs):
        raise TritonRequestError("give exactly one prompt: text_input (text) or input_ids (token ids)")
    if "text_input" in inputs:
        raw = _scalar(inputs, "text_input")
        try:
            text = raw.decode("utf-8") if isinstance(raw, bytes) else str(raw)
            text.encode("utf-8")  # a str input may hold lone surrogates
        except UnicodeError as e:
            raise TritonRequestError(f"input text_input is not valid UTF-8: {e}; send UTF-8 text") from None
        if max_seq_len is not None and len(text) > PROMPT_CHARS_PER_TOKEN * max_seq_len:
            raise _too_long(f"{len(text)} characters (more than {PROMPT_CHARS_PER_TOKEN} per token)", max_seq_len)
        return text
    ids = _unbatch("input_ids", np.asarray(inputs["input_ids"]), 1)
    if "input_lengths" in inputs and int(_scalar(inputs, "input_lengths")) != len(ids):
        raise TritonRequestError(f"input_lengths says {_scalar(inputs, 'input_lengths')} but input_ids holds "
                                 f"{len(ids)} tokens")
    if max_seq_len is not None and len(ids) >= max_seq_len:
        raise _too_long(f"{len(ids)} tokens", max_seq_len)
    if vocab_size is not None and len(ids) and not (0 <= ids.min() and ids.max() < vocab_size):
        bad = ids[(ids < 0) | (ids >= vocab_size)][:5].tolist()
        raise TritonRequestError(f"token ids {bad} are outside the vocabulary [0, {vocab_size}): send ids of this "
                                 "model's tokenizer")
    return ids.tolist()
