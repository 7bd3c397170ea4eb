"""Acceptance rules: the strategies that turn the target's logits and the drafts into emitted tokens.

Chosen once from the speculative config (STYLE.md §4): `StandardAcceptance` (strict for greedy batches, lossless
rejection sampling as soon as one request samples — which is exactly strict on its greedy rows) or
`RelaxedAcceptance` (TensorRT-LLM's relaxed acceptance for greedy requests inside `<think>…</think>`, rejection
sampling for sampling requests). Each holds per-request state as device tensors (the thinking delta), so the step
stays a pure function of fixed-shape tensors. The math lives in `nextn.plugins` (PyTorch references), dispatched
through `nextn.plugins.kernels.acceptance` (Triton kernels on CUDA, the references elsewhere).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch

from nextn.plugins.kernels.acceptance import rejection_sampling, relaxed_acceptance, strict_acceptance
from nextn.plugins.sampling import STREAM_ACCEPT, STREAM_SAMPLE, counter_uniform, filtered_probs

AcceptState = tuple[torch.Tensor, ...]


@dataclass(frozen=True)
class SamplingTensors:
    """Per-request sampling parameters of one batch, on the device.

    Attributes:
        temperature: [B] fp32 (0 = greedy); top_k: [B] int64 (0 = off); top_p: [B] fp32; seed: [B] int64.
        any_sampled: whether some request has temperature > 0 (host-known: picks the computation, not a value).
        use_filters: whether some sampling request uses top-k or top-p (host-known: skips the sort when not).
    """

    temperature: torch.Tensor
    top_k: torch.Tensor
    top_p: torch.Tensor
    seed: torch.Tensor
    any_sampled: bool
    use_filters: bool

    def probs(self, logits: torch.Tensor) -> torch.Tensor:
        """Sampling distributions for logits [B, T, V] → [B, T, V] (each request's parameters on all its rows)."""
        b, t, v = logits.shape
        rep = lambda x: x.repeat_interleave(t)  # noqa: E731
        flat = filtered_probs(logits.reshape(b * t, v), rep(self.temperature), rep(self.top_k), rep(self.top_p),
                              self.use_filters)
        return flat.view(b, t, v)


def sample_tokens(logits: torch.Tensor, positions: torch.Tensor, sampling: SamplingTensors) -> torch.Tensor:
    """One token per row of logits [B, T, V] at token positions [B, T] (greedy rows: argmax) → [B, T] int64."""
    if not sampling.any_sampled:
        return logits.argmax(dim=-1)
    from nextn.plugins.sampling import sample_from_probs

    u = counter_uniform(sampling.seed, positions, STREAM_SAMPLE)
    return sample_from_probs(sampling.probs(logits), u)


class AcceptanceRule(Protocol):
    def initial_state(self, batch: int, device: torch.device) -> AcceptState:
        """Per-request state for `batch` requests (empty when stateless)."""

    def prompt_state(self, token_ids: list[int]) -> tuple[float, ...]:
        """Host-side initial state of one request from its prompt (+ output after a preemption)."""

    def accept(self, logits: torch.Tensor, draft_tokens: torch.Tensor, first_position: torch.Tensor,
               sampling: SamplingTensors, state: AcceptState, draft_probs: torch.Tensor | None = None
               ) -> tuple[torch.Tensor, torch.Tensor, AcceptState]:
        """(tokens [B, K+1], num_emitted [B], new state) for logits [B, K+1, V] and drafts [B, K];
        first_position [B] is the position of the first token this step can emit (kv_len + 1); draft_probs
        [B, K, V] fp32 the distributions sampled drafts were drawn from (None: deterministic drafts, one-hot q)."""

    def observe(self, tokens: torch.Tensor, num_emitted: torch.Tensor, state: AcceptState) -> AcceptState:
        """The state after tokens emitted outside `accept` (the prefill's first token)."""


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
    """Relaxed acceptance in the thinking phase (REFERENCE.md §3); strict outside it; rejection sampling for
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
