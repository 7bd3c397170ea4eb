"""The tiny DeepSeek-V3 fixture: HF loads it, both config spellings, shards, MTP layers, FP8, tokenizer, distillation."""

from __future__ import annotations

import filecmp
import json
import math
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from nextn.train.mtp_distill import distill_mtp
from nextn.train.tiny_checkpoint import (
    FP8_WEIGHT,
    INDEX_FILE,
    MTP_SHARD,
    TOKENIZER_SIZE,
    TinyDeepseekSpec,
    dequantize_fp8_block,
    make_tiny_checkpoint,
    quantize_fp8_block,
    quiet_transformers,
)

SPEC = TinyDeepseekSpec()


@pytest.fixture(scope="module")
def default_ckpt(tmp_path_factory) -> Path:
    return make_tiny_checkpoint(tmp_path_factory.mktemp("default"), SPEC)


@pytest.fixture(scope="module")
def deepseek_ckpt(tmp_path_factory) -> Path:
    spec = TinyDeepseekSpec(config_spelling="deepseek", shards=3, num_mtp_modules=3, with_tokenizer=False)
    return make_tiny_checkpoint(tmp_path_factory.mktemp("deepseek"), spec)


@pytest.fixture(scope="module")
def fp8_ckpt(tmp_path_factory) -> Path:
    return make_tiny_checkpoint(tmp_path_factory.mktemp("fp8"), TinyDeepseekSpec(fp8=True, with_tokenizer=False))


def all_tensors(ckpt: Path) -> dict[str, torch.Tensor]:
    out = {}
    for file in sorted(ckpt.glob("*.safetensors")):
        out.update(load_file(file))
    return out


def hf_logits(ckpt: Path, ids: torch.Tensor) -> torch.Tensor:
    from transformers import DeepseekV3ForCausalLM

    with quiet_transformers():
        model = DeepseekV3ForCausalLM.from_pretrained(ckpt).eval()
    with torch.no_grad():
        return model(ids).logits


def test_hf_loads_both_spellings_to_the_same_model(default_ckpt, deepseek_ckpt):
    ids = torch.tensor([[0, 19923, 2058, 3, 223, 30594, 303]])
    logits = hf_logits(default_ckpt, ids)
    assert logits.shape == (1, ids.shape[1], SPEC.vocab_size)
    assert torch.isfinite(logits).all()
    assert logits[..., TOKENIZER_SIZE:].abs().max() == 0  # padding ids can never win greedy decoding
    torch.testing.assert_close(hf_logits(deepseek_ckpt, ids), logits, rtol=0, atol=0)


def test_config_spellings(default_ckpt, deepseek_ckpt):
    hf = json.loads((default_ckpt / "config.json").read_text())
    assert hf["rope_parameters"] == {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "beta_fast": 32.0,
                                     "beta_slow": 1.0, "mscale": 1.0, "mscale_all_dim": 1.0,
                                     "original_max_position_embeddings": 512}
    assert hf["dtype"] == "float32" and "rope_scaling" not in hf and "torch_dtype" not in hf
    assert hf["num_nextn_predict_layers"] == 1 and "quantization_config" not in hf
    ds = json.loads((deepseek_ckpt / "config.json").read_text())
    assert ds["rope_scaling"] == {"type": "yarn", "factor": 4.0, "beta_fast": 32.0, "beta_slow": 1.0, "mscale": 1.0,
                                  "mscale_all_dim": 1.0, "original_max_position_embeddings": 512}
    assert ds["rope_theta"] == 10000.0 and ds["torch_dtype"] == "float32"
    assert "rope_parameters" not in ds and "dtype" not in ds
    assert ds["num_nextn_predict_layers"] == 3 and ds["topk_method"] == "noaux_tc"
    for cfg in (hf, ds):
        assert (cfg["bos_token_id"], cfg["eos_token_id"], cfg["vocab_size"]) == (0, 1, 129280)


@pytest.mark.parametrize("name", ["default_ckpt", "deepseek_ckpt", "fp8_ckpt"])
def test_index_covers_every_tensor(name, request):
    ckpt = request.getfixturevalue(name)
    index = json.loads((ckpt / INDEX_FILE).read_text())
    stored = {}
    for file in ckpt.glob("*.safetensors"):
        stored.update({k: (file.name, v) for k, v in load_file(file).items()})
    assert index["weight_map"] == {k: file for k, (file, _) in stored.items()}
    assert index["metadata"]["total_size"] == sum(v.numel() * v.element_size() for _, v in stored.values())
    expected_files = 4 if name == "deepseek_ckpt" else 2
    assert len(set(index["weight_map"].values())) == expected_files


