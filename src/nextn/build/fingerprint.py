"""A SHA-256 fingerprint of a checkpoint's files, recorded in the engine manifest (`source.fingerprint`).

The digest covers, for each file in order of its relative name: the relative name, its size in bytes and its
content (streamed in 1 MiB chunks, so multi-GB shards hash in constant memory). Names are taken relative to the
files' common directory, so copying or moving a checkpoint keeps its fingerprint, while renaming, resizing or
editing any file changes it. Names come from the paths as given, symbolic links not followed (a Hugging Face cache
snapshot links `snapshots/<rev>/model.safetensors` to `blobs/<sha>`); contents and sizes are read through them.
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
    paths = sorted({Path(os.path.abspath(f)) for f in files})
    if not paths:
        raise ValueError("fingerprint needs at least one file")
    base = Path(os.path.abspath(root)) if root is not None else Path(os.path.commonpath([p.parent for p in paths]))
    named = sorted((_relative(p, base), p) for p in paths)
    h = hashlib.sha256()
    for name, path in named:
        size = path.stat().st_size
        h.update(f"{name}\0{size}\0".encode())
        with path.open("rb") as f:
            while chunk := f.read(CHUNK_BYTES):
                h.update(chunk)
    return h.hexdigest()


def _relative(path: Path, base: Path) -> str:
    """`path` relative to `base`, lexically (links not followed), else to `base` with its own links resolved."""
    for b in (base, base.resolve()):
        if b == path or b in path.parents:
            return path.relative_to(b).as_posix()
    raise ValueError(f"{path} lies outside {base}")
