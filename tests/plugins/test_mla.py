"""nextn's CPU MLA op (DeepSeek-V3's and GLM-4.7-Flash's attention, absorbed), on every ISA variant this CPU runs:
against the PyTorch reference (bf16 and f32, latent and head sizes that are not multiples of 16, a tree mask),
bit-identical whatever the batch and however the tokens are split into calls (a verify step's K + 1 rows equal
K + 1 plain steps), and bad slots refused; `kv_b` in int8 with per-row scales (a weight-quantized engine's) against
the reference of its dequantized weight."""

from __future__ import annotations

import pytest
import torch

from nextn.models.attention_metadata import AttentionMetadata, slots_for_positions
from nextn.plugins import cpu_kernels, mla

pytestmark = [pytest.mark.skipif(not cpu_kernels.available(),
                                 reason=f"nextn's CPU kernels unavailable: {cpu_kernels.unavailable_reason()}"),
              pytest.mark.usefixtures("kernel_variant")]

BLOCK = 16


def _case(b, t, nh, p, r, v, c, ctx, dtype=torch.float32, seed=0):
    """(q_nope, q_pe, kv_b, kv_cache, block tables): `ctx` cached tokens before the `t` queried ones."""
    gen = torch.Generator().manual_seed(seed)
    per = -(-(ctx + t) // BLOCK)
    tables = torch.randperm(b * per, generator=gen).add(1).reshape(b, per)  # blocks scattered through the cache
    kv = torch.randn((1 + b * per) * BLOCK, c + r, generator=gen).to(dtype)
    q_nope = torch.randn(b, t, nh, p, generator=gen).to(dtype)
    q_pe = torch.randn(b, t, nh, r, generator=gen).to(dtype)
    kv_b = (torch.randn(nh, p + v, c, generator=gen) * c ** -0.5).to(dtype)
    return q_nope, q_pe, kv_b, kv, tables


def _meta(tables, positions):
    return AttentionMetadata.create(positions, slots_for_positions(tables, positions, BLOCK), tables, BLOCK)


@pytest.mark.parametrize("b,t,nh,p,r,v,c,ctx,dtype", [
    (1, 1, 4, 16, 16, 16, 32, 5, torch.float32), (3, 5, 20, 24, 8, 40, 48, 37, torch.float32),
    (2, 3, 20, 192, 64, 256, 512, 70, torch.bfloat16), (1, 40, 9, 16, 16, 16, 32, 0, torch.float32)])
def test_matches_the_reference(b, t, nh, p, r, v, c, ctx, dtype):
    q_nope, q_pe, kv_b, kv, tables = _case(b, t, nh, p, r, v, c, ctx, dtype)
    meta = _meta(tables, (torch.arange(t) + ctx).expand(b, -1))
    got = cpu_kernels.ops().mla_attention(q_nope, q_pe, kv_b, kv, meta.context_slots, meta.visible, 0.1)
    want = mla.reference(q_nope, q_pe, kv_b, kv, meta.context_slots, meta.visible, 0.1)
    assert got.shape == (b, t, nh * v) and got.dtype == torch.float32
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_a_tree_mask():
    """Medusa-style tree rows (each sees the context and its ancestors) as the reference computes them."""
    q_nope, q_pe, kv_b, kv, tables = _case(2, 4, 4, 16, 16, 16, 32, 9)
    tree = torch.tensor([[1, 0, 0, 0], [1, 1, 0, 0], [1, 0, 1, 0], [1, 1, 0, 1]], dtype=torch.bool)
    kv_lens = torch.tensor([9, 9])
    pos = kv_lens[:, None] + torch.tensor([0, 1, 1, 2])  # rope positions: kv_len + depth
    slots = slots_for_positions(tables, kv_lens[:, None] + torch.arange(4), BLOCK)
    meta = AttentionMetadata.create_tree(pos, slots, tables, BLOCK, kv_lens, tree)
    got = cpu_kernels.ops().mla_attention(q_nope, q_pe, kv_b, kv, meta.context_slots, meta.visible, 0.2)
    want = mla.reference(q_nope, q_pe, kv_b, kv, meta.context_slots, meta.visible, 0.2)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("b,t,nh,p,r,v,c,ctx,dtype", [
    (3, 5, 20, 24, 8, 40, 48, 37, torch.float32), (2, 3, 20, 192, 64, 256, 512, 70, torch.bfloat16)])
def test_int8_kv_b_matches_the_reference_of_its_dequantized_weight(b, t, nh, p, r, v, c, ctx, dtype):
    """kv_b as int8 rows times f32 scales: the reference on q · scale (f32), within f32 rounding; and within int8's
    rounding (~1 %) of the unquantized weight's output, while a control with the scales dropped is far off."""
    q_nope, q_pe, kv_b, kv, tables = _case(b, t, nh, p, r, v, c, ctx, dtype)
    meta = _meta(tables, (torch.arange(t) + ctx).expand(b, -1))
    q8, scale = mla.quantize_kv_b(kv_b)
    assert q8.dtype == torch.int8 and q8.shape == kv_b.shape and scale.shape == (nh, p + v)
    got = cpu_kernels.ops().mla_attention(q_nope, q_pe, q8, kv, meta.context_slots, meta.visible, 0.1, scale)
    dequantized = q8.float() * scale[..., None]
    want = mla.reference(q_nope, q_pe, dequantized, kv, meta.context_slots, meta.visible, 0.1)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    exact = mla.reference(q_nope, q_pe, kv_b, kv, meta.context_slots, meta.visible, 0.1)
    assert (got - exact).norm() / exact.norm() < 0.03
    unscaled = cpu_kernels.ops().mla_attention(q_nope, q_pe, q8, kv, meta.context_slots, meta.visible, 0.1,
                                               torch.ones_like(scale))
    assert (unscaled - exact).norm() / exact.norm() > 1.0


def test_quantize_kv_b_rounds_each_row_to_its_own_step():
    w = torch.randn(3, 10, 48) * torch.tensor([1e-3, 1.0, 30.0])[:, None, None]
    w[1, 4] = 0.0  # an all-zero row: scale 1, values 0
    q8, scale = mla.quantize_kv_b(w)
    assert scale[1, 4] == 1.0 and not q8[1, 4].any()
    assert q8.abs().max() == 127
    assert ((q8.float() * scale[..., None] - w).abs() <= scale[..., None] / 2 + 1e-6 * w.abs()).all()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.int8])
