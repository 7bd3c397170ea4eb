"""What each dense family adds to the Llama layer, read from its HF `config.json`: the layer options of
`LlamaModelConfig` and the rotary settings, one function per architecture (Mistral, Qwen2/Qwen3, SmolLM3, Granite and
Phi-3 differ from Llama only in biases, q/k norms, sliding windows, NoPE layers, multipliers and rotary settings).

A family is a config + a weight map + layer options (docs/ARCHITECTURE.md, "Adding a model family"): the module
(`model.py`) and the weight layout (`weights.py`) read these options; nothing is copied per family. Defaults follow
the `transformers` 5.23 config classes (`LlamaConfig`, `Qwen2Config`, `Qwen3Config`, `Gemma3TextConfig`), so an older
`config.json` that leaves a field out reads as `transformers` reads it.
"""

from __future__ import annotations

from typing import Any
from nextn.models import yarn
from nextn.models.config import ConfigError
import math

from nextn.models.llama.rope_config import Llama3RopeScaling, LinearRopeScaling, LongRopeScaling, YarnRopeScaling


def family_options(arch: str, hf: dict[str, Any]) -> dict[str, Any]:
    """The layer options and rotary fields of architecture `arch` for `LlamaModelConfig`, from the HF dict `hf`.

    Raises:
        ConfigError: a setting the family supports in `transformers` but nextn does not (Gemma's bidirectional
            attention, a rope type other than default, llama3, linear and longrope); the message names the field.
    """
    if arch == "Gemma3ForCausalLM":
        return _gemma3(hf)
    if arch == "Gemma2ForCausalLM":
        return _gemma2(hf)
    if arch == "Gemma4ForCausalLM":
        return _gemma4(hf)
    theta, scaling = rope_from_hf(hf, arch)
    options: dict[str, Any] = {"rope_theta": theta, "rope_scaling": scaling, **_windows(arch, hf)}
    local = (hf.get("rope_parameters") or {}).get("sliding_attention")
    if isinstance(local, dict) and options.get("layer_types"):  # sliding layers with a rope of their own
        local_theta, local_scaling = rope_from_hf({"rope_parameters": local}, arch)
        if local_scaling is not None:
            raise ConfigError(f"{arch}: rope scaling on sliding_attention layers is not supported")
        if local_theta != theta:
            options["rope_local_theta"] = local_theta
    if arch == "Qwen2ForCausalLM":
        options["qkv_bias"] = bool(hf.get("qkv_bias", True))  # Qwen2Attention: q/k/v biased, o not
    if arch == "Qwen3ForCausalLM":
        options["qk_norm"] = True
    if arch == "SeedOssForCausalLM":  # SeedOssAttention: q/k/v biased (`attention_bias`), o only with attention_out_bias
        options.update(attention_bias=bool(hf.get("attention_out_bias", False)),
                       qkv_bias=bool(hf.get("attention_bias", True)) or bool(hf.get("qkv_bias")))
    if arch in ("Olmo2ForCausalLM", "Olmo3ForCausalLM"):  # Olmo2DecoderLayer / Olmo2Attention / Olmo2RMSNorm
        options.update(qk_norm=True, qk_norm_over="all_heads", norm_style="fp32_weight", norm_placement="post")
    if arch == "GraniteForCausalLM":  # GraniteConfig's multipliers, 1.0 by default
        options.update(embedding_multiplier=float(hf.get("embedding_multiplier") or 1.0),
                       attention_multiplier=float(hf.get("attention_multiplier") or 1.0),
                       residual_multiplier=float(hf.get("residual_multiplier") or 1.0),
                       logits_scaling=float(hf.get("logits_scaling") or 1.0))
    if arch == "Exaone4ForCausalLM":  # Exaone4Attention / Exaone4DecoderLayer: q/k norms, post-norms
        options.update(qk_norm=True, norm_placement="post", **_exaone4_layers(hf))
    if arch == "Glm4ForCausalLM":  # Glm4DecoderLayer: sandwich norms (renamed on reading), fused gate_up, biased
        options.update(norm_placement="sandwich", rotary_dim=_rotary_dim({"partial_rotary_factor": 0.5, **hf}),
                       rope_interleaved=True, attention_bias=False,
                       qkv_bias=bool(hf.get("qkv_bias")) or bool(hf.get("attention_bias", True)))
    if arch == "Phi3ForCausalLM":  # Phi3Attention / Phi3MLP: fused qkv_proj and gate_up_proj (split on reading)
        options["rotary_dim"] = _rotary_dim(hf)
    if arch == "SmolLM3ForCausalLM":
        layers, every = hf.get("num_hidden_layers"), int(hf.get("no_rope_layer_interval") or 4)
        nope = hf.get("no_rope_layers")
        if nope is None and type(layers) is int:
            nope = [int((i + 1) % every != 0) for i in range(layers)]
        options.update(no_rope_layers=nope, tie_word_embeddings=hf.get("tie_word_embeddings", True))
    if arch in _MOE:
        options.update(_moe(arch, hf))
    if arch in _HYBRID:
        options.update(_qwen3_5(hf))
    if arch in _MOE and arch in _HYBRID:  # the MTP layer an MoE block like the others; no dense MLP in Qwen3.5-MoE
        options.update(mtp_moe=True, intermediate_size=hf.get("intermediate_size") or hf.get("moe_intermediate_size"))
    return options


