"""An OpenAI-compatible HTTP server over one `LLM` (`nextn serve`, in the shape of `trtllm-serve`).

Routes: POST /v1/completions, POST /v1/chat/completions (non-streaming, or server-sent events with `stream: true`
ending in `data: [DONE]`), GET /v1/models, GET /health, GET /metrics (Prometheus, `serving/metrics.py`).
Every request becomes one `LLM.generate_async(..., streaming=True)` handle, so concurrent requests share the
engine through in-flight batching; a client that disconnects has its request aborted (its KV blocks are freed at
once). Bad requests get HTTP 4xx with OpenAI's error body naming the field and the fix: the HTTP edge
(`serving/http_edge.py`: API key, body size, UTF-8, JSON) then the request models (`openai_protocol.py`: types and
ranges) then the engine-dependent limits here (vocabulary, max_seq_len, prompt characters before tokenizing).
Tokenization runs in worker threads, so a long prompt never blocks the event loop; chat templates render in worker
processes under a time, size and memory budget, and a client that leaves stops its render (`serving/chat_render.py`).

Stop strings (`stop`) are matched on the detokenized text after each engine step: the text is cut before the
first match, the request is aborted there (finish_reason "stop"), and `usage.completion_tokens` counts the tokens
generated up to that step (they may run a few tokens past the match). While streaming, the last
len(longest stop) − 1 characters are held back until they cannot begin a match.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TypeVar

import anyio
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import BaseModel, ValidationError
from starlette.background import BackgroundTask
from starlette.exceptions import HTTPException

from nextn import LLM, SamplingParams
from nextn.runtime.engine import RequestError
from nextn.runtime.grammar_pool import GrammarLimits
from nextn.runtime.outputs import CompletionOutput
from nextn.runtime.request_handle import RequestHandle
from nextn.runtime.sampling_params import SamplingParamsError
from nextn.runtime.template_render import DEFAULT_TIMEOUT_S, RendererClosed, RenderLimits
from nextn.serving import PROMPT_CHARS_PER_TOKEN
from nextn.serving import openai_protocol as p
from nextn.serving.chat_render import ServerChatRenderer
from nextn.serving.choice_streams import merge_pieces
from nextn.serving.openai_chat import chat_response
from nextn.serving.openai_sampling import chat_logprobs, completion_logprobs, sampling_fields
from nextn.serving.openai_grammars import compile_grammars, tool_grammar
from nextn.serving.openai_tools import message_for_template
from nextn.serving.template_probe import TemplateProbe
from nextn.serving.http_edge import (DEFAULT_MAX_REQUEST_BYTES, OFFLOAD_BYTES, ApiKeyMiddleware, parse_json,
                                     read_body)
from nextn.serving.metrics import CountRequests, ServerMetrics

logger = logging.getLogger(__name__)

# Used when the tokenizer has no chat template: one "role: content" line per message, then "assistant:".
FALLBACK_CHAT_TEMPLATE = ("{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
                          "{% if add_generation_prompt %}assistant:{% endif %}")
COMPLETIONS_DEFAULT_MAX_TOKENS = 16  # OpenAI's default for /v1/completions; chat runs to max_seq_len
#: sequences one request may start (prompts × n): 128 prompts of n=1 pass, 128 × 16 = 2,048 do not
DEFAULT_MAX_SEQUENCES = 128
ROUTES = ("POST /v1/completions", "POST /v1/chat/completions", "GET /v1/models", "GET /health", "GET /metrics")
_Model = TypeVar("_Model", bound=BaseModel)


@dataclass
class _Job:
    """One prompt submitted to the engine."""

    handle: RequestHandle
    num_prompt_tokens: int
    stops: list[str]
    index: int = 0  # the choice it answers
    n: int = 1  # choices of its prompt


def _tool_dicts(tools: list | None) -> list[dict] | None:
    """OpenAI tool definitions as the chat template receives them (plain dicts, unset fields dropped)."""
    return [t.model_dump(exclude_none=True) for t in tools] if tools else None


def _cut(text: str, stops: list[str]) -> tuple[str, bool]:
    """`text` cut before the earliest stop string, and whether one matched."""
    hits = [i for i in (text.find(s) for s in stops) if i >= 0]
    return (text[:min(hits)], True) if hits else (text, False)


class OpenAIServer:
    """The routes' logic over one `LLM` (its background engine loop starts with the first request).

    Args:
        llm: a loaded `LLM`; the server shares it across requests (the caller shuts it down).
        model_name: the name clients send as `model` (GET /v1/models lists it).
        max_request_bytes: the largest request body read (413 beyond).
        chat_template_timeout_s: the wall-clock budget of one chat-template render (400 beyond; the render is stopped).
        grammar_limits: each guided-decoding grammar's budget (time, compiled bytes kept); default `GrammarLimits()`.
        max_sequences: the most sequences one request may start (prompts × n; 400 beyond).
    """

    def __init__(self, llm: LLM, model_name: str, max_request_bytes: int = DEFAULT_MAX_REQUEST_BYTES,
                 chat_template_timeout_s: float = DEFAULT_TIMEOUT_S, grammar_limits: GrammarLimits | None = None,
                 max_sequences: int = DEFAULT_MAX_SEQUENCES) -> None:
        if max_sequences < 1:
            raise ValueError(f"max_sequences must be ≥ 1, got {max_sequences}")
        self.llm, self.model_name, self.max_request_bytes = llm, model_name, max_request_bytes
        self.max_sequences = max_sequences
        if grammar_limits is not None:
            llm.engine.grammar_limits = grammar_limits
        self.tokenizer = llm.tokenizer
        self.max_seq_len = llm.max_seq_len
        self.vocab_size = llm.vocab_size
        self.max_prompt_chars = PROMPT_CHARS_PER_TOKEN * self.max_seq_len
        self.metrics = ServerMetrics(lambda: llm.num_free_kv_blocks, llm.num_kv_blocks, lambda: llm.prefix_cache_stats)
        self.chat_template: str | None = None
        if self.tokenizer is not None and not getattr(self.tokenizer.tok, "chat_template", None):
            self.chat_template = FALLBACK_CHAT_TEMPLATE
            logger.warning("the tokenizer has no chat template: /v1/chat/completions renders messages as "
                           "'ROLE: CONTENT' lines followed by 'assistant:' (nextn's fallback template)")
        # A rendered prompt longer than max_prompt_chars is refused anyway: the render stops there.
        limits = RenderLimits(timeout_s=chat_template_timeout_s, max_chars=self.max_prompt_chars)
        self.chat_renderer = (None if self.tokenizer is None else
                              ServerChatRenderer(self.tokenizer, self.chat_template, limits))
        # How the template takes an assistant's earlier tool calls: probed once, by the first request that has them.
        self.template_probe = TemplateProbe(self._render_probe)

    # Requests, prompts and sampling parameters --------------------------------------------------------------
    async def parse(self, raw: Request, model: type[_Model]) -> _Model:
        """The request body as `model`, through the HTTP edge's limits (size, UTF-8, JSON) and the model's checks.

        Raises:
            p.APIError: 413 for a body over max_request_bytes, 400 naming every bad field.
        """
        body = await read_body(raw, self.max_request_bytes)

        def decode() -> _Model:
            try:
                return model.model_validate(parse_json(body))
            except ValidationError as e:
                raise p.validation_error(e) from None
        return await self._off_loop(decode) if len(body) > OFFLOAD_BYTES else decode()

    def _check_chars(self, num_chars: int, param: str) -> None:
        if num_chars > self.max_prompt_chars:
            raise p.APIError(400, f"the prompt has {num_chars} characters; at most {self.max_prompt_chars} "
                             f"({PROMPT_CHARS_PER_TOKEN} per token of max_seq_len {self.max_seq_len}) can fit: shorten "
                             "the prompt", param, "context_length_exceeded")

    def _check_model(self, model: str | None) -> None:
        if model is not None and model != self.model_name:
            raise p.APIError(404, f"the model '{model}' does not exist: this server serves '{self.model_name}' "
                             "(GET /v1/models)", "model", "model_not_found")

    def _encode(self, text: str, param: str, add_special_tokens: bool = True) -> list[int]:
        if self.tokenizer is None:
            raise p.APIError(400, "this engine has no tokenizer (its checkpoint had none): send the prompt as a list "
                             "of token ids", param)
        if not text:
            raise p.APIError(400, "empty prompt: give at least one character or token id", param)
        self._check_chars(len(text), param)
        return list(self.tokenizer.tok.encode(text, add_special_tokens=add_special_tokens))

    def chat_ids(self, messages: list[p.ChatMessage], tools: list | None = None,
                 template_kwargs: dict | None = None) -> list[int]:
        """The prompt ids of `messages` as a chat request renders them (same checks, template, tool-call form and
        budget; no client to watch): for tools and tests. Raises APIError as a request would."""
        msgs = self._chat_messages(messages, self._arguments_as_text(messages))
        text = self.chat_renderer.tokenizer.render_chat(msgs, self.chat_renderer.chat_template,
                                                        limits=self.chat_renderer.limits, tools=_tool_dicts(tools),
                                                        template_kwargs=template_kwargs)
        return self._encode(text, "messages", self.chat_template is not None)

    async def _chat_ids(self, messages: list[p.ChatMessage], raw: Request, tools: list | None = None,
                        template_kwargs: dict | None = None) -> list[int]:
        as_text = any(m.tool_calls for m in messages) and await self._off_loop(self._arguments_as_text, messages)
        text = await self.chat_renderer.render(self._chat_messages(messages, as_text), raw, tools=_tool_dicts(tools),
                                               template_kwargs=template_kwargs)
        # A model's template writes its own BOS; the fallback does not, so the tokenizer adds it.
        return await self._off_loop(self._encode, text, "messages", self.chat_template is not None)

    def _render_probe(self, messages: list[dict], tools: list[dict]) -> str:
        """The template probe's render: the server's template and budget (`serving/template_probe.py`)."""
        return self.chat_renderer.tokenizer.render_chat(messages, self.chat_renderer.chat_template,
                                                        limits=self.chat_renderer.limits, tools=tools)

    def _arguments_as_text(self, messages: list[p.ChatMessage]) -> bool:
        """Whether the template gets an assistant's tool-call arguments as JSON text rather than objects: the
        template probe's answer (run once, by the first request whose messages carry tool calls; it blocks)."""
        if self.tokenizer is None or not any(m.tool_calls for m in messages):
            return False
        try:
            return self.template_probe.tool_call_form().arguments_as_text
        except RendererClosed as e:
            raise p.APIError(503, str(e), type_="server_error") from None

    def _chat_messages(self, messages: list[p.ChatMessage], arguments_as_text: bool = False) -> list[dict]:
        """The messages as the chat template gets them: an assistant's tool-call arguments as objects
        (transformers' convention, Qwen2.5's and Hermes' templates), or as JSON text for templates that concatenate
        them (DeepSeek-V3's; the template probe decides)."""
        if self.tokenizer is None:
            raise p.APIError(400, "this engine has no tokenizer, so it cannot render chat messages: use "
                             "/v1/completions with token-id prompts", "messages")
        if len(messages) > self.max_seq_len:  # every message renders to at least one token
            raise p.APIError(400, f"{len(messages)} messages cannot fit max_seq_len {self.max_seq_len} tokens: send "
                             "fewer messages", "messages", "context_length_exceeded")
        msgs = [message_for_template(m.role, m.text() if m.content is not None or not m.tool_calls else None,
                                     m.tool_calls, m.tool_call_id, m.name, arguments_as_text) for m in messages]
        self._check_chars(sum(len(m["content"] or "") for m in msgs), "messages")
        return msgs

    def _params(self, req: p._SamplingRequest, num_prompt_tokens: int, max_tokens: int | None, param: str,
                max_tokens_param: str = "max_tokens", num_top: int | None = None, tool_grammar: str | None = None
                ) -> SamplingParams:
        room = self.max_seq_len - num_prompt_tokens
        if room < 1:
            raise p.APIError(400, f"the prompt has {num_prompt_tokens} tokens but max_seq_len is {self.max_seq_len} "
                             "(prompt plus at least one generated token): shorten the prompt or restart the server "
                             "with a larger --max_seq_len", param, "context_length_exceeded")
        if max_tokens is None:
            max_tokens = min(room, COMPLETIONS_DEFAULT_MAX_TOKENS) if param == "prompt" else room
        elif max_tokens > room:
            raise p.APIError(400, f"{max_tokens_param}={max_tokens} plus the prompt's {num_prompt_tokens} tokens "
                             f"exceed max_seq_len {self.max_seq_len}: lower {max_tokens_param} to at most {room}",
                             max_tokens_param, "context_length_exceeded")
        if req.top_k is not None and req.top_k > self.vocab_size:
            raise p.APIError(400, f"top_k={p.short(req.top_k)} exceeds the vocabulary size {self.vocab_size}: give "
                             f"0 (off) to {self.vocab_size}", "top_k")
        bad = [t for t in req.stop_token_ids or [] if t >= self.vocab_size]
        if bad:
            raise p.APIError(400, f"stop_token_ids {bad[:5]} are outside the vocabulary [0, {self.vocab_size}): "
                             "give token ids of this model", "stop_token_ids")
        if req.stop and self.tokenizer is None:
            raise p.APIError(400, "stop strings need a tokenizer and this engine has none: use stop_token_ids", "stop")
        bad = [int(k) for k in req.logit_bias or {} if int(k) >= self.vocab_size]
        if bad:
            raise p.APIError(400, f"logit_bias token ids {bad[:5]} are outside the vocabulary [0, {self.vocab_size})",
                             "logit_bias")
        try:
            return SamplingParams(max_tokens=max_tokens, temperature=req.temperature or 0.0, top_k=req.top_k or 0,
                                  top_p=1.0 if req.top_p is None else req.top_p, seed=req.seed,
                                  stop_token_ids=req.stop_token_ids or [], ignore_eos=req.ignore_eos,
                                  **sampling_fields(req, num_top, tool_grammar))
        except SamplingParamsError as e:  # the runtime's own ranges (e.g. the smallest temperature)
            fields = ("temperature", "top_p", "top_k", "seed", "stop_token_ids", "max_tokens", "min_tokens")
            named = [f for f in fields if f in str(e)]
            raise p.APIError(400, str(e), min(named, key=str(e).index) if named else None) from None

    def _submit(self, prompts: list[list[int]], params: list[SamplingParams], stops: list[str], n: int = 1
                ) -> list[_Job]:
        """n jobs per prompt (choice index prompt · n + i), choice i seeded `seed + i` when the request gave a seed
        (each its own seed stream; their prompts share KV blocks through the prefix cache)."""
        self._check_sequences(len(prompts), n)
        jobs: list[_Job] = []
        try:
            for k, (ids, sp) in enumerate(zip(prompts, params)):
                for i in range(n):
                    one = sp if sp.seed is None or i == 0 else sp.model_copy(update={"seed": (sp.seed + i) % 2**63})
                    jobs.append(_Job(self.llm.generate_async(ids, one, streaming=True), len(ids), stops, k * n + i,
                                     n))
        except RequestError as e:
            for job in jobs:
                job.handle.abort()
            raise p.APIError(400, str(e), "prompt") from None
        except RuntimeError as e:  # the engine loop is shut down
            raise p.APIError(503, f"the server is shutting down: {e}", type_="server_error") from None
        return jobs

    def _check_sequences(self, num_prompts: int, n: int) -> None:
        """Raises p.APIError (400, code "too_many_sequences") when prompts × n passes `max_sequences`."""
        if num_prompts * n > self.max_sequences:
            raise p.APIError(400, f"the request asks for {num_prompts} prompt(s) × n={n} = {num_prompts * n} sequences; "
                             f"at most {self.max_sequences} per request (nextn serve --max_sequences_per_request): "
                             "send fewer prompts or a smaller n, or split the request", "n", "too_many_sequences")

    async def _compile_grammars(self, params: list[SamplingParams]) -> None:
        """`openai_grammars.compile_grammars` for this server's engine."""
        await compile_grammars(self.llm.engine, params)

    async def _tool_grammar(self, req: p._SamplingRequest) -> str | None:
        """`openai_grammars.tool_grammar` for this server's engine."""
        return await tool_grammar(self.llm.engine, req)

    @staticmethod
    async def _off_loop(fn: Callable, *args):
        """`fn(*args)` in a worker thread: tokenizing a long prompt must not stall the event loop (/health, streams)."""
        return await anyio.to_thread.run_sync(fn, *args)

    # Running requests -----------------------------------------------------------------------------------------
    async def _pieces(self, job: _Job) -> AsyncIterator[tuple[str, str | None, CompletionOutput | None, list]]:
        """Per engine step: (new text, finish_reason on the last, final output on the last, the new tokens'
        `TokenLogprob`s when the request asked for them).

        Leaving early (client gone: the consumer is cancelled) aborts the request, freeing its KV blocks.
        Raises:
            p.APIError: 500 when the engine failed the request.
        """
        sent, finish, final, num_lp = "", None, None, 0
        hold = max(map(len, job.stops), default=1) - 1
        self.metrics.running.inc()
        try:
            async for out in job.handle:
                c = out.outputs[0]
                delta, lps = "", []
                if c.logprobs is not None and finish is None:
                    lps, num_lp = c.logprobs[num_lp:], len(c.logprobs)
                if finish is None:  # not yet cut by a stop string
                    text, hit = _cut(c.text, job.stops)
                    if hit:
                        finish = "stop"
                        job.handle.abort()  # the final output follows, finish_reason "cancelled"
                    elif out.finished:
                        finish = c.finish_reason
                    elif hold:
                        text = text[:max(len(sent), len(text) - hold)]  # the tail may begin a stop string
                    if len(text) > len(sent):
                        delta, sent = text[len(sent):], text
                if out.finished:
                    final = c
                    if finish not in ("stop", "length"):
                        raise p.APIError(500, f"the engine failed the request: {c.error or finish}",
                                         type_="server_error", code=finish)
                    yield delta, finish, c, lps
                elif delta or lps:
                    yield delta, None, None, lps
        finally:
            self.metrics.running.dec()
            if final is None:
                job.handle.abort()
                self.metrics.finished.labels(finish_reason="cancelled").inc()
            else:
                self.metrics.record(final, job.num_prompt_tokens, finish or "error")

    async def _collect(self, jobs: list[_Job], raw: Request) -> list[tuple[str, str, CompletionOutput]]:
        """Run every job to completion; aborts them all if the client disconnects first."""
        async def one(job: _Job) -> tuple[str, str, CompletionOutput]:
            text = ""
            async for delta, finish, final, _ in self._pieces(job):
                text += delta
                if final is not None:
                    return text, finish, final
            raise AssertionError("the request stream ended without a final output")

        task = asyncio.ensure_future(asyncio.gather(*(one(j) for j in jobs)))
        while not (await asyncio.wait({task}, timeout=0.5))[0]:
            if await raw.is_disconnected():
                task.cancel()  # cancels each `one`, whose _pieces aborts its request
                raise p.APIError(499, "client disconnected")
        return task.result()

    @staticmethod
    def _sse(chunks: AsyncIterator[str], jobs: list[_Job]) -> StreamingResponse:
        """Server-sent events: the chunks, an error event if the engine fails, then [DONE]. The jobs are aborted
        when the response ends, also when the client left before the stream began (a no-op for finished ones)."""
        async def events() -> AsyncIterator[str]:
            try:
                async for chunk in chunks:
                    yield f"data: {chunk}\n\n"
            except p.APIError as e:
                yield f"data: {p.ErrorResponse(error=e.info).model_dump_json()}\n\n"
            yield "data: [DONE]\n\n"

        def abort() -> None:
            for job in jobs:
                job.handle.abort()
        return StreamingResponse(events(), media_type="text/event-stream", background=BackgroundTask(abort))

    @staticmethod
    def _usage(num_prompt_tokens: int, final: CompletionOutput) -> p.UsageInfo:
        n = len(final.token_ids)
        return p.UsageInfo(prompt_tokens=num_prompt_tokens, completion_tokens=n, total_tokens=num_prompt_tokens + n)

    # Routes ---------------------------------------------------------------------------------------------------
    async def completions(self, req: p.CompletionRequest, raw: Request) -> Response:
        self._check_model(req.model)
        items = [req.prompt] if isinstance(req.prompt, str) or isinstance(req.prompt[0], int) else req.prompt
        self._check_sequences(len(items), req.n)
        prompts = await self._off_loop(lambda: [self._encode(x, "prompt") if isinstance(x, str) else list(x)
                                                for x in items])
        if req.stream and len(prompts) > 1:
            raise p.APIError(400, "streaming takes one prompt per request: send the prompts as separate requests",
                             "prompt")
        params = [self._params(req, len(ids), req.max_tokens, "prompt", num_top=req.logprobs) for ids in prompts]
        await self._compile_grammars(params)
        jobs = self._submit(prompts, params, req.stop, req.n)
        base = p.CompletionResponse(model=self.model_name, choices=[])
        tok = None if self.tokenizer is None else self.tokenizer.tok

        def logprobs(entries: list, offset: int = 0) -> p.CompletionLogprobs | None:
            return None if req.logprobs is None else completion_logprobs(entries, tok, req.logprobs, offset)

        if not req.stream:
            results = await self._collect(jobs, raw)
            base.choices = [p.CompletionChoice(index=j.index, text=t, finish_reason=f,
                                               logprobs=logprobs(c.logprobs or []))
                            for j, (t, f, c) in zip(jobs, results)]
            base.usage = self._total_usage(jobs, [r[2] for r in results])
            return JSONResponse(base.model_dump())

        async def chunks() -> AsyncIterator[str]:
            finals, offsets = [], [0] * len(jobs)
            async for job, (delta, finish, final, lps) in merge_pieces(self._pieces, jobs):
                choice = p.CompletionChoice(index=job.index, text=delta, finish_reason=finish,
                                            logprobs=logprobs(lps, offsets[job.index]))
                offsets[job.index] += len(delta)
                yield base.model_copy(update={"choices": [choice]}).model_dump_json()
                if final is not None:
                    finals.append(final)
            if req.stream_options and req.stream_options.include_usage:
                yield base.model_copy(update={"usage": self._total_usage(jobs, finals)}).model_dump_json()
        return self._sse(chunks(), jobs)

    async def chat(self, req: p.ChatCompletionRequest, raw: Request) -> Response:
        return await chat_response(self, req, raw)

    @staticmethod
    def _total_usage(jobs: list[_Job], finals: list[CompletionOutput]) -> p.UsageInfo:
        """Usage over every choice: each prompt counted once (its n choices share it), every choice's tokens."""
        prompt = sum(j.num_prompt_tokens for j in jobs if j.index % j.n == 0)
        completion = sum(len(f.token_ids) for f in finals)
        return p.UsageInfo(prompt_tokens=prompt, completion_tokens=completion, total_tokens=prompt + completion)

    def models(self) -> p.ModelList:
        return p.ModelList(data=[p.ModelCard(id=self.model_name, max_model_len=self.max_seq_len)])


