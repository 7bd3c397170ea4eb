"""Writing a step's new K/V rows into one layer's paged cache, in place, also under `torch.compile`.

Eagerly this is `kv_cache.index_copy_(0, slot_mapping, new_kv)`. Under `torch.compile` that call mutates a *view*
of a graph input (the step receives the whole cache [num_layers, num_slots, width] and each layer indexes its
slice), which functionalization turns into a copy of the layer's whole slice and a write-back: measured on this
CPU (SmolLM2, 30 layers, 8,480 slots), 350 ms per compiled decode step against 28 ms eager. As an opaque custom op
with `mutates_args=("kv_cache",)` the write stays in place (vLLM's `reshape_and_cache` plays the same role).
"""

from __future__ import annotations

import torch


@torch.library.custom_op("nextn::kv_cache_write", mutates_args=("kv_cache",))
def _kv_cache_write_op(kv_cache: torch.Tensor, slot_mapping: torch.Tensor, new_kv: torch.Tensor) -> None:
    kv_cache.index_copy_(0, slot_mapping, new_kv)


@_kv_cache_write_op.register_fake
def _(kv_cache: torch.Tensor, slot_mapping: torch.Tensor, new_kv: torch.Tensor) -> None:
    return None


def kv_cache_write(kv_cache: torch.Tensor, slot_mapping: torch.Tensor, new_kv: torch.Tensor) -> None:
    """Write rows into one layer's paged cache in place.

    Args:
        kv_cache: [num_slots, width] one layer's cache (a view of the engine's cache tensor), any dtype.
        slot_mapping: [N] int64 destination slots (a padded token's slot is the null block's).
        new_kv: [N, width] rows, already in `kv_cache`'s dtype.
    """
    if torch.compiler.is_compiling():
        _kv_cache_write_op(kv_cache, slot_mapping, new_kv)
    else:  # eager: skip the custom-op dispatch (a few µs per layer)
        kv_cache.index_copy_(0, slot_mapping, new_kv)
