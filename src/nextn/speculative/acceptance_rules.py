"""Acceptance rules: the strategies that turn the target's logits and the drafts into emitted tokens.

Chosen once from the speculative config (STYLE.md §4): `StandardAcceptance` (strict for greedy batches, lossless
speculative sampling as soon as one request samples — which is exactly strict on its greedy rows: rejection sampling
for drafts drawn from q, the coupled rule for deterministic drafts) or
`RelaxedAcceptance` (TensorRT-LLM's relaxed acceptance for greedy requests inside `<think>…</think>`, rejection
sampling for sampling requests). Each holds per-request state as device tensors (the thinking delta), so the step
stays a pure function of fixed-shape tensors. The math is `strict_acceptance`, `relaxed_acceptance` and
`rejection_sampling` below: each calls its Triton launcher (`acceptance_kernels`) on CUDA tensors and its PyTorch
reference (`acceptance_reference`) elsewhere (`dispatch.use_kernel`), so CPU behaviour is the reference's exactly.
"""

from __future__ import annotations

import torch

from nextn.plugins.kernels.dispatch import use_kernel
from nextn.plugins.sampling import STREAM_ACCEPT, STREAM_SAMPLE, counter_uniform
from nextn.speculative import acceptance_reference as reference
from nextn.speculative.acceptance_kernels import (rejection_sampling_triton, relaxed_acceptance_triton,
                                                  strict_acceptance_triton)
from nextn.speculative.protocol import AcceptanceRule, AcceptState, SamplingTensors  # noqa: F401 (re-exported)


