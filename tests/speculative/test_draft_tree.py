"""Draft trees by parent pointers (issue 18): static trees from rank paths, the ancestor mask, longest-path
acceptance (greedy, hand-worked), EAGLE-2's selection (always a tree, best first), and the sampling rule's
distribution (chi-square: every emitted token is distributed as the target's, SpecInfer §4)."""

from __future__ import annotations

import math

import pytest
import torch

from nextn.speculative.draft_tree import ancestor_mask, select_dynamic_tree, static_tree, tree_accept
from nextn.speculative.medusa_tree import TreeError
from nextn.plugins.sampling import STREAM_SAMPLE, counter_uniform, sample_from_probs

TREE = [[0], [1], [0, 0], [0, 1], [1, 0], [0, 0, 0]]  # REFERENCE.md §5's example


def test_static_tree_parents_ranks_and_depths():
    t = static_tree(TREE)
    # tokens: 0 root, 1 [0], 2 [1], 3 [0,0], 4 [0,1], 5 [1,0], 6 [0,0,0]
    assert t.parents.tolist() == [0, 0, 0, 1, 1, 2, 3]
    assert t.ranks.tolist() == [0, 0, 1, 0, 1, 0, 0]
    assert t.depth.tolist() == [0, 1, 1, 2, 2, 2, 3] and t.depth_starts == (0, 1, 3, 6, 7)
    assert t.topk == 2 and t.max_depth == 3
    assert torch.equal(ancestor_mask(t.parents[None], 3)[0], t.mask)
    with pytest.raises(TreeError, match="no parent"):
        static_tree([[0, 0]])
    assert t.order.tolist() == list(range(7))  # listed in (depth, path) order already


def test_a_best_first_list_is_verified_in_its_order():
    t = static_tree([[0], [0, 0], [1], [0, 0, 0], [0, 1]])  # tokens by (depth, path): [0] [1] [0,0] [0,1] [0,0,0]
    assert t.order.tolist() == [0, 1, 3, 2, 5, 4]
    parents, depth, mask = t.verify_layout(4)  # root, [0], [0, 0], [1]: the best 3-node tree
    assert parents.tolist() == [0, 0, 1, 0] and depth.tolist() == [0, 1, 2, 1]
    assert mask[2].tolist() == [True, True, True, False]
    assert static_tree([[0, 0], [0]]).order.tolist() == [0, 1, 2]  # a child listed first: (depth, path) order


def test_greedy_acceptance_takes_the_longest_matching_path():
    t = static_tree(TREE)
    tokens = torch.tensor([[9, 10, 11, 20, 21, 22, 30]])
    # target at each node: root → 10 (matches node 1), node 1 → 21 (node 4), node 4 → 5 (a leaf: the bonus)
    target = torch.tensor([[10, 21, 7, 7, 5, 7, 7]])
    path, n, emitted = tree_accept(target, tokens, t.parents, t.depth, 3)
    assert n.tolist() == [2] and path[0, :3].tolist() == [0, 1, 4] and emitted[0, :3].tolist() == [10, 21, 5]
    target[0, 0] = 8  # no depth-1 node matches: emit the target's root token alone
    path, n, emitted = tree_accept(target, tokens, t.parents, t.depth, 3)
    assert n.tolist() == [0] and emitted[0, 0].item() == 8
    full = torch.tensor([[10, 20, 7, 30, 7, 7, 4]])  # the chain 10 → 20 → 30 and the bonus 4
    path, n, emitted = tree_accept(full, tokens, t.parents, t.depth, 3)
    assert n.tolist() == [3] and path[0].tolist() == [0, 1, 3, 6] and emitted[0].tolist() == [10, 20, 30, 4]


