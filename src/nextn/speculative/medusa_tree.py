"""Medusa tree buffers: from a list of top-k rank paths to the fixed tensors of tree verification.

Source: Cai et al. 2024, "Medusa" §2.1.2 (tree attention); buffer semantics as in FasterDecoding/Medusa
`medusa/model/utils.py::generate_medusa_buffers` (FasterDecoding/Medusa), written here from that description.

A tree is a list of nodes, each the path of top-k ranks from the root: `[0, 1]` = head 0's top-1 then head 1's
top-2. Nodes are sorted by (depth, path); token 0 is the root (the last emitted token), tokens 1..n the nodes.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from nextn.config.llm_args import MAX_TREE_DEPTH, MAX_TREE_DRAFT_TOKENS

Path = tuple[int, ...]

#: Draft nodes a static tree may hold: the dynamic tree's cap (`MTPDecodingConfig.max_total_draft_tokens`).
MAX_TREE_NODES = MAX_TREE_DRAFT_TOKENS
# MAX_TREE_DEPTH: ranks a path may hold (Medusa trees are ≤ 5 deep, MTP trees ≤ num_nextn_predict_layers ≤ 16).
MAX_TREE_FILE_BYTES = 16 << 20  # medusa_choices.json (FasterDecoding/Medusa's is a few kilobytes)


class TreeError(ValueError):
    """A malformed tree (empty, a node whose parent is missing, a negative rank)."""


@dataclass(frozen=True)
class TreeBuffers:
    """Everything a batched tree step needs, for a tree of L = num_nodes + 1 tokens and depth D.

    Attributes:
        mask: [L, L] bool; mask[i, j]: token i sees token j (the root, its ancestors and itself).
        depth: [L] int64 position offset of each token from the root (root 0).
        parents: [L] int64 token index of each token's parent (the root: 0).
        candidate_index: [L] int64 index of each token in the flattened candidates
            [root, head 0 top-k (topk entries), head 1 top-k, ...]: 1 + (depth − 1)·topk + last rank (root: 0).
        paths: [P, D + 1] int64 token indices of each root-to-leaf path, padded with 0 past its end.
        path_valid: [P, D + 1] bool, False on padding.
        depth_counts: nodes per depth 1..D.
        topk: candidates kept per head (max rank + 1).
    """

    mask: torch.Tensor
    depth: torch.Tensor
    parents: torch.Tensor
    candidate_index: torch.Tensor
    paths: torch.Tensor
    path_valid: torch.Tensor
    depth_counts: tuple[int, ...]
    topk: int

    @property
    def num_tokens(self) -> int:
        return self.mask.shape[0]

    @property
    def max_depth(self) -> int:
        return len(self.depth_counts)

    def to(self, device: torch.device | str) -> "TreeBuffers":
        return TreeBuffers(self.mask.to(device), self.depth.to(device), self.parents.to(device),
                           self.candidate_index.to(device), self.paths.to(device), self.path_valid.to(device),
                           self.depth_counts, self.topk)


def check_tree_size(choices: list[list[int]] | list[Path], vocab_size: int | None = None) -> None:
    """Bound a tree before any buffer is built: at most `MAX_TREE_NODES` nodes (the dynamic tree's cap), paths of
    at most `MAX_TREE_DEPTH` ranks, every rank an int in [0, vocab_size) (a rank is an index into a top-k over the
    vocabulary) when the vocabulary is known.

    Raises:
        TreeError: naming the limit and the offending node.
    """
    if not isinstance(choices, (list, tuple)):
        raise TreeError(f"a tree is a list of rank paths such as [[0], [1], [0, 0]], got {type(choices).__name__}")
    if len(choices) > MAX_TREE_NODES:
        raise TreeError(f"the tree has {len(choices)} nodes, more than the {MAX_TREE_NODES} a step may verify (as "
                        "max_total_draft_tokens): every node is a token verified for every request at every step")
    for c in choices:
        if not isinstance(c, (list, tuple)) or len(c) > MAX_TREE_DEPTH:
            raise TreeError(f"invalid tree node {c!r}: a path is a list of at most {MAX_TREE_DEPTH} ranks")
        for r in c:
            if isinstance(r, bool) or not isinstance(r, int) or r < 0:
                raise TreeError(f"invalid tree node {list(c)}: ranks are ints ≥ 0")
            if vocab_size is not None and r >= vocab_size:
                raise TreeError(f"tree node {list(c)} has rank {r}, but a rank indexes the top-k of the model's "
                                f"{vocab_size}-token vocabulary: ranks must be < {vocab_size}")


def build_tree(choices: list[list[int]] | list[Path], vocab_size: int | None = None) -> TreeBuffers:
    """Tree buffers for `choices` (Medusa's `medusa_choices`).

    Args:
        choices: rank paths, at most `MAX_TREE_NODES` of at most `MAX_TREE_DEPTH` ranks.
        vocab_size: the model's vocabulary, when known: every rank must be below it.
    Raises:
        TreeError: empty or too large a tree, a rank that is negative, not an int or ≥ vocab_size, a duplicate
            node, or a node whose parent path is not in the tree.
    """
    check_tree_size(choices, vocab_size)
    nodes = sorted({tuple(int(r) for r in c) for c in choices}, key=lambda p: (len(p), p))
    if not nodes:
        raise TreeError("medusa_choices is empty: give at least one path such as [[0]]")
    if len(nodes) != len(choices):
        raise TreeError("medusa_choices holds duplicate paths")
    present = set(nodes)
    for p in nodes:
        if not p or min(p) < 0:
            raise TreeError(f"invalid tree node {list(p)}: paths are non-empty lists of ranks ≥ 0")
        if len(p) > 1 and p[:-1] not in present:
            raise TreeError(f"tree node {list(p)} has no parent {list(p[:-1])} in medusa_choices")
    index = {p: i + 1 for i, p in enumerate(nodes)}  # token index; the root is 0
    n = len(nodes) + 1
    topk = max(max(p) for p in nodes) + 1
    mask = torch.eye(n, dtype=torch.bool)
    mask[:, 0] = True
    depth = torch.zeros(n, dtype=torch.int64)
    parents = torch.zeros(n, dtype=torch.int64)
    candidate_index = torch.zeros(n, dtype=torch.int64)
    for p, i in index.items():
        depth[i] = len(p)
        parents[i] = index.get(p[:-1], 0)
        candidate_index[i] = 1 + (len(p) - 1) * topk + p[-1]
        for d in range(1, len(p)):
            mask[i, index[p[:d]]] = True
    # Root-to-leaf paths, deepest-last node first (Medusa's order); a node already on a listed path is skipped.
    paths: list[list[int]] = []
    covered: set[tuple[int, ...]] = set()
    for p in reversed(nodes):
        if p in covered:
            continue
        paths.append([0] + [index[p[:d]] for d in range(1, len(p) + 1)])
        covered.update(p[:d] for d in range(1, len(p) + 1))
    width = max(len(x) for x in paths)
    padded = torch.tensor([x + [0] * (width - len(x)) for x in paths], dtype=torch.int64)
    valid = torch.tensor([[True] * len(x) + [False] * (width - len(x)) for x in paths])
    counts = tuple(sum(1 for p in nodes if len(p) == d) for d in range(1, width))
    return TreeBuffers(mask, depth, parents, candidate_index, padded, valid, counts, topk)


def chain(depth: int) -> list[list[int]]:
    """The degenerate tree: top-1 of each head, one path of `depth` nodes."""
    return [[0] * d for d in range(1, depth + 1)]


def published_tree(name: str) -> list[list[int]]:
    """A published Medusa tree by name (`mc_sim_7b_63`, `vicuna_7b_stage2`, ...).

    The trees are third-party data, not shipped in this package: they are read from the JSON file named by
    `$NEXTN_MEDUSA_CHOICES`, else from `../shared/data/medusa_choices.json` beside the working directory or the
    checkout. Raises TreeError naming what to do when the file or the name is missing.
    """
    import os
    from pathlib import Path

    from nextn.config.user_files import read_user_json

    found: Path | None
    if os.environ.get("NEXTN_MEDUSA_CHOICES"):  # the user's file: read or refused by name, never skipped
        found = Path(os.environ["NEXTN_MEDUSA_CHOICES"])
    else:
        here = Path(__file__).resolve()
        candidates = [root.parent / "shared" / "data" / "medusa_choices.json" for root in (Path.cwd(), *here.parents)]
        found = next((c for c in candidates if c.is_file()), None)
    if found is None:
        raise TreeError(f"medusa_choices {name!r} names a published tree, but no medusa_choices.json was found: set "
                        "NEXTN_MEDUSA_CHOICES to that file (FasterDecoding/Medusa's trees) or pass medusa_choices "
                        "as a list of paths, e.g. [[0], [0, 0], [1]]")
    trees = read_user_json(found, "the Medusa tree file", TreeError, MAX_TREE_FILE_BYTES)
    if not isinstance(trees, dict):
        raise TreeError(f"{found} must hold a JSON object of named trees")
    if name not in trees:
        raise TreeError(f"unknown Medusa tree {name!r}; {found} has {', '.join(trees)}")
    return trees[name]