def strict_acceptance(target_logits: torch.Tensor, draft_tokens: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Strict acceptance (`acceptance_reference.strict_acceptance`): logits [B, K+1, V], drafts [B, K] int64 →
    (tokens [B, K+1] int64, num_emitted [B] int64); the Triton kernel where it can run, else the reference."""
    if use_kernel(target_logits, draft_tokens):
        return strict_acceptance_triton(target_logits, draft_tokens)
    return reference.strict_acceptance(target_logits, draft_tokens)


def relaxed_acceptance(target_logits: torch.Tensor, draft_tokens: torch.Tensor, delta: torch.Tensor,
                       topk: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Relaxed acceptance (`acceptance_reference.relaxed_acceptance`): logits [B, K+1, V], drafts [B, K] int64,
    delta [B] fp32, topk ≥ 1 → (tokens [B, K+1] int64, num_emitted [B] int64); the kernel where it can run, else
    the reference."""
    if use_kernel(target_logits, draft_tokens, delta):
        return relaxed_acceptance_triton(target_logits, draft_tokens, delta, topk)
    return reference.relaxed_acceptance(target_logits, draft_tokens, delta, topk)


def rejection_sampling(target_probs: torch.Tensor, draft_tokens: torch.Tensor, accept_u: torch.Tensor,
                       sample_u: torch.Tensor, draft_probs: torch.Tensor | None = None
                       ) -> tuple[torch.Tensor, torch.Tensor]:
    """Speculative sampling: probs [B, K+1, V] fp32, drafts [B, K], uniforms accept_u [B, K] and sample_u [B, K+1],
    draft_probs [B, K, V] or None (deterministic drafts) → (tokens [B, K+1] int64, num_emitted [B] int64).

    Drafts drawn from q (`draft_probs`): rejection sampling (`acceptance_reference.rejection_sampling`), the kernel
    where it can run, else the reference. Deterministic drafts: `acceptance_reference.coupled_acceptance` — the
    target's tokens drawn with each position's uniform and the matching drafts kept, so the output is plain
    decoding's with the same seed, token for token (accept_u unused)."""
    if draft_probs is None:  # deterministic drafts: draw the target, keep matching drafts (plain's exact tokens)
        return reference.coupled_acceptance(target_probs, draft_tokens, sample_u)
    if use_kernel(target_probs, draft_tokens, accept_u, sample_u):
        return rejection_sampling_triton(target_probs, draft_tokens, accept_u, sample_u, draft_probs)
    return reference.rejection_sampling(target_probs, draft_tokens, accept_u, sample_u, draft_probs)


def ragged_acceptance(draft_tokens: torch.Tensor, draws: torch.Tensor, draft_lens: torch.Tensor
                      ) -> tuple[torch.Tensor, torch.Tensor]:
    """Acceptance of a ragged step (`chain_step.verify_ragged`): row b keeps its drafts while they equal the
    target's draws (argmax for greedy rows, the seeded draw plain decoding makes there for sampled ones: the coupled
    rule), never past its draft_lens[b] verified drafts, then emits the draw.

    Args:
        draft_tokens: [B, K] int64; draws: [B, K+1] int64 (columns past a row's draft_lens + 1 are never emitted);
        draft_lens: [B] int64 in [0, K].
    Returns:
        tokens [B, K+1] int64 (the draws), num_emitted [B] int64 in [1, draft_lens + 1].
    """
    k = draft_tokens.shape[1]
    verified = torch.arange(k, device=draft_tokens.device)[None, :] < draft_lens[:, None]
    match = (draft_tokens == draws[:, :k]) & verified
    return draws, match.long().cumprod(dim=1).sum(dim=1) + 1


def sample_tokens(logits: torch.Tensor, positions: torch.Tensor, sampling: SamplingTensors) -> torch.Tensor:
    """One token per row of logits [B, T, V] at token positions [B, T] (greedy rows: argmax) → [B, T] int64."""
    if not sampling.any_sampled:
        return logits.argmax(dim=-1)
    from nextn.plugins.sampling import sample_from_probs

    u = counter_uniform(sampling.seed, positions, STREAM_SAMPLE)
    return sample_from_probs(sampling.probs(logits), u)


def _rejection(logits: torch.Tensor, draft_tokens: torch.Tensor, first_position: torch.Tensor,
               sampling: SamplingTensors, draft_probs: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    w = logits.shape[1]
    positions = first_position[:, None] + torch.arange(w, device=logits.device)  # where each emitted token lands
    accept_u = counter_uniform(sampling.seed, positions[:, : w - 1], STREAM_ACCEPT)
    sample_u = counter_uniform(sampling.seed, positions, STREAM_SAMPLE)
    return rejection_sampling(sampling.probs(logits), draft_tokens, accept_u, sample_u, draft_probs)


class StandardAcceptance:
    """Strict acceptance for all-greedy batches; rejection sampling (lossless) when a request samples."""

    def initial_state(self, batch: int, device: torch.device) -> AcceptState:
        return ()

    def prompt_state(self, token_ids: list[int]) -> tuple[float, ...]:
        return ()

    def observe(self, tokens, num_emitted, state):
        return state

    def accept(self, logits, draft_tokens, first_position, sampling, state, draft_probs=None):
        if sampling.any_sampled:
            tokens, n = _rejection(logits, draft_tokens, first_position, sampling, draft_probs)
        else:
            tokens, n = strict_acceptance(logits, draft_tokens)
        return tokens, n, ()


class RelaxedAcceptance:
    """Relaxed acceptance in the thinking phase (TensorRT-LLM's MTP blog); strict outside it; rejection sampling for
    sampling requests. State: the per-request delta [B] fp32, `relaxed_delta` after `<think>`, 0 after `</think>`."""

    def __init__(self, topk: int, delta: float, begin_token: int, end_token: int) -> None:
        self.topk, self.delta, self.begin_token, self.end_token = topk, delta, begin_token, end_token

    def initial_state(self, batch: int, device: torch.device) -> AcceptState:
        return (torch.zeros(batch, dtype=torch.float32, device=device),)

    def prompt_state(self, token_ids: list[int]) -> tuple[float, ...]:
        begin = max((i for i, t in enumerate(token_ids) if t == self.begin_token), default=-1)
        end = max((i for i, t in enumerate(token_ids) if t == self.end_token), default=-1)
        return (self.delta if begin > end else 0.0,)

    def accept(self, logits, draft_tokens, first_position, sampling, state, draft_probs=None):
        (delta,) = state
        tokens, n = relaxed_acceptance(logits, draft_tokens, delta, self.topk)
        if sampling.any_sampled:
            s_tokens, s_n = _rejection(logits, draft_tokens, first_position, sampling, draft_probs)
            greedy = sampling.temperature <= 0
            tokens, n = torch.where(greedy[:, None], tokens, s_tokens), torch.where(greedy, n, s_n)
        return tokens, n, self.observe(tokens, n, state)

    def observe(self, tokens, num_emitted, state):
        return (self.update_delta(tokens, num_emitted, state[0]),)

    def update_delta(self, tokens: torch.Tensor, num_emitted: torch.Tensor, delta: torch.Tensor) -> torch.Tensor:
        """The thinking state after the emitted tokens: the last `<think>` / `</think>` among them decides."""
        j = torch.arange(tokens.shape[1], device=tokens.device)
        emitted = j[None, :] < num_emitted[:, None]
        last = lambda tok: torch.where(emitted & (tokens == tok), j, -1).amax(dim=1)  # noqa: E731
        begin, end = last(self.begin_token), last(self.end_token)
        return torch.where(begin > end, torch.full_like(delta, self.delta), torch.where(end > begin, 0.0 * delta, delta))


def greedy_sampling(batch: int, device: torch.device | str = "cpu") -> SamplingTensors:
    """SamplingTensors for `batch` greedy requests."""
    zeros = torch.zeros(batch, device=device)
    return SamplingTensors(zeros, zeros.long(), zeros + 1.0, zeros.long(), any_sampled=False, use_filters=False)
