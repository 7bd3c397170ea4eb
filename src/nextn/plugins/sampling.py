"""Sampling on the device: filtered probabilities, stateless per-request random numbers, inverse-CDF draws.

PyTorch references, fixed shapes, no host synchronisation. Randomness is counter-based (stateless, like Philox in
cuRAND or JAX's keyed PRNG): each uniform is a hash of (request seed, token position, stream), so a request's
samples do not depend on what else is in the batch, on the batch order, or on how many steps produced them.
"""

from __future__ import annotations

import torch

_M32 = 0xFFFFFFFF
_MIX = 0x45D9F3B  # a 32-bit avalanche multiplier (< 2^31, so int64 products never overflow)
_GOLDEN = 0x1E3779B9  # stream / counter spreading constant (< 2^31)

#: Streams keep the uniforms of different decisions at one position independent.
STREAM_SAMPLE = 1  # draw a token from a distribution (plain decoding, residual, bonus)
STREAM_ACCEPT = 2  # the accept/reject test of a draft token


def _mix32(x: torch.Tensor) -> torch.Tensor:
    """A 32-bit integer finaliser (three xor-shift / multiply rounds) on int64 tensors holding [0, 2^32)."""
    x = x ^ (x >> 16)
    x = (x * _MIX) & _M32
    x = x ^ (x >> 16)
    x = (x * _MIX) & _M32
    return x ^ (x >> 16)


def counter_uniform(seed: torch.Tensor, counter: torch.Tensor, stream: int) -> torch.Tensor:
    """Uniforms in [0, 1) keyed by (seed, counter, stream).

    Args:
        seed: [B] int64 per-request seeds (any value; folded to 32 bits).
        counter: [B, n] int64 non-negative counters (token positions).
        stream: which decision the numbers are for (STREAM_*).
    Returns:
        [B, n] fp32 with 24 random bits each.
    """
    s = ((seed ^ (seed >> 32)) & _M32)[:, None]
    x = _mix32(s ^ ((stream * _GOLDEN) & _M32))
    x = _mix32(x ^ (counter & _M32))
    x = _mix32(x ^ ((counter >> 32) & _M32) ^ _GOLDEN)
    return (x >> 8).to(torch.float32) * (1.0 / (1 << 24))


def filtered_probs(logits: torch.Tensor, temperature: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor,
                   use_filters: bool = True) -> torch.Tensor:
    """The sampling distribution per row: temperature, then top-k, then top-p (nucleus); greedy rows are one-hot.

    Args:
        logits: [R, V] fp32.
        temperature: [R] fp32; 0 = greedy (one-hot at the argmax).
        top_k: [R] int64; 0 = off, else keep the k most likely tokens.
        top_p: [R] fp32 in (0, 1]; keep the smallest set of most likely tokens whose mass reaches top_p.
        use_filters: False when no row filters (skips the sort); a host-known property of the batch.
    Returns:
        [R, V] fp32 probabilities (rows sum to 1).
    Sources: Holtzman et al. 2020 (nucleus sampling); the order temperature → top-k → top-p is vLLM's and
    TensorRT-LLM's.
    """
    greedy = temperature <= 0
    x = logits / torch.where(greedy, torch.ones_like(temperature), temperature)[:, None]
    if use_filters:
        sorted_x, order = x.sort(dim=-1, descending=True)
        ranks = torch.arange(x.shape[-1], device=x.device)
        keep = (top_k[:, None] <= 0) | (ranks[None, :] < top_k[:, None])
        sorted_x = sorted_x.masked_fill(~keep, float("-inf"))
        p_sorted = torch.softmax(sorted_x, dim=-1)
        mass_before = p_sorted.cumsum(dim=-1) - p_sorted  # mass of the strictly more likely tokens
        keep = keep & ((mass_before < top_p[:, None]) | (top_p[:, None] >= 1.0))  # top_p 1 keeps every token
        sorted_x = sorted_x.masked_fill(~keep, float("-inf"))
        x = torch.full_like(x, float("-inf")).scatter(-1, order, sorted_x)
    probs = torch.softmax(x, dim=-1)
    one_hot = torch.zeros_like(probs).scatter_(-1, logits.argmax(dim=-1, keepdim=True), 1.0)
    return torch.where(greedy[:, None], one_hot, probs)


def sample_from_probs(probs: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """Inverse-CDF draw: the first token whose cumulative probability exceeds u · total.

    Args:
        probs: [..., V] non-negative weights, not necessarily normalised, with positive mass per row.
        u: [...] uniforms in [0, 1).
    Returns:
        [...] int64 token ids; a token of zero weight is never returned from a row with positive mass.
    """
    cdf = probs.cumsum(dim=-1)
    target = u[..., None] * cdf[..., -1:]
    idx = (cdf <= target).sum(dim=-1)
    # cdf ≤ target counts every leading zero-weight token too, so idx lands on a positive-weight token.
    return idx.clamp(max=probs.shape[-1] - 1)
