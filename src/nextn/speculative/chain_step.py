"""The fused verify-and-draft step over a chain of drafts, the prefill step that starts it, and the chain drafters'
defaults (`LinearDrafter`; `NoDrafter`: plain decoding).

Both are pure functions of fixed-shape device tensors: no `.item()`, no Python branching on tensor values, no
boolean-mask indexing (the MoE dispatch included), so the decode step can run under
`torch.compile(fullgraph=True)` and be captured in one CUDA graph. The data flow (arXiv:2412.19437 §2.2):

    hidden  = target([last, d1..dK], positions L..L+K)        # [B, K+1, H], KV written at L..L+K
    tokens, num_emitted = acceptance(lm_head(hidden), drafts)  # strict | rejection sampling | relaxed
    (rewind)  the sequence's KV length becomes L + num_emitted: rejected entries are overwritten later
    drafts  = drafter(hidden, tokens, num_emitted)             # MTP Eagle | MTP Vanilla | n-gram | none
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from nextn.models.attention_metadata import AttentionMetadata, slots_for_positions
from nextn.models.causal_lm import SelfDraftingCausalLM
from nextn.speculative import acceptance_rules
from nextn.speculative.acceptance_rules import sample_tokens
from nextn.speculative.draft_gain import expected_tokens
from nextn.speculative.traits import DrafterTraits
from nextn.speculative.protocol import (NO_CONTEXT, NO_PREFILL, AcceptanceRule, AcceptState, Drafter, DrafterState,
                                        PrefillContext, SamplingTensors, StepOutput, VerifyContext, rows_at)


PREFILL_PADDING_SLACK = 0.125  # `prefill_groups`: a group's forward computes at most 1.125× its true tokens

RowGroups = Sequence[tuple[Sequence[int], int]]  # (rows of the padded batch, the width their forward runs at)


def prefill_groups(lens: Sequence[int], slack: float = PREFILL_PADDING_SLACK) -> list[tuple[list[int], int]]:
    """The rows of a right-padded prefill in groups whose own forward pads little: a batch of prompts 51–229
    tokens long padded to 229 computes ~2× its tokens (every layer runs the pads), which on a CPU, where prefill is
    compute-bound, costs ~2× the time.

    Rows are taken longest first; a group is closed when the next row would make rows · width exceed
    (1 + slack) · the group's true tokens (width: the group's longest). One group of every row when the whole batch
    is within that bound already.

    Args:
        lens: each row's true length (≥ 1), host ints.
        slack: the padding allowed per group, as a fraction of its tokens (≥ 0).
    Returns:
        [(rows, width)]: every row exactly once, in ascending order within a group, width = max(lens[rows]).
    """
    n = len(lens)
    if n == 0:
        return []
    bound = 1.0 + slack
    if n * max(lens) <= bound * sum(lens):
        return [(list(range(n)), max(lens))]
    groups: list[tuple[list[int], int]] = []
    rows: list[int] = []
    width = total = 0
    for i in sorted(range(n), key=lambda r: -lens[r]):  # longest first: a group's first row sets its width
        if rows and (len(rows) + 1) * width > bound * (total + lens[i]):
            groups.append((sorted(rows), width))
            rows, width, total = [], 0, 0
        rows.append(i)
        width, total = max(width, lens[i]), total + lens[i]
    groups.append((sorted(rows), width))
    return groups


def _grouped_forward(model: SelfDraftingCausalLM, input_ids: torch.Tensor, kv_cache: torch.Tensor,
                     meta: AttentionMetadata, groups: RowGroups) -> torch.Tensor:
    """hidden [B, T, H] of a right-padded prefill, one forward per group of rows at the group's width (pads
    past it: zeros). Each row's result is its own (the forward computes every row alone), so the grouping changes
    no value."""
    b, t = input_ids.shape
    if len(groups) == 1 and len(groups[0][0]) == b and groups[0][1] == t:
        return model(input_ids, kv_cache, meta)
    hidden = None
    for rows, width in groups:
        idx = torch.tensor(list(rows), dtype=torch.int64, device=input_ids.device)
        sub = AttentionMetadata.create(meta.positions[idx, :width], meta.slot_mapping[idx, :width],
                                       meta.block_tables[idx], meta.block_size)
        h = model(input_ids[idx, :width], kv_cache, sub)  # [rows, width, H]
        if hidden is None:
            hidden = h.new_zeros(b, t, h.shape[-1])
        hidden[idx, :width] = h
    return hidden


def prefill_step(model: SelfDraftingCausalLM, drafter: Drafter, acceptance: AcceptanceRule, kv_cache: torch.Tensor,
                 input_ids: torch.Tensor, prompt_lens: torch.Tensor, block_tables: torch.Tensor,
                 sampling: SamplingTensors, accept_state: AcceptState, block_size: int,
                 start_positions: torch.Tensor | None = None, next_tokens: torch.Tensor | None = None,
                 drafter_state: DrafterState = (), draft: bool = True,
                 row_groups: RowGroups | None = None) -> StepOutput:
    """Prefill right-padded prompts (or prompt chunks), emit each one's first token (argmax, or sampled) and its
    first drafts.

    A chunk starts at kv position `start_positions[b]` and attends to the earlier chunks through the paged cache.
    Only a chunk that ends its prompt emits a token; for an earlier chunk the token after its last row is known
    (`next_tokens[b]`, the next chunk's first token) and is handed to the drafter in place of a sampled one, so
    the MTP KV of every prompt position is filled from the true tokens.

    Args:
        input_ids: [B, T] int64 prompts (chunks), right-padded to the longest (T).
        prompt_lens: [B] int64 true lengths of the chunks (≥ 1).
        block_tables: [B, max_blocks] int64 covering every prompt position plus the drafter's look-ahead.
        sampling: the requests' sampling parameters; accept_state: the acceptance rule's state from the prompts.
        start_positions: [B] int64 position of each chunk's first token; None: 0 (whole prompts).
        next_tokens: [B] int64 the token after each chunk, −1 where the chunk ends its prompt (the step samples
            it); None: every chunk ends its prompt.
        drafter_state: the rows' drafter state before this chunk (stale for a first chunk); () when stateless.
        draft: False when the next decode step will not speculate: the drafter only writes its KV / state
            (`Drafter.after_prefill`).
        row_groups: the target's forward run per group of rows at the group's width (`prefill_groups`, from the
            host's lengths: no read-back); None: one forward over [B, T].
    Returns:
        StepOutput with tokens [B, 1] (for an earlier chunk: its next_token) and num_emitted = 1.
    """
    b, t = input_ids.shape
    steps = torch.arange(t, device=input_ids.device)
    start = torch.zeros_like(prompt_lens) if start_positions is None else start_positions
    positions = start[:, None] + steps  # [B, T]
    valid = steps[None, :] < prompt_lens[:, None]
    meta = AttentionMetadata.create(positions, slots_for_positions(block_tables, positions, block_size, valid),
                             block_tables, block_size)
    hidden = (model(input_ids, kv_cache, meta) if row_groups is None
              else _grouped_forward(model, input_ids, kv_cache, meta, row_groups))  # [B, T, H]
    last_idx = prompt_lens - 1
    logits = sampling.process(model.logits(rows_at(hidden, last_idx)))  # [B, 1, V]
    first = sample_tokens(logits, (start + prompt_lens)[:, None], sampling)  # [B, 1]
    if next_tokens is not None:
        first = torch.where(next_tokens[:, None] >= 0, next_tokens[:, None], first)
    # The token one position ahead of each row: the prompt shifted left, the new token after the last row.
    shifted = torch.cat([input_ids[:, 1:], input_ids[:, :1]], dim=1).scatter(1, last_idx[:, None], first)
    drafts, state = drafter.after_prefill(model, kv_cache, meta, hidden, shifted, last_idx, input_ids,
                                          drafter_state, PrefillContext(sampling, draft))
    ones = torch.ones_like(prompt_lens)
    return StepOutput(first, ones, drafts, state, acceptance.observe(first, ones, accept_state),
                      sampling.logprobs(logits, first))


def verify_and_draft_step(model: SelfDraftingCausalLM, drafter: Drafter, acceptance: AcceptanceRule,
                          kv_cache: torch.Tensor, input_ids: torch.Tensor, kv_lens: torch.Tensor,
                          block_tables: torch.Tensor, sampling: SamplingTensors, drafter_state: DrafterState,
                          accept_state: AcceptState, block_size: int,
                          draft_lens: torch.Tensor | None = None, num_drafts: int | None = None) -> StepOutput:
    """One decode step for a batch: verify the drafts, accept, rewind, draft again.

    Args:
        input_ids: [B, K+1] int64 = [last emitted token, d1..dK] per request.
        kv_lens: [B] int64 L, the number of tokens whose KV is cached (the last emitted token sits at position L).
        block_tables: [B, max_blocks] int64 covering positions up to L + 2K (the drafter's look-ahead).
        sampling: the requests' sampling parameters (greedy rows: temperature 0).
        drafter_state, accept_state: per-request states from the previous step.
        draft_lens: [B] int64 ≤ K, a ragged step (`verify_ragged`): row b verifies only its first draft_lens[b]
            drafts. Only for batches with no logits processing, a drafter whose `traits.draft_len` is PROPOSAL_PER_ROW, whose drafts are
            deterministic, and `StandardAcceptance` (the engine loader's `ragged`).
        num_drafts: drafts to make for the next step, in [1, K], for a drafter with `traits.on_demand` (the rest
            of the [B, K] drafts are zeros, never verified); None: K.
    Returns:
        StepOutput; the new KV length is kv_lens + num_emitted (the rewind: rejected entries are dead).

    A drafter with `traits.sampled` (a draft model) drew its drafts from its own q: the acceptance rule gets q
    (rejection sampling with `draft_probs`; Leviathan et al. 2023 §2.3) and the drafter the sampling parameters.
    """
    b, w = input_ids.shape
    positions = kv_lens[:, None] + torch.arange(w, device=input_ids.device)
    meta = AttentionMetadata.create(positions, slots_for_positions(block_tables, positions, block_size), block_tables, block_size)
    if draft_lens is not None:
        return verify_ragged(model, drafter, kv_cache, input_ids, meta, draft_lens, drafter_state, accept_state,
                             block_size, sampling)
    hidden = model(input_ids, kv_cache, meta)  # [B, K+1, H]
    # q [B, K, V] of sampled drafts (None: one-hot); host-known: picks the calls, not a value
    q = drafter.draft_probs(drafter_state, w - 1, sampling) if drafter.traits.sampled else None
    logits = sampling.process(model.logits(hidden))  # penalties, bias, grammar: each position after its drafts
    tokens, num_emitted, accept_state = acceptance.accept(logits, input_ids[:, 1:], kv_lens + 1, sampling,
                                                          accept_state, draft_probs=q)
    drafts, state = drafter.after_verify(model, kv_cache, meta, hidden, tokens, num_emitted, drafter_state,
                                         VerifyContext(sampling, None, num_drafts))
    return StepOutput(tokens, num_emitted, drafts, state, accept_state, sampling.logprobs(logits, tokens))


def verify_ragged(model: SelfDraftingCausalLM, drafter: Drafter, kv_cache: torch.Tensor, input_ids: torch.Tensor,
                  meta: AttentionMetadata, draft_lens: torch.Tensor, drafter_state: DrafterState,
                  accept_state: AcceptState, block_size: int, sampling: SamplingTensors) -> StepOutput:
    """A step in which row b verifies only its first draft_lens[b] drafts (ragged verification), for deterministic
    drafts (a drafter without `traits.sampled`) and a batch without logits processing.

    The target runs on the verified positions alone, each as a one-token row of its request — Σ_b (k_b + 1) rows,
    not B · (K + 1) — the way vLLM's batch expansion laid out verification: every row attends to its request's
    cache up to its own position, and the keys a forward writes are stored before any row reads them, so a row sees
    the drafts before it. Each verified position draws the target's token — the argmax for a greedy request, else a
    draw with the uniform of (seed, position) that plain decoding uses there — and row b emits its drafts while they
    equal the draws, then the draw (never past position k_b): strict acceptance, and for sampled requests the
    coupled rule (`acceptance_reference.coupled_acceptance`), whose emitted tokens are plain decoding's with the
    same seed whatever k_b is, so cutting a row's chain short keeps the target distribution. The hidden states of
    the unverified positions are zeros, which no drafter reads (it reads rows < num_emitted).

    Args:
        input_ids: [B, K+1] int64, [last, d1..dK]; meta: the grid's metadata (positions kv_len..kv_len+K).
        draft_lens: [B] int64 in [0, K].
        sampling: the requests' parameters (no logits processing: `SamplingTensors.rows` raises ValueError).
    Returns:
        StepOutput as `verify_and_draft_step`'s (tokens [B, K+1], num_emitted [B] ≤ draft_lens + 1); log-probabilities
        where a request asks ([B, K+1] positions, zeros past each row's verified ones).
    """
    b, w = input_ids.shape
    j = torch.arange(w, device=input_ids.device)
    verified = j[None, :] <= draft_lens[:, None]  # [B, K+1]
    rows, cols = verified.nonzero(as_tuple=True)  # row-major: each request's positions in order
    positions = meta.positions[rows, cols][:, None]  # [N, 1]
    tables = meta.block_tables[rows]
    flat = AttentionMetadata.create(positions, slots_for_positions(tables, positions, block_size), tables, block_size)
    hidden_flat = model(input_ids[rows, cols][:, None], kv_cache, flat)  # [N, 1, H]
    per_row = sampling.rows(rows)
    logits = model.logits(hidden_flat)  # [N, 1, V]
    drawn = sample_tokens(logits, positions + 1, per_row)  # [N, 1]: where each emitted token lands
    draws = torch.zeros_like(input_ids).index_put_((rows, cols), drawn[:, 0])  # [B, K+1]
    target, num_emitted = acceptance_rules.ragged_acceptance(input_ids[:, 1:], draws, draft_lens)
    hidden = hidden_flat.new_zeros(b, w, hidden_flat.shape[-1]).index_put_((rows, cols), hidden_flat[:, 0])
    drafts, state = drafter.after_verify(model, kv_cache, meta, hidden, target, num_emitted, drafter_state,
                                         VerifyContext(sampling, draft_lens))
    flat_logprobs = per_row.logprobs(logits, drawn)  # ([N, 1], [N, 1, k], [N, 1, k]) | None
    logprobs = None if flat_logprobs is None else tuple(
        x.new_zeros((b, w) + x.shape[2:]).index_put_((rows, cols), x[:, 0]) for x in flat_logprobs)
    return StepOutput(target, num_emitted, drafts, state, accept_state, logprobs)


class LinearDrafter:
    """The protocol's defaults for drafters whose K drafts form one chain, verified by `verify_and_draft_step`."""

    traits = DrafterTraits()

    def load_prefix(self, state: DrafterState, slot: int, token_ids: list[int]) -> None:
        return None

    def catch_up(self, kv_cache: torch.Tensor, meta: AttentionMetadata, input_ids: torch.Tensor) -> None:
        raise NotImplementedError(f"{type(self).__name__} keeps no KV written from tokens (traits.kv)")

    @property
    def decode_fn(self) -> Callable:
        return verify_and_draft_step

    def draft_probs(self, state: DrafterState, num_drafts: int, sampling: SamplingTensors) -> torch.Tensor | None:
        return None  # deterministic drafts: one-hot q

    def stat_draft_len(self, draft_len: int) -> int:
        return draft_len

    def expected_tokens(self, alpha: float, draft_len: float) -> float:
        return expected_tokens(alpha, draft_len)  # one chain of draft_len drafts


class NoDrafter(LinearDrafter):
    """Plain decoding: no drafts (K = 0)."""

    name = "none"
    traits = DrafterTraits(disaggregation=True)
    num_draft_tokens = max_draft_depth = 0

    def initial_state(self, batch, hidden_size, device, dtype):
        return ()

    def after_prefill(self, model, kv_cache, meta, hidden, next_tokens, last_idx, input_ids, state,
                      step=NO_PREFILL):
        return next_tokens.new_zeros(next_tokens.shape[0], 0), ()

    def after_verify(self, model, kv_cache, meta, hidden, target_tokens, num_emitted, state, step=NO_CONTEXT):
        return target_tokens.new_zeros(target_tokens.shape[0], 0), ()
