"""Suffix decoding (vLLM's `method: suffix`; speculative/suffix.py): the drafter keeps each slot's tokens by position
(chunks, re-runs, gaps, slot reuse, prefix-cache hits) and drafts from the request's own tree and earlier outputs;
greedy outputs are token-identical to plain decoding at batch 1 and 5, staggered, with preemption, chunked prefill,
prefix-cache hits and the overlap scheduler on or off; copying pays (AL > 1, more on a repeated request); sampling
keeps the target's distribution."""

from __future__ import annotations

import random
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from nextn.testing.spec_checks import greedy_outputs as outputs
from nextn.testing.spec_checks import staggered_outputs as staggered
from nextn.testing.spec_checks import LOOPING
from nextn.testing.spec_checks import sampled_token_counts as _positions
from nextn import LLM, SamplingParams
from nextn.build.engine_builder import build_engine
from nextn.config.llm_args import LlmArgsError, load_llm_args_yaml, parse_llm_args
from nextn.speculative.method import LoadContext
from nextn.speculative.protocol import VerifyContext
from nextn.speculative.suffix import SuffixDrafter, build
from nextn.testing.chi_square import chi_square_two_sample_pvalue

SUFFIX = {"decoding_type": "Suffix", "max_draft_len": 4}
PROMPTS = [[5, 6, 7, 8, 5, 6, 7, 8, 5, 6], [9], list(range(20, 47)), [3, 4, 3, 4, 3], [17, 42, 99, 5, 61, 8] * 3]
STORIES = Path(__file__).resolve().parents[2].parent / "shared" / "data" / "models" / "stories260K" / "stories260K.gguf"


# The drafter on its own: rows, slots, positions ------------------------------------------------------------------
def prefill(d: SuffixDrafter, slots: list[int], starts: list[int], chunks: list[list[int]], nexts: list[int]):
    """after_prefill for right-padded chunks at `starts`, each followed by `nexts` (the row convention)."""
    width = max(map(len, chunks))
    ids = torch.tensor([c + [0] * (width - len(c)) for c in chunks])
    lens = torch.tensor([len(c) for c in chunks])
    shifted = torch.cat([ids[:, 1:], ids[:, :1]], 1).scatter(1, (lens - 1)[:, None], torch.tensor(nexts)[:, None])
    meta = SimpleNamespace(positions=torch.tensor(starts)[:, None] + torch.arange(width))
    drafts, _ = d.after_prefill(None, None, meta, None, shifted, lens - 1, ids, (torch.tensor(slots),))
    return drafts.tolist()


def verify(d: SuffixDrafter, slots: list[int], last_pos: list[int], tokens: list[list[int]], counts: list[int]):
    """after_verify for rows whose last token sat at `last_pos`, emitting tokens[b][:counts[b]]."""
    meta = SimpleNamespace(positions=torch.tensor(last_pos)[:, None] + torch.arange(len(tokens[0])))
    drafts, _ = d.after_verify(None, None, meta, None, torch.tensor(tokens), torch.tensor(counts),
                               (torch.tensor(slots),))
    return drafts.tolist()


def test_rows_write_their_slots_by_position_idempotently():
    d = SuffixDrafter(3, max_tree_depth=8)
    assert d.initial_state(4, 16, torch.device("cpu"), torch.float32)[0].tolist() == [0, 1, 2, 3]
    # Two requests in slots 2 and 0; the first prefilled in two chunks, the second whole.
    prefill(d, [2, 0], [0, 0], [[1, 2, 3], [7, 8]], [4, 9])  # row 0's next token 4 is the next chunk's first
    prefill(d, [2], [3], [[4, 5, 1, 2]], [3])
    assert d.slots[2].tokens == [1, 2, 3, 4, 5, 1, 2, 3] and d.slots[2].prompt_len == 7
    assert d.slots[0].tokens == [7, 8, 9] and d.slots[0].prompt_len == 2
    nodes = d.slots[2].tree.num_nodes
    assert prefill(d, [2], [3], [[4, 5, 1, 2]], [3]) == [[4, 5, 1]]  # a re-run changes nothing; "1 2 3" → 4 5 1
    assert d.slots[2].tree.num_nodes == nodes
    # Verify: L = 7 holds the last token; two of four columns emitted (the rest rejected, never written).
    verify(d, [2, 0], [7, 2], [[4, 5, 77, 77], [9, 9, 9, 9]], [2, 1])
    assert d.slots[2].tokens == [1, 2, 3, 4, 5, 1, 2, 3, 4, 5] and d.slots[0].tokens == [7, 8, 9, 9]


