"""`--plot DIR`: PNG charts of benchmark runs (matplotlib, Agg backend: no display needed).

- `acceptance_per_position_k{K}.png` for each speculative run: the acceptance rate of each draft position
  (steps accepting draft j / decode steps; j's acceptance needs all earlier ones, so the bars never rise).
- `throughput_vs_k.png` when several runs are compared (`--baseline`, `--draft_lens`): output tokens/s and
  acceptance length against K (K = 0: no speculation).
"""

from __future__ import annotations

import io
import re
from pathlib import Path

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


def plot_acceptance_per_position(rates: list[float], path: str | Path, title: str = "") -> Path:
    """A bar chart of acceptance rate against draft position (1-based)."""
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(5, 3.5))
    positions = list(range(1, len(rates) + 1))
    ax.bar(positions, rates, color="tab:blue")
    for x, r in zip(positions, rates):
        ax.text(x, r + 0.01, f"{r:.2f}", ha="center", va="bottom", fontsize=8)
    ax.set(xlabel="draft position", ylabel="acceptance rate", ylim=(0, 1.05), xticks=positions,
           title=title or "acceptance rate per draft position")
    fig.tight_layout()
    _save(fig, path)
    plt.close(fig)
    return Path(path)


def plot_runs_vs_k(rows: list[tuple[int, float, float]], path: str | Path, title: str = "") -> Path:
    """Output tokens/s and acceptance length against K, from rows (K, tokens/s, AL)."""
    plt = _pyplot()
    rows = sorted(rows)
    ks = [r[0] for r in rows]
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(9, 3.5))
    ax1.plot(ks, [r[1] for r in rows], marker="o")
    ax1.set(xlabel="K (draft tokens per step; 0 = no speculation)", ylabel="output tokens/s", xticks=ks,
            ylim=(0, max(r[1] for r in rows) * 1.1))
    ax2.plot(ks, [r[2] for r in rows], marker="o", color="tab:green")
    ax2.set(xlabel="K (draft tokens per step; 0 = no speculation)", ylabel="acceptance length (AL)", xticks=ks,
            ylim=(0, max(r[2] for r in rows) + 0.5))
    fig.suptitle(title or "throughput and acceptance length against K")
    fig.tight_layout()
    _save(fig, path)
    plt.close(fig)
    return Path(path)


def write_plots(runs: list[tuple[BenchRun, BenchStatistics]], out_dir: str | Path) -> list[Path]:
    """The charts for these runs in `out_dir` (created); returns the files written."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    written = []
    for run, stats in runs:
        if run.max_draft_len:
            title = f"{run.decoding_mode} K={run.max_draft_len}: acceptance rate per draft position"
            written.append(plot_acceptance_per_position(stats.acceptance_rate_per_position,
                                                        out / f"acceptance_per_position_k{run.max_draft_len}.png", title))
    if len(runs) > 1:
        rows = [(run.max_draft_len, stats.output_throughput_tok_s, stats.global_acceptance_length) for run, stats in runs]
        written.append(plot_runs_vs_k(rows, out / "throughput_vs_k.png"))
    return written