def _qwen3_5(hf: dict[str, Any]) -> dict[str, Any]:
    """Qwen3.5 text (`Qwen3_5ForCausalLM`, model_type qwen3_5_text; HF `Qwen3_5TextConfig`'s defaults) and
    Qwen3-Next (`Qwen3NextForCausalLM`: the same layers, a Qwen2-MoE-style MLP of routed experts and a sigmoid-gated
    shared expert, `_moe`; its linear-attention projections stored fused, split by `stored_layout`) and Qwen3.5-MoE
    (`Qwen3_5MoeForCausalLM`: Qwen3.5's projections, Qwen3-Next's MLP, top-k always renormalised): three Gated
    DeltaNet layers then one gated-attention layer (`full_attention_interval` 4, or `layer_types`); norms scale by
    (1 + weight); q/k norms; a quarter of each head rotated (`partial_rotary_factor` 0.25, in (j, j + d/2) pairs:
    for text the multimodal rope's three position axes are equal, so it is the plain rotation); attention output
    gated by sigmoid(gate) (Qwen Team 2025, "Qwen3-Next"; HF `modeling_qwen3_5.py`). Its MTP layer (`mtp.*`,
    `mtp_num_hidden_layers` 1) is read as nextn's MTP module (`stored_layout`)."""
    layers = hf.get("num_hidden_layers")
    types = hf.get("layer_types")
    if types is None and type(layers) is int:
        every = int(hf.get("full_attention_interval") or 4)
        types = ["linear_attention" if (i + 1) % every else "full_attention" for i in range(layers)]
    params = dict(hf.get("rope_parameters") or {})
    mtp = hf.get("mtp_num_hidden_layers") or 0
    if mtp not in (0, 1):  # its released layout: one fc and norm pair, then the layers (nextn's module: one each)
        raise ConfigError(f"mtp_num_hidden_layers={mtp!r}: nextn reads one Qwen3.5 / Qwen3-Next MTP layer")
    return {"layer_types": types, "qk_norm": True, "norm_style": "unit_offset", "attn_output_gate": True,
            "num_nextn_predict_layers": mtp, "mtp_chain_normed": bool(hf.get("mtp_chain_normed", True)),
            "head_dim": hf.get("head_dim") or 256,
            "rotary_dim": _rotary_dim({**hf, "head_dim": hf.get("head_dim") or 256,
                                       "rope_parameters": {"partial_rotary_factor": 0.25, **params}})}


