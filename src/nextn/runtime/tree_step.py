"""Medusa: the drafter that builds candidate trees from the heads, and the batched tree verify-and-draft step.

Source: Cai et al. 2024 ("Medusa", §2.1.2 tree attention, §2.3.1 greedy/typical acceptance); REFERENCE.md §5.
Unlike the Medusa repository the step is batched (every request verifies the same tree shape) and runs over the
paged KV cache. Fixed shapes per (batch, tree), no host synchronisation:

    tree tokens [B, L] at cache positions L0..L0+L−1, rope positions L0 + depth       (L0 = kv_len)
    hidden = target(tree tokens, tree attention mask over the prefix + ancestors)
    per path: accepted = longest prefix with candidate[j+1] == argmax at node j; best path per request
    emitted = argmax along the best path up to its last accepted node (accepted drafts + the correction)
    KV of the best path's accepted nodes is moved to consecutive positions L0..L0+a; the rest is dead
    next tree = candidates [emitted last, head_0 top-k, head_1 top-k, ...] gathered by the tree's candidate index
"""

from __future__ import annotations

import torch

from nextn.models.medusa import MedusaHeads
from nextn.plugins.medusa_tree import TreeBuffers
from nextn.runtime.acceptance_rules import AcceptanceRule, AcceptState, SamplingTensors
from nextn.runtime.attention_metadata import AttentionMetadata, slots_for_positions
from nextn.runtime.drafters import DrafterState, _at
from nextn.runtime.spec_step import StepOutput


class MedusaDrafter:
    """Drafts a whole candidate tree (L − 1 tokens) from the Medusa heads at the last accepted position."""

    def __init__(self, heads: MedusaHeads, tree: TreeBuffers) -> None:
        if tree.max_depth > len(heads):
            raise ValueError(f"the Medusa tree is {tree.max_depth} deep but the engine has {len(heads)} heads")
        self.heads = heads
        self.tree = tree
        self.num_draft_tokens = tree.num_tokens - 1

    def initial_state(self, batch, hidden_size, device, dtype) -> DrafterState:
        return ()

    def tree_from(self, hidden_last: torch.Tensor, root: torch.Tensor) -> torch.Tensor:
        """Next tree tokens [B, L] from the hidden state at the last accepted position [B, 1, H] and its token [B, 1]."""
        topk = self.heads(hidden_last)[: self.tree.max_depth, :, 0].topk(self.tree.topk, dim=-1).indices  # [D, B, k]
        candidates = torch.cat([root, topk.permute(1, 0, 2).reshape(root.shape[0], -1)], dim=1)
        return candidates[:, self.tree.candidate_index]

    def after_prefill(self, model, kv_cache, meta, hidden, next_tokens, last_idx):
        tree = self.tree_from(_at(hidden, last_idx), next_tokens.gather(1, last_idx[:, None]))
        return tree[:, 1:], ()


def tree_verify_and_draft_step(model, drafter: MedusaDrafter, acceptance: AcceptanceRule, kv_cache: torch.Tensor,
                               input_ids: torch.Tensor, kv_lens: torch.Tensor, block_tables: torch.Tensor,
                               sampling: SamplingTensors, drafter_state: DrafterState, accept_state: AcceptState,
                               block_size: int) -> StepOutput:
    """One Medusa step for a batch (greedy acceptance: lossless).

    Args:
        input_ids: [B, L] tree tokens (the last emitted token, then the L − 1 candidates from the previous step).
        kv_lens: [B] int64 cached tokens; block_tables: [B, max_blocks] covering positions kv_len..kv_len+L−1.
    Returns:
        StepOutput with tokens [B, D+1] (emitted: the first num_emitted) and the next tree's candidates [B, L−1].
    """
    tree = drafter.tree
    b, n = input_ids.shape
    ar = torch.arange(n, device=input_ids.device)
    slots = slots_for_positions(block_tables, kv_lens[:, None] + ar, block_size)
    meta = AttentionMetadata.create_tree(kv_lens[:, None] + tree.depth, slots, block_tables, block_size, kv_lens,
                                         tree.mask)
    hidden = model(input_ids, kv_cache, meta)  # [B, L, H]
    target = model.logits(hidden).argmax(dim=-1)  # [B, L]
    cand = input_ids[:, tree.paths]  # [B, P, D+1] tokens along each path
    tgt = target[:, tree.paths]  # [B, P, D+1] the target's next token after each path node
    match = (cand[:, :, 1:] == tgt[:, :, :-1]) & tree.path_valid[None, :, 1:]
    accepted = match.to(torch.int64).cumprod(dim=-1).sum(dim=-1)  # [B, P]
    best = accepted.argmax(dim=-1)  # first path with the most accepted tokens
    num_accepted = accepted.gather(1, best[:, None]).squeeze(1)  # [B]
    path = tree.paths[best]  # [B, D+1] token indices of the best path
    tokens = tgt.gather(1, best[:, None, None].expand(-1, 1, tgt.shape[2])).squeeze(1)  # [B, D+1]
    # Compact: the best path's node t (cache position kv_len + path[t]) moves to kv_len + t, for t ≤ num_accepted.
    steps = torch.arange(path.shape[1], device=path.device)
    src = slots_for_positions(block_tables, kv_lens[:, None] + path, block_size)
    dst = slots_for_positions(block_tables, kv_lens[:, None] + steps, block_size,
                              valid=steps[None, :] <= num_accepted[:, None])
    kv_cache.index_copy_(1, dst.reshape(-1), kv_cache[:, src.reshape(-1)])
    last_node = path.gather(1, num_accepted[:, None])  # [B, 1]
    next_tree = drafter.tree_from(_at(hidden, last_node[:, 0]), tokens.gather(1, num_accepted[:, None]))
    return StepOutput(tokens, num_accepted + 1, next_tree[:, 1:], drafter_state, accept_state)
