"""Bounded reads of the files a user names (YAML options, token maps, tree files, corpora, prompt files).

A path in a config or on the command line can be anything: `/dev/zero` (endless), a FIFO or `/dev/stdin` (a read
that never returns), a directory, a 50 GB file. Every such read goes through `read_user_bytes`: the file is opened
without blocking (`O_NONBLOCK`, so a FIFO with no writer does not hang the open), checked to be a regular file on the
open descriptor (no race with a swap after the check), checked against a size cap, and read with a bound of one byte
more than the cap (a file that grows while read is still refused). Nothing else is opened.
"""

from __future__ import annotations

import json
import os
import stat
from pathlib import Path
from typing import Any

#: Default cap of a user-named file read whole (token maps of a 256k vocabulary are ~2 MB; tree files kilobytes).
MAX_USER_FILE_BYTES = 64 << 20


def check_user_file(path: str | Path, what: str, error: type[Exception] = ValueError,
                    max_bytes: int | None = None) -> int:
    """Check, without reading it, that `path` is a regular file of at most `max_bytes` (for a reader that streams
    the file itself, e.g. a gzip prompt file); return its size in bytes.

    Raises:
        `error`: as `read_user_bytes`.
    """
    return _read(path, what, error, max_bytes, read=False)[1]


def read_user_bytes(path: str | Path, what: str, error: type[Exception] = ValueError,
                    max_bytes: int | None = None) -> bytes:
    """The bytes of a regular file of at most `max_bytes`.

    Args:
        path: the file the user named.
        what: how the message names it, e.g. "draft_token_map" or "the corpus file".
        error: the exception type raised (the caller's named error, e.g. LlmArgsError).
        max_bytes: the size cap (bytes); None: `MAX_USER_FILE_BYTES` (64 MiB).
    Raises:
        `error`: missing, not a regular file (a directory, a device such as /dev/zero, a FIFO or socket: never read),
            unreadable, or larger than `max_bytes`; the message names `what`, the path and the fix.
    """
    return _read(path, what, error, max_bytes, read=True)[0]


def read_user_text(path: str | Path, what: str, error: type[Exception] = ValueError,
                   max_bytes: int | None = None, errors: str = "strict") -> str:
    """`read_user_bytes` decoded as UTF-8 (`errors="replace"` for corpora).

    Raises:
        `error`: as `read_user_bytes`, or not UTF-8 (with `errors="strict"`; the message names the byte offset).
    """
    raw = read_user_bytes(path, what, error, max_bytes)
    try:
        return raw.decode("utf-8", errors=errors)
    except UnicodeDecodeError as e:
        raise error(f"{what} {path} is not UTF-8 text (byte {e.start} is {raw[e.start]:#04x}): save it as UTF-8"
                    ) from None


def read_user_json(path: str | Path, what: str, error: type[Exception] = ValueError,
                   max_bytes: int | None = None) -> Any:
    """`read_user_text` parsed as JSON: NaN / Infinity refused, integers of at most 4300 digits, any nesting Python's
    parser survives.

    Raises:
        `error`: as `read_user_text`, or not valid JSON (line and column named).
    """
    text = read_user_text(path, what, error, max_bytes)
    try:
        return json.loads(text, parse_constant=_no_constant)
    except json.JSONDecodeError as e:
        raise error(f"{what} {path} is not valid JSON ({e})") from None
    except (ValueError, RecursionError) as e:  # NaN, a 5000-digit integer, deep nesting
        raise error(f"{what} {path} is not valid JSON: {str(e) or type(e).__name__}") from None


def _no_constant(name: str) -> Any:
    raise ValueError(f"{name} is not a JSON number")


def _read(path: str | Path, what: str, error: type[Exception], max_bytes: int | None, read: bool
          ) -> tuple[bytes, int]:
    max_bytes = MAX_USER_FILE_BYTES if max_bytes is None else max_bytes
    try:
        p = Path(path)
    except TypeError:
        raise error(f"{what} must be a file path, got {type(path).__name__}") from None
    try:
        fd = os.open(p, os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0))
    except FileNotFoundError:
        raise error(f"{what} {p} does not exist") from None
    except OSError as e:
        kind = "is a directory" if p.is_dir() else f"cannot be opened ({e.strerror})"
        raise error(f"{what} {p} {kind}: give the path of a regular file") from None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise error(f"{what} {p} is not a regular file (a directory, device, pipe or socket); it was not read: "
                        "give the path of a regular file")
        if st.st_size > max_bytes:
            raise error(f"{what} {p} is larger than {max_bytes} bytes ({st.st_size} bytes): more than such a file "
                        "holds; check the path")
        if not read:
            return b"", st.st_size
        os.set_blocking(fd, True)
        chunks, left = [], max_bytes + 1
        while left > 0:
            chunk = os.read(fd, min(left, 1 << 20))
            if not chunk:
                break
            chunks.append(chunk)
            left -= len(chunk)
    except OSError as e:
        raise error(f"{what} {p} cannot be read: {e.strerror or e}") from None
    finally:
        os.close(fd)
    data = b"".join(chunks)
    if len(data) > max_bytes:
        raise error(f"{what} {p} is larger than {max_bytes} bytes (it grew while read); check the path")
    return data, len(data)
