"""Draft_Target (a separate draft model with its own paged KV cache): greedy output token-identical to plain
decoding in every scheduling situation, the draft KV rewound right (draft = target accepts everything), a clear
vocabulary error, and rejection sampling with sampled drafts keeps the target's distribution."""

from __future__ import annotations

import json
import math
from collections import Counter

import pytest
import torch
from transformers import LlamaConfig
from transformers import LlamaForCausalLM as HFLlama

from nextn import LLM, SamplingParams
from nextn.build.engine_builder import build_engine
from nextn.config.llm_args import LlmArgsError

VOCAB = 300
PROMPTS = [[5, 6, 7, 8], [9], list(range(20, 60)), [100, 101, 102, 5, 6]]


def chi_square_two_sample_pvalue(a: Counter, b: Counter) -> float:
    """p-value that two samples come from one categorical distribution (as in test_sampling_e2e.py: pooled
    expected counts, categories expected below 5 merged, Wilson–Hilferty approximation of the tail)."""
    na, nb = sum(a.values()), sum(b.values())
    big = [c for c in set(a) | set(b) if (a[c] + b[c]) * min(na, nb) / (na + nb) >= 5]
    rest_a, rest_b = na - sum(a[c] for c in big), nb - sum(b[c] for c in big)
    rows = [(a[c], b[c]) for c in big] + ([(rest_a, rest_b)] if rest_a + rest_b else [])
    stat = sum((x - (x + y) * na / (na + nb)) ** 2 / ((x + y) * na / (na + nb))
               + (y - (x + y) * nb / (na + nb)) ** 2 / ((x + y) * nb / (na + nb)) for x, y in rows)
    df = max(len(rows) - 1, 1)
    z = ((stat / df) ** (1 / 3) - (1 - 2 / (9 * df))) / math.sqrt(2 / (9 * df))
    return 0.5 * math.erfc(z / math.sqrt(2))


def _hf_llama(num_layers: int, vocab: int = VOCAB, seed: int = 0, scale: float = 8.0) -> HFLlama:
    cfg = LlamaConfig(vocab_size=vocab, hidden_size=64, intermediate_size=96, num_hidden_layers=num_layers,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                      tie_word_embeddings=False)
    torch.manual_seed(seed)
    hf = HFLlama(cfg).eval()
    with torch.no_grad():
        hf.lm_head.weight.mul_(scale)  # peaked logits: no greedy ties, a spread but not flat sampling distribution
    return hf


@pytest.fixture(scope="module")
def engines(tmp_path_factory):
    """(target, draft, other-vocabulary draft) engine directories. The target has 3 layers; the draft is its
    first layer with the target's embeddings and head (a truncated target: it agrees often, not always)."""
    tmp = tmp_path_factory.mktemp("draft_target")
    target = _hf_llama(3)
    target.save_pretrained(tmp / "target_ckpt")
    draft = _hf_llama(1, seed=1)
    state = {k: v for k, v in target.state_dict().items() if not k.startswith(("model.layers.1.", "model.layers.2."))}
    draft.load_state_dict(state)
    draft.save_pretrained(tmp / "draft_ckpt")
    _hf_llama(1, vocab=VOCAB + 20, seed=2).save_pretrained(tmp / "other_ckpt")
    for name in ("target", "draft", "other"):
        build_engine(tmp / f"{name}_ckpt", tmp / name, progress=False, max_seq_len=256)
    return tmp / "target", tmp / "draft", tmp / "other"


def _spec(draft, k: int = 3) -> dict:
    return {"decoding_type": "Draft_Target", "max_draft_len": k, "speculative_model_dir": str(draft)}


def _ids(outs) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in outs]


GREEDY = SamplingParams(max_tokens=40, ignore_eos=True)


@pytest.fixture(scope="module")
def plain(engines):
    target, _, _ = engines
    return _ids(LLM(target, speculative_config=None).generate(PROMPTS, GREEDY))


@pytest.mark.parametrize("overlap", [True, False], ids=["overlap", "sync"])
def test_greedy_equals_plain_decoding_batched(engines, plain, overlap):
    target, draft, _ = engines
    llm = LLM(target, speculative_config=_spec(draft), disable_overlap_scheduler=not overlap)
    outs = llm.generate(PROMPTS, GREEDY)
    assert _ids(outs) == plain
    accepted = sum(o.outputs[0].num_accepted_draft_tokens for o in outs)
    drafted = sum(o.outputs[0].num_draft_tokens for o in outs)
    assert 0 < accepted < drafted, (accepted, drafted)  # a real drafter: some drafts accepted, some rejected


