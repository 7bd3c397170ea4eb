"""`nextn train-draft` on a Qwen2 base (q/k/v biases): MTP modules are `Qwen2DecoderLayer` blocks whose biases are
written to the checkpoint, and MTP and Medusa heads stay lossless in the engine. A tiny seeded Qwen2 (with
stories260K's tokenizer) runs in seconds; the real Qwen2.5-Coder-0.5B GGUF runs when it has been fetched."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from nextn.cli.train_draft import main

ROOT = Path(__file__).resolve().parents[2]
DATA = ROOT.parent / "shared" / "data"
STORIES = DATA / "models" / "stories260K" / "stories260K.gguf"
CORPUS = DATA / "corpora" / "tinystories_train_head.txt"
QWEN = ROOT / "runs" / "models" / "qwen2.5-coder-0.5b" / "qwen2.5-coder-0.5b-instruct-q4_k_m.gguf"
SMALL = ["--max_prompts", "24", "--num_tokens", "16", "--prompt_len", "8", "--batch_size", "8", "--lr", "3e-3",
         "--num_top1_prompts", "4", "--eval_prompts", "3", "--no-progress", "--seed", "0"]


@pytest.fixture(scope="module")
def tiny_qwen2(tmp_path_factory) -> Path:
    """A seeded 2-layer Qwen2 (hidden 64, random q/k/v biases, peaked logits) with stories260K's 512-token tokenizer,
    saved as an HF checkpoint. Init std 0.2: greedy continuations vary with the context, so drafts are both accepted
    and rejected (at the default 0.02 every prompt continues with one repeated token, which any draft predicts)."""
    if not (STORIES.is_file() and CORPUS.is_file()):
        pytest.skip(f"../shared/data is absent ({DATA}): stories260K's tokenizer or its corpus is not available")
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from nextn.build.gguf_reader import GGUFCheckpoint

    cfg = Qwen2Config(vocab_size=512, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                      tie_word_embeddings=False, bos_token_id=1, eos_token_id=2,
                      initializer_range=0.2)
    torch.manual_seed(0)
    model = Qwen2ForCausalLM(cfg).eval()
    with torch.no_grad():
        model.lm_head.weight.mul_(20.0)
        for layer in model.model.layers:
            for proj in (layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj):
                proj.bias.normal_(0.0, 0.5)
    out = tmp_path_factory.mktemp("qwen2") / "base"
    model.save_pretrained(out)
    GGUFCheckpoint(STORIES).write_tokenizer_files(out)
    return out


def test_mtp_module_on_a_qwen2_base_has_biases_and_is_lossless(tiny_qwen2, tmp_path):
    out = tmp_path / "mtp"
    assert main(["--model_dir", str(tiny_qwen2), "--method", "mtp", "--num_heads", "1", "--num_draft_steps", "2",
                 "--data", str(CORPUS), "--output_dir", str(out), "--steps", "8", "--eval_mtp", "2", *SMALL]) == 0
    tensors = load_file(str(out / "model.safetensors"))
    assert tensors["model.layers.2.self_attn.q_proj.bias"].shape == (64,)
    assert tensors["model.layers.2.self_attn.k_proj.bias"].abs().sum() > 0  # trained, not the zero init
    config = json.loads((out / "config.json").read_text())
    assert config["architectures"] == ["Qwen2ForCausalLM"] and config["num_nextn_predict_layers"] == 1
    meta = json.loads((out / "train_draft.json").read_text())
    assert meta["top1_after"][0] > meta["top1_before"][0]
    assert meta["acceptance"]["lossless"] and meta["acceptance"]["num_prompts"] == 3


def test_medusa_heads_on_a_qwen2_base_are_lossless(tiny_qwen2, shared_data, tmp_path):
    out = tmp_path / "medusa"
    assert main(["--model_dir", str(tiny_qwen2), "--method", "medusa", "--num_heads", "4", "--data", str(CORPUS),
                 "--output_dir", str(out), "--steps", "8", "--eval_medusa_choices",
                 str(shared_data / "medusa_choices.json"), *SMALL]) == 0
    meta = json.loads((out / "train_draft.json").read_text())
    assert meta["acceptance"]["lossless"] and meta["acceptance"]["mode"] == "medusa"


@pytest.mark.slow
def test_mtp_module_on_qwen2_5_coder_gguf_is_lossless(shared_data, tmp_path):
    """The real Qwen2.5-Coder-0.5B-Instruct (Q4_K_M GGUF, chat template): a few steps on HumanEval prompts."""
    if not QWEN.is_file():
        pytest.skip(f"{QWEN} is absent: fetch it with `python ../shared/models/fetch_models.py qwen2.5-coder-0.5b "
                    "--dest runs/models`")
    out = tmp_path / "mtp"
    assert main(["--model_dir", str(QWEN), "--method", "mtp", "--num_heads", "1", "--num_draft_steps", "2",
                 "--data", str(shared_data / "prompts" / "humaneval.jsonl.gz"), "--output_dir", str(out),
                 "--steps", "2", "--max_prompts", "4", "--num_tokens", "8", "--num_top1_prompts", "2",
                 "--batch_size", "4", "--eval_mtp", "2", "--eval_prompts", "2", "--no-progress"]) == 0
    meta = json.loads((out / "train_draft.json").read_text())
    assert meta["chat"] and meta["acceptance"]["lossless"]
    assert all(i.startswith("humaneval/") for i in meta["eval_prompt_ids"])
    assert not set(meta["eval_prompt_ids"]) & set(meta["train_prompt_ids"])
