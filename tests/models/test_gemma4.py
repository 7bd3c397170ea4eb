"""Gemma 4 text (issue 62): full-attention layers with wider heads whose V is K's projection and whose rope is
"proportional", V normalised without weight, per-layer inputs (PLE), a learned scalar per layer, the last layers
reading earlier layers' KV with double-wide MLPs — a tiny random `Gemma4ForCausalLM` made by `transformers` at test
time (`testing.tiny_families.GEMMA4`), read from its HF checkpoint, from the released multimodal layout and from the
GGUF llama.cpp's converter makes of it, decodes as `transformers` float32 does: logits over the paged cache, greedy
tokens through the engine plain and with the NGram and Suffix drafters, and batch-invariant W4A16 / W4A8 engines."""

from __future__ import annotations

import json

import pytest
import torch

from nextn.build.checkpoint import CheckpointReader
from nextn.build.gguf_reader import GGUFCheckpoint
from nextn.models.config import ConfigError
from nextn.models.llama import LlamaModelConfig
from nextn.models.llama.weights import stored_view
from nextn.testing.tiny_families import gemma_tokenizer, save_tiny, save_tiny_gemma4_vl

from family_sources import (assert_batch_invariant_engine, assert_engine_greedy, assert_text_model_greedy,
                            tiny_source)
from test_llama import _assert_matches_hf, _load

PROMPT = [1] + [100 + (7 * i) % 23 for i in range(45)]  # 46 tokens: past the window of 16


@pytest.fixture(scope="module")
def gemma4(tmp_path_factory, tokenizer_dir):
    out = tmp_path_factory.mktemp("gemma4")
    return save_tiny("gemma4_text", out, tokenizer_dir), out


@pytest.fixture(scope="module")
def gemma4_spm(tmp_path_factory):
    """The same tiny model over a Gemma-style SentencePiece vocabulary (llama.cpp's converter reads Gemma 4's
    tokenizer as one), its vocab_size the tokenizer's: what the GGUF tests convert."""
    out = tmp_path_factory.mktemp("gemma4_spm")
    vocab = gemma_tokenizer(out / "tokenizer")
    hf = save_tiny("gemma4_text", out / "hf", out / "tokenizer", vocab_size=vocab, vocab_size_per_layer_input=vocab)
    return hf, out / "hf", vocab


def _config(path, **changes) -> LlamaModelConfig:
    return LlamaModelConfig.from_hf({**json.loads((path / "config.json").read_text()), **changes})


def _model(path, cfg=None):
    cfg = cfg or _config(path)
    stored = stored_view(CheckpointReader(path), cfg)
    return _load(cfg, stored.get, stored.has)


def test_config_reads_every_part(gemma4):
    _, path = gemma4
    cfg = _config(path)
    assert (cfg.global_head_dim, cfg.layer_kv_heads(2), cfg.attention_k_eq_v, cfg.v_norm,
            cfg.num_kv_shared_layers, cfg.double_wide_mlp, cfg.hidden_size_per_layer_input, cfg.layer_scalar,
            cfg.rope_proportion, cfg.softmax_scale, cfg.norm_style) == (
        32, 1, True, True, 2, True, 64, True, 0.25, 1.0, "fp32_weight")
    # layers 4 (sliding) and 5 (full) read layers 3's and 2's KV; the four layers that compute KV share three cache
    # rows as wide as the widest layer (a full one's K and V: 2 · 32): sliding layers 0 and 1 (2 · 16 columns each)
    # one row, the full layer 2 the next, the sliding layer 3 the first columns of the third
    assert [cfg.kv_source(i) for i in range(6)] == [0, 1, 2, 3, 3, 2]
    assert (cfg.num_cache_layers, cfg.kv_cache_dim) == (3, 64)
    assert [cfg.layer_head_dim(i) for i in range(6)] == [16, 16, 32, 16, 16, 32]
    model = _model(path)
    assert (model.cache_rows, model.cache_columns) == ((0, 0, 1, 2, 2, 1), (0, 32, 0, 0, 0, 0))
    assert model.num_cache_layers == 3


