"""`open_gguf`: the `gguf` library's reader with metadata arrays parsed in one pass — the same fields, parts, data
indices and types as `gguf.GGUFReader` on real and synthetic files, and a clear error where an array or a string runs
past the end of the file."""

from __future__ import annotations

import struct
from pathlib import Path

import gguf
import numpy as np
import pytest

from nextn.build.checkpoint import CheckpointError
from nextn.build.gguf_header import open_gguf
from nextn.build.gguf_reader import GGUFCheckpoint

MODELS = Path(__file__).resolve().parents[2].parent / "shared" / "data" / "models"
REAL = [MODELS / "smollm2-135m-instruct" / "SmolLM2-135M-Instruct.Q4_1.gguf",
        MODELS / "stories260K" / "stories260K.gguf"]


def _assert_same_as_the_library(path: Path) -> None:
    want, got = gguf.GGUFReader(str(path)), open_gguf(path)
    assert list(got.fields) == list(want.fields)
    for name, w in want.fields.items():
        g = got.fields[name]
        assert (g.offset, g.data, g.types) == (w.offset, w.data, w.types), name
        assert len(g.parts) == len(w.parts), name
        for a, b in zip(g.parts, w.parts):
            assert a.dtype == b.dtype and np.array_equal(a, b), name
        assert g.contents() == w.contents(), name
    assert [(t.name, t.data_offset, t.n_bytes) for t in got.tensors] == \
        [(t.name, t.data_offset, t.n_bytes) for t in want.tensors]
    assert got.data_offset == want.data_offset


def _write(path: Path) -> None:
    """Every kind of metadata array the format has: strings (with multi-byte UTF-8 and empty ones), each scalar type,
    bools, empty arrays and an array of arrays."""
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_array("t.strings", ["a", "", "é€𝄞", "<0x0A>", "x" * 300])
    w.add_array("t.empty", [])
    w.add_array("t.nested", [[1, 2], [3]])
    w.add_key_value("t.f32", [0.5, -1.25, 3.0], gguf.GGUFValueType.ARRAY, sub_type=gguf.GGUFValueType.FLOAT32)
    w.add_key_value("t.i32", [1, -2, 3], gguf.GGUFValueType.ARRAY, sub_type=gguf.GGUFValueType.INT32)
    w.add_key_value("t.u8", [1, 2, 255], gguf.GGUFValueType.ARRAY, sub_type=gguf.GGUFValueType.UINT8)
    w.add_key_value("t.i64", [2**40, -1], gguf.GGUFValueType.ARRAY, sub_type=gguf.GGUFValueType.INT64)
    w.add_key_value("t.f64", [1e300], gguf.GGUFValueType.ARRAY, sub_type=gguf.GGUFValueType.FLOAT64)
    w.add_key_value("t.bool", [True, False], gguf.GGUFValueType.ARRAY, sub_type=gguf.GGUFValueType.BOOL)
    w.add_string("t.scalar", "plain")
    w.add_uint32("t.count", 7)
    w.add_tensor("w", np.arange(12, dtype=np.float32).reshape(3, 4))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


@pytest.mark.parametrize("path", REAL, ids=lambda p: p.parent.name)
def test_real_ggufs_read_as_the_library_reads_them(path):
    if not path.is_file():
        pytest.skip(f"{path} is absent (../shared/data/models holds it on CI)")
    _assert_same_as_the_library(path)


def test_every_kind_of_array_reads_as_the_library_reads_it(tmp_path):
    _write(tmp_path / "kinds.gguf")
    _assert_same_as_the_library(tmp_path / "kinds.gguf")
    assert open_gguf(tmp_path / "kinds.gguf").fields["t.strings"].contents()[2] == "é€𝄞"


def _offset_of(data: bytes, key: bytes) -> int:
    """Where the value of metadata `key` begins (after its name and its 4-byte type)."""
    at = data.index(struct.pack("<Q", len(key)) + key)
    return at + 8 + len(key) + 4


def test_an_array_or_string_past_the_end_of_the_file_is_refused_by_name(tmp_path):
    _write(tmp_path / "kinds.gguf")
    data = (tmp_path / "kinds.gguf").read_bytes()
    at = _offset_of(data, b"t.strings")  # u32 element type, u64 count, then the strings
    huge = tmp_path / "huge.gguf"  # a count of 2**60 elements: refused before anything is read or allocated
    huge.write_bytes(data[:at + 4] + struct.pack("<Q", 2**60) + data[at + 12:])
    with pytest.raises(ValueError, match=r"holds 1152921504606846976 elements, more than the file has room for"):
        open_gguf(huge)
    long = tmp_path / "long.gguf"  # the first string says it is 2**40 bytes long
    long.write_bytes(data[:at + 12] + struct.pack("<Q", 2**40) + data[at + 20:])
    with pytest.raises(ValueError, match=r"GGUF string at byte \d+ runs past the end of the file"):
        open_gguf(long)
    cut = tmp_path / "cut" / "model.gguf"  # cut inside the array: the checkpoint's own error names the file
    cut.parent.mkdir()
    cut.write_bytes(data[:at + 30])
    with pytest.raises(CheckpointError, match=r"model\.gguf is a truncated or corrupt GGUF file"):
        GGUFCheckpoint(cut)
