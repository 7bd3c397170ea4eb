"""The client side of `python -m nextn.bench.serve`: streamed requests to an OpenAI-compatible server and the
serving metrics of one measured level (`vllm bench serve`'s definitions).

One request is a streamed chat completion (or completion) of `max_tokens` tokens, greedy (`temperature: 0`) or
sampled (`Sampling`: temperature, top-p, top-k, and a seed per prompt so that a request samples the same on each
server that keeps seeds and on each pass), with
`ignore_eos` (an extra field that nextn serve, vLLM and llama-server accept) and `stream_options.include_usage`,
so the output token count is the server's `usage.completion_tokens`, not the number of chunks (a speculative step
may stream several tokens in one chunk). Each request opens its own connection (no keep-alive). Times are
`time.perf_counter` seconds from the request's send:
- TTFT: the first chunk that carries text;
- ITL (inter-token latency): the gaps between successive chunks that carry text;
- TPOT: (e2e − TTFT) / (output tokens − 1), for requests of at least 2 tokens;
- output tokens/s and requests/s of a level: totals over the level's wall time (first send to last response).
Percentiles are nearest-rank on the sorted values (`sorted[int(n·q)]`, as trtllm-bench's and bench/report.py's).

A level sends `num_requests` requests, prompt i mod len(prompts) each, at most `concurrency` in flight; with a
finite `request_rate` they arrive as a Poisson process of that rate (exponential gaps, seeded), else all at once
(then `concurrency` is the number of clients, each sending its next request when the last one finished). A chat
request may carry the conversation before its prompt (`history`: earlier user turns and the server's answers).
"""

from __future__ import annotations

import asyncio
import random
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

#: Seconds one request may take before it is counted as failed (a server that hangs does not hang the benchmark).
DEFAULT_REQUEST_TIMEOUT_S = 600.0
#: A chat message: {"role": "user" | "assistant", "content": text}.
Message = dict[str, str]


@dataclass(frozen=True)
class RequestResult:
    """One request's outcome. Times in seconds from its send; `chunk_times_s` are the arrivals of text chunks."""

    prompt_index: int
    ok: bool
    e2e_s: float
    output_tokens: int = 0
    ttft_s: float | None = None
    chunk_times_s: tuple[float, ...] = ()
    text: str = ""
    error: str | None = None

    @property
    def tpot_s(self) -> float | None:
        """(e2e − TTFT) / (output tokens − 1); None for a failed request or one of fewer than 2 tokens."""
        if not self.ok or self.ttft_s is None or self.output_tokens < 2:
            return None
        return (self.e2e_s - self.ttft_s) / (self.output_tokens - 1)

    @property
    def itl_s(self) -> list[float]:
        """Gaps between successive text chunks (one fewer than the chunks)."""
        t = self.chunk_times_s
        return [b - a for a, b in zip(t, t[1:])]


def percentile(values: list[float], q: float) -> float:
    """Nearest-rank percentile `sorted(values)[int(n·q)]` (q in [0, 1]); 0.0 for no values."""
    if not values:
        return 0.0
    s = sorted(values)
    return s[min(len(s) - 1, int(len(s) * q))]


@dataclass(frozen=True)
class LevelMetrics:
    """The serving metrics of one level (one pass). Times in ms, rates per second; 0 where nothing was measured."""

    num_requests: int
    num_failed: int
    wall_s: float
    output_tokens: int
    output_tok_s: float
    requests_per_s: float
    ttft_ms_p50: float
    ttft_ms_p99: float
    tpot_ms_p50: float
    tpot_ms_p99: float
    itl_ms_p50: float
    itl_ms_p99: float
    ttft_ms_mean: float
    tpot_ms_mean: float
    errors: tuple[str, ...] = field(default=())

    def to_dict(self) -> dict[str, Any]:
        d = {k: getattr(self, k) for k in self.__dataclass_fields__}
        d["errors"] = list(self.errors)
        return d


