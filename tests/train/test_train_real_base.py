"""`nextn train-draft` on a real base: SmolLM2-135M-Instruct (a quantized GGUF, llama architecture, tied embeddings,
BPE tokenizer). A short smoke run of MTP and Medusa training; the engine built with the heads must be lossless
against plain decoding on the held-out prompts (train_draft.json records it)."""

from __future__ import annotations

import json

import pytest

from nextn.cli.train_draft import main

pytestmark = pytest.mark.slow

SMALL = ["--steps", "4", "--max_prompts", "24", "--num_tokens", "12", "--prompt_len", "8", "--batch_size", "8",
         "--eval_prompts", "2", "--no-progress", "--seed", "0"]


@pytest.fixture(scope="module")
def smollm2(shared_data):
    path = shared_data / "models" / "smollm2-135m-instruct" / "SmolLM2-135M-Instruct.Q4_1.gguf"
    if not path.is_file():
        pytest.skip(f"{path} is absent")
    return path


def test_mtp_module_on_smollm2_is_lossless(smollm2, shared_data, tmp_path):
    out = tmp_path / "mtp"
    assert main(["--model_dir", str(smollm2), "--method", "mtp", "--num_heads", "1", "--num_draft_steps", "2",
                 "--data", str(shared_data / "corpora" / "tinystories_train_head.txt"), "--output_dir", str(out),
                 "--eval_mtp", "2", *SMALL]) == 0
    meta = json.loads((out / "train_draft.json").read_text())
    assert meta["acceptance"]["lossless"] is True and meta["acceptance"]["acceptance_length"] >= 1.0
    assert json.loads((out / "config.json").read_text())["num_nextn_predict_layers"] == 1


def test_medusa_heads_on_smollm2_are_lossless(smollm2, shared_data, tmp_path):
    out = tmp_path / "medusa"
    assert main(["--model_dir", str(smollm2), "--method", "medusa", "--num_heads", "4",
                 "--data", str(shared_data / "corpora" / "tinystories_train_head.txt"), "--output_dir", str(out),
                 "--eval_medusa_choices", str(shared_data / "medusa_choices.json"), *SMALL]) == 0
    meta = json.loads((out / "train_draft.json").read_text())
    assert (out / "medusa_lm_head.safetensors").is_file()
    assert meta["acceptance"]["lossless"] is True
