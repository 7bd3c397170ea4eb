"""DeepSeek-V3 for inference over a paged KV cache: the target model and its MTP modules.

Sources: DeepSeek-V3 technical report (arXiv 2412.19437) §2.1 (MLA, DeepSeekMoE) and §2.2 (MTP); parameter names
and numerics follow HF `transformers` `DeepseekV3ForCausalLM` (the oracle, matched to fp32 ~1e-5), MTP layout as
released (`model.layers.{num_hidden_layers + i}`, arXiv:2412.19437 §2.2). Every forward takes fixed-shape
device tensors
and an `AttentionMetadata`; nothing syncs with the host.
"""

from __future__ import annotations

import torch
from torch import nn

from nextn.models.causal_lm import SelfDraftingCausalLM, vocab_projection  # noqa: F401 (re-exported)
from nextn.models.config import DeepseekV3ModelConfig
from nextn.models.deepseek_v3.mla import MLAttention
from nextn.models.deepseek_v3.moe import deepseek_moe
from nextn.models.deepseek_v3.rope import rope_cache
from nextn.models.layers import GatedMLP, PreNormDecoderLayer, RMSNorm
from nextn.models.attention_metadata import AttentionMetadata
from nextn.plugins.moe_experts import block_forward


class DecoderLayer(PreNormDecoderLayer):
    """Pre-norm block: x + MLA(norm(x)), then h + MLP/MoE(norm(h)).

    `moe_block` (set at load by `plugins.decoder_layer.install_fused_layers` where it applies: int4 experts on the
    CPU): the MoE half — norm, sigmoid grouped routing, routed and shared experts, residual — as one op
    (`plugins.moe_experts.block_forward`).
    """

    moe_block = False

    def __init__(self, cfg: DeepseekV3ModelConfig, layer_idx: int) -> None:
        mlp = deepseek_moe(cfg) if cfg.is_moe_layer(layer_idx) else GatedMLP(cfg.hidden_size, cfg.intermediate_size)
        super().__init__(MLAttention(cfg), mlp, cfg.hidden_size, cfg.rms_norm_eps)
        self.layer_idx = layer_idx

    def forward(self, x: torch.Tensor, cos_sin: torch.Tensor, kv_cache: torch.Tensor,
                meta: AttentionMetadata) -> torch.Tensor:
        """x: [B, T, hidden] → [B, T, hidden]; writes this layer's latent KV."""
        if not self.moe_block or x.dtype != torch.bfloat16:
            return super().forward(x, cos_sin, kv_cache, meta)
        x = x + self.self_attn(self.input_layernorm(x), cos_sin, kv_cache, meta)
        return block_forward(self.mlp, self.post_attention_layernorm, x)


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


class DeepseekV3ForCausalLM(SelfDraftingCausalLM):
    """The target model and its MTP modules; parameter names are the engine's (HF names).

    The KV cache is one tensor [num_layers + num_mtp_layers, num_slots, kv_lora_rank + qk_rope_head_dim]:
    MTP layers page through the same block tables as the target.
    """

    #: MLA folds `kv_b_proj`'s weight into the query and output (mla.py): it stays an `nn.Linear` when packing.
    weights_read_directly = ("kv_b_proj",)

    def __init__(self, cfg: DeepseekV3ModelConfig, max_positions: int | None = None) -> None:
        super().__init__()
        self.cfg = cfg
        self.model = DeepseekV3Body(cfg)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        self.draft_head_weight: torch.Tensor | None = None
        positions = max_positions or cfg.max_position_embeddings
        self.register_buffer("rope_table", rope_cache(cfg.rope, cfg.qk_rope_head_dim, cfg.max_position_embeddings,
                                                      positions), persistent=False)

    def rope_table_for(self, num_positions: int) -> torch.Tensor:
        """The rope cos/sin table for `num_positions` positions (rebuilt after loading on the meta device)."""
        cfg = self.cfg
        return rope_cache(cfg.rope, cfg.qk_rope_head_dim, cfg.max_position_embeddings, num_positions)


