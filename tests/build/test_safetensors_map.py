"""`build/safetensors_map.py`: an engine's safetensors file mapped as one tensor — the same tensors as safetensors'
own reader, views of one mapping (so adjacent tensors can be viewed as one), and a named error for a damaged file."""

from __future__ import annotations

import json
import struct

import pytest
import torch
from safetensors.torch import load_file, save_file

from nextn.build.manifest import EngineError
from nextn.build.safetensors_map import map_safetensors


def _tensors() -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    return {"a.weight": torch.randn(4, 6, generator=gen).bfloat16(),
            "b.odd": torch.randint(0, 255, (3,), dtype=torch.uint8, generator=gen),  # leaves the next one unaligned
            "c.scale": torch.randn(5, generator=gen),
            "d.half": torch.randn(2, 3, generator=gen).half(),
            "e.int8": torch.randint(-128, 127, (7,), dtype=torch.int8, generator=gen),
            "f.empty": torch.zeros(0, 4)}


def test_the_same_tensors_as_safetensors_views_of_one_mapping(tmp_path):
    path = tmp_path / "model.safetensors"
    save_file(_tensors(), str(path))
    mapped, reference = map_safetensors(path), load_file(str(path))
    assert mapped.keys() == reference.keys()
    for name, t in reference.items():
        assert mapped[name].dtype == t.dtype and torch.equal(mapped[name], t), name
    raw = path.read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    start = {k: 8 + n + v["data_offsets"][0] for k, v in json.loads(raw[8:8 + n]).items() if k != "__metadata__"}
    aligned = [k for k, t in mapped.items() if t.numel() and start[k] % t.element_size() == 0]
    assert len({mapped[k].untyped_storage().data_ptr() for k in aligned}) == 1  # views of the one mapping
    base = mapped[aligned[0]].untyped_storage().data_ptr()
    assert all(mapped[k].data_ptr() - base == start[k] for k in aligned)  # at their offsets in the file
    for k in set(mapped) - set(aligned):  # a tensor not aligned to its element size is a copy
        assert not mapped[k].numel() or mapped[k].untyped_storage().data_ptr() != base
    mapped["a.weight"].add_(1)  # a private mapping: writing changes the process's copy, never the file
    assert torch.equal(load_file(str(path))["a.weight"], reference["a.weight"])


@pytest.mark.parametrize("damage", ["short", "header_length", "not_json", "outside", "wrong_size", "bad_dtype"])
def test_a_damaged_file_is_named(tmp_path, damage):
    path = tmp_path / "model.safetensors"
    save_file({"w": torch.ones(4, 4)}, str(path))
    raw = path.read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    header = json.loads(raw[8:8 + n])
    if damage == "short":
        raw = raw[:5]
    elif damage == "header_length":
        raw = struct.pack("<Q", len(raw)) + raw[8:]
    elif damage == "not_json":
        raw = raw[:8] + b"{" * n + raw[8 + n:]
    else:
        entry = header["w"]
        if damage == "outside":
            entry["data_offsets"] = [0, 10_000]
        elif damage == "wrong_size":
            entry["shape"] = [4, 5]
        else:
            entry["dtype"] = "Q4"
        blob = json.dumps(header).encode().ljust(n)
        raw = raw[:8] + blob[:n] + raw[8 + n:] if len(blob) <= n else struct.pack("<Q", len(blob)) + blob + raw[8 + n:]
    path.write_bytes(raw)
    with pytest.raises(EngineError, match="model.safetensors"):
        map_safetensors(path)