def test_draft_equal_to_target_accepts_every_draft(engines, plain):
    """With draft = target, every draft is the target's argmax: AL = K + 1 exactly, which only holds when the
    draft KV after every step is exactly the target's (rewind, prefill, and the drafting positions)."""
    target, _, _ = engines
    k = 3
    outs = LLM(target, speculative_config=_spec(target, k)).generate(PROMPTS, SamplingParams(max_tokens=41,
                                                                                             ignore_eos=True))
    assert [ids[:40] for ids in _ids(outs)] == plain
    for o in outs:
        c = o.outputs[0]
        assert c.num_accepted_draft_tokens == c.num_draft_tokens > 0
        assert len(c.token_ids) == 1 + (k + 1) * c.num_decode_steps  # 41 = 1 + 4 · 10


@pytest.mark.parametrize("overlap", [True, False], ids=["overlap", "sync"])
def test_greedy_staggered_arrivals_and_preemption(engines, plain, overlap):
    """Requests join while others decode, and a cache too small for all of them forces preemption (recompute):
    the draft KV is addressed by the same block tables, so it is freed and rebuilt with the target's."""
    target, draft, _ = engines
    llm = LLM(target, speculative_config=_spec(draft), disable_overlap_scheduler=not overlap,
              kv_cache_config={"tokens_per_block": 4, "max_tokens": 160})
    engine = llm.engine
    reqs = []
    for i, p in enumerate(PROMPTS):
        req = engine.make_request(p, GREEDY)
        engine.add_request(req)
        reqs.append(req)
        for _ in range(2 + i):  # the next request arrives a few steps later
            engine.step()
    while engine.has_work:
        engine.step()
    assert [r.output_token_ids for r in reqs] == plain
    assert engine.scheduler.num_preemptions > 0


def test_greedy_chunked_prefill_and_draft_len_policy(engines, plain):
    """Prompts prefilled in chunks (the draft KV filled chunk by chunk through the same metadata), and a
    draft-length schedule that verifies fewer drafts (k < K) or turns speculation off (plain steps without the
    draft model, then a re-priming step) as the batch shrinks: still token-identical."""
    target, draft, _ = engines
    spec = {**_spec(draft), "draft_len_schedule": {2: 3, 3: 1}}  # 4 requests: off; 3: k = 1; ≤ 2: k = 3
    llm = LLM(target, speculative_config=spec, enable_chunked_prefill=True, max_num_tokens=16)
    lens = [40, 30, 20, 10]  # requests finish one after another: the batch goes 4 → 3 → 2 → 1
    outs = llm.generate(PROMPTS, [SamplingParams(max_tokens=n, ignore_eos=True) for n in lens])
    assert _ids(outs) == [ids[:n] for ids, n in zip(plain, lens)]
    steps = [o.outputs[0].steps_per_draft_len for o in outs]
    assert all(s.get(0) and s.get(1) and s.get(3) for s in steps[:2]), steps


def test_vocabulary_mismatch_is_a_clear_error(engines):
    target, _, other = engines
    with pytest.raises(LlmArgsError, match=rf"{VOCAB + 20}.*{VOCAB}"):
        LLM(target, speculative_config=_spec(other))


def test_config_aliases_and_yaml_names(engines):
    target, draft, _ = engines
    spec = {"decoding_type": "Draft_Target", "max_draft_len": 2, "speculative_model": str(draft)}
    llm = LLM(target, speculative_config=spec)
    assert llm.engine.drafter.num_draft_tokens == 2
    with pytest.raises(LlmArgsError, match="speculative_model_dir"):
        LLM(target, speculative_config={"decoding_type": "Draft_Target", "max_draft_len": 2})


# ----------------------------------------------------------------------------------------------------------------
# Sampling: drafts sampled from q, rejection sampling with the full q.
PROMPT = [11, 12, 13, 14, 15]
TEMPERATURE = dict(temperature=0.8)
FILTERED = dict(temperature=1.0, top_k=20, top_p=0.9)
N = 1200  # samples per distribution
_PLAIN: dict[str, list[Counter]] = {}


