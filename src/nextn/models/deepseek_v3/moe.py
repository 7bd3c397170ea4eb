"""DeepSeek-V3's MoE MLP (GLM-4.5 / 4.7-Flash, Kimi-K2 read as this family too): sigmoid group-limited routing
(`noaux_tc`) over E routed experts, plus unscaled shared experts — built on nextn's one MoE layer
(`models.moe.SparseMoE`, the layer the Llama family's MoE models use).

Sources: DeepSeek-V3 report (arXiv 2412.19437) §2.1.2 (auxiliary-loss-free balancing: the correction bias is used
for selection only); deepseek-ai/DeepSeek-V3's `modeling_deepseek.py` (`MoEGate`, `DeepseekV3MoE`).

On that layer a step computes only the routed (token, expert) pairs, each expert on its own tokens' rows with
nextn's per-row kernels (dense, W8A16, W4A16 / W4A8 — with int4 experts, read from a GGUF's Q4_K blocks as they
are, the layer's whole MLP half is one op: `plugins.moe_experts.block_forward`), a token's outputs summed in
ascending expert id: batch-invariant. Parameter
names are the released checkpoints' (`mlp.gate.weight`, `mlp.gate.e_score_correction_bias`,
`mlp.experts.{e}.gate_proj.weight`, `mlp.shared_experts.*`).
"""

from __future__ import annotations

from nextn.models.config import DeepseekV3ModelConfig
from nextn.models.moe import NoAuxRouter, SparseMoE


def deepseek_moe(cfg: DeepseekV3ModelConfig) -> SparseMoE:
    """The MoE MLP of one DeepSeek-V3 layer: `NoAuxRouter` (n_group, topk_group, norm_topk_prob,
    routed_scaling_factor from `cfg`), `n_routed_experts` SwiGLU experts of width `moe_intermediate_size`, and the
    shared experts as one `GatedMLP` of width `moe_intermediate_size · n_shared_experts` (none when 0)."""
    gate = NoAuxRouter(cfg.hidden_size, cfg.n_routed_experts, cfg.num_experts_per_tok, cfg.n_group, cfg.topk_group,
                       cfg.norm_topk_prob, cfg.routed_scaling_factor)
    shared = cfg.moe_intermediate_size * cfg.n_shared_experts if cfg.n_shared_experts else None
    return SparseMoE(cfg.hidden_size, cfg.n_routed_experts, cfg.num_experts_per_tok, cfg.moe_intermediate_size,
                     cfg.norm_topk_prob, gate=gate, shared_experts_width=shared)
