"""Multi-head Latent Attention (MLA) over a paged latent KV cache, in the "absorbed" form.

Sources: DeepSeek-V2 report §2.1 (MLA) and DeepSeek-V3 report §2.1.1; absorption as in vLLM `mla/common.py`
and SGLang `deepseek_v2.py`. Per token the cache holds only the normalised latent c_kv [kv_lora_rank] and the
roped shared key k_pe [qk_rope_head_dim] (576 values for V3). `kv_b_proj` is folded into the query (W_UK) and
the output (W_UV), so keys and values are never expanded per head. Softmax runs in fp32. The attention itself
(absorbed queries over the paged latents) is `nextn.plugins.kernels.mla_attention`: a Triton kernel on CUDA, its
PyTorch reference elsewhere.
"""

from __future__ import annotations

import torch
from torch import nn

from nextn.models.config import DeepseekV3ModelConfig
from nextn.models.deepseek_v3.rope import apply_rope
from nextn.models.layers import RMSNorm
from nextn.plugins import cpu_kernels
from nextn.plugins.kernels.mla_attention import mla_attention
from nextn.plugins.kv_cache_write import kv_cache_write
from nextn.models.attention_metadata import AttentionMetadata


class MLAttention(nn.Module):
    """MLA with HF parameter names (`q_a_proj`, `kv_a_proj_with_mqa`, `kv_b_proj`, `o_proj`, ...).

    `mla_kernel` (set at load by `plugins.mla.install_mla` where it applies): the absorption, the attention and the
    value up-projection run as nextn's CPU op (batch-invariant), else as the PyTorch / Triton path below;
    `kv_b_int8` (set there too in a weight-quantized engine): the op reads `kv_b_proj` as int8 with per-row scales.
    """

    mla_kernel = False
    kv_b_int8: tuple[torch.Tensor, torch.Tensor] | None = None  # (int8 [NH, P + V, C], f32 scales [NH, P + V])

    def __init__(self, cfg: DeepseekV3ModelConfig) -> None:
        super().__init__()
        self.cfg = cfg
        h, nh = cfg.hidden_size, cfg.num_attention_heads
        self.num_heads = nh
        if cfg.q_lora_rank is None:
            self.q_proj = nn.Linear(h, nh * cfg.qk_head_dim, bias=False)
        else:
            self.q_a_proj = nn.Linear(h, cfg.q_lora_rank, bias=cfg.attention_bias)
            self.q_a_layernorm = RMSNorm(cfg.q_lora_rank, eps=cfg.rms_norm_eps)
            self.q_b_proj = nn.Linear(cfg.q_lora_rank, nh * cfg.qk_head_dim, bias=False)
        self.kv_a_proj_with_mqa = nn.Linear(h, cfg.kv_cache_dim, bias=cfg.attention_bias)
        self.kv_a_layernorm = RMSNorm(cfg.kv_lora_rank, eps=cfg.rms_norm_eps)
        self.kv_b_proj = nn.Linear(cfg.kv_lora_rank, nh * (cfg.qk_nope_head_dim + cfg.v_head_dim), bias=False)
        self.o_proj = nn.Linear(nh * cfg.v_head_dim, h, bias=cfg.attention_bias)
        self.scale = cfg.softmax_scale

    def _query(self, x: torch.Tensor) -> torch.Tensor:
        if self.cfg.q_lora_rank is None:
            return self.q_proj(x)
        return self.q_b_proj(self.q_a_layernorm(self.q_a_proj(x)))

    def forward(self, x: torch.Tensor, cos_sin: torch.Tensor, kv_cache: torch.Tensor,
                meta: AttentionMetadata) -> torch.Tensor:
        """Attend the query tokens to their sequences' cached latents, after writing their own.

        Args:
            x: [B, T, hidden] normalised hidden states.
            cos_sin: [B, T, 2, qk_rope_head_dim // 2] rope table rows at the tokens' positions.
            kv_cache: [num_slots, kv_lora_rank + qk_rope_head_dim] this layer's paged cache (written in place).
            meta: positions [B, T], slot_mapping [B, T], block_tables [B, max_blocks].
        Returns:
            [B, T, hidden].
        """
        cfg = self.cfg
        b, t, _ = x.shape
        nh, nope, rope_d, lora = self.num_heads, cfg.qk_nope_head_dim, cfg.qk_rope_head_dim, cfg.kv_lora_rank
        q = self._query(x).view(b, t, nh, cfg.qk_head_dim)
        q_nope, q_pe = q.split([nope, rope_d], dim=-1)  # [B, T, nh, nope], [B, T, nh, rope]
        q_pe = apply_rope(q_pe, cos_sin, cfg.rope_interleave)

        c_kv, k_pe = self.kv_a_proj_with_mqa(x).split([lora, rope_d], dim=-1)
        c_kv = self.kv_a_layernorm(c_kv)  # [B, T, lora]
        k_pe = apply_rope(k_pe, cos_sin, cfg.rope_interleave)  # [B, T, rope]
        new_kv = torch.cat([c_kv, k_pe], dim=-1).to(kv_cache.dtype)
        kv_cache_write(kv_cache, meta.slot_mapping.reshape(-1), new_kv.reshape(b * t, -1))

        if self.mla_kernel and kv_cache.dtype == x.dtype == self.kv_b_proj.weight.dtype:
            kv_b, kv_b_scale = self.kv_b_int8 or (self.kv_b_proj.weight.view(nh, -1, lora), None)
            o = cpu_kernels.ops().mla_attention(q_nope, q_pe, kv_b, kv_cache, meta.context_slots, meta.visible,
                                                self.scale, kv_b_scale)
            return self.o_proj(o.to(x.dtype))
        w_kv = self.kv_b_proj.weight.view(nh, nope + cfg.v_head_dim, lora)
        w_uk, w_uv = w_kv[:, :nope], w_kv[:, nope:]  # [nh, nope, lora], [nh, v, lora]
        q_lat = torch.einsum("btnd,ndc->btnc", q_nope, w_uk)  # absorbed query [B, T, nh, lora]
        o_lat = mla_attention(q_lat, q_pe, kv_cache, meta, self.scale)  # [B, T, nh, lora]
        o = torch.einsum("btnc,nvc->btnv", o_lat, w_uv).reshape(b, t, nh * cfg.v_head_dim)
        return self.o_proj(o)
