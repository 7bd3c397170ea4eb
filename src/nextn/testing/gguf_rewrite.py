"""GGUF files rewritten from another (gguf-py's reader and writer): the metadata copied, each tensor as it is or
changed — how the tests make the variants llama.cpp's tools write (a quantized file's 1-D one-row weights, K-quant
blocks) from the converter's f32 output, and how `benchmarks/moe_model.py` repeats a file's layers."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np


def copy_metadata(reader: Any, writer: Any, value: Callable[[str, Any], Any] = lambda name, v: v) -> None:
    """Every metadata key of `reader` (a `gguf.GGUFReader`) but the architecture (the writer's own) and the file's
    `GGUF.*` fields into `writer`, each value through `value(name, value)`, its type kept."""
    import gguf

    for field in reader.fields.values():
        if field.name == "general.architecture" or field.name.startswith("GGUF."):
            continue
        vtype = field.types[0]
        writer.add_key_value(field.name, value(field.name, field.contents()), vtype,
                             sub_type=field.types[-1] if vtype == gguf.GGUFValueType.ARRAY else None)


def rewrite(src: Path, dst: Path, tensor: Callable[[Any], tuple[np.ndarray, Any]]) -> Path:
    """`src` written to `dst` (refusing to overwrite a file) with its metadata and, for each of its tensors `t` (a
    `ReaderTensor`), `tensor(t)`: (raw data, `GGMLQuantizationType`) — (t.data, t.tensor_type) keeps it. In memory:
    for small files."""
    import gguf

    if dst.exists():
        raise FileExistsError(f"{dst} exists")
    reader = gguf.GGUFReader(src)
    writer = gguf.GGUFWriter(dst, reader.fields["general.architecture"].contents())
    copy_metadata(reader, writer)
    for t in reader.tensors:
        data, qtype = tensor(t)
        writer.add_tensor(t.name, data, raw_dtype=qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return dst