def test_a_config_without_per_layer_config_reads_as_transformers_does(gemma4):
    """The released configs name `global_head_dim` and `num_global_key_value_heads` (transformers 5.23 writes
    `per_layer_config` instead): the full layers' KV heads change only with `attention_k_eq_v`, and without the key
    their heads are 512 wide (`Gemma4TextConfig.__post_init__`)."""
    from transformers import Gemma4TextConfig

    _, path = gemma4
    for k_eq_v, changes in ((True, {"global_head_dim": 64, "num_global_key_value_heads": 2}),
                            (False, {"global_head_dim": 64, "num_global_key_value_heads": 2}), (False, {})):
        hf = {**json.loads((path / "config.json").read_text()), "attention_k_eq_v": k_eq_v, **changes}
        del hf["per_layer_config"]
        ref = Gemma4TextConfig(**{k: v for k, v in hf.items() if k not in ("architectures", "model_type",
                                                                            "transformers_version", "dtype")})
        cfg = LlamaModelConfig.from_hf(hf)
        assert cfg.layer_head_dim(2) == ref.per_layer_config[2].head_dim
        assert cfg.layer_kv_heads(2) == ref.per_layer_config[2].num_key_value_heads
        assert cfg.layer_head_dim(0) == ref.per_layer_config[0].head_dim == 16


def test_logits_match_transformers(gemma4):
    hf, path = gemma4
    assert _assert_matches_hf(_model(path), hf, 4000, [46, 9, 33]) < 1e-4


@pytest.mark.parametrize("change", ["v_norm", "layer_scalar", "per_layer_inputs", "rope", "kv_sharing"])
def test_each_part_is_needed(gemma4, change):
    """The controls: without V's norm, the layer scalars, the per-layer inputs, with the full layers' rope rotating
    every pair, or with shared layers reading their own type's first layer, the logits are no longer transformers'."""
    hf, path = gemma4
    cfg = _config(path)
    if change == "rope":
        cfg = cfg.model_copy(update={"rope_proportion": 1.0})
    model = _model(path, cfg)
    if change == "v_norm":
        for layer in model.model.layers:
            layer.self_attn.v_norm = torch.nn.Identity()
    elif change == "layer_scalar":
        for layer in model.model.layers:
            layer.layer_scalar.fill_(1.0)
    elif change == "per_layer_inputs":
        model.per_layer_inputs = False
    elif change == "kv_sharing":
        model.cache_rows = (0, 0, 1, 2, 0, 1)  # layer 4 reads layer 0's KV, not layer 3's
    with pytest.raises(AssertionError):
        _assert_matches_hf(model, hf, 4000, [40])


def test_layers_sharing_a_cache_row_keep_their_own_columns(gemma4):
    """Decoding token by token over the paged cache reads earlier steps' K and V: the two sliding layers that share
    a row give transformers' greedy tokens; written to the same columns (the control), the second overwrites the
    first's and the tokens differ."""
    from test_llama import _greedy

    hf, path = gemma4
    with torch.no_grad():
        want = hf.generate(torch.tensor([PROMPT]), max_new_tokens=12, do_sample=False, pad_token_id=0,
                           eos_token_id=None)[0, len(PROMPT):].tolist()
    model = _model(path)
    assert _greedy(model, PROMPT, 12) == want
    model.cache_columns = None
    assert _greedy(model, PROMPT, 12) != want


def test_gguf_logits_match_transformers(gemma4_spm):
    """llama.cpp's GGUF of the checkpoint (`gemma4`: per-layer KV heads and MLP widths, the proportional rope as a
    `rope_freqs` tensor) reads as the same model."""
    hf, path, vocab = gemma4_spm
    reader = GGUFCheckpoint(tiny_source(path, "gguf"))
    cfg = reader.model_config
    assert (cfg.global_head_dim, cfg.head_dim, cfg.rope_proportion, cfg.num_kv_shared_layers, cfg.double_wide_mlp,
            cfg.attention_k_eq_v, cfg.hidden_size_per_layer_input, cfg.layer_types) == (
        32, 16, 0.25, 2, True, True, 64, ("sliding_attention", "sliding_attention", "full_attention") * 2)
    stored = stored_view(reader, cfg)
    assert _assert_matches_hf(_load(cfg, stored.get, stored.has), hf, vocab, [46, 9, 33]) < 1e-4


