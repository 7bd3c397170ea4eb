"""nextn's CPU kernels on an MoE layer (W4A16 / W4A8, every ISA variant the CPU runs): the routed experts as one op
(`moe_cpu.cpp`) against the expert modules, rows computed as if alone, the attention half of the layer on the fused
decoder-layer op, and an engine using both staying lossless under speculation."""

from __future__ import annotations

import dataclasses
import sys
from pathlib import Path
from unittest import mock

import pytest
import torch

from nextn import LLM, SamplingParams
from nextn.build.engine_builder import build_engine
from nextn.models.moe import routed_experts
from nextn.plugins import cpu_kernels
from nextn.plugins.decoder_layer import fuse_stack, fused_forward, stack_forward
from nextn.plugins.moe_experts import block_forward, experts_forward
from nextn.quantization import kernel_layout
from nextn.testing.tiny_families import tiny_hf_model

from test_decoder_layer import _inputs

pytestmark = [pytest.mark.skipif(not cpu_kernels.available(),
                                 reason=f"nextn's CPU kernels unavailable: {cpu_kernels.unavailable_reason()}"),
              pytest.mark.usefixtures("kernel_variant")]


@pytest.fixture(scope="module", params=["W4A16", "W4A8"])
def llm(request, tmp_path_factory):
    """A tiny Qwen3-MoE engine (hidden 128, 8 experts of width 64, top-3, head_dim 32) in W4A16 or W4A8."""
    root = tmp_path_factory.mktemp(request.param)
    tiny_hf_model("qwen3_moe", seed=1, vocab_size=320, hidden_size=128, head_dim=32).save_pretrained(root / "ckpt")
    build_engine(root / "ckpt", root / "engine", progress=False, max_seq_len=128, dtype="bfloat16",
                 quant_algo=request.param, group_size=32)
    llm = LLM(root / "engine")
    yield llm
    llm.shutdown()


def _routing(moe, n: int, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 128, generator=gen).bfloat16()
    weights, ids = moe.gate(x)
    return x, weights, ids


def test_every_moe_layer_takes_both_ops(llm):
    model = llm.engine.model
    for layer in model.model.layers:
        assert layer.fused is not None and layer.fused.attention_only
        assert layer.mlp.fused_experts is not None and layer.moe_block
    assert model.fused_stack is not None and model.fused_stack.moe is not None  # all layers in one op call
    expert = model.model.layers[0].mlp.experts[2]  # the modules' buffers are views of the op's operands
    fused = model.model.layers[0].mlp.fused_experts
    assert expert.up_proj.qweight.untyped_storage().data_ptr() == fused.gate_up[0].untyped_storage().data_ptr()
    assert expert.down_proj.qweight.untyped_storage().data_ptr() == fused.down[0].untyped_storage().data_ptr()


def _file_mappings(path: str) -> list[tuple[int, int]]:
    """[start, end) of this process's mappings of the file `path` (`/proc/self/maps`)."""
    spans = []
    for line in open("/proc/self/maps"):
        fields = line.split(maxsplit=5)
        if len(fields) == 6 and fields[5].strip() == path:
            lo, hi = fields[0].split("-")
            spans.append((int(lo, 16), int(hi, 16)))
    return spans


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc/self/maps")
def test_the_experts_are_read_in_place_from_the_engine_file(llm):
    """The op's stacked operands are views of the engine file's mapping — page-cache pages, shared by every process
    that loads the engine — not copies: the engine stores the experts in the kernel's layout, side by side as the op
    stacks them (`quantization/kernel_layout.py`), and the mapping's data section starts 64-byte aligned."""
    spans = _file_mappings(str((Path(llm.engine_dir) / "model.safetensors").resolve()))
    assert spans
    for layer in llm.engine.model.model.layers:
        fused = layer.mlp.fused_experts
        for t in fused.gate_up + fused.down:
            start, end = t.data_ptr(), t.data_ptr() + t.numel() * t.element_size()
            assert any(lo <= start and end <= hi for lo, hi in spans), tuple(t.shape)
        assert fused.gate_up[0].data_ptr() % 64 == 0 and fused.down[0].data_ptr() % 64 == 0  # for vector loads


