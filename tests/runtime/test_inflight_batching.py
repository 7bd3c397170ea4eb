"""In-flight batching with chunked prefill: requests arriving between steps, with a KV cache too small for all of
them, get exactly the tokens each gets alone; prompts prefilled chunk by chunk under a small token budget give the
unchunked outputs and the unchunked first drafts (the MTP KV is filled from the true tokens at chunk boundaries)."""

from __future__ import annotations

import pytest

from nextn import LLM, SamplingParams
from nextn.config.llm_args import LlmArgsError

MTP = lambda k, vanilla=False: {"decoding_type": "MTP", "num_nextn_predict_layers": k, "use_mtp_vanilla": vanilla}  # noqa: E731
LONG = [[(7 * i + j) % 500 + 3 for j in range(n)] for i, n in enumerate([37, 23, 5, 41])]


def staggered(llm: LLM, prompts, params, every: int = 1) -> list[list[int]]:
    pending, ids, outs, n = list(zip(prompts, params)), [], {}, 0
    while pending or llm.has_unfinished_requests:
        if pending and n % every == 0:
            ids.append(llm.add_request(*pending.pop(0)))
        for out in llm.step():
            outs[out.request_id] = out
        n += 1
    return [outs[i].outputs[0].token_ids for i in ids]


def test_staggered_arrivals_with_a_small_kv_cache_match_each_request_alone(eagle):
    prompts = [[i, i + 1, i + 2, i + 3, i + 4] for i in range(10, 60, 10)]
    params = [SamplingParams(max_tokens=18, ignore_eos=True), SamplingParams(max_tokens=18, temperature=0.9, top_k=5, seed=3)] * 3
    alone_llm = LLM(eagle, speculative_config=MTP(3))
    alone = [alone_llm.generate(p, sp).outputs[0].token_ids for p, sp in zip(prompts, params)]
    tight = LLM(eagle, speculative_config=MTP(3), kv_cache_config={"max_tokens": 96, "tokens_per_block": 8},
                enable_chunked_prefill=True, max_num_tokens=8)
    assert staggered(tight, prompts, params) == alone
    assert tight.engine.scheduler.num_preemptions > 0
    assert tight.engine.pool.num_free == tight.engine.pool.num_blocks - 1


@pytest.mark.parametrize("which,spec", [("eagle", None), ("eagle", MTP(3)), ("vanilla", MTP(2))])
@pytest.mark.parametrize("overlap", [False, True])
def test_chunked_prefill_equals_unchunked(request, which, spec, overlap):
    engine = request.getfixturevalue(which)
    sp = SamplingParams(max_tokens=12, ignore_eos=True)
    ref = LLM(engine, speculative_config=spec).generate(LONG, sp)
    llm = LLM(engine, speculative_config=spec, enable_chunked_prefill=True, max_num_tokens=9,
              disable_overlap_scheduler=not overlap)
    llm.engine.iteration_log = []
    outs = staggered(llm, LONG, [sp] * len(LONG), every=2)
    assert outs == [o.outputs[0].token_ids for o in ref]
    prefills = [e for e in llm.engine.iteration_log if e["kind"] == "prefill"]
    assert len(prefills) >= sum(-(-len(p) // 9) for p in LONG) // 2 and max(e["num_prefill_tokens"] for e in prefills) <= 9
    assert {e["kind"] for e in llm.engine.iteration_log} == {"prefill", "decode"}


@pytest.mark.parametrize("which,spec", [("eagle", MTP(3)), ("vanilla", MTP(2))])
def test_chunked_prefill_gives_the_unchunked_first_drafts(request, which, spec):
    """The drafts after the last chunk equal those after one whole-prompt prefill: no stale MTP KV at chunk ends."""
    engine = request.getfixturevalue(which)
    drafts = []
    for kw in ({}, {"enable_chunked_prefill": True, "max_num_tokens": 6}):
        eng = LLM(engine, speculative_config=spec, disable_overlap_scheduler=True, **kw).engine
        reqs = [eng.make_request(p, SamplingParams(max_tokens=4, ignore_eos=True)) for p in LONG]
        for r in reqs:
            eng.add_request(r)
        firsts = {}
        while len(firsts) < len(reqs):
            eng.step()
            firsts.update({r.request_id: list(r.draft_tokens) for r in reqs
                           if len(r.output_token_ids) == 1 and r.request_id not in firsts})
        drafts.append([firsts[r.request_id] for r in reqs])
    assert drafts[0] == drafts[1]


def test_chunk_budget_must_exceed_the_vanilla_overlap(vanilla):
    with pytest.raises(LlmArgsError, match="max_num_tokens=2"):
        LLM(vanilla, speculative_config=MTP(2), enable_chunked_prefill=True, max_num_tokens=2)
