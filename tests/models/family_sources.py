"""The tiny family checkpoints as the tests read them: the HF directory, or its llama.cpp-converted GGUF."""

from __future__ import annotations

from pathlib import Path

import pytest

from nextn.testing import llama_cpp_converter


def tiny_source(hf_dir: Path, kind: str) -> Path:
    """The checkpoint to read: the HF directory (`kind` "hf"), or the f32 GGUF llama.cpp's converter makes of it
    (once; skips without the converter)."""
    if kind == "hf":
        return hf_dir
    if llama_cpp_converter.find() is None:
        pytest.skip("llama.cpp's convert_hf_to_gguf.py is absent: `python -m nextn.testing.llama_cpp_converter "
                    "--fetch` (.ci/run does)")
    out = hf_dir / "tiny-f32.gguf"
    if not out.is_file():
        llama_cpp_converter.convert(hf_dir, out, "f32")
    return out
