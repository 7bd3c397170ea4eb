"""nextn's CPU weight-only kernels (`woq_linear_cpu.cpp`, `int8_linear_cpu.cpp`): int4 / int8 weights, 1–8+ rows.

The decode step multiplies one row per request (plain decoding) or K + 1 (a verify step) by every weight.
PyTorch's own weight-only CPU kernels (`aten._weight_int4pack_mm_for_cpu`, `aten._weight_int8pack_mm`) are
compute-bound at one row and fall off a cliff past four rows (docs/PERFORMANCE.md); ours unpack a block of
weights into registers once and use it for up to 8 rows (int4: a nibble q → 128 + q by an OR, `vdpbf16ps` on
AVX512-BF16 and two f32 FMAs elsewhere, with exact products and f32 sums, a vector lane per output channel so that one FMA scales a group of 16
channels; int8: the same lanes, one scale per channel). Every output is
the same sequence of f32 operations whatever the row count (batch invariance: a verify step's logits equal a
plain step's, bit for bit), which `tests/plugins/test_woq_linear.py` checks.

The C++ source is compiled on first use with nextn's other CPU kernels for the CPU's ISA variant (`cpu_kernels.py`:
AVX512-BF16, AVX-512, AVX2, NEON or generic). Where that is not possible, `available()` is False with the reason in
`unavailable_reason()`, and callers keep PyTorch's kernels.

Ops (`cpu_kernels.ops().*`, the chosen ISA variant's `torch.ops.nextn_<variant>.*`, usable under `torch.compile` through the fake implementations in `cpu_kernels.py`):
- `woq_int4_linear(x [M, K] bf16|f32, w [N, K/2] uint8 (`pack_int4` layout), scale [N/16, K/g, 16] bf16,
  zero8 [N/16, K/g, 16] bf16 (`block_scales` layout), g, bias [N] f32 | None) → [M, N] in x's dtype`,
  w = (q − 8)·scale + zero8 (the engine's W4A16 format, `quantization/weight_only.py`); or two-level scales
  (W4A16 with super-blocks, llama.cpp's k-quants): scale [N/16, K/g, 2, 16] uint8 (a u8 scale and an i8 zero per
  group), zero8 → [N/16, S, 2, 16] fp16 (d, dmin per super-block), w = q·(d·scale) + dmin·zero. K % 64 == 0,
  N % 16 == 0, g % 32 == 0.
- `woq_int8_linear(x [M, K] bf16|f32, w [N, K] int8 (`pack_int8` layout), scale [N] f32, bias | None) → [M, N]`,
  w = q·scale (W8A16; every quantized engine's lm_head); `int8_linear_cpu.cpp`. On AVX512-BF16 x rounded to bf16,
  int8 → bf16 exactly, `vdpbf16ps` (32 multiply-adds an instruction, so the rows of a verify step stay
  memory-bound); elsewhere x quantized to int16 per group of 128 input channels and exact int32 sums
  (`vpdpwssd`, AVX2's `vpmaddwd`): `int8_activations()`. K % 16 == 0, N % 16 == 0.
"""

from __future__ import annotations

import torch

from nextn.plugins import cpu_kernels


def available() -> bool:
    """Whether the kernels are loaded (compiling nextn's CPU kernels on the first call: `cpu_kernels`)."""
    return cpu_kernels.available()


def unavailable_reason() -> str | None:
    """Why the kernels are unavailable (None when they are)."""
    return cpu_kernels.unavailable_reason()


def fastest_int4_algo() -> str:
    """The int4 format that runs fastest on the kernels in use: W4A16 where they multiply bf16 pairs natively
    (`avx512_bf16`: `vdpbf16ps`), else W4A8, whose int8 dot products (VNNI, `vpmaddubsw`) beat bf16 widened to f32
    by ~2x (an [8960, 1536] matrix, 1 thread, AMD EPYC Zen 4: avx2 W4A16 938-975 µs against W4A8 437-440 µs at one
    row; 4.8 against 1.7-1.8 ms at 8 rows; docs/PERFORMANCE.md)."""
    return "W4A16" if cpu_kernels.variant() == "avx512_bf16" else "W4A8"


def takes(quant_algo: str, out_features: int, in_features: int) -> bool:
    """Whether the kernels take a layer of this shape: int4 K % 64 == 0 and N % 16 == 0; int8 K % 16 == 0 (its N is
    padded to a multiple of 16 by `pack_int8`)."""
    if quant_algo in ("W4A16", "W4A8"):
        return in_features % 64 == 0 and out_features % 16 == 0
    return in_features % 16 == 0


