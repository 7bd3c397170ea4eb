"""Self-distillation data (`train/data.py`) on stories260K: continuations come from nextn's engine and are stored per
prompt, so a run with more prompts generates only the new ones and a run stopped by its time budget resumes."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from nextn import LLM, SamplingParams
from nextn.cli.train_draft import main
from nextn.train.data import GenerationStore

DATA = Path(__file__).resolve().parents[2].parent / "shared" / "data"
STORIES = DATA / "models" / "stories260K" / "stories260K.gguf"
CORPUS = DATA / "corpora" / "tinystories_train_head.txt"


@pytest.fixture(scope="module")
def llm():
    if not STORIES.is_file():
        pytest.skip(f"../shared/data is absent ({DATA}): stories260K is not available")
    return LLM(STORIES, speculative_config=None, dtype="float32", max_batch_size=4)


def test_the_store_generates_only_what_it_lacks_and_equals_plain_generate(llm, tmp_path):
    prompts = [(f"p{i}", [1, 20 + i, 30 + 2 * i]) for i in range(6)]
    store = GenerationStore(tmp_path / "gen.jsonl")
    store.generate(llm, prompts[:2], 8, ignore_eos=True, deadline=None, progress=False)
    first = (tmp_path / "gen.jsonl").read_text().splitlines()
    store.generate(llm, prompts, 8, ignore_eos=True, deadline=None, progress=False)
    lines = (tmp_path / "gen.jsonl").read_text().splitlines()
    assert len(first) == 2 and lines[:2] == first and len(lines) == 6  # nothing generated twice
    again = GenerationStore(tmp_path / "gen.jsonl")  # read back from the file
    want = llm.generate([ids for _, ids in prompts], SamplingParams(max_tokens=8, ignore_eos=True))
    assert [again.get(pid, ids) for pid, ids in prompts] == [o.outputs[0].token_ids for o in want]
    assert again.get("p0", [1, 2, 3]) is None  # another prompt under the same id is not a hit


def test_a_spent_budget_stops_generation_with_exit_status_3(tmp_path, capsys):
    if not CORPUS.is_file():
        pytest.skip(f"{CORPUS} is absent")
    argv = ["--model_dir", str(STORIES), "--method", "mtp", "--data", str(CORPUS), "--output_dir",
            str(tmp_path / "out"), "--max_prompts", "8", "--num_tokens", "8", "--prompt_len", "8", "--max_minutes", "0",
            "--no-progress"]
    assert main(argv) == 3
    assert "time budget ran out while generating" in capsys.readouterr().err
    assert not (tmp_path / "out" / "train_draft.json").exists()
    stored = list((tmp_path / "out" / "train_cache").glob("generations-*.jsonl"))
    assert len(stored) == 1 and all(json.loads(line)["id"] for line in stored[0].read_text().splitlines())


def test_a_gguf_base_is_the_model_transformers_loads():
    """`load_base` builds the `transformers` model from nextn's GGUF reader: every tensor (q/k rows in HF order) and
    the logits equal those of `transformers`' own GGUF loading (SmolLM2's Q4_1 blocks and tied head: the reader's
    tensors against `transformers`' in tests/models/test_real_gguf.py)."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    from nextn.train.data import load_base

    path = STORIES
    if not path.is_file():
        pytest.skip(f"{path} is absent (../shared/data holds it on CI)")
    model, tokenizer = load_base(path)
    cfg = AutoConfig.from_pretrained(path.parent, gguf_file=path.name)
    cfg.pad_token_id = None
    want = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, config=cfg, dtype=torch.float32)
    got_state, want_state = model.state_dict(), want.eval().state_dict()
    assert set(got_state) == set(want_state)
    assert all(torch.equal(got_state[k], want_state[k]) for k in want_state)
    ids = torch.tensor([tokenizer.encode("Once upon a time, a cat")])
    with torch.no_grad():
        assert torch.equal(model(ids).logits, want(ids).logits)
    assert not model.training and not any(p.requires_grad for p in model.parameters())


def test_the_top1_meter_takes_the_held_out_benchmarks_in_turn(tmp_path):
    if not STORIES.is_file():
        pytest.skip(f"../shared/data is absent ({DATA}): stories260K is not available")
    from nextn.train.data import DataConfig, load_base, make_self_distill_data

    prompts = DATA / "prompts"
    cfg = DataConfig(files=(str(prompts / "mt_bench.jsonl"), str(prompts / "humaneval.jsonl.gz")), chat=False,
                     prompt_len=8, num_tokens=2, max_prompts=2, num_top1_prompts=6)
    model, _ = load_base(STORIES)
    data = make_self_distill_data(STORIES, model, cfg, cache_dir=tmp_path, progress=False)
    meter = [data.prompt_ids[i].split("/")[0] for i in data.held_out_rows.tolist()]
    assert meter == ["mt_bench", "humaneval"] * 3  # in split order 12 of the first 16 were HumanEval
    assert set(data.prompt_ids[i] for i in data.held_out_rows.tolist()) <= set(data.held_out)


def test_the_generations_cache_is_read_bounded_and_skips_rows_that_are_not_its_own(tmp_path, monkeypatch):
    import os

    import nextn.train.data as data

    path = tmp_path / "generations-k.jsonl"
    path.write_text(json.dumps({"id": "a", "prompt": [1, 2], "continuation": [3]}) + "\n"
                    + "[1, 2]\n" + json.dumps({"id": "b", "prompt": "text", "continuation": [3]}) + "\n"
                    + '{"id": "c", "prom')  # a line cut by an interruption
    store = GenerationStore(path)
    assert store.done == {"a": ([1, 2], [3])}
    monkeypatch.setattr(data, "MAX_GENERATIONS_BYTES", 10)
    with pytest.raises(ValueError, match="generations cache .* larger than 10 bytes"):
        GenerationStore(path)
    fifo = tmp_path / "generations-f.jsonl"
    os.mkfifo(fifo)
    with pytest.raises(ValueError, match="not a regular file"):
        GenerationStore(fifo)