#: The mixture-of-experts architectures: their attention's options (the MoE MLP is `models/moe.py`'s)
_MOE = {"Qwen3MoeForCausalLM": {"qk_norm": True}, "Qwen2MoeForCausalLM": {"qkv_bias": True},
        "MixtralForCausalLM": {}, "OlmoeForCausalLM": {"qk_norm": True, "qk_norm_over": "all_heads"},
        "Glm4MoeForCausalLM": {}, "Qwen3NextForCausalLM": {}, "Qwen3_5MoeForCausalLM": {"norm_topk_prob": True},
        "GptOssForCausalLM": {}}
#: The hybrid architectures: Gated DeltaNet layers between gated attention ones (`_qwen3_5`)
_HYBRID = ("Qwen3_5ForCausalLM", "Qwen3NextForCausalLM", "Qwen3_5MoeForCausalLM")


def _moe(arch: str, hf: dict[str, Any]) -> dict[str, Any]:
    """An MoE family's options: its attention's (`_MOE`) and the experts' (HF `Qwen3MoeConfig`, `Qwen2MoeConfig`,
    `MixtralConfig` — `num_local_experts`, top-k always renormalised —, `OlmoeConfig`; in these two the expert
    width is `intermediate_size`).

    Raises:
        ConfigError: OLMoE's `clip_qkv` (clamped q/k/v), which nextn's attention does not apply.
    """
    if hf.get("clip_qkv") is not None:
        raise ConfigError(f"{arch} with clip_qkv {hf['clip_qkv']!r} (q/k/v clamped) is not supported")
    experts = hf.get("num_experts", hf.get("num_local_experts"))
    out: dict[str, Any] = {**_MOE[arch], "num_experts": experts}
    if arch in ("MixtralForCausalLM", "OlmoeForCausalLM"):  # every layer MoE, experts of intermediate_size
        out["moe_intermediate_size"] = hf.get("intermediate_size")
    if arch == "MixtralForCausalLM":
        out["norm_topk_prob"] = True
    if arch == "Glm4MoeForCausalLM":
        out.update(_glm4_moe(hf))
    if arch == "GptOssForCausalLM":
        out.update(_gpt_oss(hf))
    if arch not in ("MixtralForCausalLM", "GptOssForCausalLM") and not _windows(arch, hf):
        out["sliding_window"] = None  # Qwen2-MoE writes 0 or a window it does not use
    return out


def _gpt_oss(hf: dict[str, Any]) -> dict[str, Any]:
    """gpt-oss (`GptOssForCausalLM`; HF `GptOssConfig`'s defaults, OpenAI 2025 "gpt-oss-120b & gpt-oss-20b Model
    Card"): q/k/v/o biased, a learned attention sink per head, sliding (window 128) and full layers alternating from
    a sliding first, every layer MoE with experts of `intermediate_size`, a biased router whose top-k logits are
    softmaxed (= the top-k of the softmax renormalised), biased experts with the clamped SwiGLU (alpha 1.702,
    limit 7); YaRN rope (`rope_parameters`: factor 32 over 4,096, untruncated ramp); norms bf16(x̂ · w) in fp32
    (`GptOssRMSNorm`)."""
    layers = hf.get("num_hidden_layers")
    window = hf.get("sliding_window", 128)
    types = hf.get("layer_types")
    if types is None and type(layers) is int:
        types = ["sliding_attention" if (i + 1) % 2 else "full_attention" for i in range(layers)]
    return {"attention_bias": bool(hf.get("attention_bias", True)), "attn_sinks": True, "norm_style": "fp32_weight",
            "sliding_window": window if types and "sliding_attention" in types else None, "layer_types": types,
            "moe_intermediate_size": hf.get("intermediate_size"), "norm_topk_prob": True, "router_bias": True,
            "expert_act": "clamped_swiglu", "swiglu_alpha": float(hf.get("swiglu_alpha") or 1.702),
            "swiglu_limit": float(hf.get("swiglu_limit") or 7.0)}


