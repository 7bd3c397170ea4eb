"""What each GGUF architecture nextn reads stores differently: the HF family it builds as, its tensor names, how
llama.cpp's `convert_hf_to_gguf.py` changed the values, and the metadata keys of its layer options.

Sources: llama.cpp's converter (`conversion/llama.py` `LlamaModel.permute`, `conversion/qwen.py` `Qwen2Model` /
`Qwen3Model`, `conversion/gemma.py` `Gemma3Model`: norm weights stored as 1 + w) and loader (`src/models/gemma3.cpp`:
every 6th layer full attention unless `{arch}.attention.sliding_window_pattern` says otherwise, sliding layers'
rope base `{arch}.rope.freq_base_swa` (default 10000), softmax scale 1/√head_dim (1/√(hidden/heads) at 62 layers)).
"""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import Any

import numpy as np

from nextn.build import gguf_deepseek2, gguf_gemma4, gguf_qwen35
from nextn.build.checkpoint import CheckpointError

#: GGUF `general.architecture` → the HF architecture nextn builds it as.
SUPPORTED_ARCHITECTURES = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM",
                           "gemma3": "Gemma3ForCausalLM", "smollm3": "SmolLM3ForCausalLM",
                           "granite": "GraniteForCausalLM",
                           "olmo2": "Olmo2ForCausalLM", "phi3": "Phi3ForCausalLM",
                           "gemma2": "Gemma2ForCausalLM", "exaone4": "Exaone4ForCausalLM",
                           "seed_oss": "SeedOssForCausalLM", "glm4": "Glm4ForCausalLM",
                           "qwen3moe": "Qwen3MoeForCausalLM", "qwen2moe": "Qwen2MoeForCausalLM",
                           "olmoe": "OlmoeForCausalLM", "glm4moe": "Glm4MoeForCausalLM",
                           "qwen35": "Qwen3_5ForCausalLM", "qwen3next": "Qwen3NextForCausalLM",
                           "qwen35moe": "Qwen3_5MoeForCausalLM",
                           "deepseek2": "DeepseekV3ForCausalLM", "gpt-oss": "GptOssForCausalLM",
                           "gemma4": "Gemma4ForCausalLM",
                           "gemma4-assistant": "Gemma4AssistantForCausalLM"}  # and Mixtral
#: Architectures whose q/k rows llama.cpp permutes at conversion (convert_hf_to_gguf.py `LlamaModel.permute`;
#: `SmolLM3Model` and `GraniteModel` are `LlamaModel`s).
PERMUTED_ARCHITECTURES = ("llama", "smollm3", "granite")
#: Architectures whose heads may rotate only their first `{arch}.rope.dimension_count` dims (Phi-4-mini: 0.75).
PARTIAL_ROTARY_ARCHITECTURES = ("phi3", "glm4", "glm4moe", "qwen35", "qwen3next", "qwen35moe", "deepseek2")
#: Hybrid architectures: Gated DeltaNet layers between attention ones (`gguf_qwen35`)
LINEAR_ATTENTION_ARCHITECTURES = ("qwen35", "qwen3next", "qwen35moe")
#: Those whose converter tiled the value heads (`_LinearAttentionVReorderBase`; not Qwen3-Next's)
V_REORDERED_ARCHITECTURES = ("qwen35", "qwen35moe")
#: Rope frequency factors stored as tensors, per architecture: Llama 3's scaling (`rope_freqs`), LongRoPE's short
#: and long factors (conversion/phi.py `Phi3MiniModel.generate_extra_tensors`).
FACTOR_TENSORS = {"llama": ("rope_freqs.weight",), "exaone4": ("rope_freqs.weight",),
                  "phi3": ("rope_factors_long.weight", "rope_factors_short.weight"),
                  "gemma4": ("rope_freqs.weight",),  # the full layers' proportional rope (`gguf_gemma4`)
                  "gemma4-assistant": ("rope_freqs.weight",)}
