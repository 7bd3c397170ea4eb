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


#: Tokens per row the filters look at first on a CPU (`torch.topk`); a row whose nucleus is wider sorts its whole
#: vocabulary. A full sort of Qwen's 151,936 logits takes ~7 ms a row on one core, the top 256 ~0.2 ms.
CANDIDATES = 256


def filtered_probs(logits: torch.Tensor, temperature: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor,
                   use_filters: bool = True) -> torch.Tensor:
    """The sampling distribution per row: temperature, then top-k, then top-p (nucleus); greedy rows are one-hot.

    The filters keep every token whose scaled logit reaches the row's threshold: the k-th largest value (top-k; tokens
    tied with it stay, as vLLM's `apply_top_k_only`), then the smallest value of the most likely prefix whose mass
    reaches top_p. A row's result depends on its own logits and parameters only (batch-invariant). On a CPU the
    thresholds come from each row's `CANDIDATES` largest logits, and from a sort of the row where its nucleus is
    wider; on a GPU or under `torch.compile` from a sort of every row (fixed shapes, no host synchronisation).

    Args:
        logits: [R, V] fp32.
        temperature: [R] fp32; 0 = greedy (one-hot at the argmax).
        top_k: [R] int64; 0 (or ≥ V) = off, else keep the k most likely tokens.
        top_p: [R] fp32 in (0, 1]; keep the smallest set of most likely tokens whose mass reaches top_p.
        use_filters: False when no row filters (skips the thresholds); a host-known property of the batch.
    Returns:
        [R, V] fp32 probabilities (rows sum to 1).
    Sources: Holtzman et al. 2020 (nucleus sampling); the order temperature → top-k → top-p is vLLM's and
    TensorRT-LLM's.
    """
    greedy = temperature <= 0
    x = logits / torch.where(greedy, torch.ones_like(temperature), temperature)[:, None]
    if use_filters:
        x.masked_fill_(x < _thresholds(x, top_k, top_p), float("-inf"))
    probs = torch.softmax(x, dim=-1)
    if _host_checks(x) and not bool(greedy.any()):
        return probs
    top = logits.argmax(dim=-1, keepdim=True)
    probs.masked_fill_(greedy[:, None], 0.0)
    return probs.scatter_(-1, top, torch.where(greedy[:, None], 1.0, probs.gather(-1, top)))


def _host_checks(x: torch.Tensor) -> bool:
    """Whether a data-dependent branch is free here: eager on a CPU (not a captured graph, not a compiled one)."""
    return x.device.type == "cpu" and not torch.compiler.is_compiling()


def _thresholds(x: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """[R, 1] fp32: the smallest scaled logit each row keeps (−inf where it filters nothing)."""
    v = x.shape[-1]
    if not _host_checks(x) or v <= CANDIDATES:
        return _prefix_thresholds(*x.sort(dim=-1, descending=True), x, top_k, top_p)[0]
    t, covered = _prefix_thresholds(*x.topk(CANDIDATES, dim=-1), x, top_k, top_p)
    wide = (~covered).nonzero().flatten()
    if wide.numel():  # nuclei wider than the candidates: those rows sorted whole
        t[wide] = _prefix_thresholds(*x[wide].sort(dim=-1, descending=True), x[wide], top_k[wide], top_p[wide])[0]
    return t


def _prefix_thresholds(values: torch.Tensor, ids: torch.Tensor, x: torch.Tensor, top_k: torch.Tensor,
                       top_p: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Thresholds ([R, 1] fp32) from each row's largest scaled logits `values` ([R, C], descending, C ≤ V; `ids`
    their tokens), and [R] bool: whether the C values decide the row's threshold (always where C = V)."""
    c, v = values.shape[-1], x.shape[-1]
    k = torch.where((top_k > 0) & (top_k < v), top_k, 0)[:, None]
    kth = values.gather(-1, (k - 1).clamp(0, c - 1))
    in_k = (values >= kth) | (k == 0)
    # the prefix's probabilities: renormalised over the top k (all of them among the C values), else over the row
    # (softmax, not logsumexp: PyTorch's CPU softmax reduces each row alone, whatever the batch)
    p = torch.softmax(values.masked_fill(~in_k, float("-inf")), dim=-1)
    if c < v and bool((k == 0).any()):  # (c < v only where host checks are free)
        p = torch.where(k > 0, p, torch.softmax(x, dim=-1).gather(-1, ids))
    mass_before = p.cumsum(dim=-1) - p  # the mass of the strictly more likely tokens
    nucleus = top_p[:, None] < 1.0
    keep = in_k & ((mass_before < top_p[:, None]) | ~nucleus)
    last = keep.sum(-1, keepdim=True).clamp(min=1) - 1
    t = torch.where((k == 0) & ~nucleus, float("-inf"), values.gather(-1, last))
    covered = (c == v) | ((k <= c) & ~keep[:, -1:]).squeeze(-1) | ((k == 0) & ~nucleus).squeeze(-1)
    return t, covered


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
