"""nextn-bench datasets: trtllm-bench's JSON lines, synthetic length distributions, real prompt files, prepare-dataset."""

from __future__ import annotations

import gzip
import json
import random
import statistics

import pytest

from nextn.bench.dataset import (DatasetEntry, DatasetError, detect_format, load_dataset, normal_lengths,
                                 read_prompt_file, synthetic_dataset, uniform_lengths)
from nextn.cli.nextn_bench import main
from nextn.testing import SMALL_VOCAB

REAL_SETS = {"mt_bench.jsonl": ("mt_bench", 80), "spec_bench.jsonl": ("spec_bench", 480),
             "humaneval.jsonl.gz": ("humaneval", 164), "gsm8k_test.jsonl": ("gsm8k", 1319)}


def _write(path, lines):
    path.write_text("".join((line if isinstance(line, str) else json.dumps(line)) + "\n" for line in lines))
    return path


def test_load_dataset_reads_ids_and_text(tmp_path):
    path = _write(tmp_path / "d.jsonl", [{"task_id": 7, "input_ids": [1, 2, 3], "output_tokens": 4}, "",
                                         {"prompt": "hello", "output_tokens": 2}])
    assert load_dataset(path) == [DatasetEntry(7, 4, input_ids=[1, 2, 3]), DatasetEntry(1, 2, prompt="hello")]
    assert json.loads(DatasetEntry(7, 4, input_ids=[1]).to_json()) == {"task_id": 7, "input_ids": [1], "output_tokens": 4}


@pytest.mark.parametrize("line, message", [
    ("{not json", ":1: not valid JSON"),
    ("[1, 2]", "expected a JSON object"),
    ('{"input_ids": [1], "output_tokens": 2, "lora_request": 1}', "unknown field(s) ['lora_request']"),
    ('{"input_ids": [1], "prompt": "x", "output_tokens": 2}', "exactly one of 'prompt'"),
    ('{"input_ids": [1]}', "'output_tokens' must be an integer ≥ 1"),
    ('{"input_ids": [], "output_tokens": 3}', "'input_ids' must be a non-empty list"),
    ('{"input_ids": [1, -2], "output_tokens": 3}', "'input_ids' must be a non-empty list"),
])
def test_load_dataset_errors_name_the_line(tmp_path, line, message):
    path = _write(tmp_path / "bad.jsonl", [line])
    with pytest.raises(DatasetError, match=None) as e:
        load_dataset(path)
    assert message in str(e.value)
    if "JSON" in message:
        assert f"{path}:1" in str(e.value)


def test_load_dataset_missing_or_empty(tmp_path):
    with pytest.raises(DatasetError, match="does not exist"):
        load_dataset(tmp_path / "nope.jsonl")
    with pytest.raises(DatasetError, match="no requests"):
        load_dataset(_write(tmp_path / "empty.jsonl", [""]))


def test_normal_lengths_follow_mean_and_stdev_with_minimum_one():
    rng = random.Random(0)
    lens = normal_lengths(4000, 60, 12, rng)
    assert abs(statistics.mean(lens) - 60) < 1.5 and abs(statistics.pstdev(lens) - 12) < 1.5
    assert min(normal_lengths(500, 2, 10, rng)) == 1  # clipped, never 0 or negative
    assert normal_lengths(3, 8, 0, rng) == [8, 8, 8]
    with pytest.raises(DatasetError):
        normal_lengths(3, 0, 1, rng)


def test_uniform_lengths_and_synthetic_ids():
    rng = random.Random(1)
    lens = uniform_lengths(2000, 3, 9, rng)
    assert set(lens) == set(range(3, 10))
    with pytest.raises(DatasetError):
        uniform_lengths(2, 5, 4, rng)
    entries = synthetic_dataset([4, 6], [2, 3], 512, rng)
    assert [len(e.input_ids) for e in entries] == [4, 6] and [e.output_tokens for e in entries] == [2, 3]
    assert all(0 <= t < 512 for e in entries for t in e.input_ids)


def test_detect_format_by_fields():
    assert detect_format({"turns": ["a"], "category": "writing"}) == "mt_bench"
    assert detect_format({"turns": ["a"], "category": "translation"}) == "spec_bench"
    assert detect_format({"task_id": "HumanEval/0", "prompt": "def f():"}) == "humaneval"
    assert detect_format({"question": "2+2?", "answer": "4"}) == "gsm8k"
    with pytest.raises(DatasetError, match="'turns'.*'prompt'.*'question'"):
        detect_format({"text": "x"})


def test_read_prompt_file_gz_and_mixed(tmp_path):
    gz = tmp_path / "h.jsonl.gz"
    with gzip.open(gz, "wt") as f:
        f.write(json.dumps({"prompt": "def add(a, b):"}) + "\n")
    assert read_prompt_file(gz) == ("humaneval", ["def add(a, b):"])
    with pytest.raises(DatasetError, match="several formats"):
        read_prompt_file(_write(tmp_path / "m.jsonl", [{"prompt": "x"}, {"question": "y"}]))


@pytest.mark.parametrize("name", sorted(REAL_SETS))
def test_real_prompt_files_are_recognised(shared_data, name):
    fmt, prompts = read_prompt_file(shared_data / "prompts" / name)
    assert (fmt, len(prompts)) == REAL_SETS[name]
    assert all(isinstance(p, str) and p for p in prompts)