def _positions(llm: LLM, n: int, params: dict) -> list[Counter]:
    sps = [SamplingParams(max_tokens=3, ignore_eos=True, seed=s, **params) for s in range(n)]
    outs = llm.generate([PROMPT] * n, sps)
    return [Counter(o.outputs[0].token_ids[j] for o in outs) for j in range(3)]


def _plain_positions(target, params: dict) -> list[Counter]:
    """The target alone (plain decoding, other seeds than the speculative runs), computed once per params."""
    key = repr(sorted(params.items()))
    if key not in _PLAIN:
        sps = [SamplingParams(max_tokens=3, ignore_eos=True, seed=10**6 + s, **params) for s in range(N)]
        outs = LLM(target, speculative_config=None, max_batch_size=N).generate([PROMPT] * N, sps)
        _PLAIN[key] = [Counter(o.outputs[0].token_ids[j] for o in outs) for j in range(3)]
    return _PLAIN[key]


@pytest.mark.slow
@pytest.mark.parametrize("params", [TEMPERATURE, FILTERED], ids=["T0.8", "T1-k20-p0.9"])
def test_sampling_keeps_the_token_distribution(engines, params):
    target, draft, _ = engines
    plain = _plain_positions(target, params)
    llm = LLM(target, speculative_config=_spec(draft), max_batch_size=N)
    spec = _positions(llm, N, params)
    for j in (1, 2):  # the second and third tokens come out of the first verify step (drafts sampled from q)
        assert chi_square_two_sample_pvalue(plain[j], spec[j]) > 1e-3, (j, plain[j].most_common(5),
                                                                       spec[j].most_common(5))
    assert len(plain[1]) > 5, "the test needs a spread distribution to mean anything"
    outs = llm.generate([PROMPT] * 64, [SamplingParams(max_tokens=8, seed=s, ignore_eos=True, **params)
                                        for s in range(64)])
    accepted = sum(o.outputs[0].num_accepted_draft_tokens for o in outs)
    assert 20 < accepted < sum(o.outputs[0].num_draft_tokens for o in outs)


@pytest.mark.slow
def test_sampling_with_drafts_on_demand_keeps_the_token_distribution(engines):
    """Every step verifying k = 1 of K = 3 (a schedule): the drafter then drafts one token a step, its q padded
    to K, and the second and third tokens come from such drafts."""
    target, draft, _ = engines
    plain = _plain_positions(target, TEMPERATURE)
    llm = LLM(target, speculative_config={**_spec(draft), "draft_len_schedule": {N: 1}}, max_batch_size=N)
    assert llm.engine.scheduler.draft_schedule.on_demand
    spec = _positions(llm, N, TEMPERATURE)
    for j in (1, 2):
        assert chi_square_two_sample_pvalue(plain[j], spec[j]) > 1e-3, (j, plain[j].most_common(5),
                                                                       spec[j].most_common(5))


@pytest.mark.slow
def test_accepting_every_draft_fails_the_distribution_check(engines, monkeypatch):
    """The check above has power: emitting the sampled drafts unverified changes the distribution detectably."""
    import nextn.speculative.acceptance_rules as rules
    from nextn.testing.spec_checks import accept_every_draft

    target, draft, _ = engines
    plain = _plain_positions(target, TEMPERATURE)
    monkeypatch.setattr(rules, "rejection_sampling", accept_every_draft)
    broken = _positions(LLM(target, speculative_config=_spec(draft), max_batch_size=N), N, TEMPERATURE)
    assert min(chi_square_two_sample_pvalue(plain[j], broken[j]) for j in (1, 2)) < 1e-6


def test_same_seed_same_output_whatever_the_batch(engines):
    target, draft, _ = engines
    from nextn.testing.spec_checks import same_seed_same_output_whatever_the_batch as check

    check(LLM(target, speculative_config=_spec(draft)), PROMPT,
          SamplingParams(max_tokens=24, temperature=0.8, top_p=0.95, seed=1234, ignore_eos=True))


