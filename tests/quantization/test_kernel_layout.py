"""MoE experts stored in the int4 kernel's layout (`quantization/kernel_layout.py`): which linears, the conversion
both ways, the file order the MoE op stacks, and a linear read in place equal to one repacked at load — on the
kernel, and given back portably where the kernel does not run."""

from __future__ import annotations

import pytest
import torch

from nextn.plugins import woq_linear
from nextn.quantization import QuantConfig, quantize
from nextn.quantization import kernel_layout
from nextn.quantization.linear import WeightOnlyLinear
from nextn.quantization.weight_only import quantized_specs

CONFIGS = {"W4A16": QuantConfig(quant_algo="W4A16", group_size=32),
           "W4A8": QuantConfig(quant_algo="W4A8", group_size=32),
           "W4A16-k": QuantConfig(quant_algo="W4A16", group_size=32, super_block_size=64),
           "W4A8-k": QuantConfig(quant_algo="W4A8", group_size=32, super_block_size=64)}
EXPERT = "model.layers.3.mlp.experts.7.up_proj"


@pytest.fixture()
def w() -> torch.Tensor:
    return torch.randn(96, 128, generator=torch.Generator().manual_seed(0))


def test_only_int4_experts_of_kernel_shapes_apply():
    w4, w8 = CONFIGS["W4A16"], QuantConfig(quant_algo="W8A16")
    assert kernel_layout.applies(EXPERT, (96, 128), w4)
    assert kernel_layout.applies("model.layers.0.mlp.shared_expert.down_proj", (128, 96 * 4), w4)
    assert kernel_layout.applies("model.layers.0.mlp.shared_experts.gate_proj", (96, 128), w4)
    assert not kernel_layout.applies("model.layers.0.mlp.up_proj", (96, 128), w4)  # a dense MLP
    assert not kernel_layout.applies("model.layers.0.self_attn.q_proj", (96, 128), w4)
    assert not kernel_layout.applies(EXPERT, (96, 128), w8)  # int8
    assert not kernel_layout.applies(EXPERT, (90, 128), w4)  # N % 16
    assert not kernel_layout.applies(EXPERT, (96, 96), w4)  # K % 64


@pytest.mark.parametrize("name", list(CONFIGS))
def test_specs_match_the_converted_tensors_and_the_conversion_inverts(w, name):
    cfg = CONFIGS[name]
    q = quantize(w, cfg)
    k = kernel_layout.to_kernel(q, cfg)
    specs = quantized_specs(f"{EXPERT}.weight", (96, 128), cfg)
    assert {n: (s, dt) for n, (s, dt) in specs.items()} == {
        f"{EXPERT}.{f}": (tuple(t.shape), t.dtype) for f, t in k.items()}
    back = kernel_layout.to_portable(k, cfg)
    assert set(back) == set(q) and torch.equal(back["weight"], q["weight"])
    if "weight_scale_2" in q:  # two-level scales: bytes, exactly
        for f in ("weight_scale", "weight_zero", "weight_scale_2"):
            assert back[f].dtype == q[f].dtype and torch.equal(back[f], q[f]), f
    else:  # one-level: the bf16 values the kernel reads
        assert torch.equal(back["weight_scale"], q["weight_scale"].bfloat16().float())
        zero8 = (q["weight_zero"] + 8 * q["weight_scale"]).bfloat16()
        assert torch.equal((back["weight_zero"] + 8 * back["weight_scale"]).bfloat16(), zero8)


def test_file_order_puts_each_stacked_operand_in_one_run():
    experts, fields = range(3), ("qweight", "scales", "zeros")
    names = ["model.embed_tokens.weight"]
    for layer in (0, 1):
        p = f"model.layers.{layer}.mlp."
        names += [f"model.layers.{layer}.self_attn.q_proj.weight_scale", f"{p}gate.weight"]
        names += [f"{p}experts.{e}.{proj}.{f}" for e in experts for proj in ("gate_proj", "up_proj", "down_proj")
                  for f in fields]
        names += [f"{p}shared_expert.{proj}.{f}" for proj in ("gate_proj", "up_proj", "down_proj") for f in fields]
    order = kernel_layout.file_order(names)
    assert sorted(order) == sorted(names)
    rest = [n for n in names if not n.rpartition(".")[2] in fields]
    assert order[-len(rest):] == rest  # everything else after, in its own order
    p = "model.layers.0.mlp."
    assert order[:8] == [f"{p}experts.0.gate_proj.qweight", f"{p}experts.0.up_proj.qweight",
                         f"{p}experts.1.gate_proj.qweight", f"{p}experts.1.up_proj.qweight",
                         f"{p}experts.2.gate_proj.qweight", f"{p}experts.2.up_proj.qweight",
                         f"{p}experts.0.down_proj.qweight", f"{p}experts.1.down_proj.qweight"]
    assert order[8:12] == [f"{p}experts.2.down_proj.qweight", f"{p}shared_expert.gate_proj.qweight",
                           f"{p}shared_expert.up_proj.qweight", f"{p}shared_expert.down_proj.qweight"]
    assert order[12] == f"{p}experts.0.gate_proj.scales"
    assert order.index("model.layers.1.mlp.experts.0.gate_proj.qweight") == 36  # layer 0's 3 fields × 12 first


@pytest.mark.parametrize("name", list(CONFIGS))
def test_a_linear_read_in_place_equals_one_repacked_at_load(w, name, monkeypatch):
    """On nextn's kernel: the same buffers (the given tensors, not copies) and the same outputs bit for bit; where
    the kernel does not run, given back portably: the same outputs as the portable tensors (PyTorch's kernel)."""
    cfg = CONFIGS[name]
    q = quantize(w, cfg)
    x = torch.randn(5, 128, generator=torch.Generator().manual_seed(1)).bfloat16()
    if woq_linear.available():
        k = kernel_layout.to_kernel(q, cfg)
        packed, repacked = WeightOnlyLinear(k, cfg), WeightOnlyLinear(q, cfg)
        assert packed.kernel == repacked.kernel == "nextn" and packed.qweight is k["qweight"]
        for f in kernel_layout.FIELDS:
            assert torch.equal(getattr(packed, f), getattr(repacked, f)), f
        assert torch.equal(packed(x), repacked(x))
    monkeypatch.setattr(woq_linear, "available", lambda: False)
    k = kernel_layout.to_kernel(q, cfg)
    packed, portable = WeightOnlyLinear(k, cfg), WeightOnlyLinear(q, cfg)
    assert packed.kernel == portable.kernel == "aten"
    assert torch.equal(packed(x), portable(x))
