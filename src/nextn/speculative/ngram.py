"""N-gram (prompt lookup) drafting: the next K tokens are guessed by copying what followed an earlier occurrence of
the sequence's last n tokens — no draft model, no training, so it runs on any engine.

Sources: Saxena 2023, "Prompt Lookup Decoding" (github.com/apoorvumang/prompt-lookup-decoding); llama.cpp's
`llama-lookup`; TensorRT-LLM `NGramDecodingConfig` / `_torch/speculative/ngram.py` (field names and semantics, not
the code: TensorRT-LLM keeps a host-side dictionary of n-gram → continuations; here the search is a few tensor ops
over a device buffer, so drafting stays inside the fixed-shape step).

Per request the drafter keeps its token history in a device buffer indexed by batch slot (`history` [B, S] int64:
the token at each position; positions ≥ the sequence length hold stale values and are never read). Each step
writes the tokens it emitted at their positions and drafts from the buffer:

    for n = max_matching_ngram_size … 1:  earlier positions e where history[e−n+1 .. e] == the last n tokens
    the largest n with a match wins; among its matches the earliest (is_use_oldest) or the latest
    drafts d_i = history[e + 1 + (i mod s)], s = num_tokens − (e + 1): the continuation after the match, read
        periodically when it runs into the end of the sequence (the match predicts that the sequence repeats with
        period s, so this is exactly the copy extended by its own drafts)
    no match: the last token repeated (harmless: the acceptance rule keeps the output lossless)

Drafts are deterministic, so the acceptance rule sees them as one-hot q: strict acceptance for greedy requests,
rejection sampling with one-hot q for sampling requests — both keep the target's output (distribution) exactly.
"""

from __future__ import annotations

import logging

import torch

from nextn.config.llm_args import NGramDecodingConfig
from nextn.speculative.protocol import NO_CONTEXT, NO_PREFILL, DrafterState
from nextn.speculative.acceptance_rules import StandardAcceptance
from nextn.speculative.chain_step import LinearDrafter
from nextn.speculative.method import LoadContext, Method, from_build_yaml
from nextn.speculative.protocol import AcceptanceRule, Drafter

logger = logging.getLogger(__name__)

_PAD, _NO_QUERY = -2, -1  # never equal to a token id, nor to each other


def ngram_drafts(history: torch.Tensor, num_tokens: torch.Tensor, max_ngram: int, num_drafts: int,
                 use_oldest: bool = True) -> torch.Tensor:
    """Prompt-lookup drafts from each row's token history (fixed shapes, no host synchronisation).

    Args:
        history: [B, S] int64 token ids ≥ 0; row b's sequence is history[b, :num_tokens[b]] (the rest is ignored).
        num_tokens: [B] int64 sequence lengths in [1, S].
        max_ngram: the longest n-gram matched (N ≥ 1); shorter ones are tried down to 1.
        num_drafts: K, drafts per row.
        use_oldest: among the matches of the longest n, take the earliest (True) or the latest (False).
    Returns:
        [B, K] int64 drafts: the tokens after the match (periodically continued), or the last token repeated when
        even the last token alone occurs nowhere earlier.
    """
    b, s = history.shape
    n = max_ngram
    dev = history.device
    last = num_tokens - 1  # [B] position of the last token
    steps = torch.arange(n, device=dev)
    # The last n tokens, oldest first ([B, n]; _NO_QUERY before the sequence start).
    q_pos = last[:, None] - n + 1 + steps
    query = torch.where(q_pos >= 0, history.gather(1, q_pos.clamp(min=0)), _NO_QUERY)
    # windows[b, e] = history[b, e−n+1 .. e] (_PAD before position 0): the n-gram ending at each position e.
    windows = torch.cat([history.new_full((b, n - 1), _PAD), history], dim=1).unfold(1, n, 1)  # [B, S, n]
    # Match length at e: how many of the last tokens agree, counted back from the window's end.
    match_len = (windows == query[:, None, :]).flip(-1).cumprod(-1).sum(-1)  # [B, S] in [0, n]
    # Score: the longest match first, then the earliest (or latest) end; an end needs a known token after it
    # (e ≤ last − 1, which also excludes the suffix itself).
    pos = torch.arange(s, device=dev)
    tiebreak = (s - 1 - pos) if use_oldest else pos  # [S] in [0, S)
    score = torch.where(pos[None, :] < last[:, None], match_len * s + tiebreak[None, :], -1)
    best_score, end = score.max(dim=1)  # [B]
    start = torch.where(best_score >= s, end + 1, last)  # no match (length 0): start at the last token, period 1
    period = num_tokens - start  # [B] ≥ 1
    idx = start[:, None] + torch.arange(num_drafts, device=dev)[None, :] % period[:, None]
    return history.gather(1, idx)