def test_a_checkpoint_draft_is_built_like_a_quantized_target(engines, tmp_path, monkeypatch):
    """A draft given as a checkpoint is built in the target's dtype and weight-only quantization (its weights are
    read K times a step), loads with its quantized linears, and greedy output stays that of the plain target."""
    import nextn.build.engine_cache as engine_cache
    from nextn.build.manifest import EngineManifest

    monkeypatch.setattr(engine_cache, "DEFAULT_CACHE_DIR", tmp_path / "cache")
    target_ckpt, draft_ckpt = engines[0].parent / "target_ckpt", engines[0].parent / "draft_ckpt"
    build_engine(target_ckpt, tmp_path / "target_w8", dtype="bfloat16", quant_algo="W8A16", max_seq_len=256,
                 progress=False)
    plain_w8 = _ids(LLM(tmp_path / "target_w8", speculative_config=None).generate(PROMPTS, GREEDY))
    llm = LLM(tmp_path / "target_w8", speculative_config=_spec(draft_ckpt))
    (draft_dir,) = [p for p in (tmp_path / "cache").iterdir() if p.is_dir()]
    draft = EngineManifest.load(draft_dir)
    assert draft.dtype == "bfloat16" and draft.quant_config.quant_algo == "W8A16"
    assert llm.engine.drafter.draft.lm_head_quantized
    outs = llm.generate(PROMPTS, GREEDY)
    assert _ids(outs) == plain_w8 and sum(o.outputs[0].num_accepted_draft_tokens for o in outs) > 0


# ----------------------------------------------------------------------------------------------------------------
# A draft head cut to its hot tokens (`draft_vocab_size`, `draft_token_map`: speculative/draft_vocab.py).
def _record_drafts(llm: LLM) -> list[torch.Tensor]:
    """Wrap the drafter's sampling to keep every draft token it proposes."""
    drafter, seen = llm.engine.drafter, []
    inner = drafter._sample

    def sample(*args, **kwargs):
        tokens, q = inner(*args, **kwargs)
        seen.append(tokens.detach().clone())
        return tokens, q

    drafter._sample = sample
    return seen


@pytest.mark.parametrize("quantized", [False, True], ids=["fp32-head", "W4A16-head"])
def test_a_draft_head_cut_to_hot_tokens_stays_token_identical(engines, plain, tmp_path, quantized):
    """Drafts only from the hot rows (a token map from text like the outputs, plus the lowest ids), a dense or a
    W4A16 draft head: greedy output is still the plain target's, drafts are still accepted, none is off the set."""
    target, draft, _ = engines
    if quantized:
        draft = tmp_path / "draft_w4"
        build_engine(engines[0].parent / "draft_ckpt", draft, dtype="bfloat16", quant_algo="W4A16", max_seq_len=256,
                     progress=False)
    counts = Counter(t for ids in plain for t in ids)
    token_map = tmp_path / "hot.json"
    token_map.write_text(json.dumps([t for t, _ in counts.most_common(40)]))
    spec = {**_spec(draft), "draft_vocab_size": 48, "draft_token_map": str(token_map)}
    llm = LLM(target, speculative_config=spec)
    hot = llm.engine.drafter.hot_tokens
    assert hot.numel() == 48 and set(t for t, _ in counts.most_common(40)) <= set(hot.tolist())
    assert llm.engine.drafter.draft.logits(torch.zeros(1, 1, 64)).shape[-1] == 48
    seen = _record_drafts(llm)
    outs = llm.generate(PROMPTS, GREEDY)
    assert _ids(outs) == plain
    accepted = sum(o.outputs[0].num_accepted_draft_tokens for o in outs)
    assert 0 < accepted < sum(o.outputs[0].num_draft_tokens for o in outs)
    assert set(torch.cat([s.flatten() for s in seen]).tolist()) <= set(hot.tolist())


def test_a_bad_token_map_is_a_clear_error(engines, tmp_path):
    target, draft, _ = engines
    bad = tmp_path / "hot.json"
    bad.write_text(json.dumps([1, VOCAB + 5]))
    with pytest.raises(LlmArgsError, match=rf"outside the draft model's vocabulary \[0, {VOCAB}\)"):
        LLM(target, speculative_config={**_spec(draft), "draft_vocab_size": 32, "draft_token_map": str(bad)})
    with pytest.raises(LlmArgsError, match="draft_vocab_size"):
        LLM(target, speculative_config={**_spec(draft), "draft_vocab_size": 0})


