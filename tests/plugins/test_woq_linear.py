"""nextn's CPU weight-only kernels: against the PyTorch reference, batch invariance, layouts, fake tensors, fallback."""

from __future__ import annotations

import pytest
import torch

from nextn.plugins import cpu_kernels, woq_linear
from nextn.quantization import QuantConfig, dequantize, quantize
from nextn.quantization.linear import WeightOnlyLinear

pytestmark = [pytest.mark.skipif(not woq_linear.available(),
                                 reason=f"nextn's CPU kernels unavailable: {woq_linear.unavailable_reason()}"),
              pytest.mark.usefixtures("kernel_variant")]

W4 = QuantConfig(quant_algo="W4A16", group_size=32)
W8 = QuantConfig(quant_algo="W8A16")


def _int4_operands(n: int, k: int, g: int, seed: int = 0, super_block: int | None = None, a8: bool = False):
    """(quantize's tensors, and the kernel's w, scale, zero) for a random [n, k] weight: one-level scales, or
    two-level with `super_block` (scale = the 8-bit pairs, zero = the fp16 (d, dmin)); W4A8's layout with `a8`."""
    gen = torch.Generator().manual_seed(seed)
    cfg = QuantConfig(quant_algo="W4A8" if a8 else "W4A16", group_size=g, super_block_size=super_block)
    t = quantize(torch.randn(n, k, generator=gen), cfg)
    if super_block or a8:
        lin = WeightOnlyLinear(dict(t), cfg)
        return t, lin.qweight, lin.scales, lin.zeros
    scale = woq_linear.block_scales(t["weight_scale"].bfloat16())
    zero8 = woq_linear.block_scales((t["weight_zero"] + 8 * t["weight_scale"]).bfloat16())
    return t, woq_linear.pack_int4(t["weight"]), scale, zero8


@pytest.mark.parametrize("n,k,g,sb", [(96, 128, 32, None), (80, 576, 32, None), (64, 256, 64, None),
                                      (48, 1536, 128, None), (16, 64, 32, None), (16, 18944, 32, None),
                                      (80, 576, 32, 192), (48, 1536, 32, 256), (16, 18944, 32, 256),
                                      (32, 896, 32, 224), (16, 64, 32, 32)])
@pytest.mark.parametrize("rows", [1, 3, 4, 5, 8, 9, 12, 13, 16, 17])
@pytest.mark.parametrize("a8", [False, True], ids=["bf16-x", "int8-x"])
def test_int4_matches_the_reference(n, k, g, sb, rows, a8):
    """An odd number of 16-channel blocks (80, 48: one row runs two blocks at a time; W4A8 four), one block, 18
    groups, 592 groups (a 7B model's down_proj input), every row chunking; two-level scales with super-blocks of 6,
    8, 7 and 1 groups; bf16 activations (W4A16) and int8 ones (W4A8, the reference quantizing them alike)."""
    _, packed, scale, zero8 = _int4_operands(n, k, g, super_block=sb, a8=a8)
    x = torch.randn(rows, k).bfloat16()
    x[0, :g] = 0  # an all-zero group (W4A8: scale 0)
    bias = torch.randn(n)
    out = cpu_kernels.ops().woq_int4_linear(x, packed, scale, zero8, g, bias, a8)
    ref = woq_linear.int4_linear_reference(x.float(), packed, scale, zero8, g, bias, int8_activations=a8)
    assert out.shape == (rows, n) and out.dtype == torch.bfloat16
    torch.testing.assert_close(out.float(), ref, rtol=1e-2, atol=1e-2 * ref.abs().max().item())


def test_vnni_layout_keeps_every_value():
    t = quantize(torch.randn(32, 128), W4)
    packed = woq_linear.pack_int4_vnni(t["weight"])
    q = torch.stack([t["weight"] & 0x0F, t["weight"] >> 4], dim=-1).view(32, 128)
    assert torch.equal(woq_linear.unpack_int4_vnni_layout(packed), q)
    assert int(packed[0, 0]) == int(q[0, 0]) | int(q[0, 4]) << 4  # byte 4c + j of a block: k + j, k + 4 + j
    with pytest.raises(ValueError, match="K % 64"):
        woq_linear.pack_int4_vnni(torch.zeros(16, 24, dtype=torch.uint8))


