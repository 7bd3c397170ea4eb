"""The device KV cache tensor the models' attention reads and writes through block tables and slot mappings.

Its layout ([num_layers, num_blocks · block_size, kv_dim], block 0 the null block) is shared by the target, its MTP
layers and a draft model; the host-side block pool that hands out blocks is the engine's (runtime/kv_cache.py).
"""

from __future__ import annotations

import math
import mmap

import torch


def allocate_kv_cache(num_layers: int, num_blocks: int, block_size: int, kv_dim: int, dtype: torch.dtype,
                      device: torch.device | str = "cpu") -> torch.Tensor:
    """The device cache: [num_layers, num_blocks · block_size, kv_dim] zeros (MLA: kv_dim = kv_lora_rank + rope).

    On the CPU the zeros come from an anonymous memory map: the kernel hands out zero pages on first touch, so the
    cache costs resident memory only for the blocks requests have written (`torch.zeros` writes every byte: a
    Qwen2.5-1.5B engine's default pool of 8 × 25,088 tokens would be 5.7 GiB resident before the first request).
    Zeros matter: attention reads whole blocks, masks the positions past a sequence's end, and 0 · NaN would not
    be 0, so never-written slots must hold finite values.
    """
    shape = (num_layers, num_blocks * block_size, kv_dim)
    if torch.device(device).type != "cpu":
        return torch.zeros(shape, dtype=dtype, device=device)
    count = math.prod(shape)
    buf = mmap.mmap(-1, max(count * torch.empty((), dtype=dtype).element_size(), 1))
    return torch.frombuffer(buf, dtype=dtype, count=count).view(shape)  # the tensor keeps `buf` alive
