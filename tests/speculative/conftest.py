"""Fixtures shared by the speculative methods' tests."""

from __future__ import annotations

import pytest

from nextn.build.engine_builder import build_engine
from nextn.testing.tiny_llama import tiny_hf_llama


@pytest.fixture(scope="session")
def llama_engine(tmp_path_factory):
    """A tiny HF Llama built into an engine (no MTP, no Medusa weights: for methods that need none)."""
    tmp = tmp_path_factory.mktemp("llama_spec")
    tiny_hf_llama().save_pretrained(tmp / "ckpt")
    build_engine(tmp / "ckpt", tmp / "engine", progress=False, max_seq_len=128)
    return tmp / "engine"
