"""nextn's CPU gated delta rule (Gated DeltaNet's recurrence over the ring of per-request states), on every ISA
variant this CPU runs: against the PyTorch reference (outputs and the ring it keeps; fresh rows, pads, grouped value
heads, head sizes that are not multiples of 16), bit-identical whatever the batch and however the tokens are split
into calls (a verify step's K + 1 tokens equal K + 1 one-token steps), and the model path it replaces."""

from __future__ import annotations

import pytest
import torch

from nextn.plugins import cpu_kernels, gated_delta

pytestmark = [pytest.mark.skipif(not cpu_kernels.available(),
                                 reason=f"nextn's CPU kernels unavailable: {cpu_kernels.unavailable_reason()}"),
              pytest.mark.usefixtures("kernel_variant")]


def _case(b: int, t: int, h: int, dk: int, dv: int, slots: int = 5, ring: int = 4, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    q = torch.nn.functional.normalize(torch.randn(b, t, h, dk, generator=gen), dim=-1) * dk ** -0.5
    k = torch.nn.functional.normalize(torch.randn(b, t, h, dk, generator=gen), dim=-1)
    v = torch.randn(b, t, h, dv, generator=gen)
    decay = torch.rand(b, t, h, generator=gen) * 0.5 + 0.5
    beta = torch.rand(b, t, h, generator=gen)
    buf = torch.randn(slots, ring, h, dk, dv, generator=gen)
    rows = torch.randperm(slots, generator=gen)[:b]
    entry = torch.randint(0, ring, (b,), generator=gen)
    fresh = torch.arange(b) % 3 == 0
    lens = torch.randint(1, t + 1, (b,), generator=gen)
    valid = torch.arange(t)[None, :] < lens[:, None]
    return q, k, v, decay, beta, buf, rows, entry, fresh, valid


@pytest.mark.parametrize("b,t,h,dk,dv", [(1, 1, 4, 16, 16), (3, 7, 4, 16, 24), (2, 12, 2, 128, 128),
                                         (4, 3, 6, 32, 8)])
def test_matches_the_reference(b, t, h, dk, dv):
    q, k, v, decay, beta, ring, slots, entry, fresh, valid = _case(b, t, h, dk, dv)
    want_ring = ring.clone()
    want = gated_delta.reference(q, k, v, decay, beta, want_ring, slots, entry, fresh, valid)
    out = cpu_kernels.ops().gated_delta_rule(q, k, v, decay, beta, ring, slots, entry, fresh, valid)
    torch.testing.assert_close(out, want, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(ring, want_ring, rtol=1e-5, atol=1e-5)  # the last R valid tokens' states


def test_rows_and_token_splits_are_bit_identical():
    """Each row alone and in the batch, and its tokens in one call or one call each (the ring carrying the state
    between calls as a decode step's does), give the same bits."""
    q, k, v, decay, beta, ring, slots, entry, fresh, _ = _case(3, 6, 4, 32, 32, ring=6)
    valid = torch.ones(3, 6, dtype=torch.bool)
    op = cpu_kernels.ops().gated_delta_rule
    batch_ring = ring.clone()
    batch = op(q, k, v, decay, beta, batch_ring, slots, entry, fresh, valid)
    for r in range(3):
        one_ring = ring.clone()
        alone = op(q[r:r + 1], k[r:r + 1], v[r:r + 1], decay[r:r + 1], beta[r:r + 1], one_ring, slots[r:r + 1],
                   entry[r:r + 1], fresh[r:r + 1], valid[r:r + 1])
        assert torch.equal(alone, batch[r:r + 1])
        step_ring, outs = ring.clone(), []
        for t in range(6):  # one token a call: the state after token t − 1 sits at ring entry (t − 1) mod R
            start = entry[r:r + 1] if t == 0 else torch.tensor([0])
            outs.append(op(q[r:r + 1, t:t + 1], k[r:r + 1, t:t + 1], v[r:r + 1, t:t + 1], decay[r:r + 1, t:t + 1],
                           beta[r:r + 1, t:t + 1], step_ring, slots[r:r + 1], start, fresh[r:r + 1] & (t == 0),
                           valid[r:r + 1, t:t + 1]))
        assert torch.equal(torch.cat(outs, 1), batch[r:r + 1])


def test_bad_arguments_are_refused():
    q, k, v, decay, beta, ring, slots, entry, fresh, valid = _case(2, 3, 4, 16, 16)
    with pytest.raises(RuntimeError, match="out of range"):
        cpu_kernels.ops().gated_delta_rule(q, k, v, decay, beta, ring, slots + 100, entry, fresh, valid)
    with pytest.raises(RuntimeError, match="float32"):
        cpu_kernels.ops().gated_delta_rule(q.double(), k.double(), v, decay, beta, ring, slots, entry, fresh, valid)
