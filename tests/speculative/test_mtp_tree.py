"""MTP with a draft tree (issue 18): static (`eagle_choices`) and dynamic (EAGLE-2) trees are token-identical to plain
decoding on a tiny DeepSeek-V3 (MLA + MoE, distilled MTP module) and on a Llama base with a trained MTP module, at
batch > 1 with the overlap scheduler on and off; the chain as a tree drafts exactly MTP Eagle's chain; sampled
requests draw what plain decoding draws; the draft-length policy turns the tree down and off losslessly."""

from __future__ import annotations

from pathlib import Path

import pytest

from nextn import LLM, SamplingParams
from nextn.config.llm_args import LlmArgsError
from nextn.speculative.draft_tree import chain_choices
from nextn.testing import SMALL_VOCAB

DATA = Path(__file__).resolve().parents[2].parent / "shared" / "data"
STORIES = DATA / "models" / "stories260K" / "stories260K.gguf"
CORPUS = DATA / "corpora" / "tinystories_train_head.txt"

PROMPTS = [[11, 12, 13], [30, 31, 32, 33, 34, 35, 36], [7], [100, 3, 250, 4, 9]]
STATIC = {"decoding_type": "MTP", "num_nextn_predict_layers": 3,
          "eagle_choices": [[0], [0, 0], [1], [0, 0, 0], [0, 1], [2], [1, 0], [0, 0, 1], [0, 1, 0]]}  # best first
DYNAMIC = {"decoding_type": "MTP", "num_nextn_predict_layers": 3, "use_dynamic_tree": True,
           "dynamic_tree_max_topK": 3, "max_total_draft_tokens": 10}


def _ids(outs) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in outs]


def _run(engine, spec, prompts=PROMPTS, sp=None, **kw):
    sp = sp or SamplingParams(max_tokens=32, ignore_eos=True)
    llm = LLM(engine, speculative_config=spec, **kw)
    return llm.generate(prompts, sp)


@pytest.fixture(scope="module")
def plain(eagle):
    return _ids(_run(eagle, None))


@pytest.mark.parametrize("overlap", [True, False])
@pytest.mark.parametrize("spec", [STATIC, DYNAMIC], ids=["static", "dynamic"])
def test_tree_is_lossless_on_deepseek(eagle, plain, spec, overlap):
    outs = _run(eagle, spec, disable_overlap_scheduler=not overlap)
    assert _ids(outs) == plain
    assert sum(o.outputs[0].num_accepted_draft_tokens for o in outs) > 0  # the tree's drafts are accepted


def test_chain_as_a_tree_drafts_mtp_eagles_chain(eagle):
    """eagle_choices = the chain: same tokens, same accepted drafts per request as MTP Eagle (K = 3)."""
    chain = _run(eagle, {"decoding_type": "MTP", "num_nextn_predict_layers": 3})
    tree = _run(eagle, {"decoding_type": "MTP", "num_nextn_predict_layers": 3, "eagle_choices": chain_choices(3)})
    assert _ids(tree) == _ids(chain) and _stats(tree) == _stats(chain)


def _stats(outs) -> list[tuple[int, int]]:
    return [(o.outputs[0].num_draft_tokens, o.outputs[0].num_accepted_draft_tokens) for o in outs]


def test_a_tree_holding_the_chain_takes_no_more_steps(eagle):
    """Every step's tree contains the chain's path, so it emits at least as much per step. (This module's draft
    distribution is nearly flat — top-1 probability ≈ 0.003 over 512 tokens — so its second choices are rarely
    right: the trees' gain shows on trained heads, docs/PERFORMANCE.md.)"""
    sp = SamplingParams(max_tokens=64, ignore_eos=True)
    chain = _run(eagle, {"decoding_type": "MTP", "num_nextn_predict_layers": 3}, sp=sp)
    tree = _run(eagle, STATIC, sp=sp)
    assert sum(n for n, _ in _stats(tree)) <= sum(n for n, _ in _stats(chain))  # 3 counted per step for both


def test_a_dynamic_tree_with_every_candidate_is_the_full_static_tree(eagle):
    """Depth 2, top-2, budget 6 = all candidates: the same nodes as the full binary tree, so the same steps."""
    base = {"decoding_type": "MTP", "num_nextn_predict_layers": 2}
    static = _run(eagle, {**base, "eagle_choices": [[0], [1], [0, 0], [0, 1], [1, 0], [1, 1]]})
    dynamic = _run(eagle, {**base, "use_dynamic_tree": True, "dynamic_tree_max_topK": 2, "max_total_draft_tokens": 6})
    assert _ids(dynamic) == _ids(static) and _stats(dynamic) == _stats(static)