def _pack_nibbles(packed: torch.Tensor, span: int) -> torch.Tensor:
    """Blocks of 16 output channels; per 2·span input channels of a block, 16·span bytes: byte span·c + j holds
    q[c][k + j] (low nibble) and q[c][k + span + j] (high nibble). Raises ValueError unless K % 64 == N % 16 == 0."""
    n, half = packed.shape
    k = 2 * half
    if k % 64 or n % 16:
        raise ValueError(f"the int4 kernel needs K % 64 == 0 and N % 16 == 0, got N = {n}, K = {k}")
    q = torch.stack([packed & 0x0F, packed >> 4], dim=-1).view(n // 16, 16, k // (2 * span), 2, span)
    q = q.permute(0, 2, 1, 4, 3)  # [blk, k-step, c, j, (low, high)]
    return (q[..., 0] | (q[..., 1] << 4)).reshape(n, half).contiguous()


def _unpack_nibbles(w: torch.Tensor, span: int) -> torch.Tensor:
    """`_pack_nibbles`' inverse: the values q [N, K] uint8 in channel order."""
    n, half = w.shape
    k = 2 * half
    b = w.view(n // 16, k // (2 * span), 16, span)  # [blk, k-step, c, j]
    q = torch.stack([b & 0x0F, b >> 4], dim=-2)  # [blk, k-step, c, (low: k + j, high: k + span + j), j]
    return q.permute(0, 2, 1, 3, 4).reshape(n, k)


def pack_int4(packed: torch.Tensor) -> torch.Tensor:
    """The engine's portable int4 layout → the kernel's.

    Args:
        packed: [N, K/2] uint8, two values a byte, the even input channel in the low nibble (`weight_only.quantize`).
    Returns:
        [N, K/2] uint8 holding blocks of 16 output channels (8·K bytes each, in block order): for every 4 input
        channels k..k+3 of a block, 32 bytes; byte 2c + j (channel c < 16, j < 2) holds q[c][k + j] (low nibble)
        and q[c][k + 2 + j] (high nibble).
    Raises:
        ValueError: K is not a multiple of 64 or N of 16.
    """
    return _pack_nibbles(packed, 2)


def pack_int4_vnni(packed: torch.Tensor) -> torch.Tensor:
    """The engine's portable int4 layout → the W4A8 kernel's (`vpdpbusd`: 4 bytes of a channel per 32-bit lane).

    Args:
        packed: [N, K/2] uint8, two values a byte, the even input channel in the low nibble.
    Returns:
        [N, K/2] uint8: blocks of 16 output channels (8·K bytes each); in a block, for every 8 input channels
        k..k+7, 64 bytes: byte 4c + j (channel c < 16, j < 4) holds q[c][k + j] (low nibble) and q[c][k + 4 + j]
        (high nibble).
    Raises:
        ValueError: K is not a multiple of 64 or N of 16.
    """
    return _pack_nibbles(packed, 4)


def unpack_int4_vnni_layout(w: torch.Tensor) -> torch.Tensor:
    """`pack_int4_vnni`'s layout → the values q [N, K] uint8 in channel order (the inverse)."""
    return _unpack_nibbles(w, 4)


def quantize_activations(x: torch.Tensor, group_size: int) -> torch.Tensor:
    """What the W4A8 kernel multiplies instead of x [..., K]: x rounded to bf16, then per block of `group_size`
    input channels (the weight's group, or with two-level scales its super-block, as llama.cpp's Q8_0 / Q8_K)
    symmetric int8 (sx = max|x| / 127, q = round half to even of x · (1 / sx), all f32), dequantized back, f32."""
    xb = x.to(torch.bfloat16).float()
    g = xb.unflatten(-1, (-1, group_size))
    sx = g.abs().amax(-1, keepdim=True) / 127
    inv = torch.where(sx > 0, 1 / torch.where(sx > 0, sx, 1), 0)
    return (torch.round(g * inv) * sx).flatten(-2)


def pack_int8(q: torch.Tensor) -> torch.Tensor:
    """int8 weights [N, K] → the kernel's layout [N', K] (N' = N rounded up to 16, the extra rows 0): blocks of 16
    output channels, in each, for every 2 input channels k, k+1, 32 bytes: byte 2c + j = q[c][k + j]."""
    n, k = q.shape
    pad = -n % 16
    if pad:
        q = torch.cat([q, q.new_zeros(pad, k)])
    return q.view(-1, 16, k // 2, 2).transpose(1, 2).reshape(n + pad, k).contiguous()


def unpack_int8_kernel_layout(w: torch.Tensor) -> torch.Tensor:
    """`pack_int8`'s layout → the values [N', K] int8 in channel order (the inverse, padding rows kept)."""
    n, k = w.shape
    return w.view(n // 16, k // 2, 16, 2).transpose(1, 2).reshape(n, k)


def block_scales(t: torch.Tensor) -> torch.Tensor:
    """Per-group scales or zero points [N, G] → the kernel's [N/16, G, 16] (16 channels of a group together); pairs
    [N, G, 2] (two-level scales: (scale, zero) per group, (d, dmin) per super-block) → [N/16, G, 2, 16]."""
    n, g = t.shape[:2]
    if t.dim() == 3:
        return t.reshape(n // 16, 16, g, 2).permute(0, 2, 3, 1).contiguous()
    return t.reshape(n // 16, 16, g).transpose(1, 2).contiguous()


def unpack_int4_kernel_layout(w: torch.Tensor) -> torch.Tensor:
    """`pack_int4`'s layout → the values q [N, K] uint8 in channel order (the inverse)."""
    return _unpack_nibbles(w, 2)


def int4_linear_reference(x: torch.Tensor, packed: torch.Tensor, scale: torch.Tensor, zero8: torch.Tensor,
                          group_size: int, bias: torch.Tensor | None = None,
                          int8_activations: bool = False) -> torch.Tensor:
    """What `woq_int4_linear` computes, in PyTorch (f32, another summation order): x [..., K], `pack_int4`'s
    layout (`pack_int4_vnni`'s with `int8_activations`, x then quantized as `quantize_activations`), scale / zero8 in
    `block_scales`' layout → [..., N] in x's dtype."""
    n, half = packed.shape
    k = 2 * half
    g = k // group_size
    if int8_activations:
        q = unpack_int4_vnni_layout(packed).float()
        # two-level scales: x quantized per super-block (llama.cpp's Q8_K beside Q4_K), else per group (Q8_0)
        block = group_size * (g // zero8.shape[1]) if scale.dtype == torch.uint8 else group_size
        xf = quantize_activations(x, block)
    else:
        q = unpack_int4_kernel_layout(packed).float()
        xf = x.to(torch.bfloat16).float()
    if scale.dtype == torch.uint8:  # two-level: scale = (u8 scale, i8 zero) pairs, zero8 = fp16 (d, dmin)
        pairs = scale.permute(0, 3, 1, 2).reshape(n, g, 2)
        sup = zero8.float().permute(0, 3, 1, 2).reshape(n, -1, 2).repeat_interleave(g // zero8.shape[1], 1)
        s = pairs[..., 0].float() * sup[..., 0]
        z8 = pairs[..., 1].contiguous().view(torch.int8).float() * sup[..., 1] + 8 * s
    else:
        s = scale.float().transpose(1, 2).reshape(n, g)
        z8 = zero8.float().transpose(1, 2).reshape(n, g)
    w = ((q.view(n, g, group_size) - 8) * s[..., None] + z8[..., None]).view(n, k)
    y = xf @ w.T
    return (y if bias is None else y + bias.float()).to(x.dtype)


def int8_activations() -> str:
    """What `woq_int8_linear` multiplies x as on the kernels in use: "bf16" on `avx512_bf16` (`vdpbf16ps`), else
    "int16" per group of `INT16_GROUP` input channels (`quantize_activations16`; exact int32 sums of int16 × int8,
    ~2× the f32 path's speed past one row on AVX2: int8_linear_cpu.cpp)."""
    return cpu_kernels.ops().int8_linear_activations()


INT16_GROUP = 128  # input channels per int16 activation scale (the last group of a row may be shorter)


def quantize_activations16(x: torch.Tensor) -> torch.Tensor:
    """What the int8 kernel multiplies on variants without bf16 dot products, x [..., K] (K % 16 == 0): x rounded to
    bf16, then per group of `INT16_GROUP` symmetric int16 (sx = max|x| / 32767, q = round half to even of
    x · (1 / sx), all f32), dequantized back, f32."""
    xb = x.to(torch.bfloat16).float()
    k = xb.shape[-1]
    pad = -k % INT16_GROUP
    g = torch.nn.functional.pad(xb, (0, pad)).unflatten(-1, (-1, INT16_GROUP))
    sx = g.abs().amax(-1, keepdim=True) / 32767
    inv = torch.where(sx > 0, 1 / torch.where(sx > 0, sx, 1), 0)
    return (torch.round(g * inv).clamp(-32767, 32767) * sx).flatten(-2)[..., :k]


def int8_linear_reference(x: torch.Tensor, w: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None = None,
                          activations: str = "bf16") -> torch.Tensor:
    """What `woq_int8_linear` computes, in PyTorch (f32, another summation order): x [..., K], w [N, K] int8 in
    `pack_int8`'s layout, scale [N] → [..., N] in x's dtype; x multiplied as `activations` ("bf16" or "int16":
    `int8_activations()` says which the kernel uses)."""
    xf = quantize_activations16(x) if activations == "int16" else x.to(torch.bfloat16).float()
    y = (xf @ unpack_int8_kernel_layout(w).float().T) * scale.float()
    return (y if bias is None else y + bias.float()).to(x.dtype)
