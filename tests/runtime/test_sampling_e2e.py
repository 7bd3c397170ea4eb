"""Sampling end to end: MTP with rejection sampling keeps the target's token distribution; seeds are per request;
relaxed acceptance is strict outside the thinking phase."""

from __future__ import annotations

from collections import Counter

import pytest

from nextn.testing.chi_square import chi_square_two_sample_pvalue
from nextn import LLM, SamplingParams
from nextn.testing import SMALL_VOCAB

MTP3 = {"decoding_type": "MTP", "num_nextn_predict_layers": 3}
PROMPT = [11, 12, 13, 14, 15]


@pytest.fixture(scope="module")
def engine(checkpoints):
    return checkpoints.engine(distill_steps=150, num_mtp_modules=1, **SMALL_VOCAB)


def _positions(llm: LLM, n: int, params: dict) -> list[Counter]:
    sps = [SamplingParams(max_tokens=3, ignore_eos=True, seed=s, **params) for s in range(n)]
    outs = llm.generate([PROMPT] * n, sps)
    return [Counter(o.outputs[0].token_ids[j] for o in outs) for j in range(3)]


# The random-init tiny model's logits have a standard deviation of ~0.16, so temperature 1 is nearly uniform over
# the vocabulary and drafts would (correctly) almost never be accepted; these temperatures give the target a spread
# but peaked distribution (top-1 probability ~0.1–0.8), like a trained model at temperature ~1.
@pytest.mark.parametrize("params", [dict(temperature=0.07), dict(temperature=0.1, top_k=20, top_p=0.9)])
def test_mtp_keeps_the_token_distribution(engine, params):
    n = 2000
    plain = _positions(LLM(engine, speculative_config=None, max_batch_size=64), n, params)
    llm = LLM(engine, speculative_config=MTP3, max_batch_size=64)
    mtp = _positions(llm, n, params)
    for j in (1, 2):  # the second and third generated tokens come out of the verify-and-draft step
        assert chi_square_two_sample_pvalue(plain[j], mtp[j]) > 1e-3, (j, plain[j].most_common(5), mtp[j].most_common(5))
    assert len(plain[1]) > 5, "the test needs a spread distribution to mean anything"
    # Drafts were really accepted (otherwise this would only test plain sampling twice).
    stats = llm.generate([PROMPT] * 64, [SamplingParams(max_tokens=8, seed=s, ignore_eos=True, **params) for s in range(64)])
    assert sum(o.outputs[0].num_accepted_draft_tokens for o in stats) > 20


def test_always_accepting_drafts_would_fail_the_distribution_check(engine, monkeypatch):
    """The check above has power: emitting the drafts unverified changes the distribution detectably."""
    import nextn.speculative.acceptance_rules as rules
    from nextn.testing.spec_checks import accept_every_draft

    n = 2000
    plain = _positions(LLM(engine, speculative_config=None, max_batch_size=64), n, dict(temperature=0.07))
    monkeypatch.setattr(rules, "rejection_sampling", accept_every_draft)
    broken = _positions(LLM(engine, speculative_config=MTP3, max_batch_size=64), n, dict(temperature=0.07))
    assert chi_square_two_sample_pvalue(plain[1], broken[1]) < 1e-6


@pytest.mark.parametrize("spec", [None, MTP3])
def test_same_seed_same_output_whatever_the_batch(engine, spec):
    from nextn.testing.spec_checks import same_seed_same_output_whatever_the_batch as check

    check(LLM(engine, speculative_config=spec), PROMPT,
          SamplingParams(max_tokens=24, temperature=0.1, top_p=0.95, seed=1234, ignore_eos=True))


def test_relaxed_acceptance_is_strict_outside_thinking_and_with_zero_delta(engine):
    sp = SamplingParams(max_tokens=30, ignore_eos=True)
    prompts = [PROMPT, [30, 31, 32]]
    plain = [o.outputs[0].token_ids for o in LLM(engine, speculative_config=None).generate(prompts, sp)]
    relaxed = {**MTP3, "use_relaxed_acceptance_for_thinking": True, "relaxed_topk": 5, "relaxed_delta": 0.5,
               "begin_thinking_phase_token": 500, "end_thinking_phase_token": 501}
    outside = LLM(engine, speculative_config=relaxed).generate(prompts, sp)  # no <think> anywhere: strict
    assert [o.outputs[0].token_ids for o in outside] == plain
    zero = LLM(engine, speculative_config={**relaxed, "relaxed_delta": 0.0})
    inside = zero.generate([[500, *PROMPT], [500, 30, 31, 32]], sp)  # thinking, but delta 0: strict
    ref = LLM(engine, speculative_config=None).generate([[500, *PROMPT], [500, 30, 31, 32]], sp)
    assert [o.outputs[0].token_ids for o in inside] == [o.outputs[0].token_ids for o in ref]


def test_relaxed_acceptance_in_thinking_accepts_at_least_as_much(engine):
    sp = SamplingParams(max_tokens=40, ignore_eos=True)
    relaxed = {**MTP3, "use_relaxed_acceptance_for_thinking": True, "relaxed_topk": 10, "relaxed_delta": 0.9,
               "begin_thinking_phase_token": 500, "end_thinking_phase_token": 501}
    prompts = [[500, *PROMPT], [500, 30, 31, 32], [500, 40]]
    strict = LLM(engine, speculative_config=MTP3).generate(prompts, sp)
    loose = LLM(engine, speculative_config=relaxed).generate(prompts, sp)
    al = lambda outs: sum(len(o.outputs[0].token_ids) for o in outs) / sum(o.outputs[0].num_decode_steps + 1 for o in outs)  # noqa: E731
    assert al(loose) >= al(strict)
    assert all(o.outputs[0].acceptance_rate_per_position for o in loose)
