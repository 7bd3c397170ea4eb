"""Block-scaled FP8 (e4m3) weights, as in DeepSeek-V3's FP8 release (deepseek-ai/DeepSeek-V3's config.json).

A weight W [M, N] is stored as `W` in float8_e4m3fn plus `W_scale_inv` [ceil(M/bm), ceil(N/bn)] in fp32, one
scale per (bm × bn) block (bm = bn = 128 in the release; edge blocks may be partial). Dequantization multiplies each
element by the scale of its block: W_fp32[i, j] = float(W[i, j]) · scale_inv[i // bm, j // bn]. Despite its name
`scale_inv` is the *multiplicative* dequantization scale (amax / 448 of the block at quantization time).
"""

from __future__ import annotations

import torch

#: Largest finite float8_e4m3fn magnitude.
FP8_E4M3_MAX = 448.0
DEFAULT_BLOCK = (128, 128)


def _num_blocks(size: int, block: int) -> int:
    return -(-size // block)  # ceil(size / block)


def _expand(scale: torch.Tensor, shape: tuple[int, int], block: tuple[int, int]) -> torch.Tensor:
    """[ceil(M/bm), ceil(N/bn)] per-block scales → [M, N] per-element scales (edge blocks cropped)."""
    m, n = shape
    return scale.repeat_interleave(block[0], dim=0)[:m].repeat_interleave(block[1], dim=1)[:, :n]


def dequantize_block_fp8(
    weight: torch.Tensor, scale_inv: torch.Tensor, block: tuple[int, int] = DEFAULT_BLOCK
) -> torch.Tensor:
    """Dequantize a block-scaled FP8 weight.

    Args:
        weight: [M, N] float8_e4m3fn (any dtype is accepted and upcast; M, N need not be multiples of the block).
        scale_inv: [ceil(M/bm), ceil(N/bn)] per-block multiplicative scales (fp32; other float dtypes are upcast).
        block: (bm, bn) block size, `quantization_config.weight_block_size`.
    Returns:
        [M, N] float32: weight.float() · scale of each element's block.
    Raises:
        ValueError: `weight` is not 2-D, the block is not positive, or `scale_inv` has the wrong shape.
    """
    bm, bn = _check_block(block)
    if weight.dim() != 2:
        raise ValueError(f"block FP8 weights must be 2-D, got shape {list(weight.shape)}")
    m, n = weight.shape
    expected = (_num_blocks(m, bm), _num_blocks(n, bn))
    if tuple(scale_inv.shape) != expected:
        raise ValueError(
            f"scale_inv has shape {list(scale_inv.shape)}, expected {list(expected)} for a weight of shape "
            f"{[m, n]} with block {[bm, bn]}"
        )
    return weight.to(torch.float32) * _expand(scale_inv.to(torch.float32), (m, n), (bm, bn))


def quantize_block_fp8(
    weight: torch.Tensor, block: tuple[int, int] = DEFAULT_BLOCK
) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantize a 2-D weight to block-scaled FP8 (the inverse of `dequantize_block_fp8`, up to e4m3 rounding).

    Each block's scale is amax(|block|) / 448, so the block's largest element maps to ±448; an all-zero block
    gets scale 1. Relative error per element is at most 2^-4 (3 mantissa bits) above e4m3's subnormal range.

    Args:
        weight: [M, N] floating tensor (any float dtype; computed in fp32).
        block: (bm, bn) block size.
    Returns:
        (q, scale_inv): q [M, N] float8_e4m3fn and scale_inv [ceil(M/bm), ceil(N/bn)] float32.
    Raises:
        ValueError: `weight` is not 2-D or the block is not positive.
    """
    bm, bn = _check_block(block)
    if weight.dim() != 2:
        raise ValueError(f"block FP8 weights must be 2-D, got shape {list(weight.shape)}")
    w = weight.to(torch.float32)
    m, n = w.shape
    mb, nb = _num_blocks(m, bm), _num_blocks(n, bn)
    padded = torch.zeros(mb * bm, nb * bn, dtype=torch.float32)
    padded[:m, :n] = w.abs()
    amax = padded.view(mb, bm, nb, bn).amax(dim=(1, 3))  # [mb, nb]
    scale = torch.where(amax > 0, amax / FP8_E4M3_MAX, torch.ones_like(amax))
    q = (w / _expand(scale, (m, n), (bm, bn))).clamp(-FP8_E4M3_MAX, FP8_E4M3_MAX).to(torch.float8_e4m3fn)
    return q, scale


def _check_block(block: tuple[int, int] | list[int]) -> tuple[int, int]:
    if len(block) != 2 or any(int(b) <= 0 for b in block):
        raise ValueError(f"weight_block_size must be two positive integers, got {list(block)}")
    return int(block[0]), int(block[1])