@pytest.mark.parametrize("name", sorted(REAL_SETS))
def test_prepare_dataset_real_formats_tokenized(shared_data, checkpoints, tmp_path, capsys, name):
    from transformers import AutoTokenizer

    ckpt = checkpoints.checkpoint(num_mtp_modules=1)  # has the DeepSeek-V3 tokenizer files
    out = tmp_path / "d.jsonl"
    src = shared_data / "prompts" / name
    assert main(["--model_dir", str(ckpt), "prepare-dataset", "--output", str(out), "dataset",
                 "--dataset-local-path", str(src), "--num-requests", "5", "--output-len-dist", "32,0"]) == 0
    assert REAL_SETS[name][0] in capsys.readouterr().err
    entries = load_dataset(out)
    _, prompts = read_prompt_file(src)
    tok = AutoTokenizer.from_pretrained(ckpt)
    assert [e.task_id for e in entries] == list(range(5)) and all(e.output_tokens == 32 for e in entries)
    assert entries[0].input_ids == tok.encode(prompts[0])


def test_prepare_dataset_with_engine_tokenizer_and_text(checkpoints, tmp_path, capsys):
    engine = checkpoints.engine(num_mtp_modules=1)
    src = _write(tmp_path / "q.jsonl", [{"question": "How many legs has a spider?"}, {"question": " ".join(str(i) for i in range(100))}])
    out = tmp_path / "d.jsonl"
    argv = ["--engine_dir", str(engine), "prepare-dataset", "--output", str(out), "dataset", "--path", str(src)]
    assert main(argv + ["--max-input-len", "40"]) == 0
    assert "1 longer than 40 tokens dropped" in capsys.readouterr().err
    assert len(load_dataset(out)) == 1 and load_dataset(out)[0].input_ids
    assert main(argv + ["--text"]) == 0
    assert load_dataset(out)[0].prompt == "How many legs has a spider?"


def test_prepare_dataset_synthetic(checkpoints, tmp_path, capsys):
    engine = checkpoints.engine(num_mtp_modules=1, **SMALL_VOCAB)
    out = tmp_path / "norm.jsonl"
    assert main(["--engine_dir", str(engine), "prepare-dataset", "--output", str(out), "token-norm-dist",
                 "--num-requests", "400", "--input-mean", "30", "--input-stdev", "5", "--output-mean", "20",
                 "--output-stdev", "4"]) == 0
    entries = load_dataset(out)
    ins = [len(e.input_ids) for e in entries]
    outs = [e.output_tokens for e in entries]
    assert len(entries) == 400 and abs(statistics.mean(ins) - 30) < 1.5 and abs(statistics.pstdev(ins) - 5) < 1.5
    assert abs(statistics.mean(outs) - 20) < 1.5 and min(outs) >= 1
    assert all(0 <= t < SMALL_VOCAB["vocab_size"] for e in entries for t in e.input_ids)
    # stdout, uniform, options after the subcommand; same seed → same dataset
    argv = ["prepare-dataset", "--engine_dir", str(engine), "--random-seed", "3", "token-unif-dist", "--num-requests",
            "50", "--input-min", "2", "--input-max", "5", "--output-min", "1", "--output-max", "3"]
    assert main(argv) == 0
    first = capsys.readouterr().out
    rows = [json.loads(line) for line in first.splitlines()]
    assert len(rows) == 50 and {len(r["input_ids"]) for r in rows} <= {2, 3, 4, 5}
    assert {r["output_tokens"] for r in rows} <= {1, 2, 3}
    assert main(argv) == 0 and capsys.readouterr().out == first


def test_a_gzipped_dataset_is_bounded_after_decompression_and_a_device_refused(tmp_path, monkeypatch):
    monkeypatch.setattr("nextn.config.prompt_files.MAX_PROMPT_FILE_BYTES", 4096)
    rows = "".join(json.dumps({"prompt": "x" * 100, "output_tokens": 1}) + "\n" for _ in range(100))
    small = tmp_path / "d.jsonl.gz"
    with gzip.open(small, "wt") as f:
        f.write(rows)
    assert small.stat().st_size < 4096 < len(rows)
    with pytest.raises(DatasetError, match="dataset .*d.jsonl.gz decompresses to more than 4096 bytes"):
        load_dataset(small)
    bad = tmp_path / "bad.jsonl.gz"
    bad.write_bytes(gzip.compress(rows[:300].encode())[:-12])  # truncated
    with pytest.raises(DatasetError, match="bad.jsonl.gz cannot be read"):
        load_dataset(bad)
    with pytest.raises(DatasetError, match="prompt file /dev/zero is not a regular file"):
        read_prompt_file("/dev/zero")


def test_the_benchmarks_prompt_sets_are_read_bounded(tmp_path, monkeypatch):
    from benchmarks.prefix_reuse import load_conversations
    from nextn.bench.real_models import load_prompt_texts

    (tmp_path / "prompts").mkdir()
    row = json.dumps({"question_id": 81, "category": "writing", "turns": ["One?", "Two?"]}) + "\n"
    (tmp_path / "prompts" / "mt_bench.jsonl").write_text(row * 50)
    with gzip.open(tmp_path / "prompts" / "humaneval.jsonl.gz", "wt") as f:
        f.write(json.dumps({"task_id": "HumanEval/0", "prompt": "def f():"}) + "\n")
    assert load_prompt_texts(1, 1, tmp_path) == ["One?", "def f():"]
    assert load_conversations(1, tmp_path) == [("One?", "Two?")]
    monkeypatch.setattr("nextn.config.prompt_files.MAX_PROMPT_FILE_BYTES", len(row) * 10)
    with pytest.raises(DatasetError, match="mt_bench.jsonl is larger than"):
        load_prompt_texts(1, 1, tmp_path)
    with pytest.raises(DatasetError, match="mt_bench.jsonl is larger than"):
        load_conversations(1, tmp_path)