def test_with_step_times_the_hint_verifies_what_pays_and_calibrates_from_what_was_accepted():
    """`set_step_times`: argmax_k (B + c · G(k)) / t(B, k) over the proposals; without step times the longest."""
    seq = list(range(10, 30))
    def drafter(step_time=None) -> SuffixDrafter:
        d = SuffixDrafter(16, max_tree_depth=24)
        if step_time is not None:
            d.set_step_times(step_time)
        prefill(d, [0], [0], [seq + seq[:12]], [seq[12]])  # the prompt repeats: the trees expect the copy
        return d
    longest = drafter().slots[0].useful
    assert longest >= 8 and drafter().slots[0].gains == sorted(drafter().slots[0].gains)
    assert drafter().proposal_len([0]) == longest  # no step times: the longest proposal (control)
    assert drafter(lambda b, k: 1 + 0.01 * k).proposal_len([0]) == longest  # rows nearly free: all of it
    assert drafter(lambda b, k: 1 + 1.5 * k).proposal_len([0]) == 0  # each row dearer than a token: none
    stepped = drafter(lambda b, k: 1.0 + 0.3 * k * (k > 4))  # up to 4 drafts free, then dear
    assert stepped.proposal_len([0]) == 4
    # Calibration: the verified proposal expected ~4 accepted drafts; none were, so c drops and the hint shrinks.
    d = drafter(lambda b, k: 1 + 0.2 * k)
    k = d.proposal_len([0])
    assert k > 0
    for _ in range(30):
        last = len(d.slots[0].tokens) - 1
        verify(d, [0], [last], [[999] * (k + 1)], [1])  # every draft rejected: an unseen token instead
        k = max(d.proposal_len([0]), 1)
    c = d.slots[0].calibration
    assert c < 0.2 and d.proposal_len([0]) == 0
    # Not locked out: unverified steps move c back toward 1, and another request starts from 1, not from c.
    for _ in range(5):
        last = len(d.slots[0].tokens) - 1
        verify(d, [0], [last], [[seq[(last + 1) % 20]]], [1])
    assert c < d.slots[0].calibration < 1
    prefill(d, [1], [0], [seq + seq[:12]], [seq[12]])
    assert d.slots[1].calibration == 1.0 and d.proposal_len([1]) > 0


def test_a_gap_starts_a_new_segment_and_a_rewrite_rebuilds():
    d = SuffixDrafter(2, max_tree_depth=4)
    prefill(d, [0], [0], [[1, 2, 3, 1, 2]], [3])
    verify(d, [0], [9], [[5, 6, 0]], [2])  # positions 6..9 were decoded with speculation off: unknown
    s = d.slots[0]
    assert s.tokens == [1, 2, 3, 1, 2, 3, -1, -1, -1, -1, 5, 6] and s.segment == 1 and len(s.ends) == 2
    assert verify(d, [0], [11], [[1, 2, 0]], [2]) == [[3, 1]]  # drafts still come from before the gap
    verify(d, [0], [3], [[7, 8, 0]], [1])  # position 4 rewritten (7, not 2): the tree is rebuilt from position 4
    assert s.tokens == [1, 2, 3, 1, 7] and s.tree.num_nodes == 4 + 4 + 3 + 2  # the distinct paths of "1 2 3 1 7" (D 4)
    want = SuffixDrafter(2, max_tree_depth=4)
    prefill(want, [0], [0], [[1, 2, 3, 1]], [7])
    assert verify(d, [0], [4], [[9, 0, 0]], [1]) == verify(want, [0], [4], [[9, 0, 0]], [1])


