"""`RequestOutput` / `CompletionOutput`, in the shape of TensorRT-LLM's LLM API."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

FinishReason = Literal["stop", "length", "error", "cancelled"] | None


@dataclass(frozen=True)
class TokenLogprob:
    """One emitted token's log-probability under the distribution it was decoded from (penalties, bias, grammar
    and temperature applied; before top-k / top-p), and the `SamplingParams.logprobs` most likely tokens'
    (token id, log-probability), most likely first."""

    token_id: int
    logprob: float
    top: list[tuple[int, float]] = field(default_factory=list)


@dataclass
class CompletionOutput:
    """One completion, with speculative-decoding statistics.

    Attributes:
        token_ids: generated token ids (prompt excluded).
        text: detokenized `token_ids` ("" without a tokenizer).
        finish_reason: "stop" (EOS or a stop token), "length" (max_tokens or max_seq_len), "error", "cancelled"
            (aborted by the caller), or None while running.
        token_ids_diff, text_diff: in streaming outputs, what this output adds to the previous one (TensorRT-LLM's
            names); in a non-streaming output they equal token_ids and text.
        num_draft_tokens: draft tokens proposed to verification (K per decode step; for a Medusa tree, its depth:
            the most one step can accept).
        num_accepted_draft_tokens: drafts the target accepted.
        num_decode_steps: verify-and-draft steps run (prefill excluded).
        accepted_per_position: for each draft position j (0-based), the steps whose draft j was accepted.
        steps_per_draft_len: decode steps run with each draft length (the draft-length policy may lower K or turn
            speculation off, 0, per batch).
        arrival_time, first_token_time, finished_time: `time.perf_counter()` seconds at submission, at the first
            emitted token and at completion (for TTFT = first − arrival, TPOT = (finished − first) / (n − 1)).
        error: why the request failed (finish_reason "error").
        logprobs: with `SamplingParams.logprobs` set, one `TokenLogprob` per token of `token_ids`; else None.
    """

    index: int = 0
    token_ids: list[int] = field(default_factory=list)
    text: str = ""
    finish_reason: FinishReason = None
    num_draft_tokens: int = 0
    num_accepted_draft_tokens: int = 0
    num_decode_steps: int = 0
    accepted_per_position: list[int] = field(default_factory=list)
    steps_per_draft_len: dict[int, int] = field(default_factory=dict)
    arrival_time: float | None = None
    first_token_time: float | None = None
    finished_time: float | None = None
    error: str | None = None
    token_ids_diff: list[int] | None = None
    text_diff: str | None = None
    logprobs: list[TokenLogprob] | None = None

    def __post_init__(self) -> None:
        if self.token_ids_diff is None:
            self.token_ids_diff = list(self.token_ids)
        if self.text_diff is None:
            self.text_diff = self.text

    @property
    def ttft_ms(self) -> float | None:
        """Time to first token, ms."""
        if self.first_token_time is None or self.arrival_time is None:
            return None
        return (self.first_token_time - self.arrival_time) * 1e3

    @property
    def tpot_ms(self) -> float | None:
        """Time per output token after the first, ms (None with fewer than two tokens)."""
        if self.finished_time is None or self.first_token_time is None or len(self.token_ids) < 2:
            return None
        return (self.finished_time - self.first_token_time) * 1e3 / (len(self.token_ids) - 1)

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
    """The result of one prompt: `.outputs[0]` holds the completion.

    Attributes:
        num_cached_tokens: prompt tokens whose KV was reused from the prefix cache when the request was first
            admitted (vLLM's name; a multiple of tokens_per_block; 0 with `enable_block_reuse: false`).
    """

    request_id: int
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool = False
    num_cached_tokens: int = 0
