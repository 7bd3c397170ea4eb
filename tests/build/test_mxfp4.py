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


def test_a_checkpoint_reads_pairs_as_one_weight_and_refuses_malformed_blocks(tmp_path):
    """`quant_method: mxfp4`: `W_blocks` + `W_scales` are listed as `W` ([E, in, out] f32, one expert readable
    alone); blocks that are not U8 [..., rows, groups, 16] are refused by name."""
    import json

    from safetensors.torch import save_file

    from nextn.build.checkpoint import CheckpointError, CheckpointReader

    blocks = torch.randint(0, 256, (2, 3, 1, 16), dtype=torch.uint8)
    scales = torch.full((2, 3, 1), 127, dtype=torch.uint8)
    save_file({"w_blocks": blocks, "w_scales": scales, "bad_blocks": torch.zeros(2, 3, dtype=torch.uint8),
               "bad_scales": torch.zeros(2, dtype=torch.uint8)}, tmp_path / "model.safetensors")
    (tmp_path / "config.json").write_text(json.dumps({"quantization_config": {"quant_method": "mxfp4"}}))
    reader = CheckpointReader(tmp_path)
    assert sorted(reader.names()) == ["bad", "w"] and reader.tensor_info("w") == ("F32", [2, 32, 3])
    assert torch.equal(reader.get("w", 1), dequantize_mxfp4(blocks[1], scales[1]).T)
    with pytest.raises(CheckpointError, match="'bad_blocks'.*U8"):
        reader.tensor_info("bad")