def test_a_reused_slot_sends_the_previous_output_to_the_global_tree():
    d = SuffixDrafter(3, max_tree_depth=8, max_cached_requests=2)
    prefill(d, [1], [0], [[50, 51, 52]], [10])
    verify(d, [1], [3], [[11, 12, 13, 14]], [4])
    verify(d, [1], [7], [[15, 0, 0, 0]], [1])
    assert len(d.outputs) == 0  # the end of a request is only known when its slot starts another
    # A new request in slot 1 (prefill at position 0): the output 10..15 (prompt excluded) is cached.
    assert prefill(d, [1], [0], [[60, 11, 12]], [13]) == [[14, 15, 15]]  # from the global tree, padded
    assert len(d.outputs) == 1 and d.outputs.tree.count[0] == 6
    # A prefix-cache hit starts a request too; the global tree keeps max_cached_requests outputs.
    d.load_prefix((), 1, [70, 71])
    assert d.slots[1].tokens == [70, 71] and len(d.outputs) == 2
    prefill(d, [1], [2], [[72]], [73])
    d.load_prefix((), 1, [80])
    assert len(d.outputs) == 2 and d.outputs.tree.count[0] == 2  # the oldest (10..15) evicted: [13] and [73]
    assert verify(d, [1], [0], [[90, 0, 0, 0]], [1]) == [[90, 90, 90]]  # no match anywhere: the last token


def test_only_cpu_engines_and_the_config():
    with pytest.raises(LlmArgsError, match="Suffix.*CPU engines only"):
        build(parse_llm_args({"speculative_config": SUFFIX}).speculative_config,
              LoadContext(None, Path("."), torch.device("cuda"), 128))
    spec = parse_llm_args({"speculative_config": SUFFIX}).speculative_config
    assert (spec.suffix_decoding_max_tree_depth, spec.suffix_decoding_max_cached_requests,
            spec.suffix_decoding_max_spec_factor, spec.suffix_decoding_min_token_prob) == (24, 1000, 1.0, 0.1)
    with pytest.raises(LlmArgsError, match="suffix_decoding_max_tree_depth"):
        parse_llm_args({"speculative_config": {**SUFFIX, "suffix_decoding_max_tree_depth": 65}})
    with pytest.raises(LlmArgsError, match="unknown key 'speculative_config.method'"):
        parse_llm_args({"speculative_config": {**SUFFIX, "method": "suffix"}})
    args = parse_llm_args(load_llm_args_yaml(Path(__file__).parents[2] / "configs" / "suffix.yaml"))
    assert args.speculative_config.decoding_type == "Suffix" and args.speculative_config.max_draft_len == 16


# Greedy: lossless -------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("overlap", [False, True])
def test_greedy_suffix_equals_plain_decoding_alone_and_in_a_batch(llama_engine, overlap):
    sp = SamplingParams(max_tokens=32, ignore_eos=True)
    args = {"disable_overlap_scheduler": not overlap}
    plain = outputs(LLM(llama_engine, speculative_config=None, **args), PROMPTS, sp)
    llm = LLM(llama_engine, speculative_config=SUFFIX, **args)
    assert isinstance(llm.engine.drafter, SuffixDrafter)
    assert outputs(llm, PROMPTS, sp) == plain  # batch of 5
    assert [outputs(llm, [p], sp)[0] for p in PROMPTS] == plain  # one at a time, drafting from earlier outputs too
    assert len(llm.engine.drafter.outputs) >= len(PROMPTS)


@pytest.mark.parametrize("overlap", [False, True])
def test_staggered_arrivals_preemption_and_chunked_prefill_stay_lossless(llama_engine, overlap):
    prompts = PROMPTS + [[i, i + 1, i + 2, i] * 3 for i in range(30, 60, 10)]
    sp = SamplingParams(max_tokens=24, ignore_eos=True)
    plain = LLM(llama_engine, speculative_config=None)
    alone = [outputs(plain, [p], sp)[0] for p in prompts]
    tight = LLM(llama_engine, speculative_config={**SUFFIX, "suffix_decoding_max_tree_depth": 6},
                kv_cache_config={"max_tokens": 112, "tokens_per_block": 8}, enable_chunked_prefill=True,
                max_num_tokens=8, disable_overlap_scheduler=not overlap)
    assert staggered(tight, prompts, [sp] * len(prompts)) == alone
    assert tight.engine.scheduler.num_preemptions > 0
    assert tight.engine.pool.num_free == tight.engine.pool.num_blocks - 1


