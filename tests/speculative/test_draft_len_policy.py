"""Draft-length policies (TensorRT-LLM `draft_len_schedule`, `max_concurrency`, acceptance-rate gate): the
schedule's semantics, greedy outputs identical to plain decoding while K changes with the batch size, the switches
recorded in the iteration log and the request statistics, speculation off above `max_concurrency`."""

from __future__ import annotations

import pytest

from nextn import LLM, SamplingParams
from nextn.config.llm_args import LlmArgsError, MTPDecodingConfig
from nextn.speculative.draft_len_policy import (AcceptanceGate, BatchSizeDraftLen, ProposalDraftLen, StaticDraftLen,
                                               choose_draft_len_policy)
from nextn.testing import SMALL_VOCAB

PROMPTS = [[11, 12, 13, 14, 15], [30, 31, 32], [7, 8, 9, 10], [40, 41], [50, 51, 52, 53]]
SP = SamplingParams(max_tokens=16, ignore_eos=True)


def test_schedule_and_max_concurrency_semantics():
    p = BatchSizeDraftLen(4, {4: 4, 8: 2, 32: 1}, None)  # TensorRT-LLM's documented example
    assert [p.draft_len(b) for b in (1, 4, 5, 8, 9, 32, 33)] == [4, 4, 2, 2, 1, 1, 0]
    q = BatchSizeDraftLen(3, None, 2)
    assert [q.draft_len(b) for b in (1, 2, 3)] == [3, 3, 0]
    gate = AcceptanceGate(StaticDraftLen(3), window=2, threshold=0.5)
    gate.observe(6, 4)
    assert gate.draft_len(1) == 3
    gate.observe(6, 1)  # rolling rate 5/12 < 0.5: off for good
    gate.observe(6, 6)
    assert gate.draft_len(1) == 0 and gate.disabled
    assert isinstance(choose_draft_len_policy(MTPDecodingConfig(num_nextn_predict_layers=3), 3), StaticDraftLen)
    with pytest.raises(LlmArgsError, match="draft_len_schedule"):
        choose_draft_len_policy(MTPDecodingConfig(num_nextn_predict_layers=2, draft_len_schedule={2: 3}), 2)


@pytest.fixture(scope="module")
def plain(eagle):
    return [o.outputs[0].token_ids for o in LLM(eagle, speculative_config=None).generate(PROMPTS, SP)]


def staggered(llm: LLM, every: int = 1) -> list[list[int]]:
    """Requests arrive one every `every` steps, so the decode batch grows from 1 to 5 and shrinks again."""
    pending, ids, outs, n = list(PROMPTS), [], {}, 0
    while pending or llm.has_unfinished_requests:
        if pending and n % every == 0:
            ids.append(llm.add_request(pending.pop(0), SP))
        for out in llm.step():
            outs[out.request_id] = out
        n += 1
    return [outs[i] for i in ids]


@pytest.mark.parametrize("overlap", [False, True])
def test_draft_len_schedule_is_lossless_and_recorded(eagle, plain, overlap):
    spec = {"decoding_type": "MTP", "num_nextn_predict_layers": 3, "draft_len_schedule": {1: 3, 2: 2, 3: 1}}
    llm = LLM(eagle, speculative_config=spec, disable_overlap_scheduler=not overlap)
    llm.engine.iteration_log = []
    outs = staggered(llm)
    assert [o.outputs[0].token_ids for o in outs] == plain
    used = {e["draft_len"] for e in llm.engine.iteration_log if e["kind"] == "decode"}
    assert {0, 3}.issubset(used) and len(used) >= 3  # batch 1 → 3, ..., batch 4-5 → off
    for entry in llm.engine.iteration_log:
        if entry["kind"] == "decode":
            expected = {1: 3, 2: 2, 3: 1}.get(entry["num_requests"], 0)
            # or the one drafting step that re-primes the drafts when speculation comes back on
            assert entry["draft_len"] == expected or (entry["draft_len"] == 0 and entry["drafting"])
            assert entry["drafting"] == (expected > 0)
    eng_reqs = [o.outputs[0] for o in outs]
    assert sum(o.num_accepted_draft_tokens for o in eng_reqs) > 0
    if overlap:  # rows of requests that finished one step earlier ran too, and were discarded
        return
    # The per-request statistics count drafts at the draft length each step ran with.
    steps = llm.engine.iteration_log
    assert sum(o.num_decode_steps for o in eng_reqs) == sum(e["num_requests"] for e in steps if e["kind"] == "decode")
    assert sum(o.num_draft_tokens for o in eng_reqs) == sum(e["num_requests"] * e["draft_len"] for e in steps
                                                            if e["kind"] == "decode")