def _glm4_moe(hf: dict[str, Any]) -> dict[str, Any]:
    """GLM-4.5 / 4.6 (`Glm4MoeForCausalLM`; HF `Glm4MoeConfig`'s defaults): q/k/v biased by `attention_bias`, o never;
    optional q/k norms; half of each head rotated in (j, j + d/4) pairs (`partial_rotary_factor` 0.5); the first
    `first_k_dense_replace` layers dense, the rest sigmoid-routed over expert groups with shared experts."""
    first = hf.get("first_k_dense_replace", 1)
    layers = hf.get("num_hidden_layers")
    return {"qkv_bias": bool(hf.get("attention_bias")) or bool(hf.get("qkv_bias")), "attention_bias": False,
            "qk_norm": bool(hf.get("use_qk_norm", False)),
            "rotary_dim": _rotary_dim({**hf, "rope_parameters": {"partial_rotary_factor": 0.5,
                                                                 **(hf.get("rope_parameters") or {})}}),
            "num_experts": hf.get("n_routed_experts", hf.get("num_experts", 128)),
            "norm_topk_prob": bool(hf.get("norm_topk_prob", True)), "moe_router": "sigmoid_grouped",
            "n_group": hf.get("n_group") or 1, "topk_group": hf.get("topk_group") or 1,
            "routed_scaling_factor": float(hf.get("routed_scaling_factor") or 1.0),
            "n_shared_experts": hf.get("n_shared_experts", 1),
            "mlp_only_layers": tuple(range(min(first, layers))) if type(first) is int and type(layers) is int else (),
            # its MTP layers (`model.layers.{num_hidden_layers + i}`: DeepSeek-V3's module with an MoE block)
            "num_nextn_predict_layers": hf.get("num_nextn_predict_layers", hf.get("num_mtp_layers", 0)),
            "mtp_moe": True, "mtp_chain_normed": bool(hf.get("mtp_chain_normed", True))}


def _windows(arch: str, hf: dict[str, Any]) -> dict[str, Any]:
    """`sliding_window` and `layer_types` where the family's `transformers` attention uses a window: Mistral on every
    layer when `sliding_window` is set (`MistralConfig`: 4096 by default; Mistral 7B v0.2+ and Ministral leave it
    null), Qwen2/Qwen3 on the layers from `max_window_layers` on when `use_sliding_window` (their `layer_types`)."""
    layers = hf.get("num_hidden_layers")
    window = hf.get("sliding_window", 4096 if arch == "MistralForCausalLM" else None)
    if type(layers) is not int or not window:  # a GGUF writes no window as 0
        return {}
    if arch in ("MistralForCausalLM", "Phi3ForCausalLM", "MixtralForCausalLM"):  # Phi3Model: a window on every layer when set
        return {"sliding_window": window, "layer_types": ["sliding_attention"] * layers}
    if arch in ("Olmo2ForCausalLM", "Olmo3ForCausalLM"):  # OLMo 3: 3 sliding layers : 1 full (`Olmo3Config`)
        types = hf.get("layer_types")
        if types is None and arch == "Olmo2ForCausalLM":
            return {}
        return {"sliding_window": window, "layer_types": types or ["sliding_attention" if (i + 1) % 4 else
                                                                   "full_attention" for i in range(layers)]}
    if arch in ("Qwen2ForCausalLM", "Qwen3ForCausalLM", "SmolLM3ForCausalLM", "Qwen2MoeForCausalLM",
                "Qwen3MoeForCausalLM") and hf.get("use_sliding_window"):
        first = hf.get("max_window_layers", 28)
        types = hf.get("layer_types") or ["sliding_attention" if i >= first else "full_attention"
                                          for i in range(layers)]
        return {"sliding_window": window, "layer_types": types}
    return {}


