"""gpt-oss (issue 61): attention sinks, alternating sliding-window and full layers, YaRN rope, a biased router, biased
experts with the clamped SwiGLU — a tiny random `GptOssForCausalLM` made by `transformers` at test time, read from its
HF checkpoint and from the GGUF llama.cpp's converter makes of it, decodes as `transformers` float32 does (logits over
the paged cache, and greedy tokens through the engine plain and with the NGram and Suffix drafters)."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from contextlib import contextmanager

from nextn.build.checkpoint import CheckpointReader
from nextn.build.gguf_reader import GGUFCheckpoint
from nextn.models.llama import LlamaModelConfig
from nextn.models.llama.weights import stored_view
from nextn.testing.tiny_families import save_tiny

from family_sources import assert_batch_invariant_engine, assert_engine_greedy, tiny_source
from test_llama import _assert_matches_hf, _load

PROMPT = [1] + [100 + (7 * i) % 23 for i in range(45)]  # 46 tokens, repetitive: drafts get accepted


@pytest.fixture(scope="module")
def gpt_oss(tmp_path_factory, tokenizer_dir):
    out = tmp_path_factory.mktemp("gpt_oss")
    return save_tiny("gpt_oss", out, tokenizer_dir), out


def _model(path):
    if path.suffix == ".gguf":
        reader = GGUFCheckpoint(path)
        cfg = reader.model_config
    else:
        reader = CheckpointReader(path)
        cfg = LlamaModelConfig.from_hf(json.loads((path / "config.json").read_text()))
    stored = stored_view(reader, cfg)  # HF: the router renamed, the fused experts split
    return _load(cfg, stored.get, stored.has)


@contextmanager
def _oracle(hf, kind: str):
    """The `transformers` model to compare with: a GGUF does not store the clamped SwiGLU's limit, and llama.cpp (as
    nextn reading the file) applies gpt-oss's 7 — the oracle of the tiny model's GGUF is it at limit 7."""
    limit = hf.model.layers[0].mlp.experts.limit
    if kind == "gguf":
        for layer in hf.model.layers:
            layer.mlp.experts.limit = 7.0
    try:
        yield hf
    finally:
        for layer in hf.model.layers:
            layer.mlp.experts.limit = limit


@pytest.mark.parametrize("kind", ["hf", "gguf"])
def test_logits_match_transformers(gpt_oss, kind):
    hf, path = gpt_oss
    model = _model(tiny_source(path, kind))
    cfg = model.cfg
    assert (cfg.attn_sinks, cfg.router_bias, cfg.expert_act, cfg.layer_types, cfg.sliding_window,
            cfg.rope_scaling.rope_type, cfg.rope_scaling.truncate, cfg.swiglu_limit, cfg.num_experts,
            cfg.num_experts_per_tok, cfg.norm_topk_prob) == (
        True, True, "clamped_swiglu", ("sliding_attention", "full_attention"), 16, "yarn", False,
        1.0 if kind == "hf" else 7.0, 8, 2, True)
    with _oracle(hf, kind) as oracle:
        assert _assert_matches_hf(model, oracle, 4000, [70, 9, 33]) < 1e-4


def test_each_part_is_needed(gpt_oss):
    """The controls: without the sinks, the router bias or the clamp, the logits are no longer transformers'."""
    hf, path = gpt_oss
    for change in ("sinks", "router", "clamp"):
        model = _model(path)
        for layer in model.model.layers:
            if change == "sinks":
                layer.self_attn.sinks = None
            elif change == "router":
                layer.mlp.gate.bias = None
            else:
                for expert in layer.mlp.experts:
                    expert.limit = 1e9
        with pytest.raises(AssertionError):
            _assert_matches_hf(model, hf, 4000, [40])


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["hf", "gguf"])
def test_engine_greedy_is_transformers_plain_and_speculative(gpt_oss, kind, tmp_path):
    """build-engine (float32) → LLM: greedy tokens equal `transformers.generate`, plain and with NGram / Suffix."""
    hf, path = gpt_oss
    with torch.no_grad(), _oracle(hf, kind) as oracle:
        want = oracle.generate(torch.tensor([PROMPT]), max_new_tokens=32, do_sample=False, pad_token_id=0,
                               eos_token_id=None)[0, len(PROMPT):].tolist()
    assert_engine_greedy(tiny_source(path, kind), tmp_path / "engine", PROMPT, want)


