"""DeepSeek-V3 for inference over a paged KV cache: the target model and its MTP modules.

Sources: DeepSeek-V3 technical report (arXiv 2412.19437) §2.1 (MLA, DeepSeekMoE) and §2.2 (MTP); parameter names
and numerics follow HF `transformers` `DeepseekV3ForCausalLM` (the oracle, matched to fp32 ~1e-5), MTP layout as
released (`model.layers.{num_hidden_layers + i}`, REFERENCE.md §2). Every forward takes fixed-shape device tensors
and an `AttentionMetadata`; nothing syncs with the host.
"""

from __future__ import annotations

import torch
from torch import nn

from nextn.models.config import DeepseekV3ModelConfig
from nextn.models.deepseek_v3.mla import MLAttention
from nextn.models.deepseek_v3.moe import DeepseekMoE
from nextn.models.deepseek_v3.rope import rope_cache
from nextn.models.layers import GatedMLP, PreNormDecoderLayer, RMSNorm
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


class DecoderLayer(PreNormDecoderLayer):
    """Pre-norm block: x + MLA(norm(x)), then h + MLP/MoE(norm(h))."""

    def __init__(self, cfg: DeepseekV3ModelConfig, layer_idx: int) -> None:
        mlp = DeepseekMoE(cfg) if cfg.is_moe_layer(layer_idx) else GatedMLP(cfg.hidden_size, cfg.intermediate_size)
        super().__init__(MLAttention(cfg), mlp, cfg.hidden_size, cfg.rms_norm_eps)
        self.layer_idx = layer_idx


class SharedHead(nn.Module):
    """The MTP module's output norm (`shared_head.norm`); its `head` is the main model's lm_head."""

    def __init__(self, cfg: DeepseekV3ModelConfig) -> None:
        super().__init__()
        self.norm = RMSNorm(cfg.hidden_size, eps=cfg.rms_norm_eps)


class MTPLayer(DecoderLayer):
    """One MTP module (report §2.2): h' = Block(eh_proj([enorm(embed(t)); hnorm(h)])), embedding first."""

    def __init__(self, cfg: DeepseekV3ModelConfig, layer_idx: int) -> None:
        super().__init__(cfg, layer_idx)
        self.enorm = RMSNorm(cfg.hidden_size, eps=cfg.rms_norm_eps)
        self.hnorm = RMSNorm(cfg.hidden_size, eps=cfg.rms_norm_eps)
        self.eh_proj = nn.Linear(2 * cfg.hidden_size, cfg.hidden_size, bias=False)
        self.shared_head = SharedHead(cfg)

    def forward_mtp(self, token_embeds: torch.Tensor, hidden_prev: torch.Tensor, cos_sin: torch.Tensor,
                    kv_cache: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        """token_embeds, hidden_prev: [B, T, hidden] → the module's block output [B, T, hidden] (before shared_head.norm)."""
        x = self.eh_proj(torch.cat([self.enorm(token_embeds), self.hnorm(hidden_prev)], dim=-1))
        return super().forward(x, cos_sin, kv_cache, meta)


class DeepseekV3Body(nn.Module):
    """`model.*`: embeddings, N decoder layers then the MTP layers, final norm."""

    def __init__(self, cfg: DeepseekV3ModelConfig) -> None:
        super().__init__()
        n = cfg.num_hidden_layers
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(
            [DecoderLayer(cfg, i) for i in range(n)] + [MTPLayer(cfg, n + k) for k in range(cfg.num_nextn_predict_layers)]
        )
        self.norm = RMSNorm(cfg.hidden_size, eps=cfg.rms_norm_eps)


class DeepseekV3ForCausalLM(nn.Module):
    """The target model and its MTP modules; parameter names are the engine's (HF names, stacked experts).

    The KV cache is one tensor [num_layers + num_mtp_layers, num_slots, kv_lora_rank + qk_rope_head_dim]:
    MTP layers page through the same block tables as the target.
    """

    def __init__(self, cfg: DeepseekV3ModelConfig, max_positions: int | None = None) -> None:
        super().__init__()
        self.cfg = cfg
        self.model = DeepseekV3Body(cfg)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        self.draft_head_weight: torch.Tensor | None = None
        positions = max_positions or cfg.max_position_embeddings
        self.register_buffer("rope_table", rope_cache(cfg.rope, cfg.qk_rope_head_dim, cfg.max_position_embeddings,
                                                      positions), persistent=False)

    @property
    def num_cache_layers(self) -> int:
        return self.cfg.num_hidden_layers + self.cfg.num_nextn_predict_layers

    def rope_table_for(self, num_positions: int) -> torch.Tensor:
        """The rope cos/sin table for `num_positions` positions (rebuilt after loading on the meta device)."""
        cfg = self.cfg
        return rope_cache(cfg.rope, cfg.qk_rope_head_dim, cfg.max_position_embeddings, num_positions)

    def _cos_sin(self, positions: torch.Tensor) -> torch.Tensor:
        return self.rope_table[positions.clamp(min=0)]  # [B, T, 2, rope // 2]

    def forward(self, input_ids: torch.Tensor, kv_cache: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        """Target forward. input_ids: [B, T] int64 → hidden states after the final norm [B, T, hidden]."""
        x = self.model.embed_tokens(input_ids)
        cos_sin = self._cos_sin(meta.positions)
        for i in range(self.cfg.num_hidden_layers):
            x = self.model.layers[i](x, cos_sin, kv_cache[i], meta)
        return self.model.norm(x)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """lm_head: [..., hidden] → [..., vocab] fp32."""
        return vocab_projection(self.lm_head.weight, hidden).float()

    def draft_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """The drafters' lm_head: [..., hidden] → [..., vocab] fp32, through `draft_head_weight` when set.

        Drafts only propose tokens (the target verifies them), so a cheaper copy of the head — bf16 for an fp32
        engine — changes acceptance at most, never the output.
        """
        weight = self.draft_head_weight if self.draft_head_weight is not None else self.lm_head.weight
        return vocab_projection(weight, hidden.to(weight.dtype)).float()  # fp32 argmax is faster on CPU

    def use_bf16_draft_head(self) -> None:
        """Give drafters a bf16 copy of lm_head (about 5× faster on CPUs with bf16 matmul units; lossless)."""
        if self.lm_head.weight.dtype != torch.bfloat16:
            self.draft_head_weight = self.lm_head.weight.detach().to(torch.bfloat16)

    def mtp_layer(self, k: int) -> MTPLayer:
        return self.model.layers[self.cfg.num_hidden_layers + k]

    def forward_mtp(self, k: int, input_ids: torch.Tensor, hidden_prev: torch.Tensor, kv_cache: torch.Tensor,
                    meta: AttentionMetadata) -> torch.Tensor:
        """MTP module k. input_ids: [B, T] (the token one position ahead of hidden_prev's); hidden_prev: [B, T, hidden]
        (the target's final hidden for k's first use, else the previous module's output) → [B, T, hidden]."""
        layer = self.mtp_layer(k)
        embeds = self.model.embed_tokens(input_ids)
        return layer.forward_mtp(embeds, hidden_prev, self._cos_sin(meta.positions),
                                 kv_cache[self.cfg.num_hidden_layers + k], meta)

    def mtp_logits(self, k: int, hidden: torch.Tensor) -> torch.Tensor:
        """lm_head(shared_head.norm(h)) of MTP module k: [..., hidden] → [..., vocab] fp32."""
        return self.draft_logits(self.mtp_layer(k).shared_head.norm(hidden))