def _gemma3(hf: dict[str, Any]) -> dict[str, Any]:
    """Gemma 3 text (`Gemma3ForCausalLM`, model_type gemma3_text): sandwich norms scaling by (1 + weight), q/k norms,
    embeddings × √hidden, GELU-tanh, a softmax scale from `query_pre_attn_scalar`, every 6th layer full attention and
    the rest sliding with their own rope base (Gemma Team 2025, "Gemma 3 Technical Report", §2)."""
    if hf.get("use_bidirectional_attention"):
        raise ConfigError("Gemma3ForCausalLM with use_bidirectional_attention: true (an embedding model) is not a "
                          "causal LM nextn builds")
    layers = hf.get("num_hidden_layers")
    types = hf.get("layer_types")
    if types is None and type(layers) is int:
        pattern = int(hf.get("sliding_window_pattern") or hf.get("_sliding_window_pattern") or 6)
        types = ["sliding_attention" if (i + 1) % pattern else "full_attention" for i in range(layers)]
    params = hf.get("rope_parameters") or {}
    if "full_attention" in params or "sliding_attention" in params:  # transformers 5: per layer type
        full, local = dict(params.get("full_attention") or {}), dict(params.get("sliding_attention") or {})
    else:  # older releases: rope_theta (+ rope_scaling) for full layers, rope_local_base_freq for sliding ones
        full = {**(hf.get("rope_scaling") or {}), "rope_theta": hf.get("rope_theta")}
        local = {"rope_theta": hf.get("rope_local_base_freq")}
    full.setdefault("rope_theta", None)
    theta, scaling = rope_from_hf({"rope_parameters": {**full, "rope_theta": full["rope_theta"] or 1_000_000.0}},
                                  "Gemma3ForCausalLM")
    local_theta, local_scaling = rope_from_hf({"rope_parameters": {**local,
                                                                   "rope_theta": local.get("rope_theta") or 10_000.0}},
                                              "Gemma3ForCausalLM")
    if local_scaling is not None:
        raise ConfigError("Gemma3ForCausalLM: rope scaling on sliding_attention layers is not supported")
    hidden = hf.get("hidden_size")
    return {
        "rope_theta": theta, "rope_scaling": scaling, "rope_local_theta": local_theta,
        "qk_norm": True, "norm_style": "unit_offset", "norm_placement": "sandwich",
        "embedding_multiplier": float(hidden) ** 0.5 if type(hidden) is int and hidden > 0 else None,
        "hidden_act": hf.get("hidden_activation") or hf.get("hidden_act") or "gelu_pytorch_tanh",
        "query_pre_attn_scalar": hf.get("query_pre_attn_scalar", 256),
        "sliding_window": hf.get("sliding_window", 4096), "layer_types": types,
        "tie_word_embeddings": hf.get("tie_word_embeddings", True),
        "rms_norm_eps": hf.get("rms_norm_eps") or 1e-6,
        "head_dim": hf.get("head_dim") or 256,
        "attn_logit_softcapping": hf.get("attn_logit_softcapping"),  # null in Gemma 3 releases
        "final_logit_softcapping": hf.get("final_logit_softcapping"),
    }  # fmt: skip


