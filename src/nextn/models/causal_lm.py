"""What every target model family shares: the runtime's model surface over a paged KV cache.

`SelfDraftingCausalLM` holds the methods the steps and drafters call — `forward`, `logits`, `draft_logits`,
`forward_mtp`, `mtp_logits`, `num_cache_layers` — for a family that provides `self.cfg` (with `num_hidden_layers`,
`num_nextn_predict_layers`), `self.model` (`embed_tokens`, `layers` = decoder layers then MTP layers, `norm`),
`self.lm_head` and the `rope_table` buffer. MTP layers page through the same block tables as the target (one cache
tensor, one row per layer). Families: `deepseek_v3.model`, `llama.model`.
"""

from __future__ import annotations

import torch
from torch import nn

from nextn.runtime.attention_metadata import AttentionMetadata


def vocab_projection(weight: torch.Tensor, hidden: torch.Tensor) -> torch.Tensor:
    """hidden [..., H] @ weight[V, H]^T → [..., V], computed as weight @ hidden^T.

    With few rows (decode) and a large vocabulary, CPU BLAS runs the [V, H] × [H, rows] orientation several times
    faster than `F.linear`'s, and a single fp32 row falls to a single-threaded GEMV: pad it to two (measured on
    the 2-core CI machine: 1.7 ms → 0.8 ms for V = 129280, H = 64; bf16 needs no padding: 0.33 ms). Shapes stay static.
    """
    flat = hidden.reshape(-1, hidden.shape[-1])
    rows = flat.shape[0]
    if rows == 1 and weight.dtype == torch.float32:
        flat = torch.cat([flat, flat])
    out = (weight @ flat.T).T[:rows]
    return out.reshape(*hidden.shape[:-1], weight.shape[0])


class SelfDraftingCausalLM(nn.Module):
    """The shared model surface; subclasses build `cfg`, `model`, `lm_head`, `rope_table` and `rope_table_for`."""

    draft_head_weight: torch.Tensor | None = None
    #: The lm_head is a `WeightOnlyLinear` (a quantized engine): logits come from calling it, not from its weight.
    lm_head_quantized: bool = False

    @property
    def num_cache_layers(self) -> int:
        return self.cfg.num_hidden_layers + self.cfg.num_nextn_predict_layers

    def _cos_sin(self, positions: torch.Tensor) -> torch.Tensor:
        return self.rope_table[positions.clamp(min=0)]  # [B, T, 2, rope_dim // 2]

    def forward(self, input_ids: torch.Tensor, kv_cache: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        """Target forward. input_ids: [B, T] int64 → hidden states after the final norm [B, T, hidden]; writes KV
        at the tokens' slots."""
        x = self.model.embed_tokens(input_ids)
        cos_sin = self._cos_sin(meta.positions)
        for i in range(self.cfg.num_hidden_layers):
            x = self.model.layers[i](x, cos_sin, kv_cache[i], meta)
        return self.model.norm(x)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """lm_head: [..., hidden] → [..., vocab] fp32."""
        if self.lm_head_quantized:
            return self.lm_head(hidden).float()
        return vocab_projection(self.lm_head.weight, hidden).float()

    def draft_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """The drafters' lm_head: [..., hidden] → [..., vocab] fp32, through `draft_head_weight` when set.

        Drafts only propose tokens (the target verifies them), so a cheaper copy of the head — bf16 for an fp32
        engine — changes acceptance at most, never the output.
        """
        if self.draft_head_weight is None and self.lm_head_quantized:
            return self.lm_head(hidden).float()
        weight = self.draft_head_weight if self.draft_head_weight is not None else self.lm_head.weight
        return vocab_projection(weight, hidden.to(weight.dtype)).float()  # fp32 argmax is faster on CPU

    def use_bf16_draft_head(self) -> None:
        """Give drafters a bf16 copy of lm_head (about 5× faster on CPUs with bf16 matmul units; lossless)."""
        if not self.lm_head_quantized and self.lm_head.weight.dtype != torch.bfloat16:
            self.draft_head_weight = self.lm_head.weight.detach().to(torch.bfloat16)

    def mtp_layer(self, k: int) -> nn.Module:
        return self.model.layers[self.cfg.num_hidden_layers + k]

    def forward_mtp(self, k: int, input_ids: torch.Tensor, hidden_prev: torch.Tensor, kv_cache: torch.Tensor,
                    meta: AttentionMetadata) -> torch.Tensor:
        """MTP module k. input_ids: [B, T] (the token one position ahead of hidden_prev's); hidden_prev: [B, T, hidden]
        (the target's final hidden for k's first use, else the previous module's output) → [B, T, hidden]."""
        embeds = self.model.embed_tokens(input_ids)
        return self.mtp_layer(k).forward_mtp(embeds, hidden_prev, self._cos_sin(meta.positions),
                                             kv_cache[self.cfg.num_hidden_layers + k], meta)

    def mtp_logits(self, k: int, hidden: torch.Tensor) -> torch.Tensor:
        """lm_head(shared_head.norm(h)) of MTP module k: [..., hidden] → [..., vocab] fp32."""
        return self.draft_logits(self.mtp_layer(k).shared_head.norm(hidden))