def _http_error(request: Request, exc: HTTPException) -> JSONResponse:
    """Starlette's HTTP errors (unknown routes and methods) in OpenAI's error shape."""
    if exc.status_code in (404, 405):
        message = (f"{request.method} {request.url.path} is not an endpoint of nextn serve ({', '.join(ROUTES)})"
                   f"{'' if exc.status_code == 404 else ' (the path exists with another method)'}")
    else:
        message = str(exc.detail)
    return p.APIError(exc.status_code, message, code=str(exc.status_code)).response()


def _internal_error(request: Request, exc: Exception) -> JSONResponse:
    """Any other exception: a 500 in OpenAI's error shape (the traceback goes to the server's log)."""
    logger.error("%s %s failed: %s: %s", request.method, request.url.path, type(exc).__name__, exc)
    return p.APIError(500, f"internal error ({type(exc).__name__}): this is a bug in nextn serve; please report it "
                      "with the request", type_="server_error", code="internal_error").response()


def create_app(llm: LLM, served_model_name: str | None = None, api_key: str | None = None,
               max_request_bytes: int = DEFAULT_MAX_REQUEST_BYTES,
               chat_template_timeout_s: float = DEFAULT_TIMEOUT_S, grammar_limits: GrammarLimits | None = None,
               max_sequences: int = DEFAULT_MAX_SEQUENCES) -> FastAPI:
    """The FastAPI app serving `llm`.

    Args:
        llm: a loaded `LLM`, shared by every request (the caller shuts it down).
        served_model_name: the name clients send as `model`; default: the engine directory's name.
        api_key: when set, every endpoint but /health needs `Authorization: Bearer <api_key>` (401 otherwise).
        max_request_bytes: the largest request body accepted (413 beyond, before it is read).
        chat_template_timeout_s: seconds one chat-template render may take (its worker is killed beyond: 400).
        grammar_limits: each guided-decoding grammar's budget (`GrammarLimits`: seconds, compiled bytes kept).
        max_sequences: the most sequences one request may start, prompts × n (400 beyond).
    Raises:
        ValueError: an empty `api_key`, a `max_request_bytes` or `max_sequences` < 1 or a `chat_template_timeout_s`
            not > 0.
    """
    if max_request_bytes < 1:
        raise ValueError(f"max_request_bytes must be ≥ 1, got {max_request_bytes}")
    if api_key is not None and not api_key:
        raise ValueError("the API key is empty: give a non-empty key, or None to serve without one")
    server = OpenAIServer(llm, served_model_name or llm.engine_dir.resolve().name, max_request_bytes,
                          chat_template_timeout_s, grammar_limits, max_sequences)
    # No redirects for a trailing slash: a 307 has no error body, and clients that do not follow it see nothing.
    app = FastAPI(title="nextn", summary="OpenAI-compatible server of an nextn engine", redirect_slashes=False)
    app.state.server = server
    app.add_exception_handler(RequestValidationError, lambda _, e: p.validation_error(e).response())
    app.add_exception_handler(p.APIError, lambda _, e: e.response())
    app.add_exception_handler(HTTPException, _http_error)
    app.add_exception_handler(Exception, _internal_error)

    async def completions(raw: Request) -> Response:
        return await server.completions(await server.parse(raw, p.CompletionRequest), raw)

    async def chat(raw: Request) -> Response:
        return await server.chat(await server.parse(raw, p.ChatCompletionRequest), raw)

    app.post("/v1/completions", response_model=None)(completions)
    app.post("/v1/chat/completions", response_model=None)(chat)
    app.get("/v1/models")(server.models)
    async def health() -> Response:  # on the event loop: no thread needed, however busy the thread pool is
        return Response(status_code=200)

    app.get("/health")(health)
    app.get("/metrics")(lambda: Response(server.metrics.exposition(), media_type=server.metrics.content_type))
    if api_key is not None:
        app.add_middleware(ApiKeyMiddleware, api_key=api_key)
    app.add_middleware(CountRequests, metrics=server.metrics, paths={r.split()[1] for r in ROUTES})
    return app
