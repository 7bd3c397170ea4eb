"""Prometheus metrics of `nextn serve` (GET /metrics), on prometheus-client with one registry per server.

Names follow vLLM's (`spec_decode_num_drafts`, `..._accepted_tokens_per_pos`, `time_to_first_token_seconds`) under
the `nextn_` prefix; counters get prometheus-client's `_total` suffix. The speculative-decoding counters sum the
per-request statistics of `CompletionOutput` (trtllm-bench docs): DAR = accepted tokens / draft tokens, and
AL = (generation tokens) / (drafts + finished requests) when every request speculates. The prefix-cache counters
(vLLM's `prefix_cache_queries` / `prefix_cache_hits`, in tokens; hit rate = hits / queries) are read from the
engine's cumulative statistics at scrape time, so they count every admission (a preempted request's too).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

from prometheus_client import CollectorRegistry, disable_created_metrics, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily
from prometheus_client.exposition import CONTENT_TYPE_LATEST

from nextn.runtime.outputs import CompletionOutput
from nextn.runtime.prefix_cache import PrefixCacheStats

_TTFT_BUCKETS = (0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0, 2.0, 5.0, 10.0, 30.0, 60.0)  # seconds
_TPOT_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0, 2.0, 5.0)  # seconds


class ServerMetrics:
    """The server's counters, histograms and gauges.

    Args:
        free_blocks: returns the KV pool's free block count now (read at scrape time; unreferenced cached blocks
            count as free: an allocation may evict them).
        total_blocks: usable KV blocks (the null block excluded): free_blocks() equals it when no request runs.
        prefix_cache_stats: returns the engine's prefix-cache counters now (None: reuse off, counters stay 0).
    """

    content_type = CONTENT_TYPE_LATEST

    def __init__(self, free_blocks: Callable[[], int], total_blocks: int,
                 prefix_cache_stats: Callable[[], PrefixCacheStats | None] | None = None) -> None:
        disable_created_metrics()  # no `_created` series (process-wide; as vLLM's server does)
        self.registry = r = CollectorRegistry()
        self.http_requests = Counter("nextn_http_requests", "HTTP requests by endpoint and status code",
                                     ["endpoint", "status_code"], registry=r)
        self.finished = Counter("nextn_request_finished", "requests that ran in the engine, by finish reason "
                                "(stop, length, cancelled: client disconnected, error)", ["finish_reason"], registry=r)
        self.prompt_tokens = Counter("nextn_prompt_tokens", "prompt tokens of requests that ran", registry=r)
        self.generation_tokens = Counter("nextn_generation_tokens", "tokens generated", registry=r)
        self.ttft = Histogram("nextn_time_to_first_token_seconds", "time from arrival to the first token",
                              buckets=_TTFT_BUCKETS, registry=r)
        self.tpot = Histogram("nextn_time_per_output_token_seconds", "mean time per token after the first",
                              buckets=_TPOT_BUCKETS, registry=r)
        self.num_drafts = Counter("nextn_spec_decode_num_drafts", "verify-and-draft steps (decode steps that "
                                  "verified draft tokens)", registry=r)
        self.num_draft_tokens = Counter("nextn_spec_decode_num_draft_tokens", "draft tokens proposed", registry=r)
        self.num_accepted_tokens = Counter("nextn_spec_decode_num_accepted_tokens", "draft tokens accepted",
                                           registry=r)
        self.accepted_per_pos = Counter("nextn_spec_decode_num_accepted_tokens_per_pos", "draft tokens accepted "
                                        "at each draft position (0-based)", ["position"], registry=r)
        self.running = Gauge("nextn_num_requests_running", "requests submitted to the engine and not finished",
                             registry=r)
        Gauge("nextn_kv_cache_free_blocks", "free KV cache blocks", registry=r).set_function(free_blocks)
        Gauge("nextn_kv_cache_total_blocks", "usable KV cache blocks", registry=r).set(total_blocks)
        r.register(_PrefixCacheCollector(prefix_cache_stats or (lambda: None)))

    def record(self, completion: CompletionOutput, num_prompt_tokens: int, finish_reason: str) -> None:
        """Count one finished request (its statistics from the engine's final output)."""
        self.finished.labels(finish_reason=finish_reason).inc()
        self.prompt_tokens.inc(num_prompt_tokens)
        self.generation_tokens.inc(len(completion.token_ids))
        if completion.ttft_ms is not None:
            self.ttft.observe(completion.ttft_ms / 1e3)
        if completion.tpot_ms is not None:
            self.tpot.observe(completion.tpot_ms / 1e3)
        if completion.num_draft_tokens:
            self.num_drafts.inc(completion.num_decode_steps)
            self.num_draft_tokens.inc(completion.num_draft_tokens)
            self.num_accepted_tokens.inc(completion.num_accepted_draft_tokens)
            for pos, accepted in enumerate(completion.accepted_per_position):
                self.accepted_per_pos.labels(position=str(pos)).inc(accepted)

    def exposition(self) -> bytes:
        """The text exposition format of every metric."""
        return generate_latest(self.registry)


class _PrefixCacheCollector:
    """`nextn_prefix_cache_queries_total` / `nextn_prefix_cache_hits_total` (tokens) from the engine at scrape time."""

    def __init__(self, stats: Callable[[], PrefixCacheStats | None]) -> None:
        self.stats = stats

    def collect(self) -> Iterator[CounterMetricFamily]:
        s = self.stats() or PrefixCacheStats()
        yield CounterMetricFamily("nextn_prefix_cache_queries", "prompt tokens looked up in the prefix cache at "
                                  "admission (a preempted request's re-admission counts again)", value=s.queries)
        yield CounterMetricFamily("nextn_prefix_cache_hits", "of them, tokens whose KV was reused (hit rate = "
                                  "hits / queries)", value=s.hits)


class CountRequests:
    """ASGI middleware: count HTTP responses by endpoint and status (pure ASGI: streaming is left untouched)."""

    def __init__(self, app, metrics: ServerMetrics, paths: set[str]) -> None:
        self.app, self.metrics, self.paths = app, metrics, paths

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        endpoint = scope["path"] if scope["path"] in self.paths else "other"

        async def counting_send(message) -> None:
            if message["type"] == "http.response.start":
                self.metrics.http_requests.labels(endpoint=endpoint, status_code=str(message["status"])).inc()
            await send(message)

        await self.app(scope, receive, counting_send)