def test_speculation_switched_off_and_on_by_the_draft_len_policy_stays_lossless(llama_engine):
    """Above max_concurrency the step runs without the drafter: the slots' sequences get gaps, drafting resumes."""
    sp = [SamplingParams(max_tokens=n, ignore_eos=True) for n in (12, 40, 20, 36, 8)]
    plain = outputs(LLM(llama_engine, speculative_config=None), PROMPTS, sp)
    llm = LLM(llama_engine, speculative_config={**SUFFIX, "max_concurrency": 2})
    llm.engine.iteration_log = []
    assert staggered(llm, PROMPTS, sp) == plain
    drafting = [e["drafting"] for e in llm.engine.iteration_log if e["kind"] == "decode"]
    assert False in drafting and drafting[-1]


def test_copying_pays_and_earlier_outputs_are_drafted_from(llama_engine):
    llm = LLM(llama_engine, speculative_config=SUFFIX)
    sp = SamplingParams(max_tokens=48, ignore_eos=True)
    c = llm.generate([17, 42, 99, 5, 61, 8] * 5, sp).outputs[0]
    assert c.num_accepted_draft_tokens > 0 and len(c.token_ids) / (c.num_decode_steps + 1) > 1.5
    prompt = list(range(100, 127))  # no repetition in the prompt: the second run copies the first's output
    first = llm.generate(prompt, sp).outputs[0]
    second = llm.generate(prompt, sp).outputs[0]
    assert second.token_ids == first.token_ids
    assert second.num_decode_steps < first.num_decode_steps and len(second.token_ids) / (second.num_decode_steps + 1) > 3


@pytest.fixture(scope="module")
def stories_engine(tmp_path_factory):
    if not STORIES.is_file():
        pytest.skip(f"{STORIES} is absent (../shared/data): the real stories260K model is not available")
    out = tmp_path_factory.mktemp("suffix_stories") / "engine"
    build_engine(STORIES, out, max_seq_len=256, progress=False)
    return out


def test_prefix_cache_hits_stay_lossless_on_stories260k(stories_engine):
    story = ("Once upon a time, there was a little girl named Lily. She loved to play in the park with her dog. "
             "One day, Lily and her dog went to the park to play. They ran and jumped and had lots of fun. ")
    params = SamplingParams(max_tokens=32, ignore_eos=True)
    plain = LLM(stories_engine, speculative_config=None)
    prompts = [plain.tokenizer.encode(story + e) for e in ["Then", "The little dog ran", "Lily and Ben went to the"]]
    want = outputs(plain, prompts, params)
    plain.shutdown()
    llm = LLM(stories_engine, speculative_config=SUFFIX)
    assert outputs(llm, prompts, params) == want
    calls = []
    drafter = llm.engine.drafter
    load = drafter.load_prefix
    drafter.load_prefix = lambda state, slot, ids: (calls.append(len(ids)), load(state, slot, ids))
    alone = [outputs(llm, [p], params)[0] for p in prompts]  # each again: prefix-cache hits
    assert alone == want and calls and llm.engine.pool.cache.stats.hit_rate > 0
    c = llm.generate(prompts[0], params).outputs[0]
    assert len(c.token_ids) / (c.num_decode_steps + 1) > 2  # the same story again: its earlier outputs are copied
    llm.shutdown()


def test_engine_built_with_the_suffix_yaml_drafts_by_default(tmp_path):
    from nextn.testing import TinyDeepseekSpec, make_tiny_checkpoint

    ckpt = make_tiny_checkpoint(tmp_path / "ckpt", TinyDeepseekSpec(num_mtp_modules=0))
    yaml = Path(__file__).resolve().parents[2] / "configs" / "suffix.yaml"
    build_engine(ckpt, tmp_path / "engine", max_seq_len=128, progress=False, extra_llm_api_options=yaml)
    assert isinstance(LLM(tmp_path / "engine").engine.drafter, SuffixDrafter)


# Sampling ---------------------------------------------------------------------------------------------------------
# LOOPING and sampled_token_counts: nextn.testing.spec_checks (a prompt where the drafts hit about half the time).


