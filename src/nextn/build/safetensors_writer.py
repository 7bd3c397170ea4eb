"""A safetensors file written one tensor at a time (the engine's weights), holding at most one tensor in memory:
the header is computed from the specs and written first, each tensor lands at its offset as it arrives, and the
file's SHA-256 is computed as the bytes are written."""

from __future__ import annotations

import json
import math
import struct
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import torch

from nextn.build.manifest import EngineError, FileChecksum, StreamHasher, file_checksum
from nextn.progress import progress_bar

_ST_DTYPES = {torch.float32: "F32", torch.bfloat16: "BF16", torch.float16: "F16", torch.int8: "I8",
              torch.uint8: "U8"}


def write_safetensors_streaming(
    path: Path,
    specs: dict[str, tuple[tuple[int, ...], torch.dtype]],
    tensors: Iterable[tuple[str, torch.Tensor]],
    progress: bool = True,
) -> FileChecksum:
    """Write a safetensors file whose tensors arrive one at a time, holding at most one in memory.

    The header (name → dtype, shape, byte range) is computed from `specs` and written first; each tensor is then
    written at its offset as it arrives, in any order. The SHA-256 of the file is computed as the bytes are
    written when the tensors arrive in `specs` order (the builders' order), else by reading the file back.

    Args:
        path: file to create.
        specs: name → (shape, dtype) of every tensor the file will hold (float32, bfloat16 or float16).
        tensors: (name, CPU tensor) pairs; every spec'd name exactly once, with the spec'd shape and dtype.
    Returns:
        The file's size in bytes and SHA-256.
    Raises:
        EngineError: a tensor is unexpected, repeated, missing, or has another shape/dtype than its spec.
    """
    header: dict[str, Any] = {"__metadata__": {"format": "pt"}}
    offset = 0
    for name, (shape, dt) in specs.items():
        nbytes = math.prod(shape) * dt.itemsize
        header[name] = {"dtype": _ST_DTYPES[dt], "shape": list(shape), "data_offsets": [offset, offset + nbytes]}
        offset += nbytes
    blob = json.dumps(header, separators=(",", ":")).encode()
    # the data section 64-byte aligned (safetensors pads to 8 with spaces; 64 more at most): the tensors the loader
    # reads in place (`kernel_layout.file_order`, at the start) stay aligned for vector loads
    blob += b" " * (-(8 + len(blob)) % 64)
    data_start = 8 + len(blob)
    written: set[str] = set()
    hasher = StreamHasher()
    hashed_to = 0  # data bytes hashed so far, in file order
    with path.open("wb") as f, progress_bar(enabled=progress, total=len(specs), desc="build-engine", unit="tensor") as bar:
        f.write(struct.pack("<Q", len(blob)) + blob)
        hasher.update(struct.pack("<Q", len(blob)) + blob)
        f.truncate(data_start + offset)
        for name, t in tensors:
            if name not in specs or name in written:
                raise EngineError(f"internal error: unexpected or repeated engine tensor {name!r}")
            shape, dt = specs[name]
            if tuple(t.shape) != tuple(shape) or t.dtype != dt:
                raise EngineError(f"internal error: engine tensor {name!r} is {t.dtype} {list(t.shape)}, "
                                  f"expected {dt} {list(shape)}")
            start = header[name]["data_offsets"][0]
            data = t.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy().data
            f.seek(data_start + start)
            f.write(data)
            if start == hashed_to:
                hasher.update(data)
                hashed_to += data.nbytes
            written.add(name)
            bar.set_postfix_str(name, refresh=False)
            bar.update(1)
    missing = [n for n in specs if n not in written]
    if missing:
        raise EngineError(f"internal error: {len(missing)} engine tensor(s) were never produced, e.g. {missing[0]!r}")
    return hasher.checksum() if hashed_to == offset else file_checksum(path)
