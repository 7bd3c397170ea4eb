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
from nextn.models.layers import GatedMLP, RMSNorm
from nextn.runtime.attention_metadata import AttentionMetadata


class DecoderLayer(nn.Module):
    """Pre-norm block: x + MLA(norm(x)), then h + MLP/MoE(norm(h))."""

    def __init__(self, cfg: DeepseekV3ModelConfig, layer_idx: int) -> None:
        super().__init__()
        self.layer_idx = layer_idx
        self.self_attn = MLAttention(cfg)
        self.mlp = DeepseekMoE(cfg) if cfg.is_moe_layer(layer_idx) else GatedMLP(cfg.hidden_size, cfg.intermediate_size)
        self.input_layernorm = RMSNorm(cfg.hidden_size, eps=cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, eps=cfg.rms_norm_eps)

    def forward(self, x: torch.Tensor, cos_sin: torch.Tensor, kv_cache: torch.Tensor,
                meta: AttentionMetadata) -> torch.Tensor:
        """x: [B, T, hidden] → [B, T, hidden]; writes this layer's KV (kv_cache: [num_slots, kv dim])."""
        x = x + self.self_attn(self.input_layernorm(x), cos_sin, kv_cache, meta)
        return x + self.mlp(self.post_attention_layernorm(x))


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
        positions = max_positions or cfg.max_position_embeddings
        self.register_buffer("rope_table", rope_cache(cfg.rope, cfg.qk_rope_head_dim, cfg.max_position_embeddings,
                                                      positions), persistent=False)

    @property
    def num_cache_layers(self) -> int:
        return self.cfg.num_hidden_layers + self.cfg.num_nextn_predict_layers

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
        return self.lm_head(hidden).float()

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
        return self.logits(self.mtp_layer(k).shared_head.norm(hidden))
