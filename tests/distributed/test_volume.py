"""The per-rank bytes of a decode step (docs/ARCHITECTURE.md's table) follow the ring-collective formulas."""

from __future__ import annotations

import pytest

from benchmarks.volume import decode_step_volume


def test_deepseek_v3_tp8_batch1_k1():
    v = decode_step_volume(7168, 61, 129280, tp=8, batch=1, num_drafts=1)
    row = 7168 * 2  # bf16 hidden row
    # target: 2 rows × 61 layers; MTP Eagle: 2 rows × 1 module (K − 1 = 0 one-row steps); 2 all-reduces a layer
    assert v.layers == pytest.approx(2 * 7 / 8 * 2 * row * (2 * 61 + 2))
    assert v.embedding == pytest.approx(2 * 7 / 8 * 4 * row)
    assert v.logits == pytest.approx(7 / 8 * 4 * 129280 * 2)
    assert v.total == pytest.approx(7.2e6, rel=0.01)


def test_one_rank_sends_nothing():
    assert decode_step_volume(64, 2, 300, tp=1, batch=4, num_drafts=3).total == 0
