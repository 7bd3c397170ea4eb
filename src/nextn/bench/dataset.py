"""Benchmark datasets in trtllm-bench's format (trtllm-bench docs), and `prepare-dataset`'s sources.

A dataset is JSON lines, one request each: `{"task_id": 0, "input_ids": [...] | "prompt": "...", "output_tokens": 128}`.
Sources:
- synthetic: `token-norm-dist` (lengths ~ round(N(mean, stdev)), at least 1) and `token-unif-dist` (lengths uniform in
  [min, max]); token ids uniform over the engine's vocabulary (TensorRT-LLM's `prepare_dataset.py` does the same);
- real prompt files (JSONL, optionally gzipped), recognised by their fields: MT-bench and Spec-Bench (`turns`: the
  first turn is the prompt; Spec-Bench adds categories such as `translation`), HumanEval (`prompt`), GSM8K (`question`).
  `read_prompt_rows` keeps every turn and the category of each row (the serving benchmark's conversations and
  category filters).

Every file is read through `config/prompt_files.json_lines`: a regular file only (a device, FIFO or directory is
refused unread), at most `MAX_PROMPT_FILE_BYTES` on disk and, for a gzip, after decompression (counted as it streams).
"""

from __future__ import annotations

import json
import random
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

from nextn.config.prompt_files import DatasetError, detect_format, json_lines

#: The fields of a trtllm-bench dataset line.
VALID_FIELDS = ("task_id", "prompt", "input_ids", "output_tokens")


@dataclass(frozen=True)
class DatasetEntry:
    """One benchmark request: token ids or text, and how many tokens to generate."""

    task_id: int | str
    output_tokens: int
    input_ids: list[int] | None = None
    prompt: str | None = None

    def to_json(self) -> str:
        row: dict[str, Any] = {"task_id": self.task_id}
        row.update({"input_ids": self.input_ids} if self.input_ids is not None else {"prompt": self.prompt})
        row["output_tokens"] = self.output_tokens
        return json.dumps(row, ensure_ascii=False)


def _entry(row: dict, where: str, index: int) -> DatasetEntry:
    unknown = sorted(set(row) - set(VALID_FIELDS))
    if unknown:
        raise DatasetError(f"{where}: unknown field(s) {unknown}; valid fields are {list(VALID_FIELDS)}")
    if ("prompt" in row) == ("input_ids" in row):
        raise DatasetError(f"{where}: give exactly one of 'prompt' (text) and 'input_ids' (token ids)")
    out = row.get("output_tokens")
    if not isinstance(out, int) or isinstance(out, bool) or out < 1:
        raise DatasetError(f"{where}: 'output_tokens' must be an integer ≥ 1, got {out!r}")
    ids = row.get("input_ids")
    if ids is not None and (not isinstance(ids, list) or not ids
                            or not all(isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in ids)):
        raise DatasetError(f"{where}: 'input_ids' must be a non-empty list of token ids ≥ 0")
    prompt = row.get("prompt")
    if prompt is not None and (not isinstance(prompt, str) or not prompt):
        raise DatasetError(f"{where}: 'prompt' must be a non-empty string")
    task_id = row.get("task_id", index)
    return DatasetEntry(task_id=task_id, output_tokens=out, input_ids=ids, prompt=prompt)


def load_dataset(path: str | Path) -> list[DatasetEntry]:
    """Read a trtllm-bench dataset (JSON lines).

    Raises:
        DatasetError: a missing or empty file, a line that is not a JSON object, unknown fields, neither or both of
            `prompt`/`input_ids`, or `output_tokens` missing or < 1 (the message gives the line).
    """
    entries = [_entry(row, f"{path}:{lineno}", i) for i, (lineno, row) in enumerate(json_lines(path))]
    if not entries:
        raise DatasetError(f"dataset {path} has no requests")
    return entries


def write_dataset(entries: Iterable[DatasetEntry], out: IO[str]) -> int:
    """Write entries as JSON lines; returns how many."""
    n = 0
    for e in entries:
        out.write(e.to_json() + "\n")
        n += 1
    return n


# Synthetic sets --------------------------------------------------------------------------------------------------
def normal_lengths(num: int, mean: float, stdev: float, rng: random.Random) -> list[int]:
    """`num` lengths round(N(mean, stdev)), clipped to at least 1 (token-norm-dist)."""
    if mean < 1 or stdev < 0:
        raise DatasetError(f"need mean ≥ 1 and stdev ≥ 0, got mean {mean}, stdev {stdev}")
    return [max(1, round(rng.gauss(mean, stdev))) if stdev else max(1, round(mean)) for _ in range(num)]


