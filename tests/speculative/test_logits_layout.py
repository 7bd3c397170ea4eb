"""The logits a step hands to `LogitsProcessing` need not be row-contiguous (a batch's logits can come back with
strides like (1, B·V, B) when other requests share the step). Every consumer — repetition penalty, frequency /
presence penalties, logit bias, min_tokens, grammar masks (eager and lazy), log-probabilities — must give the same
result on such a layout as on a contiguous copy, and a guided row's mask must land on that row only (issue 57,
item 1: xgrammar's CPU kernel assumes contiguous rows, so a strided tensor had half of one row's mask land on the
next, or `view` failed)."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("xgrammar")

from nextn.speculative.logits_processing import (  # noqa: E402
    LogitsProcessing,
    _apply_inplace,
    apply_bitmask,
    token_logprobs,
)

B, T = 3, 3
NEG_INF = float("-inf")


def _layouts(b: int, t: int, v: int, dtype=torch.float32, seed: int = 0) -> dict[str, torch.Tensor]:
    """The same values [b, t, v] in several memory layouts (all but the first are not row-contiguous)."""
    base = torch.randn(b, t, v, generator=torch.Generator().manual_seed(seed)).to(dtype)
    batch_inner = torch.empty(t, v, b, dtype=dtype).permute(2, 0, 1)  # strides (1, v·b, b): the layout
    batch_inner.copy_(base)
    reversed_ = torch.empty(v, t, b, dtype=dtype).permute(2, 1, 0)  # strides (1, b, b·t)
    reversed_.copy_(base)
    padded = torch.zeros(b, t, v + 7, dtype=dtype)[..., :v]  # rows v + 7 apart: contiguous within, gaps between
    padded.copy_(base)
    out = {"contiguous": base, "batch_inner": batch_inner, "reversed": reversed_, "padded": padded}
    for name, x in out.items():
        assert torch.equal(x, base) and x.is_contiguous() == (name == "contiguous"), name
    return out


def _bits(bitmask: torch.Tensor, v: int) -> torch.Tensor:
    """bitmask [..., ceil(v / 32)] int32 → allowed [..., v] bool (bit j of word j // 32)."""
    j = torch.arange(v)
    return ((bitmask[..., j // 32] >> (j % 32)) & 1).bool()


def _random_mask(t: int, v: int, seed: int, refuse: float = 0.5) -> torch.Tensor:
    """[t, ceil(v / 32)] int32 with about `refuse` of the tokens disallowed; the bits past v are left clear (the
    kernel wrapper must not let them leak into the next row)."""
    gen = torch.Generator().manual_seed(seed)
    allowed = torch.rand(t, v, generator=gen) >= refuse
    allowed[:, 0] = True  # some token is always allowed
    words = torch.zeros(t, (v + 31) // 32, dtype=torch.int64)
    for j in range(v):
        words[:, j // 32] |= allowed[:, j].long() << (j % 32)
    words = torch.where(words >= 2 ** 31, words - 2 ** 32, words)
    return words.to(torch.int32)


def _processing(v: int, t: int, lazy: tuple = (), guided: bool = True) -> LogitsProcessing:
    """A mixed batch of B = 3 rows over t planned positions:
    row 0: plain sampled request with a repetition penalty and frequency / presence penalties (ragged: its drafts
           reach only positions 0..1, so nothing at position 2);
    row 1: guided (grammar bitmask on every position, the last position all-allowed: beyond its first rejected
           draft; without `guided`: no grammar), plus a logit bias;
    row 2: logit bias on every position and min_tokens (−inf on its stop token 0) on position 0 only."""
    mult = [(0, 0, 7, 1.8), (0, 0, 11, 1.8), (0, 1, 7, 1.8), (0, 1, 11, 1.8), (0, 1, 3, 1.8)]
    add = [(0, 0, 7, -0.8), (0, 1, 7, -1.3), (0, 1, 3, -0.8),  # frequency / presence
           (1, 0, 5, 2.5), (1, 1, 5, 2.5), (1, 2, 5, 2.5), (1, 2, 5, 1.0),  # logit bias (repeated: they add up)
           (2, 0, 9, 4.0), (2, 1, 9, 4.0), (2, 2, 9, 4.0), (2, 0, 0, NEG_INF)]  # bias; min_tokens on position 0
    mask = _random_mask(t, v, seed=v)
    mask[-1] = -1
    idx = lambda e: torch.tensor([x[:3] for x in e], dtype=torch.int64).view(-1, 3)  # noqa: E731
    val = lambda e: torch.tensor([x[3] for x in e], dtype=torch.float32)  # noqa: E731
    rows, masks = (torch.tensor([1]), mask[None]) if guided else (torch.zeros(0, dtype=torch.int64), mask[None][:0])
    return LogitsProcessing(idx(mult), val(mult), idx(add), val(add), rows, masks, lazy)


def _reference(p: LogitsProcessing, logits: torch.Tensor) -> torch.Tensor:
    """What `apply` must compute, in plain PyTorch on a contiguous copy (no xgrammar)."""
    out = logits.float().contiguous().clone()
    t_max, v = out.shape[1], out.shape[2]
    for (b, t, tok), r in zip(p.mult_index.tolist(), p.mult_value.tolist()):
        if t < t_max:
            x = out[b, t, tok]
            out[b, t, tok] = x / r if x > 0 else x * r
    for (b, t, tok), a in zip(p.add_index.tolist(), p.add_value.tolist()):
        if t < t_max:
            out[b, t, tok] += a
    for row, mask in zip(p.mask_rows.tolist(), p.bitmask):
        out[row] = out[row].masked_fill(~_bits(mask[:t_max], v), NEG_INF)
    return out


@pytest.mark.parametrize("v", [128, 100])  # 100: the last bitmask word is partial
@pytest.mark.parametrize("t_max", [T, 1])  # 1: a prefill's last row (the case `view` let through, silently wrong)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_mixed_batch_is_layout_independent(v, t_max, dtype):
    p = _processing(v, T)
    layouts = _layouts(B, t_max, v, dtype)
    want = _reference(p, layouts["contiguous"])
    allowed = _bits(p.bitmask[0, :t_max], v)
    for name, logits in layouts.items():
        before = logits.clone()
        got = p.apply(logits)
        assert got.dtype == torch.float32 and got.is_contiguous(), name
        assert got.data_ptr() != logits.data_ptr() and torch.equal(logits, before), name  # a new tensor
        assert torch.equal(got, want), name
        # the guided row is −inf exactly where its bits are clear, and nowhere else
        assert torch.equal(torch.isneginf(got[1]), ~allowed), name
        # the other rows: only their own processing, never a mask
        assert not torch.isneginf(got[0]).any(), name
        assert torch.isneginf(got[2]).nonzero().tolist() == [[0, 0]], name  # min_tokens: stop token, position 0
        untouched = torch.ones(B, t_max, v, dtype=torch.bool)
        untouched[0, :, [3, 7, 11]] = False
        untouched[1] = False
        untouched[2, :, [0, 9]] = False
        assert torch.equal(got[untouched], logits.float()[untouched]), name


@pytest.mark.parametrize("guided", [True, False])
@pytest.mark.parametrize("v", [128, 100])
def test_lazy_greedy_grammar_row_beside_sampled_rows(v, guided):
    """A greedy guided row (lazy masks from its unmasked argmax) beside a sampled guided row (or, without
    `guided`, a plain one) and a penalised one."""
    refused = _random_mask(T, v, seed=7, refuse=0.9)
    asked = []

    def masks_for(top):
        asked.append(list(top))
        allowed = _bits(refused, v)
        out = torch.full((T, refused.shape[-1]), -1, dtype=torch.int32)
        hit = [j for j in range(len(top)) if not allowed[j, top[j]]]
        out[hit] = refused[hit]
        return out if hit else None

    p = _processing(v, T, lazy=((2, masks_for),), guided=guided)
    layouts = _layouts(B, T, v, seed=3)
    want = _reference(p, layouts["contiguous"])
    allowed = _bits(refused, v)
    top = want[2].argmax(-1)
    for j in range(T):
        if not allowed[j, top[j]]:
            want[2, j] = want[2, j].masked_fill(~allowed[j], NEG_INF)
    for name, logits in layouts.items():
        asked.clear()
        got = p.apply(logits)
        assert asked == [top.tolist()], name
        assert torch.equal(got, want), name


@pytest.mark.parametrize("v", [128, 100])
def test_apply_bitmask_and_logprobs_are_layout_independent(v):
    mask = _random_mask(B * T, v, seed=11).view(B, T, -1)
    layouts = _layouts(B, T, v, seed=5)
    want = layouts["contiguous"].masked_fill(~_bits(mask, v), NEG_INF)
    tokens = torch.tensor([[1, 2, 3], [0, 0, 0], [4, 5, 6]])
    temperature = torch.tensor([0.0, 0.7, 1.3])  # greedy and sampled rows in one batch
    ref = token_logprobs(layouts["contiguous"], tokens, temperature, 4)
    for name, logits in layouts.items():
        got = apply_bitmask(logits, mask)
        assert got.is_contiguous() and torch.equal(got, want), name
        for a, b in zip(token_logprobs(logits, tokens, temperature, 4), ref):
            torch.testing.assert_close(a, b, rtol=0, atol=1e-6)
        # logprobs off for the batch (k = 0): the same chosen log-probabilities, no top
        chosen, top_lp, top_ids = token_logprobs(logits, tokens, temperature, 0)
        torch.testing.assert_close(chosen, ref[0], rtol=0, atol=1e-6)
        assert top_lp.shape == (B, T, 0) and top_ids.shape == (B, T, 0)


def test_the_kernel_boundary_refuses_strided_rows():
    """The layout is a checked contract: `_apply_inplace` raises rather than mask the wrong row."""
    v = 64
    mask = torch.zeros(2, 2, dtype=torch.int32)
    strided = torch.zeros(v, 2).t()  # [2, v], strides (1, 2)
    with pytest.raises(ValueError, match="contiguous rows"):
        _apply_inplace(strided, mask, None)
    with pytest.raises(ValueError, match="contiguous rows"):
        _apply_inplace(torch.zeros(2, v + 8)[:, :v], mask, None)
    with pytest.raises(ValueError, match="contiguous rows"):
        _apply_inplace(torch.zeros(2, v), torch.zeros(2, 4, dtype=torch.int32)[:, :2], None)
    with pytest.raises(ValueError, match="contiguous rows"):
        _apply_inplace(torch.zeros(1, 2, v), mask, None)
    ok = torch.zeros(2, v)
    _apply_inplace(ok, mask, [1])
    assert torch.isfinite(ok[0]).all() and torch.isneginf(ok[1]).all()
