"""The MoE block op (`moe_cpu.cpp`'s `moe_block`: norm, router, routed and shared experts, residual in one call) on
the routers and shared experts beyond Qwen3-MoE's, every ISA variant the CPU runs: GLM-4.5's sigmoid routing with
expert groups, a correction bias, a routed scaling factor and a shared expert (the Llama-family layer), GLM-4.7-Flash's
(DeepSeek-V3's layer, MLA beside it, its `kv_b_proj` read in int8) and Qwen2-MoE's sigmoid-gated shared expert —
against the PyTorch modules, rows computed as if alone, controls that the groups and the shared expert change the
result, and engines that use them staying lossless under speculation."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from nextn import LLM, SamplingParams
from nextn.build.engine_builder import build_engine
from nextn.models.moe import SparseMoE
from nextn.plugins import cpu_kernels
from nextn.plugins.moe_experts import block_forward
from nextn.testing.tiny_families import tiny_hf_model

from test_moe_experts import assert_block_is_the_modules

pytestmark = [pytest.mark.skipif(not cpu_kernels.available(),
                                 reason=f"nextn's CPU kernels unavailable: {cpu_kernels.unavailable_reason()}"),
              pytest.mark.usefixtures("kernel_variant")]

#: (family, format, overrides): hidden 128 and widths of 64 (the int4 op's multiples)
CASES = {
    "glm4_moe-W4A16": ("glm4_moe", "W4A16", dict(hidden_size=128, head_dim=32, n_group=4, topk_group=2)),
    "glm4_moe_lite-W4A8": ("glm4_moe_lite", "W4A8", dict(hidden_size=128, q_lora_rank=64)),
    "qwen2_moe-W4A16": ("qwen2_moe", "W4A16", dict(hidden_size=128, head_dim=32)),
}


@pytest.fixture(scope="module", params=list(CASES))
def llm(request, tmp_path_factory):
    family, fmt, overrides = CASES[request.param]
    root = tmp_path_factory.mktemp(request.param)
    tiny_hf_model(family, seed=3, **overrides).save_pretrained(root / "ckpt")
    build_engine(root / "ckpt", root / "engine", progress=False, max_seq_len=128, dtype="bfloat16",
                 quant_algo=fmt, group_size=32)
    llm = LLM(root / "engine")
    yield llm
    llm.shutdown()


def _moe_layers(llm):
    return [layer for layer in llm.engine.model.model.layers if isinstance(layer.mlp, SparseMoE)]


def _x(n: int, seed: int) -> torch.Tensor:
    return torch.randn(n, 128, generator=torch.Generator().manual_seed(seed)).bfloat16() * 2


def test_every_moe_layer_takes_the_block_op(llm):
    """Each MoE layer runs its MLP half as the op, its shared expert fused beside the routed ones (views of the
    modules' buffers); the stack op, which has only the softmax router and no shared expert, is not used."""
    layers = _moe_layers(llm)
    assert layers
    for layer in layers:
        fused = layer.mlp.fused_experts
        assert layer.moe_block and fused is not None and fused.shared_gate_up and fused.shared_down
        shared = layer.mlp.shared_experts or layer.mlp.shared_expert
        assert shared.up_proj.qweight.untyped_storage().data_ptr() == fused.shared_gate_up[0].untyped_storage().data_ptr()
    stack = getattr(llm.engine.model, "fused_stack", None)
    assert stack is None or stack.moe is None


@pytest.mark.parametrize("n", [1, 7])
def test_block_op_is_the_modules_mlp_half(llm, n):
    """x + moe(norm(x)) in one op: within a bf16 step of the modules' output, most elements bit-equal (the router's
    sums and sigmoid are computed in another order / precision: a last-bit difference at most)."""
    for layer in _moe_layers(llm):
        assert_block_is_the_modules(layer, _x(n, 5))


def test_block_op_rows_are_computed_as_if_alone(llm):
    """Batch invariance of the sigmoid routing, groups and shared expert in C++: each row equals itself alone."""
    layer = _moe_layers(llm)[0]
    x = _x(12, 6)
    with torch.inference_mode():
        full = block_forward(layer.mlp, layer.post_attention_layernorm, x)
        for i in range(12):
            assert torch.equal(block_forward(layer.mlp, layer.post_attention_layernorm, x[i:i + 1])[0], full[i]), i


def test_shared_expert_and_groups_count(llm):
    """Controls: the op without its shared expert, and (with expert groups) without the group limit, is far from the
    modules' output — each part of the block changes the result."""
    layer = _moe_layers(llm)[0]
    moe, norm = layer.mlp, layer.post_attention_layernorm
    x = _x(16, 7)
    fused = moe.fused_experts
    with torch.inference_mode():
        want = x + moe(norm(x))
        shared_gate = getattr(moe, "shared_expert_gate", None)  # Qwen2-MoE's: it scales the shared expert only
        try:
            moe.fused_experts = dataclasses.replace(fused, shared_gate_up=[], shared_down=[])
            moe.shared_expert_gate = None
            no_shared = block_forward(moe, norm, x)
        finally:
            moe.fused_experts, moe.shared_expert_gate = fused, shared_gate
        assert (no_shared.float() - want.float()).abs().max() > 0.1
        if getattr(moe.gate, "n_group", 1) > 1:
            groups = moe.gate.n_group, moe.gate.topk_group
            try:
                moe.gate.n_group = moe.gate.topk_group = 1
                ungrouped = block_forward(moe, norm, x)
            finally:
                moe.gate.n_group, moe.gate.topk_group = groups
            assert (ungrouped.float() - want.float()).abs().max() > 0.1


def test_deepseek_layers_read_kv_b_in_int8(llm):
    """A weight-quantized DeepSeek-layer engine (GLM-4.7-Flash's) reads MLA's kv_b_proj as int8 with row scales."""
    attn = [layer.self_attn for layer in llm.engine.model.model.layers if hasattr(layer.self_attn, "kv_b_proj")]
    for module in attn:
        q8, scale = module.kv_b_int8
        assert module.mla_kernel and q8.dtype == torch.int8 and scale.dtype == torch.float32
        w = module.kv_b_proj.weight.float().view(q8.shape)
        assert ((q8.float() * scale[..., None] - w).abs() <= scale[..., None] / 2 + 1e-3 * w.abs()).all()


def test_speculation_stays_lossless(llm):
    """NGram drafting over the block op (and int8 kv_b): the same tokens as plain decoding, at batch 1 and 3."""
    prompts = [[5, 9, 14, 9, 14, 9, 14, 30], [7, 7, 21, 40, 7, 21], [3, 200, 3, 200, 3]]
    params = SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True)
    plain = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
    spec = LLM(llm.engine_dir, speculative_config={"decoding_type": "NGram", "max_draft_len": 3})
    try:
        assert [o.outputs[0].token_ids for o in spec.generate(prompts, params)] == plain
        assert spec.generate([prompts[0]], params)[0].outputs[0].token_ids == plain[0]
    finally:
        spec.shutdown()