#: GGUF architectures of mixture-of-experts models nextn's MoE layer does not read yet (refused as MoE, by name).
MOE_ARCHITECTURES = frozenset({"mixtral",
                               "deepseek", "dbrx", "grok", "arctic", "granitemoe", "llama4", "bailingmoe",
                               "bailingmoe2", "ernie4_5-moe", "hunyuan-moe", "dots1", "smallthinker", "minimax-m2",
                               "afmoe", "lfm2moe", "grovemoe", "openai-moe"})

_GLOBAL_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
    **gguf_gemma4.GLOBAL_NAMES,
}
#: llama.cpp block tensor → HF module under `model.layers.N.` (Llama's layout)
_LLAMA_BLOCK = {
    "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj", "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj", "attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm",
}  # fmt: skip
_QK_NORMS = {"attn_q_norm": "self_attn.q_norm", "attn_k_norm": "self_attn.k_norm"}
#: Gemma's four norms: llama.cpp's `post_attention_norm` is HF's post_attention_layernorm (the attention output's),
#: its `ffn_norm` HF's pre_feedforward_layernorm, `post_ffw_norm` post_feedforward_layernorm.
_GEMMA_BLOCK = {**_LLAMA_BLOCK, **_QK_NORMS, "post_attention_norm": "post_attention_layernorm",
                "ffn_norm": "pre_feedforward_layernorm", "post_ffw_norm": "post_feedforward_layernorm"}
#: Phi-3: q, k and v as one `attn_qkv`, gate and up as one `ffn_up` (gate rows first), split by `StoredLayout`
_PHI3_BLOCK = {**_LLAMA_BLOCK, "attn_qkv": "self_attn.qkv_proj", "ffn_up": "mlp.gate_up_proj"}
#: OLMo 2's and EXAONE 4's: q/k norms and post-norms, no input norms
_POST_NORM_BLOCK = {**{k: v for k, v in _LLAMA_BLOCK.items() if k not in ("attn_norm", "ffn_norm")}, **_QK_NORMS,
                    "post_attention_norm": "post_attention_layernorm", "post_ffw_norm": "post_feedforward_layernorm"}
#: Seed-OSS: llama.cpp calls the pre-MLP norm (HF's post_attention_layernorm) `post_attention_norm`
_SEED_OSS_BLOCK = {**{k: v for k, v in _LLAMA_BLOCK.items() if k != "ffn_norm"},
                   "post_attention_norm": "post_attention_layernorm"}
#: GLM-4: fused gate_up as `ffn_up`; its sandwich norms under GLM's HF names (`StoredLayout` renames them)
_GLM4_BLOCK = {**_LLAMA_BLOCK, "ffn_up": "mlp.gate_up_proj", "post_attention_norm": "post_self_attn_layernorm",
               "ffn_norm": "post_attention_layernorm", "post_ffw_norm": "post_mlp_layernorm"}
#: An MoE block's router and shared expert (Qwen2-MoE: `ffn_*_shexp`, its sigmoid gate `ffn_gate_inp_shexp`)
_MOE_BLOCK = {"ffn_gate_inp": "mlp.gate", "ffn_gate_shexp": "mlp.shared_expert.gate_proj",
              "ffn_up_shexp": "mlp.shared_expert.up_proj", "ffn_down_shexp": "mlp.shared_expert.down_proj",
              "ffn_gate_inp_shexp": "mlp.shared_expert_gate"}
#: One-row weights HF stores as [1, in]: quantized files keep them 1-D (`llama-quantize` writes `ggml_n_dims`, which
#: drops a trailing 1; the converter's f32 / bf16 output keeps [1, in])
ONE_ROW = ("mlp.shared_expert_gate.weight",)


def hf_shape(hf_name: str, stored: list[int]) -> list[int]:
    """HF's shape of `hf_name` stored with shape `stored` (HF order): a one-row weight (`ONE_ROW`) as [1, in]."""
    return [1, *stored] if len(stored) == 1 and hf_name.endswith(ONE_ROW) else stored


