"""Per-position logit processing inside a verify step: penalties, logit bias, min_tokens and grammar masks.

Speculation stays lossless under processing because each verified position j of a request is processed with the
state that plain decoding would have there: the tokens emitted before the step plus the drafts d1..dj before it
(token counts for the penalties, the output length for min_tokens, the grammar state after d1..dj). The acceptance
rule then sees the processed target distribution: a draft the grammar forbids has probability 0 and is rejected
like any other, and the bonus token is drawn from the processed (masked) distribution.

Applied in this order, as vLLM's sampler does (`v1/sample/sampler.py`): repetition penalty (HF/CTRL, Keskar et al.
2019: a seen token's logit is divided by r when positive, multiplied by r when not), then the additive terms
(frequency and presence penalties as OpenAI defines them, `logit_bias`, −inf on stop tokens before `min_tokens`),
then the grammar's token bitmask (xgrammar's layout: bit v of word v // 32 set = token v allowed). Temperature,
top-k and top-p come after, in the acceptance rule.

The host builds a `LogitsProcessing` from each request's state (runtime/logits_processors.py); everything here is
sparse index work on the logits, so a batch whose requests use none of it pays nothing.
"""

from __future__ import annotations

from dataclasses import dataclass, fields, replace

import torch

__all__ = ["LogitsProcessing", "apply_bitmask", "token_logprobs"]


@dataclass(frozen=True)
class LogitsProcessing:
    """What to do to a step's target logits [B, T, V] (T = K+1 verified positions, or 1 for a prefill's last row).

    Attributes:
        mult_index: [M, 3] int64 (batch row, position, token) of tokens under the repetition penalty;
            mult_value: [M] fp32 the penalty r > 0 of each.
        add_index: [N, 3] int64 (batch row, position, token); add_value: [N] fp32 added (−inf masks a token).
            Indices may repeat: the values add up.
        mask_rows: [R] int64 batch rows under a grammar; bitmask: [R, T, ceil(V / 32)] int32 (bit set = allowed).
        lazy: (batch row, masks_for(top)) for greedy grammar rows without log-probabilities, which need only the
            argmax of their masked logits — the unmasked argmax wherever the grammar allows it. Given the row's
            unmasked argmax per position (a list), `masks_for` returns [T, ceil(V / 32)] int32 masks filled only
            where the grammar refuses it (−1 elsewhere), or None (runtime/logits_processors.py
            `masks_where_refused`). A host call inside the step: such steps run eagerly.
    """

    mult_index: torch.Tensor
    mult_value: torch.Tensor
    add_index: torch.Tensor
    add_value: torch.Tensor
    mask_rows: torch.Tensor
    bitmask: torch.Tensor
    lazy: tuple = ()

    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        """The processed logits [B, T, V] fp32 (a new, row-contiguous tensor; `logits` is left as it was). Entries for
        positions ≥ T are ignored (a step that verifies fewer positions than it was planned for).

        `logits` may have any strides (a batch's logits are not row-contiguous when another request shares the step,
        e.g. [B, T, V] with strides (1, B·V, B)): the copy is made row-contiguous here, the layout xgrammar's mask
        kernels take (`_apply_inplace` checks it)."""
        out = logits.float().clone(memory_format=torch.contiguous_format)
        t_max = out.shape[1]
        if self.mult_index.numel():
            b, t, v = self.mult_index[self.mult_index[:, 1] < t_max].unbind(1)
            r = self.mult_value[self.mult_index[:, 1] < t_max]
            x = out[b, t, v]
            out[b, t, v] = torch.where(x > 0, x / r, x * r)
        if self.add_index.numel():
            keep = self.add_index[:, 1] < t_max
            b, t, v = self.add_index[keep].unbind(1)
            out.index_put_((b, t, v), self.add_value[keep], accumulate=True)
        if self.mask_rows.numel():  # in place, through xgrammar's kernel, on the masked rows' positions only
            b, t, v = out.shape
            full = torch.full((b, t, self.bitmask.shape[-1]), -1, dtype=torch.int32, device=out.device)
            full[self.mask_rows] = self.bitmask[:, :t_max].to(out.device)
            flat = (self.mask_rows[:, None] * t + torch.arange(t, device=self.mask_rows.device)).flatten()
            _apply_inplace(out.view(b * t, v), full.view(b * t, -1), flat.tolist())
        if self.lazy:
            self._apply_lazy(out)
        return out

    def _apply_lazy(self, out: torch.Tensor) -> None:
        """The lazy rows' masks, in place: their unmasked argmax read back, masks filled where it is refused."""
        b, t, v = out.shape
        rows = [row for row, _ in self.lazy]
        tops = out[rows].argmax(-1).tolist()
        masked, masks = [], []
        for (row, masks_for), top in zip(self.lazy, tops):
            m = masks_for(top)
            if m is not None:
                masked.append(row)
                masks.append(m[:t])
        if masked:
            idx = torch.tensor(masked, dtype=torch.int64)
            block = out[idx].contiguous().view(len(masked) * t, v)
            _apply_inplace(block, torch.stack(masks).view(len(masked) * t, -1).to(out.device), None)
            out[idx] = block.view(len(masked), t, v)

    def to(self, device: torch.device | str) -> LogitsProcessing:
        return replace(self, **{f.name: getattr(self, f.name).to(device) for f in fields(self) if f.name != "lazy"})


