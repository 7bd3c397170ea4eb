"""MXFP4 weights as gpt-oss's HF checkpoints store them (openai/gpt-oss-20b's config.json: `quant_method: mxfp4`).

MXFP4 is the OCP Microscaling format (OCP MX specification v1.0, 2023): blocks of 32 FP4 (E2M1) elements sharing one
E8M0 scale. A checkpoint stores a weight `W` of logical shape [..., rows, cols] as two tensors:

    W_blocks  [..., rows, cols / 32, 16] uint8   two E2M1 codes per byte, the even column in the low nibble
    W_scales  [..., rows, cols / 32]     uint8   the block's power of two, biased by 127

so W[..., r, 32·g + j] = E2M1(code j of block g) · 2^(scale[..., r, g] − 127). gpt-oss's experts store the
[out, in] orientation this way (`gate_up_proj_blocks` [E, 2·intermediate, hidden / 32, 16]); the unquantized
checkpoints hold the same weights as [E, in, out] (`gate_up_proj` [E, hidden, 2·intermediate]).
"""

from __future__ import annotations

import torch

#: Elements per block, and bytes per block of FP4 codes.
BLOCK = 32
BLOCK_BYTES = BLOCK // 2
#: The value of each E2M1 code 0..15: sign bit 3, exponent bits 2..1, mantissa bit 0 (OCP MX v1.0, table 5).
E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)
#: E8M0's bias; code 255 is NaN.
SCALE_BIAS = 127


def dequantize_mxfp4(blocks: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """The float32 values of MXFP4 `blocks` with their `scales` (exact: every value is a float32).

    Args:
        blocks: [..., rows, groups, 16] uint8, two E2M1 codes per byte (low nibble first).
        scales: [..., rows, groups] uint8, E8M0 (2^(s − 127)).
    Returns:
        [..., rows, groups · 32] float32.
    Raises:
        ValueError: the dtypes are not uint8, the last dimension of `blocks` is not 16, the shapes disagree, or a
            scale is 255 (E8M0's NaN).
    """
    if blocks.dtype != torch.uint8 or scales.dtype != torch.uint8:
        raise ValueError(f"MXFP4 blocks and scales are uint8, got {blocks.dtype} and {scales.dtype}")
    if blocks.dim() < 2 or blocks.shape[-1] != BLOCK_BYTES or tuple(blocks.shape[:-1]) != tuple(scales.shape):
        raise ValueError(f"MXFP4 blocks {list(blocks.shape)} and scales {list(scales.shape)} do not match: blocks "
                         f"are [..., rows, groups, {BLOCK_BYTES}] and scales [..., rows, groups]")
    if bool((scales == 255).any()):
        raise ValueError("an MXFP4 scale is 255, E8M0's NaN: the checkpoint is corrupt")
    lut = torch.tensor(E2M1_VALUES, dtype=torch.float32)
    codes = torch.stack((blocks & 0x0F, blocks >> 4), dim=-1).to(torch.int64)  # [..., groups, 16, 2]
    values = lut[codes].flatten(-3)  # [..., rows, groups · 32]
    exponent = (scales.to(torch.int32) - SCALE_BIAS).repeat_interleave(BLOCK, dim=-1)
    return torch.ldexp(values, exponent)
