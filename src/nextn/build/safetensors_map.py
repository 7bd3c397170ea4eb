"""An engine's safetensors file mapped into memory as one tensor, its tensors views of it.

safetensors' `load_file` maps the file too, but gives every tensor a storage of its own, so no tensor can span two
of them: the MoE op's stacked experts (`kernel_layout.file_order` stores them side by side) would have to be copied.
Here the whole file is one private mapping (`mmap.ACCESS_COPY`: pages are the page cache's, shared with every process
that maps the file, until one is written) and each tensor a view of it at its header's offsets, so
`int4_operands.stack_rows` can view a run of adjacent tensors as one. Format: an 8-byte little-endian header length,
a JSON header (name → dtype, shape, [begin, end) byte offsets in the data section; `__metadata__`), the data
(https://github.com/huggingface/safetensors, "Format").
"""

from __future__ import annotations

import json
import math
import mmap
import struct
from pathlib import Path

import torch

from nextn.build.manifest import EngineError

_DTYPES = {"F32": torch.float32, "BF16": torch.bfloat16, "F16": torch.float16, "I8": torch.int8, "U8": torch.uint8,
           "I32": torch.int32, "I64": torch.int64, "F64": torch.float64, "BOOL": torch.bool, "I16": torch.int16}
MAX_HEADER = 100 << 20  # safetensors' own bound on the header


def map_safetensors(path: Path) -> dict[str, torch.Tensor]:
    """Every tensor of the safetensors file `path`, as views of one mapping of the whole file (CPU). A tensor whose
    offset is not a multiple of its element size (another writer's file) is copied instead.

    Raises:
        EngineError: the file is not a safetensors file, or a tensor lies outside it or does not match its shape.
    """
    with open(path, "rb") as f:
        size = f.seek(0, 2)
        if size < 8:
            raise EngineError(f"{path} is not a safetensors file ({size} bytes)")
        f.seek(0)
        (length,) = struct.unpack("<Q", f.read(8))
        if length > min(MAX_HEADER, size - 8):
            raise EngineError(f"{path}: header of {length} bytes in a file of {size}")
        try:
            header = json.loads(f.read(length))
        except ValueError as e:
            raise EngineError(f"{path}: the safetensors header is not JSON: {e}") from e
        whole = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_COPY) if size > 8 + length else None
    base = torch.frombuffer(whole, dtype=torch.uint8) if whole is not None else torch.empty(0, dtype=torch.uint8)
    start = 8 + length
    out: dict[str, torch.Tensor] = {}
    for name, info in header.items():
        if name == "__metadata__":
            continue
        try:
            dt, shape, (lo, hi) = _DTYPES[info["dtype"]], [int(d) for d in info["shape"]], info["data_offsets"]
        except (KeyError, TypeError, ValueError) as e:
            raise EngineError(f"{path}: tensor {name!r} has a bad header entry {info!r}") from e
        if not 0 <= lo <= hi <= size - start or hi - lo != math.prod(shape) * dt.itemsize:
            raise EngineError(f"{path}: tensor {name!r} ({info['dtype']} {shape}) does not fit bytes [{lo}, {hi})")
        raw = base[start + lo:start + hi]
        if (start + lo) % dt.itemsize:
            raw = raw.clone()
        out[name] = raw.view(dt).view(shape)
    return out
