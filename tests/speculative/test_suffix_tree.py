"""The suffix trie of suffix decoding against a brute-force reference on random sequences: every path's count, the
longest context match (from scratch and incrementally), the proposals (Arctic's rule: every match length tried,
the best score, ties to the longer match), removal and the output cache's FIFO eviction; sizes stay bounded. The C++ trie (plugins/suffix_tree_cpu.cpp) against
the Python one, operation for operation."""

from __future__ import annotations

import random
from collections import Counter

import pytest

from nextn.speculative.suffix_tree import MAX_DEPTH, ROOT, NativeSuffixTree, OutputCache, SuffixTree, new_suffix_tree


def ref_counts(seqs: list[list[int]], depth: int) -> Counter:
    """Occurrences of every path of length 1..depth (counted at the position where it ends)."""
    counts: Counter = Counter()
    for seq in seqs:
        for end in range(len(seq)):
            for length in range(1, min(depth, end + 1) + 1):
                counts[tuple(seq[end - length + 1:end + 1])] += 1
    return counts


def tree_counts(tree: SuffixTree) -> Counter:
    counts: Counter = Counter()
    stack = [((), ROOT)]
    while stack:
        path, node = stack.pop()
        for t, child in (tree.children[node] or {}).items():
            assert tree.token[child] == t
            counts[path + (t,)] = tree.count[child]
            stack.append((path + (t,), child))
    return counts


def ref_longest_match(counts: Counter, context: list[int], depth: int) -> int:
    m = 0
    while m < min(depth, len(context)) and counts[tuple(context[len(context) - m - 1:])] > 0:
        m += 1
    return m


def ref_propose(counts: Counter, context: list[int], depth: int, k: int, factor: float, min_prob: float):
    """Arctic's rule, written plainly: for each match length m = 1..M, follow the child of the largest (count,
    −token) while the path probability stays ≥ min_prob, at most min(k, ⌊factor·m⌋) tokens; keep the best score,
    later (longer) matches winning ties."""
    best = ([], 0.0, 0)
    for m in range(1, ref_longest_match(counts, context, depth) + 1):
        path = tuple(context[len(context) - m:])
        budget = min(k, int(m * factor + 1e-6))
        prob, score, tokens = 1.0, 0.0, []
        while len(tokens) < budget:
            kids = [(counts[path + (x,)], -x) for x in range(VOCAB) if len(path) < depth and counts[path + (x,)]]
            if not kids:
                break
            c, neg = max(kids)
            prob *= c / counts[path]
            if prob < min_prob:
                break
            tokens.append(-neg)
            score += prob
            path += (-neg,)
        if tokens and score >= best[1]:
            best = (tokens, score, m)
    return best


VOCAB = 6


def random_seq(rng: random.Random, n: int) -> list[int]:
    """Small vocabularies and copied spans: many repeated paths."""
    seq = [rng.randrange(VOCAB) for _ in range(3)]
    while len(seq) < n:
        if rng.random() < 0.5 and len(seq) > 4:
            start = rng.randrange(len(seq) - 2)
            seq += seq[start:start + rng.randint(2, 8)]
        else:
            seq.append(rng.randrange(rng.choice([2, VOCAB])))
    return seq[:n]


@pytest.mark.parametrize("depth", [1, 3, 8])
def test_counts_and_sizes_equal_the_reference(depth):
    rng = random.Random(depth)
    tree, seqs = SuffixTree(depth), {}
    for step in range(60):  # tokens appended to several sequences in interleaved pieces
        sid = rng.randrange(4)
        piece = random_seq(rng, rng.randint(1, 6))
        ends = tree.extend(sid, piece)
        seqs.setdefault(sid, []).extend(piece)
        seq = seqs[sid]
        assert [tree.count[n] for n in ends] == [ref_counts(list(seqs.values()), depth)[tuple(seq[-m:])]
                                          for m in range(1, min(depth, len(seq)) + 1)]
    want = ref_counts(list(seqs.values()), depth)
    assert tree_counts(tree) == want
    assert tree.num_nodes == len(want) <= sum(map(len, seqs.values())) * depth
    assert tree.count[ROOT] == sum(map(len, seqs.values()))


@pytest.mark.parametrize("depth", [2, 5, 12])
def test_matches_and_proposals_equal_the_reference(depth):
    rng = random.Random(100 + depth)
    for trial in range(25):
        seqs = [random_seq(rng, rng.randint(1, 40)) for _ in range(rng.randint(1, 3))]
        tree = SuffixTree(depth)
        for i, s in enumerate(seqs):
            tree.extend(i, s)
        counts = ref_counts(seqs, depth)
        context = random_seq(rng, rng.randint(1, 20))
        ends = tree.match(context)
        assert len(ends) == ref_longest_match(counts, context, depth)
        assert [tree.count[n] for n in ends] == [counts[tuple(context[-m:])] for m in range(1, len(ends) + 1)]
        for k, factor, min_prob in [(4, 1.0, 0.1), (6, 0.5, 0.0), (3, 2.0, 0.4), (8, 1.0, 0.9)]:
            got = tree.propose(ends, k, factor, min_prob)
            tokens, score, m = ref_propose(counts, context, depth, k, factor, min_prob)
            assert (got.tokens, got.match_len) == (tokens, m), (seqs, context, k, factor, min_prob)
            assert got.score == pytest.approx(score)


def test_incremental_match_equals_a_fresh_match():
    rng = random.Random(7)
    tree = SuffixTree(6)
    for i in range(3):
        tree.extend(i, random_seq(rng, 50))
    context, ends = [], []
    for t in random_seq(rng, 80):
        context.append(t)
        ends = tree.extend_match(ends, t)
        assert ends == tree.match(context)


