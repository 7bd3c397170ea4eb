"""Bounded reads of the files a user names (YAML options, token maps, tree files, corpora, prompt files).

A path in a config or on the command line can be anything: `/dev/zero` (endless), a FIFO or `/dev/stdin` (a read
that never returns), a directory, a 50 GB file. Every such read goes through `read_user_bytes`: the file is opened
without blocking (`O_NONBLOCK`, so a FIFO with no writer does not hang the open), checked to be a regular file on the
open descriptor (no race with a swap after the check), checked against a size cap, and read with a bound of one byte
more than the cap (a file that grows while read is still refused). Nothing else is opened. A file read as a stream
(`open_user_text`: JSON-lines prompt files, gzipped or not) gets the same checks, and its bytes — after
decompression, for a gzip — are counted as they stream: a gzip bomb stops at the cap with the caller's error.
"""

from __future__ import annotations

import contextlib
import gzip
import io
import json
import os
import stat
import zlib
from collections.abc import Iterator
from pathlib import Path
from typing import Any, TextIO

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


@contextlib.contextmanager
def open_user_text(path: str | Path, what: str, error: type[Exception] = ValueError, max_bytes: int | None = None,
                   gzipped: bool | None = None, errors: str = "strict") -> Iterator[TextIO]:
    """A regular file of at most `max_bytes`, opened as UTF-8 text to stream (e.g. line by line); a gzip
    (`gzipped`, default: the name ends with `.gz`) is decompressed as it is read, and its **decompressed** bytes are
    held to `max_bytes` too: reading past the cap raises `error` at the cap, having read at most a buffer beyond it.

    Raises:
        `error`: as `read_user_bytes` on opening; while reading: more than `max_bytes` (decompressed), a corrupt or
            truncated gzip, a read failure. UnicodeDecodeError: not UTF-8 (with `errors="strict"`).
    """
    p, fd, _ = _open_regular(path, what, error, max_bytes)
    cap = MAX_USER_FILE_BYTES if max_bytes is None else max_bytes
    raw = os.fdopen(fd, "rb")
    gz = p.name.endswith(".gz") if gzipped is None else gzipped
    inner = gzip.GzipFile(fileobj=raw, mode="rb") if gz else raw
    stream = io.TextIOWrapper(io.BufferedReader(_Bounded(inner, cap, p, what, error, gz)), encoding="utf-8",
                              errors=errors)
    try:
        yield stream
    finally:
        stream.close()
        inner.close()
        raw.close()


class _Bounded(io.RawIOBase):
    """A binary stream that refuses to return more than `cap` bytes in all (the caller's error, naming the cap)."""

    def __init__(self, inner, cap: int, path: Path, what: str, error: type[Exception], gz: bool) -> None:
        super().__init__()
        self.inner, self.left, self.cap = inner, cap, cap
        self.path, self.what, self.error, self.gz = path, what, error, gz

    def readable(self) -> bool:
        return True

    def readinto(self, buffer) -> int:
        try:
            data = self.inner.read(min(len(buffer), self.left + 1))
        except (OSError, EOFError, zlib.error) as e:  # BadGzipFile is an OSError; EOFError: a truncated gzip
            raise self.error(f"{self.what} {self.path} cannot be read: {e}") from None
        if len(data) > self.left:
            kind = "decompresses to more than" if self.gz else "is larger than"
            raise self.error(f"{self.what} {self.path} {kind} {self.cap} bytes; it was not read further: check "
                             "the path, or split the file")
        self.left -= len(data)
        buffer[: len(data)] = data
        return len(data)


def _no_constant(name: str) -> Any:
    raise ValueError(f"{name} is not a JSON number")


def _open_regular(path: str | Path, what: str, error: type[Exception], max_bytes: int | None
                  ) -> tuple[Path, int, int]:
    """(path, an open descriptor, its size) of a regular file of at most `max_bytes`, checked on the descriptor."""
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
        os.set_blocking(fd, True)
    except OSError as e:
        os.close(fd)
        raise error(f"{what} {p} cannot be read: {e.strerror or e}") from None
    except BaseException:
        os.close(fd)
        raise
    return p, fd, st.st_size


def _read(path: str | Path, what: str, error: type[Exception], max_bytes: int | None, read: bool
          ) -> tuple[bytes, int]:
    max_bytes = MAX_USER_FILE_BYTES if max_bytes is None else max_bytes
    p, fd, size = _open_regular(path, what, error, max_bytes)
    if not read:
        os.close(fd)
        return b"", size
    try:
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
