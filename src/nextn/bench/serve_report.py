"""The results of `python -m nextn.bench.serve` and what it writes from them: a Markdown table, the JSON of every
number, a chart (output tokens/s and TPOT p50 against concurrency, one line per server config and phase), and the
lossless check (every speculative nextn config's text equals nextn plain's, prompt by prompt, at each concurrency and
phase; sampled requests carry a seed per prompt, so it holds for them too where the drafts are deterministic). A phase is one turn of a multi-turn run or one pass of a repeated run
(bench/serve_workload.py); a run of one phase labels none.
"""

from __future__ import annotations

import io
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from nextn.bench.serve_client import LevelMetrics
from nextn.build.output_files import is_png, write_output_file


@dataclass
class LevelResult:
    """One concurrency level of one server config: the fastest pass's metrics (by output tokens/s), every pass's
    output tokens/s, failed requests over all passes, AL and DAR over all passes (None: the server reported no
    verify step), and each prompt's text (prompt index → the first pass's text). `phase` labels the turn and the
    repeated pass it measured ("": the level's only phase; `turn`, `repetition` 1-based)."""

    concurrency: int
    best: LevelMetrics
    passes_tok_s: list[float]
    failed_requests: int = 0
    acceptance_length: float | None = None
    draft_acceptance_rate: float | None = None
    texts: dict[int, str] = field(default_factory=dict)
    phase: str = ""
    turn: int = 1
    repetition: int = 1

    def to_dict(self) -> dict[str, Any]:
        return {"concurrency": self.concurrency, "phase": self.phase, "turn": self.turn,
                "repetition": self.repetition, **self.best.to_dict(), "passes_output_tok_s": self.passes_tok_s,
                "failed_requests_all_passes": self.failed_requests,
                "acceptance_length": self.acceptance_length, "draft_acceptance_rate": self.draft_acceptance_rate}


@dataclass
class ConfigResult:
    """One server config: its label, family ("nextn", "llama.cpp", "url"), whether it speculates, its command
    line, its levels in order, and the error that stopped it (None: it ran every level)."""

    label: str
    family: str
    speculative: bool
    argv: list[str]
    levels: list[LevelResult] = field(default_factory=list)
    error: str | None = None

    def to_dict(self) -> dict[str, Any]:
        return {"label": self.label, "family": self.family, "speculative": self.speculative, "argv": self.argv,
                "error": self.error, "levels": [lv.to_dict() for lv in self.levels]}


@dataclass(frozen=True)
class Mismatch:
    """A prompt whose text under `label` differs from nextn plain's at `concurrency` (and `phase`), first at
    character `offset`."""

    label: str
    concurrency: int
    prompt_index: int
    offset: int
    phase: str = ""

    def to_dict(self) -> dict[str, Any]:
        return {"label": self.label, "concurrency": self.concurrency, "phase": self.phase,
                "prompt_index": self.prompt_index, "offset": self.offset}


def row_label(label: str, phase: str) -> str:
    """A config's label with its phase, as the table and the chart name it ("nextn plain (turn 2)")."""
    return f"{label} ({phase})" if phase else label


def _phases(r: ConfigResult) -> list[str]:
    return list(dict.fromkeys(lv.phase for lv in r.levels)) or [""]


def _first_difference(a: str, b: str) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


def lossless_mismatches(results: list[ConfigResult]) -> tuple[list[Mismatch], int]:
    """Greedy outputs of every speculative nextn config against nextn plain's, per (concurrency, phase, prompt).

    Returns the mismatches and how many (config, concurrency, prompt) texts were compared (0: no nextn plain run,
    or no speculative nextn config). llama.cpp's texts are not compared (another numerics).
    """
    plain = next((r for r in results if r.family == "nextn" and not r.speculative), None)
    if plain is None:
        return [], 0
    reference = {(lv.concurrency, lv.phase): lv.texts for lv in plain.levels}
    mismatches, compared = [], 0
    for r in results:
        if r.family != "nextn" or not r.speculative:
            continue
        for lv in r.levels:
            ref = reference.get((lv.concurrency, lv.phase), {})
            for i, text in sorted(lv.texts.items()):
                if i in ref:
                    compared += 1
                    if text != ref[i]:
                        mismatches.append(Mismatch(r.label, lv.concurrency, i, _first_difference(text, ref[i]),
                                                   lv.phase))
    return mismatches, compared


def _fmt(x: float | None, digits: int = 1) -> str:
    return "–" if x is None else f"{x:.{digits}f}"


