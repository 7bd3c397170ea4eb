"""The static tree chosen from measured per-rank acceptance (train/tree_calibration.py)."""

import itertools
import random

import pytest
import torch

from benchmarks.mtp_tree_al import _tree
from nextn.train.tree_calibration import (best_first_tree, chain_rank_acceptance, expected_acceptance_length,
                                          path_probability, rank_acceptance)


def _all_paths(depth: int, topk: int):
    for d in range(1, depth + 1):
        yield from itertools.product(range(topk), repeat=d)


def _random_table(rng: random.Random, depth: int, topk: int) -> list[list[float]]:
    """Per depth, a rank-sorted acceptance summing to < 1 (ranks are exclusive)."""
    table = []
    for _ in range(depth):
        row = sorted((rng.random() for _ in range(topk)), reverse=True)
        total = sum(row) / rng.uniform(0.3, 0.95)
        table.append([x / total for x in row])
    return table


@pytest.mark.parametrize("seed", range(6))
def test_the_tree_is_the_most_probable_paths_and_parents_come_first(seed):
    rng = random.Random(seed)
    depth, topk, nodes = 3, 4, rng.choice([1, 3, 7, 15, 30])
    acc = _random_table(rng, depth, topk)
    tree = best_first_tree(acc, nodes)
    assert len(tree) == nodes and len({tuple(p) for p in tree}) == nodes
    seen = set()
    for p in tree:  # ancestor-closed, listed parent first, and every earlier sibling in the tree too
        assert len(p) == 1 or tuple(p[:-1]) in seen
        assert p[-1] == 0 or tuple(p[:-1]) + (p[-1] - 1,) in seen
        seen.add(tuple(p))
    best = sorted((path_probability(acc, q) for q in _all_paths(depth, topk)), reverse=True)[:nodes]
    assert expected_acceptance_length(acc, tree) == pytest.approx(1 + sum(best))  # no N-node tree expects more
    probs = [path_probability(acc, p) for p in tree]
    assert probs == sorted(probs, reverse=True)  # best first: every prefix is the best smaller tree


def test_a_uniform_prior_gives_the_prior_tree_of_configs_mtp_tree_yaml():
    """Ranks accepted 0.5, 0.2, 0.1, 0.05 at every depth: the 15-node tree measured in docs/PERFORMANCE.md."""
    documented = [[0], [0, 0], [1], [0, 0, 0], [0, 1], [2], [1, 0], [0, 0, 1], [0, 2], [0, 1, 0], [3], [2, 0],
                  [1, 0, 0], [1, 1], [0, 0, 2]]
    assert sorted(best_first_tree([[0.5, 0.2, 0.1, 0.05]] * 3, 15)) == sorted(documented)  # ties in any order
    assert _tree(15, 3, 4) == best_first_tree([[0.5, 0.2, 0.1, 0.05]] * 3, 15)


def test_a_weak_first_rank_spends_nodes_on_siblings():
    """Heads whose first choice is right 30 % of the time, the next ones 12, 7, 5 %: a wide first level."""
    acc = [[0.30, 0.12, 0.07, 0.05, 0.04, 0.03, 0.02, 0.02]] * 3
    tree = best_first_tree(acc, 15)
    assert sum(len(p) == 1 for p in tree) >= 6
    chain = [[0] * d for d in range(1, 4)]
    assert expected_acceptance_length(acc, tree) > expected_acceptance_length(acc, chain) + 0.3


def test_the_tree_stops_when_every_path_is_in():
    assert sorted(best_first_tree([[0.6, 0.3], [0.5, 0.4]], 100)) == sorted(map(list, _all_paths(2, 2)))


def test_bad_tables_are_refused():
    with pytest.raises(ValueError, match="node"):
        best_first_tree([[0.5]], 0)
    with pytest.raises(ValueError, match="same ranks"):
        best_first_tree([[0.5, 0.2], [0.5]], 3)
    with pytest.raises(ValueError, match="non-empty"):
        best_first_tree([], 3)


def test_rank_acceptance_counts_the_labels_rank_among_the_logits():
    """x · lm_headᵀ = x when lm_head is the identity: rows whose labels sit at known ranks."""
    v = 6
    lm_head = torch.eye(v)
    scores = torch.tensor([6.0, 5, 4, 3, 2, 1])  # token i has rank i
    x = scores.repeat(1, 5, 1)  # [B=1, T=5, H=V]
    labels = torch.tensor([[0, 0, 1, 3, 5]])  # ranks 0, 0, 1, 3, 5
    keep = torch.tensor([[True, True, True, True, False]])  # the rank-5 row is not measured
    acc = rank_acceptance([(x, labels, keep, x), (x, labels, torch.ones_like(keep), x)], lm_head, topk=4)
    assert acc[0] == pytest.approx([0.5, 0.25, 0.0, 0.25])
    assert acc[1] == pytest.approx([0.4, 0.2, 0.0, 0.2])  # rank 5 is outside the top 4: never accepted
    with pytest.raises(ValueError, match="no held-out position"):
        rank_acceptance([(x, labels, torch.zeros_like(keep), x)], lm_head)


def test_chain_rank_acceptance_conditions_each_step_on_the_chains_earlier_hits():
    """Eagle streams: stream s's row j continues the chain rooted at row j − s. Checked against counting by hand."""
    v, t = 5, 6
    lm_head = torch.eye(v)
    scores = torch.tensor([5.0, 4, 3, 2, 1])  # token i has rank i in every row
    x = scores.repeat(1, t, 1)
    step1 = torch.tensor([[0, 1, 0, 0, 2, 0]])  # roots 0..5: hits at roots 0, 2, 3, 5
    step2 = torch.tensor([[0, 0, 3, 0, 1, 4]])  # row j is root j − 1's step 2 (row 0 belongs to no root)
    keep1 = torch.ones(1, t, dtype=torch.bool)
    keep2 = torch.tensor([[False, True, True, True, True, False]])  # root 4's step 2 (row 5) is not measured
    acc = chain_rank_acceptance([(x, step1, keep1, x), (x, step2, keep2, x)], lm_head, topk=4)
    assert acc[0] == pytest.approx([4 / 6, 1 / 6, 1 / 6, 0])  # step 1: every root
    # step 2 over roots that hit at step 1 and are kept: roots 0 (row 1: rank 0), 2 (row 3: rank 0), 3 (row 4: rank
    # 1); root 5 has no step 2 row
    assert acc[1] == pytest.approx([2 / 3, 1 / 3, 0, 0])
    assert rank_acceptance([(x, step2, keep2, x)], lm_head, topk=4)[0] == pytest.approx([0.5, 0.25, 0, 0.25])
    missed = chain_rank_acceptance([(x, torch.full((1, t), 4), keep1, x), (x, step2, keep2, x)], lm_head, topk=4)
    assert missed == [[0, 0, 0, 0]]  # no chain hit at step 1: the table stops there
    with pytest.raises(ValueError, match="no held-out position"):
        chain_rank_acceptance([(x, step1, torch.zeros_like(keep1), x)], lm_head, topk=4)
