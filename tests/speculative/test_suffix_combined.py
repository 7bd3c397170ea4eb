"""Combined drafting (speculative/suffix_combined.py): suffix drafts where the trees' score is high, a model
drafter's (Draft_Target, MTP) elsewhere, per request per step. Greedy outputs token-identical to plain decoding at
batch 1 and 5, staggered with preemption and chunked prefill, with prefix-cache hits, overlap on and off; both
sources really draft; sampling keeps the target's distribution, and a lossy rule fails the same check."""

from __future__ import annotations

import pytest
import torch

from nextn import LLM, SamplingParams
from nextn.build.engine_builder import build_engine
from nextn.config.llm_args import LlmArgsError, parse_llm_args
from nextn.speculative.suffix_combined import CombinedDrafter
from nextn.speculative.traits import DrafterTraits
from nextn.testing.chi_square import chi_square_two_sample_pvalue
from nextn.testing.spec_checks import LOOPING
from nextn.testing.spec_checks import greedy_outputs as outputs
from nextn.testing.spec_checks import sampled_token_counts as positions
from nextn.testing.spec_checks import staggered_outputs as staggered
from nextn.testing.tiny_llama import tiny_hf_llama

# repeated stretches (the suffix trees' rows) beside fresh ones (the draft model's)
PROMPTS = [[5, 6, 7, 8, 5, 6, 7, 8, 5, 6], [9], list(range(20, 47)), [3, 4, 3, 4, 3], [17, 42, 99, 5, 61, 8] * 3]
GREEDY = SamplingParams(max_tokens=32, ignore_eos=True)


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    """(target, draft) engines: a 3-layer tiny Llama and its first layer with the same embeddings and head (a
    truncated target agrees often, not always)."""
    tmp = tmp_path_factory.mktemp("combined")
    target = tiny_hf_llama(num_layers=3, lm_head_scale=8.0)
    draft = tiny_hf_llama(num_layers=1, seed=1, lm_head_scale=8.0)
    draft.load_state_dict({k: v for k, v in target.state_dict().items()
                           if not k.startswith(("model.layers.1.", "model.layers.2."))})
    for name, model in (("target", target), ("draft", draft)):
        model.save_pretrained(tmp / f"{name}_ckpt")
        build_engine(tmp / f"{name}_ckpt", tmp / name, progress=False, max_seq_len=256)
    return tmp / "target", tmp / "draft"


def _combined(draft, k: int = 8, **kw) -> dict:
    return {"decoding_type": "Suffix", "max_draft_len": k, "suffix_decoding_max_tree_depth": 8,
            "combine_with": {"decoding_type": "Draft_Target", "max_draft_len": 3, "speculative_model_dir": str(draft)},
            **kw}


@pytest.fixture(scope="module")
def plain(pair):
    return outputs(LLM(pair[0], speculative_config=None), PROMPTS, GREEDY)


@pytest.mark.parametrize("overlap", [True, False], ids=["overlap", "sync"])
def test_greedy_equals_plain_decoding_and_both_drafters_draft(pair, plain, overlap):
    target, draft = pair
    llm = LLM(target, speculative_config=_combined(draft), disable_overlap_scheduler=not overlap)
    d = llm.engine.drafter
    assert isinstance(d, CombinedDrafter) and d.name == "Suffix+DraftModel" and d.traits.sampled
    outs = llm.generate(PROMPTS, GREEDY)
    assert [o.outputs[0].token_ids for o in outs] == plain  # a batch of 5
    assert [outputs(llm, [p], GREEDY)[0] for p in PROMPTS] == plain  # one at a time, earlier outputs in the tree
    assert d.rows_from_suffix > 0 and d.rows_from_model > 0, (d.rows_from_suffix, d.rows_from_model)
    assert sum(o.outputs[0].num_accepted_draft_tokens for o in outs) > 0