@pytest.mark.parametrize("n", [1, 5, 12])
def test_experts_op_matches_the_modules(llm, n):
    """Same bf16 roundings as the modules (SiLU's exp in f32 against the module's f64: a last-bit difference)."""
    moe = llm.engine.model.model.layers[1].mlp
    x, weights, ids = _routing(moe, n)
    with torch.inference_mode():
        fused = experts_forward(moe.fused_experts, x, weights, ids)
        ref = routed_experts(x, weights, ids, moe.experts.__getitem__, len(moe.experts))
    assert fused.dtype == torch.bfloat16 and fused.shape == ref.shape
    assert (fused == ref).float().mean() > 0.9
    torch.testing.assert_close(fused.float(), ref.float(), rtol=2e-2, atol=2e-2)


def test_experts_op_rows_are_computed_as_if_alone(llm):
    """Batch invariance, bit for bit: a token's row is the same among 0..11 others (more experts, more rows each)."""
    moe = llm.engine.model.model.layers[0].mlp
    x, weights, ids = _routing(moe, 12, seed=3)
    with torch.inference_mode():
        full = experts_forward(moe.fused_experts, x, weights, ids)
        for n in (1, 2, 5, 9):
            assert torch.equal(experts_forward(moe.fused_experts, x[:n], weights[:n], ids[:n]), full[:n]), n
        for i in range(12):
            assert torch.equal(experts_forward(moe.fused_experts, x[i:i + 1], weights[i:i + 1], ids[i:i + 1])[0],
                               full[i])


@pytest.mark.parametrize("n", [1, 7])
def test_block_op_is_the_modules_mlp_half(llm, n):
    """x + moe(norm(x)) in one op: within a bf16 step of the modules' output, most elements bit-equal (the router's
    logits are summed in another order than the dense kernel's: a last-bit difference at most)."""
    layer = llm.engine.model.model.layers[1]
    assert_block_is_the_modules(layer, torch.randn(n, 128, generator=torch.Generator().manual_seed(5)).bfloat16())


def assert_block_is_the_modules(layer, x: torch.Tensor) -> None:
    """`block_forward` of the layer's MLP half on x: within a bf16 step of x + mlp(norm(x)) by the modules, > 90 %
    of the elements bit-equal."""
    moe, norm = layer.mlp, layer.post_attention_layernorm
    with torch.inference_mode():
        got = block_forward(moe, norm, x)
        want = x + moe(norm(x))
    assert got.dtype == torch.bfloat16 and got.shape == x.shape
    assert (got == want).float().mean() > 0.9
    torch.testing.assert_close(got.float(), want.float(), rtol=3e-2, atol=3e-2)


def test_block_op_rows_are_computed_as_if_alone(llm):
    """Batch invariance of the norm, router and top-k in C++: each row equals itself alone, bit for bit."""
    layer = llm.engine.model.model.layers[0]
    x = torch.randn(12, 128, generator=torch.Generator().manual_seed(6)).bfloat16()
    with torch.inference_mode():
        full = block_forward(layer.mlp, layer.post_attention_layernorm, x)
        for i in range(12):
            assert torch.equal(block_forward(layer.mlp, layer.post_attention_layernorm, x[i:i + 1])[0], full[i]), i


