"""MXFP4 dequantization (build/mxfp4.py): the E2M1 code table, nibble order and E8M0 scales of the OCP MX format,
and refusals of malformed blocks."""

from __future__ import annotations

import pytest
import torch

from nextn.build.mxfp4 import dequantize_mxfp4


def test_codes_nibbles_and_scales():
    """Byte 0x71 holds code 1 (0.5, the even column) and code 7 (6.0); 0xF9: code 9 (−0.5) then code 15 (−6.0);
    scale 127 + s multiplies by 2^s."""
    blocks = torch.zeros(2, 1, 16, dtype=torch.uint8)
    blocks[:, 0, 0], blocks[:, 0, 1] = 0x71, 0xF9
    scales = torch.tensor([[127], [127 - 3]], dtype=torch.uint8)
    out = dequantize_mxfp4(blocks, scales)
    assert out.shape == (2, 32) and out.dtype == torch.float32
    assert out[0, :4].tolist() == [0.5, 6.0, -0.5, -6.0] and out[1, :4].tolist() == [0.0625, 0.75, -0.0625, -0.75]
    assert not out[:, 4:].any()


@pytest.mark.parametrize("blocks,scales,match", [
    (torch.zeros(2, 1, 16, dtype=torch.uint8), torch.full((2, 1), 255, dtype=torch.uint8), "NaN"),
    (torch.zeros(2, 1, 8, dtype=torch.uint8), torch.zeros(2, 1, dtype=torch.uint8), "do not match"),
    (torch.zeros(2, 2, 16, dtype=torch.uint8), torch.zeros(2, 1, dtype=torch.uint8), "do not match"),
    (torch.zeros(2, 1, 16, dtype=torch.int8), torch.zeros(2, 1, dtype=torch.uint8), "uint8"),
])
def test_malformed_blocks_are_refused(blocks, scales, match):
    with pytest.raises(ValueError, match=match):
        dequantize_mxfp4(blocks, scales)
