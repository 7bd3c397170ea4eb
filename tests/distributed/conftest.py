"""Fixtures of the distributed tests: tiny Llama / Qwen2 engines (DeepSeek-V3 ones come from tests/conftest.py)."""

from __future__ import annotations

import pytest

from nextn.build.engine_builder import build_engine
from nextn.testing.tiny_llama import tiny_hf_llama


@pytest.fixture(scope="session")
def llama_engine(tmp_path_factory):
    """A tiny Llama engine (4 heads / 2 KV heads, untied, vocabulary 300, fp32)."""
    root = tmp_path_factory.mktemp("tp_llama")
    tiny_hf_llama().save_pretrained(root / "ckpt")
    build_engine(root / "ckpt", root / "engine", progress=False, max_seq_len=128)
    return root / "engine"


@pytest.fixture(scope="session")
def qwen2_engine(tmp_path_factory):
    """A tiny Qwen2 engine: q/k/v biases, tied embeddings, an odd vocabulary (301: the last rank's slice padded)."""
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    root = tmp_path_factory.mktemp("tp_qwen2")
    cfg = Qwen2Config(vocab_size=301, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                      tie_word_embeddings=True)
    torch.manual_seed(0)
    hf = Qwen2ForCausalLM(cfg).eval()
    with torch.no_grad():
        hf.model.embed_tokens.weight.mul_(8)  # peaked logits through the tied head: no greedy near-ties
        for layer in hf.model.layers:
            layer.self_attn.q_proj.bias.normal_(0, 0.5)
    hf.save_pretrained(root / "ckpt")
    build_engine(root / "ckpt", root / "engine", progress=False, max_seq_len=128)
    return root / "engine"