@pytest.mark.parametrize("spec", [STATIC, DYNAMIC], ids=["static", "dynamic"])
def test_sampled_requests_draw_what_plain_decoding_draws(eagle, spec):
    """Sampling: one position-keyed draw per depth, descending while it is a child — the same draws as plain
    decoding (the distribution test is tests/speculative/test_draft_tree.py)."""
    sp = SamplingParams(max_tokens=24, temperature=0.8, top_p=0.95, seed=3, ignore_eos=True)
    plain = _run(eagle, None, sp=sp)
    tree = _run(eagle, spec, sp=sp)
    assert _ids(tree) == _ids(plain)


@pytest.mark.parametrize("spec", [STATIC, DYNAMIC], ids=["static", "dynamic"])
def test_draft_len_schedule_turns_the_tree_down_and_off(eagle, plain, spec):
    """Batch ≤ 1: the whole tree; ≤ 2: its best 4 nodes; more: off — still token-identical."""
    spec = {**spec, "draft_len_schedule": {1: spec.get("max_total_draft_tokens", 9), 2: 4}}
    outs = _run(eagle, spec, max_batch_size=4)
    assert _ids(outs) == plain


@pytest.mark.parametrize("spec", [STATIC, DYNAMIC, {"decoding_type": "MTP", "num_nextn_predict_layers": 3}],
                         ids=["static", "dynamic", "chain"])
def test_a_prefill_whose_batch_will_not_speculate_does_not_draft(eagle, plain, spec):
    """Schedule: speculate alone only. Four prompts admitted at once: their prefill writes the module's KV but drafts
    nothing (the next steps are plain); once one request is left, it drafts first, then its drafts are accepted —
    token-identical throughout."""
    llm = LLM(eagle, speculative_config={**spec, "draft_len_schedule": {1: 3}}, max_batch_size=4)
    llm.engine.iteration_log = []
    sp = [SamplingParams(max_tokens=n, ignore_eos=True) for n in (8, 8, 8, 32)]
    outs = llm.generate(PROMPTS, sp)
    assert _ids(outs) == [ids[:n] for ids, n in zip(plain, (8, 8, 8, 32))]  # greedy: a prefix of the 32 tokens
    log = llm.engine.iteration_log
    prefill = [e for e in log if e["kind"] == "prefill"]
    assert prefill and not any(e["drafting"] for e in prefill)
    alone = [e for e in log if e["kind"] == "decode" and e["num_requests"] == 1]
    assert alone[0]["draft_len"] == 0 and alone[0]["drafting"]  # drafts first ...
    assert any(e["draft_len"] > 0 for e in alone[1:])  # ... then speculates
    assert outs[-1].outputs[0].num_accepted_draft_tokens > 0


@pytest.mark.parametrize("spec", [STATIC, DYNAMIC], ids=["static", "dynamic"])
def test_adaptive_draft_len_counts_a_trees_nodes(eagle, plain, spec):
    """adaptive_draft_len on a tree: token-identical; its step times are kept per node count (not per accepted
    depth) and its acceptance model is the tree's own gain."""
    llm = LLM(eagle, speculative_config={**spec, "adaptive_draft_len": True}, max_batch_size=4)
    assert _ids(llm.generate(PROMPTS, SamplingParams(max_tokens=32, ignore_eos=True))) == plain
    policy, drafter = llm.engine.draft_len_policy, llm.engine.drafter
    nodes = drafter.num_draft_tokens
    assert nodes in policy.step_time[4]  # the first steps verify the whole tree, timed under its node count
    assert policy.gain == drafter.expected_tokens
    assert policy.gain(0.5, nodes) > policy.gain(0.5, 3) > 1.0  # more nodes, more expected tokens


