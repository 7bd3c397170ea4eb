"""The prefix cache's parts without a model: the hash chain (tokens, parent, look-ahead, salt), reference counts,
the LRU of unreferenced cached blocks and eviction under pressure, and the scheduler's admission and registration
rules (full blocks only, the last 1 + overlap positions always computed, the drafter's rewrite lag and gaps)."""

from __future__ import annotations

import pytest

from nextn.runtime.kv_cache import BlockPool
from nextn.runtime.prefix_cache import PrefixCache, hash_block, root_hash
from nextn.runtime.request import Request
from nextn.runtime.sampling_params import SamplingParams
from nextn.runtime.scheduler import Scheduler, SchedulerLimits
from nextn.speculative.setup import DraftSchedule
from nextn.speculative.traits import DraftKV

B = 4


def _pool(num_blocks: int = 9, lookahead: int = 0) -> BlockPool:
    return BlockPool(num_blocks, B, PrefixCache(B, "test", lookahead))


def _request(tokens: list[int], rid: int = 0) -> Request:
    return Request(rid, None, list(tokens), SamplingParams(max_tokens=8, ignore_eos=True), frozenset())


def test_keys_chain_tokens_parent_lookahead_and_salt():
    root = root_hash("a")
    assert hash_block(root, [1, 2, 3, 4]) == hash_block(root_hash("a"), [1, 2, 3, 4])
    assert hash_block(root, [1, 2, 3, 4]) != hash_block(root_hash("b"), [1, 2, 3, 4])  # engine, dtype, drafter
    assert hash_block(root, [1, 2, 3, 4]) != hash_block(root, [1, 2, 3, 5])
    assert hash_block(root, [1, 2, 3, 4], [9]) != hash_block(root, [1, 2, 3, 4], [8])  # the MTP look-ahead
    assert hash_block(root, [1, 2], [3, 4]) != hash_block(root, [1, 2, 3, 4])  # tokens and look-ahead apart
    cache = PrefixCache(B, "s", lookahead=1)
    a = cache.extend_hashes([], list(range(10)), 2)
    b = cache.extend_hashes([], [0, 1, 2, 3, 9, 5, 6, 7, 8, 9], 2)
    assert a[0] != b[0] and a[1] != b[1]  # block 0's look-ahead token differs, and block 1 chains on it
    assert cache.num_keyed_blocks(8) == 1 and cache.num_keyed_blocks(9) == 2  # a block needs its look-ahead
    with pytest.raises(ValueError, match="key only 1 blocks"):
        cache.extend_hashes([], list(range(8)), 2)


def test_refcounts_lru_and_eviction_under_pressure():
    pool = _pool(num_blocks=5)  # 4 usable blocks
    cache = pool.cache
    a: list[int] = []
    assert pool.grow(a, 3 * B)
    keys = cache.extend_hashes([], list(range(3 * B)), 3)
    for block, key in zip(a, keys):
        assert cache.register(block, key)
    blocks = list(a)
    b: list[int] = []
    assert pool.admit(b, cache.lookup(keys[:2]), 3 * B)  # shares 2, one new block
    assert b[:2] == blocks[:2] and [pool.num_refs(x) for x in blocks] == [2, 2, 1]
    assert pool.num_free == 0 and not pool.grow([], 1)
    pool.free(a)
    assert [pool.num_refs(x) for x in blocks] == [1, 1, 0] and cache.num_evictable == 1 and pool.num_free == 1
    assert cache.lookup(keys) == blocks  # the unreferenced block keeps its key: still a hit
    pool.free(b)
    assert pool.num_free == 4 and cache.num_evictable == 3  # b's own last block had no key: free list
    c: list[int] = []
    assert pool.grow(c, 2 * B)  # the free block first, then the least recently used cached block: a's tail
    assert blocks[2] in c and cache.stats.evicted_blocks == 1 and cache.lookup(keys) == blocks[:2]
    assert not cache.is_cached(blocks[2])


def test_reset_forgets_every_key():
    pool = _pool(num_blocks=5)
    a: list[int] = []
    b: list[int] = []
    pool.grow(a, 2 * B)
    pool.grow(b, B)
    keys = pool.cache.extend_hashes([], list(range(3 * B)), 3)
    for block, key in zip(a + b, keys):
        pool.cache.register(block, key)
    pool.free(a)
    pool.reset_prefix_cache()
    assert pool.cache.lookup(keys) == [] and pool.cache.num_evictable == 0 and pool.num_free == 3
    pool.free(b)  # a referenced block lost its key: back to the free list when released
    assert pool.num_free == 4 and pool.cache.cached_blocks == {}