#: An MTP layer's own tensors (llama.cpp's `blk.{N + i}.nextn.*`; conversion/glm.py, `Glm4MoeModel`), DeepSeek-V3's
#: HF names; its embedding and head copies are read as such and left out as every MTP copy is
_NEXTN = {"nextn.eh_proj": "eh_proj", "nextn.enorm": "enorm", "nextn.hnorm": "hnorm",
          "nextn.shared_head_norm": "shared_head.norm", "nextn.embed_tokens": "embed_tokens",
          "nextn.shared_head_head": "shared_head.head"}
#: GLM-4.5's: the pre-MLP norm as `post_attention_norm`, ungated shared experts, the router's correction bias
#: (`exp_probs_b.bias`: `TENSOR_NAMES`)
_GLM4_MOE_BLOCK = {**_SEED_OSS_BLOCK, **_QK_NORMS, **_NEXTN, "ffn_gate_inp": "mlp.gate", "exp_probs_b": "mlp.gate",
                   "ffn_gate_shexp": "mlp.shared_experts.gate_proj", "ffn_up_shexp": "mlp.shared_experts.up_proj",
                   "ffn_down_shexp": "mlp.shared_experts.down_proj"}
#: Block tensors whose HF name is not `<module>.<weight | bias>` (llama.cpp name without `blk.N.` → HF name without
#: `model.layers.N.`)
TENSOR_NAMES = {"exp_probs_b.bias": "mlp.gate.e_score_correction_bias", "attn_sinks.weight": "self_attn.sinks",
                **gguf_qwen35.TENSOR_NAMES, **gguf_gemma4.TENSOR_NAMES}
#: gpt-oss (conversion/gpt_oss.py): the pre-MLP norm as `post_attention_norm`, the attention sinks, a biased router;
#: its experts' biases are 2-D [E, out] tensors beside their 3-D weights (`expert_names`)
_GPT_OSS_BLOCK = {**_SEED_OSS_BLOCK, "attn_sinks": "self_attn.sinks", "ffn_gate_inp": "mlp.gate"}
#: The experts' 3-D tensors [E, out, in] (HF order) → each expert's projection (`expert_names`)
EXPERT_TENSORS = {"ffn_gate_exps": "gate_proj", "ffn_up_exps": "up_proj", "ffn_down_exps": "down_proj"}
#: Whether an MoE architecture renormalises its top-k probabilities (llama.cpp's src/models/<arch>.cpp: the `norm_w`
#: argument of `build_moe_ffn`; `{arch}.expert_weights_norm` overrides where a file writes it)
NORM_TOPK = {"qwen3moe": True, "llama": True, "qwen2moe": False, "olmoe": False, "qwen3next": True,
             "qwen35moe": True, "gpt-oss": True}  # Qwen3.5-MoE always renormalises (HF `Qwen3_5MoeTopKRouter`)
BLOCK_NAMES = {"qwen3moe": {**_LLAMA_BLOCK, **_QK_NORMS, **_MOE_BLOCK}, "qwen2moe": {**_LLAMA_BLOCK, **_MOE_BLOCK},
               "olmoe": {**_LLAMA_BLOCK, **_QK_NORMS, **_MOE_BLOCK}, "phi3": _PHI3_BLOCK, "glm4": _GLM4_BLOCK,
               "glm4moe": _GLM4_MOE_BLOCK, "qwen35": gguf_qwen35.BLOCK, "deepseek2": {**gguf_deepseek2.BLOCK, **_NEXTN},
               # Qwen3-Next: its b / a projection stored fused per key head as HF has it (`ssm_ba`)
               "qwen3next": {**gguf_qwen35.BLOCK, **_MOE_BLOCK, "ssm_ba": "linear_attn.in_proj_ba"},
               "qwen35moe": {**gguf_qwen35.BLOCK, **_MOE_BLOCK},
               "olmo2": _POST_NORM_BLOCK, "exaone4": _POST_NORM_BLOCK, "seed_oss": _SEED_OSS_BLOCK,
               "llama": {**_LLAMA_BLOCK, **_MOE_BLOCK}, "qwen2": _LLAMA_BLOCK, "qwen3": {**_LLAMA_BLOCK, **_QK_NORMS},
               "gemma2": _GEMMA_BLOCK, "gemma3": _GEMMA_BLOCK, "smollm3": _LLAMA_BLOCK, "granite": _LLAMA_BLOCK,
               "gpt-oss": _GPT_OSS_BLOCK, "gemma4": gguf_gemma4.BLOCK,
               "gemma4-assistant": gguf_gemma4.BLOCK}


