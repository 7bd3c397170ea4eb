"""Training prompts for self-distillation: where they come from, their ids, and the seeded train / held-out split.

Sources (`read_prompts`), each prompt with a stable id:
- prompt files (JSON lines, optionally gzipped; formats as `nextn.config.prompt_files` detects them): MT-bench and
  Spec-Bench first turns (`mt_bench/81`, `spec_bench/81`), HumanEval (`humaneval/HumanEval/0`), GSM8K
  (`gsm8k/12`, the row number);
- text corpora (any other file): paragraphs (blocks between blank lines, joined, at most `MAX_PARAGRAPH_CHARS`),
  `tinyshakespeare.txt:120` (the paragraph's first line number); for a chat model each is wrapped in one of a few
  fixed instructions (`CORPUS_INSTRUCTIONS`, picked by the paragraph's hash) so the answers read like chat answers.

The split (`split_prompts`) is a function of the prompt's text and the seed: held out iff a seeded hash of the
normalised text falls under the fraction. A text that occurs in several files (Spec-Bench repeats MT-bench's 80
questions) is therefore on the same side everywhere, so a held-out MT-bench question id is never trained on, by
construction; the held-out ids are recorded in `train_draft.json`.

Every file is read bounded (`nextn.config.prompt_files.MAX_PROMPT_FILE_BYTES`, on disk and, for a gzipped prompt file,
decompressed as it streams); a device, FIFO or directory is refused unread (`DatasetError`).
"""

from __future__ import annotations

import hashlib
import random
from dataclasses import dataclass
from pathlib import Path

from nextn.config.prompt_files import MAX_PROMPT_FILE_BYTES, DatasetError, detect_format, json_lines
from nextn.config.user_files import read_user_text

#: Sources whose prompts are benchmark questions (the figures are measured on their held-out part).
BENCHMARK_SOURCES = ("mt_bench", "humaneval")
#: Longest corpus paragraph used as a prompt (characters; longer ones are cut at a line end where possible).
MAX_PARAGRAPH_CHARS = 600
#: Shortest corpus paragraph used as a prompt (characters).
MIN_PARAGRAPH_CHARS = 40
#: Instructions a corpus paragraph is wrapped in for a chat model (picked by the paragraph's hash).
CORPUS_INSTRUCTIONS = (
    "Continue the following text.\n\n{}",
    "Summarize the following text.\n\n{}",
    "Explain the following text to a beginner.\n\n{}",
    "Write a short commentary on the following text.\n\n{}",
)


@dataclass(frozen=True)
class TrainPrompt:
    """One prompt: `id` (source/key), `source` (the file's format or name), the user `text`."""

    id: str
    source: str
    text: str

    @property
    def key(self) -> str:
        """The normalised text (whitespace collapsed): the identity the split and de-duplication use."""
        return " ".join(self.text.split())


def _corpus_lines(path: Path) -> list[str]:
    """The lines of a text corpus (bytes that are not UTF-8 replaced). Raises DatasetError: as `json_lines`."""
    return read_user_text(path, "corpus file", DatasetError, MAX_PROMPT_FILE_BYTES, errors="replace").splitlines()


def _paragraphs(path: Path) -> list[tuple[int, str]]:
    """(first line number, text) of every blank-line separated block of `path` with ≥ MIN_PARAGRAPH_CHARS."""
    out, block, start = [], [], 0
    lines = _corpus_lines(path)
    for lineno, line in enumerate([*lines, ""], 1):
        if line.strip():
            if not block:
                start = lineno
            if sum(len(b) + 1 for b in block) + len(line) <= MAX_PARAGRAPH_CHARS or not block:
                block.append(line.rstrip()[:MAX_PARAGRAPH_CHARS])
            continue
        text = "\n".join(block).strip()
        if len(text) >= MIN_PARAGRAPH_CHARS:
            out.append((start, text))
        block = []
    return out


def _lines(path: Path) -> list[tuple[int, str]]:
    """(line number, text) of every non-empty line of `path`."""
    lines = _corpus_lines(path)
    return [(i, line.strip()) for i, line in enumerate(lines, 1) if line.strip()]


