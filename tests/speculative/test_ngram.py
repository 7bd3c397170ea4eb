"""N-gram (prompt lookup) drafting (TensorRT-LLM `NGramDecodingConfig`): the device matcher equals a plain-Python
prompt lookup; greedy outputs are token-identical to plain decoding on both model families with or without
MTP/Medusa weights, in batches, with staggered arrivals, preemption, chunked prefill and the overlap scheduler on
or off; after every step the drafts equal a lookup over the accepted sequence; a repetitive prompt gets drafts
accepted; sampling keeps the target's distribution and a request's output does not depend on its batch."""

from __future__ import annotations

import logging
import random
from pathlib import Path

import pytest
import torch

from nextn.testing.spec_checks import greedy_outputs as outputs
from nextn.testing.spec_checks import staggered_outputs as staggered
from nextn.testing.spec_checks import LOOPING
from nextn.testing.spec_checks import sampled_token_counts as _positions
from nextn import LLM, SamplingParams
from nextn.build.engine_builder import build_engine
from nextn.config.llm_args import CudaGraphConfig, LlmArgsError, load_llm_args_yaml, parse_llm_args
from nextn.speculative.protocol import SamplingTensors
from nextn.runtime.cuda_graph_runner import CudaGraphStep, EmulatedGraphBackend
from nextn.speculative.ngram import ngram_drafts
from nextn.testing import SMALL_VOCAB
from nextn.testing.chi_square import chi_square_two_sample_pvalue

NGRAM = {"decoding_type": "NGram", "max_draft_len": 4, "max_matching_ngram_size": 3}
PROMPTS = [[5, 6, 7, 8, 5, 6, 7, 8, 5, 6], [9], list(range(20, 47)), [3, 4, 3, 4, 3]]


def lookup(seq: list[int], max_ngram: int, k: int, use_oldest: bool = True) -> list[int]:
    """Plain-Python prompt lookup: the longest n ≤ max_ngram whose last-n tokens occur earlier (followed by at least
    one token); the earliest or latest such occurrence; the tokens after it, read periodically; else the last
    token repeated."""
    for n in range(min(max_ngram, len(seq) - 1), 0, -1):
        ends = [e for e in range(n - 1, len(seq) - 1) if seq[e - n + 1: e + 1] == seq[-n:]]
        if ends:
            after = seq[(ends[0] if use_oldest else ends[-1]) + 1:]
            return [after[i % len(after)] for i in range(k)]
    return [seq[-1]] * k


@pytest.fixture(scope="module")
def deepseek_plain(checkpoints):
    """A tiny DeepSeek-V3 engine without MTP layers."""
    return checkpoints.engine(num_mtp_modules=0, **SMALL_VOCAB)


# The matcher --------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("use_oldest", [True, False])
def test_matcher_equals_plain_python_lookup(use_oldest):
    rng = random.Random(0)
    for _ in range(60):
        b, s, n, k = 6, 48, rng.randint(1, 4), rng.randint(1, 6)
        history = torch.randint(0, rng.choice([2, 3, 5, 50]), (b, s))  # small vocabularies: many matches
        lens = torch.tensor([rng.randint(1, s) for _ in range(b)])
        got = ngram_drafts(history, lens, n, k, use_oldest).tolist()
        assert got == [lookup(history[i, : lens[i]].tolist(), n, k, use_oldest) for i in range(b)]


def test_matcher_cases():
    h = torch.tensor([[1, 2, 3, 9, 1, 2, 4, 1, 2]])  # "1 2" at 0 and 4; latest: 4 → [4, 1, 2, 4]
    assert ngram_drafts(h, torch.tensor([9]), 2, 4, use_oldest=True).tolist() == [[3, 9, 1, 2]]
    assert ngram_drafts(h, torch.tensor([9]), 2, 4, use_oldest=False).tolist() == [[4, 1, 2, 4]]
    # The longer n-gram wins over a later shorter one: "3 1" matches once, "1" alone matches later.
    h = torch.tensor([[3, 1, 5, 6, 1, 7, 3, 1]])
    assert ngram_drafts(h, torch.tensor([8]), 2, 2, use_oldest=False).tolist() == [[5, 6]]
    # No match: the last token repeated; a one-token sequence too.
    assert ngram_drafts(torch.tensor([[1, 2, 3, 0]]), torch.tensor([3]), 3, 3).tolist() == [[3, 3, 3]]
    assert ngram_drafts(torch.tensor([[7, 0]]), torch.tensor([1]), 2, 2).tolist() == [[7, 7]]


