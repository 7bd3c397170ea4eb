"""Prompt files: JSON lines (gzipped or not) read bounded, and which benchmark's format a row is in.

One reader for every prompt set a user names or a benchmark ships: `nextn-bench` datasets and prompt files
(`bench/dataset.py`), the self-distillation prompts of `nextn train-draft` (`train/prompts.py`), and the MT-bench /
HumanEval sets of the benchmarks (`bench/real_models.py`, `benchmarks/prefix_reuse.py`). Each file is read through
`config/user_files.open_user_text`: a regular file only (a device, FIFO or directory is refused unread), at most
`MAX_PROMPT_FILE_BYTES` on disk and, for a gzip, after decompression (counted as it streams).

Formats, recognised by their fields: MT-bench and Spec-Bench (`turns`: the first turn is the prompt; Spec-Bench adds
categories such as `translation`), HumanEval (`prompt`), GSM8K (`question`).
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

from nextn.config.user_files import open_user_text

#: Most bytes of one dataset, prompt file or corpus, on disk and decompressed (Spec-Bench is 0.7 MB, GSM8K 0.75 MB).
MAX_PROMPT_FILE_BYTES = 1 << 30
#: MT-bench's eight categories; a `turns` file with others is Spec-Bench.
MT_BENCH_CATEGORIES = frozenset({"writing", "roleplay", "reasoning", "math", "coding", "extraction", "stem", "humanities"})


class DatasetError(ValueError):
    """A dataset or prompt file that cannot be read; the message names the file, the line and the fix."""


def json_lines(path: str | Path, what: str = "dataset") -> Iterator[tuple[int, dict]]:
    """(line number, object) for each non-blank line of a JSON-lines file (gzipped when its name ends with .gz).

    `what` names the file in errors ("dataset", "prompt file"). The cap is `MAX_PROMPT_FILE_BYTES` at call time.
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
