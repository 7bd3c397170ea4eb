"""Block-scaled FP8 quantization and dequantization (nextn.build.fp8) against an explicit per-block reference."""

from __future__ import annotations

import pytest
import torch

from nextn.build.fp8 import FP8_E4M3_MAX, dequantize_block_fp8, quantize_block_fp8

SHAPES_AND_BLOCKS = [
    ((256, 128), (128, 128)),  # exact multiples
    ((300, 200), (128, 128)),  # ragged edge blocks in both dims
    ((50, 37), (16, 16)),
    ((7, 5), (128, 128)),  # smaller than one block
    ((40, 64), (16, 24)),  # non-square block
]


def _loop_dequant(q: torch.Tensor, scale: torch.Tensor, block: tuple[int, int]) -> torch.Tensor:
    """Reference: multiply each block slice by its own scale, one block at a time."""
    bm, bn = block
    out = torch.empty(q.shape, dtype=torch.float32)
    for i in range(scale.shape[0]):
        for j in range(scale.shape[1]):
            rows, cols = slice(i * bm, (i + 1) * bm), slice(j * bn, (j + 1) * bn)
            out[rows, cols] = q[rows, cols].float() * scale[i, j]
    return out


@pytest.mark.parametrize(("shape", "block"), SHAPES_AND_BLOCKS)
def test_round_trip_matches_loop_reference_and_fp8_error(shape: tuple[int, int], block: tuple[int, int]) -> None:
    torch.manual_seed(0)
    w = torch.randn(shape) * torch.logspace(-3, 1, shape[1])  # columns spanning 4 decades
    q, scale = quantize_block_fp8(w, block)
    assert q.dtype == torch.float8_e4m3fn and q.shape == w.shape
    assert scale.dtype == torch.float32
    assert tuple(scale.shape) == (-(-shape[0] // block[0]), -(-shape[1] // block[1]))

    deq = dequantize_block_fp8(q, scale, block)
    assert deq.dtype == torch.float32
    assert torch.equal(deq, _loop_dequant(q, scale, block))
    # e4m3: 3 mantissa bits → relative error ≤ 2^-4 for normals; absolute ≤ half the subnormal step below.
    per_elem = scale.repeat_interleave(block[0], 0)[: shape[0]].repeat_interleave(block[1], 1)[:, : shape[1]]
    bound = w.abs() * 2**-4 + per_elem * 2**-9
    assert ((deq - w).abs() <= bound).all()


def test_block_maximum_maps_to_448_and_scale_is_amax_over_448() -> None:
    w = torch.zeros(4, 6)
    w[1, 2] = -3.5  # block (0, 0) with block (2, 3)
    w[3, 5] = 0.25  # block (1, 1)
    q, scale = quantize_block_fp8(w, (2, 3))
    assert torch.equal(scale, torch.tensor([[3.5 / FP8_E4M3_MAX, 1.0], [1.0, 0.25 / FP8_E4M3_MAX]]))
    assert q[1, 2].float() == -FP8_E4M3_MAX and q[3, 5].float() == FP8_E4M3_MAX
    deq = dequantize_block_fp8(q, scale, (2, 3))
    assert torch.equal(deq, w)  # the amax elements and zeros are exact


def test_all_zero_weight_gets_unit_scale() -> None:
    q, scale = quantize_block_fp8(torch.zeros(10, 10), (4, 4))
    assert torch.equal(scale, torch.ones(3, 3))
    assert torch.equal(dequantize_block_fp8(q, scale, (4, 4)), torch.zeros(10, 10))


def test_requantizing_a_dequantized_weight_is_lossless() -> None:
    torch.manual_seed(1)
    q, scale = quantize_block_fp8(torch.randn(70, 90), (32, 32))
    deq = dequantize_block_fp8(q, scale, (32, 32))
    q2, scale2 = quantize_block_fp8(deq, (32, 32))
    assert torch.equal(scale2, scale)
    assert torch.equal(dequantize_block_fp8(q2, scale2, (32, 32)), deq)


def test_accepts_bf16_input_and_scales() -> None:
    w = torch.randn(20, 20).to(torch.bfloat16)
    q, scale = quantize_block_fp8(w, (8, 8))
    s16 = scale.to(torch.bfloat16)
    per_elem = s16.float().repeat_interleave(8, 0)[:20].repeat_interleave(8, 1)[:, :20]
    assert torch.equal(dequantize_block_fp8(q, s16, (8, 8)), q.float() * per_elem)


def test_errors_name_the_shapes() -> None:
    q, scale = quantize_block_fp8(torch.randn(300, 200))
    with pytest.raises(ValueError, match=r"scale_inv has shape \[2, 2\], expected \[3, 2\]"):
        dequantize_block_fp8(q, scale[:2])
    with pytest.raises(ValueError, match="must be 2-D"):
        dequantize_block_fp8(q.reshape(3, 100, 200), scale)
    with pytest.raises(ValueError, match="must be 2-D"):
        quantize_block_fp8(torch.randn(4))
    with pytest.raises(ValueError, match="weight_block_size"):
        quantize_block_fp8(torch.randn(4, 4), (0, 4))
