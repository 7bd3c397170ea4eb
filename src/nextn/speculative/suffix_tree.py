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
ROOT = 0  # the node id of the empty path
_NONE, _STALE = -1, -2  # `best` of a leaf; `best` after a removal changed a child's count, until looked up again


@dataclass(frozen=True)
class Proposal:
    """A speculation: `tokens` (≤ K), `score` = the sum of their path probabilities (expected accepted drafts),
    `match_len` = the length of the context suffix it continues (0: none), `gains[j]` = the sum of the first j + 1
    path probabilities (the expected accepted drafts of verifying j + 1 of them; gains[-1] == score)."""

    tokens: list[int] = field(default_factory=list)
    score: float = 0.0
    match_len: int = 0
    gains: list[float] = field(default_factory=list)


class SuffixTree:
    """Sequences by id in one depth-bounded suffix trie (module docstring).

    Nodes are ids into flat lists of ints — its token, its count, its children (a dict token → id, None for a
    leaf) and its most frequent child (the largest (count, −token)) — so the garbage collector has no per-node
    objects to scan (a tree of objects made a batch of 16 requests several times slower).

    Attributes:
        max_depth: D, the longest path (1 ≤ D ≤ MAX_DEPTH).
        num_nodes: nodes besides the root (≤ tokens held × D).
        version: bumped by `remove` (node ids may be dropped and reused: matches taken before must be redone).
    """

    def __init__(self, max_depth: int) -> None:
        if not 1 <= max_depth <= MAX_DEPTH:
            raise ValueError(f"max_depth must be in [1, {MAX_DEPTH}], got {max_depth}")
        self.max_depth = max_depth
        self.version = 0
        self.token: list[int] = [-1]
        self.count: list[int] = [0]  # count[ROOT] = the tokens held
        self.children: list[dict[int, int] | None] = [None]
        self.best: list[int] = [_NONE]
        self._free: list[int] = []  # ids of dropped nodes, reused first
        self._seqs: dict[int, list[int]] = {}
        self._ends: dict[int, list[int]] = {}  # each sequence's suffix nodes, lengths 1..min(D, n)

    @property
    def num_nodes(self) -> int:
        return len(self.count) - 1 - len(self._free)

    def _new(self, token: int) -> int:
        if self._free:
            i = self._free.pop()
            self.token[i], self.count[i], self.children[i], self.best[i] = token, 0, None, _NONE
            return i
        self.token.append(token)
        self.count.append(0)
        self.children.append(None)
        self.best.append(_NONE)
        return len(self.count) - 1

    def best_child(self, node: int) -> int:
        """The child with the largest count (the smallest token among equal counts), or -1 for a leaf."""
        b = self.best[node]
        if b == _STALE:
            b, count, token = _NONE, self.count, self.token
            for c in (self.children[node] or {}).values():
                if b == _NONE or count[c] > count[b] or (count[c] == count[b] and token[c] < token[b]):
                    b = c
            self.best[node] = b
        return b

    def extend(self, seq_id: int, tokens: Sequence[int]) -> list[int]:
        """Append `tokens` to sequence `seq_id` (a new one when unseen).

        Returns:
            the nodes of the sequence's suffixes of length 1..min(D, n), shortest first: its matches in this tree
            (the tree's own list, replaced by the next call; do not modify it).
        """
        keep = self.max_depth - 1
        count, token, children, best = self.count, self.token, self.children, self.best
        ends = self._ends.get(seq_id, [])
        for t in tokens:
            new = []
            for node in (ROOT, *ends[:keep]):  # each suffix of length 0..D−1 gets child t (the hot loop, inlined)
                kids = children[node]
                if kids is None:
                    kids = children[node] = {}
                child = kids.get(t)
                if child is None:
                    if self._free:
                        child = kids[t] = self._new(t)
                    else:
                        child = kids[t] = len(count)
                        token.append(t)
                        count.append(0)
                        children.append(None)
                        best.append(_NONE)
                c = count[child] = count[child] + 1
                b = best[node]
                if b != child and b != _STALE and (b == _NONE or c > count[b] or (c == count[b] and t < token[b])):
                    best[node] = child
                new.append(child)
            ends = new
        count[ROOT] += len(tokens)
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
        count, children, best = self.count, self.children, self.best
        count[ROOT] -= len(seq)
        for start in range(len(seq)):
            node = ROOT
            for t in seq[start:start + self.max_depth]:
                siblings = children[node]
                assert siblings is not None  # the sequence was inserted: its path exists
                child = siblings[t]
                count[child] -= 1
                if best[node] == child:
                    best[node] = _STALE
                if count[child] == 0:
                    # Its only occurrence was this one, so its subtree is a chain of count-1 nodes: all dropped.
                    del siblings[t]
                    while child != _NONE:
                        kids = children[child]
                        self._free.append(child)
                        children[child] = None
                        child = next(iter(kids.values())) if kids else _NONE
                    break
                node = child

    def match(self, context: Sequence[int]) -> list[int]:
        """The nodes of context's suffixes of length 1..M, shortest first; M ≤ D the longest present (O(M²))."""
        ends: list[int] = []
        n, children = len(context), self.children
        for m in range(1, min(self.max_depth, n) + 1):
            node = ROOT
            for t in context[n - m:]:
                kids = children[node]
                node = kids.get(t, _NONE) if kids else _NONE
                if node == _NONE:
                    return ends
            ends.append(node)
        return ends

    def extend_match(self, ends: list[int], token: int) -> list[int]:
        """`match(context + [token])` from `ends` = `match(context)` in O(D) (valid while `version` is unchanged;
        a match taken before sequences were added may come out shorter than the longest present)."""
        new: list[int] = []
        children = self.children
        for node in (ROOT, *ends[:self.max_depth - 1]):
            kids = children[node]
            child = kids.get(token, _NONE) if kids else _NONE
            if child == _NONE:
                break
            new.append(child)
        return new

    def extend_match_all(self, ends: list[int], tokens: Sequence[int]) -> list[int]:
        """`extend_match` over each of `tokens` in turn."""
        for t in tokens:
            ends = self.extend_match(ends, t)
        return ends

    def propose(self, ends: Sequence[int], max_tokens: int, spec_factor: float, min_token_prob: float) -> Proposal:
        """The best speculation from matched nodes `ends` (ends[m − 1]: the node of the context's last m tokens).

        Greedy by frequency: from each node, the most frequent child while the path probability stays ≥
        min_token_prob, at most min(max_tokens, ⌊spec_factor · m⌋) tokens. Longest match first; a shorter match
        must score strictly better, and one whose budget cannot stops the search.
        """
        best = Proposal()
        count, token, children = self.count, self.token, self.children
        for m in range(len(ends), 0, -1):
            budget = min(max_tokens, int(m * spec_factor + 1e-6))
            if budget <= best.score:  # a score is at most its budget, and budgets shrink with m
                break
            tokens: list[int] = []
            gains: list[float] = []
            node, prob, score = ends[m - 1], 1.0, 0.0
            while len(tokens) < budget and children[node]:
                child = self.best_child(node)
                if child == _NONE:
                    break
                prob *= count[child] / count[node]
                if prob < min_token_prob:
                    break
                tokens.append(token[child])
                score += prob
                gains.append(score)
                node = child
            if score > best.score:
                best = Proposal(tokens, score, m, gains)
        return best


