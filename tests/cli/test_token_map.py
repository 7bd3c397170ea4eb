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
    assert main(["token-map", "--model_dir", str(tmp_path), "--corpus", str(tmp_path), "--out", str(out)]) == 2
    assert "not a .gguf file, an engine or a checkpoint" in capsys.readouterr().err