@pytest.mark.parametrize("n,k,g,sb", [(48, 1536, 32, 256), (32, 896, 32, 224), (96, 128, 32, None)])
@pytest.mark.parametrize("rows", [1, 4, 5, 9])
def test_w4a8_quantizes_activations_per_super_block_with_two_level_scales(n, k, g, sb, rows, monkeypatch):
    """W4A8 multiplies x quantized per super-block with two-level scales (llama.cpp's Q8_K, so that the 8-bit group
    scales apply to integer sums), per group with one-level ones (Q8_0): the kernel equals the reference quantizing
    alike up to f32 rounding, and (the control) is told apart from the reference quantizing per group."""
    _, packed, scale, zero8 = _int4_operands(n, k, g, seed=3, super_block=sb, a8=True)
    x = torch.randn(rows, k)
    x[:, : k // 2] *= 8  # groups of different magnitudes: a per-block scale is not a per-group one
    out = cpu_kernels.ops().woq_int4_linear(x, packed, scale, zero8, g, None, True)
    ref = woq_linear.int4_linear_reference(x.double(), packed, scale, zero8, g, int8_activations=True)
    tol = 2e-5 * ref.abs().max().item()
    torch.testing.assert_close(out.double(), ref, rtol=0, atol=tol)
    if sb:  # the reference quantizing per group instead: what W4A8 did before, not what it does
        per_block = woq_linear.quantize_activations
        monkeypatch.setattr(woq_linear, "quantize_activations", lambda x, block: per_block(x, g))
        per_group = woq_linear.int4_linear_reference(x.double(), packed, scale, zero8, g, int8_activations=True)
        assert (out.double() - per_group).abs().max().item() > 20 * tol


def test_activations_are_quantized_per_group_to_int8():
    x = torch.tensor([[1.0, -2.0, 0.5, 127.0] * 8 + [0.0] * 32])
    xq = woq_linear.quantize_activations(x, 32)
    assert torch.equal(xq[0, 32:], torch.zeros(32))  # an all-zero group stays zero
    assert torch.equal(xq[0, :4], torch.tensor([1.0, -2.0, 0.0, 127.0]))  # scale 1: 0.5 rounds half to even


def test_int8_kernel_activations_are_int16_per_group_of_128():
    """The int16 grid: an all-zero group stays zero, a group's largest value maps to ±32767, the others round to the
    grid's nearest step (1.0 in a group of maximum 3 is not on it), a short last group (K = 144: 128 + 16) is scaled
    alone, and no value moves by more than half a step."""
    x = torch.zeros(1, 144)
    x[0, :4] = torch.tensor([1.0, -2.0, 0.5, 3.0])
    x[0, 128:] = 0.25
    q = woq_linear.quantize_activations16(x)
    assert torch.equal(q[0, 4:128], torch.zeros(124)) and torch.equal(q[0, 128:], x[0, 128:])
    sx = torch.tensor(3.0) / 32767
    assert q[0, 3] == 3.0 and q[0, 0] == torch.round(1.0 * (1 / sx)) * sx != 1.0
    assert torch.allclose(q[0, :3], x[0, :3], rtol=0, atol=3 / 32767)
    y = torch.randn(4, 256)
    err16 = (woq_linear.quantize_activations16(y) - y.bfloat16().float()).abs()
    assert err16.max() <= y.abs().max() / 32767  # half a step of the largest group's grid, at most
    assert woq_linear.int8_activations() in ("bf16", "int16")


def test_pack_int4_keeps_every_value():
    for sb in (None, 64):
        cfg = QuantConfig(quant_algo="W4A16", group_size=32, super_block_size=sb)
        t, packed, scale, zero8 = _int4_operands(32, 128, 32, super_block=sb)
        x = torch.eye(128)  # rows of the identity read the dequantized weight back, column by column
        got = woq_linear.int4_linear_reference(x, packed, scale, zero8, 32)
        torch.testing.assert_close(got.T, dequantize(t, cfg))
        # and the kernel reads the same values
        torch.testing.assert_close(cpu_kernels.ops().woq_int4_linear(x.bfloat16(), packed, scale, zero8, 32, None)
                                   .float().T, dequantize(t, cfg), rtol=1e-2, atol=1e-2)
    with pytest.raises(ValueError, match="K % 64"):
        woq_linear.pack_int4(torch.zeros(16, 24, dtype=torch.uint8))
    with pytest.raises(ValueError, match="N % 16"):
        woq_linear.pack_int4(torch.zeros(8, 32, dtype=torch.uint8))


def _int8_operands(n: int, k: int, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    t = quantize(torch.randn(n, k, generator=gen), W8)
    return t, woq_linear.pack_int8(t["weight"]), t["weight_scale"]


@pytest.mark.parametrize("n,k", [(80, 576), (48, 576), (16, 576), (144, 576), (48, 1536), (80, 16), (48, 272)])
@pytest.mark.parametrize("rows", [1, 2, 3, 4, 5, 9, 16, 17])
def test_int8_matches_the_reference(n, k, rows):
    """4, 2 and 1 blocks of 16 channels at a time and the rest one by one (80 = 4 + 1, 48 = 2 + 1), every chunking;
    int16 activations (variants without bf16 dot products): whole groups of 128, a short last one (576 = 4 · 128 +
    64, 272 = 2 · 128 + 16), one short group (16), an all-zero group and a group's largest value at 32767."""
    gen = torch.Generator().manual_seed(1)
    t, packed, scale = _int8_operands(n, k, seed=1)
    x, bias = torch.randn(rows, k, generator=gen), torch.randn(n, generator=gen)
    x[0, :min(k, 128)] = 0
    x[-1, -1] = 1e4  # dwarfs the rest of its group
    out = cpu_kernels.ops().woq_int8_linear(x, packed, scale, bias)
    ref = woq_linear.int8_linear_reference(x, packed, scale, bias, woq_linear.int8_activations())
    assert out.dtype == torch.float32
    torch.testing.assert_close(out, ref, rtol=1e-4, atol=1e-4 * ref.abs().max().item())
    assert torch.equal(woq_linear.unpack_int8_kernel_layout(packed), t["weight"])


def test_int8_rows_are_padded_to_16_and_cut_back():
    """A W8A16 layer of 70 output channels (a vocabulary not a multiple of 16): packed as 80, output 70."""
    t = quantize(torch.randn(70, 64), W8)
    layer = WeightOnlyLinear(dict(t), W8)
    assert layer.qweight.shape == (80, 64) and not woq_linear.unpack_int8_kernel_layout(layer.qweight)[70:].any()
    x = torch.randn(3, 64)
    xf = woq_linear.quantize_activations16(x) if woq_linear.int8_activations() == "int16" else x.bfloat16().float()
    ref = torch.nn.functional.linear(xf, dequantize(t, W8))
    torch.testing.assert_close(layer(x), ref, rtol=1e-4, atol=1e-4 * ref.abs().max().item())


@pytest.mark.parametrize("rows", [2, 4, 5, 8, 9, 12, 13, 17])
@pytest.mark.int8_dots
def test_every_row_is_computed_as_if_alone(rows):
    """Batch invariance, bit for bit: what keeps a verify step's logits equal to plain decoding's."""
    _, packed, scale, zero8 = _int4_operands(80, 576, 32, seed=2)
    two = _int4_operands(80, 576, 32, seed=2, super_block=192)[1:]
    a8 = _int4_operands(80, 576, 32, seed=2, a8=True)[1:]
    a8_two = _int4_operands(80, 576, 32, seed=2, super_block=192, a8=True)[1:]
    _, q8, s8 = _int8_operands(80, 576)
    x = torch.randn(rows, 576).bfloat16()
    ops = [lambda a: cpu_kernels.ops().woq_int4_linear(a, packed, scale, zero8, 32, None),
           lambda a: cpu_kernels.ops().woq_int4_linear(a, *two, 32, None),
           lambda a: cpu_kernels.ops().woq_int4_linear(a, *a8, 32, None, True),
           lambda a: cpu_kernels.ops().woq_int4_linear(a, *a8_two, 32, None, True),
           lambda a: cpu_kernels.ops().woq_int8_linear(a, q8, s8, None)]
    for op in ops:
        together = op(x)
        alone = torch.cat([op(x[i:i + 1]) for i in range(rows)])
        assert torch.equal(together, alone)


def test_bad_operands_are_named():
    _, packed, scale, zero8 = _int4_operands(16, 128, 32)
    with pytest.raises(RuntimeError, match="output channels"):
        cpu_kernels.ops().woq_int4_linear(torch.randn(1, 128), packed[:8], scale, zero8, 32, None)
    with pytest.raises(RuntimeError, match="input channels"):
        cpu_kernels.ops().woq_int4_linear(torch.randn(1, 64), packed, scale, zero8, 32, None)
    with pytest.raises(RuntimeError, match="bfloat16"):
        cpu_kernels.ops().woq_int4_linear(torch.randn(1, 128), packed, scale.float(), zero8, 32, None)
    _, packed, pairs, sup = _int4_operands(16, 128, 32, super_block=64)
    with pytest.raises(RuntimeError, match="two-level scales"):
        cpu_kernels.ops().woq_int4_linear(torch.randn(1, 128), packed, pairs, sup.float(), 32, None)
    with pytest.raises(RuntimeError, match="super-blocks do not divide"):  # 3 super-blocks for 4 groups
        cpu_kernels.ops().woq_int4_linear(torch.randn(1, 128), packed, pairs, torch.cat([sup, sup[:, :1]], 1), 32, None)
    with pytest.raises(RuntimeError, match="K = 40 must be a multiple of 16"):
        cpu_kernels.ops().woq_int8_linear(torch.randn(1, 40), torch.zeros(16, 40, dtype=torch.int8), torch.ones(16), None)
    with pytest.raises(RuntimeError, match="N = 4 output channels must be a multiple of 16"):
        cpu_kernels.ops().woq_int8_linear(torch.randn(1, 32), torch.zeros(4, 32, dtype=torch.int8), torch.ones(4), None)


def test_fake_implementations_let_torch_compile_trace_the_ops():
    _, packed, scale, zero8 = _int4_operands(16, 128, 32)
    x = torch.randn(3, 128).bfloat16()
    torch.library.opcheck(cpu_kernels.ops().woq_int4_linear.default, (x, packed, scale, zero8, 32, None),
                          test_utils=("test_schema", "test_faketensor"))
    _, packed, pairs, sup = _int4_operands(16, 128, 32, super_block=64)
    torch.library.opcheck(cpu_kernels.ops().woq_int4_linear.default, (x, packed, pairs, sup, 32, None),
                          test_utils=("test_schema", "test_faketensor"))
    _, packed, scale, zero8 = _int4_operands(16, 128, 32, a8=True)
    torch.library.opcheck(cpu_kernels.ops().woq_int4_linear.default, (x, packed, scale, zero8, 32, None, True),
                          test_utils=("test_schema", "test_faketensor"))
    _, q8, s8 = _int8_operands(16, 128)
    torch.library.opcheck(cpu_kernels.ops().woq_int8_linear.default, (x, q8, s8, None),
                          test_utils=("test_schema", "test_faketensor"))


@pytest.mark.parametrize("cfg", [W4, W8, QuantConfig(quant_algo="W4A16", group_size=32, super_block_size=64),
                                 QuantConfig(quant_algo="W4A8", group_size=32)],
                         ids=["W4A16", "W8A16", "W4A16-two-level", "W4A8"])
def test_layers_use_nextn_kernels_and_agree_with_pytorchs(cfg, monkeypatch):
    t = quantize(torch.randn(96, 128), cfg)
    ours = WeightOnlyLinear(dict(t), cfg)
    monkeypatch.setattr(woq_linear, "available", lambda: False)
    aten = WeightOnlyLinear(dict(t), cfg)
    assert (ours.kernel, aten.kernel) == ("nextn", "aten")
    x = torch.randn(5, 128).bfloat16()
    ref = aten(x).float()
    torch.testing.assert_close(ours(x).float(), ref, rtol=2e-2, atol=2e-2 * ref.abs().max().item())



#: variants that differ from another only in their int8 / int16 dot products, with that other
_DOT_BASES = {"avx2_vnni": "avx2", "neon_dotprod": "neon"}
_DOT_PAIRS = [v for v, base in _DOT_BASES.items() if {v, base} <= set(cpu_kernels.runnable())]


@pytest.mark.int8_dots
@pytest.mark.parametrize("kernel_variant", _DOT_PAIRS, indirect=True)  # once, not once per variant
@pytest.mark.parametrize("rows", [1, 4, 5, 8, 12, 13])
def test_a_dot_product_variant_is_bit_identical_to_its_base(kernel_variant, rows):
    """avx2_vnni and avx2, neon_dotprod and neon differ only in how int8 / int16 products are summed (`vpdpbusd` /
    `vpdpwssd` against `vpmaddubsw` / `vpmaddwd`; `sdot` against `smull` + pairwise adds), exactly in integer on both:
    W4A8 (one-level and two-level scales, group scales applied in integer) and the int8 linear give the same bits.
    Control: one weight byte changed changes them."""
    a8 = _int4_operands(80, 1536, 32, seed=3, a8=True)[1:]
    a8_two = _int4_operands(80, 1536, 32, seed=3, super_block=256, a8=True)[1:]
    _, q8, s8 = _int8_operands(80, 576, seed=3)
    x, x8 = torch.randn(rows, 1536).bfloat16(), torch.randn(rows, 576).bfloat16()

    def outputs(w4=a8[0], w8=q8):
        ops = cpu_kernels.ops()
        return [ops.woq_int4_linear(x, w4, *a8[1:], 32, None, True), ops.woq_int4_linear(x, *a8_two, 32, None, True),
                ops.woq_int8_linear(x8, w8, s8, None)]

    with cpu_kernels.use(_DOT_BASES[kernel_variant]):
        want = outputs()
    assert cpu_kernels.ops().isa() == kernel_variant
    got = outputs()
    for w, g in zip(want, got):
        assert torch.equal(w, g)
    w4, w8 = a8[0].clone(), q8.clone()
    w4.view(-1)[7] ^= 0x88  # two 4-bit weights of one channel moved by 8 steps, one product each
    w8.view(-1)[7] = -127 if w8.view(-1)[7] > 0 else 127
    changed = outputs(w4, w8)
    assert not torch.equal(changed[0], want[0]) and not torch.equal(changed[2], want[2])