def test_staggered_preemption_chunked_prefill_and_prefix_hits_stay_lossless(pair):
    target, draft = pair
    prompts = PROMPTS + [[i, i + 1, i + 2, i] * 3 for i in range(30, 60, 10)]
    sp = SamplingParams(max_tokens=24, ignore_eos=True)
    ref = LLM(target, speculative_config=None)
    alone = [outputs(ref, [p], sp)[0] for p in prompts]
    tight = LLM(target, speculative_config=_combined(draft), kv_cache_config={"max_tokens": 160, "tokens_per_block": 8},
                enable_chunked_prefill=True, max_num_tokens=8)
    assert staggered(tight, prompts, [sp] * len(prompts)) == alone
    assert tight.engine.scheduler.num_preemptions > 0
    again = [outputs(tight, [p], sp)[0] for p in prompts[:4]]  # the same prompts again: prefix-cache hits
    assert again == alone[:4] and tight.engine.pool.cache.stats.hit_rate > 0


def test_a_copied_output_is_verified_in_long_steps(pair):
    """A repeated request: the suffix tree drafts past the draft model's K_m = 3 (draft length from the match)."""
    target, draft = pair
    llm = LLM(target, speculative_config=_combined(draft, k=16, suffix_decoding_max_tree_depth=24))
    prompt, sp = list(range(100, 127)), SamplingParams(max_tokens=48, ignore_eos=True)
    first = llm.generate(prompt, sp).outputs[0]
    second = llm.generate(prompt, sp).outputs[0]
    assert second.token_ids == first.token_ids
    assert len(second.token_ids) / (second.num_decode_steps + 1) > 4  # more than K_m + 1 tokens a step
    # steps where every row copied ran no draft passes of the draft model (its KV still written: lossless above)
    assert llm.engine.drafter.steps_without_model_drafts > 0


def test_mtp_as_the_model_drafter_is_lossless(eagle):
    plain = outputs(LLM(eagle, speculative_config=None), PROMPTS, GREEDY)
    spec = {"decoding_type": "Suffix", "max_draft_len": 6,
            "combine_with": {"decoding_type": "MTP", "num_nextn_predict_layers": 1}}
    llm = LLM(eagle, speculative_config=spec)
    assert llm.engine.drafter.name == "Suffix+MtpEagle"
    assert outputs(llm, PROMPTS, GREEDY) == plain
    assert [outputs(llm, [p], GREEDY)[0] for p in PROMPTS] == plain


def test_the_config_names_both_and_checks_them():
    args = parse_llm_args({"speculative_config": {"decoding_type": "Suffix", "max_draft_len": 8, "combine_with": {
        "decoding_type": "MTP", "num_nextn_predict_layers": 2}}})
    assert args.speculative_config.combine_with.decoding_type == "MTP"
    with pytest.raises(LlmArgsError, match="exceeds"):
        parse_llm_args({"speculative_config": {"decoding_type": "Suffix", "max_draft_len": 2, "combine_with": {
            "decoding_type": "MTP", "num_nextn_predict_layers": 3}}})
    with pytest.raises(LlmArgsError, match="chain drafter"):
        parse_llm_args({"speculative_config": {"decoding_type": "Suffix", "max_draft_len": 8, "combine_with": {
            "decoding_type": "MTP", "num_nextn_predict_layers": 2, "use_dynamic_tree": True,
            "max_total_draft_tokens": 6}}})
    with pytest.raises(LlmArgsError):  # only model drafters combine
        parse_llm_args({"speculative_config": {"decoding_type": "Suffix", "max_draft_len": 8, "combine_with": {
            "decoding_type": "NGram", "max_draft_len": 2}}})