def test_rows_and_token_splits_are_bit_identical(dtype):
    """Each sequence alone and in the batch, and its 5 tokens in one call (a verify step) or one call each (plain
    steps over the same cache), give the same bits; more heads than one task holds (int8: bf16 activations and cache,
    kv_b int8 with its scales)."""
    q_nope, q_pe, kv_b, kv, tables = _case(3, 5, 20, 32, 16, 32, 64, 21,
                                           torch.bfloat16 if dtype == torch.int8 else dtype)
    scale = None
    if dtype == torch.int8:
        kv_b, scale = mla.quantize_kv_b(kv_b)

    def op(*args):
        return cpu_kernels.ops().mla_attention(*args, scale)

    pos = (torch.arange(5) + 21).expand(3, -1)
    meta = _meta(tables, pos)
    batch = op(q_nope, q_pe, kv_b, kv, meta.context_slots, meta.visible, 0.1)
    for s in range(3):
        one = _meta(tables[s:s + 1], pos[s:s + 1])
        alone = op(q_nope[s:s + 1], q_pe[s:s + 1], kv_b, kv, one.context_slots, one.visible, 0.1)
        assert torch.equal(alone, batch[s:s + 1])
        for t in range(5):
            step = _meta(tables[s:s + 1], pos[s:s + 1, t:t + 1])
            out = op(q_nope[s:s + 1, t:t + 1], q_pe[s:s + 1, t:t + 1], kv_b, kv, step.context_slots, step.visible, 0.1)
            assert torch.equal(out, batch[s:s + 1, t:t + 1])


def test_bad_arguments_are_refused():
    q_nope, q_pe, kv_b, kv, tables = _case(1, 2, 4, 16, 16, 16, 32, 3)
    meta = _meta(tables, torch.tensor([[3, 4]]))
    with pytest.raises(RuntimeError, match="out of range"):
        cpu_kernels.ops().mla_attention(q_nope, q_pe, kv_b, kv, meta.context_slots + 10_000, meta.visible, 0.1)
    with pytest.raises(RuntimeError, match="must all be bfloat16 or all float32"):
        cpu_kernels.ops().mla_attention(q_nope.bfloat16(), q_pe, kv_b, kv, meta.context_slots, meta.visible, 0.1)
    with pytest.raises(RuntimeError, match="kv_b int8 with kv_b_scale"):
        cpu_kernels.ops().mla_attention(q_nope, q_pe, mla.quantize_kv_b(kv_b)[0], kv, meta.context_slots,
                                        meta.visible, 0.1)
    with pytest.raises(RuntimeError, match=r"kv_b_scale must be a contiguous \[NH, P \+ V\]"):
        q8, scale = mla.quantize_kv_b(kv_b)
        cpu_kernels.ops().mla_attention(q_nope, q_pe, q8, kv, meta.context_slots, meta.visible, 0.1, scale[:, 1:])
    with pytest.raises(RuntimeError, match=r"\[slots, C \+ R\]"):
        cpu_kernels.ops().mla_attention(q_nope, q_pe, kv_b, kv[:, :-1].contiguous(), meta.context_slots,
                                        meta.visible, 0.1)