# Configuration --------------------------------------------------------------------------------------------------
def test_config_uses_tensorrt_llm_names_and_defaults():
    spec = parse_llm_args({"speculative_config": {"decoding_type": "NGram", "max_draft_len": 3}}).speculative_config
    assert (spec.max_matching_ngram_size, spec.is_keep_all, spec.is_use_oldest, spec.is_public_pool) == (2, True, True, True)
    with pytest.raises(LlmArgsError, match="max_draft_len"):
        parse_llm_args({"speculative_config": {"decoding_type": "NGram"}})
    with pytest.raises(LlmArgsError, match="unknown key 'speculative_config.prompt_lookup_num_tokens'"):
        parse_llm_args({"speculative_config": {"decoding_type": "NGram", "max_draft_len": 3,
                                               "prompt_lookup_num_tokens": 2}})


def test_options_not_honoured_are_logged(deepseek_plain, caplog):
    with caplog.at_level(logging.INFO, logger="nextn.speculative.ngram"):
        LLM(deepseek_plain, speculative_config={**NGRAM, "is_public_pool": True, "is_keep_all": False})
    warned = {r.getMessage() for r in caplog.records if r.levelno == logging.WARNING}
    assert any("is_public_pool" in m for m in warned) and any("is_keep_all" in m for m in warned)


def test_config_file_loads():
    args = parse_llm_args(load_llm_args_yaml(Path(__file__).parents[2] / "configs" / "ngram.yaml"))
    assert args.speculative_config.decoding_type == "NGram" and args.speculative_config.max_draft_len == 4
    assert args.speculative_config.adaptive_draft_len  # never slower than plain decoding where drafts miss


def test_decode_step_compiles_fullgraph(llama_engine):
    """The n-gram drafting is part of the one-graph step (no host sync, no data-dependent branching)."""
    eng = LLM(llama_engine, speculative_config=NGRAM).engine
    torch._dynamo.reset()
    gen = torch.Generator().manual_seed(0)
    b, k = 3, eng.drafter.num_draft_tokens
    ids = torch.randint(0, 300, (b, k + 1), generator=gen)
    kv_lens = torch.tensor([5, 9, 17])
    tables = torch.tensor([[1, 2, 3], [4, 5, 6], [7, 8, 9]])
    (history,) = eng.drafter.initial_state(b, eng.cfg.hidden_size, torch.device("cpu"), torch.float32)
    history.copy_(torch.randint(0, 4, history.shape, generator=gen))
    sampling = SamplingTensors(torch.tensor([0.0, 0.7, 1.0]), torch.tensor([0, 5, 0]), torch.tensor([1.0, 1.0, 0.9]),
                               torch.tensor([1, 2, 3]), any_sampled=True, use_filters=True)
    kv = eng.runner.kv_cache
    kv.normal_(generator=gen)
    step_args = (ids, kv_lens, tables, sampling, (history,), (), eng.block_size)
    with torch.inference_mode():
        ref = eng.drafter.decode_fn(eng.model, eng.drafter, eng.acceptance, kv.clone(), *step_args)
        step = torch.compile(eng.drafter.decode_fn, fullgraph=True, dynamic=False, backend="aot_eager")
        out = step(eng.model, eng.drafter, eng.acceptance, kv.clone(), *step_args)
    assert torch.equal(out.tokens, ref.tokens) and torch.equal(out.draft_tokens, ref.draft_tokens)
    assert torch.equal(out.drafter_state[0], ref.drafter_state[0])
    emitted = [row[:n] for row, n in zip(ref.tokens.tolist(), ref.num_emitted.tolist())]
    for i in range(b):  # the history now holds the emitted tokens after position kv_len, and drafts come from it
        seq = history[i, : kv_lens[i] + 1].tolist() + emitted[i]
        assert ref.drafter_state[0][i, : len(seq)].tolist() == seq
        assert ref.draft_tokens[i].tolist() == lookup(seq, NGRAM["max_matching_ngram_size"], k)