def test_dynamic_selection_is_a_tree_in_score_order():
    gen = torch.Generator().manual_seed(0)
    k, depth, batch = 3, 3, 5
    # candidates as the drafter lists them: k at depth 1, then k² per depth from a beam of k
    lp = -torch.rand(batch, k + 2 * k * k, generator=gen) * 3
    parents = torch.cat([torch.zeros(batch, k, dtype=torch.int64),
                         torch.arange(1, k + 1).repeat_interleave(k).expand(batch, -1),
                         (k + 1 + torch.randint(0, k * k, (batch, k), generator=gen)).repeat_interleave(k, dim=1)], 1)
    scores = lp.clone()
    for c in range(k, lp.shape[1]):  # cumulative: parent's score plus its own log-probability
        scores[:, c] = scores.gather(1, parents[:, c:c + 1] - 1)[:, 0] + lp[:, c]
    scores[0, k] = scores[0, 0]  # a tie between a parent and its child (log-probability 0)
    cand_depth = torch.tensor([1] * k + [2] * k * k + [3] * k * k)
    tokens = torch.arange(lp.shape[1]).expand(batch, -1) + 100
    drafts, tree_parents, tree_depth = select_dynamic_tree(scores, tokens, parents, cand_depth, 8)
    for b in range(batch):
        assert (tree_parents[b, 1:] < torch.arange(1, 9)).all()  # parents first: a tree in topological order
        assert (tree_depth[b, 1:] == tree_depth[b, tree_parents[b, 1:]] + 1).all()
        chosen = scores[b, drafts[b] - 100]
        assert (chosen[:-1] >= chosen[1:]).all() and chosen[-1] >= scores[b].sort(descending=True).values[7]


def _chi2_sf(stat: float, dof: int) -> float:
    """Upper tail of the chi-square distribution (Wilson–Hilferty normal approximation)."""
    z = ((stat / dof) ** (1 / 3) - (1 - 2 / (9 * dof))) / math.sqrt(2 / (9 * dof))
    return 0.5 * math.erfc(z / math.sqrt(2))


def test_tree_sampling_keeps_the_target_distribution():
    """A 2-deep tree over a vocabulary of 6; the target distributions differ per node. Over 40,000 seeds the first
    emitted token follows p_root and the second, after an accepted child c, follows p_c (chi-square, p > 0.001),
    while drafts are accepted at the rate p_root puts on them."""
    t = static_tree([[0], [1], [0, 0], [1, 0], [1, 1]])  # root → a, b; a → a0; b → b0, b1
    v, n = 6, 40_000
    gen = torch.Generator().manual_seed(1)
    probs = torch.softmax(torch.randn(t.num_tokens, v, generator=gen) * 1.5, dim=-1)  # p at each node
    tree_tokens = torch.tensor([0, 2, 4, 1, 3, 5]).expand(n, -1)  # node tokens: a=2, b=4, a0=1, b0=3, b1=5
    seeds = torch.arange(n, dtype=torch.int64) * 7919 + 13
    u = counter_uniform(seeds, t.depth.expand(n, -1) + 1, STREAM_SAMPLE)  # one uniform per depth, as the step
    target = sample_from_probs(probs.expand(n, -1, -1), u)
    path, accepted, emitted = tree_accept(target, tree_tokens, t.parents, t.depth, t.max_depth)
    first = emitted[:, 0]
    counts = torch.bincount(first, minlength=v).double()
    stat = ((counts - n * probs[0].double()) ** 2 / (n * probs[0].double())).sum().item()
    assert _chi2_sf(stat, v - 1) > 1e-3
    for node, token in ((1, 2), (2, 4)):  # after accepting child a (or b), the next token follows p_a (p_b)
        rows = (accepted >= 1) & (first == token)
        m = int(rows.sum())
        assert abs(m / n - probs[0, token].item()) < 4 * math.sqrt(probs[0, token].item() / n) + 1e-3
        second = torch.bincount(emitted[rows, 1], minlength=v).double()
        stat = ((second - m * probs[node].double()) ** 2 / (m * probs[node].double())).sum().item()
        assert _chi2_sf(stat, v - 1) > 1e-3
        assert path[rows, 1].eq(node).all()


def test_a_static_tree_takes_the_same_caps_and_vocabulary_check():
    # issue 32: eagle_choices of 2,000 nodes gave a raw OSError; a rank ≥ the vocabulary failed every request
    import pytest as _pytest

    from nextn.speculative.draft_tree import static_tree
    from nextn.speculative.medusa_tree import TreeError

    with _pytest.raises(TreeError, match="2000 nodes, more than the 255"):
        static_tree([[i] for i in range(2000)])
    with _pytest.raises(TreeError, match="rank 600"):
        static_tree([[0], [600]], vocab_size=512)
    assert static_tree([[0], [1]], vocab_size=512).num_tokens == 3
