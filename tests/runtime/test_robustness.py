"""Issue 12, runtime: every bad request is a named error at the edge, and a request that makes an engine step fail
(whatever the cause) fails alone — the others finish with exactly their solo outputs, the KV cache comes back full,
and the LLM stays usable."""

from __future__ import annotations

import math

import numpy as np
import pytest

import nextn.speculative.acceptance_rules as acceptance_rules
from nextn import LLM, SamplingParams
from nextn.runtime.engine import RequestError
from nextn.runtime.model_runner import ModelRunner
from nextn.runtime.sampling_params import SamplingParamsError
from nextn.testing import SMALL_VOCAB as SMALL

MTP3 = {"decoding_type": "MTP", "num_nextn_predict_layers": 3}
VOCAB = SMALL["vocab_size"]
BAD_SEED = 987_654_321
GOOD = [[5, 6, 7], [8, 9, 10, 11, 12], [3, 4], [20, 21, 22, 23]]
GOOD_PARAMS = [SamplingParams(max_tokens=24, ignore_eos=True),
               SamplingParams(max_tokens=24, temperature=0.8, seed=11, ignore_eos=True),
               SamplingParams(max_tokens=20, temperature=1.0, top_k=5, seed=3, ignore_eos=True),
               SamplingParams(max_tokens=22, temperature=0.7, top_p=0.9, seed=5, ignore_eos=True)]


@pytest.fixture(scope="module")
def small_engine(checkpoints):
    return checkpoints.engine(build={"max_seq_len": 64}, num_mtp_modules=1, **SMALL)


@pytest.fixture(scope="module")
def llm(small_engine):
    return LLM(small_engine, speculative_config=MTP3, device="cpu")


@pytest.fixture(scope="module")
def solo(llm):
    """Each good request run alone."""
    return [llm.generate(p, sp).outputs[0].token_ids for p, sp in zip(GOOD, GOOD_PARAMS)]


def _kv_full(llm) -> bool:
    pool = llm.engine.pool
    return pool.num_free == pool.num_blocks - 1 and not llm.engine.has_work


# SamplingParams at the edge ----------------------------------------------------------------------------------
@pytest.mark.parametrize("kwargs,fragment", [
    (dict(top_k=2**70), "top_k"), (dict(top_k=-1), "top_k"), (dict(top_k=3.0), "must be an int"),
    (dict(top_k=np.int64(3)), "convert it with int()"), (dict(max_tokens=True), "got bool"),
    (dict(max_tokens=2.0), "must be an int"), (dict(max_tokens=2**40), "max_tokens must be in"),
    (dict(seed=2**64), "seed must be in"), (dict(seed=-1), "seed must be ≥ 0"), (dict(seed=True), "got bool"),
    (dict(temperature=math.nan), "finite"), (dict(temperature=math.inf), "finite"), (dict(temperature="1"), "number"),
    (dict(temperature=1e-30), "use 0 for greedy"), (dict(temperature=1e300), "temperature must be in"),
    (dict(temperature=10**400), "too large"), (dict(top_p=0.0), "top_p"), (dict(top_p=math.nan), "finite"),
    (dict(top_p=1.5), "top_p"), (dict(end_id=-1), "end_id"), (dict(end_id=2**63), "end_id"),
    (dict(stop_token_ids=[1, 2**70]), r"stop_token_ids\[1\]"), (dict(stop_token_ids="12"), "list of ints"),
    (dict(stop_token_ids=list(range(2000))), "at most 1024"), (dict(stop_token_ids=[False]), "got bool"),
    (dict(ignore_eos=1), "True or False"), (dict(detokenize="yes"), "True or False"), (dict(top_q=0.5), "top_q"),
])
def test_sampling_params_fields_are_checked_for_type_and_range(kwargs, fragment):
    with pytest.raises(SamplingParamsError, match=fragment):
        SamplingParams(**kwargs)


def test_sampling_params_in_range_are_accepted():
    sp = SamplingParams(temperature=1, top_p=np.float64(0.5), seed=2**63 - 1, stop_token_ids=(3, 4), max_tokens=2**31 - 1)
    assert sp.temperature == 1.0 and sp.stop_token_ids == [3, 4]


