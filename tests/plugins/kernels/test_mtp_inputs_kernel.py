"""MTP input kernels: the next step's inputs and MTP Vanilla's window against their references."""

from __future__ import annotations

import pytest
import torch


def test_next_step_inputs_hand_worked(kernels):
    from nextn.plugins.kernels.mtp_inputs import next_step_inputs

    tokens = torch.tensor([[5, 6, 7], [8, 9, 10]])
    num_emitted = torch.tensor([3, 1])  # all drafts accepted (+ bonus); all rejected
    ids, positions, kv_lens = next_step_inputs(tokens, num_emitted, torch.tensor([[1, 2], [3, 4]]),
                                               torch.tensor([10, 4]))
    assert ids.tolist() == [[7, 1, 2], [8, 3, 4]]
    assert kv_lens.tolist() == [13, 5]
    assert positions.tolist() == [[13, 14, 15], [5, 6, 7]]


@pytest.mark.parametrize("batch", [1, 3, 5])
@pytest.mark.parametrize("k", [1, 2, 3])
def test_next_step_inputs_match_reference(kernels, batch, k):
    from nextn.plugins.kernels.mtp_inputs import next_step_inputs, next_step_inputs_reference

    gen = torch.Generator().manual_seed(batch * 10 + k)
    tokens = torch.randint(0, 100, (batch, k + 1), generator=gen)
    num_emitted = torch.randint(1, k + 2, (batch,), generator=gen)
    drafts = torch.randint(0, 100, (batch, k), generator=gen)
    kv_lens = torch.randint(0, 50, (batch,), generator=gen)
    for got, want in zip(next_step_inputs(tokens, num_emitted, drafts, kv_lens),
                         next_step_inputs_reference(tokens, num_emitted, drafts, kv_lens)):
        assert torch.equal(got, want)


def test_vanilla_window_hand_worked(kernels):
    from nextn.plugins.kernels.mtp_inputs import mtp_vanilla_window

    pool_t, new_t = torch.tensor([[1, 2, 3]]), torch.tensor([[4, 5, 6]])
    pool_h, new_h = torch.arange(6.0).view(1, 3, 2), 10 + torch.arange(6.0).view(1, 3, 2)
    for n, rows in [(1, [1, 2, 3]), (3, [3, 4, 5])]:  # all rejected: one new row; all accepted: all new
        tok, hid, pos = mtp_vanilla_window(pool_t, pool_h, new_t, new_h, torch.tensor([n]), torch.tensor([20]))
        assert tok[0].tolist() == [([1, 2, 3] + [4, 5, 6])[r] for r in rows]
        assert hid[0].tolist() == [torch.cat([pool_h, new_h], 1)[0, r].tolist() for r in rows]
        assert pos[0].tolist() == [20 + n - 3 + i for i in range(3)]  # ends at the last accepted position


@pytest.mark.parametrize("batch,k,hidden", [(1, 1, 8), (3, 2, 40), (5, 3, 300)])
def test_vanilla_window_matches_reference(kernels, batch, k, hidden):
    from nextn.plugins.kernels.mtp_inputs import mtp_vanilla_window, mtp_vanilla_window_reference

    gen = torch.Generator().manual_seed(batch * 10 + k)
    w = k + 1
    args = (torch.randint(0, 100, (batch, w), generator=gen), torch.randn(batch, w, hidden, generator=gen),
            torch.randint(0, 100, (batch, w), generator=gen), torch.randn(batch, w, hidden, generator=gen),
            torch.randint(1, w + 1, (batch,), generator=gen), torch.randint(0, 50, (batch,), generator=gen))
    for got, want in zip(mtp_vanilla_window(*args), mtp_vanilla_window_reference(*args)):
        assert torch.equal(got, want)