@pytest.mark.slow
@pytest.mark.parametrize("fmt,drafter", [("W4A16", "none"), ("W4A16", "NGram"), ("W4A8", "NGram")])
def test_outputs_do_not_depend_on_the_batch(gpt_oss, tmp_path, fmt, drafter):
    """W4A16 / W4A8 engines: batch 12 = staggered = alone, token for token, plain and with NGram drafts (lossless);
    the attention — sinks included — runs in nextn's fused layer op, the experts on its int4 kernels."""
    llm = assert_batch_invariant_engine(gpt_oss[1], tmp_path, fmt, drafter)
    layers = llm.engine.model.model.layers
    assert all(layer.fused is not None and layer.fused.attn_sinks is not None for layer in layers)
    llm.shutdown()


def _mxfp4_experts(src, dst):
    """`src` (a GGUF) rewritten with its experts' weights in MXFP4, as the released gpt-oss GGUFs store them (gguf's
    own quantizer); returns {llama.cpp name: the dequantized values [E, out, in] f32}."""
    import gguf

    reader = gguf.GGUFReader(src)
    arch = reader.fields["general.architecture"].contents()
    writer = gguf.GGUFWriter(dst, arch)
    for field in reader.fields.values():
        if field.name == "general.architecture" or field.name.startswith("GGUF."):
            continue
        vtype = field.types[0]
        writer.add_key_value(field.name, field.contents(), vtype,
                             sub_type=field.types[-1] if vtype == gguf.GGUFValueType.ARRAY else None)
    values = {}
    for t in reader.tensors:
        data = np.asarray(t.data)
        if t.name.endswith("_exps.weight"):
            q = gguf.quants.quantize(data.astype(np.float32), gguf.GGMLQuantizationType.MXFP4)
            values[t.name] = gguf.quants.dequantize(q, gguf.GGMLQuantizationType.MXFP4)
            writer.add_tensor(t.name, q, raw_dtype=gguf.GGMLQuantizationType.MXFP4)
        else:
            writer.add_tensor(t.name, data)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return values


def test_mxfp4_experts_read_as_their_values(gpt_oss, tmp_path):
    """A GGUF whose experts are MXFP4 (the released files' format): nextn reads each expert's slice of the 4-bit
    blocks as `gguf` dequantizes them — logits equal `transformers` holding those same expert values."""
    from nextn.build.engine_settings import auto_quant_algo
    from nextn.plugins import woq_linear

    hf, path = gpt_oss
    values = _mxfp4_experts(tiny_source(path, "gguf"), tmp_path / "mxfp4.gguf")
    reader = GGUFCheckpoint(tmp_path / "mxfp4.gguf")
    assert reader.four_bit_share > 0.5  # the experts: a 4-bit file, built into nextn's int4 by default
    if woq_linear.available():
        assert auto_quant_algo(reader, "cpu") == woq_linear.fastest_int4_algo()
    model = _model(tmp_path / "mxfp4.gguf")
    with _oracle(hf, "gguf") as oracle:
        saved = {n: p.detach().clone() for n, p in oracle.named_parameters() if ".experts." in n}
        try:
            with torch.no_grad():
                for i, layer in enumerate(oracle.model.layers):
                    gate, up, down = (torch.from_numpy(values[f"blk.{i}.ffn_{p}_exps.weight"]).float()
                                      for p in ("gate", "up", "down"))
                    layer.mlp.experts.gate_up_proj[:, :, 0::2] = gate.transpose(1, 2)
                    layer.mlp.experts.gate_up_proj[:, :, 1::2] = up.transpose(1, 2)
                    layer.mlp.experts.down_proj.copy_(down.transpose(1, 2))
            assert not torch.equal(saved["model.layers.0.mlp.experts.down_proj"],
                                   oracle.model.layers[0].mlp.experts.down_proj)  # MXFP4 moved the values
            assert _assert_matches_hf(model, oracle, 4000, [40, 9]) < 1e-4
        finally:
            with torch.no_grad():
                for n, p in oracle.named_parameters():
                    if n in saved:
                        p.copy_(saved[n])


_E2M1 = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0])


