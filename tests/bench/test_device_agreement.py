"""`python -m benchmarks.device_agreement` on CPU: plain and NGram on stories260K agree token for token."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from benchmarks.device_agreement import cases, main

STORIES = Path(__file__).resolve().parents[2].parent / "shared" / "data" / "models" / "stories260K" / "stories260K.gguf"


def test_graph_cases_only_on_cuda():
    assert [name for name, _, _ in cases("cpu")] == ["plain", "ngram"]
    cuda = {name: extra for name, _, extra in cases("cuda")}
    assert [name for name, extra in cuda.items() if "cuda_graph_config" in extra] == [
        "plain_graph", "ngram_graph", "plain_graph_sync", "ngram_graph_sync"]
    assert [name for name, extra in cuda.items() if extra.get("disable_overlap_scheduler")] == [
        "plain_graph_sync", "ngram_graph_sync"]


@pytest.mark.skipif(not STORIES.is_file(), reason=f"{STORIES} is absent (../shared/data/models)")
def test_cpu_plain_and_ngram_agree(tmp_path, capsys):
    out = tmp_path / "a.json"
    assert main(["--model", str(STORIES), "--devices", "cpu", "--batch", "3", "--max_tokens", "12", "--repeats", "1",
                 "--engine_cache_dir", str(tmp_path / "eng"), "--json", str(out)]) == 0
    results = json.loads(out.read_text())["results"]
    assert set(results) == {"cpu_plain", "cpu_ngram"}
    assert all(r["identical"] == r["requests"] == 3 and r["tokens_per_s"] > 0 for r in results.values())
    assert "identical to cpu plain: 3/3" in capsys.readouterr().out
    with pytest.raises(SystemExit):  # never overwrites a file it did not write
        (tmp_path / "other.json").write_text("{}")
        main(["--model", str(STORIES), "--devices", "cpu", "--json", str(tmp_path / "other.json")])
