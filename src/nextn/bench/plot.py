"""`--plot DIR`: PNG charts of benchmark runs (matplotlib, Agg backend: no display needed).

- `acceptance_per_position_k{K}.png` for each speculative run: the acceptance rate of each draft position
  (steps accepting draft j / decode steps; j's acceptance needs all earlier ones, so the bars never rise).
- `throughput_vs_k.png` when several runs are compared (`--baseline`, `--draft_lens`): output tokens/s and
  acceptance length of each run as bars at the K values measured (K = 0: no speculation), model and weight format
  in the title.
"""

from __future__ import annotations

import io
import re
from pathlib import Path

from nextn.bench.passes import DEFAULT_MAX_SPREAD, speed_up
from nextn.bench.report import BenchStatistics
from nextn.bench.runner import BenchRun
from nextn.build.output_files import OutputPathError, check_output_file, is_png, write_output_file

#: The names of the charts `write_plots` writes.
CHART_NAME = re.compile(r"acceptance_per_position_k\d+\.png|throughput_vs_k\.png")


def check_plot_dir(out_dir: str | Path) -> Path:
    """Check, before the run, that `out_dir` may receive the charts: missing or a directory (not a link), and every
    chart-named file already in it a PNG (a user's file of that name is never replaced).

    Raises:
        OutputPathError: `out_dir` is a link or not a directory, or holds a chart-named file that is not a PNG.
    """
    out = Path(out_dir)
    if out.is_symlink():
        raise OutputPathError(f"--plot {out} is a symbolic link; give the directory itself")
    if out.exists() and not out.is_dir():
        raise OutputPathError(f"--plot {out} is not a directory: give the directory for the charts")
    if out.is_dir():
        for path in out.iterdir():
            if CHART_NAME.fullmatch(path.name):
                check_output_file(path, "--plot", is_png)
    return out


def _save(fig, path: str | Path) -> None:
    """Save a PNG atomically; an existing file is replaced only when it is a PNG (build/output_files.py).

    Raises:
        OutputPathError: `path` is a directory, a link or a file other than a PNG.
    """
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=100)
    write_output_file(path, buf.getvalue(), "--plot", is_png)


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def run_title(run: BenchRun) -> str:
    """'<model> (<weight format>), <mode> concurrency N' for a chart's title."""
    e = run.engine
    model = e.get("model_name") or e.get("model") or "model"
    fmt = e.get("weight_format") or e.get("dtype")
    conc = f"concurrency {run.concurrency}" if run.concurrency > 0 else "unlimited concurrency"
    shape = conc if run.mode == "throughput" else "batch 1"
    return f"{model}" + (f" ({fmt})" if fmt else "") + f", {run.mode}, {shape}"


def _run_label(run: BenchRun) -> str:
    return "no speculation\n(K=0)" if run.max_draft_len == 0 else f"{run.decoding_mode}\nK={run.max_draft_len}"


def plot_acceptance_per_position(rates: list[float], path: str | Path, title: str = "") -> Path:
    """A bar chart of acceptance rate against draft position (1-based), each bar labelled with its percentage.

    Raises:
        ValueError: no draft position (K = 0 has no drafts, so no chart).
    """
    if not rates:
        raise ValueError("no draft positions: a run without speculation has no acceptance chart")
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(6, 4))
    positions = list(range(1, len(rates) + 1))
    ax.bar(positions, rates, color="tab:blue", width=0.6)
    for x, r in zip(positions, rates):
        ax.text(x, r + 0.015, f"{r:.1%}", ha="center", va="bottom", fontsize=9)
    if max(rates) == 0:
        ax.text(0.5, 0.5, "no draft token was accepted", transform=ax.transAxes, ha="center", color="tab:red")
    ax.set(xlabel="draft position (draft j is accepted only after drafts 1..j-1)",
           ylabel="acceptance rate (steps accepting it / decode steps)", ylim=(0, 1.1), xticks=positions)
    ax.set_title(title or "acceptance rate per draft position", fontsize=10)
    fig.tight_layout()
    _save(fig, path)
    plt.close(fig)
    return Path(path)