@pytest.mark.slow
def test_suffix_keeps_the_token_distribution_and_the_check_has_power(llama_engine, monkeypatch):
    n, params = 400, dict(temperature=1.0)
    plain = _positions(LLM(llama_engine, speculative_config=None, max_batch_size=64), n, params)
    llm = LLM(llama_engine, speculative_config=SUFFIX, max_batch_size=64)
    got = _positions(llm, n, params)
    for j in (1, 2):  # the second and third tokens come out of the verify-and-draft step
        assert chi_square_two_sample_pvalue(plain[j], got[j]) > 1e-3, (j, plain[j].most_common(5), got[j].most_common(5))
    assert len(plain[1]) > 5, "the test needs a spread distribution to mean anything"
    stats = llm.generate([LOOPING] * 64, [SamplingParams(max_tokens=8, seed=s, ignore_eos=True, **params)
                                          for s in range(64)])
    assert sum(o.outputs[0].num_accepted_draft_tokens for o in stats) > 50  # drafts really were accepted

    import nextn.speculative.acceptance_rules as rules
    from nextn.testing.spec_checks import accept_every_draft

    monkeypatch.setattr(rules, "rejection_sampling", accept_every_draft)  # lossy: the drafts emitted unverified
    broken = _positions(LLM(llama_engine, speculative_config=SUFFIX, max_batch_size=64), n, params)
    assert chi_square_two_sample_pvalue(plain[1], broken[1]) < 1e-6


def _lossy_ragged_acceptance(draft_tokens, draws, draft_lens):
    """A wrong rule with `ragged_acceptance`'s signature: emits every verified draft unchecked, then a draw."""
    k = draft_tokens.shape[1]
    j = torch.arange(k + 1)[None, :]
    padded = torch.cat([draft_tokens, draws[:, -1:]], dim=1)
    return torch.where(j < draft_lens[:, None], padded, draws.gather(1, draft_lens[:, None]).expand_as(draws)), \
        draft_lens + 1


@pytest.mark.slow
def test_ragged_sampling_keeps_the_token_distribution_and_the_check_has_power(llama_engine, monkeypatch):
    """Sampled rows in ragged steps (each row verifies its own draft length, `chain_step.verify_ragged`): the
    distribution of the tokens the step emits is plain decoding's (chi-square), and the same check rejects a rule
    that emits the verified drafts unchecked."""
    import nextn.speculative.acceptance_rules as rules

    n, params = 400, dict(temperature=1.0)
    ragged = {**SUFFIX, "max_draft_len": 8, "adaptive_draft_len": True}

    def ragged_llm():
        llm = LLM(llama_engine, speculative_config=ragged, max_batch_size=64)
        llm.engine.drafter.set_step_times(lambda b, k: 1 + 0.01 * k)  # rows cheap: each row verifies its proposal
        llm.engine.iteration_log = []
        return llm

    plain = _positions(LLM(llama_engine, speculative_config=None, max_batch_size=64), n, params)
    llm = ragged_llm()
    got = _positions(llm, n, params)
    lens = [e["draft_lens"] for e in llm.engine.iteration_log if "draft_lens" in e]
    assert lens and sum(map(sum, lens)) > 100, "the check needs ragged steps that verify drafts"
    for j in (1, 2):
        assert chi_square_two_sample_pvalue(plain[j], got[j]) > 1e-3, (j, plain[j].most_common(5), got[j].most_common(5))
    monkeypatch.setattr(rules, "ragged_acceptance", _lossy_ragged_acceptance)
    broken = _positions(ragged_llm(), n, params)
    assert chi_square_two_sample_pvalue(plain[1], broken[1]) < 1e-6


@pytest.mark.parametrize("overlap", [False, True])
def test_the_draft_length_follows_the_match(llama_engine, overlap):
    """With a large K each step verifies only as many drafts as the longest proposal (`proposal_len`): a repeated
    request copies its earlier output in long steps, a fresh one verifies short ones — lossless either way."""
    sp = SamplingParams(max_tokens=48, ignore_eos=True)
    args = {"disable_overlap_scheduler": not overlap}
    plain = LLM(llama_engine, speculative_config=None, **args)
    prompt = list(range(100, 127))
    want = plain.generate(prompt, sp).outputs[0].token_ids
    plain.shutdown()
    llm = LLM(llama_engine, speculative_config={"decoding_type": "Suffix", "max_draft_len": 16}, **args)
    llm.iteration_log = []
    first = llm.generate(prompt, sp).outputs[0]
    fresh = [e["draft_len"] for e in llm.iteration_log if e["kind"] == "decode"]
    llm.iteration_log = []
    second = llm.generate(prompt, sp).outputs[0]
    repeat = [e["draft_len"] for e in llm.iteration_log if e["kind"] == "decode"]
    assert first.token_ids == want and second.token_ids == want
    assert min(fresh) < 16 and all(1 <= k <= 16 for k in fresh + repeat)
    assert max(repeat) > 8 and second.num_decode_steps * 4 < len(want)  # the copy goes in long steps
    llm.shutdown()


