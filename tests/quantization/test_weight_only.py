"""W8A16 / W4A16: quantization error bounds, storage layout, and the kernels against the reference dequantization."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from nextn.quantization import QuantConfig, QuantError, dequantize, quantize
from nextn.quantization.linear import WeightOnlyLinear, install_weight_only_linears
from nextn.quantization.weight_only import default_group_size, quantized_specs, super_block

W8 = QuantConfig(quant_algo="W8A16")
W4 = QuantConfig(quant_algo="W4A16", group_size=32)
W4K = QuantConfig(quant_algo="W4A16", group_size=32, super_block_size=64)


@pytest.fixture()
def w() -> torch.Tensor:
    return torch.randn(96, 128, generator=torch.Generator().manual_seed(0))


def test_w8_error_is_within_half_a_step(w):
    t = quantize(w, W8)
    assert t["weight"].dtype == torch.int8 and t["weight_scale"].shape == (96,)
    err = (dequantize(t, W8) - w).abs()
    assert (err <= t["weight_scale"][:, None] / 2 + 1e-6).all()


def test_w4_error_is_within_half_a_step_and_layout(w):
    t = quantize(w, W4)
    assert t["weight"].dtype == torch.uint8 and t["weight"].shape == (96, 64)
    assert t["weight_scale"].shape == (96, 4) and t["weight_zero"].shape == (96, 4)
    err = (dequantize(t, W4) - w).abs().view(96, 4, 32)
    assert (err <= t["weight_scale"][..., None] / 2 + 1e-5).all()
    # low nibble = even input channel
    q0 = torch.round((w[0, 0] - t["weight_zero"][0, 0]) / t["weight_scale"][0, 0]).int()
    assert int(t["weight"][0, 0] & 0x0F) == int(q0)
    specs = quantized_specs("model.layers.0.mlp.up_proj.weight", (96, 128), W4)
    assert {k: v[0] for k, v in specs.items()} == {k: tuple(v.shape) for k, v in
                                                   {f"model.layers.0.mlp.up_proj.{s}": x for s, x in t.items()}.items()}


def test_two_level_scales_layout_and_error(w):
    """8-bit group scales and zeros under fp16 (d, dmin) per super-block: exact products, every weight within half a
    step of its group (the range [zero, zero + 15 · scale] covers the group or clips it by less than a step), and no
    worse than one-level scales overall."""
    t = quantize(w, W4K)
    assert t["weight"].shape == (96, 64) and t["weight_scale"].dtype == torch.uint8
    assert t["weight_zero"].dtype == torch.int8 and t["weight_scale_2"].shape == (96, 2, 2)
    assert t["weight_scale_2"].dtype == torch.float16
    scale = t["weight_scale"].float() * t["weight_scale_2"].float()[..., 0].repeat_interleave(2, 1)
    deq = dequantize(t, W4K)
    err = (deq - w).abs().view(96, 4, 32)
    assert (err <= scale[..., None] * 1.01).all()
    one = (dequantize(quantize(w, W4), W4) - w).square().sum()
    assert (deq - w).square().sum() <= 1.05 * one
    specs = quantized_specs("model.layers.0.mlp.up_proj.weight", (96, 128), W4K)
    assert {k: (v[0], v[1]) for k, v in specs.items()} == {
        f"model.layers.0.mlp.up_proj.{s}": (tuple(x.shape), x.dtype) for s, x in t.items()}
    assert [super_block(k, 32, 256) for k in (1536, 576, 896, 8960, 96)] == [256, 192, 224, 256, 96]


@pytest.mark.parametrize("cfg", [W8, W4, W4K], ids=["W8A16", "W4A16", "W4A16-two-level"])
@pytest.mark.parametrize("rows", [1, 4, 7])
def test_kernel_matches_reference_dequantization(w, cfg, rows):
    t = quantize(w, cfg)
    bias = torch.randn(96)
    layer = WeightOnlyLinear({**t, "bias": bias}, cfg)
    x = torch.randn(2, rows, 128)
    ref = torch.nn.functional.linear(x.bfloat16().float(), dequantize(t, cfg).bfloat16().float(), bias)
    out = layer(x)
    assert out.shape == (2, rows, 96) and out.dtype == torch.float32
    torch.testing.assert_close(out, ref, rtol=2e-2, atol=2e-2 * ref.abs().max().item())


def test_bad_input_is_named():
    with pytest.raises(QuantError, match="2-D"):
        quantize(torch.randn(4), W8)
    with pytest.raises(QuantError, match="NaN or Inf"):
        quantize(torch.tensor([[1.0, float("nan")]]), W8)
    with pytest.raises(QuantError, match="does not divide"):
        quantize(torch.randn(8, 48), W4)
    with pytest.raises(QuantError, match="no W4A16 group size"):
        default_group_size([576, 100])
    assert default_group_size([576, 1536]) == 32 and default_group_size([896, 4864]) == 32


def test_install_replaces_only_quantized_linears():
    model = nn.Sequential(nn.Linear(128, 64), nn.ReLU(), nn.Linear(64, 32))
    weights = {f"{k}": v.detach().clone() for k, v in model.state_dict().items()}
    x = torch.randn(3, 128)
    ref = model(x)
    q = quantize(weights.pop("0.weight"), W8)
    weights.update({f"0.{k}": v for k, v in q.items()})
    replaced = install_weight_only_linears(model, weights, W8)
    assert replaced == ["0"] and isinstance(model[0], WeightOnlyLinear) and isinstance(model[2], nn.Linear)
    assert set(weights) == {"2.weight", "2.bias"}
    model.load_state_dict(weights, strict=True)
    torch.testing.assert_close(model(x), ref, rtol=0.05, atol=0.05)


def test_exclude_modules():
    cfg = QuantConfig(quant_algo="W8A16", exclude_modules=["lm_head", "model.layers.0"])
    assert not cfg.applies_to("lm_head") and not cfg.applies_to("model.layers.0.mlp.up_proj")
    assert cfg.applies_to("model.layers.1.mlp.up_proj") and cfg.applies_to("model.layers.01")


def test_quantize_stream_rewrites_specs_and_tensors(w):
    from nextn.quantization.weight_only import quantize_stream

    specs = {"a.weight": ((96, 128), torch.bfloat16), "norm.weight": ((128,), torch.bfloat16)}
    stream = [("a.weight", w.bfloat16()), ("norm.weight", torch.ones(128, dtype=torch.bfloat16))]
    new_specs, out = quantize_stream(specs, iter(stream), {"a.weight"}, W4)
    got = dict(out)
    assert set(got) == set(new_specs) == {"a.weight", "a.weight_scale", "a.weight_zero", "norm.weight"}
    for k, (shape, dtype) in new_specs.items():
        assert tuple(got[k].shape) == shape and got[k].dtype == dtype, k


def test_unaligned_weight_from_a_file_buffer_is_safe(w):
    """safetensors hands out tensors at 8-byte offsets in one buffer; the int8 kernel needs an aligned weight."""
    t = quantize(w, W8)
    buf = torch.empty(t["weight"].numel() + 8, dtype=torch.int8)
    unaligned = buf[8:].view(96, 128)
    unaligned.copy_(t["weight"])
    assert unaligned.data_ptr() % 64 != 0
    layer = WeightOnlyLinear({**t, "weight": unaligned}, W8)
    x = torch.randn(20, 128)
    torch.testing.assert_close(layer(x), WeightOnlyLinear(t, W8)(x))


@pytest.mark.parametrize("k", [172, 12])
def test_a_w8a16_layer_whose_input_is_not_a_multiple_of_8_runs(k):
    """PyTorch's `_weight_int8pack_mm` crashed the process (SIGSEGV) for K % 8 != 0 — stories260K's W8A16 down_proj,
    K = 172: such a layer dequantizes on the fly and computes the dequantized product."""
    torch.manual_seed(0)
    w = torch.randn(64, k)
    layer = WeightOnlyLinear(quantize(w, W8), W8)
    x = torch.randn(3, k).to(torch.bfloat16)
    ref = x.float() @ dequantize(quantize(w, W8), W8).float().T
    torch.testing.assert_close(layer(x).float(), ref, rtol=2e-2, atol=2e-2)
