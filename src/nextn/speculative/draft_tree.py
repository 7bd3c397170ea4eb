"""Draft trees given by parent pointers: static trees from rank paths, EAGLE-2's dynamic selection, tree acceptance.

Sources: Li et al. 2024, "EAGLE-2" §4 (expansion of the top-k nodes by cumulative draft probability, then
reranking to a node budget); Miao et al. 2024, "SpecInfer" §4 (tree verification; multi-step speculative sampling);
Cai et al. 2024, "Medusa" §2.1.2 (rank paths such as `[0, 1]`, `medusa_choices`; TensorRT-LLM calls the same format
`eagle_choices`). Written from those descriptions.

A tree of N tokens is token 0, the root (the last emitted token), then N − 1 draft nodes in an order where every
parent comes before its children. It is described by `parents` [..., N] int64 (the root is its own parent) and
`depth` [..., N] int64 (root 0), for one tree shared by the batch ([N]) or one per request ([B, N]). Fixed shapes,
no host synchronisation: every loop below runs a host-known number of times (the tree's maximum depth).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from nextn.speculative.medusa_tree import TreeError, build_tree


@dataclass(frozen=True)
class StaticTree:
    """A tree of top-k rank paths (`eagle_choices`), nodes sorted by (depth, path).

    Attributes:
        parents: [N] int64 parent token index (root: 0); ranks: [N] int64 the node's rank among its parent's
            top-k (root: 0); depth: [N] int64; mask: [N, N] bool, token i sees its ancestors and itself.
        depth_starts: index of the first token of each depth 0..D, then N (a depth's tokens are contiguous).
        topk: children drafted per expanded node (max rank + 1).
        order: [N] int64 the verification order (the listed order of `choices` when every parent is listed before
            its children — best first, so that the first w tokens are the tree to verify at a smaller draft
            length —, else the (depth, path) order): order[j] = the token index of the j-th verified token.
    """

    parents: torch.Tensor
    ranks: torch.Tensor
    depth: torch.Tensor
    mask: torch.Tensor
    depth_starts: tuple[int, ...]
    topk: int
    order: torch.Tensor

    @property
    def num_tokens(self) -> int:
        return self.parents.shape[0]

    @property
    def max_depth(self) -> int:
        return len(self.depth_starts) - 2

    def to(self, device: torch.device | str) -> "StaticTree":
        return StaticTree(self.parents.to(device), self.ranks.to(device), self.depth.to(device),
                          self.mask.to(device), self.depth_starts, self.topk, self.order.to(device))

    def verify_layout(self, width: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(parents [w], depth [w], mask [w, w]) of the first w tokens in verification order (a tree)."""
        position = torch.empty_like(self.order)
        position[self.order] = torch.arange(self.num_tokens, device=self.order.device)
        parents = position[self.parents[self.order[:width]]]
        return parents, self.depth[self.order[:width]], ancestor_mask(parents[None], self.max_depth)[0]


def static_tree(choices: list[list[int]], vocab_size: int | None = None) -> StaticTree:
    """The tree of rank paths `choices` (e.g. `[[0], [1], [0, 0]]`: top-1 and top-2 of the first draft, then the
    top-1 after the top-1).

    Raises:
        TreeError: empty, more than 255 nodes or 64 deep, a negative rank or one ≥ `vocab_size` (when given), a
            duplicate, or a node whose parent path is missing (`build_tree`).
    """
    buffers = build_tree(choices, vocab_size)  # validates; the same node order (depth, path), parents and mask
    nodes = sorted({tuple(int(r) for r in c) for c in choices}, key=lambda p: (len(p), p))
    index = {p: i + 1 for i, p in enumerate(nodes)}
    ranks = [0] + [p[-1] for p in nodes]
    depth = buffers.depth.tolist()
    starts = tuple(depth.index(d) for d in range(max(depth) + 1)) + (len(depth),)
    listed = [tuple(int(r) for r in c) for c in choices]
    parents_first = all(len(p) == 1 or p[:-1] in listed[:i] for i, p in enumerate(listed))
    order = [0] + ([index[p] for p in listed] if parents_first else list(range(1, len(depth))))
    return StaticTree(buffers.parents, torch.tensor(ranks), buffers.depth, buffers.mask, starts, buffers.topk,
                      torch.tensor(order))


def chain_choices(depth: int) -> list[list[int]]:
    """The chain as a tree: the top-1 draft at each of `depth` steps (what MTP Eagle drafts without a tree)."""
    return [[0] * d for d in range(1, depth + 1)]


def ancestor_mask(parents: torch.Tensor, max_depth: int) -> torch.Tensor:
    """Tree attention mask from parent pointers [B, N] → [B, N, N] bool: token i sees its ancestors and itself."""
    b, n = parents.shape
    mask = torch.eye(n, dtype=torch.bool, device=parents.device).expand(b, n, n).clone()
    node = torch.arange(n, device=parents.device).expand(b, n)
    for _ in range(max_depth):
        node = parents.gather(1, node)
        mask.scatter_(2, node[..., None], True)
    return mask


def tree_accept(target: torch.Tensor, tree_tokens: torch.Tensor, parents: torch.Tensor, depth: torch.Tensor,
                max_depth: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The longest accepted root-to-node path of each request's tree (SpecInfer §4.2, token tree verification).

    A node is accepted when its token equals the target token drawn at its parent and its parent is accepted.
    With `target` the argmax this is greedy verification (lossless: the deepest accepted node ends the longest
    prefix the target itself would have produced). With `target` one draw from the target's sampling distribution
    at each node (`sample_tokens`, a uniform per position), it is multi-step speculative sampling for
    deterministic drafts: SpecInfer's recursive rejection over the children with one-hot draft distributions
    accepts child j with probability p_j(x_j) (p with the earlier siblings removed and renormalised), and on
    rejecting every child draws from p without them — exactly "draw y ~ p; descend to the child whose token is y,
    else emit y". Every emitted token is thus distributed as the target's (tests/speculative/test_draft_tree.py).

    Args:
        target: [B, N] int64 the target's token at each node (argmax or sampled).
        tree_tokens: [B, N] int64 the tree (token 0: the root; children of a node are distinct tokens).
        parents, depth: [B, N] or [N] int64.
        max_depth: D, the deepest a node may be.
    Returns:
        path [B, D+1] int64 token index of the best path's node at each depth (entries past its end repeat its
        last node), num_accepted [B] int64 in [0, D] (the last node's depth), tokens [B, D+1] int64 = target
        along the path: the accepted drafts, then the correction or bonus (the first num_accepted + 1 count).
    """
    b, n = tree_tokens.shape
    parents, depth = parents.expand(b, n), depth.expand(b, n)
    match = tree_tokens == target.gather(1, parents)
    match[:, 0] = True
    ok = match
    for _ in range(max_depth):
        ok = match & ok.gather(1, parents)
    order = torch.arange(n, device=target.device)
    score = torch.where(ok, depth * n + (n - 1 - order), -1)  # deepest accepted node; ties: the first
    best = score.argmax(dim=1)
    num_accepted = depth.gather(1, best[:, None])[:, 0]
    chain = [best]
    for _ in range(max_depth):
        chain.append(parents.gather(1, chain[-1][:, None])[:, 0])
    ancestors = torch.stack(chain, dim=1)  # [B, D+1]: ancestors[:, j] = the j-th ancestor of best
    steps = torch.arange(max_depth + 1, device=target.device)
    path = ancestors.gather(1, (num_accepted[:, None] - steps).clamp(min=0))
    return path, num_accepted, target.gather(1, path)


def select_dynamic_tree(scores: torch.Tensor, tokens: torch.Tensor, cand_parents: torch.Tensor,
                        cand_depth: torch.Tensor, num_nodes: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """EAGLE-2's reranking: the `num_nodes` candidates of highest cumulative log-probability form the tree.

    A candidate's score is its parent's plus a log-probability ≤ 0, and parents are listed before their children,
    so a stable descending sort puts every parent before its children: the chosen set is a tree (closed under
    parents), its order is topological, and its first w nodes are the best w-node tree (a smaller draft length
    verifies a prefix).

    Args:
        scores: [B, C] fp32 cumulative draft log-probabilities of the C candidates.
        tokens: [B, C] int64; cand_parents: [B, C] int64 parent candidate id, 1-based (0: the root);
            cand_depth: [C] int64.
        num_nodes: M ≤ C nodes kept.
    Returns:
        drafts [B, M] int64, parents [B, M+1] int64 and depth [B, M+1] int64 of the tree (root first).
    """
    b, c = scores.shape
    order = torch.sort(scores, dim=1, descending=True, stable=True).indices[:, :num_nodes]  # [B, M] 0-based ids
    where = torch.zeros(b, c + 1, dtype=torch.int64, device=scores.device)  # candidate id → token index
    where.scatter_(1, order + 1, torch.arange(1, num_nodes + 1, device=scores.device).expand(b, num_nodes))
    parent_ids = cand_parents.gather(1, order)
    root = torch.zeros(b, 1, dtype=torch.int64, device=scores.device)
    parents = torch.cat([root, where.gather(1, parent_ids)], dim=1)
    depth = torch.cat([root, cand_depth[order]], dim=1)
    return tokens.gather(1, order), parents, depth


def check_tree_fits(name: str, depth: int, max_depth: int) -> None:
    """Raise TreeError when a tree is deeper than the drafts the module may chain (`num_nextn_predict_layers`)."""
    if depth > max_depth:
        raise TreeError(f"{name} is {depth} deep but num_nextn_predict_layers is {max_depth}: the module drafts one "
                        "depth per application; raise num_nextn_predict_layers or shorten the paths")