def test_a_proposal_follows_the_most_frequent_continuation():
    tree = SuffixTree(8)
    tree.extend(0, [1, 2, 3, 9, 1, 2, 3, 9, 1, 2, 4])
    ends = tree.match([5, 1, 2])  # "1 2" → 3 (twice) or 4 (once); then "3" → 9
    p = tree.propose(ends, 4, 1.0, 0.1)
    assert p.match_len == 2 and p.tokens == [3, 9]  # a 2-token match drafts at most 2 (spec factor 1)
    assert p.score == pytest.approx(2 / 3 + 2 / 3)
    assert tree.propose(ends, 4, 2.0, 0.1).tokens == [3, 9, 1, 2]
    assert tree.propose(ends, 4, 2.0, 0.7).tokens == []  # 2/3 < 0.7
    assert tree.propose(tree.match([7]), 4, 1.0, 0.0).tokens == []  # no match


def test_removal_restores_the_counts_of_the_others():
    rng = random.Random(3)
    depth = 5
    seqs = {i: random_seq(rng, rng.randint(5, 60)) for i in range(6)}
    tree = SuffixTree(depth)
    for i, s in seqs.items():
        tree.extend(i, s)
        tree.close(i)
    for i in (2, 0, 5):
        version = tree.version
        tree.remove(i)
        del seqs[i]
        assert tree.version > version
        want = ref_counts(list(seqs.values()), depth)
        assert tree_counts(tree) == want and tree.num_nodes == len(want)
        for _ in range(10):  # the most frequent child is recomputed where a removal changed it
            context = random_seq(rng, 8)
            got = tree.propose(tree.match(context), 4, 1.0, 0.0)
            assert (got.tokens, got.match_len) == ref_propose(want, context, depth, 4, 1.0, 0.0)[::2]
    for i in list(seqs):
        tree.remove(i)
    assert tree.num_nodes == 0 and tree.count[ROOT] == 0 and not tree.children[ROOT]


def test_output_cache_evicts_the_oldest_outputs():
    rng = random.Random(11)
    cache = OutputCache(max_depth=4, max_requests=3)
    outs = [random_seq(rng, rng.randint(3, 30)) for _ in range(7)]
    for i, out in enumerate(outs):
        cache.add([out[:2], out[2:]] if i % 2 else [out])  # an output in two runs (a gap between them)
        kept = outs[max(0, i - 2):i + 1]
        runs = [r for j, o in enumerate(kept, max(0, i - 2)) for r in ([o[:2], o[2:]] if j % 2 else [o])]
        assert len(cache) == len(kept) and tree_counts(cache.tree) == ref_counts(runs, 4)
    off = OutputCache(max_depth=4, max_requests=0)
    off.add([outs[0]])
    assert len(off) == 0 and off.tree.num_nodes == 0


def test_output_cache_evicts_beyond_its_node_bound():
    rng = random.Random(5)
    cache = OutputCache(max_depth=8, max_requests=100, max_nodes=500)
    for _ in range(20):
        cache.add([[rng.randrange(1000) for _ in range(40)]])  # ~ 40·8 new nodes each
        assert cache.tree.num_nodes <= 500 or len(cache) == 1
    assert 1 <= len(cache) < 20


def test_depth_is_bounded():
    with pytest.raises(ValueError, match="max_depth"):
        SuffixTree(MAX_DEPTH + 1)
    with pytest.raises(ValueError, match="max_depth"):
        SuffixTree(0)


def test_the_cpp_trie_equals_the_python_one_operation_for_operation():
    """Random extends, closes, removals (node ids freed and reused), matches, extended matches and proposals at
    several depths, spec factors and probability floors: identical results, node ids, counts, sizes, versions."""
    from nextn.plugins.suffix_tree_native import native_module, unavailable_reason

    if native_module() is None:
        pytest.skip(f"the C++ suffix tree did not build here: {unavailable_reason()}")
    rng = random.Random(0)
    for trial in range(12):
        depth = rng.choice([1, 2, 4, 8, 24])
        ref, cpp = SuffixTree(depth), NativeSuffixTree(depth)
        live, done = [], set()
        for _ in range(150):
            r = rng.random()
            if r < 0.6 or not live:
                sid = rng.randrange(12)
                if sid not in done:
                    tokens = [rng.randrange(6) for _ in range(rng.randint(1, 10))]
                    assert ref.extend(sid, tokens) == cpp.extend(sid, tokens)
                    live += [sid] if sid not in live else []
            else:
                sid = live.pop(rng.randrange(len(live)))
                done.add(sid)
                (ref.remove if r < 0.85 else ref.close)(sid)
                (cpp.remove if r < 0.85 else cpp.close)(sid)
            context = [rng.randrange(6) for _ in range(rng.randint(0, 30))]
            ends = ref.match(context)
            assert cpp.match(context) == ends
            token = rng.randrange(6)
            assert cpp.extend_match(ends, token) == ref.extend_match(ends, token)
            args = (rng.randint(1, 16), rng.choice([0.5, 1.0, 2.0]), rng.choice([0.0, 0.1, 0.3]))
            assert cpp.propose(ends, *args) == ref.propose(ends, *args)
            assert (cpp.num_nodes, cpp.version) == (ref.num_nodes, ref.version)
            assert [cpp.count[n] for n in (ROOT, *ends)] == [ref.count[n] for n in (ROOT, *ends)]
    assert isinstance(new_suffix_tree(4), NativeSuffixTree)


def test_without_the_extension_the_python_trie_is_used(monkeypatch):
    import nextn.plugins.suffix_tree_native as native

    monkeypatch.setattr(native, "native_module", lambda: None)
    assert type(new_suffix_tree(4)) is SuffixTree and type(OutputCache(4, 2).tree) is SuffixTree