def mtp_shapes(spec: TinyDeepseekSpec) -> dict[str, tuple[int, ...]]:
    h, v, heads = spec.hidden_size, spec.vocab_size, spec.num_attention_heads
    qk = spec.qk_nope_head_dim + spec.qk_rope_head_dim
    shapes = {
        "embed_tokens.weight": (v, h), "shared_head.head.weight": (v, h), "shared_head.norm.weight": (h,),
        "enorm.weight": (h,), "hnorm.weight": (h,), "eh_proj.weight": (h, 2 * h),
        "input_layernorm.weight": (h,), "post_attention_layernorm.weight": (h,),
        "self_attn.q_a_proj.weight": (spec.q_lora_rank, h), "self_attn.q_a_layernorm.weight": (spec.q_lora_rank,),
        "self_attn.q_b_proj.weight": (heads * qk, spec.q_lora_rank),
        "self_attn.kv_a_proj_with_mqa.weight": (spec.kv_lora_rank + spec.qk_rope_head_dim, h),
        "self_attn.kv_a_layernorm.weight": (spec.kv_lora_rank,),
        "self_attn.kv_b_proj.weight": (heads * (spec.qk_nope_head_dim + spec.v_head_dim), spec.kv_lora_rank),
        "self_attn.o_proj.weight": (h, heads * spec.v_head_dim),
        "mlp.gate.weight": (spec.n_routed_experts, h), "mlp.gate.e_score_correction_bias": (spec.n_routed_experts,),
    }
    shared = spec.moe_intermediate_size * spec.n_shared_experts
    for prefix, width in [(f"mlp.experts.{e}.", spec.moe_intermediate_size) for e in range(spec.n_routed_experts)] + [
            ("mlp.shared_experts.", shared)]:
        shapes.update({prefix + "gate_proj.weight": (width, h), prefix + "up_proj.weight": (width, h),
                       prefix + "down_proj.weight": (h, width)})
    return shapes


@pytest.mark.parametrize("name, num_modules", [("default_ckpt", 1), ("deepseek_ckpt", 3)])
def test_mtp_layers(name, num_modules, request):
    ckpt = request.getfixturevalue(name)
    tensors = all_tensors(ckpt)
    mtp_file = load_file(ckpt / MTP_SHARD)
    n = SPEC.num_hidden_layers
    assert not any(k.startswith(f"model.layers.{n + num_modules}.") for k in tensors)
    for i in range(num_modules):
        prefix = f"model.layers.{n + i}."
        layer = {k[len(prefix):]: v for k, v in tensors.items() if k.startswith(prefix)}
        assert {k: tuple(v.shape) for k, v in layer.items()} == mtp_shapes(SPEC)
        assert all(prefix + k in mtp_file for k in layer)
        assert torch.equal(layer["embed_tokens.weight"], tensors["model.embed_tokens.weight"])
        assert torch.equal(layer["shared_head.head.weight"], tensors["lm_head.weight"])
        assert layer["mlp.gate.e_score_correction_bias"].dtype == torch.float32
        assert layer["mlp.gate.e_score_correction_bias"].abs().min() > 0
    assert tensors["model.layers.1.mlp.gate.e_score_correction_bias"].abs().min() > 0  # main model too
    eh_proj = [tensors[f"model.layers.{n + i}.eh_proj.weight"] for i in range(num_modules)]
    assert all(not torch.equal(a, b) for a, b in zip(eh_proj, eh_proj[1:]))  # each module seeded on its own


def test_fp8_block_quantization_round_trip():
    w = torch.randn(300, 130, generator=torch.Generator().manual_seed(0))
    w[:128, :128] = 0.0  # an all-zero block keeps a finite scale
    q, scale_inv = quantize_fp8_block(w)
    assert q.dtype == torch.float8_e4m3fn and q.shape == w.shape
    assert scale_inv.dtype == torch.float32 and scale_inv.shape == (3, 2)
    deq = dequantize_fp8_block(q, scale_inv)
    assert deq[:128, :128].abs().max() == 0
    block_scale = scale_inv.repeat_interleave(128, 0).repeat_interleave(128, 1)[:300, :130]
    assert ((deq - w).abs() <= w.abs() * 2**-4 + block_scale * 2**-9).all()  # half an e4m3 ulp (3 mantissa bits)