@pytest.mark.slow
def test_gguf_engine_greedy_is_transformers_plain_and_speculative(gemma4_spm, tmp_path):
    hf, path, _ = gemma4_spm
    with torch.no_grad():
        want = hf.generate(torch.tensor([PROMPT]), max_new_tokens=32, do_sample=False, pad_token_id=0,
                           eos_token_id=None)[0, len(PROMPT):].tolist()
    assert_engine_greedy(tiny_source(path, "gguf"), tmp_path / "engine", PROMPT, want)


def test_refuses_what_it_does_not_build(gemma4):
    _, path = gemma4
    with pytest.raises(ConfigError, match="enable_moe_block"):
        _config(path, enable_moe_block=True, num_experts=4, top_k_experts=2, moe_intermediate_size=32)
    with pytest.raises(ConfigError, match="different head shapes"):
        _config(path, per_layer_config={"2": {"head_dim": 32}, "5": {"head_dim": 64}})


@pytest.mark.slow
def test_engine_greedy_is_transformers_plain_and_speculative(gemma4, tmp_path):
    """build-engine (float32) → LLM: greedy tokens equal `transformers.generate`, plain and with NGram / Suffix."""
    hf, path = gemma4
    with torch.no_grad():
        want = hf.generate(torch.tensor([PROMPT]), max_new_tokens=32, do_sample=False, pad_token_id=0,
                           eos_token_id=None)[0, len(PROMPT):].tolist()
    assert_engine_greedy(path, tmp_path / "engine", PROMPT, want)


@pytest.mark.slow
@pytest.mark.parametrize("fmt,drafter", [("W4A16", "NGram"), ("W4A8", "NGram")])
def test_outputs_do_not_depend_on_the_batch(gemma4, tmp_path, fmt, drafter):
    """W4A16 / W4A8 engines: batch 12 = staggered = alone, token for token, with NGram drafts (lossless); every
    layer attends on nextn's paged-attention kernel (the sliding layers' cache rows a row-strided view)."""
    llm = assert_batch_invariant_engine(gemma4[1], tmp_path, fmt, drafter)
    assert all(layer.self_attn.paged_attention_kernel for layer in llm.engine.model.model.layers)
    llm.shutdown()


@pytest.mark.slow
def test_released_vision_language_checkpoint_builds_its_text_model(tokenizer_dir, tmp_path):
    """Gemma 4 ships as `Gemma4ForConditionalGeneration`: the text model under `model.language_model.`, the vision
    tower beside it (left out: nextn decodes text); its greedy text equals transformers' generate of the whole
    model."""
    hf = save_tiny_gemma4_vl(tmp_path / "hf", tokenizer_dir)
    assert_text_model_greedy(hf, tmp_path / "hf", tmp_path / "engine", PROMPT, "Gemma4ForCausalLM")


def test_a_decode_step_reads_one_row_of_the_per_layer_embedding(gemma4, tmp_path):
    """The bandwidth floor (`nextn-bench`'s "MB/step") counts one gathered row of the per-layer-input table, not the
    table (49,152 × 6 · 64 f32 here: 75 MB; Gemma-4-E2B's is 4.7 GB in bf16)."""
    from nextn.bench.bandwidth import decode_step_bytes
    from nextn.build.engine_builder import build_engine

    _, path = gemma4
    build_engine(path, tmp_path / "engine", dtype="float32", quant_algo=None, max_seq_len=64, progress=False)
    step, total = decode_step_bytes(tmp_path / "engine")
    table, row = 49152 * 6 * 64 * 4, 6 * 64 * 4  # and of the main embedding (the lm_head is its own here)
    embed, embed_row = 49152 * 64 * 4, 64 * 4
    assert step == total - table + row - embed + embed_row