def test_adaptive_suffix_picks_lengths_from_its_proposals_and_stays_lossless(llama_engine):
    """`adaptive_draft_len` on Suffix: ProposalDraftLen keeps the cap, the drafter picks k in 0..K per step (0: a
    step that verifies nothing but still drafts, so the trees see every token: no gaps)."""
    sp = [SamplingParams(max_tokens=n, ignore_eos=True) for n in (12, 40, 20, 36, 8)]
    plain = outputs(LLM(llama_engine, speculative_config=None), PROMPTS, sp)
    llm = LLM(llama_engine, speculative_config={**SUFFIX, "max_draft_len": 8, "adaptive_draft_len": True})
    assert llm.engine.drafter.step_time is not None
    llm.engine.iteration_log = []
    assert staggered(llm, PROMPTS, sp) == plain
    assert outputs(llm, PROMPTS, sp) == plain  # again: the outputs are in the global tree now
    decode = [e for e in llm.engine.iteration_log if e["kind"] == "decode"]
    assert all(e["drafting"] for e in decode)  # the drafter saw every step
    assert {e["draft_len"] for e in decode} - {0}  # it verified drafts where they paid
    llm.shutdown()


def test_each_row_gets_its_own_draft_length_where_it_pays():
    """`proposal_lens`: the drafts of the highest calibrated gain first, the total of the most expected tokens
    per second — a copying row verifies its proposal, a row with nothing to copy none, in the same step."""
    seq = list(range(10, 30))
    d = SuffixDrafter(16, max_tree_depth=24)
    assert d.proposal_lens([0], 16) is None  # no step times: one length per step (`proposal_len`)
    prefill(d, [0, 1], [0, 0], [seq + seq[:12], [7, 8, 9]], [seq[12], 5])
    useful = d.slots[0].useful
    assert useful >= 8 and d.slots[1].useful == 0
    d.set_step_times(lambda b, k: 1 + 0.01 * k)  # rows nearly free
    assert d.proposal_lens([0, 1], 16) == [useful, 0]
    assert d.proposal_lens([0, 1], 3) == [3, 0]  # the policy's cap
    assert d.proposal_lens([1, 0], 16) == [0, useful]
    d.set_step_times(lambda b, k: 1 + 1.5 * k)  # each row dearer than a token: none
    assert d.proposal_lens([0, 1], 16) == [0, 0]
    # A row's drafts cost what a uniform step with as many rows costs: t(B, Σk / B). Cheap up to 2 rows a request
    # (4 in all at batch 2), dear after: the copying row takes 4.
    d.set_step_times(lambda b, k: 1.0 + 0.3 * max(0.0, k - 2) * b)
    assert d.proposal_lens([0, 1], 16) == [4, 0]
    # Priced by drafts in all (`ragged_step_times`): a first row dearer than a token, the next ones cheap — a
    # proposal pays only where it is long enough to carry the first row's cost, whatever the uniform times say.
    d.set_step_times(lambda b, k: 1 + 0.01 * k, lambda b, most: [1.0] + [1.6 + 0.01 * n for n in range(1, most + 1)])
    assert d.proposal_lens([0, 1], 16) == [useful, 0]  # its many drafts carry the first row's cost
    d.set_step_times(lambda b, k: 1 + 0.01 * k, lambda b, most: [1.0] + [20.0 + 0.01 * n for n in range(1, most + 1)])
    assert d.proposal_lens([0, 1], 16) == [0, 0]  # no proposal here carries a first row that dear: none
    # Calibration per row: row 0 rejected everything it verified (k = 3) and its calibration drops; a row that
    # verified none moves back toward 1.
    last = len(d.slots[0].tokens) - 1
    verify_ragged = d.after_verify(None, None, SimpleNamespace(positions=torch.tensor([[last], [3]]) + torch.arange(4)),
                                   None, torch.tensor([[999] * 4, [5] * 4]), torch.tensor([1, 1]),
                                   (torch.tensor([0, 1]),), VerifyContext(draft_lens=torch.tensor([3, 0])))
    assert verify_ragged[0].shape == (2, 16) and d.slots[0].calibration < 1.0