#: A block tensor's llama.cpp name: `blk.N.<name>.<weight | bias>` (nextn.*: an MTP layer's own tensors), or without
#: the suffix (qwen35's `ssm_a`)
BLOCK_RE = re.compile(r"blk\.(\d+)\.(\w+|nextn\.\w+)\.(weight|bias)")
_BARE_RE = re.compile(r"blk\.(\d+)\.(\w+)")


def hf_name(gguf_name: str, arch: str = "llama") -> str | None:
    """The HF name of a llama.cpp tensor name of an `arch` file (`blk.3.attn_q.weight` →
    `model.layers.3.self_attn.q_proj.weight`; Gemma's `blk.3.ffn_norm.weight` → `...pre_feedforward_layernorm.weight`),
    or None for a tensor the family does not have."""
    names = global_names()
    if gguf_name in names:
        return names[gguf_name]
    m = BLOCK_RE.fullmatch(gguf_name)
    block = BLOCK_NAMES.get(arch, {})
    if m and f"{m[2]}.{m[3]}" in TENSOR_NAMES and m[2] in block:
        return f"model.layers.{m[1]}.{TENSOR_NAMES[f'{m[2]}.{m[3]}']}"
    if m and m[2] in block:
        return f"model.layers.{m[1]}.{block[m[2]]}.{m[3]}"
    bare = _BARE_RE.fullmatch(gguf_name)  # a block tensor without .weight / .bias (qwen35's `ssm_a`)
    if bare and bare[2] in TENSOR_NAMES and bare[2] in block:
        return f"model.layers.{bare[1]}.{TENSOR_NAMES[bare[2]]}"
    return None


def global_names() -> dict[str, str]:
    """llama.cpp's names of the tensors outside the blocks → HF names."""
    return dict(_GLOBAL_NAMES)


def expert_names(block: str, name: str, count: int, param: str = "weight") -> list[str] | None:
    """The HF names of the `count` experts' slices of llama.cpp block tensor `name`.`param` of block `block`
    (`ffn_gate_exps` → `model.layers.N.mlp.experts.{e}.gate_proj.weight`, e < count; gpt-oss's biases, `param`
    "bias", likewise), or None for a tensor that holds no experts."""
    proj = EXPERT_TENSORS.get(name)
    if proj is None:
        return None
    return [f"model.layers.{block}.mlp.experts.{e}.{proj}.{param}" for e in range(count)]


def moe_config(arch: str, key: Callable[..., Any]) -> dict[str, Any]:
    """The HF config fields of an MoE GGUF's experts (`{arch}.expert_count`, `expert_used_count`,
    `expert_feed_forward_length`, `expert_shared_feed_forward_length`; `key` as in `family_config`), Mixtral's
    architecture for a llama file with experts; {} for a dense file."""
    experts = key("expert_count", "raw", 0)
    if not experts:
        return {}

    def optional(name: str) -> int | None:
        return key(name, "count", None) if key(name, "raw", None) is not None else None

    norm = key("expert_weights_norm", "raw", None)
    out = {"num_experts": key("expert_count", "count", None),
           "num_experts_per_tok": key("expert_used_count", "count", None),
           "moe_intermediate_size": optional("expert_feed_forward_length") or key("feed_forward_length", "count", None),
           "norm_topk_prob": NORM_TOPK.get(arch, False) if norm is None else bool(norm),
           "shared_expert_intermediate_size": optional("expert_shared_feed_forward_length")}
    if arch == "llama":
        out.update(architectures=["MixtralForCausalLM"], model_type="mixtral")
    return out


