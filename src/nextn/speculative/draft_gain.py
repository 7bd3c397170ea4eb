"""Expected tokens per verify step: what a draft length buys, for chains and trees of drafts.

A verify step with k drafts emits 1 + (accepted drafts) tokens per request. With each draft accepted with
probability α independently of the others, a chain of k drafts emits (1 − α^(k+1)) / (1 − α) on average (Leviathan
et al. 2023, eq. 1). A tree's node [r1, .., rd] (the rank-rd candidate after the path [r1, .., rd−1]) is accepted
with probability Π_i acc[i][r_i] when depths are independent, and a tree emits 1 + Σ over its nodes of those
probabilities (Medusa, Cai et al. 2024, §2.1.2; Sequoia, Chen et al. 2024). The tree of N nodes with the largest
expected length keeps the N most probable paths (`best_first_tree`), listed best first so that its first n nodes
are the best n-node tree — which is how a draft-length policy turns a tree down (speculative/draft_len_policy.py).

`TreeGain` ties the two together for the draft-length policy: from one number, the top-1 acceptance α, it predicts
a tree's gain at any node count, rank r being accepted with α · `RANK_PRIOR`[r] (a chain is the tree of rank-0
paths, so `TreeGain` of a chain equals `expected_tokens`). Written from the papers' descriptions.
"""

from __future__ import annotations

import heapq
import math
from collections.abc import Callable, Sequence

# Acceptance of the rank-r candidate relative to the top-1's, at any depth: the prior behind `configs/mtp_tree.yaml`'s
# documented tree and the dynamic tree's expected shape (measured on SmolLM2's trained module: 1, 0.26, 0.13, 0.11,
# 0.06 at step 1, docs/PERFORMANCE.md).
RANK_PRIOR = (1.0, 0.4, 0.2, 0.1, 0.06, 0.04)

Gain = Callable[[float, float], float]  # (α, draft length) → expected tokens per request per verify step

# A draft length k ≥ 1 is chosen over plain decoding only where it is predicted to emit tokens this factor faster:
# near break-even the prediction errs by more than the gain (step times measured at other contexts, host work between
# steps). Measured: an MoE at batch 8 with every draft accepted, t(4) / t(0) ≈ 4.9, predicted 1.01×, ran at 0.97×.
MIN_GAIN = 1.05


def expected_tokens(alpha: float, k: float) -> float:
    """Tokens one verify step emits per request with a chain of k drafts when each draft is accepted with probability
    α independently of the others (Leviathan et al. 2023, eq. 1): (1 − α^(k+1)) / (1 − α); k may be fractional (a
    mean over steps)."""
    return float(k + 1) if alpha >= 1.0 else (1.0 - alpha ** (k + 1)) / (1.0 - alpha)


def path_probability(acceptance: Sequence[Sequence[float]], path: Sequence[int]) -> float:
    """Π_i acceptance[i][path[i]]: the chance the node `path` is accepted, depths taken as independent."""
    return math.prod(acceptance[i][r] for i, r in enumerate(path))


def best_first_tree(acceptance: Sequence[Sequence[float]], nodes: int) -> list[list[int]]:
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
    frontier: list[tuple[float, tuple[int, ...]]] = [(-path_probability(acceptance, (0,)), (0,))]
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


def expected_acceptance_length(acceptance: Sequence[Sequence[float]], choices: Sequence[Sequence[int]]) -> float:
    """1 + Σ over the tree's nodes of `path_probability`: tokens per step the tree is expected to emit (the target's
    own token included), under the independence assumption."""
    return 1.0 + sum(path_probability(acceptance, p) for p in choices)


class TreeGain:
    """Expected tokens per request of a verify step over the first n nodes of a tree (listed in verification order,
    best first), from the top-1 acceptance α: rank r accepted with α · `RANK_PRIOR`[r] at every depth.

    Args:
        paths: the tree's rank paths in verification order (parents first), e.g. `eagle_choices`.
    """

    def __init__(self, paths: Sequence[Sequence[int]]) -> None:
        # per node: (depth, Π RANK_PRIOR over its ranks); its probability at α is α^depth · that product
        self.nodes = [(len(p), math.prod(RANK_PRIOR[min(r, len(RANK_PRIOR) - 1)] for r in p)) for p in paths]

    def __call__(self, alpha: float, n: float) -> float:
        return 1.0 + sum(alpha ** d * w for d, w in self.nodes[: max(int(round(n)), 0)])


def prior_tree(depth: int, nodes: int, topk: int = 4) -> list[list[int]]:
    """The best-first tree of `nodes` paths over ranks < `topk` under `RANK_PRIOR` at top-1 acceptance 0.5 (per-rank
    acceptance 0.5, 0.2, 0.1, 0.05, ...; a dynamic tree's expected shape): `best_first_tree` of that table."""
    return best_first_tree([[0.5 * w for w in RANK_PRIOR[:topk]]] * depth, nodes)


def alpha_for_gain(gain: Gain, accepted: float, k: float) -> float:
    """The top-1 acceptance α at which `gain`(α, k) − 1 equals `accepted`, the mean accepted drafts per step at draft
    length k (bisection on the monotone gain; 0 when nothing was accepted, 1 when every draft was)."""
    if k <= 0 or accepted <= 0.0:
        return 0.0
    if accepted >= gain(1.0, k) - 1.0:
        return 1.0
    lo, hi = 0.0, 1.0
    for _ in range(24):  # to 6e-8
        mid = (lo + hi) / 2
        if gain(mid, k) - 1.0 < accepted:
            lo = mid
        else:
            hi = mid
    return (lo + hi) / 2
