"""`nextn train-draft --method medusa` on stories260K (a real pretrained model): a short self-distillation is
deterministic under its seed, beats the untrained heads, writes files `read_medusa_heads` loads, and an engine
with the trained heads stays token-identical to plain decoding on held-out prompts (mc_sim_7b_63 tree)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from nextn.build.medusa_heads import read_medusa_heads
from nextn.cli.train_draft import main
from nextn.train.data import DataConfig
from nextn.train.evaluate import evaluate_heads
from nextn.train.medusa import train_medusa
from nextn.train.session import TrainSettings

DATA = Path(__file__).resolve().parents[2].parent / "shared" / "data"
STORIES = DATA / "models" / "stories260K" / "stories260K.gguf"
CORPUS = DATA / "corpora" / "tinystories_train_head.txt"
CHOICES = DATA / "medusa_choices.json"
#: a small recipe for the test budget (the real one: docs, --steps 3000 on all prompts).
SMALL = {"steps": 60, "max_prompts": 96, "num_tokens": 40, "prompt_len": 12, "batch": 32, "lr": 3e-3, "seed": 3}


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    if not (STORIES.is_file() and CORPUS.is_file() and CHOICES.is_file()):
        pytest.skip(f"../shared/data is absent ({DATA}): stories260K, its corpus or the Medusa trees are not available")
    out = tmp_path_factory.mktemp("medusa") / "heads"
    argv = ["--model_dir", str(STORIES), "--method", "medusa", "--num_heads", "4", "--data", str(CORPUS),
            "--output_dir", str(out), "--steps", str(SMALL["steps"]), "--seed", str(SMALL["seed"]),
            "--max_prompts", str(SMALL["max_prompts"]), "--num_tokens", str(SMALL["num_tokens"]),
            "--prompt_len", str(SMALL["prompt_len"]), "--batch_size", str(SMALL["batch"]), "--lr", str(SMALL["lr"]),
            "--no-progress"]
    assert main(argv) == 0
    return out


def test_training_beats_the_untrained_heads_and_writes_readable_files(trained):
    meta = json.loads((trained / "train_draft.json").read_text())
    assert meta["steps"] == SMALL["steps"] and len(meta["top1_after"]) == 4
    assert all(after > before + 0.03 for before, after in zip(meta["top1_before"], meta["top1_after"]))
    heads = read_medusa_heads(trained)
    assert (heads.num_heads, heads.num_layers, heads.hidden_size, heads.vocab_size) == (4, 1, 64, 512)
    config = json.loads((trained / "config.json").read_text())
    assert config["medusa_num_heads"] == 4 and config["medusa_num_layers"] == 1
    assert config["base_model_name_or_path"] == str(STORIES)


def test_training_is_deterministic_under_its_seed(trained, tmp_path):
    data = DataConfig(files=(str(CORPUS),), seed=SMALL["seed"], prompt_len=SMALL["prompt_len"],
                      num_tokens=SMALL["num_tokens"], max_prompts=SMALL["max_prompts"])
    settings = TrainSettings(steps=SMALL["steps"], batch=SMALL["batch"], lr=SMALL["lr"], seed=SMALL["seed"],
                             progress=False)
    result = train_medusa(STORIES, data, tmp_path, settings, num_heads=4)
    first = load_file(str(trained / "medusa_lm_head.safetensors"))
    again = load_file(str(tmp_path / "medusa_lm_head.safetensors"))
    assert first.keys() == again.keys() and all(torch.equal(first[k], again[k]) for k in first)
    assert result.held_out_prompts == json.loads((trained / "train_draft.json").read_text())["held_out_prompts"]


def test_trained_heads_stay_lossless_on_held_out_prompts(trained):
    prompts = json.loads((trained / "train_draft.json").read_text())["held_out_prompts"][:4]
    choices = json.loads(CHOICES.read_text())["mc_sim_7b_63"]
    m = evaluate_heads(STORIES, trained, "medusa", prompts, medusa_choices=choices, max_tokens=32, ignore_eos=True,
                       engine_dir=trained.parent / "engine")
    assert m["lossless"] and m["tokens"] == 4 * 32
    assert m["acceptance_length"] > 1.2  # random heads accept almost nothing (≈ 1.0)


def test_missing_data_file_is_a_clear_error(tmp_path, capsys):
    argv = ["--model_dir", str(tmp_path), "--method", "mtp", "--data", str(tmp_path / "x.txt"),
            "--output_dir", str(tmp_path / "out")]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert "x.txt" in err and "not found" in err
