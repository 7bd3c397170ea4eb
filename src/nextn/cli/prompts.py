"""Prompt sets for the demo and the benchmark: MT-bench from ../shared/data when present, else embedded ones."""

from __future__ import annotations

import json
from pathlib import Path

#: MT-bench-style first turns, used when ../shared/data/prompts/mt_bench.jsonl is absent (a user's fresh clone).
EMBEDDED_PROMPTS = [
    "Compose an engaging travel blog post about a recent trip to Hawaii.",
    "Draft a professional email seeking your supervisor's feedback on the quarterly report.",
    "Explain the difference between a list and a tuple in Python, with examples.",
    "Describe five key principles in evaluating an argument in analytical writing.",
    "Write a short story about a robot who learns to paint.",
    "What are the main differences between renewable and non-renewable energy sources?",
]


def find_shared(relative: str) -> Path | None:
    """`../shared/data/<relative>` beside the working directory or this checkout, if that file is present."""
    here = Path(__file__).resolve()
    for root in (Path.cwd(), *here.parents):
        candidate = root.parent / "shared" / "data" / relative
        if candidate.is_file():
            return candidate
    return None


def find_mt_bench() -> Path | None:
    """../shared/data/prompts/mt_bench.jsonl relative to the working directory or this checkout, if present."""
    return find_shared("prompts/mt_bench.jsonl")


def load_prompts(n: int, path: str | Path | None = None) -> tuple[list[str], str]:
    """The first turns of `n` MT-bench questions (or the embedded prompts) and where they came from."""
    source = Path(path) if path else find_mt_bench()
    if source is None:
        return (EMBEDDED_PROMPTS * (n // len(EMBEDDED_PROMPTS) + 1))[:n], "embedded MT-bench-style prompts"
    rows = [json.loads(line) for line in source.read_text().splitlines() if line.strip()]
    return [r["turns"][0] for r in rows[:n]], str(source)