def _gemma2(hf: dict[str, Any]) -> dict[str, Any]:
    """Gemma 2 (`Gemma2ForCausalLM`): Gemma 3's layer without q/k norms, one rope base, every other layer sliding
    (from the first), and soft-capped attention and final logits (Gemma Team 2024, "Gemma 2", §2; HF
    `modeling_gemma2.py`)."""
    if hf.get("use_bidirectional_attention"):
        raise ConfigError("Gemma2ForCausalLM with use_bidirectional_attention: true is not a causal LM nextn builds")
    layers = hf.get("num_hidden_layers")
    types = hf.get("layer_types")
    if types is None and type(layers) is int:
        types = ["sliding_attention" if (i + 1) % 2 else "full_attention" for i in range(layers)]
    theta, scaling = rope_from_hf(hf, "Gemma2ForCausalLM")
    hidden = hf.get("hidden_size")
    return {
        "rope_theta": theta, "rope_scaling": scaling, "norm_style": "unit_offset", "norm_placement": "sandwich",
        "embedding_multiplier": float(hidden) ** 0.5 if type(hidden) is int and hidden > 0 else None,
        "hidden_act": hf.get("hidden_activation") or hf.get("hidden_act") or "gelu_pytorch_tanh",
        "query_pre_attn_scalar": hf.get("query_pre_attn_scalar", 256),
        "sliding_window": hf.get("sliding_window", 4096), "layer_types": types,
        "attn_logit_softcapping": hf.get("attn_logit_softcapping", 50.0),
        "final_logit_softcapping": hf.get("final_logit_softcapping", 30.0),
        "tie_word_embeddings": hf.get("tie_word_embeddings", True),
        "rms_norm_eps": hf.get("rms_norm_eps") or 1e-6, "head_dim": hf.get("head_dim") or 256,
    }  # fmt: skip


def _gemma4(hf: dict[str, Any]) -> dict[str, Any]:
    """Gemma 4 text (`Gemma4ForCausalLM`, model_type gemma4_text; HF `modeling_gemma4.py`): Gemma 3's sandwich layer
    with RMSNorms that scale by w (not 1 + w), V normalised without weight, a softmax scale of 1, full-attention layers
    with wider heads (`global_head_dim`, `num_global_key_value_heads`, or HF 5.23's `per_layer_config`), V = K's
    projection there (`attention_k_eq_v`), "proportional" rope on them, per-layer inputs (PLE), a learned scalar per
    layer, and the last `num_kv_shared_layers` layers reading earlier layers' KV (their MLP double wide).

    Raises:
        ConfigError: the MoE variant (`enable_moe_block`), bidirectional attention, or heads of full layers that
            differ across them.
    """
    if hf.get("enable_moe_block"):
        raise ConfigError("Gemma4ForCausalLM with enable_moe_block: true (Gemma 4's MoE, a dense MLP beside its "
                          "experts) is not supported yet; the dense Gemma 4 models are")
    if hf.get("use_bidirectional_attention"):
        raise ConfigError("Gemma4ForCausalLM with use_bidirectional_attention is not a causal LM nextn builds")
    params = dict(hf.get("rope_parameters") or {})
    full_rope = dict(params.get("full_attention") or {})
    proportion = None
    if full_rope.get("rope_type") == "proportional":
        proportion = float(full_rope.get("partial_rotary_factor", 1.0))
        if float(full_rope.get("factor", 1.0)) != 1.0:
            raise ConfigError("Gemma4ForCausalLM: proportional rope with a factor other than 1 is not supported")
        params["full_attention"] = {"rope_type": "default", "rope_theta": full_rope.get("rope_theta") or 1_000_000.0}
    options = _gemma3({**hf, "query_pre_attn_scalar": 1.0, "rope_parameters": params,
                       "sliding_window": hf.get("sliding_window") or 512})  # Gemma4TextConfig's default
    types = options["layer_types"]
    overrides = {int(k): v for k, v in (hf.get("per_layer_config") or {}).items() if isinstance(v, dict)}
    full = [i for i, t in enumerate(types or ()) if t == "full_attention"]
    dims = {(overrides.get(i, {}).get("head_dim"), overrides.get(i, {}).get("num_key_value_heads")) for i in full}
    if len(dims) > 1:
        raise ConfigError(f"Gemma4ForCausalLM: full_attention layers with different head shapes {sorted(dims)}")
    head, kv_heads = dims.pop() if dims else (None, None)
    if not overrides:  # a config written before per_layer_config (the releases'): HF's `__post_init__` defaults —
        head = hf.get("global_head_dim") or 512  # the full layers' KV heads are overridden only with k_eq_v
        kv_heads = hf.get("num_global_key_value_heads") if hf.get("attention_k_eq_v") else None
    return {
        **options, "norm_style": "fp32_weight", "v_norm": True,
        "global_head_dim": head, "global_num_key_value_heads": kv_heads,
        "attention_k_eq_v": bool(hf.get("attention_k_eq_v")), "rope_proportion": proportion,
        "num_kv_shared_layers": int(hf.get("num_kv_shared_layers") or 0),
        "double_wide_mlp": bool(hf.get("use_double_wide_mlp")),
        "hidden_size_per_layer_input": int(hf.get("hidden_size_per_layer_input") or 0),
        # HF's default is 262,144, every release's vocabulary: its vocabulary where a config (a GGUF's) leaves it out
        "vocab_size_per_layer_input": hf.get("vocab_size_per_layer_input") or hf.get("vocab_size"),
        "layer_scalar": True,
    }  # fmt: skip


