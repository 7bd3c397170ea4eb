"""Bad input gets a clear error and loses nothing; KV-cache pressure preempts and resumes without corruption."""

from __future__ import annotations

import pytest

from nextn.testing import SMALL_VOCAB as SMALL
from nextn import LLM, SamplingParams
from nextn.config.llm_args import LlmArgsError
from nextn.runtime.sampling_params import SamplingParamsError

MTP3 = {"decoding_type": "MTP", "num_nextn_predict_layers": 3}


@pytest.fixture(scope="module")
def small_engine(checkpoints):
    return checkpoints.engine(build={"max_seq_len": 64}, num_mtp_modules=1, **SMALL)


@pytest.fixture(scope="module")
def llm(small_engine):
    return LLM(small_engine, speculative_config=MTP3)


@pytest.mark.parametrize("kwargs,fragment", [
    (dict(max_tokens=0), "max_tokens must be ≥ 1"),
    (dict(max_tokens=-3), "max_tokens must be ≥ 1"),
    (dict(temperature=-1.0), "temperature must be ≥ 0"),
    (dict(top_q=0.5), "top_q"),
])
def test_invalid_sampling_params(kwargs, fragment):
    with pytest.raises(SamplingParamsError, match=fragment):
        SamplingParams(**kwargs)


@pytest.mark.parametrize("prompt,fragment", [
    ([], "empty prompt"),
    ("", "empty prompt"),
    ([1, 2, 99999], "outside the vocabulary"),
    ([-1, 2], "outside the vocabulary"),
    (list(range(1, 70)), "max_seq_len is 64"),
    ("text needs a tokenizer", "no tokenizer"),
])
def test_bad_prompt_errors_and_others_keep_running(llm, prompt, fragment):
    good = [[5, 6, 7], [8, 9, 10, 11, 12]]
    alone = llm.generate(good, SamplingParams(max_tokens=12, ignore_eos=True))
    outs = llm.generate([good[0], prompt, good[1]], SamplingParams(max_tokens=12, ignore_eos=True))
    bad = outs[1].outputs[0]
    assert bad.finish_reason == "error" and fragment in bad.error and bad.token_ids == []
    assert [outs[0].outputs[0].token_ids, outs[2].outputs[0].token_ids] == [o.outputs[0].token_ids for o in alone]
    assert all(o.outputs[0].finish_reason == "length" for o in (outs[0], outs[2]))


def test_max_seq_len_ends_a_request_with_length(llm):
    out = llm.generate(list(range(1, 61)), SamplingParams(max_tokens=50, ignore_eos=True))
    assert out.outputs[0].finish_reason == "length"
    assert len(out.prompt_token_ids) + len(out.outputs[0].token_ids) == 64


def test_stop_token_is_emitted_and_ends_the_request(llm):
    full = llm.generate([3, 4, 5], SamplingParams(max_tokens=20, ignore_eos=True)).outputs[0].token_ids
    stop = full[5]
    out = llm.generate([3, 4, 5], SamplingParams(max_tokens=20, stop_token_ids=[stop])).outputs[0]
    assert out.token_ids == full[: full.index(stop) + 1] and out.finish_reason == "stop"


def test_full_kv_cache_preempts_and_resumes_losslessly(small_engine):
    prompts = [[i, i + 1, i + 2, i + 3] for i in range(10, 80, 10)]
    params = SamplingParams(max_tokens=40, ignore_eos=True)
    roomy = LLM(small_engine, speculative_config=MTP3).generate(prompts, params)
    tight = LLM(small_engine, speculative_config=MTP3, kv_cache_config={"max_tokens": 128, "tokens_per_block": 8})
    outs = tight.generate(prompts, params)
    assert tight.engine.scheduler.num_preemptions > 0
    assert [o.outputs[0].token_ids for o in outs] == [o.outputs[0].token_ids for o in roomy]
    assert tight.engine.pool.num_free == tight.engine.pool.num_blocks - 1  # every block returned


def test_prompt_larger_than_the_whole_cache_is_rejected(small_engine):
    llm = LLM(small_engine, speculative_config=None, kv_cache_config={"max_tokens": 16, "tokens_per_block": 8})
    out = llm.generate(list(range(1, 40)), SamplingParams(max_tokens=4)).outputs[0]
    assert out.finish_reason == "error" and "kv_cache_config.max_tokens" in out.error


def test_speculative_config_errors(small_engine, checkpoints):
    with pytest.raises(LlmArgsError, match="num_nextn_predict_layer"):
        LLM(small_engine, speculative_config={"decoding_type": "MTP", "num_nextn_predict_layer": 3})
    with pytest.raises(LlmArgsError, match="exceeds the engine's 1 MTP modules"):
        LLM(small_engine, speculative_config={"decoding_type": "MTP", "num_nextn_predict_layers": 2,
                                              "use_mtp_vanilla": True})


def test_sequence_outgrowing_the_whole_cache_ends_with_an_error_and_others_finish(small_engine):
    llm = LLM(small_engine, speculative_config=MTP3, kv_cache_config={"max_tokens": 40, "tokens_per_block": 8})
    outs = llm.generate([[5, 6, 7], [8, 9]], [SamplingParams(max_tokens=50, ignore_eos=True),
                                              SamplingParams(max_tokens=5, ignore_eos=True)])
    long, short = outs[0].outputs[0], outs[1].outputs[0]
    assert long.finish_reason == "error" and "kv_cache_config.max_tokens" in long.error
    assert 0 < len(long.token_ids) < 50  # what it generated before the cache ran out is kept
    assert short.finish_reason == "length" and len(short.token_ids) == 5
    assert llm.engine.pool.num_free == llm.engine.pool.num_blocks - 1
