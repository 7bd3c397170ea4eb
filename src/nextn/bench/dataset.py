"""Benchmark datasets in trtllm-bench's format (REFERENCE.md §7), and `prepare-dataset`'s sources.

A dataset is JSON lines, one request each: `{"task_id": 0, "input_ids": [...] | "prompt": "...", "output_tokens": 128}`.
Sources:
- synthetic: `token-norm-dist` (lengths ~ round(N(mean, stdev)), at least 1) and `token-unif-dist` (lengths uniform in
  [min, max]); token ids uniform over the engine's vocabulary (TensorRT-LLM's `prepare_dataset.py` does the same);
- real prompt files (JSONL, optionally gzipped), recognised by their fields: MT-bench and Spec-Bench (`turns`: the
  first turn is the prompt; Spec-Bench adds categories such as `translation`), HumanEval (`prompt`), GSM8K (`question`).

Every file is read through `config/user_files.open_user_text`: a regular file only (a device, FIFO or directory is
refused unread), at most `MAX_PROMPT_FILE_BYTES` on disk and, for a gzip, after decompression (counted as it streams).
"""

from __future__ import annotations

import json
import random
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

from nextn.config.user_files import open_user_text

#: The fields of a trtllm-bench dataset line.
VALID_FIELDS = ("task_id", "prompt", "input_ids", "output_tokens")
#: MT-bench's eight categories; a `turns` file with others is Spec-Bench.
MT_BENCH_CATEGORIES = frozenset({"writing", "roleplay", "reasoning", "math", "coding", "extraction", "stem", "humanities"})
#: Most bytes of one dataset, prompt file or corpus, on disk and decompressed (Spec-Bench is 0.7 MB, GSM8K 0.75 MB).
MAX_PROMPT_FILE_BYTES = 1 << 30


class DatasetError(ValueError):
    """A dataset or prompt file that cannot be read; the message names the file, the line and the fix."""


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


def _json_lines(path: str | Path, what: str = "dataset") -> Iterable[tuple[int, dict]]:
    """(line number, object) for each non-blank line of a JSON-lines file (gzipped when its name ends with .gz).

    Raises:
        DatasetError: missing, not a regular file, over `MAX_PROMPT_FILE_BYTES` (on disk or decompressed), a corrupt
            gzip, not UTF-8, bad JSON, not an object (the line named).
    """
    path = Path(path)
    try:
        with open_user_text(path, what, DatasetError, MAX_PROMPT_FILE_BYTES) as f:
            for lineno, line in enumerate(f, 1):
                if not line.strip():
                    continue
                try:
                    row = json.loads(line)
                except json.JSONDecodeError as e:
                    raise DatasetError(f"{path}:{lineno}: not valid JSON ({e.msg})") from None
                except (ValueError, RecursionError) as e:  # an int of over 4300 digits, nesting past the stack
                    raise DatasetError(f"{path}:{lineno}: not valid JSON ({str(e) or type(e).__name__})") from None
                if not isinstance(row, dict):
                    raise DatasetError(f"{path}:{lineno}: expected a JSON object, got {type(row).__name__}")
                yield lineno, row
    except (OSError, UnicodeDecodeError, EOFError) as e:
        raise DatasetError(f"{path}: cannot be read ({e})") from None


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
    entries = [_entry(row, f"{path}:{lineno}", i) for i, (lineno, row) in enumerate(_json_lines(path))]
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
def detect_format(row: dict) -> str:
    """The prompt-file format of one row: "mt_bench", "spec_bench", "humaneval" or "gsm8k".

    Raises:
        DatasetError: no field that says which (the message lists the recognised ones).
    """
    if isinstance(row.get("turns"), list):
        return "mt_bench" if row.get("category", "writing") in MT_BENCH_CATEGORIES else "spec_bench"
    if isinstance(row.get("prompt"), str):
        return "humaneval"
    if isinstance(row.get("question"), str):
        return "gsm8k"
    raise DatasetError(f"unrecognised prompt file row with fields {sorted(row)}: expected 'turns' (MT-bench, "
                       "Spec-Bench), 'prompt' (HumanEval) or 'question' (GSM8K)")


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


def read_prompt_file(path: str | Path) -> tuple[str, list[str]]:
    """The format of a prompt file and its prompts (first turns for MT-bench/Spec-Bench), in file order.

    The format is detected from the fields of every row; a Spec-Bench file is one whose categories go beyond
    MT-bench's eight. Raises DatasetError: missing file, bad JSON, rows of no or of mixed formats.
    """
    rows = list(_json_lines(path, "prompt file"))
    if not rows:
        raise DatasetError(f"prompt file {path} is empty")
    formats = {detect_format(row) for _, row in rows}
    if formats == {"mt_bench", "spec_bench"}:
        formats = {"spec_bench"}
    if len(formats) > 1:
        raise DatasetError(f"{path}: rows of several formats {sorted(formats)}")
    fmt = formats.pop()
    return fmt, [_prompt_text(row, fmt, f"{path}:{lineno}") for lineno, row in rows]


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
