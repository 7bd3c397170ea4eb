"""Penalties, logit bias, min_tokens, grammars and log-probabilities with every drafter on: greedy outputs equal plain
decoding with the same parameters, token for token; log-probabilities equal within float tolerance; sampled outputs
keep the processed distribution (chi-square, with a lossy control that fails it)."""

from __future__ import annotations

import json
from collections import Counter

import pytest

from nextn import LLM, SamplingParams
from nextn.runtime.sampling_params import GuidedDecodingParams
from nextn.testing.chi_square import chi_square_two_sample_pvalue
from nextn.testing.spec_checks import LOOPING, OTHER_PROMPTS

PROCESSED = [
    SamplingParams(max_tokens=24, ignore_eos=True),  # no processing, in the same batch
    SamplingParams(max_tokens=24, ignore_eos=True, presence_penalty=1.5, frequency_penalty=0.5),
    SamplingParams(max_tokens=24, ignore_eos=True, repetition_penalty=1.8, logprobs=3),
    SamplingParams(max_tokens=24, logit_bias={17: 4.0, 42: 3.0, 5: -50.0}, min_tokens=20, logprobs=0),
]
PROMPTS = [LOOPING, LOOPING[:20], OTHER_PROMPTS[1], LOOPING[5:40]]


def _outputs(llm, prompts=PROMPTS, params=PROCESSED):
    return [o.outputs[0] for o in llm.generate(prompts, params)]


def _check_same(plain, spec):
    for i, (a, b) in enumerate(zip(plain, spec)):
        assert a.token_ids == b.token_ids, i
        assert (a.logprobs is None) == (b.logprobs is None), i
        for x, y in zip(a.logprobs or [], b.logprobs or []):
            assert x.token_id == y.token_id and x.logprob == pytest.approx(y.logprob, abs=1e-4), i
            assert [t for t, _ in x.top] == [t for t, _ in y.top], i
            assert [lp for _, lp in x.top] == pytest.approx([lp for _, lp in y.top], abs=1e-4), i


@pytest.mark.parametrize("spec", [
    {"decoding_type": "NGram", "max_draft_len": 4, "max_matching_ngram_size": 3},
    {"decoding_type": "Suffix", "max_draft_len": 6},
    "draft_target",
])
def test_greedy_processing_with_a_drafter_equals_plain_decoding(llama_engine, spec):
    if spec == "draft_target":  # the engine drafts for itself: the drafts are its unprocessed argmax
        spec = {"decoding_type": "Draft_Target", "max_draft_len": 3, "speculative_model_dir": str(llama_engine)}
    plain = _outputs(LLM(llama_engine, speculative_config=None))
    llm = LLM(llama_engine, speculative_config=spec)
    got = _outputs(llm)
    _check_same(plain, got)
    assert sum(c.num_accepted_draft_tokens for c in got) > 0, "drafts must be accepted for this to mean anything"
    unprocessed = _outputs(LLM(llama_engine, speculative_config=None),
                           params=[SamplingParams(max_tokens=24, ignore_eos=True)] * 4)
    assert all(a.token_ids != b.token_ids for a, b in zip(plain[1:], unprocessed[1:])), "processing had no effect"
    assert len(plain[3].logprobs) == len(plain[3].token_ids) and plain[3].logprobs[0].top == []
    assert all(lp.logprob <= 0 and len(lp.top) == 3 for lp in plain[2].logprobs)


def test_min_tokens_and_bias_do_what_they_say(llama_engine):
    llm = LLM(llama_engine, speculative_config=None)
    [out] = _outputs(llm, [LOOPING], [SamplingParams(max_tokens=12, logit_bias={99: 100.0}, ignore_eos=True)])
    assert out.token_ids == [99] * 12
    [out] = _outputs(llm, [LOOPING], [SamplingParams(max_tokens=12, min_tokens=12, end_id=99,
                                                     logit_bias={99: 100.0})])
    assert 99 not in out.token_ids and len(out.token_ids) == 12  # the end token is masked before min_tokens


@pytest.mark.parametrize("engine,spec", [
    ("eagle", {"decoding_type": "MTP", "num_nextn_predict_layers": 1}),
    ("medusa_engine", {"decoding_type": "Medusa", "medusa_choices": [[0], [1], [0, 0], [0, 1], [1, 0], [0, 0, 0]]}),
])
def test_greedy_processing_with_model_drafters_equals_plain_decoding(request, engine, spec):
    path = request.getfixturevalue(engine)
    prompts = [[11, 12, 13, 14, 15, 16, 17], [30, 31, 32], [7, 8, 9, 10], [5, 6]]
    params = [SamplingParams(max_tokens=20, ignore_eos=True, **kw) for kw in (
        {}, {"presence_penalty": 1.0, "frequency_penalty": 0.7}, {"repetition_penalty": 2.0, "logprobs": 2},
        {"logit_bias": {3: 2.0, 4: 2.0}, "min_tokens": 5, "logprobs": 0})]
    plain = _outputs(LLM(path, speculative_config=None), prompts, params)
    got = _outputs(LLM(path, speculative_config=spec), prompts, params)
    _check_same(plain, got)


