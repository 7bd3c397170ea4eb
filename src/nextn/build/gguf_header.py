"""A GGUF header read fast: its first metadata keys without `gguf.GGUFReader` (which parses every key before
answering), enough to refuse an unsupported architecture at once (`peek_architecture`); and `open_gguf`, the `gguf`
library's reader with its metadata arrays (the vocabulary) parsed in one pass instead of one call per element."""

from __future__ import annotations

import struct
import sys
from pathlib import Path
from typing import Any

__all__ = ["open_gguf", "peek_architecture"]

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


_STRING, _ARRAY = 8, 9  # GGUF value types (gguf.GGUFValueType.STRING / ARRAY)


def open_gguf(path: Path) -> Any:
    """`gguf.GGUFReader` over `path` whose metadata arrays of strings or numbers are parsed in one pass.

    The library parses an array one element at a time through numpy views of its memory map (~30 µs an element: a
    151k-token vocabulary and its merges, ~10 s at every load of a Qwen2.5 GGUF). This reader yields the same
    `fields` (parts, data indices and types as the library's, checked in tests/build/test_gguf_header.py) at ~1 µs an
    element; arrays of arrays, and files of the other byte order, take the library's path.

    Raises:
        ValueError: an array or string that runs past the end of the file; the library's errors (ValueError,
            IndexError, KeyError) on other malformed headers.
    """
    import gguf
    import numpy as np

    class _Reader(gguf.GGUFReader):
        def _get_field_parts(self, orig_offs: int, raw_type: int) -> tuple[int, list, list[int], list]:
            if raw_type != _ARRAY or self.byte_order != "I" or sys.byteorder != "little":
                return super()._get_field_parts(orig_offs, raw_type)
            raw = self.data.view(np.ndarray)  # plain views: a memmap's slice costs ~10x more
            if orig_offs + 12 > len(raw):
                raise ValueError(f"GGUF array header at byte {orig_offs} runs past the end of the file")
            itype, alen = raw[orig_offs:orig_offs + 4].view(np.uint32), raw[orig_offs + 4:orig_offs + 12].view("<u8")
            kind, n, offs = int(itype[0]), int(alen[0]), orig_offs + 12
            scalar = self.gguf_scalar_to_np.get(gguf.GGUFValueType(kind)) if kind != _STRING else None
            if kind != _STRING and scalar is None:  # an array of arrays: the library's path
                return super()._get_field_parts(orig_offs, raw_type)
            width = 8 if kind == _STRING else np.dtype(scalar).itemsize  # each element's least size
            if n > (len(raw) - offs) // width:
                raise ValueError(f"GGUF array at byte {orig_offs} holds {n} elements, more than the file has room for")
            parts: list = [itype, alen]
            if kind == _STRING:
                view = memoryview(raw)
                for _ in range(n):
                    size = int.from_bytes(view[offs:offs + 8], "little")
                    if offs + 8 + size > len(raw):
                        raise ValueError(f"GGUF string at byte {offs} runs past the end of the file")
                    parts += (raw[offs:offs + 8].view(np.uint64), raw[offs + 8:offs + 8 + size])
                    offs += 8 + size
                idxs = list(range(3, 2 + 2 * n, 2))
            else:
                values = raw[offs:offs + n * width].view(scalar)
                parts += (values[i:i + 1] for i in range(n))
                offs += n * width
                idxs = list(range(2, 2 + n))
            types = [gguf.GGUFValueType(_ARRAY)] + ([gguf.GGUFValueType(kind)] if n else [])
            return offs - orig_offs, parts, idxs, types

    return _Reader(str(path))