class NGramDrafter(LinearDrafter):
    """Prompt-lookup drafting over each request's prompt and output (TensorRT-LLM's NGram drafter).

    State: `history` [max_batch_size, S] int64 per batch slot, S = max_seq_len + 2K + 2 (a step in flight may
    write K + 1 tokens past max_seq_len before the host sees the request finish; writes past S clamp to S − 1,
    which is never read). It is rebuilt by every prefill (after a preemption too: prompt + output are prefilled
    again; the tokens a prefix-cache hit skips are written by `load_prefix`), so a reused slot never reads the
    previous request's tokens.

    While the draft-length policy turns speculation off the step runs without a drafter, so the positions decoded
    then are not written; drafting from stale values there can only lower acceptance (verification keeps the
    output exact).
    """

    name = "NGram"

    def __init__(self, num_draft_tokens: int, max_matching_ngram_size: int, max_seq_len: int,
                 is_use_oldest: bool = True) -> None:
        self.num_draft_tokens = self.max_draft_depth = num_draft_tokens
        self.max_ngram = max_matching_ngram_size
        self.use_oldest = is_use_oldest
        self.history_len = max_seq_len + 2 * num_draft_tokens + 2

    @classmethod
    def from_config(cls, spec: NGramDecodingConfig, max_seq_len: int) -> "NGramDrafter":
        """The drafter for `spec`, logging the options nextn accepts but does not honour (a warning when set
        explicitly, an info line for TensorRT-LLM's defaults)."""
        notes = []
        if spec.is_public_pool:
            notes.append(("is_public_pool", "is_public_pool: drafts come from each request's own prompt and output; "
                          "nextn has no pool shared across requests"))
        if not spec.is_keep_all:
            notes.append(("is_keep_all", "is_keep_all: false has no effect: every earlier occurrence of the n-gram is "
                          "searched on each step and is_use_oldest picks one"))
        for field, note in notes:
            (logger.warning if field in spec.model_fields_set else logger.info)("speculative_config.%s", note)
        return cls(spec.max_draft_len, spec.max_matching_ngram_size, max_seq_len, spec.is_use_oldest)

    def initial_state(self, batch: int, hidden_size: int, device: torch.device, dtype: torch.dtype) -> DrafterState:
        return (torch.zeros(batch, self.history_len, dtype=torch.int64, device=device),)

    def load_prefix(self, state: DrafterState, slot: int, token_ids: list[int]) -> None:
        """The reused tokens of a prefix-cache hit into the slot's history (the prefill writes the rest)."""
        (history,) = state
        n = min(len(token_ids), self.history_len)
        history[slot, :n] = torch.tensor(token_ids[:n], dtype=history.dtype, device=history.device)

    def _write(self, history: torch.Tensor, positions: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
        """history with tokens [B, T] written at positions [B, T] (clamped into the buffer)."""
        return history.scatter(1, positions.clamp(max=self.history_len - 1), tokens)

    def _draft(self, history: torch.Tensor, num_tokens: torch.Tensor) -> torch.Tensor:
        return ngram_drafts(history, num_tokens, self.max_ngram, self.num_draft_tokens, self.use_oldest)

    def after_prefill(self, model, kv_cache, meta, hidden, next_tokens, last_idx, input_ids, state,
                      step=NO_PREFILL):
        (history,) = state or self.initial_state(input_ids.shape[0], 0, input_ids.device, hidden.dtype)
        start = meta.positions[:, :1]  # [B, 1] the chunk's first position
        history = self._write(history, start, input_ids[:, :1])  # (only the first chunk's is new)
        # Row p's next token lands at p + 1; rows past last_idx are padding and land past the new length.
        history = self._write(history, meta.positions + 1, next_tokens)
        num_tokens = start[:, 0] + last_idx + 2  # through the token after the chunk's last row
        return self._draft(history, num_tokens), (history,)

    def after_verify(self, model, kv_cache, meta, hidden, target_tokens, num_emitted, state, step=NO_CONTEXT):
        (history,) = state
        first = meta.positions[:, :1] + 1  # [B, 1] where the first emitted token lands (kv_len + 1)
        steps = torch.arange(target_tokens.shape[1], device=target_tokens.device)
        history = self._write(history, first + steps, target_tokens)  # rejected columns land past the new length
        return self._draft(history, first[:, 0] + num_emitted), (history,)


def build(spec: NGramDecodingConfig, ctx: LoadContext) -> tuple[Drafter, AcceptanceRule]:
    """Prompt-lookup drafts from each request's own tokens (no weights: any engine), verified strictly / by
    rejection sampling over the deterministic drafts."""
    return NGramDrafter.from_config(spec, ctx.max_seq_len), StandardAcceptance()


METHOD = Method("NGram", NGramDecodingConfig, build, from_build_yaml("NGram"))
