"""The paged KV cache: a block pool on the host and one cache tensor on the device.

Block 0 is the null block: never handed out, it absorbs the KV writes of padded tokens. A request owns an ordered
list of blocks (its block table); slot = block · block_size + offset. The MTP layers page through the same blocks
as the target (one tensor, one row per layer), and a draft model's KV tensor is addressed by the same block ids.

With prefix caching (`kv_cache_config.enable_block_reuse`, runtime/prefix_cache.py) blocks are reference-counted:
a full block whose content is final may hold a key and be shared read-only by several requests; when its last
reference goes it is parked in the cache's LRU instead of the free list, still findable, and evicted (its key
forgotten) only when an allocation finds the free list empty.

Where sliding-window and full-attention layers mix, the cache rows only sliding layers read have blocks of their own
for the pool blocks within a window (`attach_sliding`, runtime/sliding_blocks.py); the pool tells them when a block
is freed or its key evicted.
"""

from __future__ import annotations

from collections import deque

import torch

from nextn.runtime.prefix_cache import PrefixCache
from nextn.runtime.sliding_blocks import SlidingBlocks

NULL_BLOCK = 0


class KVCacheFullError(RuntimeError):
    """A request can never fit in the KV cache, even alone."""


class BlockPool:
    """Allocator of KV blocks (host side): a free list, reference counts, and the prefix cache when reuse is on.

    Args:
        num_blocks: blocks of the cache tensor, the null block included (≥ 2).
        block_size: tokens per block.
        prefix_cache: the prefix cache (None: no reuse; every freed block goes back to the free list).
    Raises:
        ValueError: fewer than 2 blocks.
    """

    def __init__(self, num_blocks: int, block_size: int, prefix_cache: PrefixCache | None = None) -> None:
        if num_blocks < 2:
            raise ValueError("the KV cache needs at least 2 blocks (block 0 is reserved)")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.cache = prefix_cache
        self._free: deque[int] = deque(range(1, num_blocks))
        self._refs = [0] * num_blocks
        self.sliding: SlidingBlocks | None = None  # a model mixing sliding and full layers (`attach_sliding`)

    def attach_sliding(self, num_blocks: int, window: int) -> SlidingBlocks:
        """Give the sliding-window layers' cache rows their own `num_blocks` blocks (runtime/sliding_blocks.py)."""
        cached = self.cache.is_cached if self.cache is not None else (lambda block: False)
        self.sliding = SlidingBlocks(num_blocks, self.num_blocks, window, self.block_size, cached)
        return self.sliding

    @property
    def num_free(self) -> int:
        """Blocks an allocation can take now: never-used or released blocks plus unreferenced cached ones."""
        return len(self._free) + (self.cache.num_evictable if self.cache is not None else 0)

    @property
    def capacity_tokens(self) -> int:
        """Tokens one sequence could hold with every usable block."""
        return (self.num_blocks - 1) * self.block_size

    def blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def num_refs(self, block: int) -> int:
        """Requests whose block table holds `block` now."""
        return self._refs[block]

    def grow(self, table: list[int], num_tokens: int) -> bool:
        """Extend `table` in place to cover `num_tokens`; False (and no change) when the pool is short.

        New blocks come from the free list first, then by evicting the least recently used cached block.
        """
        need = self.blocks_for(num_tokens) - len(table)
        if need <= 0:
            return True
        if need > self.num_free:
            return False
        for _ in range(need):
            block = self._free.popleft() if self._free else self._evict()
            self._refs[block] = 1
            table.append(block)
        return True

    def admit(self, table: list[int], cached: list[int], num_tokens: int) -> bool:
        """Give an empty `table` the shared blocks `cached` (a prefix-cache hit, in order) and new blocks up to
        `num_tokens`; False and no change when the pool is short.

        Raises:
            ValueError: `table` is not empty.
        """
        if table:
            raise ValueError("admit needs an empty block table")
        parked = sum(1 for b in cached if self._refs[b] == 0)  # taking them makes them unevictable
        if self.blocks_for(num_tokens) - len(cached) > self.num_free - parked:
            return False
        for block in cached:
            if self._refs[block] == 0:
                self.cache.unpark(block)  # type: ignore[union-attr]
            self._refs[block] += 1
            table.append(block)
        return self.grow(table, num_tokens)

    def reset_prefix_cache(self) -> None:
        """Drop every cached block's key (a benchmark's cold start); no-op without a prefix cache."""
        if self.cache is not None:
            self._free.extend(self.cache.clear())
            if self.sliding is not None:
                self.sliding.forget_idle()  # the parked blocks' and those of blocks behind every window

    def free(self, table: list[int]) -> None:
        """Drop `table`'s references (and clear it). A block left unreferenced goes to the LRU when it holds a key
        (tail blocks first, so that a prefix outlives its continuations), else to the free list."""
        if self.sliding is not None:
            self.sliding.drop(table)
        for block in reversed(table):
            self._drop(block)
        table.clear()

    def release_prefix(self, table: list[int], num_blocks: int) -> int:
        """Drop the references of `table`'s first `num_blocks` entries (blocks no query will read again: behind a
        sliding window), leaving the null block in their place; returns the blocks released now."""
        released = 0
        for i in range(min(num_blocks, len(table)) - 1, -1, -1):  # newest first: earlier ones went already
            if table[i] == NULL_BLOCK:
                break
            self._drop(table[i])
            table[i] = NULL_BLOCK
            released += 1
        return released

    def _drop(self, block: int) -> None:
        if block == NULL_BLOCK:  # a released entry of a table (`release_prefix`)
            return
        self._refs[block] -= 1
        if self._refs[block] > 0:
            return
        if self.cache is not None and self.cache.is_cached(block):
            self.cache.park(block)
        else:
            self._free.append(block)
            if self.sliding is not None:
                self.sliding.forget(block)

    def _evict(self) -> int:
        block = self.cache.evict()  # type: ignore[union-attr]
        if self.sliding is not None:
            self.sliding.forget(block)
        return block
