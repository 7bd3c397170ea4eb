"""nextn's CPU weight-only kernels: against the PyTorch reference, batch invariance, layouts, fake tensors, fallback."""

from __future__ import annotations

import pytest
import torch

from nextn.plugins import woq_linear
from nextn.quantization import QuantConfig, dequantize, quantize
from nextn.quantization.linear import WeightOnlyLinear

pytestmark = pytest.mark.skipif(not woq_linear.available(),
                                reason=f"nextn's CPU kernels unavailable: {woq_linear.unavailable_reason()}")

W4 = QuantConfig(quant_algo="W4A16", group_size=32)
W8 = QuantConfig(quant_algo="W8A16")


def _int4_operands(n: int, k: int, g: int, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    t = quantize(torch.randn(n, k, generator=gen), QuantConfig(quant_algo="W4A16", group_size=g))
    scale = woq_linear.block_scales(t["weight_scale"].bfloat16())
    zero8 = woq_linear.block_scales((t["weight_zero"] + 8 * t["weight_scale"]).bfloat16())
    return t, woq_linear.pack_int4(t["weight"]), scale, zero8


@pytest.mark.parametrize("n,k,g", [(96, 128, 32), (80, 576, 32), (64, 256, 64), (48, 1536, 128), (16, 64, 32),
                                   (16, 18944, 32)])
@pytest.mark.parametrize("rows", [1, 3, 4, 5, 8, 9, 17])
def test_int4_matches_the_reference(n, k, g, rows):
    """An odd number of 16-channel blocks (80, 48: one row runs two blocks at a time), one block, 18 groups, 592
    groups (a 7B model's down_proj input), every row chunking."""
    _, packed, scale, zero8 = _int4_operands(n, k, g)
    x = torch.randn(rows, k).bfloat16()
    bias = torch.randn(n)
    out = torch.ops.nextn.woq_int4_linear(x, packed, scale, zero8, g, bias)
    ref = woq_linear.int4_linear_reference(x.float(), packed, scale, zero8, g, bias)
    assert out.shape == (rows, n) and out.dtype == torch.bfloat16
    torch.testing.assert_close(out.float(), ref, rtol=1e-2, atol=1e-2 * ref.abs().max().item())


def test_pack_int4_keeps_every_value():
    t, packed, scale, zero8 = _int4_operands(32, 128, 32)
    x = torch.eye(128)  # rows of the identity read the dequantized weight back, column by column
    got = woq_linear.int4_linear_reference(x, packed, scale, zero8, 32)
    torch.testing.assert_close(got.T, dequantize(t, W4))
    # and the kernel reads the same values
    torch.testing.assert_close(torch.ops.nextn.woq_int4_linear(x.bfloat16(), packed, scale, zero8, 32, None).float().T,
                               dequantize(t, W4), rtol=1e-2, atol=1e-2)
    with pytest.raises(ValueError, match="K % 64"):
        woq_linear.pack_int4(torch.zeros(16, 24, dtype=torch.uint8))
    with pytest.raises(ValueError, match="N % 16"):
        woq_linear.pack_int4(torch.zeros(8, 32, dtype=torch.uint8))


@pytest.mark.parametrize("rows", [1, 2, 5, 9])
def test_int8_matches_the_reference(rows):
    gen = torch.Generator().manual_seed(1)
    t = quantize(torch.randn(70, 576, generator=gen), W8)
    x, bias = torch.randn(rows, 576, generator=gen), torch.randn(70, generator=gen)
    out = torch.ops.nextn.woq_int8_linear(x, t["weight"], t["weight_scale"], bias)
    ref = woq_linear.int8_linear_reference(x, t["weight"], t["weight_scale"], bias)
    assert out.dtype == torch.float32
    torch.testing.assert_close(out, ref, rtol=1e-4, atol=1e-4 * ref.abs().max().item())


@pytest.mark.parametrize("rows", [2, 4, 5, 8, 13])
def test_every_row_is_computed_as_if_alone(rows):
    """Batch invariance, bit for bit: what keeps a verify step's logits equal to plain decoding's."""
    _, packed, scale, zero8 = _int4_operands(80, 576, 32, seed=2)
    t8 = quantize(torch.randn(70, 576), W8)
    x = torch.randn(rows, 576).bfloat16()
    ops = [lambda a: torch.ops.nextn.woq_int4_linear(a, packed, scale, zero8, 32, None),
           lambda a: torch.ops.nextn.woq_int8_linear(a, t8["weight"], t8["weight_scale"], None)]
    for op in ops:
        together = op(x)
        alone = torch.cat([op(x[i:i + 1]) for i in range(rows)])
        assert torch.equal(together, alone)


def test_bad_operands_are_named():
    _, packed, scale, zero8 = _int4_operands(16, 128, 32)
    with pytest.raises(RuntimeError, match="output channels"):
        torch.ops.nextn.woq_int4_linear(torch.randn(1, 128), packed[:8], scale, zero8, 32, None)
    with pytest.raises(RuntimeError, match="input channels"):
        torch.ops.nextn.woq_int4_linear(torch.randn(1, 64), packed, scale, zero8, 32, None)
    with pytest.raises(RuntimeError, match="bfloat16"):
        torch.ops.nextn.woq_int4_linear(torch.randn(1, 128), packed, scale.float(), zero8, 32, None)
    with pytest.raises(RuntimeError, match="multiple of 16"):
        torch.ops.nextn.woq_int8_linear(torch.randn(1, 40), torch.zeros(4, 40, dtype=torch.int8), torch.ones(4), None)


def test_fake_implementations_let_torch_compile_trace_the_ops():
    _, packed, scale, zero8 = _int4_operands(16, 128, 32)
    x = torch.randn(3, 128).bfloat16()
    torch.library.opcheck(torch.ops.nextn.woq_int4_linear.default, (x, packed, scale, zero8, 32, None),
                          test_utils=("test_schema", "test_faketensor"))
    t8 = quantize(torch.randn(8, 128), W8)
    torch.library.opcheck(torch.ops.nextn.woq_int8_linear.default, (x, t8["weight"], t8["weight_scale"], None),
                          test_utils=("test_schema", "test_faketensor"))


@pytest.mark.parametrize("cfg", [W4, W8], ids=["W4A16", "W8A16"])
def test_layers_use_nextn_kernels_and_agree_with_pytorchs(cfg, monkeypatch):
    t = quantize(torch.randn(96, 128), cfg)
    ours = WeightOnlyLinear(dict(t), cfg)
    monkeypatch.setattr(woq_linear, "available", lambda: False)
    aten = WeightOnlyLinear(dict(t), cfg)
    assert (ours.kernel, aten.kernel) == ("nextn", "aten")
    x = torch.randn(5, 128).bfloat16()
    ref = aten(x).float()
    torch.testing.assert_close(ours(x).float(), ref, rtol=2e-2, atol=2e-2 * ref.abs().max().item())
