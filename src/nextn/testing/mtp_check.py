"""A model's first MTP module over whole sequences, as the engine runs it (a paged KV cache, the target's final hidden
states beside the tokens one position on): what the tests compare with a reference MTP implementation."""

from __future__ import annotations

from typing import NamedTuple

import torch

from nextn.models.attention_metadata import AttentionMetadata, slots_for_positions
from nextn.models.kv_cache import allocate_kv_cache

BLOCK = 8


class MtpPass(NamedTuple):
    hidden: torch.Tensor  # [B, T, hidden]: the target's final (normed) hidden states
    mtp_hidden: torch.Tensor  # [B, T - 1, hidden]: MTP module 0 at positions 0..T-2 (token t + 1 beside h_t)
    mtp_logits: torch.Tensor  # [B, T - 1, vocab] fp32: its draft logits (for token t + 2)


def mtp_pass(model, ids: torch.Tensor, shift: int = 1) -> MtpPass:
    """Prefill `ids` [B, T] through `model` (any nextn causal LM with MTP modules) over a fresh paged cache, then MTP
    module 0 over positions 0..T-2 with the tokens `shift` positions on (1: the engine's; 0: a wrong pairing, for
    controls)."""
    b, t = ids.shape
    per_seq = -(-t // BLOCK)
    tables = torch.arange(1, 1 + b * per_seq).reshape(b, per_seq)
    kv = allocate_kv_cache(model.num_cache_layers, 1 + b * per_seq, BLOCK, model.cfg.kv_cache_dim, torch.float32)
    pos = torch.arange(t).expand(b, -1)
    meta = AttentionMetadata.create(pos, slots_for_positions(tables, pos, BLOCK), tables, BLOCK)
    with torch.inference_mode():
        hidden = model(ids, kv, meta)
        h1 = model.forward_mtp(0, ids[:, shift:t - 1 + shift], hidden[:, :-1], kv, meta.with_tokens(
            pos[:, :-1], slots_for_positions(tables, pos[:, :-1], BLOCK)))
        return MtpPass(hidden, h1, model.mtp_logits(0, h1))
