"""Tree acceptance (Medusa): greedy path matching and typical acceptance, on the REFERENCE.md §5 example tree."""

from __future__ import annotations

import math

import torch

from nextn.speculative.acceptance_reference import tree_greedy_acceptance, tree_typical_acceptance
from nextn.speculative.medusa_tree import build_tree

TREE = build_tree([[0], [1], [0, 0], [0, 1], [1, 0], [0, 0, 0]])  # tokens: 0 root, 1 [0], 2 [1], 3 [0,0], 4 [0,1], 5 [1,0], 6 [0,0,0]


def test_greedy_picks_the_longest_matching_path():
    tree_tokens = torch.tensor([[10, 11, 12, 13, 14, 15, 16]])
    # Target argmax after each token: root→11 (matches [0]), [0]→14 (matches [0,1], not [0,0]), [0,1]→99.
    target = torch.tensor([[11, 14, 0, 0, 99, 0, 0]])
    best, n = tree_greedy_acceptance(target, tree_tokens, TREE.paths, TREE.path_valid)
    assert TREE.paths[best[0]].tolist()[:3] == [0, 1, 4] and n.tolist() == [2]
    # Nothing matches: 0 accepted, the first path is chosen.
    best, n = tree_greedy_acceptance(torch.full((1, 7), 77), tree_tokens, TREE.paths, TREE.path_valid)
    assert n.tolist() == [0] and best.tolist() == [0]
    # The full depth-3 path.
    best, n = tree_greedy_acceptance(torch.tensor([[11, 13, 0, 16, 0, 0, 5]]), tree_tokens, TREE.paths, TREE.path_valid)
    assert TREE.paths[best[0]].tolist() == [0, 1, 3, 6] and n.tolist() == [3]


def test_padding_never_counts_as_accepted():
    tree_tokens = torch.tensor([[10, 11, 12, 13, 14, 15, 16]])
    target = torch.tensor([[12, 0, 15, 0, 0, 10, 0]])  # path [0,2,5] accepted fully (2 tokens), then padding
    best, n = tree_greedy_acceptance(target, tree_tokens, TREE.paths, TREE.path_valid)
    assert TREE.paths[best[0]].tolist()[:3] == [0, 2, 5] and n.tolist() == [2]


def test_typical_acceptance_threshold():
    v = 20
    tree_tokens = torch.tensor([[0, 1, 2, 3, 4, 5, 6]])
    probs = torch.full((1, 7, v), 1.0 / v)
    # At the root: a peaked distribution where token 1 ([0]) has 0.5 and token 2 ([1]) 0.01.
    root = torch.full((v,), 0.49 / (v - 2))
    root[1], root[2] = 0.5, 0.01
    probs[0, 0] = root
    h = -(root * root.log()).sum().item()
    bar = min(0.09, 0.3 * math.exp(-h))
    assert 0.01 < bar < 0.5  # token 1 passes, token 2 does not (bar ≈ 0.035)
    best, n = tree_typical_acceptance(probs, tree_tokens, TREE.paths, TREE.path_valid, 0.09, 0.3)
    path = TREE.paths[best[0]].tolist()
    assert path[1] == 1 and n.item() >= 1
    # Below token 1 the distributions are uniform: p = 0.05 > min(0.09, 0.3·exp(−ln 20)) = 0.015, so the
    # candidates pass all the way down [0, 0, 0].
    assert n.item() == 3
    # One-hot (greedy) distributions: typical acceptance is exact matching.
    onehot = torch.zeros(1, 7, v)
    onehot[0, 0, 2] = 1  # root → [1]
    onehot[0, 2, 5] = 1  # [1] → [1,0]
    onehot[0, 5, 9] = 1
    onehot[0, [1, 3, 4, 6], 9] = 1
    best, n = tree_typical_acceptance(onehot, tree_tokens, TREE.paths, TREE.path_valid, 0.09, 0.3)
    assert TREE.paths[best[0]].tolist()[:3] == [0, 2, 5] and n.tolist() == [2]
