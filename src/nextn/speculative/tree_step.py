"""The fused verify-and-draft step over a tree of drafts (Medusa, MTP static and dynamic trees).

Sources: Cai et al. 2024, "Medusa" §2.1.2 (tree attention); Miao et al. 2024, "SpecInfer" §4 (token tree
verification); FasterDecoding/Medusa. Unlike the Medusa repository the step is batched and runs over the paged KV cache.
Fixed shapes per (batch, tree width), no host synchronisation: it compiles with `torch.compile(fullgraph=True)` and
is captured in one CUDA graph like the chain step. For B requests, a tree of w tokens (root = the last emitted
token at position L = kv_len):

    layout  = drafter.tree_layout(state, w)                             parents, depth, mask (protocol.TreeLayout)
    hidden  = target(tree tokens at cache positions L..L+w−1, rope positions L + depth, tree attention)   [B, w, H]
    path, a, tokens = acceptance.accept_tree(logits, tree tokens, layout)    the longest accepted root-to-node path
    (compact) the path's node at depth t moves to cache position L + t, t ≤ a; the rest is dead
    drafts  = drafter.after_verify_tree(hidden, path, tokens, a)              Medusa: heads at the last accepted
                                                                               node; MTP: its module over the path

A step of width 1 (speculation off, or re-priming an MTP tree's drafts) has no tree: it is the chain step.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from nextn.models.attention_metadata import AttentionMetadata, slots_for_positions
from nextn.models.causal_lm import SelfDraftingCausalLM
from nextn.speculative.acceptance_rules import sample_tokens
from nextn.speculative.chain_step import verify_and_draft_step
from nextn.speculative.protocol import (AcceptState, DrafterState, SamplingTensors, StepOutput, TreeAcceptanceRule,
                                        TreeDrafter)


def compact_path_kv(kv_cache: torch.Tensor, block_tables: torch.Tensor, block_size: int, kv_lens: torch.Tensor,
                    path: torch.Tensor, num_accepted: torch.Tensor) -> None:
    """Move the KV of each request's accepted path to consecutive positions, in place: the node at depth t (cache
    position kv_len + path[t]) goes to kv_len + t for t ≤ num_accepted; entries past it write into the null block.

    Args:
        kv_cache: [layers, slots, ...] the paged cache; block_tables: [B, max_blocks] int64.
        kv_lens: [B] int64; path: [B, D+1] int64 token indices; num_accepted: [B] int64 in [0, D].
    """
    steps = torch.arange(path.shape[1], device=path.device)
    src = slots_for_positions(block_tables, kv_lens[:, None] + path, block_size)
    dst = slots_for_positions(block_tables, kv_lens[:, None] + steps, block_size,
                              valid=steps[None, :] <= num_accepted[:, None])
    kv_cache.index_copy_(1, dst.reshape(-1), kv_cache[:, src.reshape(-1)])


def tree_verify_and_draft_step(model: SelfDraftingCausalLM, drafter: TreeDrafter, acceptance: TreeAcceptanceRule,
                               kv_cache: torch.Tensor, input_ids: torch.Tensor, kv_lens: torch.Tensor,
                               block_tables: torch.Tensor, sampling: SamplingTensors, drafter_state: DrafterState,
                               accept_state: AcceptState, block_size: int, draft_lens: torch.Tensor | None = None,
                               num_drafts: int | None = None) -> StepOutput:
    """One tree step for a batch: verify the tree, keep the longest accepted path, compact its KV, draft the next
    tree (greedy requests: lossless; sampling requests: as the acceptance rule decides).

    Args:
        input_ids: [B, w] int64 tree tokens (the last emitted token, then the first w − 1 draft nodes); w = 1: no
            tree (the chain step).
        kv_lens: [B] int64 cached tokens; block_tables: [B, max_blocks] int64 covering the drafter's look-ahead
            (Medusa: kv_len + w − 1; MTP trees: kv_len + 2(N − 1) + 1).
        sampling: with logit processing or log-probabilities asked for (`host_work`), the step verifies the root
            alone (the chain step with no drafts: lossless, one token per request) and the drafter drafts again.
        drafter_state: the drafter's per-request state (a dynamic tree's parents and depth; () for a static tree).
        draft_lens, num_drafts: the chain step's ragged and on-demand arguments, None for a tree (a tree drafter
            neither proposes per-row lengths nor drafts on demand).
    Returns:
        StepOutput with tokens [B, D+1] (emitted: the first num_emitted = num_accepted + 1) and the next tree's
        drafts [B, N−1].
    """
    if draft_lens is not None or num_drafts is not None:
        raise ValueError("a tree step verifies its tree: no per-row draft lengths, no on-demand drafts")
    b, w = input_ids.shape
    if w == 1:
        return verify_and_draft_step(model, drafter, acceptance, kv_cache, input_ids, kv_lens, block_tables,
                                     sampling, drafter_state, accept_state, block_size)
    if sampling.host_work:  # processing and log-probabilities are per chain position: verify the root alone
        return _root_step(model, drafter, kv_cache, input_ids[:, :1], kv_lens, block_tables, sampling,
                          drafter_state, accept_state, block_size)
    layout = drafter.tree_layout(drafter_state, w)
    slots = slots_for_positions(block_tables, kv_lens[:, None] + torch.arange(w, device=input_ids.device), block_size)
    meta = AttentionMetadata.create_tree(kv_lens[:, None] + layout.depth, slots, block_tables, block_size, kv_lens,
                                         layout.mask)
    hidden = model(input_ids, kv_cache, meta)  # [B, w, H]
    path, num_accepted, tokens = acceptance.accept_tree(model.logits(hidden), input_ids, layout, kv_lens, sampling)
    compact_path_kv(kv_cache, block_tables, block_size, kv_lens, path, num_accepted)
    drafts, state = drafter.after_verify_tree(model, kv_cache, meta, hidden, path, tokens, num_accepted,
                                              drafter_state)
    return StepOutput(tokens, num_accepted + 1, drafts, state, accept_state)


def _root_step(model: SelfDraftingCausalLM, drafter: TreeDrafter, kv_cache: torch.Tensor, root: torch.Tensor,
               kv_lens: torch.Tensor, block_tables: torch.Tensor, sampling: SamplingTensors,
               drafter_state: DrafterState, accept_state: AcceptState, block_size: int) -> StepOutput:
    """A tree of the root alone [B, 1]: its next token from the processed logits (as plain decoding draws it), then
    the drafter's next tree from it."""
    slots = slots_for_positions(block_tables, kv_lens[:, None], block_size)
    mask = torch.ones(1, 1, dtype=torch.bool, device=root.device)
    meta = AttentionMetadata.create_tree(kv_lens[:, None], slots, block_tables, block_size, kv_lens, mask)
    hidden = model(root, kv_cache, meta)  # [B, 1, H]
    logits = sampling.process(model.logits(hidden))
    tokens = sample_tokens(logits, kv_lens[:, None] + 1, sampling)  # [B, 1]
    zeros = torch.zeros_like(kv_lens)
    drafts, state = drafter.after_verify_tree(model, kv_cache, meta, hidden, zeros[:, None], tokens, zeros,
                                              drafter_state)
    return StepOutput(tokens, zeros + 1, drafts, state, accept_state, sampling.logprobs(logits, tokens))


class TreeDrafterBase:
    """The protocol's defaults for drafters whose drafts form a tree, verified by `tree_verify_and_draft_step`."""

    def load_prefix(self, state: DrafterState, slot: int, token_ids: list[int]) -> None:
        return None

    def catch_up(self, kv_cache: torch.Tensor, meta: AttentionMetadata, input_ids: torch.Tensor) -> None:
        raise NotImplementedError(f"{type(self).__name__} keeps no KV written from tokens (traits.kv)")

    def draft_probs(self, state: DrafterState, num_drafts: int, sampling: SamplingTensors) -> torch.Tensor | None:
        return None  # deterministic drafts: one-hot q

    @property
    def decode_fn(self) -> Callable[..., StepOutput]:
        return tree_verify_and_draft_step
