"""Prefix caching: full KV blocks found again by the hash chain of their tokens, shared read-only between requests.

Sources (facts only, no code): vLLM's automatic prefix caching (a block is identified by the hash of its parent
block's hash and its own tokens plus "extra keys"; blocks no request references stay cached in an LRU free queue
and are evicted only when a new block is needed; only full blocks are cached) and TensorRT-LLM's
`KvCacheConfig.enable_block_reuse` (on by default).

What makes a block's content here (the key of block i, `hash_block`):
- the engine: a salt over the checkpoint fingerprint, the KV dtype and the drafter (so two engines, or a bf16 and
  an fp32 cache, never share a key);
- every token before and in the block (the parent hash chains them);
- the drafter's **look-ahead**: an MTP module's KV at position p pairs embed(x_{p+1}) with the target's hidden state
  at p, so a block's last MTP row depends on the first token of the *next* block (MTP Eagle: 1 token); MTP
  Vanilla's module k depends on x_{p+k} (K tokens). Those tokens are part of the key, so a request whose
  continuation differs never reads a module row computed from another continuation. The target's KV and a draft
  model's KV depend on tokens ≤ p only (look-ahead 0).

When a block may be registered (the scheduler's rule, `Scheduler.cache_blocks`): every row of it, target and
drafter, is final and no later step of its request can write it — positions below the request's computed length
minus the drafter's rewrite lag (MTP Vanilla re-runs its modules over the last K positions: lag K), and below the
first position decoded while speculation was off (those steps run without the drafter, leaving its KV unwritten).
A hit is then exactly what a fresh prefill would compute (up to float rounding), so the drafter state follows the
target's for MTP Eagle, MTP Vanilla and the draft model; the n-gram drafter's token history is rebuilt from the
reused tokens (`Drafter.load_prefix`); Medusa keeps no KV.

The pool side (reference counts, which block goes where when freed) is `kv_cache.BlockPool`.
"""

from __future__ import annotations

import hashlib
from array import array
from collections import OrderedDict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

BlockHash = bytes  # SHA-256 digest (32 bytes)


def root_hash(salt: str) -> BlockHash:
    """The parent hash of a sequence's first block: everything besides tokens that changes KV content."""
    return hashlib.sha256(b"nextn-prefix-cache/1\x00" + salt.encode()).digest()


def hash_block(parent: BlockHash, tokens: Sequence[int], lookahead: Sequence[int] = ()) -> BlockHash:
    """The key of one full block: SHA-256 over the parent's key, the block's token ids and the look-ahead tokens.

    Args:
        parent: the previous block's key (`root_hash` for the first block).
        tokens: the block's token ids (tokens_per_block of them).
        lookahead: the tokens after the block that its drafter KV depends on (may be empty).
    Returns:
        32 bytes. SHA-256 rather than Python's `hash`: a collision would silently hand one request another's KV.
    """
    h = hashlib.sha256(parent)
    h.update(array("q", tokens).tobytes())
    h.update(b"|")
    h.update(array("q", lookahead).tobytes())
    return h.digest()


@dataclass
class PrefixCacheStats:
    """Cumulative counters (vLLM's `prefix_cache_queries` / `prefix_cache_hits`: tokens, not requests).

    Attributes:
        queries: prompt tokens looked up at admissions (a preempted request counts again when re-admitted).
        hits: of them, tokens whose KV was reused.
        evicted_blocks: cached blocks whose content was dropped to make room.
    """

    queries: int = 0
    hits: int = 0
    evicted_blocks: int = 0

    @property
    def hit_rate(self) -> float:
        """hits / queries (0 before any query)."""
        return self.hits / self.queries if self.queries else 0.0