def test_request_stats_count_steps_per_draft_len(eagle, plain):
    spec = {"decoding_type": "MTP", "num_nextn_predict_layers": 3, "draft_len_schedule": {1: 3, 2: 1}}
    eng = LLM(eagle, speculative_config=spec, disable_overlap_scheduler=True).engine
    reqs = [eng.make_request(p, SP) for p in PROMPTS[:2]]
    eng.add_request(reqs[0])
    for _ in range(3):
        eng.step()
    eng.add_request(reqs[1])
    while eng.has_work:
        eng.step()
    assert [r.output_token_ids for r in reqs] == plain[:2]
    assert set(reqs[0].steps_per_draft_len) == {1, 3} and sum(reqs[0].steps_per_draft_len.values()) == reqs[0].num_decode_steps
    out = reqs[0].to_output().outputs[0]  # the public statistics carry the same counts
    assert out.steps_per_draft_len == reqs[0].steps_per_draft_len


def test_max_concurrency_turns_speculation_off_above_it(eagle, plain):
    spec = {"decoding_type": "MTP", "num_nextn_predict_layers": 2, "max_concurrency": 2}
    llm = LLM(eagle, speculative_config=spec)
    llm.engine.iteration_log = []
    outs = staggered(llm)
    assert [o.outputs[0].token_ids for o in outs] == plain
    decode = [e for e in llm.engine.iteration_log if e["kind"] == "decode"]
    assert all(e["drafting"] == (e["num_requests"] <= 2) for e in decode)
    # draft length 2 when on, except one re-priming step (0, drafting) right after speculation comes back
    assert all(e["draft_len"] == (2 if e["num_requests"] <= 2 else 0) or e["drafting"] for e in decode)
    assert any(e["draft_len"] == 2 for e in decode) and any(not e["drafting"] for e in decode)
    assert {e["draft_len"] for e in decode} == {0, 2}


def test_acceptance_gate_turns_speculation_off_and_stays_lossless(eagle, plain):
    spec = {"decoding_type": "MTP", "num_nextn_predict_layers": 3, "acceptance_rate_window_size": 2,
            "acceptance_rate_threshold": 1.0}  # unreachable: off after two speculative iterations
    llm = LLM(eagle, speculative_config=spec)
    llm.engine.iteration_log = []
    assert [o.outputs[0].token_ids for o in llm.generate(PROMPTS, SP)] == plain
    lens = [e["draft_len"] for e in llm.engine.iteration_log if e["kind"] == "decode"]
    assert lens[0] == 3 and lens[-1] == 0 and llm.engine.draft_len_policy.disabled