class _View:
    """Read-only `view[node]` over the C++ trie (its `count`, `token` and `children` lists, as the reference has
    them)."""

    __slots__ = ("_get",)

    def __init__(self, get) -> None:
        self._get = get

    def __getitem__(self, node: int):
        return self._get(node)


class NativeSuffixTree:
    """`SuffixTree`'s interface over nextn's C++ trie (plugins/suffix_tree_cpu.cpp): the same node ids, counts,
    matches and proposals for the same calls, at a fraction of the host time.

    Raises:
        ValueError: max_depth outside [1, MAX_DEPTH]; RuntimeError: the extension is unavailable
            (`plugins.suffix_tree_native.unavailable_reason()`).
    """

    __slots__ = ("_t", "extend", "close", "remove", "match", "extend_match", "extend_match_all", "best_child")

    def __init__(self, max_depth: int) -> None:
        from nextn.plugins.suffix_tree_native import native_module, unavailable_reason

        if not 1 <= max_depth <= MAX_DEPTH:
            raise ValueError(f"max_depth must be in [1, {MAX_DEPTH}], got {max_depth}")
        module = native_module()
        if module is None:
            raise RuntimeError(f"the C++ suffix tree is unavailable: {unavailable_reason()}")
        t = self._t = module.SuffixTreeCpu(max_depth)
        # the extension's bound methods as attributes: no Python frame on the drafter's per-token calls
        self.extend, self.close, self.remove = t.extend, t.close, t.remove
        self.match, self.extend_match, self.best_child = t.match, t.extend_match, t.best_child
        self.extend_match_all = t.extend_match_all

    @property
    def max_depth(self) -> int:
        return self._t.max_depth

    @property
    def version(self) -> int:
        return self._t.version

    @property
    def num_nodes(self) -> int:
        return self._t.num_nodes

    @property
    def count(self) -> _View:
        """count[node]: the node's count, as the reference's list (read-only; the root's: the tokens held)."""
        return _View(self._t.count)

    @property
    def token(self) -> _View:
        """token[node]: the token on the edge into the node, as the reference's list (read-only)."""
        return _View(self._t.token)

    @property
    def children(self) -> _View:
        """children[node]: {token: child} or None for a leaf, as the reference's list (a copy, read-only)."""
        return _View(lambda node: dict(self._t.children(node)) or None)

    def propose(self, ends: Sequence[int], max_tokens: int, spec_factor: float, min_token_prob: float) -> Proposal:
        tokens, score, match_len, gains = self._t.propose(ends, max_tokens, spec_factor, min_token_prob)
        return Proposal(tokens, score, match_len, gains)


def new_suffix_tree(max_depth: int) -> SuffixTree | NativeSuffixTree:
    """A trie of depth `max_depth`: the C++ one where its extension builds here (chosen once per process), else
    the Python reference."""
    from nextn.plugins.suffix_tree_native import native_module

    return NativeSuffixTree(max_depth) if native_module() is not None else SuffixTree(max_depth)


class OutputCache:
    """Earlier requests' outputs in one SuffixTree, first in first out: at most `max_requests` outputs and, past
    `max_nodes` nodes, the oldest evicted down to the newest one (0 requests: off, nothing is kept).

    Attributes:
        tree: the shared tree; its `version` changes with each eviction.
    """

    def __init__(self, max_depth: int, max_requests: int, max_nodes: int = 1 << 20) -> None:
        self.tree = new_suffix_tree(max_depth)
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
