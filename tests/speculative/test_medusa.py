"""Medusa end to end: build-engine packs heads; greedy tree decoding is token-identical to plain decoding on
stories260K (GGUF, a real pretrained model) and on a tiny DeepSeek-V3 base, for published trees and a chain;
unsafe or misfitting head files are refused; the tree step compiles with fullgraph=True."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from nextn import LLM, SamplingParams
from nextn.build.engine_builder import build_engine
from nextn.build.medusa_heads import MedusaHeadsError, read_medusa_heads
from nextn.models.medusa import MedusaHeads
from nextn.speculative.medusa_tree import chain
from nextn.testing import SMALL_VOCAB
from nextn.speculative.tree_step import tree_verify_and_draft_step

DATA = Path(__file__).resolve().parents[2].parent / "shared" / "data"
STORIES = DATA / "models" / "stories260K" / "stories260K.gguf"


def write_heads(out: Path, num_heads: int, hidden: int, vocab: int, seed: int = 0) -> Path:
    torch.manual_seed(seed)
    heads = MedusaHeads(num_heads, 1, hidden, vocab)
    out.mkdir(parents=True, exist_ok=True)
    save_file({k: v.contiguous() for k, v in heads.state_dict().items()}, str(out / "medusa_lm_head.safetensors"))
    (out / "config.json").write_text(json.dumps({"medusa_num_heads": 2, "medusa_num_layers": 1}))  # says 2: trust tensors
    return out


@pytest.fixture(scope="module")
def published_trees():
    path = DATA / "medusa_choices.json"
    if not path.is_file():
        pytest.skip(f"{path} is absent: the published Medusa trees are not available")
    return json.loads(path.read_text())


@pytest.fixture(scope="module")
def stories_engine(tmp_path_factory):
    if not STORIES.is_file():
        pytest.skip(f"{STORIES} is absent: the real stories260K model is not available")
    tmp = tmp_path_factory.mktemp("stories")
    heads = write_heads(tmp / "heads", 5, 64, 512)
    build_engine(STORIES, tmp / "engine", max_seq_len=256, progress=False, medusa_model_dir=heads)
    return tmp / "engine"


def test_stories260k_plain_decoding_reproduces_the_model_card(stories_engine):
    out = LLM(stories_engine, speculative_config=None).generate([1], SamplingParams(max_tokens=40)).outputs[0]
    assert out.text.startswith("Once upon a time, there was a little girl named Lily. She loved to play outside")


@pytest.mark.parametrize("tree", ["mc_sim_7b_63", "vicuna_7b_stage2", "chain"])
def test_medusa_is_lossless_on_stories260k(stories_engine, published_trees, tree):
    prompts = ["Once upon a time", "Lily and Ben went to the park.", "The cat", "One day"]
    sp = SamplingParams(max_tokens=48, ignore_eos=True)
    plain = LLM(stories_engine, speculative_config=None).generate(prompts, sp)
    choices = chain(4) if tree == "chain" else published_trees[tree]
    llm = LLM(stories_engine, speculative_config={"decoding_type": "Medusa", "medusa_choices": choices})
    assert llm.engine.manifest.speculative.num_medusa_heads == 5  # the tensors, not the config's 2
    outs = llm.generate(prompts, sp)
    assert [o.outputs[0].token_ids for o in outs] == [o.outputs[0].token_ids for o in plain]


def test_medusa_is_lossless_on_a_deepseek_base(checkpoints, tmp_path):
    ckpt = checkpoints.checkpoint(num_mtp_modules=1, **SMALL_VOCAB)
    heads = write_heads(tmp_path / "heads", 4, 64, 512)
    build_engine(ckpt, tmp_path / "engine", progress=False, medusa_model_dir=heads)
    prompts = [[11, 12, 13], [30, 31, 32, 33, 34, 35, 36], [7]]
    sp = SamplingParams(max_tokens=30, ignore_eos=True)
    plain = LLM(tmp_path / "engine", speculative_config=None).generate(prompts, sp)
    medusa = LLM(tmp_path / "engine", speculative_config={"decoding_type": "Medusa", "medusa_choices": [[0], [1], [0, 0], [0, 1], [1, 0], [0, 0, 0]]})
    assert [o.outputs[0].token_ids for o in medusa.generate(prompts, sp)] == [o.outputs[0].token_ids for o in plain]


def test_oracle_heads_accept_long_paths_and_stay_lossless(checkpoints, tmp_path):
    """Heads that know the plain continuation: whole paths are accepted, so KV compaction is exercised."""
    ckpt = checkpoints.checkpoint(num_mtp_modules=1, **SMALL_VOCAB)
    build_engine(ckpt, tmp_path / "engine", progress=False, medusa_model_dir=write_heads(tmp_path / "h", 4, 64, 512))
    prompt = [11, 12, 13, 14, 15]
    sp = SamplingParams(max_tokens=40, ignore_eos=True)
    plain = LLM(tmp_path / "engine", speculative_config=None).generate(prompt, sp).outputs[0].token_ids
    seq = prompt + plain
    llm = LLM(tmp_path / "engine", speculative_config={"decoding_type": "Medusa", "medusa_choices": [[0], [1], [0, 0], [0, 1], [1, 0], [0, 0, 0], [0, 0, 0, 0]]})
    drafter = llm.engine.drafter
    follow = {}  # token → the tokens after its first occurrence in the plain output (an oracle for the heads)
    for i, t in enumerate(seq):
        follow.setdefault(t, seq[i + 1 : i + 1 + drafter.tree.max_depth])

    def oracle_tree(hidden_last, root):
        d, k = drafter.tree.max_depth, drafter.tree.topk
        cands = torch.full((root.shape[0], d, k), 3, dtype=torch.int64)
        for r in range(root.shape[0]):
            future = follow.get(root[r, 0].item(), [])
            cands[r, : len(future), 0] = torch.tensor(future, dtype=torch.int64)
        return torch.cat([root, cands.reshape(root.shape[0], -1)], 1)[:, drafter.tree.candidate_index]

    drafter.tree_from = oracle_tree
    out = llm.generate(prompt, sp).outputs[0]
    assert out.token_ids == plain
    assert out.acceptance_length > 2.0 and out.accepted_per_position[3] > 0


def test_unsafe_and_misfitting_head_files_are_refused(checkpoints, tmp_path):
    class Payload:
        def __reduce__(self):
            return (os.getcwd, ())

    torch.save({"0.0.linear.weight": torch.zeros(2, 2), "x": Payload()}, tmp_path / "medusa_lm_head.pt")
    with pytest.raises(MedusaHeadsError, match="pickle payload"):
        read_medusa_heads(tmp_path)
    ckpt = checkpoints.checkpoint(num_mtp_modules=1, **SMALL_VOCAB)
    wrong = write_heads(tmp_path / "wrong", 3, 32, 512)
    with pytest.raises(MedusaHeadsError, match="hidden size 32"):
        build_engine(ckpt, tmp_path / "engine", progress=False, medusa_model_dir=wrong)
    assert not (tmp_path / "engine").exists()


def test_tree_step_compiles_fullgraph(checkpoints, tmp_path):
    ckpt = checkpoints.checkpoint(num_mtp_modules=1, **SMALL_VOCAB)
    build_engine(ckpt, tmp_path / "engine", progress=False, medusa_model_dir=write_heads(tmp_path / "h", 3, 64, 512))
    eng = LLM(tmp_path / "engine", speculative_config={"decoding_type": "Medusa", "medusa_choices": [[0], [1], [0, 0], [1, 0], [0, 0, 0]]}).engine
    b, n = 2, eng.drafter.tree.num_tokens
    ids = torch.randint(0, 512, (b, n), generator=torch.Generator().manual_seed(0))
    args = (eng.model, eng.drafter, eng.acceptance)
    from nextn.speculative.acceptance_rules import greedy_sampling

    rest = (ids, torch.tensor([4, 9]), torch.tensor([[1, 2], [3, 4]]), greedy_sampling(b), (), (), eng.block_size)
    kv = eng.runner.kv_cache.normal_()
    torch._dynamo.reset()
    with torch.inference_mode():
        ref = tree_verify_and_draft_step(*args, kv.clone(), *rest)
        out = torch.compile(tree_verify_and_draft_step, fullgraph=True, backend="aot_eager")(*args, kv.clone(), *rest)
    assert torch.equal(out.tokens, ref.tokens) and torch.equal(out.draft_tokens, ref.draft_tokens)


def test_medusa_sampling_uses_typical_acceptance_and_is_seeded(stories_engine):
    spec = {"decoding_type": "Medusa", "medusa_choices": chain(3) + [[1], [1, 0], [2]]}
    llm = LLM(stories_engine, speculative_config=spec)
    sp = SamplingParams(max_tokens=40, temperature=0.8, top_p=0.95, seed=11, ignore_eos=True)
    a = llm.generate(["Once upon a time", "The dog"], [sp, sp.model_copy(update={"seed": 12})])
    b = llm.generate(["Once upon a time"], sp)
    assert a[0].outputs[0].token_ids == b[0].outputs[0].token_ids  # same seed, different batch
    assert all(len(o.outputs[0].token_ids) == 40 for o in a)
    greedy = llm.generate(["Once upon a time"], SamplingParams(max_tokens=30, ignore_eos=True))
    plain = LLM(stories_engine, speculative_config=None).generate(["Once upon a time"], SamplingParams(max_tokens=30, ignore_eos=True))
    assert greedy[0].outputs[0].token_ids == plain[0].outputs[0].token_ids
