"""The sliding-window layers' own KV blocks, for a model that mixes sliding-window and full-attention layers.

A model whose every KV-cache layer slides releases the blocks behind the window from the request's block table
(`SchedulerLimits.kv_window`). Where full-attention layers read the same positions (Gemma 2 / 3 / 4, gpt-oss,
Cohere 2, …) the pool blocks stay; what goes is the part of them only sliding layers read. The KV-cache rows that
only sliding layers read address **sliding blocks** instead of pool blocks: `block_map[b]` is the sliding block that
holds pool block b's positions in those rows (0: none, the null block). A request's pool blocks within its window —
from the first key its next query sees to the last position its next step writes — each hold a sliding block
(`ensure`); blocks falling behind the window give theirs back (`release`). The sliding rows' memory is then bounded
by `num_blocks` (about max_batch_size × (window + a step's tokens) / block_size), not by max_seq_len; the cache tensor
is an anonymous memory map on the CPU (`models.kv_cache.allocate_kv_cache`), so the sliding rows' pages past
`num_blocks` are never touched and never resident.

With prefix caching a sliding block whose pool block is cached outlives its window as an **idle** block, kept (least
recently used first) until an allocation needs it, so that a later request reusing that prefix finds the sliding KV
of the window before its first computed token (`hit_len`: a hit is cut where that KV is gone; vLLM's hybrid KV-cache
manager does the same for sliding-window groups).

The attention side: `AttentionMetadata.windowed(window, block_map)` reads the sliding layers' block tables, slots and
context slots through the map (`models/attention_metadata.py`).
"""

from __future__ import annotations

from collections import OrderedDict, deque
from collections.abc import Callable

import torch