class PrefixCache:
    """Which physical block holds which key, and the LRU order of the cached blocks no request references.

    Args:
        block_size: tokens per block.
        salt: engine identity (`root_hash`).
        lookahead: tokens after a block that belong to its key (the drafter's KV dependency, see module docstring).
    """

    def __init__(self, block_size: int, salt: str = "", lookahead: int = 0) -> None:
        if lookahead < 0:
            raise ValueError(f"lookahead must be ≥ 0, got {lookahead}")
        self.block_size = block_size
        self.lookahead = lookahead
        self.root = root_hash(salt)
        self.stats = PrefixCacheStats()
        self._block_of: dict[BlockHash, int] = {}
        self._hash_of: dict[int, BlockHash] = {}
        self._lru: OrderedDict[int, None] = OrderedDict()  # unreferenced cached blocks, least recently used first
        self._no_drafter_kv: set[int] = set()  # cached blocks whose drafter KV was never written (`register`)

    # Keys ----------------------------------------------------------------------------------------------------
    def num_keyed_blocks(self, num_tokens: int) -> int:
        """Leading full blocks of a `num_tokens` sequence whose key is known (their look-ahead tokens exist)."""
        return max(0, (num_tokens - self.lookahead) // self.block_size)

    def extend_hashes(self, hashes: list[BlockHash], tokens: Sequence[int], num_blocks: int) -> list[BlockHash]:
        """Append to `hashes` (a request's chain so far) the keys of its blocks up to `num_blocks`; returns it.

        Raises:
            ValueError: `tokens` too short for `num_blocks` keys (fewer than num_blocks · block_size + lookahead).
        """
        if num_blocks > self.num_keyed_blocks(len(tokens)):
            raise ValueError(f"{len(tokens)} tokens key only {self.num_keyed_blocks(len(tokens))} blocks, "
                             f"not {num_blocks}")
        b, a = self.block_size, self.lookahead
        for i in range(len(hashes), num_blocks):
            parent = hashes[i - 1] if i else self.root
            hashes.append(hash_block(parent, tokens[i * b:(i + 1) * b], tokens[(i + 1) * b:(i + 1) * b + a]))
        return hashes

    # Blocks --------------------------------------------------------------------------------------------------
    def lookup(self, hashes: Sequence[BlockHash]) -> list[int]:
        """The physical blocks of the longest run of leading keys that are cached (referenced or not)."""
        blocks = []
        for h in hashes:
            block = self._block_of.get(h)
            if block is None:
                break
            blocks.append(block)
        return blocks

    def register(self, block: int, key: BlockHash, drafter_kv: bool = True) -> bool:
        """Record that `block` (referenced, its content final) holds `key`; `drafter_kv` False: its target KV is
        final but its drafter's KV was never written (a draft model that skipped these positions while speculation
        was off; a hit must have the drafter catch them up, `lacks_drafter_kv`).

        Returns:
            False when the key is already held by another block (two requests computed the same prefix at once:
            this copy stays private and is freed as usual) or the block already holds a key.
        """
        if key in self._block_of or block in self._hash_of:
            return False
        self._block_of[key] = block
        self._hash_of[block] = key
        if not drafter_kv:
            self._no_drafter_kv.add(block)
        return True

    def caught_up(self, blocks: Iterable[int]) -> int:
        """The drafter's KV of these cached `blocks` is written now (a step catching a request's drafter up over
        them was planned; steps run in order, so any later hit reads it after it is written): hits no longer catch
        them up again. Blocks not cached or not lacking it are skipped. Returns how many marks were cleared."""
        marked = [b for b in blocks if b in self._no_drafter_kv]
        self._no_drafter_kv.difference_update(marked)
        return len(marked)

    def lacks_drafter_kv(self, block: int) -> bool:
        """Whether cached `block` was registered without its drafter's KV."""
        return block in self._no_drafter_kv

    def is_cached(self, block: int) -> bool:
        return block in self._hash_of

    def key_of(self, block: int) -> BlockHash | None:
        return self._hash_of.get(block)

    @property
    def cached_blocks(self) -> dict[int, BlockHash]:
        """Every block holding a key (a copy), referenced or not."""
        return dict(self._hash_of)

    @property
    def num_evictable(self) -> int:
        """Cached blocks no request references (free for allocation, content kept until evicted)."""
        return len(self._lru)

    def park(self, block: int) -> None:
        """A cached block lost its last reference: most recently used end of the LRU."""
        self._lru[block] = None

    def unpark(self, block: int) -> None:
        """A parked block is referenced again (a hit)."""
        del self._lru[block]

    def evict(self) -> int:
        """Drop the least recently used unreferenced block's key and return the block for reuse.

        Raises:
            KeyError: nothing is evictable.
        """
        block, _ = self._lru.popitem(last=False)
        del self._block_of[self._hash_of.pop(block)]
        self._no_drafter_kv.discard(block)
        self.stats.evicted_blocks += 1
        return block

    def clear(self) -> list[int]:
        """Forget every key (vLLM's `reset_prefix_cache`); returns the unreferenced blocks, now plain free blocks.
        Referenced blocks stay with their requests and go to the free list when released."""
        parked = list(self._lru)
        self._lru.clear()
        self._block_of.clear()
        self._hash_of.clear()
        self._no_drafter_kv.clear()
        return parked

    def record_query(self, num_tokens: int, num_hit_tokens: int) -> None:
        """Count one admission's lookup: `num_tokens` queried, `num_hit_tokens` reused."""
        self.stats.queries += num_tokens
        self.stats.hits += num_hit_tokens