LOGPROB_PROMPT = [11, 12, 13, 14, 15]


def test_logprobs_are_the_models_log_softmax(eagle):
    """Each emitted token's log-probability equals log_softmax of the model's logits for the sequence before it."""
    import torch

    llm = LLM(eagle, speculative_config={"decoding_type": "MTP", "num_nextn_predict_layers": 1})
    [out] = _outputs(llm, [LOGPROB_PROMPT], [SamplingParams(max_tokens=6, ignore_eos=True, logprobs=2,
                                                            temperature=0.5, seed=3)])
    seq = LOGPROB_PROMPT + out.token_ids
    logits = llm.prompt_logits(seq)  # [len(seq), V]
    for i, lp in enumerate(out.logprobs):
        row = torch.log_softmax(logits[len(LOGPROB_PROMPT) + i - 1].float() / 0.5, -1)
        assert lp.logprob == pytest.approx(row[out.token_ids[i]].item(), abs=2e-3)
        assert [t for t, _ in lp.top] == row.topk(2).indices.tolist()


SCHEMA = {"type": "object", "properties": {"color": {"enum": ["red", "green", "blue"]}, "ok": {"type": "boolean"},
                                           "size": {"enum": [1, 2, 3]}},
          "required": ["color", "ok", "size"], "additionalProperties": False}


@pytest.fixture(scope="module")
def tokenized(checkpoints):
    """A tiny DeepSeek-V3 with the real DeepSeek-V3 tokenizer (129,280-row vocabulary) and one MTP module."""
    pytest.importorskip("xgrammar")
    return checkpoints.engine(distill_steps=0)


def test_json_schema_output_validates_and_equals_plain_decoding(tokenized):
    jsonschema = pytest.importorskip("jsonschema")
    guided = SamplingParams(max_tokens=48, guided_decoding=GuidedDecodingParams(json=SCHEMA))
    prompts = ["Give me a color:", "JSON please", "Once upon a time"]
    plain = LLM(tokenized, speculative_config=None).generate(prompts, guided)
    for spec in ({"decoding_type": "MTP", "num_nextn_predict_layers": 1},
                 {"decoding_type": "NGram", "max_draft_len": 4}):
        got = LLM(tokenized, speculative_config=spec).generate(prompts, guided)
        assert [o.outputs[0].token_ids for o in got] == [o.outputs[0].token_ids for o in plain], spec
    for o in plain:
        jsonschema.validate(json.loads(o.outputs[0].text), SCHEMA)
        assert o.outputs[0].finish_reason == "stop"


def test_regex_and_choice_grammars(tokenized):
    llm = LLM(tokenized, speculative_config={"decoding_type": "NGram", "max_draft_len": 3})
    [a, b] = llm.generate(["x", "y"], [
        SamplingParams(max_tokens=16, guided_decoding=GuidedDecodingParams(regex=r"[0-9]{3}-[a-c]{2}")),
        SamplingParams(max_tokens=16, guided_decoding=GuidedDecodingParams(choice=["alpha", "beta"]))])
    import re

    assert re.fullmatch(r"[0-9]{3}-[a-c]{2}", a.outputs[0].text), a.outputs[0].text
    assert b.outputs[0].text in ("alpha", "beta")


def test_a_bad_grammar_fails_its_request_only(tokenized):
    llm = LLM(tokenized, speculative_config=None)
    bad, good = llm.generate(["x", "y"], [SamplingParams(guided_decoding=GuidedDecodingParams(grammar="root ::= (")),
                                          SamplingParams(max_tokens=3, ignore_eos=True)])
    assert bad.outputs[0].finish_reason == "error" and "cannot be compiled" in bad.outputs[0].error
    assert len(good.outputs[0].token_ids) == 3


# Sampling ---------------------------------------------------------------------------------------------------------
# The token that most often continues the looping prompt (so the n-gram drafts propose it) is banned (bias −100):
# processed correctly it never appears; a rule that leaves the later verified positions unprocessed lets it through.
POSITIONS = range(1, 6)


def _counts(llm, n, params):
    sps = [SamplingParams(max_tokens=6, ignore_eos=True, seed=s, **params) for s in range(n)]
    outs = llm.generate([LOOPING] * n, sps)
    return [Counter(o.outputs[0].token_ids[j] for o in outs) for j in range(6)], outs