def markdown_table(results: list[ConfigResult], concurrencies: list[int]) -> str:
    """Rows: server configs (one per phase); per concurrency, output tok/s and TTFT / TPOT p50 (ms). Then one detail
    row per (config, phase, concurrency) with every metric."""
    head = "| server |" + "".join(f" c={c} tok/s | c={c} TTFT / TPOT p50 ms |" for c in concurrencies)
    lines = [head, "|---|" + "---:|---:|" * len(concurrencies)]
    for r in results:
        for phase in _phases(r):
            by_c = {lv.concurrency: lv for lv in r.levels if lv.phase == phase}
            cells = []
            for c in concurrencies:
                lv = by_c.get(c)
                cells += ["failed" if lv is None else f"{lv.best.output_tok_s:.1f}",
                          "–" if lv is None else f"{lv.best.ttft_ms_p50:.0f} / {lv.best.tpot_ms_p50:.1f}"]
            lines.append(f"| {row_label(r.label, phase)} | " + " | ".join(cells) + " |")
    lines += ["", "| server | c | tok/s | req/s | TTFT p50 | TTFT p99 | TPOT p50 | TPOT p99 | ITL p50 | ITL p99 "
                  "| AL | DAR | failed | passes tok/s |",
              "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|"]
    for r in results:
        order = _phases(r)
        for lv in sorted(r.levels, key=lambda lv: order.index(lv.phase)):
            b, sent = lv.best, lv.best.num_requests * len(lv.passes_tok_s)
            lines.append(f"| {row_label(r.label, lv.phase)} | {lv.concurrency} | {b.output_tok_s:.1f} "
                         f"| {b.requests_per_s:.2f} | {b.ttft_ms_p50:.0f} | {b.ttft_ms_p99:.0f} | {b.tpot_ms_p50:.1f} "
                         f"| {b.tpot_ms_p99:.1f} "
                         f"| {b.itl_ms_p50:.1f} | {b.itl_ms_p99:.1f} | {_fmt(lv.acceptance_length, 2)} "
                         f"| {_fmt(lv.draft_acceptance_rate, 2)} | {lv.failed_requests}/{sent} "
                         f"| {' / '.join(f'{t:.1f}' for t in lv.passes_tok_s)} |")
    errors = [f"- {r.label}: {r.error}" for r in results if r.error]
    return "\n".join(lines + ([""] + errors if errors else [])) + "\n"


def lossless_text(mismatches: list[Mismatch], compared: int) -> str:
    """One line (and one per mismatch, at most 20) saying whether the speculative nextn configs were lossless."""
    if compared == 0:
        return "Lossless check: nothing compared (needs nextn plain and a speculative nextn config).\n"
    if not mismatches:
        return f"Lossless check: all {compared} texts of the speculative nextn configs equal nextn plain's.\n"
    lines = [f"Lossless check: {len(mismatches)} of {compared} texts differ from nextn plain's:"]
    lines += [f"- {row_label(m.label, m.phase)}, concurrency {m.concurrency}, prompt {m.prompt_index}: first "
              f"difference at character {m.offset}" for m in mismatches[:20]]
    return "\n".join(lines) + "\n"


def plot(results: list[ConfigResult], path: Path, title: str) -> Path:
    """Two panels against concurrency (log 2 axis), one line per config and phase: output tokens/s, TPOT p50 (ms).

    Raises:
        OutputPathError: `path` exists and is not a PNG (build/output_files.py).
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4.2))
    for r in results:
        for phase in _phases(r) if r.levels else []:
            levels = [lv for lv in r.levels if lv.phase == phase]
            xs, label = [lv.concurrency for lv in levels], row_label(r.label, phase)
            style = "--" if r.family == "llama.cpp" else "-"
            ax1.plot(xs, [lv.best.output_tok_s for lv in levels], style, marker="o", label=label)
            ax2.plot(xs, [lv.best.tpot_ms_p50 for lv in levels], style, marker="o", label=label)
    levels = sorted({lv.concurrency for r in results for lv in r.levels})
    for ax, ylabel in ((ax1, "output tokens/s (fastest pass)"), (ax2, "TPOT p50 (ms)")):
        ax.set_xscale("log", base=2)
        ax.set_xticks(levels, [str(c) for c in levels])
        ax.minorticks_off()
        ax.set(xlabel="concurrent requests", ylabel=ylabel)
        ax.set_ylim(bottom=0)
        ax.grid(alpha=0.3)
    ax1.legend(fontsize=8)
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=100)
    plt.close(fig)
    write_output_file(path, buf.getvalue(), "--output_dir", is_png)
    return path