def test_fp8_checkpoint_dequantizes_to_the_fp32_one(fp8_ckpt, default_ckpt):
    cfg = json.loads((fp8_ckpt / "config.json").read_text())
    assert cfg["quantization_config"] == {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                                          "weight_block_size": [128, 128]}
    fp8, ref = all_tensors(fp8_ckpt), all_tensors(default_ckpt)
    assert set(fp8) == set(ref) | {k + "_scale_inv" for k in ref if FP8_WEIGHT.search(k)}
    quantized = 0
    for name, w in ref.items():
        if not FP8_WEIGHT.search(name):
            assert torch.equal(fp8[name], w), name  # norms, router, embeddings, heads, eh_proj stay as they were
            continue
        q, scale_inv = fp8[name], fp8[name + "_scale_inv"]
        assert q.dtype == torch.float8_e4m3fn and scale_inv.dtype == torch.float32
        assert scale_inv.shape == (math.ceil(w.shape[0] / 128), math.ceil(w.shape[1] / 128))
        torch.testing.assert_close(dequantize_fp8_block(q, scale_inv), w, rtol=2**-4, atol=scale_inv.max().item() * 2**-9)
        quantized += 1
    assert quantized > 0
    assert "model.layers.3.eh_proj.weight_scale_inv" not in fp8 and "model.layers.1.mlp.gate.weight_scale_inv" not in fp8


def test_tokenizer_round_trip(default_ckpt):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(default_ckpt)
    assert (tok.bos_token, tok.bos_token_id) == ("<｜begin▁of▁sentence｜>", 0)
    assert (tok.eos_token, tok.eos_token_id) == ("<｜end▁of▁sentence｜>", 1)
    text = "Multi-token prediction drafts 3 tokens per step; 你好!"
    ids = tok(text)["input_ids"]
    assert 0 < len(ids) < len(text) and max(ids) < TOKENIZER_SIZE
    assert tok.decode(ids) == text


def test_same_spec_gives_identical_files(default_ckpt, tmp_path):
    again = make_tiny_checkpoint(tmp_path, SPEC)
    for file in ["config.json", INDEX_FILE, *(p.name for p in default_ckpt.glob("*.safetensors"))]:
        assert filecmp.cmp(default_ckpt / file, again / file, shallow=False), file


def test_without_mtp_there_is_one_file_and_nothing_to_distill(tmp_path):
    ckpt = make_tiny_checkpoint(tmp_path, TinyDeepseekSpec(num_mtp_modules=0, with_tokenizer=False))
    assert sorted(p.name for p in ckpt.glob("*.safetensors")) == ["model.safetensors"]
    assert not (ckpt / INDEX_FILE).exists()
    assert json.loads((ckpt / "config.json").read_text())["num_nextn_predict_layers"] == 0
    with pytest.raises(ValueError, match="no MTP layers"):
        distill_mtp(ckpt, steps=1, progress=False)


def test_distill_raises_mtp_accuracy_and_writes_back(tmp_path):
    ckpt = make_tiny_checkpoint(tmp_path, TinyDeepseekSpec(num_mtp_modules=2, with_tokenizer=False))
    main_before, mtp_before = load_file(ckpt / "model.safetensors"), load_file(ckpt / MTP_SHARD)
    kwargs = dict(num_sequences=32, seq_len=24, batch=8, seed=1, progress=False)
    result = distill_mtp(ckpt, steps=60, **kwargs)
    assert result["num_modules"] == 2 and len(result["top1_after"]) == 2
    for before, after in zip(result["top1_before"], result["top1_after"]):
        assert after > before and after > 0.3
    main_after, mtp_after = load_file(ckpt / "model.safetensors"), load_file(ckpt / MTP_SHARD)
    assert main_after.keys() == main_before.keys() and all(torch.equal(main_after[k], v) for k, v in main_before.items())
    assert mtp_after.keys() == mtp_before.keys()
    assert not torch.equal(mtp_after["model.layers.3.eh_proj.weight"], mtp_before["model.layers.3.eh_proj.weight"])
    assert torch.equal(mtp_after["model.layers.4.embed_tokens.weight"], mtp_before["model.layers.4.embed_tokens.weight"])
    reread = distill_mtp(ckpt, steps=0, **kwargs)  # same data, weights as written: the accuracy reached
    assert reread["top1_before"] == result["top1_after"]
