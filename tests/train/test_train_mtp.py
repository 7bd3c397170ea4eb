"""`nextn train-draft --method mtp` (issue 4): MTP modules for a Llama base by self-distillation. The Eagle stream
attention equals the full masked computation; a few steps reduce the loss and are deterministic under a seed; the
written checkpoint builds into an engine whose plain decoding equals the base's and whose MTP decoding is lossless;
the CLI runs end to end on stories260K. The distilled DeepSeek-V3 student's checkpoint builds and stays lossless."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from torch import nn

from nextn import LLM, SamplingParams
from nextn.build.engine_builder import build_engine
from nextn.cli.train_draft import main
from nextn.train.data import DataConfig, load_base, make_self_distill_data
from nextn.train.mtp import MtpContext, eagle_mask, fit_mtp, mtp_module

DATA = Path(__file__).resolve().parents[2].parent / "shared" / "data"
STORIES = DATA / "models" / "stories260K" / "stories260K.gguf"
CORPUS = DATA / "corpora" / "tinystories_train_head.txt"
SMALL = ["--max_prompts", "40", "--num_tokens", "20", "--prompt_len", "10", "--batch_size", "8", "--lr", "3e-3",
         "--no-progress"]


@pytest.fixture(scope="module")
def stories(tmp_path_factory):
    if not (STORIES.is_file() and CORPUS.is_file()):
        pytest.skip(f"../shared/data is absent ({DATA}): stories260K or its corpus is not available")
    torch.manual_seed(0)
    model, _ = load_base(STORIES)
    cfg = DataConfig(files=(str(CORPUS),), prompt_len=10, num_tokens=20, max_prompts=40, num_top1_prompts=8, seed=1)
    data = make_self_distill_data(STORIES, model, cfg, cache_dir=tmp_path_factory.mktemp("data"), progress=False)
    return model, data


def test_cutting_the_prompt_context_keeps_the_generated_tokens(stories):
    _, data = stories
    cut = data.with_context(4)
    assert cut.prompt_lens.tolist() == [4] * len(cut.prompt_lens) and cut.tokens.shape[1] == 4 + 20
    assert cut.tokens[:, 3:].equal(data.tokens[:, 9:]) and cut.hidden[:, 3:].equal(data.hidden[:, 9:])
    assert (cut.lengths - cut.prompt_lens).equal(data.lengths - data.prompt_lens)


def test_targets_are_the_bases_own_tokens(stories):
    """Generated positions: the engine's continuation; prompt positions: the base's prediction (argmax)."""
    _, data = stories
    rows = data.rows(torch.arange(4), with_prompts=True)
    p = int(data.prompt_lens[0])
    assert rows.prompt_lens.tolist() == [1] * 4 and rows.targets[:, p:].equal(rows.tokens[:, p:])
    assert rows.targets[:, 1:p].equal(data.base_next[:4, : p - 1])
    agree = (data.base_next[:, p - 1 : -1] == data.tokens[:, p:]).float().mean()
    assert agree > 0.9  # the transformers pass predicts what the engine generated


def test_eagle_mask_is_the_runtime_cache_after_a_chain():
    m = eagle_mask(4, 3)[0, 0] == 0  # [12, 12] allowed
    # step 3 (stream 2) at position 3: chain from p = 1 sees module-1 rows 0..1, step 2 at 2, itself at 3
    assert m[8 + 3].nonzero().flatten().tolist() == [0, 1, 4 + 2, 8 + 3]
    assert m[:4, :4].equal(torch.ones(4, 4, dtype=torch.bool).tril()) and not m[:4, 4:].any()


def test_stream_attention_equals_the_masked_streams(stories):
    model, data = stories
    ctx = MtpContext(model.model.embed_tokens.weight, model.lm_head.weight, model.model.rotary_emb)
    module = mtp_module(model.config)
    rows = data.rows(torch.arange(4))
    with torch.no_grad():
        fast, ref = ctx.eagle(module, *rows[:4], 3), ctx.eagle(module, *rows[:4], 3, reference=True)
    for (x, labels, keep, _), (y, labels_ref, keep_ref, _) in zip(fast, ref):
        torch.testing.assert_close(x, y, atol=1e-5, rtol=1e-5)
        assert labels.equal(labels_ref) and keep.equal(keep_ref)
    assert [k.sum().item() for _, _, k, _ in fast] == [4 * (19 - s) for s in range(3)]  # chains from generated rows


@pytest.mark.parametrize("num_modules", [1, 3])
def test_a_few_steps_reduce_the_loss_deterministically(stories, num_modules):
    model, data = stories
    ctx = MtpContext(model.model.embed_tokens.weight, model.lm_head.weight, model.model.rotary_emb)
    held_out = data.rows(data.held_out_rows)
    runs = []
    for _ in range(2):
        torch.manual_seed(5)
        modules = nn.ModuleList(mtp_module(model.config) for k in range(num_modules))
        run = ((lambda r: ctx.eagle(modules[0], *r[:4], 3, targets=r.targets)) if num_modules == 1
               else (lambda r: ctx.vanilla(modules, *r[:4], targets=r.targets)))
        before = ctx.loss(run(held_out)).item()
        fit_mtp(run, ctx, modules.parameters(), data, 8, batch=8, lr=3e-3, seed=2, progress=False)
        runs.append((before, ctx.loss(run(held_out)).item(), modules.state_dict()))
    (before, after, state), (_, _, again) = runs
    assert after < before
    assert all(torch.equal(state[k], again[k]) for k in state)


@pytest.fixture(scope="module")
def trained(stories, tmp_path_factory):
    out = tmp_path_factory.mktemp("mtp") / "ckpt"
    argv = ["--model_dir", str(STORIES), "--method", "mtp", "--num_heads", "1", "--num_draft_steps", "2",
            "--data", str(CORPUS), "--output_dir", str(out), "--steps", "6", "--seed", "1", *SMALL]
    assert main(argv) == 0
    return out


def test_cli_writes_a_checkpoint_build_engine_reads(trained):
    meta = json.loads((trained / "train_draft.json").read_text())
    assert meta["method"] == "mtp" and meta["mode"] == "eagle" and len(meta["top1_after"]) == 2
    acc = meta["rank_acceptance"]  # per draft step (to twice the trained 2), per rank: the calibrated tree's input
    assert 1 <= len(acc) <= 4 and all(len(row) == 8 and sum(row) <= 1 + 1e-6 for row in acc)
    assert max(map(len, meta["eagle_choices"])) <= len(acc)
    assert abs(acc[0][0] - meta["top1_after"][0]) < 1e-6  # rank 0 = the held-out top-1 meter
    assert len(meta["eagle_choices"]) == 15 and meta["eagle_choices"][0] == [0]
    assert meta["expected_acceptance_length"] >= 1.0
    config = json.loads((trained / "config.json").read_text())
    assert config["num_nextn_predict_layers"] == 1 and config["num_hidden_layers"] == 5
    names = load_file(str(trained / "model.safetensors")).keys()
    assert "model.layers.5.eh_proj.weight" in names and "model.layers.5.self_attn.q_proj.weight" in names
    assert (trained / "tokenizer.json").is_file()


def test_checkpoint_engine_decodes_like_the_base_and_mtp_is_lossless(trained, tmp_path):
    """Plain decoding of the written checkpoint = the GGUF base's; MTP Eagle (K = 3) = plain decoding."""
    prompts = json.loads((trained / "train_draft.json").read_text())["held_out_prompts"][:3]
    build_engine(STORIES, tmp_path / "base", progress=False, max_seq_len=128)
    build_engine(trained, tmp_path / "mtp", progress=False, max_seq_len=128)
    sp = SamplingParams(max_tokens=24, ignore_eos=True)
    base = LLM(tmp_path / "base").generate(prompts, sp)
    plain = LLM(tmp_path / "mtp", speculative_config=None).generate(prompts, sp)
    mtp = LLM(tmp_path / "mtp", speculative_config={"decoding_type": "MTP", "num_nextn_predict_layers": 3}
              ).generate(prompts, sp)
    ids = [o.outputs[0].token_ids for o in base]
    assert [o.outputs[0].token_ids for o in plain] == ids and [o.outputs[0].token_ids for o in mtp] == ids


