"""What the engine must know about a drafter, declared once as a frozen record (`DrafterTraits`): its KV, how far
that KV looks ahead, where each step's draft length comes from, whether its drafts are sampled or cost a forward
each, and what it allows (disaggregation, a cheaper draft head). The engine reads these through the setup resolved
at load (speculative/setup.py), never from the drafter class.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum


class DraftKV(Enum):
    """The KV a drafter keeps in the engine's paged cache (in the target's block ids)."""

    NONE = "none"  # no KV of its own (n-gram, suffix, Medusa): a cached block is the target's alone
    # written from the target's hidden states in the step that verifies (MTP): a step run with speculation off
    # leaves it unwritten, and nothing writes it later (such blocks are not registered in the prefix cache)
    FROM_HIDDEN = "from_hidden"
    # depends on the tokens only (a draft model): a step run with speculation off may skip it, and the drafter
    # writes the gap later from the tokens (`Drafter.catch_up`)
    FROM_TOKENS = "from_tokens"


class DraftLenSource(Enum):
    """Where a decode step's draft length comes from."""

    POLICY = "policy"  # the draft-length policy's k for the whole batch
    # the policy's k capped by the drafter's proposal for the batch (`Proposer.proposal_len`)
    PROPOSAL = "proposal"
    # as PROPOSAL, and the drafter takes the engine's step times (`Proposer.set_step_times`: it then proposes the
    # length of the most expected tokens per second) and, where the step can verify ragged batches, gives each row
    # its own length (`Proposer.proposal_lens`)
    PROPOSAL_PER_ROW = "proposal_per_row"


@dataclass(frozen=True)
class DrafterTraits:
    """A drafter's declaration to the engine.

    Attributes:
        kv: the KV it keeps (`DraftKV`).
        key_lookahead: tokens after a position that its KV there depends on (MTP Eagle 1, MTP Vanilla K): part of
            a prefix-cache block's key.
        rerun_rows: rows a prefill chunk re-runs from the previous chunk's end (MTP Vanilla: K, so that every
            module's KV near a chunk boundary is computed from the true next tokens).
        sampled: drafts drawn from the drafter's own distribution q (a draft model): the chain step hands q
            (`Drafter.draft_probs`) to the acceptance rule; False: deterministic drafts (one-hot q).
        on_demand: each draft costs a forward of its own (a draft model), so a step drafts only the draft length
            the policy chose (`VerifyContext.num_drafts`), where the step is the eager chain step.
        draft_len: where a step's draft length comes from (`DraftLenSource`).
        kv_only_pass: `after_verify` with `VerifyContext.draft` False writes its KV / state for the verified rows
            and skips the draft passes (a drafter that wraps it uses that on steps where another source drafts).
        disaggregation: a request can move to a decode server with only its KV, first token and drafts (no
            per-request drafter state, no second KV cache).
        draft_head: it drafts from the model's lm_head (MTP): the engine may give it a cheaper bf16 copy.
        tree: it verifies a tree of drafts in one forward under a tree mask (Medusa, MTP trees): a model
            with linear-attention layers (one recurrent state per request, no tree) cannot run it.
    """

    kv: DraftKV = DraftKV.NONE
    key_lookahead: int = 0
    rerun_rows: int = 0
    sampled: bool = False
    on_demand: bool = False
    draft_len: DraftLenSource = DraftLenSource.POLICY
    kv_only_pass: bool = False
    disaggregation: bool = False
    draft_head: bool = False
    tree: bool = False

    def __post_init__(self) -> None:
        if self.key_lookahead < 0 or self.rerun_rows < 0:
            raise ValueError(f"key_lookahead and rerun_rows must be ≥ 0, got {self.key_lookahead}, "
                             f"{self.rerun_rows}")
