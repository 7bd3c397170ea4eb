"""`nextn token-map`: token ids ranked by their count in a corpus under the model's own tokenizer (SmolLM2's GGUF
from ../shared), written atomically; unreadable inputs are exit status 2 with the file named."""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path

import pytest

from nextn.cli.main import main
from nextn.cli.token_map import load_tokenizer

SMOLLM2 = Path(__file__).resolve().parents[2].parent / "shared" / "data" / "models" / "smollm2-135m-instruct" / \
    "SmolLM2-135M-Instruct.Q4_1.gguf"
TEXT = "def add(a, b):\n    return a + b\n\n" * 5 + "The cat sat on the mat. The cat ran.\n"


@pytest.fixture(scope="module")
def gguf() -> Path:
    if not SMOLLM2.is_file():
        pytest.skip(f"{SMOLLM2} is absent (../shared/data/models holds it on CI)")
    return SMOLLM2


def test_ids_are_ranked_by_count_then_id(gguf, tmp_path, capsys):
    corpus = tmp_path / "corpus.txt"
    corpus.write_text(TEXT)
    prompts = tmp_path / "mt.jsonl"
    prompts.write_text(json.dumps({"question_id": 1, "category": "coding", "turns": ["Sort a list."]}) + "\n")
    out = tmp_path / "maps" / "hot.json"
    assert main(["token-map", "--model_dir", str(gguf), "--corpus", str(corpus), str(prompts), "--out", str(out)]) == 0
    ids = json.loads(out.read_text())
    tok = load_tokenizer(gguf)
    counts = Counter(tok.encode(TEXT, add_special_tokens=False) + tok.encode("Sort a list.", add_special_tokens=False))
    assert ids == sorted(counts, key=lambda i: (-counts[i], i))
    assert counts[ids[0]] > counts[ids[-1]]  # a real ranking, not one count for all
    assert "distinct token ids" in capsys.readouterr().out
    assert [p.name for p in out.parent.iterdir()] == ["hot.json"]  # no temporary file left


def test_unreadable_inputs_are_exit_status_2(gguf, tmp_path, capsys):
    out = tmp_path / "hot.json"
    assert main(["token-map", "--model_dir", str(gguf), "--corpus", str(tmp_path / "missing.txt"),
                 "--out", str(out)]) == 2
    assert "missing.txt" in capsys.readouterr().err and not out.exists()
    corpus = tmp_path / "corpus.txt"
    corpus.write_text("a b c\n")
    assert main(["token-map", "--model_dir", str(tmp_path), "--corpus", str(corpus), "--out", str(out)]) == 2
    assert "not a .gguf file, an engine or a checkpoint" in capsys.readouterr().err


@pytest.mark.parametrize("corpus", ["/dev/zero", "fifo"])
def test_a_corpus_that_is_not_a_regular_file_is_refused_unread(tmp_path, capsys, corpus):
    # issue 32: `--corpus /dev/zero` read until MemoryError; a FIFO would block for ever
    import os

    if corpus == "fifo":
        corpus = str(tmp_path / "fifo")
        os.mkfifo(corpus)
    out = tmp_path / "hot.json"
    assert main(["token-map", "--model_dir", str(tmp_path), "--corpus", corpus, "--out", str(out)]) == 2
    assert "not a regular file" in capsys.readouterr().err and not out.exists()


def test_out_must_be_a_file_and_not_a_users_file(tmp_path, capsys):
    # issue 32: `--out DIR` was a traceback; `--out config.json` replaced the user's file
    corpus = tmp_path / "corpus.txt"
    corpus.write_text(TEXT)
    args = ["token-map", "--model_dir", str(tmp_path / "none"), "--corpus", str(corpus), "--out"]
    assert main([*args, str(tmp_path)]) == 2
    assert "is a directory" in capsys.readouterr().err
    mine = tmp_path / "config.json"
    mine.write_text('{"vocab_size": 10}')
    assert main([*args, str(mine)]) == 2
    assert "not written by this command" in capsys.readouterr().err
    assert mine.read_text() == '{"vocab_size": 10}'
    link = tmp_path / "link.json"
    link.symlink_to(mine)
    assert main([*args, str(link)]) == 2 and "symbolic link" in capsys.readouterr().err


def test_an_earlier_token_map_is_replaced_and_force_replaces_any_file(gguf, tmp_path):
    corpus = tmp_path / "corpus.txt"
    corpus.write_text(TEXT)
    out = tmp_path / "hot.json"
    out.write_text("[3, 2, 1]")
    base = ["token-map", "--model_dir", str(gguf), "--corpus", str(corpus), "--out", str(out)]
    assert main(base) == 0 and json.loads(out.read_text()) != [3, 2, 1]
    out.write_text("notes")
    assert main(base) == 2 and out.read_text() == "notes"
    assert main([*base, "--force"]) == 0 and isinstance(json.loads(out.read_text()), list)
