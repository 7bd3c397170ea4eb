"""The one object the model runner hands every attention layer: where each query token sits and where its KV goes.

Fixed shapes, all on the device, so a step built from it can be captured in one CUDA graph:
query tokens are a padded [batch, num_tokens] grid; pads write their KV into the reserved null block (block 0,
never given to a request) and are ignored by the caller.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch

from nextn.plugins.kernels.medusa_tree import tree_visibility
from nextn.plugins.kernels.slot_mapping import slot_mapping


@dataclass(frozen=True)
class AttentionMetadata:
    """Paged-attention inputs for one forward.

    Attributes:
        positions: [batch, num_tokens] int64, the absolute position of each query token (pads: any ≥ 0).
        slot_mapping: [batch, num_tokens] int64, the KV-cache slot (block · block_size + offset) each token's
            KV is written to; pads point into the null block.
        block_tables: [batch, max_blocks] int64, the blocks of each sequence in order (unused entries: 0).
        block_size: tokens per KV block.
        tree_start: [batch] int64 kv_len for a tree forward (`create_tree`), else None.
        tree_mask: the tree's own mask for a tree forward, else None: [L, L] bool (one tree for the batch) or
            [B, T, L] bool (per request: T query tokens over the L tree keys at tree_start..tree_start+L−1).
        recurrent: for a model with linear-attention layers, its `RecurrentState` and this forward's
            `RecurrentRows` (set by the model's forward: `models/recurrent_state.py`), else None.
    A query at position p attends to every cached key at positions 0..p of its own sequence (causal over the
    paged cache): the keys this forward writes are stored before attention reads them. `context_slots` and
    `visible` spell the same out densely for the PyTorch attention; kernels read block tables, positions and the
    tree fields instead.
    """

    positions: torch.Tensor
    slot_mapping: torch.Tensor
    block_tables: torch.Tensor
    block_size: int
    context_slots: torch.Tensor  # [batch, max_blocks · block_size] int64: the slot of every key position
    visible: torch.Tensor  # [batch, 1, num_tokens, max_blocks · block_size] bool: key position ≤ query position
    tree_start: torch.Tensor | None = None
    tree_mask: torch.Tensor | None = None
    recurrent: tuple | None = None

    @classmethod
    def create(cls, positions: torch.Tensor, slot_mapping: torch.Tensor, block_tables: torch.Tensor,
               block_size: int) -> "AttentionMetadata":
        """Metadata for one forward; the per-key tensors are derived once here, not in every layer."""
        b, max_blocks = block_tables.shape
        offsets = torch.arange(block_size, device=block_tables.device)
        context_slots = (block_tables[:, :, None] * block_size + offsets).reshape(b, max_blocks * block_size)
        return cls(positions, slot_mapping, block_tables, block_size, context_slots,
                   _visible(positions, max_blocks * block_size))

    @classmethod
    def create_tree(cls, positions: torch.Tensor, slot_mapping: torch.Tensor, block_tables: torch.Tensor,
                    block_size: int, kv_lens: torch.Tensor, tree_mask: torch.Tensor) -> "AttentionMetadata":
        """Metadata for tree verification: the L tree tokens sit at cache positions kv_len..kv_len+L−1 (by token
        index) with rope positions kv_len + depth; token i sees the cached prefix and its tree ancestors
        (tree_mask [L, L] bool), nothing else. A per-request mask [B, T, L] gives T query tokens (positions and
        slots [B, T]) their own view of the L tree keys (an MTP tree: speculative/mtp_tree.py)."""
        b, max_blocks = block_tables.shape
        s = max_blocks * block_size
        offsets = torch.arange(block_size, device=block_tables.device)
        context_slots = (block_tables[:, :, None] * block_size + offsets).reshape(b, s)
        visible = tree_visibility(kv_lens, tree_mask, s)  # [B, T, S]
        return cls(positions, slot_mapping, block_tables, block_size, context_slots, visible[:, None], kv_lens,
                   tree_mask)

    @property
    def max_context(self) -> int:
        """Keys gathered per sequence: max_blocks · block_size."""
        return self.context_slots.shape[1]

    def windowed(self, window: int, block_map: torch.Tensor | None = None) -> "AttentionMetadata":
        """The same forward for a sliding-window layer: a query at position p sees keys p − window + 1 .. p (HF's
        `sliding_window_causal_mask`), tree keys (at tree_start and after) as the tree mask says — exact while a
        tree is shallower than the window.

        Args:
            window: keys a query sees.
            block_map: [num_pool_blocks] int64, the sliding block of each pool block (runtime/sliding_blocks.py),
                where the sliding layers' cache rows have blocks of their own: block tables, slots and context slots
                are read through it (a key behind the window maps to the null block, and is masked).
        """
        meta = self if block_map is None else self._through(block_map.to(self.block_tables.device))
        keys = torch.arange(self.max_context, device=self.visible.device)
        near = keys[None, None, :] > self.positions.clamp(min=0)[:, :, None] - window  # [B, T, S]
        if self.tree_start is not None:
            near = near | (keys[None, None, :] >= self.tree_start[:, None, None])
        return replace(meta, visible=self.visible & near[:, None])

    def _through(self, block_map: torch.Tensor) -> "AttentionMetadata":
        bs = self.block_size
        tables = block_map[self.block_tables]
        slots = block_map[self.slot_mapping // bs] * bs + self.slot_mapping % bs
        offsets = torch.arange(bs, device=tables.device)
        context = (tables[:, :, None] * bs + offsets).reshape(self.context_slots.shape)
        return replace(self, slot_mapping=slots, block_tables=tables, context_slots=context)

    def with_tokens(self, positions: torch.Tensor, slot_mapping: torch.Tensor) -> "AttentionMetadata":
        """The same sequences with other query tokens (the drafter's steps)."""
        return AttentionMetadata(positions, slot_mapping, self.block_tables, self.block_size, self.context_slots,
                                 _visible(positions, self.max_context))


def _visible(positions: torch.Tensor, max_context: int) -> torch.Tensor:
    """Causal mask over the gathered context: [B, 1, T, S], key position ≤ the query's (pads: position 0)."""
    keys = torch.arange(max_context, device=positions.device)
    return (keys[None, None, :] <= positions.clamp(min=0)[:, :, None])[:, None]


def slots_for_positions(block_tables: torch.Tensor, positions: torch.Tensor, block_size: int,
                        valid: torch.Tensor | None = None) -> torch.Tensor:
    """Slot of each position through the block table, on the device (no host sync).

    Args:
        block_tables: [batch, max_blocks] int64.
        positions: [batch, n] int64; must be < max_blocks · block_size where valid.
        valid: optional [batch, n] bool; invalid entries (and negative positions) map to slot 0 (null block).
    Returns:
        [batch, n] int64 slots (`nextn.plugins.kernels.slot_mapping`: the kernel on CUDA, else the reference).
    """
    return slot_mapping(block_tables, positions, block_size, valid)
