"""Combined drafting: suffix drafts where the suffix trees expect enough accepted drafts, a model drafter's
elsewhere — decided per request, per step (Snowflake Arctic Inference's "Arctic + Suffix": suffix speculation when
its score clears a threshold, the learned speculator otherwise; TensorRT-LLM combines its suffix automaton with
MTP / Eagle the same way). One chain step verifies either kind: every row carries K drafts.

    each step     both drafters see the verified rows (the model drafter keeps its KV and state whole); the
                  suffix trees propose first; row b takes the suffix proposal when its score — the expected
                  number of accepted drafts (speculative/suffix_tree.py) — is at least `min_score`, else the
                  model drafter's K_m drafts, padded to K with their last token; when every row takes the suffix
                  proposal the model drafter only writes its KV (`traits.kv_only_pass`: no draft passes)
    how many      the step verifies as many drafts as the longest useful proposal in the batch (`proposal_len`:
                  a suffix row's match length, a model row's K_m)
    sampling      the model drafter's q for its rows (a draft model samples its drafts), one-hot q for suffix
                  rows and for the padding (a function of the drafts before it): rejection sampling stays exact
                  (Leviathan et al. 2023, §2.3, with q the distribution each draft was drawn from)

Lossless by construction: which drafts a row verifies never changes what the acceptance rule emits for them.
The suffix drafter reads tokens on the host, so the combination runs on CPU engines only (suffix.py's `build`).
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any, Protocol

import torch

from nextn.speculative.chain_step import LinearDrafter
from nextn.speculative.protocol import NO_CONTEXT, NO_PREFILL, Drafter, DrafterState, SamplingTensors
from nextn.speculative.traits import DraftLenSource


class SuffixSource(Drafter, Protocol):
    """The suffix drafter as combined drafting reads it (`SuffixDrafter`, whose module builds this drafter)."""

    slots: dict[int, Any]  # batch slot → its request's suffix state: `useful` drafts and the proposal's `score`

__all__ = ["CombinedDrafter"]


class CombinedDrafter(LinearDrafter):
    """A suffix drafter and a chain model drafter (Draft_Target, MTP as a chain) behind one `Drafter`.

    Args:
        suffix: the `SuffixDrafter` (K drafts a step; its per-slot proposals carry `useful` and `score`).
        model: the model drafter; its draft count K_m ≤ K.
        min_score: a suffix proposal wins its row when its score is ≥ this (None: K_m, the most accepted drafts the
            model drafter could give in one step).
    Raises:
        ValueError: K_m > K, or a tree drafter (it verifies a tree, not a chain).
    Attributes:
        rows_from_suffix, rows_from_model: rows drafted by each so far (statistics).
        steps_without_model_drafts: steps in which every row took the suffix proposal, so a model drafter that
            `traits.kv_only_pass` only wrote its KV (no draft passes: such a step costs what Suffix alone costs).
    """

    def __init__(self, suffix: SuffixSource, model: Drafter, min_score: float | None = None) -> None:
        if model.num_draft_tokens > suffix.num_draft_tokens:
            raise ValueError(f"the model drafter's {model.num_draft_tokens} drafts exceed the suffix drafter's "
                             f"{suffix.num_draft_tokens}")
        if hasattr(model, "tree_layout"):
            raise ValueError(f"{model.name} drafts a tree; combined drafting takes a chain drafter")
        self.suffix, self.model = suffix, model
        self.name = f"Suffix+{model.name}"
        self.num_draft_tokens = self.max_draft_depth = suffix.num_draft_tokens
        self.model_drafts = model.num_draft_tokens
        self.min_score = float(self.model_drafts if min_score is None else min_score)
        # the model drafter's KV and state are what the engine must keep for it
        # the model drafter's KV and state are what the engine must keep for it (the suffix trees are host state:
        # only the model drafter's KV lags); the draft length comes from the proposals
        self.traits = replace(model.traits, draft_len=DraftLenSource.PROPOSAL, on_demand=False,
                              kv_only_pass=False, disaggregation=False)
        self._from_suffix: dict[int, bool] = {}  # batch slot → whether its last drafts came from the suffix trees
        self.rows_from_suffix = self.rows_from_model = 0
        self.steps_without_model_drafts = 0  # steps where every row copied and the model drafter only kept its KV

    # State: (suffix's slot ids [B], *the model drafter's state, drafts [B, K] int64, from_suffix [B] bool) --------
    def initial_state(self, batch: int, hidden_size: int, device: torch.device, dtype: torch.dtype) -> DrafterState:
        return (*self.suffix.initial_state(batch, hidden_size, device, dtype),
                *self.model.initial_state(batch, hidden_size, device, dtype),
                torch.zeros(batch, self.num_draft_tokens, dtype=torch.int64, device=device),
                torch.zeros(batch, dtype=torch.bool, device=device))

    def _split(self, state: DrafterState) -> tuple[DrafterState, DrafterState]:
        return state[:1], state[1:-2]

    def load_prefix(self, state: DrafterState, slot: int, token_ids: list[int]) -> None:
        suffix_state, model_state = self._split(state)
        self.suffix.load_prefix(suffix_state, slot, token_ids)
        self.model.load_prefix(model_state, slot, token_ids)

    def proposal_len(self, slots: list[int]) -> int:
        """The longest useful proposal among `slots`: a suffix row's match, a model row's K_m."""
        known = self.suffix.slots
        return max(1, max(((known[s].useful if self._from_suffix.get(s) else self.model_drafts)
                           for s in slots if s in known), default=self.num_draft_tokens))

    def _picks(self, suffix_state: DrafterState, draft: bool = True) -> list[bool]:
        """Per row: whether the suffix proposal (score ≥ min_score) drafts it."""
        known = self.suffix.slots
        return [draft and s in known and known[s].score >= self.min_score for s in suffix_state[0].tolist()]

    def _choose(self, pick: list[bool], suffix_drafts: torch.Tensor, model_drafts: torch.Tensor,
                suffix_state: DrafterState, model_state: DrafterState) -> tuple[torch.Tensor, DrafterState]:
        """Per row: the suffix proposal where `pick`, else the model's drafts padded to K."""
        for s, p in zip(suffix_state[0].tolist(), pick):
            self._from_suffix[s] = p
        n = sum(pick)
        self.rows_from_suffix += n
        self.rows_from_model += len(pick) - n
        k, km = self.num_draft_tokens, model_drafts.shape[1]
        padded = model_drafts if km == k else torch.cat(
            [model_drafts, (model_drafts[:, -1:] if km else suffix_drafts[:, :1]).expand(-1, k - km)], dim=1)
        from_suffix = torch.tensor(pick, dtype=torch.bool, device=suffix_drafts.device)
        drafts = torch.where(from_suffix[:, None], suffix_drafts, padded)
        return drafts, (*suffix_state, *model_state, drafts, from_suffix)

    # The protocol -------------------------------------------------------------------------------------------------
    def catch_up(self, kv_cache, meta, input_ids):
        self.model.catch_up(kv_cache, meta, input_ids)

    def after_prefill(self, model, kv_cache, meta, hidden, next_tokens, last_idx, input_ids, state,
                      step=NO_PREFILL):
        suffix_state, model_state = self._split(state)
        s_drafts, suffix_state = self.suffix.after_prefill(model, kv_cache, meta, hidden, next_tokens, last_idx,
                                                           input_ids, suffix_state, step)
        m_drafts, model_state = self.model.after_prefill(model, kv_cache, meta, hidden, next_tokens, last_idx,
                                                         input_ids, model_state, step)
        return self._choose(self._picks(suffix_state, step.draft), s_drafts, m_drafts, suffix_state, model_state)

    def after_verify(self, model, kv_cache, meta, hidden, target_tokens, num_emitted, state, step=NO_CONTEXT):
        suffix_state, model_state = self._split(state)
        s_drafts, suffix_state = self.suffix.after_verify(model, kv_cache, meta, hidden, target_tokens, num_emitted,
                                                          suffix_state)
        pick = self._picks(suffix_state)
        if all(pick) and self.model.traits.kv_only_pass:  # every row copies: the model drafter keeps its KV only
            step = replace(step, draft=False)
            self.steps_without_model_drafts += 1
        m_drafts, model_state = self.model.after_verify(model, kv_cache, meta, hidden, target_tokens, num_emitted,
                                                        model_state, step)
        return self._choose(pick, s_drafts, m_drafts, suffix_state, model_state)

    def draft_probs(self, state: DrafterState, num_drafts: int, sampling: SamplingTensors) -> torch.Tensor | None:
        """q [B, num_drafts, V] fp32: the model drafter's q on its rows' first K_m drafts, one-hot elsewhere (suffix
        rows, padding); None when the model drafter's drafts are deterministic too (one-hot q for every row)."""
        _, model_state = self._split(state)
        drafts, from_suffix = state[-2], state[-1]
        km = min(num_drafts, self.model_drafts)
        q_model = self.model.draft_probs(model_state, km, sampling) if self.traits.sampled else None
        if q_model is None:
            return None
        q = torch.nn.functional.one_hot(drafts[:, :num_drafts], q_model.shape[-1]).to(q_model.dtype)
        q[:, :km] = torch.where(from_suffix[:, None, None], q[:, :km], q_model)
        return q
