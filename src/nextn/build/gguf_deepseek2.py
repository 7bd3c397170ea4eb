"""llama.cpp's `deepseek2` GGUFs (DeepSeek-V3, Kimi-K2, GLM-4.7-Flash) as nextn's DeepSeek-V3 family: tensor names,
the HF config from the metadata, and MLA's `kv_b_proj`, which llama.cpp's converter stores split in two.

Sources: llama.cpp's `conversion/deepseek.py` (`DeepseekV2Model`: `kv_b_proj` [heads·(nope + v), kv_lora] stored as
`attn_k_b` — each head's key rows transposed, [heads, kv_lora, nope] — and `attn_v_b` [heads, v, kv_lora]; the
`*_length_mla` keys; YaRN's `rope.scaling.yarn_log_multiplier` = 0.1 · mscale_all_dim) and `conversion/glm.py`
(`Glm4MoeLiteModel`: its MTP layers appended as the last blocks, `nextn_predict_layers`).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from nextn.build.checkpoint import CheckpointError

#: llama.cpp block tensor → HF module under `model.layers.N.` (DeepSeek-V3's names). `attn_k_b` is read as the key
#: half of `kv_b_proj` and `attn_v_b` as its value half (`value_half`); older files store `attn_kv_b` whole.
BLOCK = {
    "attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj", "attn_q_a": "self_attn.q_a_proj", "attn_q_a_norm": "self_attn.q_a_layernorm",
    "attn_q_b": "self_attn.q_b_proj", "attn_kv_a_mqa": "self_attn.kv_a_proj_with_mqa",
    "attn_kv_a_norm": "self_attn.kv_a_layernorm", "attn_kv_b": "self_attn.kv_b_proj", "attn_k_b": "self_attn.kv_b_proj",
    "attn_output": "self_attn.o_proj", "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj", "ffn_down": "mlp.down_proj",
    "ffn_gate_inp": "mlp.gate", "exp_probs_b": "mlp.gate", "ffn_gate_shexp": "mlp.shared_experts.gate_proj",
    "ffn_up_shexp": "mlp.shared_experts.up_proj", "ffn_down_shexp": "mlp.shared_experts.down_proj",
}  # fmt: skip
#: llama.cpp's expert gating functions (`LLAMA_EXPERT_GATING_FUNC_TYPE_*`)
_SOFTMAX, _SIGMOID = 1, 2


def value_half(block: str, name: str) -> str | None:
    """The HF name of the `kv_b_proj` whose value half block tensor `name` (`attn_v_b`) of block `block` is, else
    None."""
    return f"model.layers.{block}.self_attn.kv_b_proj.weight" if name == "attn_v_b" else None


def merge_kv_b(k_b: torch.Tensor, v_b: torch.Tensor) -> torch.Tensor:
    """HF's `kv_b_proj` [heads · (nope + v), kv_lora] from llama.cpp's halves: `k_b` [heads, kv_lora, nope] (HF order
    of the GGUF shape) and `v_b` [heads, v, kv_lora]; each head's key rows, then its value rows."""
    return torch.cat([k_b.transpose(1, 2), v_b], dim=1).reshape(-1, v_b.shape[2])


def merged_shape(k_b: list[int], v_b: list[int]) -> list[int]:
    """`merge_kv_b`'s output shape from the halves' HF-order shapes (checked before any data is read)."""
    return [k_b[0] * (k_b[2] + v_b[1]), k_b[1]]


