"""Strict (greedy) acceptance of draft tokens: the PyTorch reference.

Source: REFERENCE.md §2 (TensorRT-LLM `MTPSampler` semantics and its unit-test cases); Leviathan et al. 2023 §2.3
(with argmax target and draft, rejection sampling reduces to prefix matching, which is lossless under greedy).
"""

from __future__ import annotations

import torch


def strict_acceptance(target_logits: torch.Tensor, draft_tokens: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Accept the longest prefix of drafts that equals the target's argmax.

    Args:
        target_logits: [B, K+1, V] the target's logits at [last token, d1..dK].
        draft_tokens: [B, K] int64 drafts d1..dK (K may be 0: plain decoding).
    Returns:
        target_tokens: [B, K+1] int64 argmax t0..tK; the emitted tokens are its first `num_emitted` entries
            (matched drafts equal the target tokens before them, then the correction or bonus token).
        num_emitted: [B] int64 in [1, K+1] = 1 + number of accepted drafts.
    No host synchronisation: fixed shapes, cumulative product instead of a data-dependent loop.
    """
    target_tokens = target_logits.argmax(dim=-1)
    match = (draft_tokens == target_tokens[:, :-1]).to(torch.int64)  # [B, K]
    num_accepted = match.cumprod(dim=1).sum(dim=1)
    return target_tokens, num_accepted + 1


def relaxed_acceptance(target_logits: torch.Tensor, draft_tokens: torch.Tensor, delta: torch.Tensor,
                       topk: int) -> tuple[torch.Tensor, torch.Tensor]:
    """TensorRT-LLM's relaxed acceptance for thinking models (REFERENCE.md §3).

    Per position: p = softmax(logits); take the top-`topk` (probabilities v_0 ≥ v_1 ≥ …, ids i_0, i_1, …); the
    draft is accepted when it equals some i_j with j = 0 or v_j ≥ v_0 − delta. Stop at the first rejected draft;
    the token emitted there is i_0. Lossy by design; with delta = 0 it is strict acceptance (up to exact ties).

    Args:
        target_logits: [B, K+1, V].
        draft_tokens: [B, K] int64.
        delta: [B] fp32 per-request relaxation (0 outside the thinking phase).
        topk: candidates per position (`relaxed_topk`, ≥ 1).
    Returns:
        tokens [B, K+1] int64 (accepted drafts, then the top-1 at the first rejection or the bonus position),
        num_emitted [B] int64 in [1, K+1].
    """
    probs = torch.softmax(target_logits.float(), dim=-1)
    top_v, top_i = probs.topk(topk, dim=-1)  # [B, K+1, topk]
    k = draft_tokens.shape[1]
    close = top_v >= top_v[..., :1] - delta[:, None, None]  # [B, K+1, topk]
    close[..., 0] = True
    hit = (top_i[:, :k] == draft_tokens[..., None]) & close[:, :k]
    accepted = hit.any(dim=-1).to(torch.int64)  # [B, K]
    num_accepted = accepted.cumprod(dim=1).sum(dim=1)
    return _emit(draft_tokens, top_i[..., 0], num_accepted)


def rejection_sampling(target_probs: torch.Tensor, draft_tokens: torch.Tensor, accept_u: torch.Tensor,
                       sample_u: torch.Tensor, draft_probs: torch.Tensor | None = None
                       ) -> tuple[torch.Tensor, torch.Tensor]:
    """Speculative sampling: lossless in distribution (Leviathan et al. 2023, Thm. 1; Chen et al. 2023, Alg. 2).

    Draft d at position j is accepted when u_j < min(1, p_j(d) / q_j(d)); at the first rejection a token is drawn
    from normalize(max(p_j − q_j, 0)) and the step ends; when all K drafts pass, a bonus token is drawn from p_K.
    With argmax drafts q is one-hot (accept with probability p(d); the residual is p without d), and with greedy
    (one-hot) p this is exactly strict acceptance.

    Args:
        target_probs: [B, K+1, V] the target's sampling distributions (temperature/top-k/top-p applied).
        draft_tokens: [B, K] int64.
        accept_u, sample_u: [B, K] and [B, K+1] uniforms in [0, 1).
        draft_probs: [B, K, V] the drafts' distributions, or None for argmax (one-hot) drafts.
    Returns:
        tokens [B, K+1] int64 (accepted drafts, then the residual or bonus draw), num_emitted [B] int64 in [1, K+1].
    """
    from nextn.plugins.sampling import sample_from_probs

    b, k = draft_tokens.shape
    p = target_probs[:, :k]  # [B, K, V]
    p_d = p.gather(-1, draft_tokens[..., None]).squeeze(-1)  # [B, K]
    if draft_probs is None:
        ratio = p_d  # q(d) = 1
        residual = p.scatter(-1, draft_tokens[..., None], 0.0)
    else:
        q_d = draft_probs.gather(-1, draft_tokens[..., None]).squeeze(-1)
        ratio = p_d / q_d.clamp_min(1e-20)
        residual = (p - draft_probs).clamp_min(0.0)
    # A residual with no mass only arises where acceptance is certain; fall back to p there to stay finite.
    empty = residual.sum(-1, keepdim=True) <= 0
    residual = torch.where(empty, p, residual)
    candidates = torch.cat([residual, target_probs[:, k:]], dim=1)  # [B, K+1, V]: residual j, bonus at K
    drawn = sample_from_probs(candidates, sample_u)  # [B, K+1]
    accepted = (accept_u < ratio).to(torch.int64)
    num_accepted = accepted.cumprod(dim=1).sum(dim=1)
    return _emit(draft_tokens, drawn, num_accepted)


def _emit(draft_tokens: torch.Tensor, fallback: torch.Tensor, num_accepted: torch.Tensor
          ) -> tuple[torch.Tensor, torch.Tensor]:
    """tokens[:, j] = draft j for j < num_accepted, else fallback[:, j]; returns (tokens [B, K+1], num_accepted + 1)."""
    padded = torch.cat([draft_tokens, fallback[:, -1:]], dim=1)  # [B, K+1] even when K = 0
    j = torch.arange(padded.shape[1], device=padded.device)
    tokens = torch.where(j[None, :] < num_accepted[:, None], padded, fallback)
    return tokens, num_accepted + 1