def test_student_checkpoint_builds_and_stays_lossless(stories, tmp_path):
    """A couple of student steps: a DeepSeek-V3 checkpoint (MLA + MoE + 1 MTP layer, stories260K tokenizer)."""
    out = tmp_path / "student"
    argv = ["--model_dir", str(STORIES), "--method", "student", "--data", str(CORPUS), "--output_dir", str(out),
            "--steps", "2", "--seed", "1", "--eval_mtp", "2", "--eval_prompts", "2", *SMALL]
    assert main(argv) == 0
    config = json.loads((out / "config.json").read_text())
    assert config["architectures"] == ["DeepseekV3ForCausalLM"] and config["num_nextn_predict_layers"] == 1
    assert config["vocab_size"] == 512 and (out / "tokenizer.json").is_file()
    meta = json.loads((out / "train_draft.json").read_text())
    assert meta["acceptance"]["lossless"] and len(meta["top1_after"]) == 4  # next token, MTP steps 1..3


def test_eval_only_measures_the_cached_checkpoint(trained):
    argv = ["--model_dir", str(STORIES), "--method", "mtp", "--data", str(CORPUS), "--output_dir", str(trained),
            "--eval_only", "--eval_mtp", "3", "--eval_prompts", "2", *SMALL]
    assert main(argv) == 0
    m = json.loads((trained / "train_draft.json").read_text())["acceptance"]
    assert m["lossless"] and m["num_prompts"] == 2 and m["mode"] == "eagle" and m["acceptance_length"] >= 1.0


def test_a_second_method_reuses_the_cached_data(trained, tmp_path):
    """Medusa heads on the MTP run's data: nothing is generated again, the split is the same."""
    out = tmp_path / "medusa"
    argv = ["--model_dir", str(STORIES), "--method", "medusa", "--num_heads", "2", "--data", str(CORPUS),
            "--output_dir", str(out), "--cache_dir", str(trained / "train_cache"), "--steps", "2", "--seed", "1",
            *SMALL]
    assert main(argv) == 0
    meta, first = (json.loads((d / "train_draft.json").read_text()) for d in (out, trained))
    assert meta["seconds"]["generate"] == 0.0 and meta["seconds"]["hidden"] == 0.0
    assert meta["train_prompt_ids"] == first["train_prompt_ids"] and meta["held_out_ids"] == first["held_out_ids"]


@pytest.mark.parametrize("flag,value,message", [("--tree_nodes", "0", "--tree_nodes must be in [1, 255]"),
                                                ("--tree_depth", "-1", "--tree_depth must be in [0, 64]")])
def test_a_bad_tree_size_is_refused_before_any_work(tmp_path, capsys, flag, value, message):
    out = tmp_path / "never"
    argv = ["--model_dir", str(STORIES), "--method", "mtp", "--data", str(CORPUS), "--output_dir", str(out),
            flag, value, *SMALL]
    assert main(argv) == 2
    assert message in capsys.readouterr().err and not out.exists()
