"""`nextn train-draft` on a real base: SmolLM2-135M-Instruct (a quantized GGUF, llama architecture, tied embeddings,
BPE tokenizer, chat template). A short smoke run of MTP and Medusa training on MT-bench prompts: the data is
chat-templated, the held-out MT-bench questions are never trained on, and the engine built with the heads is
lossless against plain decoding on them (train_draft.json records it)."""

from __future__ import annotations

import json

import pytest

from nextn.cli.train_draft import main

pytestmark = pytest.mark.slow

SMALL = ["--steps", "4", "--max_prompts", "8", "--num_tokens", "12", "--num_top1_prompts", "2", "--batch_size", "8",
         "--eval_prompts", "2", "--no-progress", "--seed", "0"]


@pytest.fixture(scope="module")
def cache(tmp_path_factory):
    return tmp_path_factory.mktemp("cache")


@pytest.fixture(scope="module")
def smollm2(shared_data):
    path = shared_data / "models" / "smollm2-135m-instruct" / "SmolLM2-135M-Instruct.Q4_1.gguf"
    if not path.is_file():
        pytest.skip(f"{path} is absent")
    return path


def test_mtp_module_on_smollm2_is_lossless(smollm2, shared_data, cache, tmp_path):
    out = tmp_path / "mtp"
    assert main(["--model_dir", str(smollm2), "--method", "mtp", "--num_heads", "1", "--num_draft_steps", "2",
                 "--data", str(shared_data / "prompts" / "mt_bench.jsonl"), "--output_dir", str(out),
                 "--cache_dir", str(cache), "--eval_mtp", "2", *SMALL]) == 0
    meta = json.loads((out / "train_draft.json").read_text())
    assert meta["chat"] and meta["acceptance"]["lossless"] is True and meta["acceptance"]["acceptance_length"] >= 1.0
    assert json.loads((out / "config.json").read_text())["num_nextn_predict_layers"] == 1
    assert all(i.startswith("mt_bench/") for i in meta["eval_prompt_ids"])
    assert set(meta["eval_prompt_ids"]) <= set(meta["held_out_ids"])
    assert not set(meta["held_out_ids"]) & set(meta["train_prompt_ids"])


def test_medusa_heads_on_smollm2_are_lossless(smollm2, shared_data, cache, tmp_path):
    out = tmp_path / "medusa"
    assert main(["--model_dir", str(smollm2), "--method", "medusa", "--num_heads", "4",
                 "--data", str(shared_data / "prompts" / "mt_bench.jsonl"), "--output_dir", str(out),
                 "--cache_dir", str(cache),
                 "--eval_medusa_choices", str(shared_data / "medusa_choices.json"), *SMALL]) == 0
    meta = json.loads((out / "train_draft.json").read_text())
    assert (out / "medusa_lm_head.safetensors").is_file()
    assert meta["acceptance"]["lossless"] is True
