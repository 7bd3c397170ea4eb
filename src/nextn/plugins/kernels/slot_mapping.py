"""Slot mapping through the block table, and the KV-length rewind, on the device.

`slot = block_table[b, pos // block_size] · block_size + pos % block_size`; padding (negative positions or
`valid` False) maps to slot 0, the null block (ARCHITECTURE.md, KV cache). The rewind after a verification is
kv_len ← kv_len + num_emitted: the entries of rejected drafts stay in the cache, dead, and are overwritten by the
next step (ARCHITECTURE.md, data flow). Source of the paged layout: vLLM's PagedAttention (Kwon et al. 2023 §4.2).
Reference: the former `runtime.attention_metadata.slots_for_positions`, now `slot_mapping_reference`.
"""

from __future__ import annotations

import functools

import torch

from nextn.plugins.kernels.dispatch import cdiv, launch, register_op, use_kernel

__all__ = ["slot_mapping", "slot_mapping_triton", "slot_mapping_reference", "rewind_kv_lens", "rewind_kv_lens_triton",
           "rewind_kv_lens_reference"]

_BLOCK = 128


@functools.cache
def _build():
    global tl
    import triton
    import triton.language as tl

    @triton.jit
    def slot_mapping_kernel(block_tables_ptr, positions_ptr, valid_ptr, slots_ptr, n, max_blocks, block_size,
                            HAS_VALID: tl.constexpr, BLOCK: tl.constexpr):
        """Program (b, i): slots of positions[b, i·BLOCK : (i+1)·BLOCK]."""
        b = tl.program_id(0)
        offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        inside = offs < n
        pos = tl.load(positions_ptr + b * n + offs, mask=inside, other=0)
        p = tl.maximum(pos, 0)
        block_idx = tl.minimum(p // block_size, max_blocks - 1)
        block = tl.load(block_tables_ptr + b * max_blocks + block_idx, mask=inside, other=0)
        slot = block * block_size + p % block_size
        keep = pos >= 0
        if HAS_VALID:
            keep = keep & (tl.load(valid_ptr + b * n + offs, mask=inside, other=0) != 0)
        tl.store(slots_ptr + b * n + offs, tl.where(keep, slot, 0), mask=inside)

    @triton.jit
    def rewind_kernel(kv_lens_ptr, num_emitted_ptr, out_ptr, batch, BLOCK: tl.constexpr):
        offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        inside = offs < batch
        kv = tl.load(kv_lens_ptr + offs, mask=inside, other=0)
        n = tl.load(num_emitted_ptr + offs, mask=inside, other=0)
        tl.store(out_ptr + offs, kv + n, mask=inside)

    return slot_mapping_kernel, rewind_kernel


def __getattr__(name: str):
    kernels = ("slot_mapping_kernel", "rewind_kernel")
    if name in kernels:
        return _build()[kernels.index(name)]
    raise AttributeError(name)


def slot_mapping_reference(block_tables: torch.Tensor, positions: torch.Tensor, block_size: int,
                           valid: torch.Tensor | None = None) -> torch.Tensor:
    """Slot of each position through the block table (PyTorch).

    Args:
        block_tables: [batch, max_blocks] int64.
        positions: [batch, n] int64; must be < max_blocks · block_size where valid (larger ones are clamped to the
            last block).
        valid: optional [batch, n] bool; invalid entries (and negative positions) map to slot 0 (null block).
    Returns:
        [batch, n] int64 slots.
    """
    pos = positions.clamp(min=0)
    block_idx = (pos // block_size).clamp(max=block_tables.shape[1] - 1)
    slots = block_tables.gather(1, block_idx) * block_size + pos % block_size
    keep = positions >= 0 if valid is None else valid & (positions >= 0)
    return torch.where(keep, slots, torch.zeros_like(slots))


def _slot_mapping_valid(block_tables: torch.Tensor, positions: torch.Tensor, block_size: int,
                        valid: torch.Tensor) -> torch.Tensor:
    b, n = positions.shape
    slots = torch.empty(b, n, dtype=torch.int64, device=positions.device)
    if n:
        launch(_build()[0])[(b, cdiv(n, _BLOCK))](
            block_tables.contiguous(), positions.contiguous(), valid.to(torch.int8).contiguous(), slots, n,
            block_tables.shape[1], block_size, HAS_VALID=True, BLOCK=_BLOCK)
    return slots


def _slot_mapping_all(block_tables: torch.Tensor, positions: torch.Tensor, block_size: int) -> torch.Tensor:
    b, n = positions.shape
    slots = torch.empty(b, n, dtype=torch.int64, device=positions.device)
    if n:
        launch(_build()[0])[(b, cdiv(n, _BLOCK))](
            block_tables.contiguous(), positions.contiguous(), positions, slots, n, block_tables.shape[1],
            block_size, HAS_VALID=False, BLOCK=_BLOCK)
    return slots


def _rewind(kv_lens: torch.Tensor, num_emitted: torch.Tensor) -> torch.Tensor:
    out = torch.empty_like(kv_lens)
    b = kv_lens.shape[0]
    launch(_build()[1])[(cdiv(b, _BLOCK),)](kv_lens.contiguous(), num_emitted.to(kv_lens.dtype).contiguous(),
                                                   out, b, BLOCK=_BLOCK)
    return out


_slot_mapping_valid_op = register_op("slot_mapping_valid", _slot_mapping_valid)
_slot_mapping_op = register_op("slot_mapping", _slot_mapping_all)
_rewind_op = register_op("rewind_kv_lens", _rewind)


def slot_mapping_triton(block_tables: torch.Tensor, positions: torch.Tensor, block_size: int,
                        valid: torch.Tensor | None = None) -> torch.Tensor:
    """Launcher: the arguments and result of `slot_mapping_reference` (one program per 128 positions of a row)."""
    if valid is None:
        return _slot_mapping_op(block_tables, positions, block_size)
    return _slot_mapping_valid_op(block_tables, positions, block_size, valid)


def slot_mapping(block_tables: torch.Tensor, positions: torch.Tensor, block_size: int,
                 valid: torch.Tensor | None = None) -> torch.Tensor:
    """Slots [batch, n] int64 of positions [batch, n]: the kernel where it can run, else the reference."""
    if use_kernel(block_tables, positions):
        return slot_mapping_triton(block_tables, positions, block_size, valid)
    return slot_mapping_reference(block_tables, positions, block_size, valid)


def rewind_kv_lens_reference(kv_lens: torch.Tensor, num_emitted: torch.Tensor) -> torch.Tensor:
    """The KV length after a verification: kv_lens [B] int64 + num_emitted [B] int64 → [B] int64 (rejected
    drafts' entries beyond it are dead)."""
    return kv_lens + num_emitted


def rewind_kv_lens_triton(kv_lens: torch.Tensor, num_emitted: torch.Tensor) -> torch.Tensor:
    """Launcher of the rewind: the arguments and result of `rewind_kv_lens_reference`."""
    return _rewind_op(kv_lens, num_emitted)


def rewind_kv_lens(kv_lens: torch.Tensor, num_emitted: torch.Tensor) -> torch.Tensor:
    """The rewound KV lengths: the kernel where it can run, else the reference."""
    if use_kernel(kv_lens, num_emitted):
        return rewind_kv_lens_triton(kv_lens, num_emitted)
    return rewind_kv_lens_reference(kv_lens, num_emitted)
