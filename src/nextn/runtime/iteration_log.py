"""The per-iteration statistics an engine logs (`print_iter_log`) or records (`Engine.iteration_log`).

One dict per applied step: its kind and size, tokens emitted, requests finished, free KV blocks, waiting requests,
latency from launch to applied (ms), and for a decode step its draft length (a ragged step: also each row's,
`draft_lens`), for a prefill step the tokens computed
and reused (prefix cache), and the prefix cache's cumulative hit rate (vLLM's).
"""

from __future__ import annotations

import time

from nextn.runtime.model_runner import InflightStep, StepResult
from nextn.runtime.scheduler import Scheduler
from nextn.runtime.step_plan import DecodePlan


def iteration_entry(step: InflightStep, result: StepResult, num_finished: int, scheduler: Scheduler) -> dict:
    """The log entry of `step`, just applied (`result` its read-back, `num_finished` the requests it finished)."""
    plan, pool = step.plan, scheduler.pool
    entry: dict[str, object] = {"kind": plan.kind, "num_requests": plan.num_requests, "num_finished": num_finished,
             "num_emitted": sum(len(e) for e in result.emitted), "free_blocks": pool.num_free,
             "num_waiting": len(scheduler.waiting), "latency_ms": (time.perf_counter() - step.launch_time) * 1e3}
    if isinstance(plan, DecodePlan):
        entry["draft_len"], entry["drafting"] = result.draft_len, plan.drafting
        if plan.draft_lens:
            entry["draft_lens"] = list(plan.draft_lens)
    else:
        entry["num_prefill_tokens"] = sum(e - s for s, e in zip(plan.chunk_starts, plan.chunk_ends))
        entry["num_reused_tokens"] = sum(plan.num_reused)
        entry["drafting"] = plan.drafting
    if pool.cache is not None:  # cumulative, over every admission so far (vLLM's hit rate)
        entry["prefix_cache_hit_rate"] = round(pool.cache.stats.hit_rate, 4)
    return entry