def apply_bitmask(logits: torch.Tensor, bitmask: torch.Tensor) -> torch.Tensor:
    """logits [..., V] with every token whose bit is clear in bitmask [..., ceil(V / 32)] int32 set to −inf (a new
    fp32 tensor, row-contiguous whatever the strides of `logits`)."""
    v = logits.shape[-1]
    out = logits.float().clone(memory_format=torch.contiguous_format)
    _apply_inplace(out.view(-1, v), bitmask.reshape(-1, bitmask.shape[-1]).contiguous(), None)
    return out


def _apply_inplace(logits: torch.Tensor, bitmask: torch.Tensor, rows: list[int] | None) -> None:
    """xgrammar's `apply_token_bitmask_inplace` (its CPU kernel on the host, its CUDA / Triton kernel on a GPU):
    logits [N, V] fp32, bitmask [N, ceil(V / 32)] int32; only `rows` (None: all).

    Both must be 2-D with contiguous rows: xgrammar's CPU kernel reads row i at i · stride(0) and assumes unit
    stride within it, so a column-strided tensor would have one row's mask land on the next (ValueError instead).

    Where V is not a multiple of 32 the last word's bits past V are set first: xgrammar's CPU kernel (0.2.8) masks
    the next row's token 0 when they are clear (a row [-1, -1, -1, 15] over V = 100 masks row + 1's token 0)."""
    import xgrammar

    _check_rows(logits, "logits", torch.float32)
    _check_rows(bitmask, "bitmask", torch.int32)
    if bitmask.shape[0] != logits.shape[0] and rows is None:
        raise ValueError(f"bitmask rows {bitmask.shape[0]} != logits rows {logits.shape[0]}")
    v = logits.shape[-1]
    if v % 32:
        bitmask = bitmask.clone()
        bitmask[:, v // 32] |= -(1 << (v % 32))

    xgrammar.apply_token_bitmask_inplace(logits, bitmask, vocab_size=logits.shape[-1], indices=rows)


def _check_rows(x: torch.Tensor, name: str, dtype: torch.dtype) -> None:
    """ValueError unless `x` is a 2-D `dtype` tensor whose rows are contiguous (unit stride along the last dim,
    rows `shape[1]` elements apart: what `_apply_inplace`'s kernels assume)."""
    if x.dim() != 2 or x.dtype != dtype or not x.is_contiguous():
        raise ValueError(f"{name} must be 2-D contiguous rows of {dtype}; got shape {tuple(x.shape)}, "
                         f"strides {x.stride()}, {x.dtype}")


def token_logprobs(logits: torch.Tensor, tokens: torch.Tensor, temperature: torch.Tensor, k: int
                   ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Log-probabilities of emitted tokens under the processed distribution softmax(logits / temperature)
    (temperature 0: the logits as they are), and the k most likely tokens'.

    Args:
        logits: [B, T, V] processed logits of the positions that emitted `tokens` [B, T] int64; temperature: [B].
    Returns:
        (logprob [B, T] fp32, top_logprobs [B, T, k] fp32, top_ids [B, T, k] int64), most likely first.
    """
    t = torch.where(temperature > 0, temperature, torch.ones_like(temperature)).float()
    logp = torch.log_softmax(logits.float() / t[:, None, None], dim=-1)
    chosen = logp.gather(-1, tokens[..., None].clamp(min=0))[..., 0]
    top_lp, top_ids = logp.topk(k, dim=-1) if k > 0 else (logp[..., :0], tokens[..., None][..., :0])
    return chosen, top_lp, top_ids