def read_prompts(files: list[str | Path], *, chat: bool) -> list[TrainPrompt]:
    """Every prompt of `files`, in file order, without repeated texts (a benchmark's id wins, then the first).

    Args:
        chat: prompts for a chat model. Corpus paragraphs are wrapped in an instruction; without `chat`, a corpus
            gives its lines as raw text (a plain language model continues them) and prompt files their texts.
    Raises:
        DatasetError: a prompt file or corpus that cannot be read: missing, not a regular file, over
            `MAX_PROMPT_FILE_BYTES` (on disk, or a gzip decompressed), bad JSON. ValueError: no prompt at all.
    """
    prompts, seen = [], set()
    for f in map(Path, files):
        name = f.name.removesuffix(".gz")
        if name.endswith((".jsonl", ".json")):
            rows = list(json_lines(f, "prompt file"))
            formats = {detect_format(row) for _, row in rows}
            fmt = "spec_bench" if "spec_bench" in formats else formats.pop() if len(formats) == 1 else None
            if fmt is None:
                raise DatasetError(f"{f}: rows of several formats {sorted(formats)}")
            for lineno, row in rows:
                text = row["turns"][0] if "turns" in row else row.get("prompt", row.get("question"))
                key = row.get("question_id", row.get("task_id", lineno))
                prompts.append(TrainPrompt(f"{fmt}/{key}", fmt, text))
        elif chat:
            for lineno, text in _paragraphs(f):
                instruction = CORPUS_INSTRUCTIONS[_hash(text, "instruction") % len(CORPUS_INSTRUCTIONS)]
                prompts.append(TrainPrompt(f"{f.name}:{lineno}", f.name, instruction.format(text)))
        else:
            prompts.extend(TrainPrompt(f"{f.name}:{lineno}", f.name, text) for lineno, text in _lines(f))
    unique = []
    for p in sorted(prompts, key=lambda p: p.source not in BENCHMARK_SOURCES):  # stable: a benchmark's id wins
        if p.key not in seen:
            seen.add(p.key)
            unique.append(p)
    if not unique:
        raise ValueError(f"no prompt in {[str(f) for f in files]}")
    return unique


def _hash(text: str, salt: str) -> int:
    return int.from_bytes(hashlib.sha256(f"{salt}\0{text}".encode()).digest()[:8], "big")


def is_held_out(prompt: TrainPrompt, seed: int, fraction: float) -> bool:
    """Whether `prompt` is held out: a seeded hash of its normalised text, uniform in [0, 1), is below `fraction`."""
    return _hash(prompt.key, f"split-{seed}") / 2**64 < fraction


def split_prompts(prompts: list[TrainPrompt], *, seed: int, held_out_fraction: float,
                  benchmark_held_out_fraction: float) -> tuple[list[TrainPrompt], list[TrainPrompt]]:
    """(train, held out), each in a seeded shuffled order; benchmark sources use their own fraction.

    Raises:
        ValueError: one side is empty.
    """
    train, held = [], []
    for p in prompts:
        fraction = benchmark_held_out_fraction if p.source in BENCHMARK_SOURCES else held_out_fraction
        (held if is_held_out(p, seed, fraction) else train).append(p)
    if not train or not held:
        raise ValueError(f"{len(prompts)} prompt(s) give {len(train)} to train on and {len(held)} held out: need "
                         "both (more prompts, or another --held_out_fraction)")
    rng = random.Random(seed)
    rng.shuffle(train)
    rng.shuffle(held)
    return train, held


def balanced(prompts: list[TrainPrompt], limit: int | None = None) -> list[TrainPrompt]:
    """At most `limit` prompts (None: all) taken round-robin over their sources (in the given order within each
    source), so that the first N of them do not let a large corpus crowd out the small question sets."""
    limit = len(prompts) if limit is None else min(limit, len(prompts))
    by_source: dict[str, list[TrainPrompt]] = {}
    for p in prompts:
        by_source.setdefault(p.source, []).append(p)
    queues = list(by_source.values())
    out: list[TrainPrompt] = []
    depth = 0
    while len(out) < limit:
        for q in queues:
            if depth < len(q) and len(out) < limit:
                out.append(q[depth])
        depth += 1
    return out