@pytest.mark.parametrize("kwargs,fragment", [
    (dict(temperature=1.0, top_k=VOCAB + 1), "exceeds the vocabulary size"),
    (dict(end_id=VOCAB), "end_id"), (dict(stop_token_ids=[1, VOCAB + 7]), "stop_token_ids"),
    (dict(max_tokens=65), "exceeds max_seq_len 64"),
])
def test_sampling_params_are_checked_against_the_engine(llm, kwargs, fragment):
    with pytest.raises(RequestError, match=fragment) as e:
        llm.add_request([1, 2, 3], SamplingParams(**kwargs))
    assert isinstance(e.value, SamplingParamsError)  # the servers catch either
    assert not llm.engine.has_work


def test_params_that_skip_validation_are_caught_when_the_request_is_made(llm):
    for bad in (SamplingParams.model_construct(top_k=2**70), SamplingParams().model_copy(update={"seed": 2**64}),
                SamplingParams.model_construct(temperature=math.nan), {"max_tokens": 3}):
        with pytest.raises(RequestError):
            llm.add_request([1, 2, 3], bad)
    assert not llm.engine.has_work


# Prompts at the edge -----------------------------------------------------------------------------------------
@pytest.mark.parametrize("prompt,fragment", [
    ([1.5, 2], "prompt\\[0\\] is float"), ([True, 2], "prompt\\[0\\] is bool"), ([1, np.int64(2)], "numpy.int64"),
    ([1, None], "prompt\\[1\\] is NoneType"), (np.array([1, 2]), "tolist"), (b"abc", "bytes"),
    (bytearray(b"ab"), "bytearray"), (7, "got int"), (None, "got NoneType"), ({"a": 1}, "got dict"),
    ("\ud800", "lone surrogate"), ("ok \udfff", "lone surrogate"), ([2**70], "outside the vocabulary"),
    ((), "empty prompt"),
])
def test_bad_prompts_are_named_errors(llm, prompt, fragment):
    with pytest.raises(RequestError, match=fragment):
        llm.add_request(prompt)
    assert not llm.engine.has_work


def test_generate_reports_bad_prompts_and_runs_the_others(llm, solo):
    outs = llm.generate([GOOD[0], b"bytes", [1.0, 2.0], GOOD[1], "\ud800"],
                        [GOOD_PARAMS[0], GOOD_PARAMS[0], GOOD_PARAMS[0], GOOD_PARAMS[1], GOOD_PARAMS[0]])
    assert [o.outputs[0].finish_reason for o in outs] == ["length", "error", "error", "length", "error"]
    assert [outs[0].outputs[0].token_ids, outs[3].outputs[0].token_ids] == solo[:2]
    one = llm.generate([1.5, 2])  # a single token-id prompt, still one output
    assert one.outputs[0].finish_reason == "error" and "float" in one.outputs[0].error
    assert _kv_full(llm)


# Failure isolation -------------------------------------------------------------------------------------------
def _check_isolated(llm, solo, outs, fragment):
    bad = outs[1].outputs[0]
    assert bad.finish_reason == "error" and fragment in bad.error
    assert [o.outputs[0].token_ids for o in [outs[0], *outs[2:]]] == solo
    assert all(o.outputs[0].finish_reason == "length" for o in [outs[0], *outs[2:]])
    assert _kv_full(llm)


def test_a_request_that_breaks_sampling_fails_alone(llm, solo, monkeypatch):
    """The issue's case, by fault injection: sampling raises whenever the bad request's seed is in the batch."""
    real = acceptance_rules.counter_uniform

    def faulty(seed, counter, stream):
        if bool((seed == BAD_SEED).any()):
            raise ValueError("Overflow when unpacking long long")
        return real(seed, counter, stream)

    monkeypatch.setattr(acceptance_rules, "counter_uniform", faulty)
    bad = SamplingParams(max_tokens=24, temperature=1.0, seed=BAD_SEED)
    outs = llm.generate([GOOD[0], [9, 9, 9], *GOOD[1:]], [GOOD_PARAMS[0], bad, *GOOD_PARAMS[1:]])
    _check_isolated(llm, solo, outs, "Overflow when unpacking long long")
    monkeypatch.undo()
    assert [o.outputs[0].token_ids for o in llm.generate(GOOD, GOOD_PARAMS)] == solo  # usable after