def _to_mxfp4(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """HF's [E, in, out] expert weights as gpt-oss's release stores them: [E, out, in / 32, 16] uint8 codes (two
    per byte, even column low) and [E, out, in / 32] E8M0 scales — the OCP MX rounding (a block's power of two is
    floor(log2 amax) − 2, codes round to nearest), written here independently of nextn."""
    g = w.transpose(1, 2).float().reshape(*w.shape[:1], w.shape[2], w.shape[1] // 32, 32)
    exp = torch.floor(torch.log2(g.abs().amax(-1).clamp_min(2.0 ** -100))) - 2
    x = g / torch.exp2(exp)[..., None]
    code = (x.abs()[..., None] - _E2M1).abs().argmin(-1) + 8 * (x < 0)
    return (code[..., 0::2] | (code[..., 1::2] << 4)).to(torch.uint8), (exp + 127).to(torch.uint8)


@pytest.fixture(scope="module")
def gpt_oss_mxfp4(gpt_oss, tmp_path_factory):
    """The tiny checkpoint as gpt-oss's HF release stores it (experts MXFP4, `quant_method: mxfp4`), and
    `transformers`' model of that directory (it dequantizes the experts itself on a CPU)."""
    import shutil

    from safetensors.torch import load_file, save_file
    from transformers import AutoModelForCausalLM

    _, src = gpt_oss
    out = tmp_path_factory.mktemp("gpt_oss_mxfp4")
    for f in src.iterdir():
        if f.is_file() and f.suffix != ".gguf":
            shutil.copy(f, out / f.name)
    tensors = {}
    for name, t in load_file(src / "model.safetensors").items():
        if name.endswith(("experts.gate_up_proj", "experts.down_proj")):
            tensors[name + "_blocks"], tensors[name + "_scales"] = _to_mxfp4(t)
        else:
            tensors[name] = t
    save_file(tensors, out / "model.safetensors", metadata={"format": "pt"})
    config = json.loads((out / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "mxfp4", "modules_to_not_convert": [
        "model.layers.*.self_attn", "model.layers.*.mlp.router", "model.embed_tokens", "lm_head"]}
    (out / "config.json").write_text(json.dumps(config))
    return AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval(), out


def test_hf_mxfp4_checkpoint_reads_as_transformers_dequantizes_it(gpt_oss, gpt_oss_mxfp4):
    """gpt-oss's HF release format: each expert's MXFP4 blocks read alone (`get(name, expert)`), logits equal
    `transformers` loading the same directory; the values are MXFP4's, not the unquantized checkpoint's."""
    from nextn.build.engine_settings import auto_quant_algo
    from nextn.plugins import woq_linear

    hf, _ = gpt_oss
    oracle, path = gpt_oss_mxfp4
    reader = CheckpointReader(path)
    name = "model.layers.1.mlp.experts.gate_up_proj"
    assert name in reader.names() and not any(n.endswith(("_blocks", "_scales")) for n in reader.names())
    assert reader.tensor_info(name) == ("F32", [8, 64, 128]) and reader.is_quantized
    assert torch.equal(reader.get(name, 5), oracle.model.layers[1].mlp.experts.gate_up_proj[5])
    assert not torch.equal(reader.get(name), hf.model.layers[1].mlp.experts.gate_up_proj)  # MXFP4 moved them
    assert reader.four_bit_share > 0.5  # the experts: built into nextn's int4 by default, as the MXFP4 GGUF is
    if woq_linear.available():
        assert auto_quant_algo(reader, "cpu") == woq_linear.fastest_int4_algo()
    assert _assert_matches_hf(_model(path), oracle, 4000, [40, 9]) < 1e-4


@pytest.mark.slow
def test_engine_from_hf_mxfp4_is_transformers_greedy(gpt_oss_mxfp4, tmp_path):
    """build-engine (float32) from the MXFP4 checkpoint → LLM: greedy tokens equal `transformers.generate` on it."""
    oracle, path = gpt_oss_mxfp4
    with torch.no_grad():
        want = oracle.generate(torch.tensor([PROMPT]), max_new_tokens=32, do_sample=False, pad_token_id=0,
                               eos_token_id=None)[0, len(PROMPT):].tolist()
    assert_engine_greedy(path, tmp_path / "engine", PROMPT, want)