@pytest.mark.slow
def test_sampling_with_a_cut_draft_head_keeps_the_token_distribution(engines):
    """q is zero off the hot set: rejection sampling's residual must bring those tokens back at the target's rate."""
    target, draft, _ = engines
    plain = _plain_positions(target, TEMPERATURE)
    llm = LLM(target, speculative_config={**_spec(draft), "draft_vocab_size": 64}, max_batch_size=N)
    hot = set(llm.engine.drafter.hot_tokens.tolist())
    spec = _positions(llm, N, TEMPERATURE)
    for j in (1, 2):
        assert chi_square_two_sample_pvalue(plain[j], spec[j]) > 1e-3, (j, plain[j].most_common(5),
                                                                       spec[j].most_common(5))
        off = sum(n for t, n in plain[j].items() if t not in hot)
        assert off > 0.1 * N, "the test needs target mass off the hot set to mean anything"


def _count_draft_rows(llm: LLM) -> list[int]:
    """Rows the draft model runs, counted per forward (it wraps the draft model's forward)."""
    drafter = llm.engine.runner.drafter
    inner, rows = drafter.draft.forward, []

    def forward(input_ids, *args, **kwargs):
        rows.append(input_ids.numel())
        return inner(input_ids, *args, **kwargs)

    drafter.draft.forward = forward
    return rows


@pytest.mark.parametrize("overlap", [True, False], ids=["overlap", "sync"])
@pytest.mark.parametrize("chunked", [False, True], ids=["whole", "chunked"])
def test_speculation_off_skips_the_draft_prefill_and_catches_up_exactly(engines, plain, overlap, chunked):
    """Admitted while the batch is too big to speculate, the prompts are prefilled by the target alone (the draft
    model does not run at all); when two requests finish and speculation turns on, the remaining ones catch their
    draft KV up (prompt and the tokens decoded meanwhile). With draft = target every later draft must then be
    accepted — which holds only if the caught-up KV is exactly what a drafting prefill and drafting steps write."""
    target, _, _ = engines
    spec = {**_spec(target, 3), "draft_len_schedule": {2: 3}}  # 3-4 requests: off; ≤ 2: K = 3
    llm = LLM(target, speculative_config=spec, disable_overlap_scheduler=not overlap,
              enable_chunked_prefill=chunked, max_num_tokens=16 if chunked else 8192)
    rows = _count_draft_rows(llm)
    lens = [40, 40, 8, 8]
    outs = llm.generate(PROMPTS, [SamplingParams(max_tokens=n, ignore_eos=True) for n in lens])
    assert _ids(outs) == [ids[:n] for ids, n in zip(plain, lens)]
    for o in outs[:2]:
        c = o.outputs[0]
        assert c.steps_per_draft_len.get(0) and c.steps_per_draft_len.get(3), c.steps_per_draft_len
        assert c.num_accepted_draft_tokens == c.num_draft_tokens > 0, (c.num_accepted_draft_tokens, c.num_draft_tokens)
    for o in outs[2:]:
        assert o.outputs[0].num_draft_tokens == 0
    if chunked:  # (the two short prompts decode while the long one is prefilled: speculation turns on early)
        return
    # the draft model first ran when speculation turned on: one catch-up pass per long request over its prompt
    # and the ≥ 8 tokens decoded before (never over the short requests' prompts)
    assert rows[0] >= len(PROMPTS[0]) + 8 and rows[1] >= len(PROMPTS[1]) + 8, rows[:4]
    assert rows[0] - len(PROMPTS[0]) == rows[1] - len(PROMPTS[1]), rows[:4]  # both at the same step


def test_a_batch_that_never_speculates_never_runs_the_draft_model(engines, plain):
    target, draft, _ = engines
    spec = {**_spec(draft, 3), "draft_len_schedule": {1: 3}}  # a batch of 4 that finishes together: never on
    llm = LLM(target, speculative_config=spec)
    rows = _count_draft_rows(llm)
    outs = llm.generate(PROMPTS, GREEDY)
    assert _ids(outs) == plain
    assert rows == []


def _draft_forwards(llm: LLM) -> list[tuple[int, int]]:
    """(batch, tokens) of every draft model forward (it wraps the draft model's forward)."""
    drafter = llm.engine.runner.drafter
    inner, shapes = drafter.draft.forward, []

    def forward(input_ids, *args, **kwargs):
        shapes.append(tuple(input_ids.shape))
        return inner(input_ids, *args, **kwargs)

    drafter.draft.forward = forward
    return shapes


