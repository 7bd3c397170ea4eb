"""Training prompts (`train/prompts.py`): stable ids per source, a held-out split that is a function of the text (so
a held-out MT-bench question repeated in Spec-Bench is never trained on), and a round-robin cap over sources."""

from __future__ import annotations

import json

import pytest

from nextn.train.prompts import balanced, is_held_out, read_prompts, split_prompts


@pytest.fixture
def files(tmp_path):
    mt = [{"question_id": 81 + i, "category": "writing", "turns": [f"Write poem number {i}.", "Again."]}
          for i in range(40)]
    spec = [*mt[:40], *({"question_id": 500 + i, "category": "translation", "turns": [f"Translate {i}."]}
                        for i in range(20))]
    (tmp_path / "mt_bench.jsonl").write_text("".join(json.dumps(r) + "\n" for r in mt))
    (tmp_path / "spec_bench.jsonl").write_text("".join(json.dumps(r) + "\n" for r in spec))
    (tmp_path / "corpus.txt").write_text("\n\n".join(f"Paragraph {i} " + "word " * 12 for i in range(30)) + "\n")
    # Spec-Bench first: its copies of the MT-bench questions must still count as MT-bench ids
    return [tmp_path / "spec_bench.jsonl", tmp_path / "mt_bench.jsonl", tmp_path / "corpus.txt"]


def test_ids_sources_and_duplicates(files):
    prompts = read_prompts(files, chat=True)
    ids = [p.id for p in prompts]
    assert len(ids) == len(set(ids)) == 40 + 20 + 30  # the 40 repeated questions count once
    assert {p.id for p in prompts if p.source == "mt_bench"} == {f"mt_bench/{81 + i}" for i in range(40)}
    assert "spec_bench/500" in ids and "corpus.txt:1" in ids and "corpus.txt:3" in ids
    corpus = next(p for p in prompts if p.id == "corpus.txt:1")
    assert corpus.text.endswith("Paragraph 0 " + "word " * 11 + "word") and "\n\n" in corpus.text  # an instruction
    raw = read_prompts(files[2:], chat=False)
    assert raw[0].text.startswith("Paragraph 0")  # a plain LM continues the raw text


def test_split_is_a_function_of_the_text_and_the_seed(files):
    prompts = read_prompts(files, chat=True)
    train, held = split_prompts(prompts, seed=3, held_out_fraction=0.1, benchmark_held_out_fraction=0.5)
    assert {p.id for p in train}.isdisjoint(p.id for p in held) and len(train) + len(held) == len(prompts)
    held_mt = {p.key for p in held if p.source == "mt_bench"}
    assert 8 <= len(held_mt) <= 32  # about half of the 40 benchmark questions
    assert not held_mt & {p.key for p in train}  # never trained on, whichever file named them
    again, _ = split_prompts(list(reversed(prompts)), seed=3, held_out_fraction=0.1, benchmark_held_out_fraction=0.5)
    assert {p.id for p in again} == {p.id for p in train}  # order of the files does not matter
    other, _ = split_prompts(prompts, seed=4, held_out_fraction=0.1, benchmark_held_out_fraction=0.5)
    assert {p.id for p in other} != {p.id for p in train}
    assert all(is_held_out(p, 3, 0.5) for p in held if p.source == "mt_bench")


def test_balanced_takes_sources_round_robin(files):
    prompts = read_prompts(files, chat=True)
    first = balanced(prompts, 9)
    assert [p.source for p in first] == ["mt_bench", "spec_bench", "corpus.txt"] * 3
    assert len(balanced(prompts)) == len(prompts)


def test_no_prompt_is_an_error(tmp_path):
    (tmp_path / "empty.txt").write_text("\n\nshort\n")
    with pytest.raises(ValueError, match="no prompt"):
        read_prompts([tmp_path / "empty.txt"], chat=True)


# Bounded reads (issue 32, class 4) ------------------------------------------------------------------------------
def test_a_gzip_bomb_stops_at_the_decompressed_cap(tmp_path, monkeypatch):
    import gzip
    import time

    import nextn.train.prompts as prompts
    from nextn.config.prompt_files import DatasetError

    bomb = tmp_path / "bomb.jsonl.gz"
    with gzip.open(bomb, "wb", compresslevel=9) as f:  # 50 MB of zeros in a ~50 KB file
        for _ in range(50):
            f.write(b"\0" * (1 << 20))
    assert bomb.stat().st_size < 1 << 20
    monkeypatch.setattr(prompts, "MAX_PROMPT_FILE_BYTES", 1 << 20, raising=True)
    monkeypatch.setattr("nextn.config.prompt_files.MAX_PROMPT_FILE_BYTES", 1 << 20)
    start = time.perf_counter()
    with pytest.raises(DatasetError, match=r"bomb.jsonl.gz decompresses to more than 1048576 bytes"):
        read_prompts([bomb], chat=True)
    assert time.perf_counter() - start < 5


def test_a_corpus_over_the_cap_a_device_and_a_fifo_are_refused_unread(tmp_path, monkeypatch):
    import os
    import threading

    from nextn.config.prompt_files import DatasetError

    monkeypatch.setattr("nextn.train.prompts.MAX_PROMPT_FILE_BYTES", 1000)
    big = tmp_path / "big.txt"
    big.write_text("word " * 400)
    with pytest.raises(DatasetError, match="corpus file .*big.txt is larger than 1000 bytes"):
        read_prompts([big], chat=False)
    with pytest.raises(DatasetError, match="corpus file /dev/zero is not a regular file"):
        read_prompts(["/dev/zero"], chat=True)
    fifo = tmp_path / "prompts.jsonl"
    os.mkfifo(fifo)
    result = []

    def read():
        try:
            read_prompts([fifo], chat=True)
        except DatasetError as e:
            result.append(str(e))

    t = threading.Thread(target=read, daemon=True)
    t.start()
    t.join(5)
    assert result and "not a regular file" in result[0], "a FIFO hung the read or was read"
