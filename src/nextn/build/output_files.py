"""Where the commands other than `build-engine` may write: single output files and claimed output directories.

The rule is build-engine's (`build/output_dir.py`): nextn never overwrites what it did not write.
- **A file output** (`token-map --out`, `nextn-bench --output / --report_json / --iteration_log`, a bench module's
  `--json`, a plot): a missing path is written; an existing one is replaced only when it is in the format that
  command writes (`is_ours` sniffs its first 64 KiB: a token map, a report carrying `"written_by": "nextn ..."`,
  a PNG), or with `--force` where the command has it. A directory, a symbolic link, a device or pipe is always
  refused. The file is written beside its path and renamed into place, so a failure leaves no half-written file.
- **A directory output** (`train-draft --output_dir`, `make-checkpoint --output_dir`): a missing or empty directory
  is claimed by writing `.nextn-output.json` into it; a non-empty one is used only when it holds that marker from the
  same command (or `is_legacy` recognises an older run's output), and never when it is, or holds, one of the
  command's inputs (the base model, the data).
"""

from __future__ import annotations

import json
import os
import re
import stat
import tempfile
from collections.abc import Callable, Iterable
from pathlib import Path

from nextn.build.manifest import EngineError

#: The marker a command writes into an output directory it claims.
MARKER_NAME = ".nextn-output.json"
#: Bytes of an existing file read to recognise its format.
SNIFF_BYTES = 64 << 10
#: How many foreign files a refusal names.
SHOWN = 8


class OutputPathError(EngineError):
    """An output path a command may not write (a user's file or directory, an input, a directory given for a file);
    the message names it and the way out. An `EngineError`, so every CLI reports it in one line with status 2."""


def written_by(command: str) -> dict[str, str]:
    """The key a JSON report starts with, so a later run recognises the file as its own: {"written_by": ...}."""
    return {"written_by": f"nextn {command}"}


def is_report_of(command: str) -> Callable[[bytes], bool]:
    """`is_ours` for a JSON object written with `written_by(command)` first."""
    pattern = re.compile(rb'^\s*\{\s*"written_by"\s*:\s*"' + re.escape(f"nextn {command}".encode()) + rb'"')
    return lambda head: bool(pattern.match(head))


def is_token_map(head: bytes) -> bool:
    """`is_ours` for `nextn token-map`'s output: a JSON list of token ids."""
    return bool(re.fullmatch(rb"\s*\[[\d,\s]*\]?\s*", head))


def is_png(head: bytes) -> bool:
    return head.startswith(b"\x89PNG\r\n\x1a\n")


def is_jsonl_with(key: str) -> Callable[[bytes], bool]:
    """`is_ours` for JSON lines whose first object starts with `key` (a dataset's "task_id", a log's "iteration")."""
    pattern = re.compile(rb'^\{\s*"' + re.escape(key.encode()) + rb'"\s*:')
    return lambda head: bool(pattern.match(head))


def check_output_file(path: str | Path, what: str, is_ours: Callable[[bytes], bool] | None = None,
                      force: bool = False, force_flag: str | None = None) -> Path:
    """Check that `path` may be written as `what`; return it as a Path.

    Raises:
        OutputPathError: `path` is a directory, a symbolic link or not a regular file; its parent is not a directory;
            or it is a file not in the command's format (`is_ours`), without `force`.
    """
    p = Path(path)
    if p.is_symlink():
        raise OutputPathError(f"{what} {p} is a symbolic link; nothing was written: give the path of the file itself")
    if p.is_dir():
        raise OutputPathError(f"{what} {p} is a directory; give a file path (e.g. {p / 'out.json'})")
    for parent in p.absolute().parents:
        if parent.exists() or parent.is_symlink():
            if not parent.is_dir():
                raise OutputPathError(f"{what} {p}: {parent} is not a directory")
            break
    if not p.exists():
        return p
    st = p.stat()
    if not stat.S_ISREG(st.st_mode):
        raise OutputPathError(f"{what} {p} exists and is not a regular file (a device, pipe or socket); nothing was "
                              "written: choose another path")
    if force:
        return p
    try:
        with p.open("rb") as f:
            head = f.read(SNIFF_BYTES)
    except OSError as e:
        raise OutputPathError(f"{what} {p} exists and cannot be read to check it ({e.strerror})") from None
    if is_ours is not None and is_ours(head):
        return p
    way_out = f", or pass {force_flag} to overwrite it" if force_flag else ""
    raise OutputPathError(f"{what} {p} exists and was not written by this command (not its format); nothing was "
                          f"written: choose another path, move the file away{way_out}")


def write_output_file(path: str | Path, data: str | bytes, what: str, is_ours: Callable[[bytes], bool] | None = None,
                      force: bool = False, force_flag: str | None = None) -> Path:
    """`check_output_file`, then write `data` atomically (a temporary file beside `path`, renamed over it).

    Raises:
        OutputPathError: as `check_output_file`. OSError: the write itself failed (nothing is left behind).
    """
    p = check_output_file(path, what, is_ours, force, force_flag)
    p.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=p.parent, prefix=f".{p.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data.encode("utf-8") if isinstance(data, str) else data)
        os.replace(tmp, p)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return p


def claim_output_dir(path: str | Path, command: str, inputs: Iterable[str | Path] = (),
                     is_legacy: Callable[[Path], bool] | None = None, flag: str = "--output_dir",
                     check_only: bool = False) -> Path:
    """Make `path` this command's output directory (created when missing), or refuse it.

    Args:
        path: the output directory.
        command: e.g. "train-draft"; recorded in the marker.
        inputs: the command's input paths (base model, data): the output may not be one of them or hold one.
        is_legacy: recognises an output written before markers existed (then the marker is added).
        flag: the option's name, for messages.
        check_only: refuse or accept without creating or marking anything (a command that claims several
            directories checks them all first).
    Raises:
        OutputPathError: `path` is a symbolic link or a file, is or holds an input, or is a non-empty directory this
            command did not write (its files named).
    """
    out = Path(path)
    if out.is_symlink():
        raise OutputPathError(f"{flag} {out} is a symbolic link; pass the directory it points to")
    if out.exists() and not out.is_dir():
        raise OutputPathError(f"{flag} {out} exists and is not a directory; choose another {flag}")
    resolved = out.resolve()
    for i in inputs:
        src = Path(i).resolve()
        if src == resolved or resolved in src.parents:
            raise OutputPathError(f"{flag} {out} is or holds the input {i}; writing there would overwrite it: "
                                  f"choose another {flag}")
    marker = out / MARKER_NAME
    if out.is_dir() and any(out.iterdir()) and not _marked(marker, command):
        if is_legacy is None or not is_legacy(out):
            names = sorted(p.name + ("/" if p.is_dir() else "") for p in out.iterdir())
            more = f" and {len(names) - SHOWN} more" if len(names) > SHOWN else ""
            raise OutputPathError(
                f"{flag} {out} is not empty and was not written by nextn {command} (it holds "
                f"{', '.join(names[:SHOWN])}{more}); nothing was changed: choose a new or empty {flag}")
    if check_only:
        return out
    out.mkdir(parents=True, exist_ok=True)
    if not marker.is_file():
        marker.write_text(json.dumps(written_by(command)) + "\n")
    return out


def _marked(marker: Path, command: str) -> bool:
    if marker.is_symlink() or not marker.is_file():
        return False
    try:
        with marker.open("rb") as f:
            head = f.read(SNIFF_BYTES)
    except OSError:
        return False
    return is_report_of(command)(head)
