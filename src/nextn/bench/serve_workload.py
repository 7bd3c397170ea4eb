"""What `python -m nextn.bench.serve` sends: a named prompt set (or one category of it, or a prompt file), each row
as a conversation of `turns` user turns, and the phases of one measured level.

Named sets (files of `--prompts_dir`, by default ../shared/data/prompts):
- `mt_bench`: MT-bench's 80 questions, 10 in each of 8 categories, two turns each;
- `spec_bench`: Spec-Bench's 480 rows: MT-bench's 80, then 80 each of translation, summarization, qa,
  math_reasoning and rag (one turn each);
- `humaneval`, `code_edit`: 164 code prompts each (one turn);
- `NAME:CATEGORY`: only the rows of that category of a set with categories (`spec_bench:translation`,
  `mt_bench:writing`); `spec_bench_summarization` and `spec_bench_rag` are `spec_bench:summarization` and
  `spec_bench:rag`, the two Spec-Bench tasks whose outputs copy most from their inputs.
Any other value is a prompt file in one of bench/dataset.py's formats.

A level's phases, in order: for each of `repeat` passes over the same requests, turn 1 of every conversation, then
turn 2 of every conversation, ... (Spec-Bench and vLLM's multi-turn benchmark also send turn k+1 after turn k's
answer; here each turn of all conversations is one phase, so that each turn has its own wall time, tokens/s and
latencies). Turn k's request carries the conversation so far: [user turn 1, assistant answer 1, ..., user turn k],
each answer the text the server streamed for that conversation's earlier turn in the same pass.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass
from pathlib import Path

from nextn.bench.dataset import DatasetError, PromptRow, read_prompt_rows

#: `--dataset` names: files of the prompts directory.
DATASETS = {"mt_bench": "mt_bench.jsonl", "spec_bench": "spec_bench.jsonl", "humaneval": "humaneval.jsonl.gz",
            "code_edit": "code_edit.jsonl"}
#: Shortcut names: (set, category).
CATEGORY_SETS = {"spec_bench_summarization": ("spec_bench", "summarization"), "spec_bench_rag": ("spec_bench", "rag")}
#: Most turns of one conversation (`--turns`; MT-bench has two).
MAX_TURNS = 4
#: Most passes over the same requests in one level (`--repeat`).
MAX_REPEAT = 10


@dataclass(frozen=True)
class Workload:
    """The conversations of a run: `conversations[i]` is row i's first `turns` user turns (every row has them).
    `format` is the file's (bench/dataset.py); `category` the category kept (None: every row)."""

    dataset: str
    format: str
    conversations: tuple[tuple[str, ...], ...]
    category: str | None = None

    @property
    def turns(self) -> int:
        return len(self.conversations[0])

    def prompts(self, turn: int) -> list[str]:
        """The user message of turn `turn` (1-based) of every conversation."""
        return [c[turn - 1] for c in self.conversations]


@dataclass(frozen=True)
class Phase:
    """One measured part of a level: turn `turn` of every conversation in pass `repetition` (both 1-based);
    `label` names it in the report ("" when the level has no other phase)."""

    turn: int
    repetition: int
    label: str


def level_phases(turns: int, repeat: int) -> list[Phase]:
    """The phases of a level, in the order they run: each pass's turns in order, pass after pass."""
    phases = []
    for rep in range(1, repeat + 1):
        for turn in range(1, turns + 1):
            parts = ([f"pass {rep}"] if repeat > 1 else []) + ([f"turn {turn}"] if turns > 1 else [])
            phases.append(Phase(turn, rep, ", ".join(parts)))
    return phases


def dataset_names() -> list[str]:
    """Every `--dataset` name, the category form last."""
    return [*DATASETS, *CATEGORY_SETS, "NAME:CATEGORY"]


def _resolve(dataset: str, prompts_dir: Path) -> tuple[Path, str | None]:
    if dataset in CATEGORY_SETS:
        name, category = CATEGORY_SETS[dataset]
        return prompts_dir / DATASETS[name], category
    name, sep, category = dataset.partition(":")
    if name in DATASETS:
        if sep and not category:
            raise DatasetError(f"--dataset {dataset}: no category after ':' (e.g. spec_bench:summarization)")
        return prompts_dir / DATASETS[name], category or None
    path = Path(dataset)
    if not path.exists():
        raise DatasetError(f"--dataset {dataset!r} is neither a prompt file nor a named set; valid names: "
                           f"{', '.join(dataset_names())} (CATEGORY: one of the set's categories)")
    return path, None


def _only(rows: list[PromptRow], category: str, dataset: str) -> list[PromptRow]:
    counts = Counter(r.category for r in rows if r.category is not None)
    if not counts:
        raise DatasetError(f"--dataset {dataset}: this set has no categories (mt_bench and spec_bench have)")
    if category not in counts:
        raise DatasetError(f"--dataset {dataset}: no category {category!r}; its categories are "
                           + ", ".join(f"{c} ({n} rows)" for c, n in sorted(counts.items())))
    return [r for r in rows if r.category == category]


def load_workload(dataset: str, prompts_dir: Path, num_prompts: int, turns: int = 1) -> Workload:
    """The first `num_prompts` rows of `dataset` (a name of `dataset_names()` or a prompt file), after its category
    filter, each as its first `turns` user turns.

    Raises:
        DatasetError: an unknown name or category (the valid ones listed), a category of a set without categories,
            a missing or unreadable file (bench/dataset.py), a selected row of fewer than `turns` turns.
    """
    path, category = _resolve(dataset, prompts_dir)
    fmt, rows = read_prompt_rows(path)
    if category is not None:
        rows = _only(rows, category, dataset)
    rows = rows[:num_prompts]
    short = sum(len(r.turns) < turns for r in rows)
    if short:
        raise DatasetError(f"--turns {turns}: {short} of the {len(rows)} prompts of {dataset} have fewer turns "
                           "(two-turn sets: mt_bench, or spec_bench:CATEGORY of an MT-bench category)")
    return Workload(dataset, fmt, tuple(r.turns[:turns] for r in rows), category)
