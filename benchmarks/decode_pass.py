"""One timed greedy pass of an `LLM` over token-id prompts: tokens/s, acceptance length and draft acceptance rate.

Shared by the drafter comparison (`benchmarks/drafters.py`) and the MTP-tree bench (`benchmarks/mtp_tree_al.py`):
both time the same pass on every configuration so that their figures compare.
"""

from __future__ import annotations

import time


def run_nextn(llm, prompts: list[list[int]], max_tokens: int, batch: int) -> dict:
    """One pass over `prompts` (token ids) on `llm`, greedy, `max_tokens` new tokens each with EOS ignored.

    Batch 1: the prompts one after another, `tps` = decode tokens/s (tokens after the first over first-token →
    finish time, summed). Batch B > 1: the prompts in waves of B submitted together (every request emits
    `max_tokens`, so each wave decodes at batch B throughout), `tps` = new tokens over the wall time.
    Returns {"tps": float, "al": float (1 + accepted drafts / decode steps), "acceptance_rate": float (accepted /
    drafted, 0 without drafts), "tokens": list[list[int]] (each prompt's output ids)}.
    """
    from nextn import SamplingParams

    params = SamplingParams(max_tokens=max_tokens, ignore_eos=True, detokenize=False)
    t0 = time.perf_counter()
    if batch == 1:
        outs = [llm.generate([p], params)[0].outputs[0] for p in prompts]
        seconds = sum(o.finished_time - o.first_token_time for o in outs)
        tokens = sum(len(o.token_ids) - 1 for o in outs)
    else:
        outs = [r.outputs[0] for i in range(0, len(prompts), batch) for r in llm.generate(prompts[i:i + batch], params)]
        seconds, tokens = time.perf_counter() - t0, sum(len(o.token_ids) for o in outs)
    steps = sum(o.num_decode_steps for o in outs)
    drafts = sum(o.num_draft_tokens for o in outs)
    accepted = sum(o.num_accepted_draft_tokens for o in outs)
    return {"tps": tokens / seconds, "al": 1 + accepted / steps if steps else 1.0,
            "acceptance_rate": accepted / drafts if drafts else 0.0,
            "tokens": [list(o.token_ids) for o in outs]}


def best_of(llm, prompts: list, params, repeats: int) -> tuple[float, list[list[int]]]:
    """`llm.generate(prompts, params)` `repeats` times (after the caller's warm-up): (the fastest wall time in
    seconds, each request's output token ids of the last run)."""
    best, outputs = float("inf"), []
    for _ in range(repeats):
        t0 = time.perf_counter()
        outputs = llm.generate(prompts, params)
        best = min(best, time.perf_counter() - t0)
    return best, [list(o.outputs[0].token_ids) for o in outputs]