def uniform_lengths(num: int, low: int, high: int, rng: random.Random) -> list[int]:
    """`num` lengths uniform in [low, high] (token-unif-dist)."""
    if not 1 <= low <= high:
        raise DatasetError(f"need 1 ≤ min ≤ max, got min {low}, max {high}")
    return [rng.randint(low, high) for _ in range(num)]


def synthetic_dataset(input_lens: list[int], output_lens: list[int], vocab_size: int,
                      rng: random.Random) -> list[DatasetEntry]:
    """Requests of random token ids in [0, vocab_size) with the given input and output lengths."""
    return [DatasetEntry(task_id=i, output_tokens=o, input_ids=[rng.randrange(vocab_size) for _ in range(n)])
            for i, (n, o) in enumerate(zip(input_lens, output_lens))]


# Real prompt sets ------------------------------------------------------------------------------------------------
def _prompt_text(row: dict, fmt: str, where: str) -> str:
    if fmt in ("mt_bench", "spec_bench"):
        turns = row.get("turns")
        if not isinstance(turns, list) or not turns or not isinstance(turns[0], str):
            raise DatasetError(f"{where}: 'turns' must be a non-empty list of strings")
        return turns[0]
    key = "prompt" if fmt == "humaneval" else "question"
    if not isinstance(row.get(key), str):
        raise DatasetError(f"{where}: {fmt} rows need a string '{key}'")
    return row[key]


@dataclass(frozen=True)
class PromptRow:
    """One row of a prompt file: its user turns in file order (MT-bench's rows have two; a HumanEval, GSM8K or
    single-turn Spec-Bench row one) and its `category` (MT-bench's and Spec-Bench's; None where the row has none)."""

    turns: tuple[str, ...]
    category: str | None = None


def _rows_and_format(path: str | Path) -> tuple[str, list[tuple[int, dict]]]:
    rows = list(json_lines(path, "prompt file"))
    if not rows:
        raise DatasetError(f"prompt file {path} is empty")
    formats = {detect_format(row) for _, row in rows}
    if formats == {"mt_bench", "spec_bench"}:
        formats = {"spec_bench"}
    if len(formats) > 1:
        raise DatasetError(f"{path}: rows of several formats {sorted(formats)}")
    return formats.pop(), rows


def read_prompt_file(path: str | Path) -> tuple[str, list[str]]:
    """The format of a prompt file and its prompts (first turns for MT-bench/Spec-Bench), in file order.

    The format is detected from the fields of every row; a Spec-Bench file is one whose categories go beyond
    MT-bench's eight. Raises DatasetError: missing file, bad JSON, rows of no or of mixed formats.
    """
    fmt, rows = _rows_and_format(path)
    return fmt, [_prompt_text(row, fmt, f"{path}:{lineno}") for lineno, row in rows]


def read_prompt_rows(path: str | Path) -> tuple[str, list[PromptRow]]:
    """The format of a prompt file and its rows, every turn and the category kept, in file order.

    Raises:
        DatasetError: as `read_prompt_file`, and a `turns` entry that is not a string (the line named).
    """
    fmt, rows = _rows_and_format(path)
    out = []
    for lineno, row in rows:
        first = _prompt_text(row, fmt, f"{path}:{lineno}")
        later = row["turns"][1:] if fmt in ("mt_bench", "spec_bench") else []
        if not all(isinstance(t, str) for t in later):
            raise DatasetError(f"{path}:{lineno}: 'turns' must be a non-empty list of strings")
        category = row.get("category")
        out.append(PromptRow((first, *later), category if isinstance(category, str) else None))
    return fmt, out


def prompt_dataset(prompts: list[str], output_lens: list[int], tokenizer=None,
                   max_input_len: int | None = None) -> tuple[list[DatasetEntry], int]:
    """Dataset entries from prompts: token ids when a tokenizer is given (anything with `.encode(text)`), else text.

    Returns the entries and how many prompts were dropped for exceeding `max_input_len` tokens (tokenized only).
    """
    entries, dropped = [], 0
    for prompt, out in zip(prompts, output_lens):
        if tokenizer is None:
            entries.append(DatasetEntry(task_id=len(entries), output_tokens=out, prompt=prompt))
            continue
        ids = tokenizer.encode(prompt)
        if max_input_len is not None and len(ids) > max_input_len:
            dropped += 1
            continue
        entries.append(DatasetEntry(task_id=len(entries), output_tokens=out, input_ids=ids))
    return entries, dropped
