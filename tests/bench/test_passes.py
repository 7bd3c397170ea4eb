"""bench/passes.py: the spread of timed passes, the warning when they disagree, and the speed-up bound (≤ AL)."""

from __future__ import annotations

import pytest

from nextn.bench.passes import DEFAULT_MAX_SPREAD, PassSpread, speed_up, spread_warning


def test_spread_of_passes():
    s = PassSpread((10.0, 12.0, 11.0), load_before=0.2, load_after=0.4, cpu_cores=8, torch_threads=4)
    assert (s.minimum, s.median, s.maximum) == (10.0, 11.0, 12.0)
    assert s.relative_spread == pytest.approx(2 / 11)
    assert s.disagrees(0.10) and not s.disagrees(0.20)
    assert s.passes_text() == "10.00 / 12.00 / 11.00"
    assert s.noise_text() == "load average 0.20 before, 0.40 after, on 8 cores with 4 torch threads"
    assert not s.busy()
    one = PassSpread((10.0,))
    assert one.relative_spread is None and not one.disagrees(0.01)  # one pass: no spread can be measured
    d = s.to_dict()
    assert d["num_passes"] == 3 and d["output_throughput_tok_s"] == [10.0, 12.0, 11.0]
    assert d["load_average_after"] == 0.4


def test_warning_names_the_spread_and_the_machines_noise():
    busy = PassSpread((8.18, 15.03, 8.46), load_before=7.2, load_after=8.02, cpu_cores=2, torch_threads=2)
    w = spread_warning("NGram K=4", busy, DEFAULT_MAX_SPREAD)
    assert w is not None and "NGram K=4" in w and "disagree by 81%" in w and "8.18 / 15.03 / 8.46" in w
    assert "load average 7.20 before, 8.02 after, on 2 cores" in w and "--num_threads 1" in w
    assert spread_warning("NGram K=4", PassSpread((10.0, 10.5, 10.2)), DEFAULT_MAX_SPREAD) is None


def test_a_speed_up_above_the_al_is_refused():
    # issue 33: `Speed-up over no speculation (NGram K=4): 15.010x (AL 1.006)` was printed as a result
    v = speed_up(150.1, 10.0, 1.006)
    assert v.impossible and not v.reliable and v.shown is None
    assert "exceeds the AL 1.006" in v.reason and v.to_dict(10.0)["speed_up"] is None
    ok = speed_up(10.3, 10.0, 1.006)  # within the tolerance of noise
    assert ok.reliable and ok.shown == pytest.approx(1.03) and ok.reason is None
    good = speed_up(25.0, 10.0, 2.8)
    assert good.reliable and good.shown == pytest.approx(2.5)


def test_a_speed_up_from_disagreeing_passes_is_flagged():
    noisy = PassSpread((5.0, 10.0, 9.0))
    v = speed_up(20.0, 10.0, 2.8, spec=PassSpread((20.0, 19.8)), base=noisy)
    assert not v.reliable and not v.impossible and v.shown == pytest.approx(2.0)
    assert "baseline passes disagree by 56%" in v.reason
