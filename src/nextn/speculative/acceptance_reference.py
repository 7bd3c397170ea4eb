"""Strict (greedy) acceptance of draft tokens: the PyTorch reference.

Source: arXiv:2412.19437 §2.2 and TensorRT-LLM's `MTPSampler` semantics and its unit-test cases; Leviathan et al.
2023 §2.3
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
    """TensorRT-LLM's relaxed acceptance for thinking models (TensorRT-LLM's MTP blog).

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


def coupled_acceptance(target_probs: torch.Tensor, draft_tokens: torch.Tensor, sample_u: torch.Tensor
                       ) -> tuple[torch.Tensor, torch.Tensor]:
    """Speculative sampling for deterministic drafts: draw the target's token at every verified position with that
    position's uniform, then accept the drafts that equal the draws (strict acceptance over sampled targets).

    Lossless, and more: each emitted token is the token plain decoding draws at that position with the same
    uniform (same seed, same position), whatever the drafts were — the emitted prefix always equals plain
    decoding's, and a draft is accepted with probability p(d), as rejection sampling with one-hot q accepts it
    (Leviathan et al. 2023, §2.3: the coupling that makes their rule lossless, realised with shared randomness).
    So seeded sampling reproduces plain decoding's output token for token with any drafter whose drafts do not
    depend on the sampling (n-gram and suffix matches, argmax MTP and Medusa heads).

    Args:
        target_probs: [B, K+1, V] the target's sampling distributions (greedy rows: one-hot at the argmax).
        draft_tokens: [B, K] int64.
        sample_u: [B, K+1] uniforms in [0, 1), one per position (`counter_uniform(seed, position, STREAM_SAMPLE)`).
    Returns:
        tokens [B, K+1] int64 (the draws), num_emitted [B] int64 in [1, K+1] = 1 + the matching prefix's length.
    """
    from nextn.plugins.sampling import sample_from_probs

    drawn = sample_from_probs(target_probs, sample_u)  # [B, K+1]
    k = draft_tokens.shape[1]
    matched = (draft_tokens == drawn[:, :k]).to(torch.int64).cumprod(dim=1).sum(dim=1)
    return drawn, matched + 1


def _emit(draft_tokens: torch.Tensor, fallback: torch.Tensor, num_accepted: torch.Tensor
          ) -> tuple[torch.Tensor, torch.Tensor]:
    """tokens[:, j] = draft j for j < num_accepted, else fallback[:, j]; returns (tokens [B, K+1], num_accepted + 1)."""
    padded = torch.cat([draft_tokens, fallback[:, -1:]], dim=1)  # [B, K+1] even when K = 0
    j = torch.arange(padded.shape[1], device=padded.device)
    tokens = torch.where(j[None, :] < num_accepted[:, None], padded, fallback)
    return tokens, num_accepted + 1


def tree_greedy_acceptance(target_tokens: torch.Tensor, tree_tokens: torch.Tensor, paths: torch.Tensor,
                           path_valid: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Greedy tree verification (Medusa, lossless): per path, the longest prefix where each candidate equals the
    target's argmax at its parent; the best path is the first with the most accepted tokens.

    Args:
        target_tokens: [B, L] argmax of the target at every tree token; tree_tokens: [B, L] the candidates.
        paths: [P, D+1] token indices of the root-to-leaf paths; path_valid: [P, D+1] bool.
    Returns:
        best path [B] int64, num_accepted [B] int64 (candidates accepted on it, 0..D).
    """
    cand, tgt = tree_tokens[:, paths], target_tokens[:, paths]  # [B, P, D+1]
    match = (cand[:, :, 1:] == tgt[:, :, :-1]) & path_valid[None, :, 1:]
    accepted = match.to(torch.int64).cumprod(dim=-1).sum(dim=-1)  # [B, P]
    best = accepted.argmax(dim=-1)
    return best, accepted.gather(1, best[:, None]).squeeze(1)


def tree_typical_acceptance(target_probs: torch.Tensor, tree_tokens: torch.Tensor, paths: torch.Tensor,
                            path_valid: torch.Tensor, posterior_threshold: float, posterior_alpha: float
                            ) -> tuple[torch.Tensor, torch.Tensor]:
    """Typical acceptance (Medusa-2, Cai et al. 2024 §2.3.1; lossy): a candidate x is accepted when
    p(x) > min(ε, δ·exp(−H(p))) under its parent's distribution p, ε = posterior_threshold, δ = posterior_alpha.
    The best path has the most accepted candidates, ties broken by the highest summed log-likelihood.

    Args:
        target_probs: [B, L, V] the target's sampling distributions at every tree token.
    Returns:
        best path [B] int64, num_accepted [B] int64.
    """
    entropy = -(target_probs * torch.log(target_probs.clamp_min(1e-20))).sum(-1)  # [B, L]
    bar = torch.minimum(torch.full_like(entropy, posterior_threshold), posterior_alpha * torch.exp(-entropy))
    parent, child = paths[:, :-1], paths[:, 1:]  # [P, D]
    p_child = target_probs[:, parent].gather(-1, tree_tokens[:, child][..., None]).squeeze(-1)  # [B, P, D]
    ok = (p_child > bar[:, parent]) & path_valid[None, :, 1:]
    accepted = ok.to(torch.int64).cumprod(dim=-1)  # [B, P, D]
    count = accepted.sum(dim=-1)
    loglik = (torch.log(p_child.clamp_min(1e-20)) * accepted).sum(dim=-1)
    # Most accepted first, then likelihood: loglik ≤ 0 and bounded, so a scaled count dominates it.
    best = (count * 1e4 + loglik.clamp(min=-1e3)).argmax(dim=-1)
    return best, count.gather(1, best[:, None]).squeeze(1)
