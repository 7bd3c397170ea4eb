"""`RequestOutput` / `CompletionOutput`, in the shape of TensorRT-LLM's LLM API."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

FinishReason = Literal["stop", "length", "error"] | None


@dataclass
class CompletionOutput:
    """One completion, with speculative-decoding statistics.

    Attributes:
        token_ids: generated token ids (prompt excluded).
        text: detokenized `token_ids` ("" without a tokenizer).
        finish_reason: "stop" (EOS or a stop token), "length" (max_tokens or max_seq_len), "error", or None.
        num_draft_tokens: draft tokens proposed to verification (K per decode step).
        num_accepted_draft_tokens: drafts the target accepted.
        num_decode_steps: verify-and-draft steps run (prefill excluded).
        accepted_per_position: for each draft position j (0-based), the steps whose draft j was accepted.
        error: why the request failed (finish_reason "error").
    """

    index: int = 0
    token_ids: list[int] = field(default_factory=list)
    text: str = ""
    finish_reason: FinishReason = None
    num_draft_tokens: int = 0
    num_accepted_draft_tokens: int = 0
    num_decode_steps: int = 0
    accepted_per_position: list[int] = field(default_factory=list)
    error: str | None = None

    @property
    def acceptance_length(self) -> float:
        """Emitted tokens per iteration, prefill counted as one (trtllm-bench's AL = output / (decode steps + 1))."""
        return len(self.token_ids) / (self.num_decode_steps + 1) if self.token_ids else 0.0

    @property
    def acceptance_rate_per_position(self) -> list[float]:
        """Per draft position j: accepted / decode steps (j's acceptance requires all earlier ones)."""
        return [a / self.num_decode_steps for a in self.accepted_per_position] if self.num_decode_steps else []

    @property
    def draft_acceptance_rate(self) -> float:
        """Accepted drafts / proposed drafts (DAR); 0 without drafts."""
        return self.num_accepted_draft_tokens / self.num_draft_tokens if self.num_draft_tokens else 0.0


@dataclass
class RequestOutput:
    """The result of one prompt: `.outputs[0]` holds the completion."""

    request_id: int
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool = False
