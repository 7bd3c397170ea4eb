"""A GGUF header's first metadata keys, read without `gguf.GGUFReader` (which parses every key before answering):
enough to refuse an unsupported architecture at once (`peek_architecture`)."""

from __future__ import annotations

import struct
from pathlib import Path

__all__ = ["peek_architecture"]

_HEADER_KEYS = 16  # converters write general.architecture among the first metadata keys


def peek_architecture(path: Path) -> str | None:
    """`general.architecture` read from the first metadata keys of a GGUF header (GGUF v2/v3: magic, version, tensor
    and key counts, then key, type, value), without `gguf.GGUFReader`, which parses every key first (a 262k-token
    vocabulary: ~20 s); None when it is not among the first `_HEADER_KEYS` or the header is not one (the reader
    then decides). Strings and scalars are skipped by their size; an array before it ends the peek."""
    sizes = {0: 1, 1: 1, 2: 2, 3: 2, 4: 4, 5: 4, 6: 4, 7: 1, 10: 8, 11: 8, 12: 8}  # ggml scalar value types
    try:
        with path.open("rb") as f:
            head = f.read(24)
            if len(head) < 24 or head[:4] != b"GGUF" or struct.unpack_from("<I", head, 4)[0] < 2:
                return None
            for _ in range(min(struct.unpack_from("<Q", head, 16)[0], _HEADER_KEYS)):
                (n,) = struct.unpack("<Q", f.read(8))
                key = f.read(min(n, 256))
                (kind,) = struct.unpack("<I", f.read(4))
                if kind == 8:  # string
                    (m,) = struct.unpack("<Q", f.read(8))
                    value = f.read(min(m, 256))
                    if key == b"general.architecture":
                        return value.decode("utf-8", "replace")
                elif kind in sizes:
                    f.read(sizes[kind])
                else:
                    return None
    except (OSError, struct.error):
        return None
    return None