def test_draft_probs_are_the_model_q_on_its_rows_and_one_hot_elsewhere():
    class Model:
        name, num_draft_tokens, traits = "M", 2, DrafterTraits(sampled=True)

        def draft_probs(self, state, num, sampling):
            return state[0][:, :num]

    class Suffix:
        num_draft_tokens, slots = 4, {}

    d = CombinedDrafter(Suffix(), Model())
    q_model = torch.softmax(torch.randn(2, 2, 5), -1)
    drafts = torch.tensor([[1, 2, 2, 2], [3, 4, 0, 1]])
    state = (torch.arange(2), q_model, drafts, torch.tensor([False, True]))
    q = d.draft_probs(state, 4, sampling=None)
    assert q.shape == (2, 4, 5)
    assert torch.equal(q[0, :2], q_model[0])  # the model's row: its q, then one-hot padding
    assert torch.equal(q[0, 2:], torch.nn.functional.one_hot(drafts[0, 2:], 5).float())
    assert torch.equal(q[1], torch.nn.functional.one_hot(drafts[1], 5).float())  # a suffix row: one-hot throughout
    assert d.min_score == 2.0  # default: K_m, the most the model drafter could give


@pytest.mark.slow
def test_sampling_keeps_the_token_distribution_and_the_check_has_power(pair, monkeypatch):
    target, draft = pair
    n, params = 400, dict(temperature=1.0)
    want = positions(LLM(target, speculative_config=None, max_batch_size=64), n, params)
    llm = LLM(target, speculative_config=_combined(draft, suffix_decoding_min_score=0.5), max_batch_size=64)
    got = positions(llm, n, params)
    for j in (1, 2):  # the second and third tokens come out of the verify-and-draft step
        assert chi_square_two_sample_pvalue(want[j], got[j]) > 1e-3, (j, want[j].most_common(5), got[j].most_common(5))
    assert len(want[1]) > 5, "the test needs a spread distribution to mean anything"
    d = llm.engine.drafter
    assert d.rows_from_suffix > 0 and d.rows_from_model > 0, (d.rows_from_suffix, d.rows_from_model)
    stats = llm.generate([LOOPING] * 64, [SamplingParams(max_tokens=8, seed=s, ignore_eos=True, **params)
                                          for s in range(64)])
    assert sum(o.outputs[0].num_accepted_draft_tokens for o in stats) > 20  # drafts really were accepted

    import nextn.speculative.acceptance_rules as rules
    from nextn.testing.spec_checks import accept_every_draft

    monkeypatch.setattr(rules, "rejection_sampling", accept_every_draft)  # lossy: the drafts emitted unverified
    broken = positions(LLM(target, speculative_config=_combined(draft, suffix_decoding_min_score=0.5),
                           max_batch_size=64), n, params)
    # fails the check above (the draft model's q is close to the target's p, so emitting its drafts unverified
    # is only mildly lossy; seeds are fixed, so the p-value is too)
    assert min(chi_square_two_sample_pvalue(want[j], broken[j]) for j in (1, 2)) < 1e-4


def test_a_checkpoint_draft_in_a_yaml_is_found_and_built(pair, plain, tmp_path, monkeypatch):
    """The combined config's draft model, given as a checkpoint path relative to its YAML file, is read from the
    YAML's folder and built into the engine cache like a Draft_Target draft."""
    import nextn.build.engine_cache as engine_cache
    from nextn.config.llm_args import load_llm_args_yaml

    monkeypatch.setattr(engine_cache, "DEFAULT_CACHE_DIR", tmp_path / "cache")
    target, draft = pair
    yaml = draft.parent / "combined.yaml"
    yaml.write_text("speculative_config:\n  decoding_type: Suffix\n  max_draft_len: 8\n  combine_with:\n"
                    "    decoding_type: Draft_Target\n    max_draft_len: 3\n    speculative_model_dir: draft_ckpt\n")
    spec = load_llm_args_yaml(yaml)["speculative_config"]
    assert spec["combine_with"]["speculative_model_dir"] == str(draft.parent / "draft_ckpt")
    llm = LLM(target, speculative_config=spec)
    assert llm.engine.drafter.name == "Suffix+DraftModel"
    assert outputs(llm, PROMPTS, GREEDY) == plain
    assert list((tmp_path / "cache").iterdir())  # the checkpoint was built into the cache
