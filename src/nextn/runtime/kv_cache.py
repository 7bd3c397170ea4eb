"""The paged KV cache: a block pool on the host and one cache tensor on the device.

Block 0 is the null block: never handed out, it absorbs the KV writes of padded tokens. A request owns an ordered
list of blocks (its block table); slot = block · block_size + offset. The MTP layers page through the same blocks
as the target (one tensor, one row per layer).
"""

from __future__ import annotations

from collections import deque

import torch

NULL_BLOCK = 0


class KVCacheFullError(RuntimeError):
    """A request can never fit in the KV cache, even alone."""


class BlockPool:
    """Free-list allocator of KV blocks (host side)."""

    def __init__(self, num_blocks: int, block_size: int) -> None:
        if num_blocks < 2:
            raise ValueError("the KV cache needs at least 2 blocks (block 0 is reserved)")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self._free: deque[int] = deque(range(1, num_blocks))

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def capacity_tokens(self) -> int:
        """Tokens one sequence could hold with every usable block."""
        return (self.num_blocks - 1) * self.block_size

    def blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def grow(self, table: list[int], num_tokens: int) -> bool:
        """Extend `table` in place to cover `num_tokens`; False (and no change) when the pool is short."""
        need = self.blocks_for(num_tokens) - len(table)
        if need <= 0:
            return True
        if need > len(self._free):
            return False
        table.extend(self._free.popleft() for _ in range(need))
        return True

    def free(self, table: list[int]) -> None:
        self._free.extend(table)
        table.clear()


def allocate_kv_cache(num_layers: int, num_blocks: int, block_size: int, kv_dim: int, dtype: torch.dtype,
                      device: torch.device | str = "cpu") -> torch.Tensor:
    """The device cache: [num_layers, num_blocks · block_size, kv_dim] zeros (MLA: kv_dim = kv_lora_rank + rope)."""
    return torch.zeros(num_layers, num_blocks * block_size, kv_dim, dtype=dtype, device=device)