def level_metrics(results: list[RequestResult], wall_s: float) -> LevelMetrics:
    """Metrics of a level from its requests' results and its wall time (seconds, > 0).

    Only requests that succeeded count toward tokens, rates and latencies; failures are counted and their first
    few errors kept.
    """
    ok = [r for r in results if r.ok]
    ttft = [r.ttft_s * 1e3 for r in ok if r.ttft_s is not None]
    tpot = [r.tpot_s * 1e3 for r in ok if r.tpot_s is not None]
    itl = [g * 1e3 for r in ok for g in r.itl_s]
    tokens = sum(r.output_tokens for r in ok)
    wall = max(wall_s, 1e-9)
    return LevelMetrics(
        num_requests=len(results), num_failed=len(results) - len(ok), wall_s=wall_s, output_tokens=tokens,
        output_tok_s=tokens / wall, requests_per_s=len(ok) / wall,
        ttft_ms_p50=percentile(ttft, 0.5), ttft_ms_p99=percentile(ttft, 0.99),
        tpot_ms_p50=percentile(tpot, 0.5), tpot_ms_p99=percentile(tpot, 0.99),
        itl_ms_p50=percentile(itl, 0.5), itl_ms_p99=percentile(itl, 0.99),
        ttft_ms_mean=sum(ttft) / len(ttft) if ttft else 0.0, tpot_ms_mean=sum(tpot) / len(tpot) if tpot else 0.0,
        errors=tuple(dict.fromkeys(r.error for r in results if r.error))[:5])


def open_client(base_url: str, timeout_s: float = DEFAULT_REQUEST_TIMEOUT_S):
    """An `openai.AsyncOpenAI` client for `base_url` (e.g. "http://127.0.0.1:8000/v1"), no retries.

    Raises:
        RuntimeError: the `openai` package is not installed (it is in nextn's `test` extra).
    """
    try:
        import openai
    except ImportError:
        raise RuntimeError("the serving benchmark drives servers with the `openai` client: pip install "
                           "'openai==3.54.0' (nextn's `test` extra)") from None
    # A new connection per request: llama-server closes an idle keep-alive connection after 5 s, httpx keeps one
    # for 5 s, and a request sent on a connection the server is closing fails. A loopback connect costs tens of µs.
    limits = type(openai.DEFAULT_CONNECTION_LIMITS)(max_connections=None, max_keepalive_connections=0)
    return openai.AsyncOpenAI(base_url=base_url, api_key="none", max_retries=0, timeout=timeout_s,
                              http_client=openai.DefaultAsyncHttpxClient(limits=limits, timeout=timeout_s))


@dataclass(frozen=True)
class Sampling:
    """What a request samples with (`vllm bench serve`'s --temperature / --top-p / --top-k); temperature 0 is greedy.
    A sampled request's seed is `seed` + its prompt's index."""

    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int = 0

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    def describe(self) -> str:
        if self.greedy:
            return "greedy"
        return (f"sampled (temperature {self.temperature:g}" + (f", top-p {self.top_p:g}" if self.top_p < 1 else "")
                + (f", top-k {self.top_k}" if self.top_k > 0 else "") + ", a seed per prompt)")

    def fields(self, prompt_index: int) -> tuple[dict[str, Any], dict[str, Any]]:
        """(OpenAI arguments, extra body fields) of a request for prompt `prompt_index`."""
        if self.greedy:
            return {"temperature": 0.0}, {}
        extra = {"top_k": self.top_k} if self.top_k > 0 else {}
        return {"temperature": self.temperature, "top_p": self.top_p, "seed": self.seed + prompt_index}, extra


GREEDY = Sampling()


