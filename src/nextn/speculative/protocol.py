"""The contracts between speculative decoding and the engine: `Drafter` and `AcceptanceRule` (chain and tree
variants: `TreeDrafter`, `TreeAcceptanceRule` over a `TreeLayout`), the per-step `StepOutput` and the batch's
`SamplingTensors`.

A method (registry.py) builds one drafter and one acceptance rule; the model runner hands them fixed-shape device
tensors and gets fixed-shape device tensors back, so the whole step can be compiled and captured in one CUDA graph.

Row convention: the drafter is handed "rows", one per target input position, with
- `hidden` [B, T, H]: the target's final hidden state at each row's position p;
- `input_ids` [B, T] (prefill only): the token at p;
- `next_tokens` [B, T]: the token at p + 1 (for the last accepted row: the token just emitted);
- `last_idx` [B]: the row of the last accepted position; rows after it hold rejected or padded inputs.
Sources: arXiv:2412.19437 §2.2 (TensorRT-LLM's MTP semantics); Leviathan et al. 2023 (acceptance).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

import torch

from nextn.models.attention_metadata import AttentionMetadata
from nextn.models.causal_lm import SelfDraftingCausalLM
from nextn.plugins.sampling import filtered_probs
from nextn.speculative.logits_processing import LogitsProcessing, token_logprobs
from nextn.speculative.traits import DrafterTraits

AcceptState = tuple[torch.Tensor, ...]
DrafterState = tuple[torch.Tensor, ...]


@dataclass(frozen=True)
class SamplingTensors:
    """Per-request sampling parameters of one batch, on the device.

    Attributes:
        temperature: [B] fp32 (0 = greedy); top_k: [B] int64 (0 = off); top_p: [B] fp32; seed: [B] int64.
        any_sampled: whether some request has temperature > 0 (host-known: picks the computation, not a value).
        use_filters: whether some sampling request uses top-k or top-p (host-known: skips the sort when not).
        processing: the rows' penalties, bias, min_tokens and grammar masks per verified position (None: none;
            speculative/logits_processing.py); a step applies it to the target's logits before the acceptance rule.
        num_logprobs: −1 (no row asks) or the most top log-probabilities a row asks for: the step then returns
            each emitted token's log-probability and the top ones (`StepOutput.logprobs`).
    """

    temperature: torch.Tensor
    top_k: torch.Tensor
    top_p: torch.Tensor
    seed: torch.Tensor
    any_sampled: bool
    use_filters: bool
    processing: LogitsProcessing | None = None
    num_logprobs: int = -1

    @property
    def host_work(self) -> bool:
        """Whether the step needs logit processing or log-probabilities (steps that do run eagerly, as a chain)."""
        return self.processing is not None or self.num_logprobs >= 0

    def process(self, logits: torch.Tensor) -> torch.Tensor:
        """The target's logits [B, T, V] with the rows' processing applied (the same tensor when there is none)."""
        return logits if self.processing is None else self.processing.apply(logits)

    def logprobs(self, logits: torch.Tensor, tokens: torch.Tensor) -> tuple[torch.Tensor, ...] | None:
        """`token_logprobs` of `tokens` [B, T] under processed logits [B, T, V], or None when no row asks."""
        if self.num_logprobs < 0:
            return None
        return token_logprobs(logits, tokens, self.temperature, self.num_logprobs)

    def rows(self, index: torch.Tensor) -> SamplingTensors:
        """The parameters of the requests `index` [N] int64 (a request may repeat: one row per verified position of
        a ragged step). Raises ValueError when the batch has logits processing (its state is per request and
        position, not per row)."""
        if self.processing is not None:
            raise ValueError("logits processing cannot be split into rows; verify one draft length for this batch")
        return SamplingTensors(self.temperature[index], self.top_k[index], self.top_p[index], self.seed[index],
                               self.any_sampled, self.use_filters, None, self.num_logprobs)

    def probs(self, logits: torch.Tensor) -> torch.Tensor:
        """Sampling distributions for logits [B, T, V] → [B, T, V] (each request's parameters on all its rows)."""
        b, t, v = logits.shape
        rep = lambda x: x.repeat_interleave(t)  # noqa: E731
        flat = filtered_probs(logits.reshape(b * t, v), rep(self.temperature), rep(self.top_k), rep(self.top_p),
                              self.use_filters)
        return flat.view(b, t, v)


class AcceptanceRule(Protocol):
    def initial_state(self, batch: int, device: torch.device) -> AcceptState:
        """Per-request state for `batch` requests (empty when stateless)."""

    def prompt_state(self, token_ids: list[int]) -> tuple[float, ...]:
        """Host-side initial state of one request from its prompt (+ output after a preemption)."""

    def accept(self, logits: torch.Tensor, draft_tokens: torch.Tensor, first_position: torch.Tensor,
               sampling: SamplingTensors, state: AcceptState, draft_probs: torch.Tensor | None = None
               ) -> tuple[torch.Tensor, torch.Tensor, AcceptState]:
        """(tokens [B, K+1], num_emitted [B], new state) for logits [B, K+1, V] and drafts [B, K];
        first_position [B] is the position of the first token this step can emit (kv_len + 1); draft_probs
        [B, K, V] fp32 the distributions sampled drafts were drawn from (None: deterministic drafts, one-hot q)."""

    def observe(self, tokens: torch.Tensor, num_emitted: torch.Tensor, state: AcceptState) -> AcceptState:
        """The state after tokens emitted outside `accept` (the prefill's first token)."""


@dataclass(frozen=True)
class TreeLayout:
    """The draft tree one tree step verifies: w tokens, token 0 the root (the last emitted token), then w − 1 draft
    nodes, every parent before its children. One tree for the batch ([w] / [w, w]) or one per request ([B, w] /
    [B, w, w]).

    Attributes:
        parents: [w] or [B, w] int64 parent token index (the root is its own parent, 0).
        depth: [w] or [B, w] int64 (root 0): token i is verified at rope position kv_len + depth[i].
        mask: [w, w] or [B, w, w] bool, mask[.., i, j]: token i sees token j (its ancestors and itself).
        max_depth: D, the deepest a node may be (host int): accepted paths are [B, D+1].
    """

    parents: torch.Tensor
    depth: torch.Tensor
    mask: torch.Tensor
    max_depth: int


class TreeAcceptanceRule(AcceptanceRule, Protocol):
    """An acceptance rule over a tree of drafts (Medusa, MTP trees): the rows are tree nodes, and the emitted tokens
    follow the longest accepted root-to-node path. A step without a tree (width 1) uses `accept`."""

    def accept_tree(self, logits: torch.Tensor, tree_tokens: torch.Tensor, layout: TreeLayout,
                    kv_lens: torch.Tensor, sampling: SamplingTensors
                    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(path [B, D+1] int64, num_accepted [B] int64 in [0, D], tokens [B, D+1] int64) for logits [B, w, V] fp32
        over the tree tokens [B, w] laid out by `layout` (kv_lens [B]: the root's position). path[:, t] is the token
        index of the accepted path's node at depth t for t ≤ num_accepted (entries past it: any valid index);
        tokens are the target's along the path: the accepted drafts, then the correction or bonus token (the
        first num_accepted + 1 are emitted). A token drawn at depth t lands at position kv_len + 1 + t."""


@dataclass(frozen=True)
class StepOutput:
    """What one step leaves on the device for the host.

    Attributes:
        tokens: [B, K+1] int64; the emitted tokens of request b are tokens[b, :num_emitted[b]].
        num_emitted: [B] int64 in [1, K+1] (prefill: 1).
        draft_tokens: [B, K] int64 drafts for the next step.
        drafter_state: the drafter's per-request state for the next step.
        accept_state: the acceptance rule's per-request state (the thinking delta) for the next step.
        logprobs: with `SamplingTensors.num_logprobs` ≥ 0, (logprob [B, K+1] fp32 of each token in `tokens`,
            top_logprobs [B, K+1, k] fp32, top_ids [B, K+1, k] int64); else None.
    """

    tokens: torch.Tensor
    num_emitted: torch.Tensor
    draft_tokens: torch.Tensor
    drafter_state: DrafterState
    accept_state: AcceptState = ()
    logprobs: tuple[torch.Tensor, ...] | None = None


@dataclass(frozen=True)
class VerifyContext:
    """What a decode step tells the drafter's `after_verify` besides the verified rows (always passed).

    Attributes:
        sampling: the requests' sampling parameters (a drafter with `traits.sampled` draws its drafts with them);
            None only where a caller outside the engine runs the hook.
        draft_lens: [B] int64 in [0, K], each row's verified drafts on a ragged step (`chain_step.verify_ragged`);
            None: every row verified the step's draft length.
        num_drafts: the drafts to make for the next step, 1..K, for a drafter with `traits.on_demand` on the eager
            chain step (the rest of its [B, K] drafts are zeros, never verified); None: K.
        draft: False: write the drafter's KV / state for the verified rows and skip the draft passes (zeros come
            back); only for drafters with `traits.kv_only_pass`.
    """

    sampling: SamplingTensors | None = None
    draft_lens: torch.Tensor | None = None
    num_drafts: int | None = None
    draft: bool = True


NO_CONTEXT = VerifyContext()


@dataclass(frozen=True)
class PrefillContext:
    """What a prefill step tells the drafter's `after_prefill` besides the prompt rows (always passed).

    Attributes:
        sampling: the requests' sampling parameters (a drafter with `traits.sampled` draws its drafts with them);
            None only where a caller outside the engine runs the hook.
        draft: False: the next decode step will not speculate (the draft-length policy is off at that batch size),
            so the drafter may only write its KV / state for the prompt rows and return zeros: the step that turns
            speculation back on drafts first.
    """

    sampling: SamplingTensors | None = None
    draft: bool = True


NO_PREFILL = PrefillContext()


def rows_at(x: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
    """x[b, idx[b]] for x [B, T, ...] and idx [B] → [B, 1, ...]."""
    index = idx.view(-1, 1, *([1] * (x.dim() - 2))).expand(-1, 1, *x.shape[2:])
    return x.gather(1, index)


class Drafter(Protocol):
    """A drafter strategy: proposes the next step's drafts from the target's hidden states (row convention above).

    Everything the engine, the scheduler, the prefix cache, disaggregated serving and the benchmarks need to know
    about a drafter is in its `traits`, resolved once at load into a `SpeculativeSetup` (speculative/setup.py);
    nothing outside `nextn.speculative` checks which class runs.
    """

    name: str  # what logs, benchmarks and the prefix cache's key call it ("MtpEagle", "NGram", "DraftModel", ...)
    traits: DrafterTraits  # what the engine must know about it (speculative/traits.py), read once at load
    num_draft_tokens: int  # draft tokens verified per step (K; a Medusa tree's node count)
    max_draft_depth: int  # the most drafts one step can accept (K; a Medusa tree's depth)

    def catch_up(self, kv_cache: torch.Tensor, meta: AttentionMetadata, input_ids: torch.Tensor) -> None:
        """(drafters with `traits.kv` FROM_TOKENS) write the drafter's KV for tokens input_ids [B, T] int64 at
        `meta`'s positions (pads: slots of the null block), nothing else; other drafters never see it."""

    @property
    def decode_fn(self) -> Callable:
        """The decode step that verifies this drafter's drafts: `chain_step.verify_and_draft_step`, or
        `tree_step.tree_verify_and_draft_step` for a `TreeDrafter`."""

    def stat_draft_len(self, draft_len: int) -> int:
        """Drafts counted per request for a decode step run with `draft_len` (statistics: DT, DAR, AL)."""

    def expected_tokens(self, alpha: float, draft_len: float) -> float:
        """Tokens a request is expected to emit in a decode step run with `draft_len` when each top-1 draft is
        accepted with probability α (speculative/draft_gain.py; the adaptive draft-length policy's model)."""

    def initial_state(self, batch: int, hidden_size: int, device: torch.device, dtype: torch.dtype) -> DrafterState:
        """Per-request state for `batch` fresh requests (empty tuple when stateless)."""

    def after_prefill(self, model: SelfDraftingCausalLM, kv_cache: torch.Tensor, meta: AttentionMetadata,
                      hidden: torch.Tensor, next_tokens: torch.Tensor, last_idx: torch.Tensor,
                      input_ids: torch.Tensor, state: DrafterState, step: PrefillContext = NO_PREFILL
                      ) -> tuple[torch.Tensor, DrafterState]:
        """Drafts [B, K] after a prefill over the prompt rows, and the state for the first decode step (`state`:
        the rows' state before this chunk — stale for a request's first chunk); `step`: the sampling parameters
        and whether to draft at all (`PrefillContext`; the engine always passes it)."""

    def after_verify(self, model: SelfDraftingCausalLM, kv_cache: torch.Tensor, meta: AttentionMetadata,
                     hidden: torch.Tensor, target_tokens: torch.Tensor, num_emitted: torch.Tensor,
                     state: DrafterState, step: VerifyContext = NO_CONTEXT) -> tuple[torch.Tensor, DrafterState]:
        """Drafts [B, K] after verifying [last, d1..dK]: rows are the K+1 verified positions, last_idx =
        num_emitted − 1; `step`: the sampling parameters, ragged draft lengths, drafts to make and whether to draft at all
        (`VerifyContext`; the engine always passes it)."""

    def draft_probs(self, state: DrafterState, num_drafts: int, sampling: SamplingTensors) -> torch.Tensor | None:
        """For drafters with `traits.sampled`: q [B, num_drafts, V] fp32, the distributions this step's first
        `num_drafts` drafts were drawn from (the acceptance rule's `draft_probs`), read from `state`; None when no
        request samples or the state is empty (speculation was off): one-hot q."""

    def load_prefix(self, state: DrafterState, slot: int, token_ids: list[int]) -> None:
        """Before a prefill that starts after a prefix-cache hit: rebuild, in place, the per-request state of batch
        slot `slot` that the reused tokens `token_ids` (positions 0..n−1) would have left (no-op when the drafter's
        state lives in the KV cache or is rebuilt by the prefill)."""


class TreeDrafter(Drafter, Protocol):
    """A drafter whose drafts form a tree (Medusa, MTP trees), verified by `tree_step.tree_verify_and_draft_step`:
    its draft tokens [B, N−1] are the tree's nodes after the root, and a step verifies the first w tokens."""

    def tree_layout(self, state: DrafterState, width: int) -> TreeLayout:
        """The tree of the first `width` tokens (root included) that this step verifies, from the drafter's
        per-request state (a dynamic tree's shape) or its own buffers (a static tree)."""

    def after_verify_tree(self, model: SelfDraftingCausalLM, kv_cache: torch.Tensor, meta: AttentionMetadata,
                          hidden: torch.Tensor, path: torch.Tensor, tokens: torch.Tensor, num_accepted: torch.Tensor,
                          state: DrafterState) -> tuple[torch.Tensor, DrafterState]:
        """The next tree's drafts [B, N−1] and state after a verified tree.

        Args:
            meta: the verified tree's metadata (`meta.tree_start` [B] = kv_len, the root's position).
            hidden: [B, w, H] the target's hidden states at the tree's tokens.
            path, tokens, num_accepted: `TreeAcceptanceRule.accept_tree`'s result. The path's KV has been moved
                to the consecutive positions kv_len..kv_len + num_accepted (the rest is dead).
        """


class Proposer(Drafter, Protocol):
    """A drafter that knows on the host, before a step, how many of a request's drafts are worth verifying (a
    suffix tree's match): `traits.draft_len` PROPOSAL (`proposal_len`) or PROPOSAL_PER_ROW (all three hooks)."""

    def proposal_len(self, slots: list[int]) -> int:
        """The draft length worth verifying for the requests in batch slots `slots`; it caps the step's draft
        length (0: verify none; the drafter still runs and sees the step's tokens)."""

    def set_step_times(self, step_time: Callable[[int, int], float],
                       ragged_step_times: Callable[[int, int], list[float]] | None = None) -> None:
        """From now on propose the length of the most expected tokens per second: `step_time(batch, k)` is a step's
        time over a plain step's (`ProposalDraftLen.relative_step_time`); `ragged_step_times(batch, most)` a ragged
        step's verifying n = 0..most drafts in all (`ProposalDraftLen.ragged_step_times`), or None."""

    def proposal_lens(self, slots: list[int], cap: int) -> list[int] | None:
        """Each row's own draft length k_r ≤ cap for these slots (ragged verification: `VerifyContext.draft_lens`),
        or None while it has no step times (the step verifies one length)."""
