"""Drafters: the strategies that propose the next step's K draft tokens from the target's hidden states.

Each implements `Drafter`: `after_prefill` and `after_verify` take fixed-shape device tensors and return drafts
[B, K] plus the drafter's per-request state (Vanilla's token/hidden pools, the n-gram drafter's token history;
nothing for Eagle). Chosen once, at load time, from the speculative config (STYLE.md §4). What the engine needs to
know about a drafter is on the protocol too (`decode_fn`, `prefill_overlap`, `stat_draft_len`): it never checks
which drafter runs. The n-gram (prompt lookup) drafter is in ngram_drafter.py, Medusa's in tree_step.py.
Sources: REFERENCE.md §2; DeepSeek-V3 report §2.2; TensorRT-LLM `_torch/speculative/mtp.py` (Eagle and Vanilla
modes) for the semantics, not the code.

Row convention: the drafter is handed "rows", one per target input position, with
- `hidden` [B, T, H]: the target's final hidden state at each row's position p;
- `input_ids` [B, T] (prefill only): the token at p;
- `next_tokens` [B, T]: the token at p + 1 (for the last accepted row: the token just emitted);
- `last_idx` [B]: the row of the last accepted position; rows after it hold rejected or padded inputs.
MTP module 1 at position p pairs embed(x_{p+1}) with h_p and predicts x_{p+2}.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol

import torch

from nextn.models.deepseek_v3.model import DeepseekV3ForCausalLM
from nextn.runtime.acceptance_rules import SamplingTensors
from nextn.runtime.attention_metadata import AttentionMetadata, slots_for_positions
from nextn.runtime.draft_gain import expected_tokens

DrafterState = tuple[torch.Tensor, ...]


def _at(x: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
    """x[b, idx[b]] for x [B, T, ...] and idx [B] → [B, 1, ...]."""
    index = idx.view(-1, 1, *([1] * (x.dim() - 2))).expand(-1, 1, *x.shape[2:])
    return x.gather(1, index)


class Drafter(Protocol):
    num_draft_tokens: int  # draft tokens verified per step (K; a Medusa tree's node count)
    max_draft_depth: int  # the most drafts one step can accept (K; a Medusa tree's depth)
    prefill_overlap: int  # rows a prefill chunk re-runs from the previous chunk's end (MTP Vanilla: K)
    uses_draft_head: bool  # drafts from the model's lm_head (MTP): the engine may give it a cheaper bf16 copy
    # Prefix caching (runtime/prefix_cache.py): tokens after a position that its drafter KV there depends on (MTP
    # Eagle 1, Vanilla K: part of a cached block's key), and whether it keeps KV that a step run without the drafter
    # (speculation off) leaves unwritten (MTP, draft model: such blocks are not cached).
    kv_lookahead: int
    kv_in_cache: bool

    @property
    def decode_fn(self) -> Callable:
        """The decode step that verifies this drafter's drafts (`verify_and_draft_step`, or Medusa's tree step)."""

    def stat_draft_len(self, draft_len: int) -> int:
        """Drafts counted per request for a decode step run with `draft_len` (statistics: DT, DAR, AL)."""

    def expected_tokens(self, alpha: float, draft_len: float) -> float:
        """Tokens a request is expected to emit in a decode step run with `draft_len` when each top-1 draft is
        accepted with probability α (runtime/draft_gain.py; the adaptive draft-length policy's model)."""

    def initial_state(self, batch: int, hidden_size: int, device: torch.device, dtype: torch.dtype) -> DrafterState:
        """Per-request state for `batch` fresh requests (empty tuple when stateless)."""

    def after_prefill(self, model: DeepseekV3ForCausalLM, kv_cache: torch.Tensor, meta: AttentionMetadata,
                      hidden: torch.Tensor, next_tokens: torch.Tensor, last_idx: torch.Tensor,
                      input_ids: torch.Tensor, state: DrafterState, sampling: SamplingTensors | None = None,
                      draft: bool = True) -> tuple[torch.Tensor, DrafterState]:
        """Drafts [B, K] after a prefill over the prompt rows, and the state for the first decode step (`state`:
        the rows' state before this chunk — stale for a request's first chunk; `sampling`: the requests' sampling
        parameters, for drafters that sample their drafts). `draft` False: the next decode step will not speculate
        (the draft-length policy is off at that batch size), so a drafter may only write its KV / state for the
        prompt rows and return zeros: the step that turns speculation back on drafts first."""

    def after_verify(self, model: DeepseekV3ForCausalLM, kv_cache: torch.Tensor, meta: AttentionMetadata,
                     hidden: torch.Tensor, target_tokens: torch.Tensor, num_emitted: torch.Tensor,
                     state: DrafterState) -> tuple[torch.Tensor, DrafterState]:
        """Drafts [B, K] after verifying [last, d1..dK]: rows are the K+1 verified positions, last_idx = num_emitted − 1."""

    def load_prefix(self, state: DrafterState, slot: int, token_ids: list[int]) -> None:
        """Before a prefill that starts after a prefix-cache hit: rebuild, in place, the per-request state of batch
        slot `slot` that the reused tokens `token_ids` (positions 0..n−1) would have left (no-op when the drafter's
        state lives in the KV cache or is rebuilt by the prefill)."""


class LinearDrafter:
    """The protocol's defaults for drafters whose K drafts form one chain, verified by `verify_and_draft_step`."""

    prefill_overlap = 0
    uses_draft_head = False
    kv_lookahead = 0
    kv_in_cache = False

    def load_prefix(self, state: DrafterState, slot: int, token_ids: list[int]) -> None:
        return None

    @property
    def decode_fn(self) -> Callable:
        from nextn.runtime.spec_step import verify_and_draft_step  # spec_step imports this module

        return verify_and_draft_step

    def stat_draft_len(self, draft_len: int) -> int:
        return draft_len

    def expected_tokens(self, alpha: float, draft_len: float) -> float:
        return expected_tokens(alpha, draft_len)  # one chain of draft_len drafts


class MtpEagleDrafter(LinearDrafter):
    """MTP Eagle: module 1 applied K times with a shared KV (TensorRT-LLM's default for one-module checkpoints).

    Step 1 runs over all rows (filling the module's KV for every accepted position; rows past the last accepted
    one write KV that later steps overwrite) and drafts from the last accepted row. Steps 2..K each take one token:
    the previous draft with the module's own previous output, at the next position.
    """

    uses_draft_head = True
    kv_lookahead = 1  # module 1's KV at p pairs embed(x_{p+1}) with h_p
    kv_in_cache = True

    def __init__(self, num_draft_tokens: int) -> None:
        self.num_draft_tokens = self.max_draft_depth = num_draft_tokens

    def initial_state(self, batch: int, hidden_size: int, device: torch.device, dtype: torch.dtype) -> DrafterState:
        return ()

    def _draft(self, model: DeepseekV3ForCausalLM, kv_cache: torch.Tensor, meta: AttentionMetadata,
               hidden: torch.Tensor, next_tokens: torch.Tensor, last_idx: torch.Tensor) -> torch.Tensor:
        h = _at(model.forward_mtp(0, next_tokens, hidden, kv_cache, meta), last_idx)  # [B, 1, H]
        token = model.mtp_logits(0, h).argmax(-1)  # [B, 1]
        drafts = [token]
        position = _at(meta.positions, last_idx)  # [B, 1]
        for _ in range(1, self.num_draft_tokens):
            position = position + 1
            step_meta = meta.with_tokens(position, slots_for_positions(meta.block_tables, position, meta.block_size))
            h = model.forward_mtp(0, token, h, kv_cache, step_meta)
            token = model.mtp_logits(0, h).argmax(-1)
            drafts.append(token)
        return torch.cat(drafts, dim=1)

    def after_prefill(self, model, kv_cache, meta, hidden, next_tokens, last_idx, input_ids, state, sampling=None,
                      draft=True):
        if not draft:  # the module's KV over the prompt rows only
            model.forward_mtp(0, next_tokens, hidden, kv_cache, meta)
            return next_tokens.new_zeros(next_tokens.shape[0], self.num_draft_tokens), ()
        return self._draft(model, kv_cache, meta, hidden, next_tokens, last_idx), ()

    def after_verify(self, model, kv_cache, meta, hidden, target_tokens, num_emitted, state):
        return self._draft(model, kv_cache, meta, hidden, target_tokens, num_emitted - 1), ()


class MtpVanillaDrafter(LinearDrafter):
    """MTP Vanilla: K distinct modules, module k drafts token k, each with its own KV (DeepSeek-V3 report §2.2).

    Module k at position p pairs embed(x_{p+k}) with module k−1's output at p (the target's for k = 1). After a
    verification every module re-runs over a window of the K+1 positions ending at the last accepted one: this
    covers every position whose module-k KV was computed from a draft that has since been rejected, and every new
    position. The window's target hidden states and tokens come from the per-request pools
    (`pool_tokens` [B, K+1], `pool_hidden` [B, K+1, H]), slid after each verification.
    """

    uses_draft_head = True
    kv_in_cache = True

    def __init__(self, num_draft_tokens: int) -> None:
        self.num_draft_tokens = self.max_draft_depth = num_draft_tokens
        self.prefill_overlap = num_draft_tokens  # every module's KV near a chunk boundary from the true tokens
        self.kv_lookahead = num_draft_tokens  # module k's KV at p depends on x_{p+k}

    def initial_state(self, batch: int, hidden_size: int, device: torch.device, dtype: torch.dtype) -> DrafterState:
        w = self.num_draft_tokens + 1
        return (torch.zeros(batch, w, dtype=torch.int64, device=device),
                torch.zeros(batch, w, hidden_size, dtype=dtype, device=device))

    def _run_modules(self, model: DeepseekV3ForCausalLM, kv_cache: torch.Tensor, meta: AttentionMetadata,
                     hidden: torch.Tensor, tokens: torch.Tensor, last_idx: torch.Tensor) -> torch.Tensor:
        drafts = []
        h = hidden
        for k in range(self.num_draft_tokens):
            h = model.forward_mtp(k, tokens, h, kv_cache, meta)
            token = model.mtp_logits(k, _at(h, last_idx)).argmax(-1)  # [B, 1]
            drafts.append(token)
            # Module k+1 at row i needs the token one further on: shift left, put the new draft at last_idx.
            tokens = torch.cat([tokens[:, 1:], tokens[:, -1:]], dim=1).scatter(1, last_idx[:, None], token)
        return torch.cat(drafts, dim=1)

    def _window(self, x: torch.Tensor, last_idx: torch.Tensor) -> torch.Tensor:
        """Rows last_idx−K..last_idx of x [B, T, ...] (zeros before row 0) → [B, K+1, ...]."""
        w = self.num_draft_tokens + 1
        idx = last_idx[:, None] - w + 1 + torch.arange(w, device=x.device)  # [B, K+1]
        valid = idx >= 0
        idx = idx.clamp(min=0).view(*idx.shape, *([1] * (x.dim() - 2))).expand(-1, -1, *x.shape[2:])
        out = x.gather(1, idx)
        return out * valid.view(*valid.shape, *([1] * (x.dim() - 2))).to(out.dtype)

    def after_prefill(self, model, kv_cache, meta, hidden, next_tokens, last_idx, input_ids, state, sampling=None,
                      draft=True):
        drafts = self._run_modules(model, kv_cache, meta, hidden, next_tokens, last_idx)
        return drafts, (self._window(next_tokens, last_idx), self._window(hidden, last_idx))

    def after_verify(self, model, kv_cache, meta, hidden, target_tokens, num_emitted, state):
        pool_tokens, pool_hidden = state  # positions L−K..L (tokens one ahead) and L−K−1..L−1, L = first verified
        w = self.num_draft_tokens + 1
        # Rows of [pool; verified] ending at the last accepted position L + num_emitted − 1.
        idx = num_emitted[:, None] + torch.arange(w, device=hidden.device)  # [B, K+1]
        win_hidden = torch.cat([pool_hidden, hidden], dim=1).gather(1, idx[..., None].expand(-1, -1, hidden.shape[-1]))
        win_tokens = torch.cat([pool_tokens, target_tokens], dim=1).gather(1, idx)
        positions = meta.positions[:, :1] + num_emitted[:, None] - w + torch.arange(w, device=hidden.device)
        win_meta = meta.with_tokens(positions, slots_for_positions(meta.block_tables, positions, meta.block_size))
        last = torch.full_like(num_emitted, w - 1)
        drafts = self._run_modules(model, kv_cache, win_meta, win_hidden, win_tokens, last)
        return drafts, (win_tokens, win_hidden)


class NoDrafter(LinearDrafter):
    """Plain decoding: no drafts (K = 0)."""

    num_draft_tokens = max_draft_depth = 0

    def initial_state(self, batch, hidden_size, device, dtype):
        return ()

    def after_prefill(self, model, kv_cache, meta, hidden, next_tokens, last_idx, input_ids, state, sampling=None,
                      draft=True):
        return next_tokens.new_zeros(next_tokens.shape[0], 0), ()

    def after_verify(self, model, kv_cache, meta, hidden, target_tokens, num_emitted, state):
        return target_tokens.new_zeros(target_tokens.shape[0], 0), ()