@pytest.mark.parametrize("modules", [1, 2])
def test_drafts_stay_equal_to_drafts_from_scratch_while_k_changes(checkpoints, modules):
    """Eagle and Vanilla: after every step — whatever draft length it verified — the drafts equal those of a fresh
    prefill over the accepted sequence, so raising the draft length again stays lossless."""
    import torch

    from nextn.speculative.acceptance_rules import StandardAcceptance, greedy_sampling
    from nextn.models.kv_cache import allocate_kv_cache
    from nextn.speculative.chain_step import prefill_step

    engine = checkpoints.engine(num_mtp_modules=modules, **SMALL_VOCAB)
    k = 3 if modules == 1 else modules  # Eagle applies its one module K times; Vanilla has one per draft
    spec = {"decoding_type": "MTP", "num_nextn_predict_layers": k, "draft_len_schedule": {1: k, 3: 1}}
    eng = LLM(engine, speculative_config=spec, disable_overlap_scheduler=True).engine
    eng.iteration_log = []
    reqs = [eng.make_request(p, SamplingParams(max_tokens=12, ignore_eos=True)) for p in PROMPTS[:3]]
    checked, n = 0, 0
    while n < len(reqs) or eng.has_work:
        if n < len(reqs) and len(eng.iteration_log) >= 3 * n:
            eng.add_request(reqs[n])
            n += 1
        for req in eng.step():
            if req.finished:
                continue
            seq = req.all_token_ids[:-1]
            kv = allocate_kv_cache(eng.model.num_cache_layers, 1 + -(-(len(seq) + 2 * k + 1) // 16), 16,
                                   eng.cfg.kv_cache_dim, torch.float32)
            with torch.inference_mode():
                ref = prefill_step(eng.model, eng.drafter, StandardAcceptance(), kv, torch.tensor([seq]),
                                   torch.tensor([len(seq)]), torch.arange(1, kv.shape[1] // 16)[None],
                                   greedy_sampling(1), (), 16)
            assert ref.draft_tokens[0].tolist() == req.draft_tokens
            checked += 1
    assert {e["draft_len"] for e in eng.iteration_log if e["kind"] == "decode"} == {1, k} and checked > 10


@pytest.mark.parametrize("overlap", [False, True])
def test_speculation_off_runs_no_drafter_and_comes_back(eagle, plain, overlap):
    """Above the schedule speculation is off: those steps are plain decoding (the drafter does not run, so they cost
    no more than plain decoding); when the batch shrinks, one drafting step re-primes the drafts and K comes back."""
    spec = {"decoding_type": "MTP", "num_nextn_predict_layers": 3, "draft_len_schedule": {1: 3}}
    llm = LLM(eagle, speculative_config=spec, disable_overlap_scheduler=not overlap)
    drafted_batches = []
    after_verify = llm.engine.drafter.after_verify

    def spy(model, kv_cache, meta, hidden, *args):
        drafted_batches.append(hidden.shape[0])
        return after_verify(model, kv_cache, meta, hidden, *args)

    llm.engine.drafter.after_verify = spy
    llm.engine.iteration_log = []
    params = [SamplingParams(max_tokens=8 + 4 * i, ignore_eos=True) for i in range(len(PROMPTS))]
    outs = llm.generate(PROMPTS, params)
    ref = LLM(eagle, speculative_config=None).generate(PROMPTS, params)
    assert [o.outputs[0].token_ids for o in outs] == [o.outputs[0].token_ids for o in ref]
    decode = [e for e in llm.engine.iteration_log if e["kind"] == "decode"]
    assert drafted_batches and set(drafted_batches) == {1}  # never drafted for a batch of 2 or more
    assert decode[0]["num_requests"] == len(PROMPTS) and decode[0]["draft_len"] == 0
    assert decode[-1]["num_requests"] == 1 and decode[-1]["draft_len"] == 3
    assert outs[-1].outputs[0].num_accepted_draft_tokens > 0  # the drafts came back and were accepted


def test_adaptive_draft_len_follows_acceptance_and_measured_cost():
    from nextn.speculative.draft_len_policy import AdaptiveDraftLen, acceptance_from_rate, expected_tokens

    assert expected_tokens(0.8, 3) == pytest.approx(1 + 0.8 + 0.64 + 0.512)
    for alpha in (0.1, 0.5, 0.9):  # the rate → α inversion round-trips
        rate = (expected_tokens(alpha, 4) - 1) / 4
        assert acceptance_from_rate(rate, 4) == pytest.approx(alpha, abs=1e-6)
    p = AdaptiveDraftLen(StaticDraftLen(4), probe_every=1000)
    assert p.draft_len(1) == 4  # nothing observed yet: try the full length
    p.observe(4, 4, 4, 1, 0.012)
    p.observe(4, 4, 4, 1, 0.012)
    assert p.draft_len(1) == 0  # two speculating steps timed, no plain one yet: time a plain step
    for _ in range(20):  # plain steps of 10 ms, speculating steps of 12 ms at k = 4, drafts almost always accepted
        p.observe(0, 0, 0, 1, 0.010)
        p.observe(4, 4, 4, 1, 0.012)
    assert p.alpha > 0.95 and p.relative_step_time(1, 4) == pytest.approx(1.2, rel=0.01) and p.draft_len(1) == 4
    # k = 2 not timed: two verified rows fewer than k = 4, each at most 1/4 of k = 4's extra time (so ≥ 1)
    assert p.relative_step_time(1, 2) == pytest.approx(1.1, rel=0.01)
    assert p.relative_step_time(1, 5) == pytest.approx(1.2 + p.prior_cost, rel=0.01)
    for _ in range(80):  # acceptance drops to 1 in 8 drafts at k = 4 (α ≈ 0.34): shorter drafts pay more
        p.observe(8, 1, 4, 1, 0.012)
    assert p.alpha == pytest.approx(0.34, abs=0.01) and p.draft_len(1) == 2
    for _ in range(40):  # then to nothing: E(k) / (t(k) / t(0)) < 1 for every k > 0, plain decoding
        p.observe(8, 0, 4, 1, 0.012)
    assert p.draft_len(1) == 0
    q = AdaptiveDraftLen(StaticDraftLen(4), probe_every=1000)
    for _ in range(20):  # α ≈ 0.7, but a speculating step costs 3.2 plain ones (a compute-bound target)
        q.observe(0, 0, 0, 8, 0.100)
        q.observe(4 * 8, round(8 * 4 * ((expected_tokens(0.7, 4) - 1) / 4)), 4, 8, 0.100 * (1 + 0.8 * 4))
    assert q.draft_len(8) == 0 and q.draft_len(1) > 0  # batch 8 measured as not paying; batch 1 not yet measured
    d = AdaptiveDraftLen(StaticDraftLen(3), probe_every=1000)
    for _ in range(20):  # a draft model: drafting K = 3 costs 1.05 steps whatever k, each verified row 0.1 more
        d.observe(0, 0, 0, 1, 0.010)
        d.observe(3, 3, 3, 1, 0.0215)
        d.observe(1, 1, 1, 1, 0.0215 - 0.002)
    # α ≈ 1: k = 3 gives 4 tokens per 2.15 steps (1.86×), k = 1 only 2 per 1.95 — a per-draft linear fit of
    # the k = 1 steps, (1.95 − 1) / 1, would price k = 3 at 3.85 steps
    assert d.relative_step_time(1, 1) == pytest.approx(1.95, rel=0.01) and d.draft_len(1) == 3
    cold = AdaptiveDraftLen(StaticDraftLen(3), probe_every=8)
    for seconds in (0.050, 0.050) + (0.010,) * 20:  # two cold speculating steps, then plain ones
        cold.observe(3 if seconds > 0.02 else 0, 3 if seconds > 0.02 else 0, 3 if seconds > 0.02 else 0, 1, seconds)
    assert cold.draft_len(1) == 0  # 4 tokens per 5 steps
    cold.observe(3, 3, 3, 1, 0.012)  # a probe 20 steps later: the stale cold time is replaced, not blended
    assert cold.relative_step_time(1, 3) == pytest.approx(1.2) and cold.draft_len(1) == 3
    r = AdaptiveDraftLen(StaticDraftLen(4), probe_every=3, probe_budget=0)  # the schedule alone
    r.observe(8, 0, 4, 1, 0.0)  # nothing accepted: off ...
    ks = []  # ... with a speculating probe after 3 steps, then 6, then 12
    for _ in range(24):
        ks.append(r.draft_len(1))
        if ks[-1]:  # the drafter's first step back primes the drafts (k = 0 with drafting on): the probe goes on
            r.observe(0, 0, 0, 1, 0.0)
            assert r.draft_len(1) == ks[-1]
        r.observe(2 * ks[-1], 0, ks[-1], 1, 0.0)
    # probes at the k of the best predicted rate: with α ≈ 0 the cheapest, one draft (not the full length)
    assert [i for i, k in enumerate(ks) if k] == [2, 8, 20] and set(ks) == {0, 1}


def test_adaptive_draft_len_speculates_only_where_it_is_predicted_to_pay_by_a_margin():
    """Near break-even the prediction's error exceeds the gain: a k ≥ 1 must beat plain decoding by `min_gain`
    (an MoE at batch 8, every draft accepted, t(4) / t(0) = 4.9: predicted 1.01×, measured 0.97×)."""
    from nextn.speculative.draft_len_policy import AdaptiveDraftLen

    for ratio, want in ((4.9, 0), (4.8, 0), (4.7, 4), (2.0, 4)):  # E(1, 4) = 5: 1.02×, 1.04×, 1.06×, 2.5×
        p = AdaptiveDraftLen(StaticDraftLen(4), profile={8: {0: 0.040, 4: 0.040 * ratio}})
        for _ in range(30):
            p.observe(32, 32, 4, 8, 0.040 * ratio)
        assert p.alpha > 0.99 and p.best_draft_len(8, 4) == want, ratio


def test_adaptive_draft_len_probes_a_hopeless_batch_size_rarely():
    """A speculating step at 6 plain steps with K = 4: no acceptance could pay (5 tokens at most), so the bucket
    probes every idle_probe_every steps instead of doubling from probe_every."""
    from nextn.speculative.draft_len_policy import AdaptiveDraftLen

    for cost, hopeless in ((0.060, True), (0.030, False)):
        p = AdaptiveDraftLen(StaticDraftLen(4), probe_every=4, max_probe_every=16, idle_probe_every=50,
                             probe_budget=0)
        p.observe(8 * 4, 8 * 4, 4, 8, cost)  # two warm-up steps at k = 4, all accepted ...
        p.observe(8 * 4, 8 * 4, 4, 8, cost)
        p.observe(0, 0, 0, 8, 0.010)  # ... a plain one ...
        for _ in range(10):
            p.observe(8 * 4, 0, 4, 8, cost)  # ... then nothing accepted: off
        ks = []
        for _ in range(120):
            ks.append(p.draft_len(8))
            if ks[-1]:
                p.observe(0, 0, 0, 8, 0.0)  # the drafts' priming step
                p.draft_len(8)
            p.observe(8 * ks[-1], 0, ks[-1], 8, cost if ks[-1] else 0.010)
        probes = [i for i, k in enumerate(ks) if k]
        assert p.hopeless(8, 4) == hopeless
        # hopeless: every 50 steps; else doubling from 4 up to max_probe_every (16)
        assert probes == ([49, 99] if hopeless else [3, 11, 27, 43, 59, 75, 91, 107])


def test_adaptive_draft_len_follows_each_requests_own_acceptance():
    from nextn.speculative.draft_len_policy import AdaptiveDraftLen

    p = AdaptiveDraftLen(StaticDraftLen(4), probe_every=1000)
    for _ in range(30):  # request 1's drafts all hit, request 2's all miss; each extra draft costs 10 % of a step
        p.observe(0, 0, 0, 2, 0.010)
        p.observe(8, 4, 4, 2, 0.014, per_request={1: 4, 2: 0})
    assert p.request_alpha[1] > 0.99 and p.request_alpha[2] < 0.01
    assert p.draft_len(2, [1]) == 4 and p.draft_len(2, [2]) == 0  # alone, each runs what pays for it
    assert p.draft_len(2, [1, 2]) == 4  # together: 1 + 5 tokens per 1.4 steps beats 2 per step
    # the pooled α (1 draft in 2 accepted at k = 4: α ≈ 0.74) stands for a request not seen yet
    assert 0.7 < p.alpha < 0.8 and p.draft_len(2, [3]) == p.best_draft_len(2, 4)
    q = AdaptiveDraftLen(StaticDraftLen(4), probe_every=1000)  # a hitting and a missing request, k = 1 and 4 timed
    q.observe(0, 0, 0, 2, 0.010)
    for _ in range(30):
        q.observe(2, 1, 1, 2, 0.016, per_request={1: 1, 2: 0})
    for _ in range(30):
        q.observe(8, 4, 4, 2, 0.031, per_request={1: 4, 2: 0})
    # their own α (1 and 0): k + 2 tokens per t(k) = 1.6, 2.1, 2.6, 3.1 steps (k = 2, 3 interpolated) — none beats
    # 2 per step; the pooled α (≈ 0.74, half the drafts accepted at k = 4) would take 2 · 1.74 per 1.6 steps at
    # k = 1
    assert q.relative_step_time(2, 2) == pytest.approx(2.1, rel=0.01)
    assert q.draft_len(2, [1, 2]) == 0 and q.best_draft_len(2, 4) > 0
    p.max_tracked_requests = 2  # the least recently observed requests are forgotten
    p.observe(8, 4, 4, 2, 0.0, per_request={1: 4, 6: 0})
    assert list(p.request_alpha) == [1, 6]


@pytest.mark.parametrize("overlap", [False, True])
def test_adaptive_draft_len_is_lossless(eagle, plain, overlap):
    spec = {"decoding_type": "MTP", "num_nextn_predict_layers": 3, "adaptive_draft_len": True}
    llm = LLM(eagle, speculative_config=spec, disable_overlap_scheduler=not overlap)
    llm.engine.iteration_log = []
    assert [o.outputs[0].token_ids for o in staggered(llm)] == plain
    assert llm.engine.draft_len_policy.alpha is not None  # it observed the speculating steps
    assert len(llm.engine.draft_len_policy.request_alpha) > 1  # and each request's own acceptance
    assert {e["draft_len"] for e in llm.engine.iteration_log if e["kind"] == "decode"} - {0, 1, 2, 3} == set()


def test_an_expensive_probe_waits_until_it_fits_the_probe_budget():
    """A step profile where a speculating step costs ~4 plain steps (MTP drafting over a 129k vocabulary on the
    CPU): drafts that miss switch speculation off, and a probe at k = 1 — 2 · 3.7 − 2 = 5.4 plain steps lost —
    waits 5.4 / 0.02 = 270 steps, not probe_every (the control: without a budget it probes after probe_every)."""
    from nextn.speculative.draft_len_policy import AdaptiveDraftLen

    profile = {1: {0: 0.010, 1: 0.037, 4: 0.040}}
    for budget, first_probe in ((0.02, 269), (0.0, 7)):
        p = AdaptiveDraftLen(StaticDraftLen(4), probe_every=8, profile=profile, probe_budget=budget)
        p.observe(4, 0, 4, 1, 0.040)  # nothing accepted: α ≈ 0, off (not hopeless: 5 tokens at α = 1 > 4 steps)
        ks = [p.draft_len(1) for _ in range(300)]
        assert [i for i, k in enumerate(ks) if k][:1] == [first_probe] and ks[first_probe] == 1
        assert p.probe_wait(1, 1) == pytest.approx(270 if budget else 0.0, rel=0.02)
    cheap = AdaptiveDraftLen(StaticDraftLen(4), probe_every=8, profile={1: {0: 0.010, 1: 0.0101, 4: 0.0105}})
    cheap.observe(4, 0, 4, 1, 0.0105)
    assert cheap.probe_wait(1, 1) < 8  # a probe that costs little keeps the probe_every schedule


def test_ragged_step_times_price_rows_by_the_batch_one_times_below_one_a_row():
    """`ProposalDraftLen.ragged_step_times`: n < B drafts in all cost what n more token rows cost at batch 1 (a kernel
    whose 9th row is dear makes batch 8's first verified row dear); from B on, linear between the uniform lengths."""
    ones = {0: 30.0, 1: 31.0, 2: 32.0, 4: 34.0, 7: 37.0, 8: 47.0, 16: 55.0}  # rows 8 → 9: +10 (a second chunk)
    policy = ProposalDraftLen(StaticDraftLen(16), profile={1: ones, 8: {0: 70.0, 1: 126.0, 2: 182.0}})
    times = policy.ragged_step_times(8, 20)
    assert times[0] == 1.0
    assert times[1] == pytest.approx(1 + (47.0 - 37.0) / 70.0)  # t₁(8) − t₁(7): the 9th token row
    assert times[3] == pytest.approx(1 + (49.0 - 37.0) / 70.0)  # t₁(10) between the timed 8 and 16
    assert times[8] == pytest.approx(126.0 / 70.0) and times[12] == pytest.approx((126.0 + 28.0) / 70.0)
    assert times[16] == pytest.approx(182.0 / 70.0)
    # without batch-1 times: linear between the uniform lengths from the first draft on
    plain = ProposalDraftLen(StaticDraftLen(16), profile={8: {0: 70.0, 1: 126.0}}).ragged_step_times(8, 4)
    assert plain[1] == pytest.approx(1 + 56.0 / 8 / 70.0) and plain[4] == pytest.approx(1 + 28.0 / 70.0)
    # batch 1: its own times
    assert policy.ragged_step_times(1, 2) == pytest.approx([1.0, 31.0 / 30.0, 32.0 / 30.0])
