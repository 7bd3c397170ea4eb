"""`python -m benchmarks.overlap` on CPU: overlap and sync passes on a random tiny Llama give identical tokens."""

from __future__ import annotations

import json

import pytest

from benchmarks.overlap import main


def test_overlap_and_sync_agree_on_cpu(tmp_path, capsys):
    out = tmp_path / "o.json"
    assert main(["--device", "cpu", "--shapes", "tiny", "--batch_sizes", "1", "3", "--max_tokens", "10",
                 "--repeats", "1", "--rounds", "1", "--json", str(out)]) == 0
    results = json.loads(out.read_text())["results"]
    assert set(results) == {"tiny_b1", "tiny_b3"}
    for r in results.values():
        assert r["identical"] == r["requests"] and r["speed_up"] > 0
        assert [p["overlap"] for p in r["passes"]] == [True, False]
    assert "identical 3/3" in capsys.readouterr().out


def test_bounds_are_checked_before_any_work(tmp_path):
    with pytest.raises(SystemExit):
        main(["--device", "cpu", "--shapes", "tiny", "--batch_sizes", "0"])
    (tmp_path / "other.json").write_text("{}")
    with pytest.raises(SystemExit):  # never overwrites a file it did not write
        main(["--device", "cpu", "--shapes", "tiny", "--json", str(tmp_path / "other.json")])