# Greedy: lossless ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("which", ["llama_engine", "deepseek_plain", "medusa_engine"])  # medusa_engine: MTP too
def test_greedy_ngram_equals_plain_decoding(request, which):
    engine = request.getfixturevalue(which)
    sp = SamplingParams(max_tokens=40, ignore_eos=True)
    plain = outputs(LLM(engine, speculative_config=None), PROMPTS, sp)
    llm = LLM(engine, speculative_config=NGRAM)
    assert type(llm.engine.drafter).__name__ == "NGramDrafter"
    assert outputs(llm, PROMPTS, sp) == plain


@pytest.mark.parametrize("overlap", [False, True])
def test_staggered_arrivals_preemption_and_chunked_prefill_stay_lossless(llama_engine, overlap):
    prompts = PROMPTS + [[i, i + 1, i + 2, i] * 3 for i in range(30, 60, 10)]
    sp = SamplingParams(max_tokens=24, ignore_eos=True)
    plain = LLM(llama_engine, speculative_config=None)
    alone = [outputs(plain, [p], sp)[0] for p in prompts]
    tight = LLM(llama_engine, speculative_config={**NGRAM, "is_use_oldest": False},
                kv_cache_config={"max_tokens": 112, "tokens_per_block": 8}, enable_chunked_prefill=True,
                max_num_tokens=8, disable_overlap_scheduler=not overlap)
    assert staggered(tight, prompts, [sp] * len(prompts)) == alone
    assert tight.engine.scheduler.num_preemptions > 0
    assert tight.engine.pool.num_free == tight.engine.pool.num_blocks - 1


def test_speculation_switched_off_and_on_by_the_draft_len_policy_stays_lossless(llama_engine):
    """Above max_concurrency requests the step runs without the drafter (the history is not written then); when the
    batch shrinks, drafting resumes from a history with a stale gap: lower acceptance at worst, same tokens."""
    sp = [SamplingParams(max_tokens=n, ignore_eos=True) for n in (12, 40, 20, 36)]
    plain = outputs(LLM(llama_engine, speculative_config=None), PROMPTS, sp)
    llm = LLM(llama_engine, speculative_config={**NGRAM, "max_concurrency": 2})
    llm.engine.iteration_log = []
    assert staggered(llm, PROMPTS, sp) == plain
    drafting = [e["drafting"] for e in llm.engine.iteration_log if e["kind"] == "decode"]
    assert False in drafting and drafting[-1]


def test_drafts_after_every_step_equal_a_lookup_over_the_accepted_sequence(llama_engine):
    """The device token history is exactly the sequence (across prefill chunks, rewinds and a preemption)."""
    spec = {**NGRAM, "max_matching_ngram_size": 2}
    eng = LLM(llama_engine, speculative_config=spec, disable_overlap_scheduler=True, enable_chunked_prefill=True,
              max_num_tokens=7, kv_cache_config={"max_tokens": 96, "tokens_per_block": 8}).engine
    reqs = [eng.make_request(p, SamplingParams(max_tokens=30, ignore_eos=True)) for p in PROMPTS]
    for r in reqs:
        eng.add_request(r)
    checked = 0
    while eng.has_work:
        for r in eng.step():
            if not r.finished and r.draft_tokens:
                assert r.draft_tokens == lookup(r.all_token_ids, 2, 4), r.request_id
                checked += 1
    assert checked > 30 and eng.scheduler.num_preemptions > 0