def unsupported(path: Any, arch: str) -> str:
    """The refusal of a GGUF of architecture `arch`: an MoE one says so."""
    if arch in MOE_ARCHITECTURES:
        return (f"{path}: GGUF architecture {arch!r} is a mixture-of-experts model, which nextn does not build yet; "
                f"nextn reads {', '.join(SUPPORTED_ARCHITECTURES)} (Mixtral as llama)")
    return f"{path}: unsupported GGUF architecture {arch!r}; nextn reads {', '.join(SUPPORTED_ARCHITECTURES)}"


def rope_scaling_config(arch: str, scaling: str, key: Callable[..., Any]) -> dict[str, Any] | None:
    """HF's `rope_scaling` of a GGUF whose `{arch}.rope.scaling.type` is `scaling` (`key` as in `family_config`):
    none, linear (`rope.scaling.factor`) or YaRN as `convert_hf_to_gguf.py` writes it (`TextModel.set_gguf_parameters`:
    `rope.scaling.factor`, `.original_context_length`, and where the config set them `.yarn_beta_fast`,
    `.yarn_beta_slow`, `.yarn_attn_factor` — HF's `attention_factor`).

    Raises:
        ValueError: any other scaling type (the message names it).
    """
    if scaling == "none":
        return None
    if scaling == "linear":
        return {"rope_type": "linear", "factor": key("rope.scaling.factor", "number", 1.0)}
    if scaling != "yarn":
        raise ValueError(f"{arch}.rope.scaling.type {scaling!r} is not supported (nextn reads GGUFs with plain, "
                         "linear or YaRN RoPE scaling, and Llama 3's rope_freqs)")
    out = {"rope_type": "yarn", "factor": key("rope.scaling.factor", "number", 1.0),
           "original_max_position_embeddings": key("rope.scaling.original_context_length", "count", None)}
    for name, hf in (("yarn_beta_fast", "beta_fast"), ("yarn_beta_slow", "beta_slow"),
                     ("yarn_attn_factor", "attention_factor")):
        if key(f"rope.scaling.{name}", "raw", None) is not None:
            out[hf] = key(f"rope.scaling.{name}", "number", None)
    return out


def norm_shift(arch: str, hf_name: str) -> float:
    """What llama.cpp's converter added to tensor `hf_name` of an `arch` file (Gemma's RMSNorm weights: 1.0, since
    `Gemma3RMSNorm` scales by 1 + w), subtracted again when reading. 0.0 for everything else."""
    if arch in LINEAR_ATTENTION_ARCHITECTURES:
        return gguf_qwen35.norm_shift(hf_name)
    return 1.0 if arch in ("gemma2", "gemma3") and hf_name.endswith("norm.weight") else 0.0


def factor_values(t: Any, count: int, path: Any, what: str = "rotary_dim // 2") -> list[float] | None:
    """A rope factor tensor's `count` float32 values (`what`: how the count is derived, for the message; None when
    `t` is None).

    Raises:
        CheckpointError: the tensor is not F32, holds another count, or a value that is not finite and positive.
    """
    if t is None:
        return None
    values = np.asarray(t.data).reshape(-1)
    if t.tensor_type.name != "F32" or values.size != count or not np.all(np.isfinite(values)) or not np.all(values > 0):
        raise CheckpointError(f"{path}: {t.name} must be {count} positive F32 values ({what}), got {values.size} "
                              f"of type {t.tensor_type.name}")
    return [float(v) for v in values.astype(np.float32)]