def rope_from_hf(hf: dict[str, Any], arch: str) -> tuple[float, Any]:
    """(rope_theta, scaling) from `rope_parameters` (transformers 5) or `rope_scaling` + `rope_theta`.

    Raises:
        ConfigError: a rope type other than default, llama3, linear, longrope and yarn, or scaling fields those
            refuse.
    """
    params = dict(hf.get("rope_parameters") or hf.get("rope_scaling") or {})
    if isinstance(params.get("full_attention"), dict):  # transformers 5, per layer type (OLMo 3): the full layers'
        params = dict(params["full_attention"])
    theta = float(params.pop("rope_theta", None) or hf.get("rope_theta") or 10000.0)
    rope_type = params.pop("rope_type", None) or params.pop("type", None) or "default"
    if rope_type == "default":
        return theta, None
    if rope_type in ("longrope", "su"):
        return theta, _longrope(hf, params, arch)
    if rope_type == "yarn":
        return theta, _yarn(hf, params, arch)
    kinds = {"llama3": Llama3RopeScaling, "linear": LinearRopeScaling}
    if rope_type not in kinds:
        raise ConfigError(f"unsupported rope type {rope_type!r} for {arch}: nextn supports 'default', "
                          f"{', '.join(map(repr, kinds))}, 'longrope', 'yarn'")
    kind = kinds[rope_type]
    keep = {k: v for k, v in params.items() if k in kind.model_fields and v is not None}
    if "factor" not in keep:
        raise ConfigError(f"{rope_type} rope scaling needs 'factor' in rope_scaling/rope_parameters")
    try:
        return theta, kind(**keep)
    except ValueError as e:
        raise ConfigError(f"invalid {rope_type} rope scaling {params}: {e}") from e


def _exaone4_layers(hf: dict[str, Any]) -> dict[str, Any]:
    """EXAONE 4's hybrid attention: with a `sliding_window`, the layers `layer_types` (or `sliding_window_pattern`,
    a count — every n-th layer full — or a string like "LLLG") marks sliding attend to the window with RoPE, the
    others to every key without RoPE (HF `Exaone4Attention`: "global NoPE"); without one, every layer is full with
    RoPE."""
    layers, window = hf.get("num_hidden_layers"), hf.get("sliding_window", 4096)
    if not window or type(layers) is not int:
        return {}
    types = hf.get("layer_types")
    if types is None:
        pattern = hf.get("sliding_window_pattern", 4)
        if isinstance(pattern, str) and pattern:
            types = ["sliding_attention" if pattern[i % len(pattern)] == "L" else "full_attention"
                     for i in range(layers)]
        elif type(pattern) is int and pattern > 0:
            types = ["sliding_attention" if (i + 1) % pattern else "full_attention" for i in range(layers)]
        else:
            raise ConfigError(f"Exaone4ForCausalLM: sliding_window_pattern {pattern!r} is neither a layer count "
                              "nor a pattern like 'LLLG'")
    return {"sliding_window": window, "layer_types": types,
            "no_rope_layers": [int(t == "sliding_attention") for t in types]}