def test_the_stack_is_its_moe_layers_one_by_one(llm):
    """`llama_decoder_stack` with MoE layers equals each layer's two op calls in order (the attention op, then
    `moe_block`), bit for bit: the outputs and every layer's KV; a stack lacking a layer's router is refused."""
    model = llm.engine.model
    layers = list(model.model.layers)
    x, kv, meta = _inputs(layers[0], 2, 3, [7, 21], seed=5)
    kv = torch.stack([kv.roll(i, 0) for i in range(len(layers))])  # [layers, slots, kv dim], layers' caches differ
    inputs = model.attention_inputs(meta)
    kv_stack, kv_one = kv.clone(), kv.clone()
    with torch.inference_mode():
        out = stack_forward(model.fused_stack, x, inputs, kv_stack)
        ref = x
        cos_sin, layer_meta = inputs["full_attention"]
        for i, layer in enumerate(layers):
            ref = block_forward(layer.mlp, layer.post_attention_layernorm,
                                fused_forward(layer, ref, cos_sin, kv_one[i], layer_meta))
        assert torch.equal(out, ref)
        assert torch.equal(kv_stack, kv_one) and not torch.equal(kv_stack, kv)
        short = dataclasses.replace(model.fused_stack, moe=dataclasses.replace(model.fused_stack.moe,
                                                                              routers=model.fused_stack.moe.routers[1:]))
        with pytest.raises(RuntimeError, match="MoE layers need a router"):
            stack_forward(short, x, inputs, kv_stack)


def test_moe_layers_without_the_block_op_leave_no_stack(llm):
    layers = list(llm.engine.model.model.layers)
    assert fuse_stack(layers) is not None
    layers[1].moe_block = False
    try:
        assert fuse_stack(layers) is None
    finally:
        layers[1].moe_block = True


def test_experts_op_refuses_an_unknown_expert(llm):
    moe = llm.engine.model.model.layers[0].mlp
    x, weights, ids = _routing(moe, 2)
    with pytest.raises(RuntimeError, match="expert id 8 outside"):
        experts_forward(moe.fused_experts, x, weights, ids.clone().fill_(8))


def test_the_layer_matches_the_pytorch_modules(llm):
    """Attention on the op, experts on the op: the layer's output and the KV it writes as the modules compute them,
    within a bf16 step (all but a few elements bit-equal)."""
    model = llm.engine.model
    layer = model.model.layers[1]
    x, kv, meta = _inputs(layer, 2, 3, [9, 20])
    cos_sin = model._cos_sin(meta.positions)
    kv_fused, kv_ref = kv.clone(), kv.clone()
    with torch.inference_mode():
        fused = layer(x, cos_sin, kv_fused, meta)
        saved = layer.fused, layer.mlp.fused_experts
        layer.fused = layer.mlp.fused_experts = None
        try:
            ref = layer(x, cos_sin, kv_ref, meta)
        finally:
            layer.fused, layer.mlp.fused_experts = saved
    assert (fused == ref).float().mean() > 0.9
    torch.testing.assert_close(fused.float(), ref.float(), rtol=3e-2, atol=3e-2)
    torch.testing.assert_close(kv_fused.float(), kv_ref.float(), rtol=2e-2, atol=2e-2)


def test_an_engine_with_experts_stored_portably_decodes_the_same(llm, tmp_path):
    """An engine of layout 6 (the experts stored portably, as before `kernel_layout`): its experts repacked and
    stacked at load (copies, not the file's pages) into the same operands, bit for bit — the same greedy tokens."""
    ckpt = Path(llm.engine_dir).parent / "ckpt"
    algo = llm.engine.manifest.quant_config.quant_algo
    with mock.patch.object(kernel_layout, "applies", lambda *a: False):
        build_engine(ckpt, tmp_path / "engine", progress=False, max_seq_len=128, dtype="bfloat16", quant_algo=algo,
                     group_size=32)
    old = LLM(tmp_path / "engine")
    try:
        fused_new, fused_old = (m.engine.model.model.layers[0].mlp.fused_experts for m in (llm, old))
        for a, b in zip(fused_new.gate_up + fused_new.down, fused_old.gate_up + fused_old.down):
            assert torch.equal(a, b)
        spans = _file_mappings(str((tmp_path / "engine" / "model.safetensors").resolve()))
        start = fused_old.gate_up[0].data_ptr()
        assert not any(lo <= start < hi for lo, hi in spans)  # a copy
        prompt = [1] + [10 + (7 * i) % 23 for i in range(40)]
        params = SamplingParams(max_tokens=32, ignore_eos=True)
        assert old.generate(prompt, params).outputs[0].token_ids == llm.generate(prompt, params).outputs[0].token_ids
    finally:
        old.shutdown()