def test_graph_replay_with_the_history_state_matches_the_eager_engine(llama_engine):
    """The token history goes through the CUDA-graph runner's static state buffers (capture emulated on CPU)."""
    sp = [SamplingParams(max_tokens=n, ignore_eos=True) for n in (9, 30, 17, 24)]
    eager = LLM(llama_engine, speculative_config=NGRAM, max_batch_size=4)
    llm = LLM(llama_engine, speculative_config=NGRAM, max_batch_size=4)
    eng = llm.engine
    max_blocks = -(-(eng.max_seq_len + eng.scheduler.lookahead) // eng.block_size)
    step = CudaGraphStep(eng.runner.decode_fn, CudaGraphConfig(enable_padding=True), eng.max_batch_size, max_blocks,
                         "cpu", backend=EmulatedGraphBackend())
    eng.runner.decode_fn = step
    assert outputs(llm, PROMPTS, sp) == outputs(eager, PROMPTS, sp)
    assert step.num_replays > 0 and step.num_eager == 0 and step.num_padded_rows > 0


def test_a_repetitive_prompt_gets_drafts_accepted(llama_engine):
    prompt = [17, 42, 99, 5, 61, 8] * 5
    out = LLM(llama_engine, speculative_config=NGRAM).generate(prompt, SamplingParams(max_tokens=48, ignore_eos=True))
    c = out.outputs[0]
    al = len(c.token_ids) / (c.num_decode_steps + 1)
    assert c.num_accepted_draft_tokens > 0 and al > 1.0, (al, c.token_ids)


# Sampling ---------------------------------------------------------------------------------------------------------
# LOOPING and sampled_token_counts: nextn.testing.spec_checks (a prompt where the drafts hit about half the time).


@pytest.mark.slow
@pytest.mark.parametrize("params", [dict(temperature=1.0), dict(temperature=1.0, top_k=8, top_p=0.9)])
def test_ngram_keeps_the_token_distribution(llama_engine, params):
    n = 800
    plain = _positions(LLM(llama_engine, speculative_config=None, max_batch_size=64), n, params)
    llm = LLM(llama_engine, speculative_config=NGRAM, max_batch_size=64)
    ngram = _positions(llm, n, params)
    for j in (1, 2):  # the second and third tokens come out of the verify-and-draft step
        assert chi_square_two_sample_pvalue(plain[j], ngram[j]) > 1e-3, (j, plain[j].most_common(5), ngram[j].most_common(5))
    assert len(plain[1]) > 5, "the test needs a spread distribution to mean anything"
    stats = llm.generate([LOOPING] * 64, [SamplingParams(max_tokens=8, seed=s, ignore_eos=True, **params) for s in range(64)])
    assert sum(o.outputs[0].num_accepted_draft_tokens for o in stats) > 50  # drafts really were accepted


@pytest.mark.slow
def test_accepting_every_draft_would_fail_the_distribution_check(llama_engine, monkeypatch):
    """The check above has power: emitting the n-gram drafts unverified changes the distribution detectably."""
    import nextn.speculative.acceptance_rules as rules
    from nextn.testing.spec_checks import accept_every_draft

    n = 400
    plain = _positions(LLM(llama_engine, speculative_config=None, max_batch_size=64), n, dict(temperature=1.0))
    monkeypatch.setattr(rules, "rejection_sampling", accept_every_draft)
    broken = _positions(LLM(llama_engine, speculative_config=NGRAM, max_batch_size=64), n, dict(temperature=1.0))
    assert chi_square_two_sample_pvalue(plain[1], broken[1]) < 1e-6


def test_same_seed_same_output_whatever_the_batch(llama_engine):
    from nextn.testing.spec_checks import same_seed_same_output_whatever_the_batch as check

    check(LLM(llama_engine, speculative_config=NGRAM), LOOPING,
          SamplingParams(max_tokens=24, temperature=1.0, top_p=0.95, seed=1234, ignore_eos=True))


def test_engine_built_with_an_ngram_yaml_drafts_by_default(tmp_path):
    """`build-engine --extra_llm_api_options ngram.yaml`: the engine records no MTP method and loads NGram."""
    from pathlib import Path

    from nextn import LLM, SamplingParams
    from nextn.build.engine_builder import build_engine
    from nextn.speculative.ngram import NGramDrafter
    from nextn.testing import TinyDeepseekSpec, make_tiny_checkpoint

    ckpt = make_tiny_checkpoint(tmp_path / "ckpt", TinyDeepseekSpec(num_mtp_modules=1))
    yaml = Path(__file__).resolve().parents[2] / "configs" / "ngram.yaml"
    manifest = build_engine(ckpt, tmp_path / "engine", max_seq_len=128, progress=False, extra_llm_api_options=yaml)
    assert manifest.speculative.method == "none"
    llm = LLM(tmp_path / "engine")
    assert isinstance(llm.engine.drafter, NGramDrafter)
    plain = LLM(tmp_path / "engine", speculative_config=None)
    prompt, params = [5, 6, 7, 5, 6, 7, 5, 6], SamplingParams(max_tokens=12, ignore_eos=True)
    assert llm.generate(prompt, params).outputs[0].token_ids == plain.generate(prompt, params).outputs[0].token_ids
