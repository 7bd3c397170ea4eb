"""Shared checks for the tests of every drafter: a broken acceptance rule (to show a distribution test has power),
the batch-independence of a seeded request, and incremental drafts against a fresh prefill's."""

from __future__ import annotations

import torch

from nextn.runtime.sampling_params import SamplingParams

#: Prompts that share the batch with the request under test in `same_seed_same_output_whatever_the_batch`.
OTHER_PROMPTS = [[3, 4], list(range(20, 45)), [7] * 9]


def accept_every_draft(target_probs: torch.Tensor, draft_tokens: torch.Tensor, accept_u: torch.Tensor,
                       sample_u: torch.Tensor, draft_probs: torch.Tensor | None = None):
    """A wrong rule with `rejection_sampling`'s signature: emits all K drafts unverified plus a token from p.

    Monkeypatched over `nextn.speculative.acceptance_rules.rejection_sampling`, it must make a chi-square test of the
    output distribution fail; otherwise that test could not detect a lossy rule.
    """
    from nextn.speculative.acceptance_reference import _emit
    from nextn.plugins.sampling import sample_from_probs

    k = draft_tokens.shape[1]
    return _emit(draft_tokens, sample_from_probs(target_probs, sample_u), draft_tokens.new_full(draft_tokens.shape[:1], k))


def same_seed_same_output_whatever_the_batch(llm, prompt: list[int], params: SamplingParams) -> None:
    """Assert that a seeded request gives the same tokens alone and amid other requests, and others with another seed.

    Raises:
        AssertionError: the output depends on the batch, or ignores the seed.
    """
    alone = llm.generate(prompt, params).outputs[0].token_ids
    batch = llm.generate(OTHER_PROMPTS[:2] + [prompt] + OTHER_PROMPTS[2:],
                         [SamplingParams(max_tokens=30, temperature=1.0, seed=9), SamplingParams(max_tokens=5),
                          params, SamplingParams(max_tokens=12, temperature=0.5, top_k=3, seed=5)])
    assert batch[2].outputs[0].token_ids == alone
    assert llm.generate(prompt, params.model_copy(update={"seed": 4321})).outputs[0].token_ids != alone


def check_drafts_against_fresh_prefill(engine, num_draft_tokens: int, check_drafter_state: bool = False) -> int:
    """Run the engine's queued greedy requests to the end, asserting after every step that each unfinished request's
    drafts (built incrementally over the paged cache, with rewinds) equal the drafts of a fresh prefill over its
    accepted sequence: the drafter's KV cache holds no stale rejected entries.

    Args:
        engine: an `Engine` with requests added and not yet stepped.
        num_draft_tokens: the drafter's K; the fresh KV cache holds the sequence plus 2K + 1 rows.
        check_drafter_state: also compare the runner's per-slot drafter state buffers (a dynamic tree's parents and
            depths) with the fresh prefill's.

    Returns:
        The number of (request, step) pairs checked.

    Raises:
        AssertionError: a token, a draft or (with `check_drafter_state`) a state row differs from the fresh prefill's.
    """
    from nextn.speculative.acceptance_rules import StandardAcceptance, greedy_sampling
    from nextn.models.kv_cache import allocate_kv_cache
    from nextn.speculative.chain_step import prefill_step

    checked = 0
    while engine.has_work:
        plan = engine.scheduler.schedule()
        reqs = engine.scheduler.requests_of(plan)
        result = engine.runner.run(plan)
        for req, slot, emitted, drafts in zip(reqs, plan.batch_slots, result.emitted, result.drafts):
            req.append(emitted, engine.max_seq_len)
            req.draft_tokens = drafts
            if req.finished:
                continue
            seq = req.all_token_ids[:-1]
            kv = allocate_kv_cache(engine.model.num_cache_layers, 1 + -(-(len(seq) + 2 * num_draft_tokens + 1) // 16),
                                   16, engine.cfg.kv_cache_dim, torch.float32)
            table = torch.arange(1, kv.shape[1] // 16)[None]
            with torch.inference_mode():
                ref = prefill_step(engine.model, engine.drafter, StandardAcceptance(), kv, torch.tensor([seq]),
                                   torch.tensor([len(seq)]), table, greedy_sampling(1), (), 16)
            assert ref.tokens[0].tolist() == [req.all_token_ids[-1]]
            assert ref.draft_tokens[0].tolist() == drafts, f"step {req.num_tokens}: stale drafter state"
            if check_drafter_state:
                for buf, fresh in zip(engine.runner.state, ref.drafter_state):
                    assert buf[slot].tolist() == fresh[0].tolist()
            checked += 1
        engine.scheduler.forget_scheduled()  # applied here by hand
        engine.scheduler.finish_done()
    return checked


def greedy_outputs(llm, prompts, params) -> list[list[int]]:
    """Each prompt's output token ids from one `generate` over all of them (a batch)."""
    return [o.outputs[0].token_ids for o in llm.generate(prompts, params)]


def staggered_outputs(llm, prompts, params) -> list[list[int]]:
    """Output token ids when one request joins before each step until all have, then steps until all finish."""
    pending, ids, outs = list(zip(prompts, params)), [], {}
    while pending or llm.has_unfinished_requests:
        if pending:
            ids.append(llm.add_request(*pending.pop(0)))
        outs.update({o.request_id: o for o in llm.step()})
    return [outs[i].outputs[0].token_ids for i in ids]


#: The tiny Llama's own greedy continuation of [17, 42, 99, 5, 61, 8] * 5 (`testing.tiny_llama`): it loops, so copying
#: drafters (n-gram, suffix) predict what it samples at temperature 1 about half the time, while the next tokens
#: stay spread (top-1 ~0.4) — a prompt on which a distribution test of those drafters has power.
LOOPING = [17, 42, 99, 5, 61, 8] * 5 + [231, 111, 101, 298, 272, 73, 42, 254, 297] * 2 + [111, 101] + [66, 106, 200, 28] * 3


def sampled_token_counts(llm, n: int, params: dict, prompt: list[int] = LOOPING) -> list:
    """Counts of the first three sampled tokens over `n` seeds (seed = 0..n−1) of `prompt`: [Counter] × 3."""
    from collections import Counter

    sps = [SamplingParams(max_tokens=3, ignore_eos=True, seed=s, **params) for s in range(n)]
    outs = llm.generate([prompt] * n, sps)
    return [Counter(o.outputs[0].token_ids[j] for o in outs) for j in range(3)]
