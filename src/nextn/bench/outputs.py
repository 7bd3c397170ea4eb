"""The JSON result files of the `python -m nextn.bench.<module>` benchmarks and of the studies in the repository's
benchmarks/ folder (`--json`, `--out`).

The rule is `build/output_files.py`'s: a benchmark never overwrites what it did not write. Each file is an object
whose first key is `"written_by": "nextn bench.<module>"`; an existing file is replaced only when it starts so (a
run of the same benchmark wrote it), and a directory, link, device or another program's file is refused — **before
the run** (`check_report`, from the argument check, so an hour-long benchmark does not fail at its end), then
written atomically (`write_report`: a temporary file beside the path, renamed over it).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

from nextn.build.output_files import OutputPathError, check_output_file, is_report_of, write_output_file, written_by


def command(module: str) -> str:
    """The `written_by` command of a benchmark module, e.g. "bench.drafters"."""
    return f"bench.{module}"


def check_report(parser: argparse.ArgumentParser, path: str | Path | None, module: str, flag: str = "--json"
                 ) -> Path | None:
    """Check, before any work, that `path` may receive `module`'s report; a refusal is the parser's usage error
    (one line, exit status 2), so nothing is loaded or run.

    Raises:
        SystemExit: (status 2, via `parser.error`) `path` is a directory, a link, not a regular file, or a file
            this benchmark did not write (build/output_files.py).
    """
    if path is None:
        return None
    try:
        return check_output_file(path, flag, is_report_of(command(module)))
    except OutputPathError as e:
        parser.error(str(e))


def write_report(path: str | Path, module: str, payload: dict[str, Any], flag: str = "--json", indent: int = 1
                 ) -> Path:
    """Write `payload` as `{"written_by": "nextn bench.<module>", **payload}` to `path`, atomically.

    Raises:
        OutputPathError: as `check_report` (the path changed since the check).
    """
    text = json.dumps({**written_by(command(module)), **payload}, indent=indent, default=str) + "\n"
    return write_output_file(path, text, flag, is_report_of(command(module)))