class SlidingBlocks:
    """Sliding blocks for the pool blocks within requests' windows (host side; `block_map` is what the model reads).

    Args:
        num_blocks: sliding blocks, the null block 0 included (≥ 2).
        num_pool_blocks: blocks of the pool whose blocks are mapped (the null block included).
        window: keys a query sees: positions p − window + 1 .. p.
        block_size: tokens per block (the pool's).
        is_cached: whether a pool block holds a prefix-cache key (its sliding block is kept idle, not freed, when no
            window needs it).
    Raises:
        ValueError: fewer than 2 blocks, or a window < 1.
    """

    def __init__(self, num_blocks: int, num_pool_blocks: int, window: int, block_size: int,
                 is_cached: Callable[[int], bool] = lambda block: False) -> None:
        if num_blocks < 2 or window < 1:
            raise ValueError(f"sliding blocks need ≥ 2 blocks and a window ≥ 1 (got {num_blocks}, {window})")
        self.num_blocks, self.window, self.block_size = num_blocks, window, block_size
        self._is_cached = is_cached
        #: [num_pool_blocks] int64 on the CPU: pool block → its sliding block (0: none); read by the model's forward
        self.block_map = torch.zeros(num_pool_blocks, dtype=torch.int64)
        self._map = [0] * num_pool_blocks  # the same on the host (Python reads of a tensor are slow)
        self._pins = [0] * num_pool_blocks  # requests whose window holds the pool block
        self._free: deque[int] = deque(range(1, num_blocks))
        self._idle: OrderedDict[int, None] = OrderedDict()  # pool blocks with an unpinned, cached sliding block (LRU)
        self._spans: dict[int, list[int]] = {}  # id(block table) → [first, end) of the table entries it pins
        self.rows: tuple[int, ...] = ()  # the KV-cache rows that read through the map (set by the engine)
        self.peak_in_use = 0

    @property
    def num_in_use(self) -> int:
        """Sliding blocks held now (pinned or idle)."""
        return self.num_blocks - 1 - len(self._free)

    def first_block_seen(self, position: int) -> int:
        """Index (in a block table) of the first block a query at `position` reads."""
        return max(0, position - self.window + 1) // self.block_size

    def ensure(self, table: list[int], position: int, num_tokens: int) -> bool:
        """Give every entry of `table` from the first block a query at `position` sees up to the block holding
        position `num_tokens` − 1 a sliding block, pinned for this request; False and no change when too few are
        free or idle.

        Raises:
            ValueError: `table` is shorter than `num_tokens` needs (grow it in the pool first).
        """
        end = -(-num_tokens // self.block_size)
        if end > len(table):
            raise ValueError(f"the block table holds {len(table)} blocks; {num_tokens} tokens need {end}")
        span = self._spans.get(id(table))
        start = span[1] if span is not None else self.first_block_seen(position)
        new = table[start:end]
        need = sum(1 for b in new if self._map[b] == 0)
        reclaimed = sum(1 for b in new if b in self._idle)  # idle ones it pins: no longer evictable
        if need > len(self._free) + len(self._idle) - reclaimed:
            return False
        if span is None:
            span = self._spans[id(table)] = [start, start]
        for b in new:
            if self._map[b] == 0:
                self._set(b, self._free.popleft() if self._free else self._evict())
            self._idle.pop(b, None)
            self._pins[b] += 1
        span[1] = max(span[1], end)
        self.peak_in_use = max(self.peak_in_use, self.num_in_use)
        return True

    def release(self, table: list[int], position: int) -> int:
        """Unpin `table`'s blocks before the first one a query at `position` sees (its next query's position);
        returns how many were unpinned."""
        span = self._spans.get(id(table))
        if span is None:
            return 0
        stop = min(self.first_block_seen(position), span[1])
        for i in range(span[0], stop):
            self._unpin(table[i])
        released = max(0, stop - span[0])
        span[0] = max(span[0], stop)
        return released

    def drop(self, table: list[int]) -> None:
        """The request lets `table` go (finished, preempted, cancelled): unpin what it pins."""
        span = self._spans.pop(id(table), None)
        if span is not None:
            for i in range(span[0], min(span[1], len(table))):
                self._unpin(table[i])

    def forget(self, block: int) -> None:
        """Pool block `block` lost its content (freed without a prefix-cache key, or its key evicted): its idle
        sliding block goes back to the free list."""
        if self._map[block] and self._pins[block] == 0:
            self._idle.pop(block, None)
            self._free.append(self._map[block])
            self._set(block, 0)

    def forget_idle(self) -> None:
        """The prefix cache forgot every key: every idle sliding block goes back to the free list."""
        for block in list(self._idle):
            self.forget(block)

    def hit_len(self, hits: list[int]) -> int:
        """How many of a prefix hit's blocks (in order) can be reused: the most h whose window before position
        h · block_size — what the first computed query reads — still has every sliding block (0: none)."""
        h = len(hits)
        while h > 0 and not all(self._map[hits[i]] for i in range(self.first_block_seen(h * self.block_size), h)):
            h -= 1
        return h

    def _unpin(self, block: int) -> None:
        self._pins[block] -= 1
        if self._pins[block] == 0 and self._map[block]:
            if self._is_cached(block):
                self._idle[block] = None
            else:
                self.forget(block)

    def _evict(self) -> int:
        block, _ = self._idle.popitem(last=False)
        sliding = self._map[block]
        self._set(block, 0)
        return sliding

    def _set(self, block: int, sliding: int) -> None:
        self._map[block] = sliding
        self.block_map[block] = sliding


def sliding_plan(model_cfg, device: torch.device, compiled: bool, drafter_keeps_kv: bool, max_batch_size: int,
                 lookahead: int, block_size: int, prefill_tokens: int) -> tuple[int, int] | None:
    """(sliding rows, sliding blocks to allocate) where the sliding layers' rows get blocks of their own, else None.

    They do for a model mixing sliding-window and full-attention layers (`sliding_cache_rows`) without MTP layers,
    on the CPU, without torch.compile or CUDA graphs (the map is read in place each step), and with a drafter
    that keeps no KV of its own (a draft model may attend further back). The count bounds what the scheduler can
    pin at once: every batch slot its window plus a decode step's `lookahead` tokens, plus two prefill steps'
    `prefill_tokens` (the step's budget, a whole prompt without chunked prefill; the overlap scheduler plans a
    request's next chunk before the last one's blocks are released) and a partial block per request.
    """
    rows = getattr(model_cfg, "sliding_cache_rows", ())
    mtp = bool(getattr(model_cfg, "num_nextn_predict_layers", 0))
    if not rows or mtp or device.type != "cpu" or compiled or drafter_keeps_kv:
        return None
    window = model_cfg.sliding_window
    per_request = -(-(window - 1 + lookahead) // block_size) + 2
    return len(rows), 1 + max_batch_size * per_request + -(-2 * prefill_tokens // block_size) + max_batch_size