def family_config(arch: str, key: Callable[..., Any], layers: int, hidden: int, heads: int, head_dim: int,
                  factors: Callable[[str, int], list[float] | None] = lambda name, n: None,
                  has: Callable[[str], bool] = lambda name: False) -> dict[str, Any]:
    """The HF config fields of `arch`'s layer options from its GGUF metadata (`key(name, kind, default)` reads
    `{arch}.{name}` as "count", "number" or "raw" (any value); `factors(tensor name, count)` a factor tensor's
    values; `has(HF name)` whether the file holds a tensor); {} for the Llama layout."""
    if arch == "glm4moe":
        return _glm4moe(key, layers, head_dim, has)
    if arch == "deepseek2":
        return gguf_deepseek2.config(key, layers, heads, has)
    if arch in LINEAR_ATTENTION_ARCHITECTURES:
        return gguf_qwen35.config(key, layers, head_dim)
    if arch == "phi3":
        return _phi3(key, head_dim, factors)
    if arch == "gpt-oss":
        return _gpt_oss(key, layers)
    if arch in ("gemma4", "gemma4-assistant"):
        return gguf_gemma4.config(key, layers, factors, has)
    if arch == "glm4":  # conversion/glm.py: rope.dimension_count = head_dim × partial_rotary_factor
        return {"partial_rotary_factor": key("rope.dimension_count", "count", head_dim) / head_dim}
    if arch in ("exaone4", "olmo2"):  # exaone.py, olmo.py (OLMo 3 is written as olmo2): a window, a bool a layer
        window = key("attention.sliding_window", "count", 0) if key("attention.sliding_window", "raw", None) else 0
        pattern = key("attention.sliding_window_pattern", "raw", None)
        if not window or not isinstance(pattern, list):
            return {"sliding_window": None}
        return {"sliding_window": window,
                "layer_types": ["sliding_attention" if p else "full_attention" for p in pattern][:layers]}
    if arch == "gemma2":  # llama.cpp's gemma2.cpp: every other layer sliding from the first; the 27B's (46 layers)
        window = key("attention.sliding_window", "count", 4096)  # softmax scale 1/√(hidden/heads), else 1/√head_dim
        return {"hidden_activation": "gelu_pytorch_tanh", "sliding_window": window,
                "query_pre_attn_scalar": hidden // heads if layers == 46 else head_dim,
                "layer_types": ["sliding_attention" if i % 2 == 0 else "full_attention" for i in range(layers)],
                "attn_logit_softcapping": key("attn_logit_softcapping", "number", 50.0) or None,
                "final_logit_softcapping": key("final_logit_softcapping", "number", 30.0) or None}
    if arch == "smollm3":  # llama.cpp's smollm3.cpp: no RoPE on every 4th layer, a fixed step (no metadata key)
        return {"no_rope_layers": [int((i + 1) % 4 != 0) for i in range(layers)]}
    if arch == "granite":  # conversion/granite.py writes HF's *_multiplier as llama.cpp's *_scale keys
        return {"embedding_multiplier": key("embedding_scale", "number", 1.0),
                "attention_multiplier": key("attention.scale", "number", 1.0),
                "residual_multiplier": key("residual_scale", "number", 1.0),
                "logits_scaling": key("logit_scale", "number", 1.0)}
    if arch != "gemma3":
        return {}
    window = key("attention.sliding_window", "count", 0)
    pattern = key("attention.sliding_window_pattern", "raw", 6)
    if isinstance(pattern, list):  # one bool a layer: sliding or not (llama.cpp `is_swa_impl`)
        types = ["sliding_attention" if p else "full_attention" for p in pattern][:layers]
    else:
        n = int(pattern)
        types = ["sliding_attention" if n == 0 or i % n < n - 1 else "full_attention" for i in range(layers)]
    full = {"rope_type": "default", "rope_theta": key("rope.freq_base", "number", 1_000_000.0)}
    if key("rope.scaling.type", "raw", "none") == "linear":
        full.update(rope_type="linear", factor=key("rope.scaling.factor", "number", 1.0))
    return {
        "hidden_activation": "gelu_pytorch_tanh",
        "query_pre_attn_scalar": hidden // heads if layers == 62 else head_dim,
        "sliding_window": window or None,
        "layer_types": types if window else ["full_attention"] * layers,
        "rope_parameters": {"full_attention": full, "sliding_attention": {
            "rope_type": "default", "rope_theta": key("rope.freq_base_swa", "number", 10_000.0)}},
    }  # fmt: skip


