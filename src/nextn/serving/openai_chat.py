"""POST /v1/chat/completions: messages (and tools) through the chat template, n choices, tool calls parsed into
`message.tool_calls` (streamed as `delta.tool_calls`), log-probabilities in OpenAI's chat shape.

While streaming with tools, text from an unclosed `<tool_call>` (or a tail that could begin one) is held back;
when the choice ends its calls are parsed and sent as one `delta.tool_calls` chunk each, with finish_reason
"tool_calls".
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator
from typing import Any, Protocol

from fastapi import Request
from fastapi.responses import JSONResponse, Response

from nextn.serving import openai_protocol as p
from nextn.serving.choice_streams import merge_pieces
from nextn.serving.openai_sampling import chat_logprobs
from nextn.serving.openai_tools import open_tool_call, parse_tool_calls

__all__ = ["chat_response"]


class ServerCore(Protocol):
    """What the chat route uses of `OpenAIServer` (serving/openai_server.py)."""

    model_name: str
    tokenizer: Any

    def _check_model(self, model: str | None) -> None: ...
    async def _chat_ids(self, messages: list, raw: Request, tools: list | None = None,
                        template_kwargs: dict | None = None) -> list[int]: ...
    def _params(self, req: Any, num_prompt_tokens: int, max_tokens: int | None, param: str,
                max_tokens_param: str = ..., num_top: int | None = None, tool_grammar: str | None = None) -> Any: ...
    async def _tool_grammar(self, req: Any) -> str | None: ...
    def _submit(self, prompts: list, params: list, stops: list[str], n: int = 1) -> list: ...

    async def _compile_grammars(self, params: list) -> None: ...
    async def _collect(self, jobs: list, raw: Request) -> list: ...
    def _pieces(self, job: Any) -> AsyncIterator: ...
    def _sse(self, chunks: AsyncIterator[str], jobs: list) -> Response: ...
    def _total_usage(self, jobs: list, finals: list) -> p.UsageInfo: ...


async def chat_response(server: ServerCore, req: p.ChatCompletionRequest, raw: Request) -> Response:
    """The chat route's response (JSON, or server-sent events with `stream`). Raises p.APIError as the server."""
    server._check_model(req.model)
    tools = req.tools if req.tools and req.tool_choice != "none" else None
    ids = await server._chat_ids(req.messages, raw, tools, req.chat_template_kwargs)
    limit_param = "max_completion_tokens" if req.max_completion_tokens is not None else "max_tokens"
    limit = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
    num_top = (req.top_logprobs or 0) if req.logprobs else None
    params = server._params(req, len(ids), limit, "messages", limit_param, num_top, await server._tool_grammar(req))
    await server._compile_grammars([params])
    jobs = server._submit([ids], [params], req.stop, req.n)
    tok = None if server.tokenizer is None else server.tokenizer.tok

    def logprobs(entries: list) -> p.ChatLogprobs | None:
        return chat_logprobs(entries, tok, num_top) if num_top is not None else None

    if not req.stream:
        results = await server._collect(jobs, raw)
        choices = []
        for job, (text, finish, final) in zip(jobs, results):
            content, calls = parse_tool_calls(text, tools) if tools else (text, [])
            choices.append(p.ChatChoice(index=job.index, finish_reason="tool_calls" if calls else finish,
                                        message=p.AssistantMessage(content=content, tool_calls=calls or None),
                                        logprobs=logprobs(final.logprobs or [])))
        return JSONResponse(p.ChatCompletionResponse(model=server.model_name, choices=choices,
                                                     usage=server._total_usage(jobs, [r[2] for r in results]),
                                                     ).model_dump())
    base = p.ChatCompletionChunk(id=p._id("chatcmpl"), created=int(time.time()), model=server.model_name, choices=[])

    def chunk(index: int, delta: p.DeltaMessage, finish: str | None = None, lps: list | None = None) -> str:
        choice = p.ChatStreamChoice(index=index, delta=delta, finish_reason=finish,
                                    logprobs=logprobs(lps) if lps else None)
        return base.model_copy(update={"choices": [choice]}).model_dump_json()

    async def chunks() -> AsyncIterator[str]:
        full, sent, finals = [""] * len(jobs), [""] * len(jobs), []
        for job in jobs:
            yield chunk(job.index, p.DeltaMessage(role="assistant", content=""))
        async for job, (delta, finish, final, lps) in merge_pieces(server._pieces, jobs):
            i = job.index
            full[i] += delta
            if tools:  # only what cannot belong to a tool call yet
                delta = full[i][len(sent[i]):open_tool_call(full[i])] if final is None else ""
            sent[i] += delta
            if delta or lps:
                yield chunk(i, p.DeltaMessage(content=delta), lps=lps)
            if final is None:
                continue
            finals.append(final)
            calls = []
            if tools:
                content, calls = parse_tool_calls(full[i], tools)
                rest = (content or "")[len(sent[i].strip()):] if calls else full[i][len(sent[i]):]
                if rest:
                    yield chunk(i, p.DeltaMessage(content=rest))
                for k, call in enumerate(calls):
                    yield chunk(i, p.DeltaMessage(tool_calls=[{"index": k, **call.model_dump()}]))
            yield chunk(i, p.DeltaMessage(), "tool_calls" if calls else finish)
        if req.stream_options and req.stream_options.include_usage:
            yield base.model_copy(update={"usage": server._total_usage(jobs, finals)}).model_dump_json()
    return server._sse(chunks(), jobs)
