"""YaRN rope scaling (Qwen3 / Qwen2.5's long-context settings, SmolLM3, gpt-oss): the inverse frequencies and the
attention factor equal `transformers`' `_compute_yarn_parameters` for every way a config spells them, and a tiny
Qwen3 with YaRN decodes as `transformers` float32 from its HF checkpoint and from llama.cpp's GGUF of it."""

from __future__ import annotations

import json

import pytest
import torch

from nextn.build.gguf_reader import GGUFCheckpoint
from nextn.models.config import ConfigError
from nextn.models.llama import LlamaModelConfig
from nextn.models.llama.rope import inv_freq, rope_cache
from nextn.models.llama.weights import stored_view
from nextn.testing.tiny_families import save_tiny

from family_sources import tiny_source
from test_llama import _assert_matches_hf, _load

BASE = dict(architectures=["Qwen3ForCausalLM"], model_type="qwen3", vocab_size=64, hidden_size=64,
            intermediate_size=128, num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=2, head_dim=32,
            max_position_embeddings=4096)
#: A ramp several dims wide at base 1e4 over an original context of 64 (so the tests' 70-token prompts exceed it)
YARN = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "original_max_position_embeddings": 64}


@pytest.mark.parametrize("params", [
    YARN,
    {**YARN, "beta_fast": 16.0, "beta_slow": 2.0},
    {**YARN, "truncate": False},  # gpt-oss's setting
    {**YARN, "attention_factor": 0.7},
    {**YARN, "mscale": 1.0, "mscale_all_dim": 0.5},
    {**YARN, "factor": 32.0, "original_max_position_embeddings": 1024, "rope_theta": 150000.0},
])
def test_frequencies_and_attention_factor_are_transformers(params):
    from transformers import Qwen3Config
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    hf = {**BASE, "rope_parameters": params}
    cfg = LlamaModelConfig.from_hf(hf)
    assert cfg.rope_scaling.rope_type == "yarn"
    want, attention = ROPE_INIT_FUNCTIONS["yarn"](Qwen3Config(**{k: v for k, v in hf.items() if k != "architectures"}),
                                                  "cpu")
    torch.testing.assert_close(inv_freq(cfg), want, rtol=1e-6, atol=0)
    assert cfg.rope_scaling.attention_factor == pytest.approx(attention, rel=1e-12)
    table = rope_cache(cfg, 8)  # cos and sin scaled by the attention factor
    assert table[0, 0, 0].item() == pytest.approx(attention, rel=1e-6)
    assert not torch.equal(want, inv_freq(LlamaModelConfig.from_hf({**BASE, "rope_theta": params["rope_theta"]})))


def test_yarn_spellings_and_refusals():
    legacy = LlamaModelConfig.from_hf({**BASE, "rope_theta": 1e4, "original_max_position_embeddings": 64,
                                       "rope_scaling": {"type": "yarn", "factor": 4.0}})
    assert legacy.rope_scaling == LlamaModelConfig.from_hf({**BASE, "rope_parameters": YARN}).rope_scaling
    # no original context anywhere: transformers' default, max_position_embeddings (and factor from it if absent)
    implied = LlamaModelConfig.from_hf({**BASE, "rope_parameters": {"rope_type": "yarn", "rope_theta": 1e4}})
    assert (implied.rope_scaling.original_max_position_embeddings, implied.rope_scaling.factor) == (4096, 1.0)
    with pytest.raises(ConfigError, match="invalid yarn rope scaling"):
        LlamaModelConfig.from_hf({**BASE, "rope_parameters": {**YARN, "factor": -2.0}})
    with pytest.raises(ConfigError, match="unsupported rope type 'dynamic'.*'yarn'"):
        LlamaModelConfig.from_hf({**BASE, "rope_parameters": {"rope_type": "dynamic", "factor": 2.0}})


@pytest.fixture(scope="module")
def tiny_yarn(tmp_path_factory, tokenizer_dir):
    out = tmp_path_factory.mktemp("qwen3_yarn")
    hf = save_tiny("qwen3", out, tokenizer_dir, rope_parameters=dict(YARN), max_position_embeddings=4096)
    return hf, out


@pytest.mark.parametrize("kind", ["hf", "gguf"])
def test_tiny_qwen3_with_yarn_is_transformers(tiny_yarn, kind):
    hf, hf_dir = tiny_yarn
    path = tiny_source(hf_dir, kind)
    if kind == "gguf":
        reader = GGUFCheckpoint(path)
        cfg = reader.model_config
    else:
        from nextn.build.checkpoint import CheckpointReader

        reader = CheckpointReader(path)
        cfg = LlamaModelConfig.from_hf(json.loads((path / "config.json").read_text()))
    assert cfg.rope_scaling is not None and cfg.rope_scaling.rope_type == "yarn"
    assert cfg.rope_scaling == LlamaModelConfig.from_hf(hf.config.to_dict() | {
        "architectures": ["Qwen3ForCausalLM"]}).rope_scaling
    stored = stored_view(reader, cfg)
    model = _load(cfg, stored.get, stored.has)
    assert _assert_matches_hf(model, hf, 4000, [70, 9, 33]) < 1e-4


def test_gguf_scaling_keys():
    from nextn.build.gguf_families import rope_scaling_config

    meta = {"rope.scaling.factor": 4.0, "rope.scaling.original_context_length": 64, "rope.scaling.yarn_beta_fast": 16.0}

    def key(name, kind, default):
        return meta.get(name, default)

    assert rope_scaling_config("qwen3", "yarn", key) == {
        "rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64, "beta_fast": 16.0}
    assert rope_scaling_config("qwen3", "none", key) is None
    with pytest.raises(ValueError, match="qwen3.rope.scaling.type 'longrope' is not supported"):
        rope_scaling_config("qwen3", "longrope", key)