def _glm4moe(key: Callable[..., Any], layers: int, head_dim: int, has: Callable[[str], bool]) -> dict[str, Any]:
    """GLM-4.5's fields as `Glm4MoeConfig` names them (conversion/glm.py `Glm4MoeModel.set_gguf_parameters`; the
    experts' counts and top-k renormalisation are `moe_config`'s). Raises CheckpointError: a gating function other
    than sigmoid (llama.cpp's `LLAMA_EXPERT_GATING_FUNC_TYPE_SIGMOID` = 2). `block_count` counts the MTP layers the
    converter embeds (`nextn_predict_layers`, the last blocks)."""
    mtp = key("nextn_predict_layers", "count", 0) if key("nextn_predict_layers", "raw", 0) else 0
    gating = key("expert_gating_func", "raw", 2)
    if gating != 2:
        raise CheckpointError(f"glm4moe.expert_gating_func {gating!r}: nextn reads GLM-4.5's sigmoid routing (2)")
    return {"partial_rotary_factor": key("rope.dimension_count", "count", head_dim) / head_dim,
            "n_shared_experts": key("expert_shared_count", "count", 0) if key("expert_shared_count", "raw", 0) else 0,
            "first_k_dense_replace": key("leading_dense_block_count", "count", 0)
            if key("leading_dense_block_count", "raw", 0) else 0,
            "routed_scaling_factor": key("expert_weights_scale", "number", 1.0),
            "n_group": key("expert_group_count", "count", 1), "topk_group": key("expert_group_used_count", "count", 1),
            "use_qk_norm": has("model.layers.0.self_attn.q_norm.weight"),
            "num_hidden_layers": layers - mtp, "num_nextn_predict_layers": mtp}


def _gpt_oss(key: Callable[..., Any], layers: int) -> dict[str, Any]:
    """gpt-oss's window and layers as llama.cpp runs them (src/models/openai-moe.cpp: `load_swa_pattern(ml, 2)`,
    every other layer sliding from the first) and its YaRN, whose ramp HF's `GptOssConfig` leaves untruncated (the
    file does not say so). The clamped SwiGLU's alpha and limit are not in the file either: llama.cpp uses gpt-oss's
    1.702 and 7 (src/llama-graph.cpp, `LLM_FFN_SWIGLU_OAI_MOE`), and so does nextn reading it (HF's defaults)."""
    scaling = rope_scaling_config("gpt-oss", key("rope.scaling.type", "raw", "none"), key)
    return {"sliding_window": key("attention.sliding_window", "count", 128),
            "layer_types": ["sliding_attention" if i % 2 == 0 else "full_attention" for i in range(layers)],
            "rope_scaling": {**scaling, "truncate": False} if scaling and scaling["rope_type"] == "yarn" else scaling}


def _phi3(key: Callable[..., Any], head_dim: int, factors: Callable[[str, int], list[float] | None]) -> dict[str, Any]:
    """Phi-3's partial rotary (`rope.dimension_count`), window (`attention.sliding_window`, 0: none) and LongRoPE
    (the two factor tensors, `rope.scaling.original_context_length`, `rope.scaling.attn_factor`)."""
    rotary = key("rope.dimension_count", "count", head_dim)
    out: dict[str, Any] = {"partial_rotary_factor": rotary / head_dim,
                           "sliding_window": key("attention.sliding_window", "raw", 0) or None}
    long, short = factors("rope_factors_long.weight", rotary // 2), factors("rope_factors_short.weight", rotary // 2)
    if long is not None or short is not None:
        orig = key("rope.scaling.original_context_length", "count", None)
        out["rope_parameters"] = {
            "rope_type": "longrope", "rope_theta": key("rope.freq_base", "number", 10000.0),
            "long_factor": long or short, "short_factor": short or long, "original_max_position_embeddings": orig,
            "attention_factor": key("rope.scaling.attn_factor", "number", 1.0)}
    return out