def test_tree_options_are_checked(eagle, vanilla):
    with pytest.raises(LlmArgsError, match="deep but num_nextn_predict_layers is 1"):
        LLM(eagle, speculative_config={"decoding_type": "MTP", "eagle_choices": [[0], [0, 0]]})
    with pytest.raises(LlmArgsError, match="exceeds the 3 candidates"):
        LLM(eagle, speculative_config={**DYNAMIC, "num_nextn_predict_layers": 1, "max_total_draft_tokens": 4})
    with pytest.raises(LlmArgsError, match="MTP Vanilla"):
        LLM(vanilla, speculative_config={"decoding_type": "MTP", "eagle_choices": [[0]]})
    with pytest.raises(LlmArgsError, match="exclusive"):
        LLM(eagle, speculative_config={**DYNAMIC, "eagle_choices": [[0]]})


@pytest.fixture(scope="module")
def llama_mtp(tmp_path_factory):
    """stories260K (a real Llama GGUF) with one MTP module trained for a few steps by `nextn train-draft`."""
    if not (STORIES.is_file() and CORPUS.is_file()):
        pytest.skip(f"../shared/data is absent ({DATA}): stories260K or its corpus is not available")
    from nextn.build.engine_builder import build_engine
    from nextn.cli.train_draft import main

    tmp = tmp_path_factory.mktemp("llama_mtp")
    argv = ["--model_dir", str(STORIES), "--method", "mtp", "--num_heads", "1", "--num_draft_steps", "3",
            "--data", str(CORPUS), "--output_dir", str(tmp / "ckpt"), "--steps", "30", "--seed", "1",
            "--max_prompts", "40", "--num_tokens", "20", "--prompt_len", "10", "--batch_size", "8", "--lr", "3e-3",
            "--no-progress"]
    assert main(argv) == 0
    build_engine(tmp / "ckpt", tmp / "engine", progress=False, max_seq_len=128)
    return tmp / "engine"


@pytest.mark.parametrize("overlap", [True, False])
@pytest.mark.parametrize("spec", [STATIC, DYNAMIC], ids=["static", "dynamic"])
def test_tree_is_lossless_on_a_llama_base_with_a_trained_mtp_module(llama_mtp, spec, overlap):
    prompts = ["Once upon a time", "Lily and Ben went to the park.", "The cat", "One day"]
    plain = _ids(_run(llama_mtp, None, prompts))
    outs = _run(llama_mtp, spec, prompts, disable_overlap_scheduler=not overlap)
    assert _ids(outs) == plain
    assert sum(o.outputs[0].num_accepted_draft_tokens for o in outs) > 0


@pytest.mark.parametrize("spec", [STATIC, DYNAMIC], ids=["static", "dynamic"])
def test_incremental_trees_equal_trees_from_scratch(eagle, spec):
    """After every step, the drafted tree (built with compaction, the path's first pass and per-depth passes over
    the paged cache) equals the tree a fresh prefill over the accepted sequence drafts: no stale module KV."""
    from nextn.testing.spec_checks import check_drafts_against_fresh_prefill

    eng = LLM(eagle, speculative_config=spec).engine
    for p in PROMPTS:
        eng.add_request(eng.make_request(p, SamplingParams(max_tokens=20, ignore_eos=True)))
    checked = check_drafts_against_fresh_prefill(eng, eng.drafter.num_draft_tokens, check_drafter_state=True)
    assert checked > 15


@pytest.mark.parametrize("spec", [STATIC, DYNAMIC], ids=["static", "dynamic"])
def test_tree_step_compiles_fullgraph(eagle, spec):
    """The tree step is one graph (torch.compile fullgraph=True) and matches eager, with a mixed greedy/sampled
    batch: no host synchronisation, no data-dependent branching in the tree expansion or the selection."""
    import torch

    from nextn.speculative.protocol import SamplingTensors
    from nextn.speculative.tree_step import tree_verify_and_draft_step

    eng = LLM(eagle, speculative_config=spec).engine
    torch._dynamo.reset()
    gen = torch.Generator().manual_seed(0)
    b, n = 3, eng.drafter.num_draft_tokens + 1
    ids = torch.randint(0, SMALL_VOCAB["vocab_size"], (b, n), generator=gen)
    kv_lens = torch.tensor([5, 9, 17])
    tables = torch.tensor([[1, 2], [3, 4], [5, 6]])
    state = eng.drafter.initial_state(b, eng.cfg.hidden_size, torch.device("cpu"), torch.float32)
    sampling = SamplingTensors(torch.tensor([0.0, 0.7, 1.0]), torch.tensor([0, 5, 0]), torch.tensor([1.0, 1.0, 0.9]),
                               torch.tensor([1, 2, 3]), any_sampled=True, use_filters=True)
    kv = eng.runner.kv_cache
    kv.normal_(generator=gen)
    args = (eng.model, eng.drafter, eng.acceptance)
    with torch.inference_mode():
        ref = tree_verify_and_draft_step(*args, kv.clone(), ids, kv_lens, tables, sampling, state, (),
                                         eng.block_size)
        step = torch.compile(tree_verify_and_draft_step, fullgraph=True, dynamic=False, backend="aot_eager")
        out = step(*args, kv.clone(), ids, kv_lens, tables, sampling, state, (), eng.block_size)
    assert torch.equal(out.tokens, ref.tokens) and torch.equal(out.num_emitted, ref.num_emitted)
    assert torch.equal(out.draft_tokens, ref.draft_tokens)
    for got, want in zip(out.drafter_state, ref.drafter_state):
        assert torch.equal(got, want)


