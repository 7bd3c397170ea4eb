"""A depth-bounded suffix trie with occurrence counts, the data structure of suffix decoding (Oliaro et al.,
"SuffixDecoding", NeurIPS 2025, arXiv 2411.04975; the algorithm of Snowflake Arctic Inference's `SuffixTree`,
kept uncompressed here: one node per token of a path).

Every suffix of every sequence is inserted up to depth D, so the node of a path p (|p| ≤ D) counts the occurrences
of p in the tree's sequences (the positions where p ends). child.count / node.count estimates P(next token | the
last |p| tokens were p); the counts of a node's children sum to at most its own.

    append t to sequence s   each node of s's current suffixes of length 0..D−1 (the root first) gets child t,
                             count + 1                                                        O(D) per token
    match a context          the nodes of its suffixes of length 1..M, M the longest present (suffixes of a
                             present path are present); `extend_match` moves them on by one token in O(D)
    propose                  from each matched node, longest match first, follow the most frequent child while
                             the path's probability (the product of child / parent counts) stays ≥ min_token_prob,
                             at most min(K, ⌊spec_factor · m⌋) tokens for a match of length m; the score is the sum
                             of those probabilities (the expected number of accepted drafts); the best score wins,
                             ties to the longer match (Arctic's rule)
    remove sequence s        each of its suffixes walked (≤ D deep), counts − 1, nodes at 0 dropped  O(D) per token

Sizes: a sequence of n tokens adds at most n·D nodes (fewer where its paths repeat); D ≤ MAX_DEPTH. Not
thread-safe: one thread (the engine's step) mutates and reads a tree.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field

MAX_DEPTH = 64  # the deepest tree: bounds the nodes a token adds (D) and the work of each append and match


class Node:
    """One path of the trie: its last token, its occurrence count, its children by token and the most frequent
    child (the largest (count, −token); `_STALE` after a removal until it is looked up again)."""

    __slots__ = ("token", "count", "children", "best")

    def __init__(self, token: int) -> None:
        self.token = token
        self.count = 0
        self.children: dict[int, Node] | None = None
        self.best: Node | None = None


_STALE = Node(-1)


def best_child(node: Node) -> Node | None:
    """The child with the largest count (the smallest token among equal counts), or None for a leaf."""
    best = node.best
    if best is _STALE:
        best = None
        for c in (node.children or {}).values():
            if best is None or c.count > best.count or (c.count == best.count and c.token < best.token):
                best = c
        node.best = best
    return best


@dataclass(frozen=True)
class Proposal:
    """A speculation: `tokens` (≤ K), `score` = the sum of their path probabilities (expected accepted drafts),
    `match_len` = the length of the context suffix it continues (0: none)."""

    tokens: list[int] = field(default_factory=list)
    score: float = 0.0
    match_len: int = 0


def propose(ends: Sequence[Node], max_tokens: int, spec_factor: float, min_token_prob: float) -> Proposal:
    """The best speculation from matched nodes `ends` (ends[m − 1]: the node of the context's last m tokens).

    Greedy by frequency: from each node, the most frequent child while the path probability stays ≥
    min_token_prob, at most min(max_tokens, ⌊spec_factor · m⌋) tokens. Longest match first; a shorter match must
    score strictly better, and one whose budget cannot stops the search.
    """
    best = Proposal()
    for m in range(len(ends), 0, -1):
        budget = min(max_tokens, int(m * spec_factor + 1e-6))
        if budget <= best.score:  # a score is at most its budget, and budgets shrink with m
            break
        node, prob, score, tokens = ends[m - 1], 1.0, 0.0, []
        while len(tokens) < budget and node.children:
            child = best_child(node)
            if child is None:
                break
            prob *= child.count / node.count
            if prob < min_token_prob:
                break
            tokens.append(child.token)
            score += prob
            node = child
        if score > best.score:
            best = Proposal(tokens, score, m)
    return best


class SuffixTree:
    """Sequences by id in one depth-bounded suffix trie (module docstring).

    Attributes:
        max_depth: D, the longest path (1 ≤ D ≤ MAX_DEPTH).
        root: the empty path; root.count = the tokens held.
        num_nodes: nodes besides the root (≤ tokens held × D).
        version: bumped by `remove` (nodes may be dropped: matches taken before it must be redone).
    """

    def __init__(self, max_depth: int) -> None:
        if not 1 <= max_depth <= MAX_DEPTH:
            raise ValueError(f"max_depth must be in [1, {MAX_DEPTH}], got {max_depth}")
        self.max_depth = max_depth
        self.root = Node(-1)
        self.num_nodes = 0
        self.version = 0
        self._seqs: dict[int, list[int]] = {}
        self._ends: dict[int, list[Node]] = {}  # each sequence's suffix nodes, lengths 1..min(D, n)

    def __contains__(self, seq_id: int) -> bool:
        return seq_id in self._seqs

    def _child(self, node: Node, token: int) -> Node:
        """node's child for `token` (created when new), its count + 1."""
        children = node.children
        if children is None:
            children = node.children = {}
        child = children.get(token)
        if child is None:
            child = children[token] = Node(token)
            self.num_nodes += 1
        child.count += 1
        b = node.best
        if b is not _STALE and (b is None or child.count > b.count or (child.count == b.count and token < b.token)):
            node.best = child
        return child

    def extend(self, seq_id: int, tokens: Sequence[int]) -> list[Node]:
        """Append `tokens` to sequence `seq_id` (a new one when unseen).

        Returns:
            the nodes of the sequence's suffixes of length 1..min(D, n), shortest first: its matches in this tree
            (the tree's own list, replaced by the next call; do not modify it).
        """
        root, keep = self.root, self.max_depth - 1
        ends = self._ends.get(seq_id, [])
        for t in tokens:
            new = [self._child(root, t)]
            new += [self._child(node, t) for node in ends[:keep]]
            ends = new
        root.count += len(tokens)
        self._seqs.setdefault(seq_id, []).extend(tokens)
        self._ends[seq_id] = ends
        return ends

    def close(self, seq_id: int) -> None:
        """No more tokens for `seq_id`: forget its suffix nodes (its tokens stay, for `remove`)."""
        self._ends.pop(seq_id, None)

    def remove(self, seq_id: int) -> None:
        """Take sequence `seq_id` out of the tree (O(n·D)); nodes whose count reaches 0 are dropped.

        Raises:
            KeyError: no such sequence.
        """
        seq = self._seqs.pop(seq_id)
        self._ends.pop(seq_id, None)
        self.version += 1
        self.root.count -= len(seq)
        for start in range(len(seq)):
            node = self.root
            for t in seq[start:start + self.max_depth]:
                child = node.children[t]
                child.count -= 1
                if node.best is child:
                    node.best = _STALE
                if child.count == 0:
                    # Its only occurrence was this one, so its subtree is a chain of count-1 nodes: all dropped.
                    del node.children[t]
                    while child is not None:
                        self.num_nodes -= 1
                        child = next(iter(child.children.values())) if child.children else None
                    break
                node = child

    def match(self, context: Sequence[int]) -> list[Node]:
        """The nodes of context's suffixes of length 1..M, shortest first; M ≤ D the longest present (O(M²))."""
        ends: list[Node] = []
        n = len(context)
        for m in range(1, min(self.max_depth, n) + 1):
            node: Node | None = self.root
            for t in context[n - m:]:
                node = node.children.get(t) if node.children else None
                if node is None:
                    return ends
            ends.append(node)
        return ends

    def extend_match(self, ends: list[Node], token: int) -> list[Node]:
        """`match(context + [token])` from `ends` = `match(context)` in O(D) (valid while `version` is unchanged;
        a match taken before sequences were added may come out shorter than the longest present)."""
        new: list[Node] = []
        for node in (self.root, *ends[:self.max_depth - 1]):
            child = node.children.get(token) if node.children else None
            if child is None:
                break
            new.append(child)
        return new


class OutputCache:
    """Earlier requests' outputs in one SuffixTree, first in first out: at most `max_requests` outputs and, past
    `max_nodes` nodes, the oldest evicted down to the newest one (0 requests: off, nothing is kept).

    Attributes:
        tree: the shared tree; its `version` changes with each eviction.
    """

    def __init__(self, max_depth: int, max_requests: int, max_nodes: int = 1 << 20) -> None:
        self.tree = SuffixTree(max_depth)
        self.max_requests = max_requests
        self.max_nodes = max_nodes
        self._outputs: deque[list[int]] = deque()  # the sequence ids of each output, oldest first
        self._next_id = 0

    def __len__(self) -> int:
        return len(self._outputs)

    def add(self, segments: Sequence[Sequence[int]]) -> None:
        """One finished output, as its runs of known tokens (each its own sequence); evicts beyond the bounds."""
        if self.max_requests == 0 or not any(segments):
            return
        ids = []
        for seg in segments:
            if seg:
                self.tree.extend(self._next_id, seg)
                self.tree.close(self._next_id)
                ids.append(self._next_id)
                self._next_id += 1
        self._outputs.append(ids)
        while len(self._outputs) > self.max_requests or (self.tree.num_nodes > self.max_nodes
                                                         and len(self._outputs) > 1):
            for seq_id in self._outputs.popleft():
                self.tree.remove(seq_id)