def plot_runs(runs: list[tuple[BenchRun, BenchStatistics]], path: str | Path, title: str = "",
              max_spread: float = DEFAULT_MAX_SPREAD) -> Path:
    """Output tokens/s (the reported, fastest pass; whiskers from the slowest to the fastest pass) and acceptance
    length of each measured run, as bars at their own K only: no line across K values that were not measured. Runs whose
    passes disagree by more than `max_spread` are named in a red note under the chart."""
    plt = _pyplot()
    runs = sorted(runs, key=lambda rs: rs[0].max_draft_len)
    xs = list(range(len(runs)))
    labels = [_run_label(run) for run, _ in runs]
    tok_s = [stats.output_throughput_tok_s for _, stats in runs]
    als = [stats.global_acceptance_length for _, stats in runs]
    low = [max(0.0, t - run.spread.minimum) if run.spread else 0.0 for (run, _), t in zip(runs, tok_s)]
    high = [max(0.0, run.spread.maximum - t) if run.spread else 0.0 for (run, _), t in zip(runs, tok_s)]
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(4 + 1.6 * len(runs), 4.2))
    colors = ["tab:gray" if run.max_draft_len == 0 else "tab:blue" for run, _ in runs]
    ax1.bar(xs, tok_s, color=colors, width=0.6, yerr=[low, high], capsize=4)
    for x, t in zip(xs, tok_s):
        ax1.text(x, t * 1.02, f"{t:.1f}", ha="center", va="bottom", fontsize=9)
    passes = max((len(run.spread.tok_s) for run, _ in runs if run.spread), default=1)
    ax1.set(ylabel="output tokens/s" + (f" (fastest of {passes} passes;\nwhisker: slowest)" if passes > 1 else ""),
            xticks=xs, ylim=(0, max(tok_s) * 1.2 or 1))
    ax1.set_xticklabels(labels)
    ax2.bar(xs, als, color=colors, width=0.6)
    for x, a in zip(xs, als):
        ax2.text(x, a + 0.03, f"{a:.3f}", ha="center", va="bottom", fontsize=9)
    ax2.set(ylabel="acceptance length (output tokens / step)", xticks=xs, ylim=(0, max(als) * 1.2 + 0.2))
    ax2.set_xticklabels(labels)
    fig.suptitle(title or "output tokens/s and acceptance length of each run", fontsize=10)
    notes = _unreliable_notes(runs, max_spread)
    fig.tight_layout(rect=(0, 0.05 * len(notes), 1, 1))
    for i, note in enumerate(notes):
        fig.text(0.5, 0.01 + 0.05 * i, note, ha="center", va="bottom", fontsize=8, color="tab:red")
    _save(fig, path)
    plt.close(fig)
    return Path(path)


def _unreliable_notes(runs: list[tuple[BenchRun, BenchStatistics]], max_spread: float) -> list[str]:
    """Red notes for the chart: runs whose passes disagree, and speed-ups over K = 0 above the run's AL."""
    notes = []
    noisy = [f"K={run.max_draft_len} {run.spread.relative_spread:.0%}" for run, _ in runs
             if run.spread is not None and run.spread.disagrees(max_spread)]
    if noisy:
        notes.append(f"unreliable: passes disagree ({', '.join(noisy)}; {runs[0][0].spread.noise_text()})")
    base = next((stats for run, stats in runs if run.max_draft_len == 0), None)
    for run, stats in runs if base is not None else ():
        v = speed_up(stats.output_throughput_tok_s, base.output_throughput_tok_s, stats.global_acceptance_length)
        if run.max_draft_len and v.impossible:
            notes.append(f"unreliable: K={run.max_draft_len} measured {v.ratio:.2f}x K=0, above its AL "
                         f"{stats.global_acceptance_length:.3f} (impossible): machine noise, not a speed-up")
    return notes


def write_plots(runs: list[tuple[BenchRun, BenchStatistics]], out_dir: str | Path,
                max_spread: float = DEFAULT_MAX_SPREAD) -> list[Path]:
    """The charts for these runs in `out_dir` (created): an acceptance chart per speculative run (none for K = 0)
    and, with several runs, their throughput and AL side by side; returns the files written."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    written = []
    for run, stats in runs:
        if run.max_draft_len and stats.acceptance_rate_per_position:
            title = (f"{run_title(run)}\n{run.decoding_mode} K={run.max_draft_len}: acceptance rate per draft position "
                     f"(AL {stats.global_acceptance_length:.3f})")
            path = out / f"acceptance_per_position_k{run.max_draft_len}.png"
            written.append(plot_acceptance_per_position(stats.acceptance_rate_per_position, path, title))
    if len(runs) > 1:
        written.append(plot_runs(runs, out / "throughput_vs_k.png", run_title(runs[0][0]), max_spread))
    return written
