"""Draft-length policies: how many drafts each decode step verifies, so that speculation never costs more than
it gains (a strategy chosen once, at load time, from the speculative config).

Speculation pays when the target forward over B·(k+1) tokens costs little more than over B tokens: true at small
batches, false once the step is compute-bound (large B) or when few drafts are accepted. The policies follow
TensorRT-LLM's speculative-config fields (`DecodingBaseConfig`):
- `draft_len_schedule` {batch size threshold: draft length}: a batch of B requests uses the draft length of the
  smallest threshold ≥ B; above the largest threshold speculation is off (draft length 0).
- `max_concurrency`: above this many requests in the batch speculation is off.
- `acceptance_rate_window_size` N and `acceptance_rate_threshold` t: once the rolling draft acceptance rate
  (accepted drafts / drafts) over the last N speculation-enabled iterations drops below t, speculation is off for
  good.

A step with draft length 0 < k < K runs the same verify-and-draft step with k draft columns ([last, d1..dk]); the
drafter still drafts K tokens (its KV and pools stay exactly as after a K-draft step, so raising k again later
keeps the drafts equal to drafts from scratch), and the unused drafts are dropped. With speculation off (k = 0)
the step is plain decoding with no drafter at all, so it costs what plain decoding costs; when speculation comes
back on, one step with k = 0 and the drafter on re-primes the drafts (the drafter's KV / pools for the positions
decoded while off are missing, which can only lower acceptance: verification keeps the output lossless).
"""

from __future__ import annotations

from collections import deque
from typing import Protocol

from nextn.config.llm_args import DecodingBaseConfig, LlmArgsError, MedusaDecodingConfig


class DraftLenPolicy(Protocol):
    max_draft_len: int  # K: the drafter's draft count, the most a step can verify

    def draft_len(self, batch_size: int) -> int:
        """Drafts each request verifies in a decode step of `batch_size` requests, in [0, K]."""

    def observe(self, num_draft_tokens: int, num_accepted_draft_tokens: int) -> None:
        """One processed decode iteration's totals over its batch (feedback for acceptance-based policies)."""


class StaticDraftLen:
    """Always K (TensorRT-LLM's behaviour without a schedule)."""

    def __init__(self, max_draft_len: int) -> None:
        self.max_draft_len = max_draft_len

    def draft_len(self, batch_size: int) -> int:
        return self.max_draft_len

    def observe(self, num_draft_tokens: int, num_accepted_draft_tokens: int) -> None:
        pass


class BatchSizeDraftLen:
    """`draft_len_schedule` and/or `max_concurrency`: the draft length as a function of the batch size."""

    def __init__(self, max_draft_len: int, schedule: dict[int, int] | None, max_concurrency: int | None) -> None:
        self.max_draft_len = max_draft_len
        self.schedule = sorted((schedule or {}).items())
        self.max_concurrency = max_concurrency

    def draft_len(self, batch_size: int) -> int:
        if self.max_concurrency is not None and batch_size > self.max_concurrency:
            return 0
        if not self.schedule:
            return self.max_draft_len
        return next((k for limit, k in self.schedule if batch_size <= limit), 0)

    def observe(self, num_draft_tokens: int, num_accepted_draft_tokens: int) -> None:
        pass


class AcceptanceGate:
    """Wraps a policy; turns speculation off for good once the rolling draft acceptance rate over the last
    `window` speculation-enabled iterations falls below `threshold`."""

    def __init__(self, inner: DraftLenPolicy, window: int, threshold: float) -> None:
        self.inner, self.threshold = inner, threshold
        self.max_draft_len = inner.max_draft_len
        self._window: deque[tuple[int, int]] = deque(maxlen=window)
        self.disabled = False

    def draft_len(self, batch_size: int) -> int:
        return 0 if self.disabled else self.inner.draft_len(batch_size)

    def observe(self, num_draft_tokens: int, num_accepted_draft_tokens: int) -> None:
        if self.disabled or num_draft_tokens == 0:
            return
        self._window.append((num_draft_tokens, num_accepted_draft_tokens))
        if len(self._window) == self._window.maxlen:
            drafts = sum(d for d, _ in self._window)
            self.disabled = sum(a for _, a in self._window) / drafts < self.threshold
        self.inner.observe(num_draft_tokens, num_accepted_draft_tokens)


def choose_draft_len_policy(spec: DecodingBaseConfig | MedusaDecodingConfig | None,
                            num_draft_tokens: int) -> DraftLenPolicy:
    """The draft-length policy for this speculative config (chosen once, at load time).

    Medusa verifies its whole tree every step (its width is the tree's, not a draft length): static.

    Raises:
        LlmArgsError: a schedule entry with a threshold < 1 or a draft length outside [0, K].
    """
    if not isinstance(spec, DecodingBaseConfig):
        return StaticDraftLen(num_draft_tokens)
    schedule = spec.draft_len_schedule
    bad = {b: k for b, k in (schedule or {}).items() if b < 1 or not 0 <= k <= num_draft_tokens}
    if bad:
        raise LlmArgsError(f"speculative_config.draft_len_schedule {bad}: thresholds must be ≥ 1 and draft lengths "
                           f"in [0, the max draft length {num_draft_tokens}]")
    policy: DraftLenPolicy = StaticDraftLen(num_draft_tokens)
    if schedule or spec.max_concurrency is not None:
        policy = BatchSizeDraftLen(num_draft_tokens, schedule, spec.max_concurrency)
    if spec.acceptance_rate_window_size and spec.acceptance_rate_threshold is not None:
        policy = AcceptanceGate(policy, spec.acceptance_rate_window_size, spec.acceptance_rate_threshold)
    return policy
