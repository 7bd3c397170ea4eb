"""Medusa tree buffers: the worked example of REFERENCE.md §5 and invariants on all nine published trees."""

from __future__ import annotations

import json

import pytest
import torch

from nextn.speculative.medusa_tree import TreeError, build_tree, chain


def test_reference_worked_example():
    t = build_tree([[0], [1], [0, 0], [0, 1], [1, 0], [0, 0, 0]])
    assert t.depth_counts == (2, 3, 1)
    assert t.depth.tolist() == [0, 1, 1, 2, 2, 2, 3]
    assert t.paths.tolist() == [[0, 1, 3, 6], [0, 2, 5, 0], [0, 1, 4, 0]]
    assert t.path_valid.tolist() == [[True] * 4, [True, True, True, False], [True, True, True, False]]
    # token 3 = [0, 0]: sees the root, [0] (token 1) and itself
    assert t.mask[3].nonzero().flatten().tolist() == [0, 1, 3]
    assert t.candidate_index.tolist() == [0, 1, 2, 3, 4, 3, 5]  # topk 2: 1 + (depth-1)·2 + rank


def _check_invariants(choices):
    t = build_tree(choices)
    nodes = sorted((tuple(c) for c in choices), key=lambda p: (len(p), p))
    assert t.num_tokens == len(choices) + 1
    assert sum(t.depth_counts) == len(choices)
    for i, p in enumerate(nodes, start=1):
        assert t.depth[i] == len(p)
        assert t.candidate_index[i] == 1 + (len(p) - 1) * t.topk + p[-1]
        ancestors = {0} | {nodes.index(p[:d]) + 1 for d in range(1, len(p))} | {i}
        assert set(t.mask[i].nonzero().flatten().tolist()) == ancestors
    leaves = {p for p in nodes if not any(q[: len(p)] == p and len(q) > len(p) for q in nodes)}
    assert len(t.paths) == len(leaves)
    for row, valid in zip(t.paths.tolist(), t.path_valid.tolist()):
        toks = [x for x, v in zip(row, valid) if v]
        assert toks[0] == 0 and [t.depth[x].item() for x in toks] == list(range(len(toks)))
        for a, b in zip(toks, toks[1:]):
            assert t.mask[b, a]  # each step goes to a child
        assert nodes[toks[-1] - 1] in leaves
    assert {nodes[[x for x, v in zip(r, m) if v][-1] - 1] for r, m in zip(t.paths.tolist(), t.path_valid.tolist())} == leaves


def test_published_trees(shared_data):
    trees = json.loads((shared_data / "medusa_choices.json").read_text())
    assert len(trees) == 9
    for name, choices in trees.items():
        assert len(choices) == 63, name
        _check_invariants(choices)
        assert build_tree(choices).num_tokens == 64


def test_chain_is_the_degenerate_tree():
    t = build_tree(chain(4))
    assert t.paths.tolist() == [[0, 1, 2, 3, 4]] and t.topk == 1
    assert torch.equal(t.mask, torch.ones(5, 5, dtype=torch.bool).tril())


@pytest.mark.parametrize("bad,fragment", [([], "empty"), ([[0, 1]], "no parent"), ([[0], [0]], "duplicate"),
                                          ([[-1]], "ranks")])
def test_malformed_trees(bad, fragment):
    with pytest.raises(TreeError, match=fragment):
        build_tree(bad)


def _wide_tree(n: int) -> list[list[int]]:
    return [[i] for i in range(n)]


def test_a_tree_is_capped_like_the_dynamic_one_before_any_buffer_is_built():
    # issue 32: 5,000 nodes ran for minutes, 20,000 tried to allocate 25.6 GB a step
    from nextn.speculative.medusa_tree import MAX_TREE_NODES

    assert MAX_TREE_NODES == 255
    build_tree(_wide_tree(255))
    for n in (256, 20_000):
        with pytest.raises(TreeError, match=f"{n} nodes, more than the 255"):
            build_tree(_wide_tree(n))
    with pytest.raises(TreeError, match="at most 64 ranks"):
        build_tree([[0] * d for d in range(1, 66)][-1:])


def test_ranks_must_index_the_vocabulary():
    # issue 32: [[0], [600]] on a 512-token model loaded, then every request failed
    build_tree([[0], [511]], vocab_size=512)
    for rank in (512, 600, 2_000_000_000):
        with pytest.raises(TreeError, match=f"rank {rank}.*512-token vocabulary"):
            build_tree([[0], [rank]], vocab_size=512)
    with pytest.raises(TreeError, match="ints"):
        build_tree([[0], [True]])
