"""What the family tests share: SmolLM2's tokenizer for the tiny checkpoints (their GGUFs: `family_sources.py`)."""

from __future__ import annotations

from pathlib import Path

import pytest

from nextn.testing.tiny_families import smollm2_tokenizer

SHARED = Path(__file__).resolve().parents[2].parent / "shared"


@pytest.fixture(scope="module")
def tokenizer_dir(tmp_path_factory) -> Path:
    """SmolLM2-135M's tokenizer files (skips when its GGUF is absent)."""
    out = tmp_path_factory.mktemp("tokenizer")
    try:
        smollm2_tokenizer(SHARED, out)
    except FileNotFoundError as e:
        pytest.skip(f"SmolLM2's GGUF (the tiny checkpoints' tokenizer) is absent: {e}")
    return out
