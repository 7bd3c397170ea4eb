"""Dense-family weight layouts: the HF checkpoint's tensors and the engine's (runtime) tensors — Llama's, plus what
the layer options add (`q_norm` / `k_norm` [head_dim] for `qk_norm`; `pre_feedforward_layernorm` /
`post_feedforward_layernorm` for sandwich norms, no `input_layernorm` for post-norms; q/k/v(/o) biases).

The engine keeps HF names unchanged; the changes made at build time are that a tied model (`tie_word_embeddings`)
stores its embedding once (no `lm_head.weight`, even when the checkpoint holds a copy), and that MTP layers (`model.layers.{num_hidden_layers + i}`: a decoder block plus `enorm`, `hnorm`, `eh_proj`,
`shared_head.norm`) lose their copies of `embed_tokens` / `shared_head.head` when a checkpoint carries them, as for
DeepSeek-V3 (every engine uses the main model's embedding and lm_head).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from typing import Any

import torch

from nextn.models.deepseek_v3.weights import Shape, TensorGetter, WeightError, checked_tensor, dropped_by_design
from nextn.models.llama.config import LlamaModelConfig


__all__ = ["WeightError", "runtime_weight_dtype", "runtime_weight_specs", "stored_view", "to_runtime",
           "unread_tensors"]


def stored_view(reader: Any, cfg: LlamaModelConfig) -> Any:
    """`reader` as the engine reads it: wrapped in `stored_layout.StoredLayout` where the family stores tensors
    otherwise (Phi-3's fused projections, partial rotary), else `reader` itself."""
    from nextn.models.llama.stored_layout import StoredLayout, needs_view

    return StoredLayout(reader, cfg) if needs_view(cfg) else reader


def runtime_weight_dtype(name: str, dtype: torch.dtype) -> torch.dtype:
    """The dtype an engine stores tensor `name` in: `dtype`, float32 for a sigmoid router's correction bias, a
    Gated DeltaNet's decay parameters (`A_log`, `dt_bias`: HF computes the decay from them in float32) and attention
    sinks (gpt-oss: logits beside the float32 scores)."""
    return torch.float32 if name.endswith(("e_score_correction_bias", ".A_log", ".dt_bias", ".sinks")) else dtype


def _linear_attention_specs(cfg: LlamaModelConfig) -> dict[str, Shape]:
    """A Gated DeltaNet layer's token mixer (HF `Qwen3_5GatedDeltaNet`'s names)."""
    h, nv = cfg.hidden_size, cfg.linear_num_value_heads
    assert nv is not None and cfg.linear_num_key_heads and cfg.linear_key_head_dim and cfg.linear_value_head_dim
    key, value = cfg.linear_num_key_heads * cfg.linear_key_head_dim, nv * cfg.linear_value_head_dim
    conv = 2 * key + value
    return {"linear_attn.in_proj_qkv.weight": (conv, h), "linear_attn.in_proj_z.weight": (value, h),
            "linear_attn.in_proj_b.weight": (nv, h), "linear_attn.in_proj_a.weight": (nv, h),
            "linear_attn.conv1d.weight": (conv, 1, cfg.linear_conv_kernel_dim or 1), "linear_attn.dt_bias": (nv,),
            "linear_attn.A_log": (nv,), "linear_attn.norm.weight": (cfg.linear_value_head_dim,),
            "linear_attn.out_proj.weight": (h, value)}


def _layer_specs(cfg: LlamaModelConfig, index: int | None = None) -> dict[str, Shape]:
    h, d, i = cfg.hidden_size, cfg.head_dim, cfg.intermediate_size
    nkv = cfg.num_key_value_heads
    if index is not None:  # Gemma 4: full layers' wider heads, KV-shared layers' double-wide MLP
        d, nkv = cfg.layer_head_dim(index), cfg.layer_kv_heads(index)
        i *= 2 if cfg.double_wide_mlp and cfg.is_kv_shared(index) else 1
    q, kv = cfg.num_attention_heads * d, nkv * d
    specs: dict[str, Shape] = {
        "self_attn.q_proj.weight": (q, h), "self_attn.k_proj.weight": (kv, h),
        "self_attn.v_proj.weight": (kv, h), "self_attn.o_proj.weight": (h, q),
    }  # fmt: skip
    if index is not None and cfg.is_kv_shared(index):  # it reads an earlier layer's KV: no K / V of its own
        del specs["self_attn.k_proj.weight"], specs["self_attn.v_proj.weight"]
    elif index is not None and cfg.attention_k_eq_v and cfg.is_global_layer(index):
        del specs["self_attn.v_proj.weight"]  # V is K's projection
    if index is not None and index in cfg.linear_layers:
        specs = _linear_attention_specs(cfg)
    elif cfg.attn_output_gate:
        specs["self_attn.gate_proj.weight"] = (q, h)
    attends = "self_attn.q_proj.weight" in specs
    if cfg.has_qkv_bias and attends:
        specs.update({"self_attn.q_proj.bias": (q,), "self_attn.k_proj.bias": (kv,), "self_attn.v_proj.bias": (kv,)})
    if cfg.attention_bias and attends:
        specs["self_attn.o_proj.bias"] = (h,)
    if cfg.attn_sinks and attends:
        specs["self_attn.sinks"] = (cfg.num_attention_heads,)
    if cfg.qk_norm and attends:
        full = cfg.qk_norm_over == "all_heads"
        specs.update({"self_attn.q_norm.weight": (q if full else d,), "self_attn.k_norm.weight": (kv if full else d,)})
        if "self_attn.k_proj.weight" not in specs:
            del specs["self_attn.k_norm.weight"]
    if index is not None and cfg.is_moe_layer(index):
        specs.update(_moe_specs(cfg))
    else:
        specs.update({"mlp.gate_proj.weight": (i, h), "mlp.up_proj.weight": (i, h), "mlp.down_proj.weight": (h, i)})
    if cfg.norm_placement != "post":
        specs["input_layernorm.weight"] = (h,)
    specs["post_attention_layernorm.weight"] = (h,)
    if cfg.norm_placement == "sandwich":
        specs["pre_feedforward_layernorm.weight"] = (h,)
    if cfg.norm_placement != "pre":
        specs["post_feedforward_layernorm.weight"] = (h,)
    if (p := cfg.hidden_size_per_layer_input) and index is not None and index < cfg.num_hidden_layers:
        specs.update({"per_layer_input_gate.weight": (p, h), "per_layer_projection.weight": (h, p),
                      "post_per_layer_input_norm.weight": (h,)})
    if cfg.layer_scalar and index is not None and index < cfg.num_hidden_layers:
        specs["layer_scalar"] = (1,)
    return specs


def _moe_specs(cfg: LlamaModelConfig) -> dict[str, Shape]:
    """An MoE layer's MLP tensors (`models/moe.py`): the router, each expert's gate / up / down, a shared expert."""
    h, w = cfg.hidden_size, cfg.moe_intermediate_size
    assert w is not None  # the config's check
    specs: dict[str, Shape] = {"mlp.gate.weight": (cfg.num_experts, h)}
    if cfg.moe_router == "sigmoid_grouped":
        specs["mlp.gate.e_score_correction_bias"] = (cfg.num_experts,)
    if cfg.router_bias:
        specs["mlp.gate.bias"] = (cfg.num_experts,)
    biased = cfg.expert_act == "clamped_swiglu"  # gpt-oss: every expert projection biased
    for e in range(cfg.num_experts):
        specs.update({f"mlp.experts.{e}.gate_proj.weight": (w, h), f"mlp.experts.{e}.up_proj.weight": (w, h),
                      f"mlp.experts.{e}.down_proj.weight": (h, w)})
        if biased:
            specs.update({f"mlp.experts.{e}.gate_proj.bias": (w,), f"mlp.experts.{e}.up_proj.bias": (w,),
                          f"mlp.experts.{e}.down_proj.bias": (h,)})
    if s := cfg.shared_expert_intermediate_size:
        specs.update({"mlp.shared_expert.gate_proj.weight": (s, h), "mlp.shared_expert.up_proj.weight": (s, h),
                      "mlp.shared_expert.down_proj.weight": (h, s), "mlp.shared_expert_gate.weight": (1, h)})
    if cfg.n_shared_experts:
        s = w * cfg.n_shared_experts
        specs.update({"mlp.shared_experts.gate_proj.weight": (s, h), "mlp.shared_experts.up_proj.weight": (s, h),
                      "mlp.shared_experts.down_proj.weight": (h, s)})
    return specs


def runtime_weight_specs(cfg: LlamaModelConfig) -> dict[str, Shape]:
    """Every tensor an engine holds, name → shape, in build order (MTP layers after the main ones; no
    `lm_head.weight` when tied)."""
    h, v = cfg.hidden_size, cfg.vocab_size
    specs: dict[str, Shape] = {"model.embed_tokens.weight": (v, h)}
    layer = _layer_specs(cfg)
    for n in range(cfg.num_hidden_layers):
        per_layer = cfg.num_experts or cfg.linear_layers or cfg.architecture == "Gemma4ForCausalLM"
        specs.update({f"model.layers.{n}.{k}": s for k, s in (_layer_specs(cfg, n) if per_layer else layer).items()})
    mtp = {"enorm.weight": (h,), "hnorm.weight": (h,), "eh_proj.weight": (h, 2 * h), "shared_head.norm.weight": (h,)}
    for n in range(cfg.num_hidden_layers, cfg.num_hidden_layers + cfg.num_nextn_predict_layers):
        block = _layer_specs(cfg, n) if cfg.num_experts else layer
        specs.update({f"model.layers.{n}.{k}": s for k, s in {**block, **mtp}.items()})
    if p := cfg.hidden_size_per_layer_input:  # Gemma 4's per-layer inputs (PLE), every layer's packed in one row
        lp = cfg.num_hidden_layers * p
        specs.update({"model.embed_tokens_per_layer.weight": (cfg.vocab_size_per_layer_input, lp),
                      "model.per_layer_model_projection.weight": (lp, h),
                      "model.per_layer_projection_norm.weight": (p,)})
    specs["model.norm.weight"] = (h,)
    if not cfg.tie_word_embeddings:
        specs["lm_head.weight"] = (v, h)
    return specs


def unread_tensors(names: Iterable[str], cfg: LlamaModelConfig) -> list[str]:
    """The stored tensors (`names`) that `to_runtime` would not read for `cfg`, in stored order; a tied model's
    `lm_head.weight` copy and `deepseek_v3.weights.dropped_by_design` tensors are left out on purpose, not listed."""
    specs = runtime_weight_specs(cfg)
    n, k = cfg.num_hidden_layers, cfg.num_nextn_predict_layers
    return [name for name in names if name not in specs and not dropped_by_design(name, n, k)
            and not (name == "lm_head.weight" and cfg.tie_word_embeddings) and not _unused_kv(name, cfg)]


def _unused_kv(name: str, cfg: LlamaModelConfig) -> bool:
    """Whether `name` is a K/V projection or norm of a KV-shared layer (Gemma 4's releases may store them; HF
    ignores them too: `_keys_to_ignore_on_load_unexpected`)."""
    parts = name.split(".")
    return (cfg.num_kv_shared_layers > 0 and len(parts) > 4 and parts[:2] == ["model", "layers"]
            and parts[2].isdigit() and cfg.is_kv_shared(int(parts[2]))
            and parts[3] == "self_attn" and parts[4] in ("k_proj", "v_proj", "k_norm", "v_norm"))


def to_runtime(
    get: TensorGetter, has: Callable[[str], bool], cfg: LlamaModelConfig, dtype: torch.dtype
) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield the engine's tensors (name, contiguous tensor in `dtype`) from an HF-named checkpoint.

    Args:
        get: returns a source tensor by HF name (GGUF readers: already renamed and un-permuted); KeyError when absent.
        has: whether the source holds a tensor name.
        cfg: the normalised config.
        dtype: the engine's weight dtype.
    Raises:
        WeightError: a tensor is missing or misshapen (the message names it and the expected shape).
    """
    for name, shape in runtime_weight_specs(cfg).items():
        if name == "lm_head.weight" and not has(name):
            raise WeightError(f"checkpoint is missing tensor 'lm_head.weight' (expected shape {list(shape)}; "
                              "tie_word_embeddings is false)")
        yield name, checked_tensor(get, name, shape).to(runtime_weight_dtype(name, dtype)).contiguous()
