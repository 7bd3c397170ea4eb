"""Expected tokens per verify step (speculative/draft_gain.py): chains, trees, the α inversion, and the drafters' gains."""

import itertools
import random

import pytest

from nextn.speculative.draft_tree import static_tree
from nextn.speculative.draft_gain import (RANK_PRIOR, TreeGain, alpha_for_gain, best_first_tree, expected_tokens,
                                      path_probability, prior_tree)
from nextn.speculative.draft_len_policy import AdaptiveDraftLen, StaticDraftLen
from nextn.speculative.mtp_tree import DynamicTreeDrafter, StaticTreeDrafter


def test_a_chain_tree_gains_what_leviathans_formula_says():
    chain = TreeGain([[0] * d for d in range(1, 8)])
    for alpha, k in itertools.product((0.0, 0.3, 0.7, 0.99), range(8)):
        assert chain(alpha, k) == pytest.approx(expected_tokens(alpha, k))
    assert expected_tokens(1.0, 3) == 4.0


def test_a_tree_gain_sums_its_first_nodes_path_probabilities():
    paths = [[0], [1], [0, 0], [2], [1, 0], [0, 1]]
    gain = TreeGain(paths)
    acc = [[0.6 * w for w in RANK_PRIOR]] * 2
    for n in range(len(paths) + 1):
        assert gain(0.6, n) == pytest.approx(1 + sum(path_probability(acc, p) for p in paths[:n]))
    assert gain(0.6, 99) == gain(0.6, len(paths))  # a longer draft length than the tree: the whole tree


@pytest.mark.parametrize("paths", [[[0], [0, 0], [0, 0, 0]], [[0], [1], [0, 0], [2], [1, 0], [0, 1], [0, 0, 0]]])
def test_alpha_inversion_round_trips(paths):
    gain = TreeGain(paths)
    for alpha in (0.05, 0.3, 0.6, 0.95):
        for n in range(1, len(paths) + 1):
            assert alpha_for_gain(gain, gain(alpha, n) - 1, n) == pytest.approx(alpha, abs=1e-6)
    assert alpha_for_gain(gain, 0.0, 3) == 0.0 and alpha_for_gain(gain, 99.0, 3) == 1.0


def test_the_prior_tree_is_the_most_probable_paths():
    tree = prior_tree(3, 15)
    acc = [[0.5 * w for w in RANK_PRIOR[:4]]] * 3
    every = [p for d in range(1, 4) for p in itertools.product(range(4), repeat=d)]
    best = sorted((path_probability(acc, p) for p in every), reverse=True)[:15]
    assert sorted(path_probability(acc, p) for p in tree) == pytest.approx(sorted(best))
    assert tree == best_first_tree(acc, 15)


def test_the_tree_drafters_gain_follows_their_verification_order():
    choices = [[0], [0, 0], [1], [0, 0, 0], [0, 1], [2]]  # best first, parents first: verified in this order
    drafter = StaticTreeDrafter(static_tree(choices))
    listed = TreeGain(choices)
    for n in range(1, 7):
        assert drafter.expected_tokens(0.5, n) == pytest.approx(listed(0.5, n))
    shuffled = [[0, 0], [0], [1]]  # a child before its parent: (depth, path) order
    by_depth = StaticTreeDrafter(static_tree(shuffled))
    assert by_depth.expected_tokens(0.5, 2) == pytest.approx(TreeGain([[0], [1]])(0.5, 2))
    dynamic = DynamicTreeDrafter(4, 3, 15)
    assert dynamic.expected_tokens(0.5, 15) == pytest.approx(TreeGain(prior_tree(3, 15))(0.5, 15))


def test_the_adaptive_policy_counts_a_trees_nodes_and_turns_it_down():
    """Steps timed per node count; acceptance read through the tree's gain, so it picks the node count that pays."""
    tree = TreeGain(prior_tree(3, 15))
    p = AdaptiveDraftLen(StaticDraftLen(15), probe_every=1000, gain=tree)
    rng = random.Random(0)
    alpha = 0.6
    for _ in range(200):  # plain 10 ms; 15 nodes 30 ms, 3 nodes 12 ms; accepted drafts drawn around their mean
        p.observe(0, 0, 0, 1, 0.010)
        for k, t in ((15, 0.030), (3, 0.012)):
            mean = tree(alpha, k) - 1  # the expected accepted drafts per step at k nodes
            accepted = int(mean) + (rng.random() < mean - int(mean))
            p.observe(3, accepted, k, 1, t, {1: accepted})
    assert p.alpha == pytest.approx(alpha, abs=0.1)
    assert p.step_time[1][15] == pytest.approx(0.030) and p.step_time[1][3] == pytest.approx(0.012)
    # 15 nodes: E ≈ 2.0 per 3 plain steps; 3 nodes: E ≈ 1.7 per 1.2 — the short tree pays, the long one does not
    assert p.draft_len(1, [1]) == 3
