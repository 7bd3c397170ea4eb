"""`--plot`: charts a person can read — every measured K as its own bar (no line across unmeasured K), model and
weight format in the title, acceptance bars labelled with their values, none for K = 0."""

from __future__ import annotations

import pytest

import nextn.bench.plot as plot
from nextn.bench.passes import PassSpread
from nextn.bench.report import compute_statistics
from nextn.bench.runner import BenchRun
from nextn.runtime.outputs import CompletionOutput

ENGINE = {"model": "LlamaForCausalLM", "model_name": "SmolLM2-135M-Instruct.Q4_1", "weight_format": "W4A16"}


def _run(k: int, accepted: list[int], seconds: float, spread: tuple[float, ...]) -> BenchRun:
    out = CompletionOutput(token_ids=list(range(12)), num_decode_steps=10, accepted_per_position=accepted,
                           arrival_time=0.0, first_token_time=0.01, finished_time=0.5, finish_reason="length")
    return BenchRun(mode="throughput", decoding_mode="NGram" if k else "none", max_draft_len=k, input_lens=[4],
                    outputs=[out], start_time=0.0, end_time=seconds, concurrency=-1, streaming=False,
                    engine=dict(ENGINE), spread=PassSpread(spread, 5.0, 6.0, 2, 2))


@pytest.fixture()
def figures(monkeypatch):
    saved = {}

    def save(fig, path):
        saved[path.name] = fig
        path.write_bytes(b"\x89PNG\r\n\x1a\n")

    monkeypatch.setattr(plot, "_save", save)
    return saved


def test_runs_are_bars_at_measured_k_with_model_and_format(tmp_path, figures):
    # issue 33: K=0 and K=4 were joined by a line across K=1..3, with no model name
    runs = [(r, compute_statistics(r)) for r in (_run(0, [], 1.0, (12.0, 11.0, 6.0)), _run(4, [1, 0, 0, 0], 1.2,
                                                                                         (10.0, 9.9, 9.8)))]
    written = plot.write_plots(runs, tmp_path)
    assert sorted(p.name for p in written) == ["acceptance_per_position_k4.png", "throughput_vs_k.png"]
    fig = figures["throughput_vs_k.png"]
    title = fig._suptitle.get_text()
    assert "SmolLM2-135M-Instruct.Q4_1" in title and "W4A16" in title
    for ax in fig.axes:
        joined = [ln for ln in ax.get_lines() if ln.get_linestyle() != "None" and len(set(ln.get_xdata())) > 1]
        assert not joined  # no line drawn from one K to another
        assert len(ax.patches) == 2  # one bar per measured run
        assert [t.get_text() for t in ax.get_xticklabels()] == ["no speculation\n(K=0)", "NGram\nK=4"]
    tok_s_labels = {t.get_text() for t in fig.axes[0].texts}
    assert {"12.0", "10.0"} <= tok_s_labels
    notes = [t.get_text() for t in fig.texts]
    assert any("unreliable: passes disagree (K=0 55%" in n and "load average 5.00 before" in n for n in notes)
    assert not any("above its AL" in n for n in notes)  # 10 vs 12 tokens/s: no speed-up to doubt


def test_a_speed_up_above_the_al_is_marked_on_the_chart(tmp_path, figures):
    runs = [(r, compute_statistics(r)) for r in (_run(0, [], 15.0, (0.8,)), _run(4, [1, 0, 0, 0], 1.0, (12.0,)))]
    plot.write_plots(runs, tmp_path)
    notes = [t.get_text() for t in figures["throughput_vs_k.png"].texts]
    assert any("K=4 measured 15.00x K=0, above its AL 1.091 (impossible)" in n for n in notes), notes


def test_acceptance_bars_carry_their_values_and_k0_has_none(tmp_path, figures):
    runs = [(r, compute_statistics(r)) for r in (_run(0, [], 1.0, (12.0,)), _run(4, [6, 3, 1, 0], 1.0, (12.0,)))]
    plot.write_plots(runs, tmp_path)
    assert "acceptance_per_position_k0.png" not in figures
    ax = figures["acceptance_per_position_k4.png"].axes[0]
    assert [t.get_text() for t in ax.texts] == ["60.0%", "30.0%", "10.0%", "0.0%"]
    assert "SmolLM2-135M-Instruct.Q4_1 (W4A16)" in ax.get_title() and "AL " in ax.get_title()
    with pytest.raises(ValueError, match="no draft positions"):
        plot.plot_acceptance_per_position([], tmp_path / "x.png")


def test_a_real_png_is_written(tmp_path):
    runs = [(r, compute_statistics(r)) for r in (_run(0, [], 1.0, (12.0, 11.9)), _run(2, [5, 2], 1.0, (12.5, 12.4)))]
    for path in plot.write_plots(runs, tmp_path):
        assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and path.stat().st_size > 5000