@pytest.mark.slow
def test_sampling_with_processing_keeps_the_processed_distribution(llama_engine, monkeypatch):
    n = 600
    ngram = {"decoding_type": "NGram", "max_draft_len": 3, "max_matching_ngram_size": 3}
    unbanned, _ = _counts(LLM(llama_engine, speculative_config=None, max_batch_size=64), 200, dict(temperature=1.0))
    ban, seen = sum(unbanned[1:], Counter()).most_common(1)[0]
    assert seen > 100, "the ban must matter for the control to mean anything"
    biased = dict(temperature=1.0, logit_bias={ban: -100.0, 17: 2.0, 42: 2.0}, presence_penalty=0.8)
    plain, _ = _counts(LLM(llama_engine, speculative_config=None, max_batch_size=64), n, biased)
    spec, outs = _counts(LLM(llama_engine, speculative_config=ngram, max_batch_size=64), n, biased)
    assert sum(o.outputs[0].num_accepted_draft_tokens for o in outs) > 100  # later positions come from verify steps
    for j in POSITIONS:
        assert chi_square_two_sample_pvalue(plain[j], spec[j]) > 1e-3, (j, plain[j].most_common(5),
                                                                        spec[j].most_common(5))
    assert all(c[ban] == 0 for c in plain + spec)
    # The control: processing only the first verified position (the later ones as the raw model has them) is lossy,
    # and these checks see it.
    import nextn.runtime.logits_processors as lp

    original = lp.RequestProcessor.positions

    def first_only(self, drafts, width, **kw):
        mult, add, masks = original(self, drafts, width, **kw)
        return [e for e in mult if e[0] == 0], [e for e in add if e[0] == 0], masks

    monkeypatch.setattr(lp.RequestProcessor, "positions", first_only)
    lossy, _ = _counts(LLM(llama_engine, speculative_config=ngram, max_batch_size=64), n, biased)
    assert sum(c[ban] for c in lossy) > 0 or min(chi_square_two_sample_pvalue(plain[j], lossy[j])
                                                 for j in POSITIONS) < 1e-3


@pytest.mark.slow
def test_sampling_under_a_grammar_keeps_the_masked_distribution(tokenized, monkeypatch):
    """Sampled outputs of a regex grammar over the letters a-d, the prompt the letters' cycle (so n-gram drafts are
    grammatical and get accepted: the later tokens come out of verify steps), against plain decoding per position;
    then a lossy control that masks only the first verified position and fails the same checks."""
    import re

    n, regex = 400, r"[a-d]{6}"
    prompt = [67, 68, 69, 70] * 16  # "abcd" × 16, one token per letter in the DeepSeek-V3 tokenizer
    ngram = {"decoding_type": "NGram", "max_draft_len": 3, "max_matching_ngram_size": 2}
    sps = [SamplingParams(max_tokens=8, temperature=1.0, seed=s, guided_decoding=GuidedDecodingParams(regex=regex))
           for s in range(n)]

    def counts(llm):
        outs = llm.generate([prompt] * n, sps)
        per_pos = [Counter(o.outputs[0].token_ids[j] for o in outs if len(o.outputs[0].token_ids) > j)
                   for j in range(4)]
        return per_pos, outs

    plain, _ = counts(LLM(tokenized, speculative_config=None, max_batch_size=64))
    got, outs = counts(LLM(tokenized, speculative_config=ngram, max_batch_size=64))
    assert all(re.fullmatch(regex, o.outputs[0].text) for o in outs)
    # the model prefers multi-letter tokens, so single-letter drafts are accepted now and then: enough for verify
    # steps to emit later tokens (and for the control below to be caught)
    assert sum(o.outputs[0].num_accepted_draft_tokens for o in outs) > 10
    for j in (1, 2, 3):
        assert chi_square_two_sample_pvalue(plain[j], got[j]) > 1e-3, (j, plain[j].most_common(5),
                                                                      got[j].most_common(5))
    import nextn.runtime.logits_processors as lp

    original = lp.RequestProcessor._masks

    def first_only(self, drafts, width):
        masks = original(self, drafts, width)
        if masks is not None:
            masks[1:] = -1  # later positions unmasked: lossy
        return masks

    monkeypatch.setattr(lp.RequestProcessor, "_masks", first_only)
    lossy, outs = counts(LLM(tokenized, speculative_config=ngram, max_batch_size=64))
    assert (not all(re.fullmatch(regex, o.outputs[0].text) for o in outs)
            or min(chi_square_two_sample_pvalue(plain[j], lossy[j]) for j in (1, 2, 3)) < 1e-3)
