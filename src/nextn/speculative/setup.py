"""The speculative setup an engine runs, resolved once at load (`resolve`): the method's drafter and acceptance rule,
the drafter's traits, the decode step as layered (compiled, CUDA-graphed), and the engine's choices that follow from
them — ragged steps, on-demand drafts, the draft-length policy, what the scheduler reads (`DraftSchedule`). The
scheduler and the model runner read this record; nothing outside `nextn.speculative` reads a drafter's traits or
checks its class.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, replace
from typing import Any, cast

from nextn.speculative.acceptance_rules import StandardAcceptance
from nextn.speculative.chain_step import verify_and_draft_step
from nextn.speculative.draft_len_policy import DraftLenPolicy, ProposalDraftLen, choose_draft_len_policy
from nextn.speculative.protocol import AcceptanceRule, Drafter, Proposer
from nextn.speculative.traits import DraftKV, DraftLenSource, DrafterTraits


@dataclass(frozen=True)
class DraftSchedule:
    """What the scheduler reads of the speculative setup.

    Attributes:
        num_draft_tokens: K, the drafter's drafts per step (0: plain decoding).
        rerun_rows: rows a prefill chunk re-runs from the previous chunk's end (`DrafterTraits.rerun_rows`).
        kv: the drafter's KV (`DraftKV`): with FROM_HIDDEN or FROM_TOKENS, blocks past a step run with speculation
            off are not registered in the prefix cache; with FROM_TOKENS, prefills that will not speculate skip the
            drafter and a request's first drafting step after such a gap catches it up.
        on_demand: a decode step drafts only the draft length the policy chose for it, not K (a draft model on the
            eager chain step: `StepPlan.num_drafts`); a step then verifies at most the drafts its rows' last
            step made.
        proposal_len: (batch slots) → the draft length worth verifying for them, which caps the step's
            (`Proposer.proposal_len`); None: the policy's draft length stands.
        proposal_lens: (batch slots, cap) → each row's own draft length, or None (`Proposer.proposal_lens`), where
            the decode step verifies ragged batches (`StepPlan.draft_lens`); None: one length per step.
    """

    num_draft_tokens: int = 0
    rerun_rows: int = 0
    kv: DraftKV = DraftKV.NONE
    on_demand: bool = False
    proposal_len: Callable[[list[int]], int] | None = None
    proposal_lens: Callable[[list[int], int], list[int] | None] | None = None

    def without_proposals(self) -> DraftSchedule:
        """This schedule with the drafter's proposals ignored (a step profile times every draft length as asked)."""
        return replace(self, proposal_len=None, proposal_lens=None)


@dataclass(frozen=True)
class SpeculativeSetup:
    """The speculative method as the engine runs it.

    Attributes:
        drafter, acceptance: the method's strategies (registry.build).
        traits: the drafter's `DrafterTraits`.
        decode_fn: the decode step as layered (the drafter's `decode_fn`, compiled or CUDA-graphed).
        ragged: decode steps may verify each row's own draft length (`chain_step.verify_ragged`): a proposer of
            per-row lengths, the eager chain step, deterministic drafts and `StandardAcceptance` (strict acceptance
            of greedy rows, the coupled rule of sampled ones).
        schedule: what the scheduler reads (`DraftSchedule`).
    """

    drafter: Drafter
    acceptance: AcceptanceRule
    traits: DrafterTraits
    decode_fn: Callable[..., Any]
    ragged: bool
    schedule: DraftSchedule

    @property
    def num_draft_tokens(self) -> int:
        return self.drafter.num_draft_tokens

    def draft_len_policy(self, spec: Any, step_profile: Mapping[int, Mapping[int, float]] | None
                         ) -> DraftLenPolicy:
        """The draft-length policy for `spec` (`choose_draft_len_policy`) over the measured step times; a proposer
        of per-row lengths is handed the policy's step times (it then proposes by expected tokens per second).

        Raises:
            LlmArgsError: a draft-length schedule that does not fit K.
        """
        proposes = self.traits.draft_len is DraftLenSource.PROPOSAL_PER_ROW
        policy = choose_draft_len_policy(spec, self.num_draft_tokens, self.drafter.expected_tokens, step_profile,
                                         proposes=proposes)
        if isinstance(policy, ProposalDraftLen):
            cast(Proposer, self.drafter).set_step_times(policy.relative_step_time, policy.ragged_step_times)
        return policy


def resolve(drafter: Drafter, acceptance: AcceptanceRule, decode_fn: Callable[..., Any] | None = None,
            layered: bool = False, recurrent: bool = False) -> SpeculativeSetup:
    """The setup of `drafter` and `acceptance` (registry.build's) run by `decode_fn` (default: the drafter's own
    step); `layered`: the step is compiled or CUDA-graphed (traced with K draft passes and one draft length per
    step, so no on-demand drafts and no ragged steps); `recurrent`: the target keeps recurrent state (Gated DeltaNet
    layers), which a ragged step's rows — one verified token each, `chain_step.verify_ragged` — cannot carry, so
    no ragged steps (each step verifies one draft length, its rows' longest proposal at most)."""
    traits = drafter.traits
    eager_chain = drafter.decode_fn is verify_and_draft_step and not layered
    proposes = traits.draft_len is not DraftLenSource.POLICY
    ragged = (traits.draft_len is DraftLenSource.PROPOSAL_PER_ROW and eager_chain and not traits.sampled
              and type(acceptance) is StandardAcceptance and not recurrent)
    proposer = cast(Proposer, drafter)  # its traits say it has the hooks read here
    schedule = DraftSchedule(drafter.num_draft_tokens, traits.rerun_rows, traits.kv,
                             traits.on_demand and eager_chain,
                             proposer.proposal_len if proposes else None,
                             proposer.proposal_lens if ragged else None)
    return SpeculativeSetup(drafter, acceptance, traits, decode_fn or drafter.decode_fn, ragged, schedule)