@pytest.mark.parametrize("overlap", [False, True])
def test_ragged_steps_verify_each_rows_own_length_losslessly(llama_engine, overlap):
    """With step times the scheduler asks for each row's length (`StepPlan.draft_lens`) and the chain step verifies
    each row's own positions only (`chain_step.verify_ragged`): greedy outputs token-identical to plain decoding,
    staggered, with a repeated request copying long stretches beside fresh ones; a seeded sampling row and a row
    asking for log-probabilities ride in ragged steps too (the sampled row is plain decoding's with the same seed,
    the log-probabilities plain's); a row with logits processing makes the step verify one length (control)."""
    prompts = PROMPTS + [list(range(100, 127))]
    sp = [SamplingParams(max_tokens=n, ignore_eos=True) for n in (12, 40, 20, 36, 8, 32)]
    args = {"disable_overlap_scheduler": not overlap}
    plain_llm = LLM(llama_engine, speculative_config=None, **args)
    plain = outputs(plain_llm, prompts, sp)
    llm = LLM(llama_engine, speculative_config={**SUFFIX, "max_draft_len": 16, "adaptive_draft_len": True}, **args)
    llm.engine.drafter.set_step_times(lambda b, k: 1 + 0.05 * k)  # rows cheap: each row verifies its proposal
    assert llm.engine.scheduler.draft_schedule.proposal_lens is not None
    outputs(llm, [prompts[-1]], [sp[-1]])  # its output goes to the global tree: that request copies in long steps
    llm.engine.iteration_log = []
    assert staggered(llm, prompts, sp) == plain
    assert outputs(llm, prompts, sp) == plain
    lens = [e["draft_lens"] for e in llm.engine.iteration_log if "draft_lens" in e]
    assert lens and any(max(x) > 8 and min(x) < max(x) for x in lens)  # long and short rows in one step

    def ragged_full_batches() -> int:
        return len([e for e in llm.engine.iteration_log if "draft_lens" in e and e["num_requests"] == len(prompts)])

    # Sampled and log-probability rows beside greedy ones, in ragged steps.
    mixed = sp[:-2] + [SamplingParams(max_tokens=24, ignore_eos=True, temperature=1.0, top_p=0.9, seed=3),
                       SamplingParams(max_tokens=32, ignore_eos=True, logprobs=2)]
    want = [o.outputs[0] for o in plain_llm.generate(prompts, mixed)]
    llm.engine.iteration_log = []
    got = [o.outputs[0] for o in llm.generate(prompts, mixed)]
    assert [o.token_ids for o in got] == [o.token_ids for o in want]
    assert ragged_full_batches() > 0
    assert got[-1].num_accepted_draft_tokens > 8  # the copying row: drafts accepted in the ragged steps
    for x, y in zip(want[-1].logprobs, got[-1].logprobs, strict=True):
        assert x.token_id == y.token_id and x.logprob == pytest.approx(y.logprob, abs=1e-4)
        assert [t for t, _ in x.top] == [t for t, _ in y.top]
    # Control: a row with a penalty (logits processing) in the batch: one length for every row, still exact.
    llm.engine.iteration_log = []
    penalised = sp[:-1] + [SamplingParams(max_tokens=32, ignore_eos=True, repetition_penalty=1.3)]
    assert outputs(llm, prompts, penalised) == outputs(plain_llm, prompts, penalised)
    assert ragged_full_batches() == 0
    llm.shutdown()
    plain_llm.shutdown()


