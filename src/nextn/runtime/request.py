"""A request's state while it runs: its tokens, KV blocks, pending drafts and statistics."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from enum import Enum

from nextn.runtime.logits_processors import RequestProcessor
from nextn.runtime.outputs import CompletionOutput, FinishReason, RequestOutput, TokenLogprob
from nextn.runtime.sampling_params import SamplingParams


class RequestStatus(Enum):
    WAITING = "waiting"  # not prefilled (or preempted: to be prefilled again over prompt + output)
    RUNNING = "running"  # holds a batch slot and KV blocks: in (chunked) prefill, then in decode
    FINISHED = "finished"


@dataclass(eq=False, slots=True)
class Progress:
    """Where a request's current admission stands: the scheduler's counters (a preemption starts them again).

    Attributes:
        prefill_len: tokens this admission prefills (0 while waiting), reused prefix included.
        num_prefilled_tokens: of them, scheduled so far (chunked prefill) or reused from the prefix cache.
        prefill_done: this admission's last prefill chunk has been processed (its first token appended).
        num_computed_tokens: leading positions whose KV (target and drafter) processed steps have written.
        num_committed_blocks: leading blocks of the block table already handed to the prefix cache (or hits).
        num_inflight_tokens: most tokens a launched, not yet processed step may emit (overlap scheduler).
        num_drafts: drafts its last launched step made for the next (0: it did not draft; a prefill: K).
        drafter_gap: kv_len at this admission's first step run without its drafter (its KV left unwritten), or None.
    """

    prefill_len: int = 0
    num_prefilled_tokens: int = 0
    prefill_done: bool = False
    num_computed_tokens: int = 0
    num_committed_blocks: int = 0
    num_inflight_tokens: int = 0
    num_drafts: int = 0
    drafter_gap: int | None = None


@dataclass(eq=False)
class Request:
    """Invariant while decoding: the KV of all tokens but the last is cached (kv_len = num_tokens − 1), as far as
    the host knows; a step still in flight (overlap scheduler) may add up to `num_inflight_tokens` more.

    Progress (`progress`, set by the scheduler when it schedules a chunk, not when the chunk has run):
    `prefill_len` tokens are prefilled at admission (the prompt, plus the output after a preemption);
    `num_prefilled_tokens` of them have been scheduled so far.
    """

    request_id: int
    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams
    eos_ids: frozenset[int]
    seed: int = 0  # the request's sampling seed (SamplingParams.seed, or drawn at submission)
    output_token_ids: list[int] = field(default_factory=list)
    status: RequestStatus = RequestStatus.WAITING
    block_table: list[int] = field(default_factory=list)
    draft_tokens: list[int] = field(default_factory=list)
    batch_slot: int = -1  # row in the drafter-state buffers while running
    block_hashes: list[bytes] = field(default_factory=list)  # prefix-cache keys of its leading full blocks
    progress: Progress = field(default_factory=Progress)  # where this admission stands (the scheduler's)
    num_cached_tokens: int = -1  # prompt tokens reused from the prefix cache at its first admission (-1: not yet)
    finish_reason: FinishReason = None
    error: str | None = None
    num_failed_steps: int = 0  # engine steps that failed with it in the batch and no request found at fault
    num_draft_tokens: int = 0
    num_accepted_draft_tokens: int = 0
    num_decode_steps: int = 0
    accepted_per_position: list[int] = field(default_factory=list)  # steps whose draft j was accepted
    steps_per_draft_len: dict[int, int] = field(default_factory=dict)  # decode steps run with each draft length
    text: str = ""
    arrival_time: float = field(default_factory=time.perf_counter)  # perf_counter seconds at submission
    first_token_time: float | None = None
    finished_time: float | None = None
    processor: RequestProcessor | None = None  # penalties / bias / min_tokens / grammar state (needs_processing)
    logprobs: list[TokenLogprob] | None = None  # one per output token when params.logprobs is set

    @property
    def all_token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids

    @property
    def last_token_id(self) -> int:
        """`all_token_ids[-1]` without building the list."""
        return self.output_token_ids[-1] if self.output_token_ids else self.prompt_token_ids[-1]

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def kv_len(self) -> int:
        return self.num_tokens - 1

    @property
    def finished(self) -> bool:
        return self.status is RequestStatus.FINISHED

    @property
    def is_decoding(self) -> bool:
        """Running with its whole prefill scheduled: it can join a decode step."""
        progress = self.progress
        return self.status is RequestStatus.RUNNING and 0 < progress.prefill_len <= progress.num_prefilled_tokens

    @property
    def finishes_in_flight(self) -> bool:
        """The step in flight surely ends it (it emits ≥ 1 token and one more reaches max_tokens): no need to
        launch it again before that step is processed."""
        return self.progress.num_inflight_tokens > 0 and len(self.output_token_ids) + 1 >= self.params.max_tokens

    def reset_prefill(self) -> None:
        """Back to waiting (preemption): the next admission prefills prompt + output again."""
        self.progress = Progress(num_drafts=self.progress.num_drafts)  # (block_hashes stay: the tokens only grow)
        self.draft_tokens = []

    def append(self, tokens: list[int], max_seq_len: int, logprobs: list[TokenLogprob] | None = None) -> None:
        """Append emitted tokens, cutting at EOS / stop tokens / max_tokens / max_seq_len and finishing if so;
        `logprobs` (one per token) are kept with them when the request asked for them."""
        if self.first_token_time is None and tokens:
            self.first_token_time = time.perf_counter()
        self.progress.prefill_done = True
        stops = set(self.params.stop_token_ids) | (set() if self.params.ignore_eos else set(self.eos_ids))
        kept = len(tokens)
        for i, tok in enumerate(tokens):
            self.output_token_ids.append(tok)
            if tok in stops:
                self.finish("stop")
            elif len(self.output_token_ids) >= self.params.max_tokens or self.num_tokens >= max_seq_len:
                self.finish("length")
            if self.finished:
                kept = i + 1
                break
        if self.processor is not None:
            self.processor.advance(tokens[:kept])
        if self.logprobs is not None and logprobs is not None:  # the batch computes the most any row asks for
            k = self.params.logprobs
            self.logprobs.extend(e if len(e.top) == k else TokenLogprob(e.token_id, e.logprob, e.top[:k])
                                 for e in logprobs[:kept])

    def record_step(self, draft_len: int, num_accepted: int) -> None:
        """Count one verify-and-draft step that accepted `num_accepted` of `draft_len` drafts."""
        self.num_decode_steps += 1
        self.steps_per_draft_len[draft_len] = self.steps_per_draft_len.get(draft_len, 0) + 1
        self.num_draft_tokens += draft_len
        self.num_accepted_draft_tokens += num_accepted
        if len(self.accepted_per_position) < draft_len:
            self.accepted_per_position.extend([0] * (draft_len - len(self.accepted_per_position)))
        for j in range(num_accepted):
            self.accepted_per_position[j] += 1

    def finish(self, reason: FinishReason, error: str | None = None) -> None:
        self.status = RequestStatus.FINISHED
        self.finished_time = time.perf_counter()
        self.finish_reason = reason
        self.error = error

    def to_output(self) -> RequestOutput:
        completion = CompletionOutput(
            index=0, token_ids=list(self.output_token_ids), text=self.text, finish_reason=self.finish_reason,
            num_draft_tokens=self.num_draft_tokens, num_accepted_draft_tokens=self.num_accepted_draft_tokens,
            num_decode_steps=self.num_decode_steps, error=self.error,
            accepted_per_position=list(self.accepted_per_position),
            steps_per_draft_len=dict(self.steps_per_draft_len),
            arrival_time=self.arrival_time, first_token_time=self.first_token_time, finished_time=self.finished_time,
            logprobs=None if self.logprobs is None else list(self.logprobs),
        )
        return RequestOutput(self.request_id, self.prompt, list(self.prompt_token_ids), [completion], self.finished,
                             num_cached_tokens=max(0, self.num_cached_tokens))
