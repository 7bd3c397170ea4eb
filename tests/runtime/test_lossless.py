"""Greedy decoding is lossless: MTP Eagle (K = 1, 2, 3) and MTP Vanilla give token-identical outputs to plain decoding,
which is token-identical to Hugging Face `generate(do_sample=False)`, for a batch of prompts of different lengths."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoTokenizer
from transformers import DeepseekV3ForCausalLM as HFDeepseekV3

from nextn import LLM, SamplingParams
from nextn.cli.prompts import load_prompts
from nextn.testing.spec_checks import check_drafts_against_fresh_prefill

DISTILL_STEPS = 150
MAX_TOKENS = 40


def _prompts() -> list[str]:
    prompts, _ = load_prompts(5)  # MT-bench first turns when ../shared/data is present
    return [prompts[0], prompts[1][:40], prompts[2][:15], prompts[3], "Hi"]  # different lengths


@pytest.fixture(scope="module")
def eagle_engine(checkpoints):
    return checkpoints.engine(distill_steps=DISTILL_STEPS, num_mtp_modules=1)


@pytest.fixture(scope="module")
def vanilla_engine(checkpoints):
    return checkpoints.engine(distill_steps=DISTILL_STEPS, num_mtp_modules=3)


def _generate(engine, spec, prompts, **kw):
    llm = LLM(engine, speculative_config=spec, **kw)
    return llm.generate(prompts, SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True))


def _mtp(k: int, vanilla: bool = False) -> dict:
    return {"decoding_type": "MTP", "num_nextn_predict_layers": k, "use_mtp_vanilla": vanilla}


def test_plain_decoding_matches_transformers(eagle_engine, checkpoints):
    prompts = _prompts()
    outs = _generate(eagle_engine, None, prompts)
    ckpt = checkpoints.checkpoint(DISTILL_STEPS, num_mtp_modules=1)
    tok = AutoTokenizer.from_pretrained(ckpt)
    hf = HFDeepseekV3.from_pretrained(ckpt).eval()
    assert len({len(o.prompt_token_ids) for o in outs}) >= 4
    for prompt, out in zip(prompts, outs):
        ids = tok(prompt, return_tensors="pt").input_ids
        assert ids[0].tolist() == out.prompt_token_ids
        with torch.inference_mode():
            ref = hf.generate(ids, max_new_tokens=MAX_TOKENS, min_new_tokens=MAX_TOKENS, do_sample=False,
                              pad_token_id=tok.eos_token_id)
        assert out.outputs[0].token_ids == ref[0, ids.shape[1]:].tolist()
        assert out.outputs[0].text == tok.decode(out.outputs[0].token_ids, skip_special_tokens=True)


@pytest.mark.parametrize("k", [1, 2, 3])
def test_mtp_eagle_is_lossless(eagle_engine, k):
    prompts = _prompts()
    plain = _generate(eagle_engine, None, prompts)
    mtp = _generate(eagle_engine, _mtp(k), prompts)
    for a, b in zip(plain, mtp):
        assert b.outputs[0].token_ids == a.outputs[0].token_ids
        assert b.outputs[0].num_draft_tokens == k * b.outputs[0].num_decode_steps
    accepted = sum(o.outputs[0].num_accepted_draft_tokens for o in mtp)
    assert accepted > 0, "the distilled MTP module should get drafts accepted (multi-token steps exercised)"
    assert sum(len(o.outputs[0].token_ids) for o in mtp) / sum(o.outputs[0].num_decode_steps + 1 for o in mtp) > 1.2


def test_mtp_vanilla_is_lossless(vanilla_engine):
    prompts = _prompts()
    plain = _generate(vanilla_engine, None, prompts)
    llm = LLM(vanilla_engine, speculative_config=_mtp(3))
    assert type(llm.engine.drafter).__name__ == "MtpVanillaDrafter"  # 3 modules → Vanilla by default
    mtp = llm.generate(prompts, SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True))
    for a, b in zip(plain, mtp):
        assert b.outputs[0].token_ids == a.outputs[0].token_ids
    assert sum(o.outputs[0].num_accepted_draft_tokens for o in mtp) > 0


def test_forced_vanilla_on_one_module_with_k1(eagle_engine):
    prompts = _prompts()
    plain = _generate(eagle_engine, None, prompts)
    mtp = _generate(eagle_engine, _mtp(1, vanilla=True), prompts)
    assert [o.outputs[0].token_ids for o in mtp] == [o.outputs[0].token_ids for o in plain]


@pytest.mark.parametrize("which,k", [("eagle", 3), ("vanilla", 3)])
def test_incremental_drafts_equal_drafts_from_scratch(eagle_engine, vanilla_engine, which, k):
    """After every step, the drafter's drafts (built incrementally over the paged cache, with rewinds) equal the
    drafts of a fresh prefill over the accepted sequence: the MTP KV cache holds no stale rejected entries."""
    llm = LLM(eagle_engine if which == "eagle" else vanilla_engine, speculative_config=_mtp(k))
    eng = llm.engine
    for p in _prompts():
        eng.add_request(eng.make_request(p, SamplingParams(max_tokens=24, ignore_eos=True)))
    checked = check_drafts_against_fresh_prefill(eng, k)
    assert checked > 20