@pytest.mark.parametrize("spec", [STATIC, DYNAMIC], ids=["static", "dynamic"])
def test_graph_replay_matches_the_eager_engine(eagle, spec):
    """CUDA-graph replay of the tree step (the CPU emulation backend: static buffers, padded batches, the dynamic
    tree's state rows) gives the eager engine's tokens and accepted drafts, greedy and sampled requests mixed."""
    from nextn.config.llm_args import CudaGraphConfig
    from nextn.runtime.cuda_graph_runner import CudaGraphStep, EmulatedGraphBackend

    params = [SamplingParams(max_tokens=n, ignore_eos=True) for n in (6, 10, 14, 20)]
    params[0] = SamplingParams(max_tokens=6, ignore_eos=True, temperature=0.8, top_k=20, seed=7)
    eager = _run(eagle, spec, sp=params, max_batch_size=4, max_seq_len=128)
    llm = LLM(eagle, speculative_config=spec, max_batch_size=4, max_seq_len=128)
    eng = llm.engine
    max_blocks = -(-(eng.max_seq_len + eng.scheduler.lookahead) // eng.block_size)
    step = CudaGraphStep(eng.runner.decode_fn, CudaGraphConfig(enable_padding=True), eng.max_batch_size, max_blocks,
                         "cpu", backend=EmulatedGraphBackend())
    eng.runner.decode_fn = step
    graph = llm.generate(PROMPTS, params)
    assert _ids(graph) == _ids(eager) and _stats(graph) == _stats(eager)
    assert step.num_replays > 0


CHAIN = {"decoding_type": "MTP", "num_nextn_predict_layers": 3}


@pytest.mark.parametrize("spec", [CHAIN, STATIC, DYNAMIC], ids=["chain", "static", "dynamic"])
def test_a_draft_head_cut_to_hot_tokens_is_lossless(eagle, plain, spec, tmp_path):
    """The MTP module's head over the hot tokens only (`draft_vocab_size` + a token map): −inf logits elsewhere,
    drafts still accepted, output still plain decoding's, chain and trees."""
    import json
    from collections import Counter

    import torch

    counts = Counter(t for ids in plain for t in ids)
    token_map = tmp_path / "hot.json"
    token_map.write_text(json.dumps([t for t, _ in counts.most_common(24)]))
    llm = LLM(eagle, speculative_config={**spec, "draft_vocab_size": 32, "draft_token_map": str(token_map)})
    model = llm.engine.model
    hot = model.draft_hot_tokens
    assert hot.numel() == 32 and {t for t, _ in counts.most_common(24)} <= set(hot.tolist())
    logits = model.draft_logits(torch.randn(2, 1, model.cfg.hidden_size))
    off = torch.ones(SMALL_VOCAB["vocab_size"], dtype=torch.bool)
    off[hot] = False
    assert logits.shape[-1] == SMALL_VOCAB["vocab_size"] and torch.isinf(logits[..., off]).all()
    assert torch.isfinite(logits[..., hot]).all()
    outs = llm.generate(PROMPTS, SamplingParams(max_tokens=32, ignore_eos=True))
    assert _ids(outs) == plain
    assert sum(o.outputs[0].num_accepted_draft_tokens for o in outs) > 0


def test_a_bad_draft_token_map_is_a_clear_error(eagle, tmp_path):
    bad = tmp_path / "hot.json"
    bad.write_text("[1, 100000]")
    with pytest.raises(LlmArgsError, match="outside the draft model's vocabulary"):
        LLM(eagle, speculative_config={**CHAIN, "draft_vocab_size": 32, "draft_token_map": str(bad)})
