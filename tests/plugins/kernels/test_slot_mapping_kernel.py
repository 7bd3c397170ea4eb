"""Slot mapping and KV-length rewind kernels against their references (and hand-worked slots)."""

from __future__ import annotations

import pytest
import torch


def test_hand_worked_slots_with_padding_and_null_block(kernels):
    from nextn.plugins.kernels.slot_mapping import slot_mapping, slot_mapping_reference

    tables = torch.tensor([[3, 7, 0], [5, 0, 0]])
    positions = torch.tensor([[0, 3, 4, 9], [2, -1, 3, 1]])
    valid = torch.tensor([[True, True, True, True], [True, True, True, False]])
    # block size 4: row 0 → 3·4+0, 3·4+3, 7·4+0, block index 2 (table entry 0) → 0·4+1; row 1: pads → 0
    expected = [[12, 15, 28, 1], [22, 0, 23, 0]]
    assert slot_mapping(tables, positions, 4, valid).tolist() == expected
    assert slot_mapping_reference(tables, positions, 4, valid).tolist() == expected
    assert slot_mapping(tables, positions, 4).tolist() == [[12, 15, 28, 1], [22, 0, 23, 21]]


@pytest.mark.parametrize("batch", [1, 3, 5])
@pytest.mark.parametrize("k", [1, 2, 3])
@pytest.mark.parametrize("block_size", [1, 4, 16])
def test_matches_reference_over_shapes(kernels, batch, k, block_size):
    from nextn.plugins.kernels.slot_mapping import slot_mapping, slot_mapping_reference

    gen = torch.Generator().manual_seed(batch * 100 + k * 10 + block_size)
    max_blocks = 6
    tables = torch.randint(1, 50, (batch, max_blocks), generator=gen)
    kv_lens = torch.randint(0, max_blocks * block_size - k, (batch,), generator=gen)
    positions = kv_lens[:, None] + torch.arange(k + 1)  # K+1 verify positions, often across a block boundary
    positions[0, -1] = -1  # a pad
    valid = torch.rand(batch, k + 1, generator=gen) < 0.8
    for v in (None, valid):
        assert torch.equal(slot_mapping(tables, positions, block_size, v),
                           slot_mapping_reference(tables, positions, block_size, v))


def test_long_rows_span_several_programs(kernels):
    from nextn.plugins.kernels.slot_mapping import slot_mapping, slot_mapping_reference

    tables = torch.arange(1, 3 * 40 + 1).view(3, 40)
    positions = torch.arange(300).expand(3, -1).clone()  # 300 > one 128-wide program
    positions[1, 250:] = -1
    assert torch.equal(slot_mapping(tables, positions, 8), slot_mapping_reference(tables, positions, 8))


def test_rewind(kernels):
    from nextn.plugins.kernels.slot_mapping import rewind_kv_lens, rewind_kv_lens_reference

    kv, n = torch.tensor([10, 0, 7]), torch.tensor([1, 4, 2])
    assert rewind_kv_lens(kv, n).tolist() == [11, 4, 9] == rewind_kv_lens_reference(kv, n).tolist()