def test_speculation_stays_lossless(llm):
    """Greedy tokens with NGram drafts (verify steps of several rows) equal plain decoding's."""
    prompt = [1] + [10 + (7 * i) % 23 for i in range(40)]
    params = SamplingParams(max_tokens=40, ignore_eos=True)
    plain = llm.generate(prompt, params).outputs[0].token_ids
    spec = LLM(llm.engine_dir, speculative_config={"decoding_type": "NGram", "max_draft_len": 4})
    try:
        assert spec.generate(prompt, params).outputs[0].token_ids == plain
    finally:
        spec.shutdown()


def test_gpt_oss_layer_with_attention_sinks_matches_the_pytorch_modules(tmp_path):
    """gpt-oss (W4A16): the attention half — its sinks in the op's softmax — on the fused layer op, the MLP half
    (f32-scaled norm, biased router, biased clamped-SwiGLU experts) on the block op; the layer's output and KV as the
    modules compute them; the controls: without the sinks, and the experts without their clamp, the ops are far from
    the modules."""
    hf = tiny_hf_model("gpt_oss", seed=1, vocab_size=320, hidden_size=128)
    with torch.no_grad():  # sinks near 3 (e^3 ~ 20 keys' worth): the softmax leans on them
        for layer in hf.model.layers:
            layer.self_attn.sinks.add_(2.0)
    hf.save_pretrained(tmp_path / "ckpt")
    build_engine(tmp_path / "ckpt", tmp_path / "engine", progress=False, max_seq_len=128, dtype="bfloat16",
                 quant_algo="W4A16", group_size=32)
    llm = LLM(tmp_path / "engine")
    try:
        model = llm.engine.model
        for layer in model.model.layers:
            experts = layer.mlp.fused_experts
            assert layer.fused is not None and layer.fused.attn_sinks is not None and layer.moe_block
            assert experts is not None and experts.activation == 1 and experts.down_bias[0].shape[0] == 8
        for index in (0, 1):  # a sliding layer and a full one
            layer = model.model.layers[index]
            x, kv, meta = _inputs(layer, 2, 3, [9, 20])
            cos_sin = model._cos_sin(meta.positions)
            kv_fused, kv_ref = kv.clone(), kv.clone()
            saved = layer.fused, layer.mlp.fused_experts
            with torch.inference_mode():
                fused = layer(x, cos_sin, kv_fused, meta)
                try:
                    layer.fused = layer.mlp.fused_experts = None
                    ref = layer(x, cos_sin, kv_ref, meta)
                    layer.fused = dataclasses.replace(saved[0], attn_sinks=None)
                    layer.mlp.fused_experts = saved[1]
                    no_sinks = layer(x, cos_sin, kv.clone(), meta)
                    layer.fused, layer.mlp.fused_experts = saved[0], dataclasses.replace(saved[1], limit=1e9)
                    no_clamp = layer(x, cos_sin, kv.clone(), meta)
                finally:
                    layer.fused, layer.mlp.fused_experts = saved
            # the clamped SwiGLU in f32 against the module's f64 (three factors): a few more last-bit differences
            assert (fused == ref).float().mean() > 0.8
            torch.testing.assert_close(fused.float(), ref.float(), rtol=3e-2, atol=3e-2)
            torch.testing.assert_close(kv_fused.float(), kv_ref.float(), rtol=2e-2, atol=2e-2)
            assert (no_sinks.float() - ref.float()).abs().max() > 0.1
            assert (no_clamp.float() - ref.float()).abs().max() > 0.1
    finally:
        llm.shutdown()
