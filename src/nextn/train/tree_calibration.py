"""A static draft tree chosen for trained heads: per-depth, per-rank acceptance, then best-first tree construction.

Medusa (Cai et al. 2024, §2.1.2 and its repository's tree search) builds `medusa_choices` from each head's top-k
accuracies measured on held-out data: under the assumption that depths are independent, a node with rank path
[r1, .., rd] is accepted with probability Π_i acc[i][r_i], the expected tokens a tree adds per step are the sum of
its nodes' probabilities, and the best tree of N nodes keeps the N most probable paths. Sequoia (Chen et al. 2024)
optimises the same objective with dynamic programming. Written from those descriptions; the construction itself
(`best_first_tree`, `path_probability`, `expected_acceptance_length`) lives in speculative/draft_gain.py, which the
draft-length policy shares.

Here the accuracies come from the trained MTP module itself, teacher-forced on held-out sequences of the base's own
greedy continuations (`MtpContext.eagle`): `rank_acceptance` — acc[d][r] = the share of positions where the base's
token is the module's rank-r candidate at draft step d + 1 (full-vocabulary logits) — and `chain_rank_acceptance`,
the same share among the chains whose steps 1..d all hit. A tree's node is verified only once its parent was
accepted, so its product wants the conditional figures: on Qwen2.5-Coder-0.5B's module the top-1 at steps 2 and 3
is 0.39 and 0.36 on average but ~0.5 right after a hit, which makes deeper paths worth more than the average says
(and a chain of 15 drafts gains over one of 3). train-draft calibrates past the module's trained steps
(`--tree_depth`) and `best_first_tree` turns the table into `eagle_choices` listed best first, so that the
draft-length policy's first w nodes are the best w-node tree."""

from __future__ import annotations

import torch

from nextn.speculative.draft_gain import best_first_tree, expected_acceptance_length, path_probability

__all__ = ["rank_acceptance", "best_first_tree", "expected_acceptance_length", "path_probability"]


@torch.no_grad()
def rank_acceptance(outputs, lm_head: torch.Tensor, topk: int = 8, chunk: int = 2048) -> list[list[float]]:
    """acc[d][r]: the share of kept positions whose label is the rank-r token of draft step d + 1.

    Args:
        outputs: `mtp.StepOutputs` — per draft step (x [B, T, H] after shared_head.norm, labels [B, T] int64,
            keep [B, T] bool, ...), teacher-forced on held-out rows.
        lm_head: [V, H], the head the drafts are read from.
        topk: ranks measured per step.
    Returns:
        `len(outputs)` lists of `topk` floats in [0, 1], each list summing to ≤ 1 (ranks are exclusive).
    Raises:
        ValueError: a step with no kept position, or topk < 1.
    """
    if topk < 1:
        raise ValueError(f"topk must be ≥ 1, got {topk}")
    out = []
    for d, (x, labels, keep, *_) in enumerate(outputs):
        if not keep.any():
            raise ValueError(f"draft step {d + 1} has no held-out position to measure")
        counted = _label_ranks(x, labels, lm_head, topk, chunk)[keep]
        out.append([(counted == r).float().mean().item() for r in range(topk)])
    return out




@torch.no_grad()
def chain_rank_acceptance(outputs, lm_head: torch.Tensor, topk: int = 8, chunk: int = 2048) -> list[list[float]]:
    """acc[d][r]: the share of kept chains whose step-(d + 1) label is the module's rank-r token, among the chains
    whose steps 1..d were all top-1 hits — the conditional acceptance a tree's path product needs (a node is
    verified only after its parent was accepted; easy stretches make a step more likely right after a hit than on
    average, which the unconditional `rank_acceptance` misses and which favours deeper trees).

    Args:
        outputs: `mtp.StepOutputs` of MTP Eagle's streams (`MtpContext.eagle`): stream s's row j continues the
            chain rooted at row j − s, so the chain of row i is (stream 0, row i), (stream 1, row i + 1), ...
        lm_head: [V, H]; topk: ranks measured per step.
    Returns:
        A list of `topk` floats in [0, 1] per step, step 1 `rank_acceptance`'s, up to the last step that some kept
        chain reached with every earlier step a hit (fewer than `len(outputs)` lists for weak modules).
    Raises:
        ValueError: topk < 1, or no kept position at step 1.
    """
    if topk < 1:
        raise ValueError(f"topk must be ≥ 1, got {topk}")
    out, alive = [], None  # alive [B, T − d]: the chain rooted at this row was kept and hit at steps 1..d
    for d, (x, labels, keep, *_) in enumerate(outputs):
        ranks = _label_ranks(x, labels, lm_head, topk, chunk)[:, d:]  # by root row: step d + 1 of root i at i + d
        kept = keep[:, d:] if alive is None else keep[:, d:] & alive[:, : keep.shape[1] - d]
        counted = ranks[kept]
        if len(counted) == 0:  # no chain reached this step: the table (and any tree from it) stops before it
            if d == 0:
                raise ValueError("draft step 1 has no held-out position to measure")
            break
        out.append([(counted == r).float().mean().item() for r in range(topk)])
        alive = kept & (ranks == 0)
    return out


def _label_ranks(x: torch.Tensor, labels: torch.Tensor, lm_head: torch.Tensor, topk: int, chunk: int) -> torch.Tensor:
    """[B, T] int64: each label's rank among x · lm_headᵀ's top-k (topk where it is not among them)."""
    flat_x, flat_l = x.reshape(-1, x.shape[-1]), labels.reshape(-1)
    ranks = torch.full((flat_l.shape[0],), topk, dtype=torch.int64)
    for start in range(0, flat_x.shape[0], chunk):
        top = (flat_x[start:start + chunk].float() @ lm_head.float().T).topk(topk, dim=-1).indices  # [n, k]
        hit = top == flat_l[start:start + chunk, None]
        ranks[start:start + chunk] = torch.where(hit.any(-1), hit.int().argmax(-1), topk)
    return ranks.view(labels.shape)
