"""DeepSeek-V3 weight layouts: the HF checkpoint's tensors and the engine's (runtime) tensors.

The engine keeps HF names (routed experts one by one: `mlp.experts.{e}.gate_proj.weight`, ..., the layout
`models.moe.SparseMoE` reads, so weight-only formats quantize each expert like any linear), with two changes made
once at build time:
- the MTP layers' copies of `embed_tokens` / `shared_head.head` are dropped (every engine uses the main
  model's embedding and lm_head: arXiv:2412.19437 §2.2);
- a tied checkpoint gets an explicit `lm_head.weight`.
Both expert spellings load: per-expert (DeepSeek's release, what `transformers` `save_pretrained` writes, the GGUF
reader's names) and fused (`mlp.experts.gate_up_proj` [E, 2·I_moe, H], gate rows then up rows, and
`mlp.experts.down_proj` [E, H, I_moe]: transformers' in-memory layout), split on reading.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable, Iterator

from typing import Any

import torch

from nextn.models.config import DeepseekV3ModelConfig

Shape = tuple[int, ...]
#: Reads one tensor of the source checkpoint by HF name (dequantized); raises KeyError when absent.
TensorGetter = Callable[[str], torch.Tensor]

#: Tensors kept in fp32 whatever the engine dtype (the router's selection bias decides top-k ties).
FP32_TENSORS = ("e_score_correction_bias",)


#: Tensors an MTP layer may store that no engine reads: its copies of the main model's embedding and lm_head.
MTP_COPIES = ("embed_tokens.weight", "shared_head.head.weight")
#: RoPE frequency buffers some checkpoints store; the runtime recomputes them from the config.
DERIVED_SUFFIXES = (".rotary_emb.inv_freq",)
_MTP_COPY_RE = re.compile(r"model\.layers\.(\d+)\.(?:" + "|".join(map(re.escape, MTP_COPIES)) + ")")
_EXPERT_RE = re.compile(r"(model\.layers\.\d+\.mlp\.experts\.)(\d+)\.(gate|up|down)_proj\.weight")
_FUSED_RE = re.compile(r"(model\.layers\.(\d+)\.mlp\.experts\.)(?:gate_up|down)_proj")


class WeightError(ValueError):
    """A checkpoint tensor is missing or has the wrong shape; the message names the tensor."""


def stored_view(reader: Any, cfg: DeepseekV3ModelConfig) -> Any:
    """DeepSeek-V3 checkpoints store the engine's layout: `reader` itself (the dense families' `stored_view` may wrap
    it)."""
    return reader


def runtime_weight_dtype(name: str, dtype: torch.dtype) -> torch.dtype:
    """The dtype an engine stores tensor `name` in: `dtype`, or fp32 for FP32_TENSORS."""
    return torch.float32 if name.endswith(FP32_TENSORS) else dtype


def layer_prefix(layer_idx: int) -> str:
    return f"model.layers.{layer_idx}."


def _attention_specs(cfg: DeepseekV3ModelConfig) -> dict[str, Shape]:
    h, nh = cfg.hidden_size, cfg.num_attention_heads
    specs: dict[str, Shape] = {}
    if cfg.q_lora_rank is None:
        specs["self_attn.q_proj.weight"] = (nh * cfg.qk_head_dim, h)
    else:
        specs["self_attn.q_a_proj.weight"] = (cfg.q_lora_rank, h)
        specs["self_attn.q_a_layernorm.weight"] = (cfg.q_lora_rank,)
        specs["self_attn.q_b_proj.weight"] = (nh * cfg.qk_head_dim, cfg.q_lora_rank)
        if cfg.attention_bias:
            specs["self_attn.q_a_proj.bias"] = (cfg.q_lora_rank,)
    specs["self_attn.kv_a_proj_with_mqa.weight"] = (cfg.kv_cache_dim, h)
    specs["self_attn.kv_a_layernorm.weight"] = (cfg.kv_lora_rank,)
    specs["self_attn.kv_b_proj.weight"] = (nh * (cfg.qk_nope_head_dim + cfg.v_head_dim), cfg.kv_lora_rank)
    specs["self_attn.o_proj.weight"] = (h, nh * cfg.v_head_dim)
    if cfg.attention_bias:
        specs["self_attn.kv_a_proj_with_mqa.bias"] = (cfg.kv_cache_dim,)
        specs["self_attn.o_proj.bias"] = (h,)
    specs["input_layernorm.weight"] = (h,)
    specs["post_attention_layernorm.weight"] = (h,)
    return specs


def _mlp_specs(prefix: str, width: int, h: int) -> dict[str, Shape]:
    return {f"{prefix}gate_proj.weight": (width, h), f"{prefix}up_proj.weight": (width, h), f"{prefix}down_proj.weight": (h, width)}


def _dense_or_shared_specs(cfg: DeepseekV3ModelConfig, layer_idx: int) -> dict[str, Shape]:
    h = cfg.hidden_size
    if not cfg.is_moe_layer(layer_idx):
        return _mlp_specs("mlp.", cfg.intermediate_size, h)
    specs: dict[str, Shape] = {"mlp.gate.weight": (cfg.n_routed_experts, h), "mlp.gate.e_score_correction_bias": (cfg.n_routed_experts,)}
    if cfg.n_shared_experts:
        specs.update(_mlp_specs("mlp.shared_experts.", cfg.moe_intermediate_size * cfg.n_shared_experts, h))
    return specs


def _mtp_specs(cfg: DeepseekV3ModelConfig) -> dict[str, Shape]:
    h = cfg.hidden_size
    return {"enorm.weight": (h,), "hnorm.weight": (h,), "eh_proj.weight": (h, 2 * h), "shared_head.norm.weight": (h,)}


def runtime_weight_specs(cfg: DeepseekV3ModelConfig) -> dict[str, Shape]:
    """Every tensor an engine holds, name → shape, in build order (MTP layers last)."""
    h, v = cfg.hidden_size, cfg.vocab_size
    specs: dict[str, Shape] = {"model.embed_tokens.weight": (v, h)}
    for i in range(cfg.num_hidden_layers + cfg.num_nextn_predict_layers):
        p = layer_prefix(i)
        layer = {**_attention_specs(cfg), **_dense_or_shared_specs(cfg, i)}
        if cfg.is_moe_layer(i):
            for e in range(cfg.n_routed_experts):
                layer.update(_mlp_specs(f"mlp.experts.{e}.", cfg.moe_intermediate_size, h))
        if i >= cfg.num_hidden_layers:
            layer.update(_mtp_specs(cfg))
        specs.update({p + k: s for k, s in layer.items()})
    specs["model.norm.weight"] = (h,)
    specs["lm_head.weight"] = (v, h)
    return specs


def dropped_by_design(name: str, num_layers: int, num_mtp_layers: int) -> bool:
    """Whether a stored tensor is one every engine leaves out on purpose: an MTP layer's embedding / lm_head copy
    (`MTP_COPIES`) or a RoPE buffer (`DERIVED_SUFFIXES`)."""
    if name.endswith(DERIVED_SUFFIXES):
        return True
    m = _MTP_COPY_RE.fullmatch(name)
    return m is not None and num_layers <= int(m[1]) < num_layers + num_mtp_layers


def unread_tensors(names: Iterable[str], cfg: DeepseekV3ModelConfig) -> list[str]:
    """The stored tensors (`names`, FP8 scales hidden) that `to_runtime` would not read for `cfg`, in stored order.

    Read: every `runtime_weight_specs` name, and the fused `mlp.experts.gate_up_proj` / `down_proj` of a MoE layer
    where its per-expert weights are not stored. Left out by design (not listed): `dropped_by_design`.
    """
    names = list(names)
    specs = runtime_weight_specs(cfg)
    stored = set(names)
    n, k = cfg.num_hidden_layers, cfg.num_nextn_predict_layers
    unread = []
    for name in names:
        if name in specs or dropped_by_design(name, n, k):
            continue
        m = _FUSED_RE.fullmatch(name)
        if m and int(m[2]) < n + k and cfg.is_moe_layer(int(m[2])) and f"{m[1]}0.down_proj.weight" not in stored:
            continue
        unread.append(name)
    return unread


def checked_tensor(get: TensorGetter, name: str, shape: Shape) -> torch.Tensor:
    """`get(name)`, checked against `shape`; raises WeightError naming the tensor when missing or misshapen."""
    try:
        t = get(name)
    except KeyError as e:
        raise WeightError(f"checkpoint is missing tensor {name!r} (expected shape {list(shape)})") from e
    if tuple(t.shape) != tuple(shape):
        raise WeightError(f"tensor {name!r} has shape {list(t.shape)}, expected {list(shape)}")
    return t


def _expert_from_fused(get: TensorGetter, cfg: DeepseekV3ModelConfig, name: str) -> torch.Tensor:
    """Expert weight `name` (`...mlp.experts.{e}.{gate,up,down}_proj.weight`) sliced from the stored fused tensors
    (`mlp.experts.gate_up_proj` [E, 2I, H]: gate rows then up rows; `mlp.experts.down_proj` [E, H, I])."""
    m = _EXPERT_RE.fullmatch(name)
    e, w, h = cfg.n_routed_experts, cfg.moe_intermediate_size, cfg.hidden_size
    expert = int(m[2])
    if m[3] == "down":
        return checked_tensor(get, m[1] + "down_proj", (e, h, w))[expert]
    gate_up = checked_tensor(get, m[1] + "gate_up_proj", (e, 2 * w, h))[expert]
    return gate_up[:w] if m[3] == "gate" else gate_up[w:]


def to_runtime(
    get: TensorGetter, has: Callable[[str], bool], cfg: DeepseekV3ModelConfig, dtype: torch.dtype
) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield the engine's tensors (name, tensor in `dtype`, fp32 for FP32_TENSORS) from an HF checkpoint.

    Args:
        get: returns a source tensor by HF name, FP8 already dequantized; raises KeyError when absent.
        has: whether the source holds a tensor name.
        cfg: the normalised config; `num_nextn_predict_layers` says how many MTP layers to read.
        dtype: the engine's weight dtype.
    Raises:
        WeightError: a tensor is missing or misshapen (the message names it and the expected shape).
    """
    specs = runtime_weight_specs(cfg)

    def cast(name: str, t: torch.Tensor) -> torch.Tensor:
        return t.to(runtime_weight_dtype(name, dtype)).contiguous()

    for name, shape in specs.items():
        if (m := _EXPERT_RE.fullmatch(name)) and not has(name) and has(m[1] + "down_proj"):
            yield name, cast(name, _expert_from_fused(get, cfg, name))
        elif name == "lm_head.weight" and not has(name):
            if not cfg.tie_word_embeddings:
                raise WeightError(f"checkpoint is missing tensor 'lm_head.weight' (expected shape {list(shape)}; "
                                  "tie_word_embeddings is false)")
            yield name, cast(name, checked_tensor(get, "model.embed_tokens.weight", shape))
        else:
            yield name, cast(name, checked_tensor(get, name, shape))


def present_mtp_layers(has: Callable[[str], bool], cfg: DeepseekV3ModelConfig) -> int:
    """How many MTP layers the checkpoint really holds (leading layers N, N+1, ... with an `eh_proj`).

    `transformers` writes `num_nextn_predict_layers: 1` by default but never saves MTP tensors, so the config
    alone overstates it; a layer that is only partly present is still reported missing by `to_runtime`.
    """
    n = 0
    while n < cfg.num_nextn_predict_layers and any(
        has(layer_prefix(cfg.num_hidden_layers + n) + k) for k in ("eh_proj.weight", "enorm.weight", "input_layernorm.weight")
    ):
        n += 1
    return n