def test_a_fault_after_several_decode_steps_keeps_the_others_exact(llm, solo, monkeypatch):
    """The fault hits the step read-back (overlap scheduler: a step is in flight) on the bad request's third decode
    step: the others' tokens of the lost steps are recomputed exactly, the bad one keeps what it had."""
    real = ModelRunner.read_back
    seen = {"decode": 0}

    def faulty(self, step):
        if step.plan.kind == "decode" and BAD_SEED in step.plan.seeds:
            seen["decode"] += 1
            if seen["decode"] >= 3:
                raise RuntimeError("injected read-back fault")
        return real(self, step)

    monkeypatch.setattr(ModelRunner, "read_back", faulty)
    bad = SamplingParams(max_tokens=24, seed=BAD_SEED, ignore_eos=True)
    outs = llm.generate([GOOD[0], [9, 9, 9], *GOOD[1:]], [GOOD_PARAMS[0], bad, *GOOD_PARAMS[1:]])
    _check_isolated(llm, solo, outs, "injected read-back fault")
    assert outs[1].outputs[0].token_ids  # tokens before the fault are kept


def test_a_transient_fault_fails_nobody(llm, solo, monkeypatch):
    real = ModelRunner.launch
    calls = {"n": 0}

    def once(self, batch, prev=None):
        calls["n"] += 1
        if calls["n"] == 4:
            raise RuntimeError("transient")
        return real(self, batch, prev)

    monkeypatch.setattr(ModelRunner, "launch", once)
    outs = llm.generate(GOOD, GOOD_PARAMS)
    assert [o.outputs[0].token_ids for o in outs] == solo and calls["n"] > 4
    assert _kv_full(llm)


def test_a_persistent_batch_fault_ends_with_errors_not_a_loop(small_engine, monkeypatch):
    """A fault that needs two requests together is never found alone: after 3 tries both end with "error"."""
    llm = LLM(small_engine, speculative_config=None, device="cpu")
    real = ModelRunner.launch

    def pair(self, batch, prev=None):
        if batch.num_requests > 1:
            raise RuntimeError("needs the batch")
        return real(self, batch, prev)

    monkeypatch.setattr(ModelRunner, "launch", pair)
    outs = llm.generate(GOOD[:2], SamplingParams(max_tokens=40, ignore_eos=True))
    finish = [o.outputs[0].finish_reason for o in outs]
    assert "error" in finish and all(f in ("error", "length") for f in finish)
    assert _kv_full(llm)


def test_the_engine_loop_isolates_a_failing_request(small_engine, solo, monkeypatch):
    real = acceptance_rules.counter_uniform

    def faulty(seed, counter, stream):
        if bool((seed == BAD_SEED).any()):
            raise RuntimeError("injected fault")
        return real(seed, counter, stream)

    monkeypatch.setattr(acceptance_rules, "counter_uniform", faulty)
    llm = LLM(small_engine, speculative_config=MTP3, device="cpu")
    try:
        handles = [llm.generate_async(p, sp) for p, sp in zip(GOOD, GOOD_PARAMS)]
        bad = llm.generate_async([9, 9], SamplingParams(max_tokens=24, temperature=1.0, seed=BAD_SEED))
        assert bad.result(timeout=120).outputs[0].finish_reason == "error"
        assert [h.result(timeout=120).outputs[0].token_ids for h in handles] == solo
        monkeypatch.undo()
        assert llm.generate_async(GOOD[0], GOOD_PARAMS[0]).result(timeout=120).outputs[0].token_ids == solo[0]
        assert llm.engine.pool.num_free == llm.engine.pool.num_blocks - 1
    finally:
        llm.shutdown()


def test_a_text_prompt_too_long_for_any_tokenization_is_refused_before_tokenizing():
    from nextn.runtime.request_validation import max_token_bytes, prompt_token_ids

    class Tok:  # the longest vocabulary entry is 4 bytes: 64 tokens hold at most 256 characters
        class tok:
            @staticmethod
            def get_vocab():
                return {"a": 0, "abcd": 1, "é": 2}

        calls = 0

        def encode(self, text):
            Tok.calls += 1
            return [0] * len(text)

    tok = Tok()
    assert max_token_bytes(tok) == 4
    with pytest.raises(RequestError, match="257 characters"):
        prompt_token_ids("x" * 257, tok, vocab_size=8, max_seq_len=64)
    assert Tok.calls == 0  # refused without tokenizing
    with pytest.raises(RequestError, match="max_seq_len is 64"):
        prompt_token_ids("x" * 100, tok, vocab_size=8, max_seq_len=64)  # tokenized, then too long
    assert prompt_token_ids("xy", tok, vocab_size=8, max_seq_len=64) == ("xy", [0, 0])
