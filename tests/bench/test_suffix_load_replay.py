"""benchmarks/suffix_load_replay.py: recorded streams through the suffix drafter by C closed-loop clients, priced with
step times (the decision quality of ragged draft lengths under load)."""

from __future__ import annotations

import json

import pytest

from benchmarks.suffix_load_replay import main, replay_under_load
from nextn.speculative.suffix import SuffixDrafter

SEQ = list(range(10, 40))
STREAMS = [(SEQ, SEQ[:24]), ([5, 6, 7], [8, 9, 1, 2, 3, 4, 5, 6]), (SEQ, SEQ[:20])]  # two copy their prompt


def _drafter(step_time) -> SuffixDrafter:
    d = SuffixDrafter(16)
    d.set_step_times(lambda b, k: step_time(b, k) / step_time(b, 0.0))
    return d


@pytest.mark.parametrize("concurrency", [1, 2, 3])
def test_copies_pay_where_rows_are_cheap_and_nothing_is_verified_where_they_are_dear(concurrency):
    cheap = lambda b, k: 1.0 + 0.01 * k  # noqa: E731
    (r,) = replay_under_load(STREAMS, _drafter(cheap), concurrency, 1, cheap)
    assert r["tokens"] == sum(len(o) - 1 for _, o in STREAMS)  # every output token after the prefill's, once
    assert r["predicted_speedup"] > 1.5 and r["verified_rows_per_step"] > 1
    dear = lambda b, k: 1.0 + 2.0 * k  # noqa: E731  a verified row costs two plain steps
    (r,) = replay_under_load(STREAMS, _drafter(dear), concurrency, 1, dear)
    assert r["verified_rows_per_step"] == 0 and r["predicted_speedup"] == 1.0 and r["accepted_over_predicted"] is None


def test_the_command_reads_streams_and_a_profile(tmp_path, capsys):
    streams = tmp_path / "streams.json"
    streams.write_text(json.dumps({"streams": STREAMS}))
    with pytest.raises(SystemExit):
        main(["--streams", str(tmp_path / "missing.json"), "--step_profile", str(tmp_path / "p.json")])
    assert "not a streams.json" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["--streams", str(streams), "--step_profile", "p.json", "--concurrency", "0"])