@pytest.mark.parametrize("spec", [SUFFIX, {"decoding_type": "NGram", "max_draft_len": 3}], ids=["Suffix", "NGram"])
def test_seeded_sampling_equals_plain_decoding_token_for_token(llama_engine, spec):
    """Deterministic drafts are verified by the coupled rule (acceptance_reference.coupled_acceptance): each emitted
    token is the one plain decoding draws there with the same seed, so sampled output is plain's exactly — again
    when the request repeats (a warm global tree proposes other drafts), and in a batch."""
    prompts = [LOOPING, PROMPTS[0], PROMPTS[4]]
    sps = [SamplingParams(max_tokens=32, ignore_eos=True, temperature=t, top_p=p, seed=s)
           for t, p, s in ((1.0, 1.0, 3), (0.8, 0.9, 11), (1.2, 1.0, 5))]
    plain = LLM(llama_engine, speculative_config=None)
    want = [o.outputs[0].token_ids for o in plain.generate(prompts, sps)]
    plain.shutdown()
    llm = LLM(llama_engine, speculative_config=spec)
    for _ in range(2):  # the second round drafts from the first round's outputs too
        outs = llm.generate(prompts, sps)
        assert [o.outputs[0].token_ids for o in outs] == want
    assert sum(o.outputs[0].num_accepted_draft_tokens for o in outs) > 0
    assert [llm.generate(p, sp).outputs[0].token_ids for p, sp in zip(prompts, sps)] == want


def test_the_offline_replay_reproduces_the_engine_step_for_step(llama_engine):
    """benchmarks/suffix_replay.py replays recorded greedy outputs through the drafter's host methods instead of running
    the model: its steps and verified rows must be the engine's own, cold and warm (the global tree). Without the
    overlap scheduler, whose step in flight past a request's end is not a replayed step."""
    from benchmarks.suffix_replay import accepted_tree, replay_nextn

    sp = SamplingParams(max_tokens=48, ignore_eos=True)
    prompt = list(range(100, 127))
    llm = LLM(llama_engine, speculative_config={"decoding_type": "Suffix", "max_draft_len": 16},
              disable_overlap_scheduler=True)
    engine = []
    for _ in range(2):
        llm.iteration_log = []
        out = llm.generate(prompt, sp).outputs[0].token_ids
        decode = [e for e in llm.iteration_log if e["kind"] == "decode"]
        engine.append((len(decode), sum(e["draft_len"] for e in decode)))
    llm.shutdown()
    replay = replay_nextn([(prompt, list(out))], SuffixDrafter(16), passes=2, step_time=None)
    assert [(r.steps, r.rows) for r in replay] == engine and replay[1].al > 3
    assert replay[0].tokens == replay[1].tokens == len(out) - 1
    # a tree verifies along the path that matches: root children 5 and 7, then 7's child 8
    assert accepted_tree([5, 7, 8, 9], [-1, -1, 1, 1], [7, 8, 3]) == 2 and accepted_tree([5], [-1], [6]) == 0


def test_the_copy_oracle_verifies_exactly_the_copyable_stretch():
    """benchmarks/suffix_replay.py's copy oracle (the bound quoted for copying drafters) finds the longest stretch of the
    output to come in the request's context or an earlier output — at token boundaries only — and verifies that."""
    from benchmarks.suffix_replay import _Haystack, replay_copy_oracle

    h = _Haystack()
    h.add([1, 23, 4])
    h.add([7, 8], separate=True)
    assert h.longest_run([23, 4, 9]) == 2 and h.longest_run([2, 3]) == 0 and h.longest_run([3, 4]) == 0
    assert h.longest_run([4, 7]) == 1 and h.longest_run([7, 8]) == 2 and h.longest_run([4]) == 1
    # the output copies the prompt: after the prefill's token 10 one step verifies 11..16 (6 drafts) and emits 99
    # too; 98 occurs nowhere: a step of no drafts
    prompt, output = [10, 11, 12, 13, 14, 15, 16], [10, 11, 12, 13, 14, 15, 16, 99, 98]
    cold = replay_copy_oracle([(prompt, output)], passes=1, step_time=None, max_draft_len=16)[0]
    assert (cold.steps, cold.rows, cold.tokens) == (2, 6, 8)
    # capped at K = 4 ([11..14] + 15, [16] + 99, [] + 98); a second pass copies [16, 99, 98] from the first's output
    two = replay_copy_oracle([(prompt, output)], passes=2, step_time=lambda k: 1.0 + 0.1 * k, max_draft_len=4)
    assert [(r.steps, r.rows) for r in two] == [(3, 5), (2, 7)]
