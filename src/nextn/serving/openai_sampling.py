"""An OpenAI request's sampling fields as `SamplingParams`, and the engine's log-probabilities in OpenAI's shapes.

The grammar a request asks for comes from one of: `response_format` (json_object, json_schema), vLLM's
`guided_json` / `guided_regex` / `guided_choice` / `guided_grammar`, or `tool_choice` "required" / a named function
(serving/openai_tools.py); two at once is a 400 naming both.
"""

from __future__ import annotations

import json
from typing import Any

from nextn.runtime.outputs import TokenLogprob
from nextn.runtime.sampling_params import GuidedDecodingParams, SamplingParamsError
from nextn.serving import openai_protocol as p

__all__ = ["guided_decoding", "sampling_fields", "chat_logprobs", "completion_logprobs"]


def guided_decoding(req: p._SamplingRequest, tool_grammar: str | None = None) -> GuidedDecodingParams | None:
    """The request's grammar, or None. `tool_grammar`: the EBNF its `tool_choice` enforces (`tool_call_grammar`,
    converted off the event loop by the caller). Raises p.APIError (400) for two grammars at once or one that is
    invalid."""
    asked: dict[str, dict[str, Any]] = {}
    fmt = req.response_format
    if fmt is not None and fmt.type == "json_object":
        asked["response_format"] = {"json_object": True}
    elif fmt is not None and fmt.type == "json_schema":
        if fmt.json_schema is None:
            raise p.APIError(400, "response_format of type json_schema needs a json_schema: {name, schema}",
                             "response_format")
        schema = fmt.json_schema.schema_
        asked["response_format"] = {"json": schema} if schema else {"json_object": True}
    for name, key in (("guided_json", "json"), ("guided_regex", "regex"), ("guided_choice", "choice"),
                      ("guided_grammar", "grammar")):
        if getattr(req, name) is not None:
            asked[name] = {key: getattr(req, name)}
    if tool_grammar is not None:
        asked["tool_choice"] = {"grammar": tool_grammar}
    if len(asked) > 1:
        raise p.APIError(400, f"one output constraint at a time: the request sets {' and '.join(asked)}",
                         next(iter(asked)))
    if not asked:
        return None
    (param, spec), = asked.items()
    try:
        return GuidedDecodingParams(**spec)
    except SamplingParamsError as e:
        raise p.APIError(400, str(e), param) from None


def sampling_fields(req: p._SamplingRequest, num_top: int | None, tool_grammar: str | None = None) -> dict[str, Any]:
    """The SamplingParams fields beyond the basic ones: penalties, bias, min_tokens, logprobs, the grammar."""
    out: dict[str, Any] = {"presence_penalty": req.presence_penalty, "frequency_penalty": req.frequency_penalty,
                           "min_tokens": req.min_tokens, "logprobs": num_top,
                           "guided_decoding": guided_decoding(req, tool_grammar)}
    if req.repetition_penalty is not None:
        out["repetition_penalty"] = req.repetition_penalty
    if req.logit_bias:
        out["logit_bias"] = {int(k): v for k, v in req.logit_bias.items()}
    return out


def _token(tokenizer, token_id: int) -> tuple[str, list[int]]:
    text = tokenizer.decode([token_id]) if tokenizer is not None else str(token_id)
    return text, list(text.encode("utf-8"))


def chat_logprobs(entries: list[TokenLogprob], tokenizer, num_top: int) -> p.ChatLogprobs:
    """OpenAI's chat `logprobs.content`: per token its text, bytes, log-probability and the top `num_top`."""
    content = []
    for e in entries:
        text, raw = _token(tokenizer, e.token_id)
        tops = [p.TopLogprob(token=t, logprob=lp, bytes=b) for (t, b), lp in
                ((_token(tokenizer, tid), lp) for tid, lp in e.top[:num_top])]
        content.append(p.TokenLogprob(token=text, logprob=e.logprob, bytes=raw, top_logprobs=tops))
    return p.ChatLogprobs(content=content)


def completion_logprobs(entries: list[TokenLogprob], tokenizer, num_top: int, offset: int = 0
                        ) -> p.CompletionLogprobs:
    """The legacy completions `logprobs`: tokens, token_logprobs, top_logprobs (text → logprob), text_offset."""
    out = p.CompletionLogprobs()
    for e in entries:
        text, _ = _token(tokenizer, e.token_id)
        out.tokens.append(text)
        out.token_logprobs.append(e.logprob)
        out.top_logprobs.append({_token(tokenizer, tid)[0]: lp for tid, lp in e.top[:num_top]})
        out.text_offset.append(offset)
        offset += len(text)
    return out


def dumps(obj: Any) -> str:
    return json.dumps(obj, ensure_ascii=False)
