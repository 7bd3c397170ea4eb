"""A static draft tree chosen for trained heads: per-depth, per-rank acceptance, then best-first tree construction.

Medusa (Cai et al. 2024, §2.1.2 and its repository's tree search) builds `medusa_choices` from each head's top-k
accuracies measured on held-out data: under the assumption that depths are independent, a node with rank path
[r1, .., rd] is accepted with probability Π_i acc[i][r_i], the expected tokens a tree adds per step are the sum of
its nodes' probabilities, and the best tree of N nodes keeps the N most probable paths. Sequoia (Chen et al. 2024)
optimises the same objective with dynamic programming. Written from those descriptions.

Here the accuracies come from the trained MTP module itself, teacher-forced on held-out sequences of the base's own
greedy continuations (`MtpContext.eagle`): acc[d][r] = the share of positions where the base's token is the
module's rank-r candidate at draft step d + 1 (full-vocabulary logits). `best_first_tree` turns them into
`eagle_choices` listed best first, so that the draft-length policy's first w nodes are the best w-node tree.
"""

from __future__ import annotations

import heapq
import math

import torch


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
        rows, want = x[keep], labels[keep]
        if len(rows) == 0:
            raise ValueError(f"draft step {d + 1} has no held-out position to measure")
        hits = torch.zeros(topk)
        for part, lab in zip(rows.split(chunk), want.split(chunk)):
            top = (part.float() @ lm_head.float().T).topk(topk, dim=-1).indices  # [n, k]
            hits += (top == lab[:, None]).sum(0).float()
        out.append((hits / len(rows)).tolist())
    return out


def path_probability(acceptance: list[list[float]], path: tuple[int, ...] | list[int]) -> float:
    """Π_i acceptance[i][path[i]]: the chance the node `path` is accepted, depths taken as independent."""
    return math.prod(acceptance[i][r] for i, r in enumerate(path))


def best_first_tree(acceptance: list[list[float]], nodes: int) -> list[list[int]]:
    """The `nodes` rank paths of largest `path_probability`, best first, every parent listed before its children.

    Grown from the root: the frontier holds the first child of every chosen node and the next sibling of every
    chosen node; the most probable frontier path is taken next. When acc[d][r] does not grow with r (ranks sorted
    by the module's own probabilities), a path is never more probable than its parent or its previous sibling,
    so this picks the N most probable paths — the tree of N nodes with the largest expected accepted length.

    Args:
        acceptance: acc[d][r] for depths 0..D−1 (`rank_acceptance`), ranks 0..k−1.
        nodes: draft nodes in the tree (verified tokens − 1).
    Returns:
        `eagle_choices`: at most `nodes` rank paths (fewer only when every path of depth ≤ D and rank < k is in).
    Raises:
        ValueError: nodes < 1, or an empty / ragged acceptance table.
    """
    if nodes < 1:
        raise ValueError(f"a tree needs ≥ 1 node, got {nodes}")
    if not acceptance or not acceptance[0] or any(len(row) != len(acceptance[0]) for row in acceptance):
        raise ValueError("acceptance must be a non-empty [depth][rank] table with the same ranks at every depth")
    depth, topk = len(acceptance), len(acceptance[0])
    frontier = [(-path_probability(acceptance, (0,)), (0,))]
    chosen: list[list[int]] = []
    while frontier and len(chosen) < nodes:
        _, path = heapq.heappop(frontier)
        chosen.append(list(path))
        if path[-1] + 1 < topk:
            sibling = path[:-1] + (path[-1] + 1,)
            heapq.heappush(frontier, (-path_probability(acceptance, sibling), sibling))
        if len(path) < depth:
            child = path + (0,)
            heapq.heappush(frontier, (-path_probability(acceptance, child), child))
    return chosen


def expected_acceptance_length(acceptance: list[list[float]], choices: list[list[int]]) -> float:
    """1 + Σ over the tree's nodes of `path_probability`: tokens per step the tree is expected to emit (the target's
    own token included), under the independence assumption."""
    return 1.0 + sum(path_probability(acceptance, p) for p in choices)
