"""Tensor and expert parallelism on 2 gloo ranks (CPU): `LLM(..., tensor_parallel_size=2)` starts its worker rank
itself, and greedy outputs are token-identical to one process — plain decoding, n-gram drafting, MTP."""

from __future__ import annotations

import contextlib

import pytest

from nextn import LLM, SamplingParams
from nextn.testing import SMALL_VOCAB

SP = SamplingParams(max_tokens=12, ignore_eos=True)
PROMPTS = [[5, 6, 7, 8, 5, 6, 7], [9], list(range(20, 50))]


def tokens(llm: LLM) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in llm.generate(PROMPTS, SP)]


@contextlib.contextmanager
def parallel_llm(engine, **kwargs):
    llm = LLM(engine, **kwargs)
    try:
        yield llm
    finally:
        llm._workers.close()


@pytest.mark.parametrize("engine", ["llama_engine", "qwen2_engine"])
def test_llama_family_tp2_equals_one_rank(engine, request):
    """Heads (GQA: one KV head a rank), MLP columns/rows, the vocabulary (Qwen2: tied, odd size, q/k/v biases)."""
    path = request.getfixturevalue(engine)
    ref = tokens(LLM(path, speculative_config=None))
    ngram = {"decoding_type": "NGram", "max_draft_len": 3}
    with parallel_llm(path, speculative_config=ngram, tensor_parallel_size=2) as llm:
        assert llm.engine.model.model.layers[0].self_attn.num_kv_heads == 1
        out = llm.generate(PROMPTS, SP)
        assert [o.outputs[0].token_ids for o in out] == ref
        assert sum(o.outputs[0].num_accepted_draft_tokens for o in out) > 0  # drafts verified, some accepted


@pytest.mark.parametrize("ep", [1, 2])
def test_deepseek_v3_mtp_tp2_equals_one_rank(checkpoints, ep):
    """MLA heads, dense MLP, MoE (ep=1: experts split by columns; ep=2: by id), the MTP module, MTP Eagle drafts."""
    engine = checkpoints.engine(distill_steps=150, num_mtp_modules=1, **SMALL_VOCAB)
    mtp = {"decoding_type": "MTP", "num_nextn_predict_layers": 2}
    ref = LLM(engine, speculative_config=mtp).generate(PROMPTS, SP)
    with parallel_llm(engine, speculative_config=mtp, tensor_parallel_size=2, moe_expert_parallel_size=ep) as llm:
        out = llm.generate(PROMPTS, SP)
    assert [o.outputs[0].token_ids for o in out] == [o.outputs[0].token_ids for o in ref]
    assert [o.outputs[0].num_accepted_draft_tokens for o in out] == [o.outputs[0].num_accepted_draft_tokens
                                                                    for o in ref]


def test_prefix_cache_hits_and_chunked_prefill_stay_in_step(llama_engine):
    """The second run of a prompt reuses cached blocks (workers rebuild the n-gram history from the plan's
    num_reused); prompts prefilled in 16-token chunks alternate with decode steps of the others."""
    prompts = [list(range(30, 90)), [7, 8, 9, 7, 8, 9, 7]]
    opts = {"enable_chunked_prefill": True, "max_num_tokens": 16, "kv_cache_config": {"tokens_per_block": 8}}
    ref = [o.outputs[0].token_ids for o in LLM(llama_engine, speculative_config=None).generate(prompts, SP)]
    ngram = {"decoding_type": "NGram", "max_draft_len": 3}
    with parallel_llm(llama_engine, speculative_config=ngram, tensor_parallel_size=2, **opts) as llm:
        first = llm.generate(prompts, SP)
        again = llm.generate(prompts[0], SP)
    assert [o.outputs[0].token_ids for o in first] == ref and again.outputs[0].token_ids == ref[0]
    assert again.num_cached_tokens > 0


def test_deepseek_v3_mtp_vanilla_tp2_equals_one_rank(checkpoints):
    """Two MTP modules (MTP Vanilla): the per-request pools of hidden states and tokens stay in step on each rank."""
    engine = checkpoints.engine(num_mtp_modules=2, **SMALL_VOCAB)
    vanilla = {"decoding_type": "MTP", "num_nextn_predict_layers": 2, "use_mtp_vanilla": True}
    ref = [o.outputs[0].token_ids for o in LLM(engine, speculative_config=vanilla).generate(PROMPTS, SP)]
    with parallel_llm(engine, speculative_config=vanilla, tensor_parallel_size=2) as llm:
        assert [o.outputs[0].token_ids for o in llm.generate(PROMPTS, SP)] == ref