@pytest.mark.parametrize("overlap", [True, False], ids=["overlap", "sync"])
def test_a_step_drafts_only_the_draft_length_it_verifies(engines, plain, overlap):
    """A draft model drafts on demand: a step the policy runs at k = 1 of K = 3 runs one draft forward (over the
    emitted tokens, its first draft from there), not three. Growing back to k = 3 (the batch shrinks), the first
    step verifies the one draft there is and drafts three. With draft = target every draft is still accepted
    (the draft KV and drafts are what full drafting writes) and the output is plain decoding's."""
    target, _, _ = engines
    spec = {**_spec(target, 3), "draft_len_schedule": {2: 3, 3: 1}}  # 3 requests: k = 1; ≤ 2: k = 3
    llm = LLM(target, speculative_config=spec, disable_overlap_scheduler=not overlap)
    assert llm.engine.scheduler.draft_schedule.on_demand
    shapes = _draft_forwards(llm)
    lens = [40, 40, 12]
    outs = llm.generate(PROMPTS[:3], [SamplingParams(max_tokens=n, ignore_eos=True) for n in lens])
    assert _ids(outs) == [ids[:n] for ids, n in zip(plain, lens)]
    for o in outs:
        c = o.outputs[0]
        assert c.num_accepted_draft_tokens == c.num_draft_tokens > 0, (c.num_draft_tokens, c.steps_per_draft_len)
    assert outs[0].outputs[0].steps_per_draft_len.get(1) and outs[0].outputs[0].steps_per_draft_len.get(3)
    # Batch-3 steps draft at k = 1: their one forward runs the k + 1 = 2 verified rows, no one-token pass follows
    # (the prefill drafts K: the prompts [3, T], then K one-token passes from the first token). The first of them
    # runs one row: the prefill's drafting wrote d1's KV (the pass that drafted d2), and d1 was accepted.
    batch3 = [s for s in shapes if s[0] == 3]
    assert batch3[:5] == [(3, max(len(p) for p in PROMPTS[:3])), (3, 1), (3, 1), (3, 1), (3, 1)], batch3[:5]
    assert batch3[5:] and all(s == (3, 2) for s in batch3[5:]), batch3
    assert (2, 1) in shapes  # at batch 2 drafting is K = 3 again (two one-token passes after the first)


def test_the_pass_after_verification_runs_only_rows_without_draft_kv(engines, plain, monkeypatch):
    """The one-token passes of a step wrote its drafts' KV, so the draft model's pass after verification starts at
    the first verified row whose draft KV is missing. With draft = target (every draft accepted, K = 3) it runs 2
    rows — d3 and the bonus token — not K + 1; with a real draft model the drafts are exactly those of a pass over
    all K + 1 rows (the rows it skips hold the same bits: batch invariance), and the output is plain decoding's."""
    from nextn.speculative import draft_model

    target, draft, _ = engines
    llm = LLM(target, speculative_config=_spec(target, 3))
    shapes = _draft_forwards(llm)
    assert _ids(llm.generate(PROMPTS, GREEDY)) == plain
    passes = [t for _, t in shapes[1:] if t > 1]  # after the prefill's pass: one per step, the others one row
    assert passes and set(passes) == {2}, shapes

    def run(full: bool) -> tuple[list[list[int]], list[list[int]], list[int]]:
        if full:  # every verified row, as the pass ran before it knew which rows have their KV
            monkeypatch.setattr(draft_model, "missing_rows",
                                lambda tokens, num_emitted, first, state: (torch.zeros_like(num_emitted),
                                                                           tokens.shape[1]))
        llm = LLM(target, speculative_config=_spec(draft))
        seen, widths = _record_drafts(llm), _draft_forwards(llm)
        return _ids(llm.generate(PROMPTS, GREEDY)), [s.tolist() for s in seen], [t for _, t in widths[1:]]

    ids, drafts, widths = run(full=False)
    ids_full, drafts_full, widths_full = run(full=True)
    assert ids == ids_full == plain
    assert drafts == drafts_full
    # (the one-token passes are in both lists; here every pass after verification ran 1 or 2 rows, not 4)
    assert max(widths_full) == 4 and max(widths) <= 2 and sum(widths) < 0.75 * sum(widths_full), (widths, widths_full)