def config(key: Callable[..., Any], layers: int, heads: int, has: Callable[[str], bool]) -> dict[str, Any]:
    """The DeepSeek-V3 HF config fields of a `deepseek2` file (`key(name, kind, default)` reads `deepseek2.{name}`;
    `has(HF name)`: whether the file holds a tensor). The dense layers are the leading blocks without a router (the
    `leading_dense_block_count` key is 0 in files converted from configs that name them by `mlp_layer_types`); the
    blocks past `block_count − nextn_predict_layers` are MTP layers.

    Raises:
        CheckpointError: softmax routing (DeepSeek-V2's; nextn's DeepSeek-V3 layer routes by sigmoid with a
            correction bias), a router without that bias, or RoPE scaling other than YaRN.
    """
    mtp = key("nextn_predict_layers", "count", 0) if key("nextn_predict_layers", "raw", 0) else 0
    main = layers - mtp
    dense = next((i for i in range(main) if has(f"model.layers.{i}.mlp.gate.weight")), main)
    experts = key("expert_count", "count", 0) if key("expert_count", "raw", 0) else 0
    gating = key("expert_gating_func", "raw", None)
    if experts and (gating == _SOFTMAX or not has(f"model.layers.{dense}.mlp.gate.e_score_correction_bias")):
        raise CheckpointError(f"deepseek2.expert_gating_func {gating!r}: softmax routing without a correction bias "
                              "(DeepSeek-V2) is not supported; nextn reads DeepSeek-V3's sigmoid routing "
                              "(DeepSeek-V3, Kimi-K2, GLM-4.7-Flash)")
    if gating not in (None, _SOFTMAX, _SIGMOID):
        raise CheckpointError(f"deepseek2.expert_gating_func {gating!r}: nextn reads sigmoid routing (2)")
    rope = key("rope.dimension_count", "count", None)
    mla = key("attention.key_length_mla", "raw", None) is not None  # else the lengths are MLA's own (older files)
    k_len = key("attention.key_length_mla" if mla else "attention.key_length", "count", None)
    v_len = key("attention.value_length_mla" if mla else "attention.value_length", "count", None)
    q_lora = key("attention.q_lora_rank", "count", 0) if key("attention.q_lora_rank", "raw", 0) else None
    norm = key("expert_weights_norm", "raw", None)
    out: dict[str, Any] = {
        "architectures": ["DeepseekV3ForCausalLM"], "model_type": "deepseek_v3",
        "num_hidden_layers": main, "num_nextn_predict_layers": mtp, "num_attention_heads": heads,
        "num_key_value_heads": heads, "q_lora_rank": q_lora, "kv_lora_rank": key("attention.kv_lora_rank", "count", None),
        "qk_rope_head_dim": rope, "qk_nope_head_dim": k_len - rope, "v_head_dim": v_len,
        "n_routed_experts": experts or None, "first_k_dense_replace": dense,
        "num_experts_per_tok": key("expert_used_count", "count", 1) if experts else 1,
        "moe_intermediate_size": key("expert_feed_forward_length", "count", 0) if experts else None,
        "n_shared_experts": key("expert_shared_count", "count", 0) if key("expert_shared_count", "raw", 0) else 0,
        "routed_scaling_factor": key("expert_weights_scale", "number", 1.0),
        "norm_topk_prob": bool(norm) if norm is not None else False,  # llama.cpp's default: not renormalised
        "n_group": key("expert_group_count", "count", 1) if key("expert_group_count", "raw", 0) else 1,
        "topk_group": key("expert_group_used_count", "count", 1) if key("expert_group_used_count", "raw", 0) else 1,
    }  # fmt: skip
    scaling = key("rope.scaling.type", "raw", "none")
    if scaling == "yarn":
        mscale_all_dim = key("rope.scaling.yarn_log_multiplier", "number", 0.0) / 0.1
        out["rope_scaling"] = {
            "rope_type": "yarn", "factor": key("rope.scaling.factor", "number", 1.0),
            "original_max_position_embeddings": key("rope.scaling.original_context_length", "count", 4096),
            "beta_fast": key("rope.scaling.yarn_beta_fast", "number", 32.0),
            "beta_slow": key("rope.scaling.yarn_beta_slow", "number", 1.0),
            # the file keeps mscale_all_dim only; DeepSeek-V3's and Kimi-K2's mscale equals it
            "mscale": mscale_all_dim or None, "mscale_all_dim": mscale_all_dim or None}
    elif scaling != "none":
        raise CheckpointError(f"deepseek2.rope.scaling.type {scaling!r}: nextn reads DeepSeek's YaRN or no scaling")
    return out
