"""Medusa tree kernels: the tree attention mask and the candidate gather against their references."""

from __future__ import annotations

import pytest
import torch

from nextn.speculative.medusa_tree import build_tree

TREE = [[0], [1], [0, 0], [0, 1], [1, 0], [0, 0, 0]]  # REFERENCE.md §5's worked example: L = 7, depth 3, topk 2


def test_visibility_hand_worked(kernels):
    from nextn.plugins.kernels.medusa_tree import tree_visibility

    tree = build_tree(TREE)
    vis = tree_visibility(torch.tensor([2]), tree.mask, 12)  # [1, L, 12]
    # token 3 = [0, 0] at cache position 2 + 3: sees the prefix 0..1, the root (2), [0] (3) and itself (5)
    assert vis[0, 3].nonzero().flatten().tolist() == [0, 1, 2, 3, 5]
    assert vis.dtype == torch.bool


@pytest.mark.parametrize("batch", [1, 3, 5])
@pytest.mark.parametrize("max_context", [8, 40, 300])
def test_visibility_matches_reference(kernels, batch, max_context):
    from nextn.plugins.kernels.medusa_tree import tree_visibility, tree_visibility_reference

    tree = build_tree(TREE)
    kv_lens = torch.randint(0, max_context, (batch,), generator=torch.Generator().manual_seed(batch))
    kv_lens[0] = max_context - 3  # the tree runs past the gathered context
    assert torch.equal(tree_visibility(kv_lens, tree.mask, max_context),
                       tree_visibility_reference(kv_lens, tree.mask, max_context))


def test_candidates_hand_worked(kernels):
    from nextn.plugins.kernels.medusa_tree import tree_candidates

    tree = build_tree(TREE)  # candidate_index [0, 1, 2, 3, 4, 3, 5]
    topk = torch.tensor([[[10, 11]], [[20, 21]], [[30, 31]]])  # [D=3, B=1, topk=2]
    assert tree_candidates(torch.tensor([[7]]), topk, tree.candidate_index).tolist() == [[7, 10, 11, 20, 21, 20, 30]]


@pytest.mark.parametrize("batch", [1, 2, 5])
@pytest.mark.parametrize("choices", [TREE, [[0], [0, 0], [0, 0, 0]], [[i] for i in range(5)] + [[0, 1], [4, 2]]])
def test_candidates_match_reference(kernels, batch, choices):
    from nextn.plugins.kernels.medusa_tree import tree_candidates, tree_candidates_reference

    tree = build_tree(choices)
    gen = torch.Generator().manual_seed(batch)
    root = torch.randint(0, 1000, (batch, 1), generator=gen)
    topk = torch.randint(0, 1000, (tree.max_depth, batch, tree.topk), generator=gen)
    assert torch.equal(tree_candidates(root, topk, tree.candidate_index),
                       tree_candidates_reference(root, topk, tree.candidate_index))


@pytest.mark.parametrize("batch", [1, 3])
def test_per_request_rectangular_visibility_matches_reference(kernels, batch):
    """An MTP tree's masks: one per request, Q query tokens over L tree keys ([B, Q, L])."""
    from nextn.plugins.kernels.medusa_tree import tree_visibility, tree_visibility_reference

    gen = torch.Generator().manual_seed(batch)
    mask = torch.rand(batch, 3, 7, generator=gen) < 0.5
    kv_lens = torch.randint(0, 30, (batch,), generator=gen)
    got = tree_visibility(kv_lens, mask, 40)
    assert got.shape == (batch, 3, 40) and torch.equal(got, tree_visibility_reference(kv_lens, mask, 40))
    shared = build_tree(TREE).mask
    assert torch.equal(tree_visibility_reference(kv_lens, shared.expand(batch, 7, 7), 40),
                       tree_visibility_reference(kv_lens, shared, 40))
