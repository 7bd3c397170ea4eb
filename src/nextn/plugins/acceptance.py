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