async def send_request(client, model: str, prompt: str, prompt_index: int, max_tokens: int,
                       chat: bool = True, history: Sequence[Message] = (), sampling: Sampling = GREEDY
                       ) -> RequestResult:
    """Stream one request of `max_tokens` tokens (EOS ignored; greedy unless `sampling` says otherwise) and time its
    chunks; never raises for a
    failed request (it is returned with ok=False and the error). A chat request's messages are `history`, then
    `prompt` as the last user message.

    Raises:
        ValueError: a `history` for a completions request (`chat` False).
    """
    if history and not chat:
        raise ValueError("a conversation history needs the chat endpoint")
    fields, extra = sampling.fields(prompt_index)
    kwargs = dict(model=model, max_tokens=max_tokens, stream=True, stream_options={"include_usage": True},
                  extra_body={"ignore_eos": True, **extra}, **fields)
    t0 = time.perf_counter()
    times, parts, tokens = [], [], None
    try:
        if chat:
            messages = [*history, {"role": "user", "content": prompt}]
            stream = await client.chat.completions.create(messages=messages, **kwargs)
        else:
            stream = await client.completions.create(prompt=prompt, **kwargs)
        async for chunk in stream:
            now = time.perf_counter() - t0
            if chunk.usage is not None:
                tokens = chunk.usage.completion_tokens
            for choice in chunk.choices or ():
                piece = (choice.delta.content if chat and choice.delta is not None else getattr(choice, "text", None))
                if piece:
                    times.append(now)
                    parts.append(piece)
    except Exception as e:  # any failure of one request is that request's result, not the level's
        return RequestResult(prompt_index, ok=False, e2e_s=time.perf_counter() - t0,
                             error=f"{type(e).__name__}: {str(e)[:200]}")
    e2e = time.perf_counter() - t0
    if tokens is None:
        return RequestResult(prompt_index, ok=False, e2e_s=e2e, text="".join(parts),
                             error="the stream carried no usage (the server ignored stream_options.include_usage)")
    return RequestResult(prompt_index, ok=True, e2e_s=e2e, output_tokens=tokens, ttft_s=times[0] if times else None,
                         chunk_times_s=tuple(times), text="".join(parts))


async def run_level(client, model: str, prompts: list[str], num_requests: int, concurrency: int, max_tokens: int,
                    request_rate: float = float("inf"), chat: bool = True, seed: int = 0,
                    histories: Sequence[Sequence[Message] | None] | None = None, sampling: Sampling = GREEDY
                    ) -> tuple[list[RequestResult], float]:
    """Send `num_requests` requests (prompt i mod len(prompts)), at most `concurrency` in flight, arriving at
    `request_rate` per second (Poisson; inf = all at once). Returns the results in send order and the wall time
    in seconds from the first send to the last response.

    `histories[i]` (chat only; `num_requests` entries) is the conversation before request i's prompt; None there
    fails request i unsent (an earlier turn of its conversation failed).

    Raises:
        ValueError: `histories` of another length than `num_requests`.
    """
    if histories is not None and len(histories) != num_requests:
        raise ValueError(f"{len(histories)} histories for {num_requests} requests")
    gate = asyncio.Semaphore(concurrency)
    rng = random.Random(seed)
    arrivals, t = [], 0.0
    for _ in range(num_requests):
        arrivals.append(t)
        if request_rate != float("inf"):
            t += rng.expovariate(request_rate)

    async def one(i: int, start: float) -> RequestResult:
        delay = start - (time.perf_counter() - t0)
        if delay > 0:
            await asyncio.sleep(delay)
        history = () if histories is None else histories[i]
        if history is None:
            return RequestResult(i % len(prompts), ok=False, e2e_s=0.0,
                                 error="not sent: an earlier turn of its conversation failed")
        async with gate:
            return await send_request(client, model, prompts[i % len(prompts)], i % len(prompts), max_tokens, chat,
                                      history, sampling)

    t0 = time.perf_counter()
    results = await asyncio.gather(*(one(i, a) for i, a in enumerate(arrivals)))
    return list(results), time.perf_counter() - t0


async def served_model(client) -> str:
    """The first model id the server lists at /v1/models.

    Raises:
        RuntimeError: the server lists no model.
    """
    page = await client.models.list()
    ids = [m.id for m in page.data]
    if not ids:
        raise RuntimeError("the server lists no model at /v1/models")
    return ids[0]
