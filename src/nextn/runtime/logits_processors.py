"""The host side of logit processing: each request's penalty counts and grammar state, and the batch's
`LogitsProcessing` built from them for one step (speculative/logits_processing.py applies it).

A step verifies [last, d1..dk] for a request; position j is processed with the state after d1..dj: the counts of
the tokens generated so far plus d1..dj (frequency / presence penalties), the prompt's and those tokens' set
(repetition penalty), the output length + j (min_tokens) and the grammar matcher advanced over d1..dj and rolled
back after. A draft the grammar rejects ends the walk: the positions after it cannot be reached this step (the
acceptance rule stops at the first rejected draft), so their masks are left all-allowed.
"""

from __future__ import annotations

import functools
from collections import Counter
from collections.abc import Sequence

import torch

from nextn.runtime.sampling_params import SamplingParams
from nextn.speculative.logits_processing import LogitsProcessing

__all__ = ["RequestProcessor", "build_processing"]


class RequestProcessor:
    """One request's processing state on the host.

    Args:
        params: the request's sampling parameters (`needs_processing`); prompt_ids: its prompt (repetition penalty);
        stop_ids: the tokens that end it (masked before `min_tokens`); vocab_size: the model's vocabulary (the
        logits' last dimension); matcher: its xgrammar `GrammarMatcher`, or None without a grammar.
    """

    def __init__(self, params: SamplingParams, prompt_ids: Sequence[int], stop_ids: Sequence[int], vocab_size: int,
                 matcher=None) -> None:
        self.params = params
        self.vocab_size = vocab_size
        self.stop_ids = sorted(set(stop_ids))
        self.prompt_set = frozenset(prompt_ids) if params.repetition_penalty != 1.0 else frozenset()
        self.counts: Counter[int] = Counter()
        self.num_generated = 0
        self.matcher = matcher

    def advance(self, tokens: Sequence[int]) -> None:
        """The request emitted `tokens` (in order)."""
        self.counts.update(tokens)
        self.num_generated += len(tokens)
        if self.matcher is not None:
            for t in tokens:
                if self.matcher.is_terminated() or not self.matcher.accept_token(t):
                    break  # only a stop token past the grammar's end (the request ends on it)

    @property
    def argmax_only(self) -> bool:
        """Whether the request needs only the argmax of its processed logits under a grammar (greedy, no
        log-probabilities): its masks can wait for the step's logits (`masks_where_refused`)."""
        return self.matcher is not None and self.params.temperature == 0 and self.params.logprobs is None

    def positions(self, drafts: Sequence[int], width: int, with_masks: bool = True):
        """Per position j < width (state after drafts[:j]): (mult [(j, token, r)], add [(j, token, value)],
        bitmask [width, ceil(V/32)] int32 or None (always None without `with_masks`))."""
        p = self.params
        mult, add = [], []
        counts = Counter(self.counts)
        for j in range(width):
            if j:
                counts[drafts[j - 1]] += 1
            if p.repetition_penalty != 1.0:
                mult += [(j, t, p.repetition_penalty) for t in self.prompt_set.union(counts)]
            if p.frequency_penalty or p.presence_penalty:
                add += [(j, t, -(p.frequency_penalty * c + p.presence_penalty)) for t, c in counts.items()]
            add += [(j, t, b) for t, b in p.logit_bias.items()]
            if self.num_generated + j < p.min_tokens:
                add += [(j, t, float("-inf")) for t in self.stop_ids]
        return mult, add, self._masks(drafts, width) if with_masks else None

    def masks_where_refused(self, drafts: Sequence[int], width: int, top: Sequence[int]) -> torch.Tensor | None:
        """The lazy form of the masks for an `argmax_only` request: walking the same states as `positions` (after
        drafts[:j]), the matcher tries each position's unmasked argmax top[j] and rolls it back; only where it is
        refused is the mask filled. Returns [width, ceil(V/32)] int32 (−1 = all allowed where not filled), or None
        when every argmax is allowed. The matcher is left where it was."""
        m, masks, accepted = self.matcher, None, 0
        width = min(width, len(top))  # a step may verify fewer positions than planned
        for j in range(width):
            if m.is_terminated():
                break
            if m.accept_token(top[j]):
                if j < width - 1 and drafts[j] == top[j]:  # the draft is the argmax: already advanced over it
                    accepted += 1
                    continue
                m.rollback(1)
            else:
                if masks is None:
                    masks = torch.full((width, (self.vocab_size + 31) // 32), -1, dtype=torch.int32)
                m.fill_next_token_bitmask(masks, j)
            if j == width - 1 or not m.accept_token(drafts[j]):
                break
            accepted += 1
        if accepted:
            m.rollback(accepted)
        return masks

    def _masks(self, drafts: Sequence[int], width: int) -> torch.Tensor | None:
        if self.matcher is None:
            return None
        masks = torch.full((width, (self.vocab_size + 31) // 32), -1, dtype=torch.int32)
        accepted = 0
        for j in range(width):
            if self.matcher.is_terminated():
                break
            self.matcher.fill_next_token_bitmask(masks, j)
            if j == width - 1 or not self.matcher.accept_token(drafts[j]):
                break
            accepted += 1
        if accepted:
            self.matcher.rollback(accepted)
        return masks


def build_processing(rows: Sequence[tuple[int, RequestProcessor, Sequence[int]]], width: int
                     ) -> LogitsProcessing | None:
    """The batch's processing for one step, on the CPU: rows (batch row, processor, drafts d1..d{width−1}); None
    when no row needs any (the step then runs as without processing)."""
    mult, add, mask_rows, masks, lazy = [], [], [], [], []
    vocab_size = rows[0][1].vocab_size if rows else 0
    for row, proc, drafts in rows:
        m, a, bitmask = proc.positions(drafts, width, with_masks=not proc.argmax_only)
        if proc.argmax_only:
            lazy.append((row, functools.partial(proc.masks_where_refused, tuple(drafts), width)))
        mult += [(row, j, t, r) for j, t, r in m]
        add += [(row, j, t, v) for j, t, v in a]
        if bitmask is not None:
            mask_rows.append(row)
            masks.append(bitmask)
    if not (mult or add or mask_rows or lazy):
        return None

    def index(entries):
        idx = torch.tensor([e[:3] for e in entries], dtype=torch.int64).view(-1, 3)
        return idx, torch.tensor([e[3] for e in entries], dtype=torch.float32)

    words = (vocab_size + 31) // 32
    (mult_index, mult_value), (add_index, add_value) = index(mult), index(add)
    return LogitsProcessing(mult_index, mult_value, add_index, add_value, torch.tensor(mask_rows, dtype=torch.int64),
                            torch.stack(masks) if masks else torch.zeros(0, width, words, dtype=torch.int32),
                            tuple(lazy))