def test_admit_that_does_not_fit_changes_nothing():
    pool = _pool(num_blocks=4)  # 3 usable
    cache = pool.cache
    a: list[int] = []
    pool.grow(a, 2 * B)
    keys = cache.extend_hashes([], list(range(2 * B)), 2)
    for block, key in zip(a, keys):
        cache.register(block, key)
    pool.free(a)
    table: list[int] = []
    # 2 parked hits + 2 new blocks > 3 usable (the hits cannot also be evicted for the new ones)
    assert not pool.admit(table, cache.lookup(keys), 4 * B)
    assert table == [] and cache.num_evictable == 2 and pool.num_free == 3
    assert pool.admit(table, cache.lookup(keys), 3 * B) and pool.num_free == 0


def test_registration_of_the_same_content_twice_keeps_one_copy():
    pool = _pool()
    cache = pool.cache
    a: list[int] = []
    b: list[int] = []
    pool.grow(a, B)
    pool.grow(b, B)
    key = cache.extend_hashes([], [1, 2, 3, 4], 1)[0]
    assert cache.register(a[0], key) and not cache.register(b[0], key)
    blocks = a + b
    pool.free(b)
    pool.free(a)
    assert cache.num_evictable == 1 and cache.lookup([key]) == blocks[:1] and pool.num_free == 8


def test_without_a_cache_the_pool_is_a_free_list():
    pool = BlockPool(5, B)
    t: list[int] = []
    assert pool.grow(t, 4 * B) and pool.num_free == 0
    pool.free(t)
    assert pool.num_free == 4 and t == []


def _next_prefill(sched: Scheduler):
    """The next prefill batch (a decode step of the running requests comes first after a prefill)."""
    batch = sched.schedule()
    return sched.schedule() if batch.kind == "decode" else batch


def _run_prefill(sched: Scheduler, req: Request) -> None:
    """Schedule and 'process' whole prefills (as the engine does after a step): computed = the chunk end."""
    batch = sched.schedule()
    assert batch is not None and batch.kind == "prefill"
    for r, end in zip(sched.requests_of(batch), batch.chunk_ends):
        r.progress.num_computed_tokens = end
        sched.cache_blocks(r)


@pytest.mark.parametrize("overlap,lookahead", [(0, 0), (0, 1), (3, 3)])
def test_admission_reuses_full_blocks_and_computes_the_last_positions(overlap, lookahead):
    pool = _pool(num_blocks=30, lookahead=lookahead)
    sched = Scheduler(pool, SchedulerLimits(4, 64), DraftSchedule(num_draft_tokens=3, rerun_rows=overlap))
    first = _request(list(range(100, 118)))  # 18 tokens: 4 full blocks
    sched.add(first)
    _run_prefill(sched, first)
    final = 18 - overlap  # Vanilla's last K positions may still be rewritten
    keyed = min(final // B, (18 - lookahead) // B)
    assert first.progress.num_committed_blocks == keyed and len(pool.cache.cached_blocks) == keyed
    second = _request(list(range(100, 118)) + [7, 8], rid=1)  # extends the first prompt
    sched.add(second)
    batch = _next_prefill(sched)
    n = 20
    hit = min(keyed, (n - 1 - overlap) // B, (n - lookahead) // B)
    assert batch.chunk_starts == (hit * B,) and batch.num_reused == (hit * B,) and second.num_cached_tokens == hit * B
    assert n - batch.chunk_starts[0] >= 1 + overlap  # the first token's logits; Vanilla's K+1 hidden states
    assert second.block_table[:hit] == first.block_table[:hit]
    assert all(pool.num_refs(b) == 2 for b in second.block_table[:hit])
    assert pool.cache.stats.hits == hit * B and pool.cache.stats.queries == 18 + 20


def test_a_partial_block_is_never_shared():
    pool = _pool(num_blocks=30)
    sched = Scheduler(pool, SchedulerLimits(4, 64))
    first = _request(list(range(100, 110)))  # 2 full blocks + 2 tokens
    sched.add(first)
    _run_prefill(sched, first)
    assert first.progress.num_committed_blocks == 2
    second = _request(list(range(100, 110)) + [1], rid=1)
    sched.add(second)
    assert _next_prefill(sched).chunk_starts == (2 * B,)  # positions 8, 9 are recomputed into its own block
    assert second.block_table[2] != first.block_table[2]


def test_no_blocks_registered_past_a_step_without_the_drafter():
    pool = _pool(num_blocks=30)
    sched = Scheduler(pool, SchedulerLimits(4, 64), DraftSchedule(num_draft_tokens=2, kv=DraftKV.FROM_HIDDEN))
    req = _request(list(range(100, 106)))
    sched.add(req)
    _run_prefill(sched, req)
    req.output_token_ids = [1]
    req.progress.prefill_done = True
    assert req.progress.num_committed_blocks == 1
    # speculation off: a step without the drafter
    sched.draft_len_policy.draft_len = lambda batch_size, request_ids=(): 0
    assert not sched.schedule().drafting and req.progress.drafter_gap == req.kv_len == 6
    req.output_token_ids += list(range(10))
    req.progress.num_computed_tokens = req.kv_len
    sched.cache_blocks(req)
    assert req.progress.num_committed_blocks == 1  # block 1 (positions 4..7) holds a position decoded without the drafter
