"""A SHA-256 fingerprint of a checkpoint's files, recorded in the engine manifest (`source.fingerprint`).

The digest covers, for each file in order of its relative name: the relative name, its size in bytes and its
content (streamed in 1 MiB chunks, so multi-GB shards hash in constant memory). Names are taken relative to the
files' common directory, so copying or moving a checkpoint keeps its fingerprint, while renaming, resizing or
editing any file changes it.
"""

from __future__ import annotations

import hashlib
import os
from collections.abc import Iterable
from pathlib import Path

CHUNK_BYTES = 1 << 20


def fingerprint(files: Iterable[str | Path], root: str | Path | None = None) -> str:
    """SHA-256 hex digest over (relative name, size, content) of `files`.

    Args:
        files: the files to cover (config.json and the weight files); order does not matter, duplicates count once.
        root: directory the names are relative to; default: the files' common parent directory.
    Returns:
        64 hex characters.
    Raises:
        ValueError: `files` is empty or a file lies outside `root`.
        FileNotFoundError: a file does not exist.
    """
    paths = sorted({Path(f).resolve() for f in files})
    if not paths:
        raise ValueError("fingerprint needs at least one file")
    base = Path(root).resolve() if root is not None else Path(os.path.commonpath([p.parent for p in paths]))
    h = hashlib.sha256()
    for path in sorted(paths, key=lambda p: p.relative_to(base).as_posix()):
        size = path.stat().st_size
        h.update(f"{path.relative_to(base).as_posix()}\0{size}\0".encode())
        with path.open("rb") as f:
            while chunk := f.read(CHUNK_BYTES):
                h.update(chunk)
    return h.hexdigest()
