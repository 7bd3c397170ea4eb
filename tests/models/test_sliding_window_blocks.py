"""Blocks behind the sliding window go back to the pool (issue 60): a model whose every KV-cache layer slides (a tiny
random Mistral, window 16, made by `transformers` at test time) decodes far past a KV cache that could never hold
the whole sequence, token for token as `transformers` float32 does, plain and with NGram drafts; without the release
the same request fails on the same cache (the control), and a model with full-attention layers does not release."""

from __future__ import annotations

import pytest
import torch

from nextn import LLM, SamplingParams
from nextn.build.engine_builder import build_engine
from nextn.testing.tiny_families import save_tiny

PROMPT = [1] + [100 + (7 * i) % 23 for i in range(39)]  # 40 tokens
NEW = 120  # 160 in all: the cache below holds 56
SMALL_CACHE = {"tokens_per_block": 8, "max_tokens": 64, "enable_block_reuse": False}


@pytest.fixture(scope="module")
def mistral(tmp_path_factory, tokenizer_dir):
    out = tmp_path_factory.mktemp("mistral_window")
    hf = save_tiny("mistral", out / "hf", tokenizer_dir)
    assert hf.config.sliding_window == 16
    with torch.no_grad():
        want = hf.generate(torch.tensor([PROMPT]), max_new_tokens=NEW, do_sample=False, pad_token_id=0,
                           eos_token_id=None)[0, len(PROMPT):].tolist()
    build_engine(out / "hf", out / "engine", dtype="float32", quant_algo=None, max_seq_len=256, progress=False)
    return out / "engine", want


@pytest.mark.parametrize("spec,reuse", [(None, False), ({"decoding_type": "NGram", "max_draft_len": 4}, False),
                                        (None, True)])
def test_decodes_past_a_cache_smaller_than_the_sequence(mistral, spec, reuse):
    """Twice in a row: with prefix caching the released blocks are parked, found or evicted like any other."""
    engine, want = mistral
    llm = LLM(engine, device="cpu", speculative_config=spec, kv_cache_config={**SMALL_CACHE,
                                                                              "enable_block_reuse": reuse})
    assert llm.engine.scheduler.kv_window == 16 and llm.engine.pool.capacity_tokens < len(PROMPT) + NEW
    outs = [llm.generate(PROMPT, SamplingParams(max_tokens=NEW, ignore_eos=True)).outputs[0] for _ in range(2)]
    free_after = llm.engine.pool.num_free
    llm.shutdown()
    assert all(o.finish_reason == "length" and o.token_ids == want for o in outs)
    assert free_after == llm.engine.pool.num_blocks - 1  # every block back, the released ones counted once


def test_without_the_release_the_cache_is_too_small(mistral):
    engine, _ = mistral
    llm = LLM(engine, device="cpu", speculative_config=None, kv_cache_config=SMALL_CACHE)
    llm.engine.scheduler.kv_window = None
    out = llm.generate(PROMPT, SamplingParams(max_tokens=NEW, ignore_eos=True)).outputs[0]
    llm.shutdown()
    assert out.finish_reason == "error" and len(out.token_ids) < NEW


def test_a_model_with_full_attention_layers_keeps_its_blocks(tmp_path, tokenizer_dir):
    """Its pool blocks stay (full layers read them); its sliding layers' rows get blocks of their own
    (tests/models/test_sliding_rows.py)."""
    save_tiny("gemma2", tmp_path / "hf", tokenizer_dir)  # sliding and full layers alternate
    build_engine(tmp_path / "hf", tmp_path / "engine", dtype="float32", quant_algo=None, max_seq_len=256,
                 progress=False)
    llm = LLM(tmp_path / "engine", device="cpu", speculative_config=None)
    assert llm.engine.scheduler.kv_window is None and llm.engine.pool.sliding.rows == (0, 2)
    llm.shutdown()


def test_nextns_kernels_read_the_window_past_released_blocks(mistral, tmp_path):
    """A W4A8 engine (nextn's int4 kernels, its paged attention): the small cache decodes as a cache that holds it
    all, plain and with NGram drafts."""
    from nextn.plugins import woq_linear

    if not woq_linear.available():
        pytest.skip(f"nextn's int4 CPU kernels are unavailable here: {woq_linear.unavailable_reason()}")
    engine, _ = mistral
    build_engine(engine.parent / "hf", tmp_path / "w4a8", quant_algo="W4A8", max_seq_len=256, progress=False)
    params = SamplingParams(max_tokens=NEW, ignore_eos=True)
    outs = {}
    for spec in (None, {"decoding_type": "NGram", "max_draft_len": 4}):
        for cache in ({}, SMALL_CACHE):
            llm = LLM(tmp_path / "w4a8", device="cpu", speculative_config=spec, kv_cache_config=cache)
            outs[str(spec), bool(cache)] = llm.generate(PROMPT, params).outputs[0].token_ids
            llm.shutdown()
    assert len(set(map(tuple, outs.values()))) == 1 and len(outs["None", True]) == NEW