def _rotary_dim(hf: dict[str, Any]) -> int | None:
    """The rotated dims of a head from `partial_rotary_factor` (top level or in `rope_parameters`; HF's
    `int(head_dim * factor)`), None when every dim rotates."""
    params = hf.get("rope_parameters") or hf.get("rope_scaling") or {}
    factor = params.get("partial_rotary_factor", hf.get("partial_rotary_factor", 1.0))
    hidden, heads = hf.get("hidden_size"), hf.get("num_attention_heads")
    head_dim = hf.get("head_dim") or (hidden // heads if type(hidden) is int and type(heads) is int and heads else None)
    if factor in (None, 1, 1.0) or head_dim is None:
        return None
    if not isinstance(factor, (int, float)) or not 0 < factor <= 1:
        raise ConfigError(f"partial_rotary_factor {factor!r} must be a number in (0, 1]")
    return int(head_dim * factor)


def _yarn(hf: dict[str, Any], params: dict[str, Any], arch: str) -> YarnRopeScaling:
    """YaRN from `rope_parameters` / `rope_scaling`, read as HF's `_compute_yarn_parameters` reads it: the original
    context from the config's own `original_max_position_embeddings`, else the rope parameters', else
    `max_position_embeddings`; a missing factor is max_position_embeddings / original; the attention factor, when
    not given, mscale(factor, mscale) / mscale(factor, mscale_all_dim) with both set, else 0.1·ln(factor) + 1
    (1 when factor ≤ 1)."""
    orig = (hf.get("original_max_position_embeddings") or params.get("original_max_position_embeddings")
            or hf.get("max_position_embeddings"))
    if type(orig) is not int or orig <= 0:
        raise ConfigError(f"yarn rope scaling of {arch} needs original_max_position_embeddings, got {orig!r}")
    factor = params.get("factor") or (hf.get("max_position_embeddings") or orig) / orig
    attention = yarn.attention_factor(factor, params.get("attention_factor"), params.get("mscale"),
                                      params.get("mscale_all_dim"))
    try:
        return YarnRopeScaling(factor=factor, original_max_position_embeddings=orig, attention_factor=attention,
                               beta_fast=params.get("beta_fast") or 32.0, beta_slow=params.get("beta_slow") or 1.0,
                               truncate=params.get("truncate", True) is not False)
    except ValueError as e:
        raise ConfigError(f"invalid yarn rope scaling {params}: {e}") from e


def _longrope(hf: dict[str, Any], params: dict[str, Any], arch: str) -> LongRopeScaling:
    """LongRoPE from `rope_parameters` (or Phi-3's older `rope_scaling` of type "su"), its attention factor defaulted
    as HF's `_compute_longrope_parameters` does: √(1 + ln s / ln orig) with s = max_position_embeddings / orig (or
    `factor`), 1 when s ≤ 1."""
    orig = params.get("original_max_position_embeddings") or hf.get("original_max_position_embeddings")
    if type(orig) is not int or orig <= 0:
        raise ConfigError(f"longrope rope scaling of {arch} needs original_max_position_embeddings, got {orig!r}")
    factor = params.get("factor") or (hf.get("max_position_embeddings") or orig) / orig
    attention = params.get("attention_factor")
    if attention is None:
        attention = math.sqrt(1 + math.log(factor) / math.log(orig)) if factor > 1 else 1.0
    try:
        return LongRopeScaling(short_factor=params.get("short_factor") or (),
                               long_factor=params.get("long_factor") or (), original_max_position_embeddings=orig,
                               attention_factor=attention)
    except ValueError as e:
        raise ConfigError(f"invalid longrope rope scaling {params}: {e}") from e
