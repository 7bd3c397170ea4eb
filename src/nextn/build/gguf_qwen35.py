"""Qwen3.5's GGUF (llama.cpp architecture `qwen35`; Qwen3-Next's `qwen3next` the same but its value heads in
HF's order, its b / a projection fused, and MoE tensors as qwen2moe's): its tensor names, the config from its
metadata, and the values llama.cpp's converter changed, restored to `transformers`' (`Qwen3_5ForCausalLM`'s) layout.

Sources: llama.cpp's converter, `conversion/qwen.py` (`Qwen3NextModel.modify_tensors`: `A_log` stored as
A = −exp(A_log), `dt_bias` as `ssm_dt.bias`, the conv kernel squeezed to [channels, taps], every zero-centred norm
weight stored as 1 + w; `_LinearAttentionVReorderBase`: where value heads outnumber key heads, the value heads of
the q/k/v projection's v rows, `in_proj_z`, `in_proj_a` / `in_proj_b`, `A_log`, `dt_bias`, the conv's v channels and
`out_proj`'s columns reordered from grouped by key head [k0: v0..v(r−1), k1: ...] to tiled [v0: k0, k1, ..., v1: ...];
`_QwenMtpMixin`: the MTP layer as `blk.{N}` with `nextn.*` tensors, `nextn_predict_layers`) and its metadata writer
(`ssm.conv_kernel`, `ssm.state_size` = key head dim, `ssm.group_count` = key heads, `ssm.time_step_rank` = value
heads, `ssm.inner_size` = value heads × value head dim, `attention.recurrent_layers`).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

#: llama.cpp block tensor → HF module under `model.layers.N.` (attention and MLP as Qwen3's, the pre-MLP norm as
#: `post_attention_norm`, the Gated DeltaNet's under `linear_attn`, the MTP layer's `nextn.*`)
BLOCK = {
    "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj", "attn_q_norm": "self_attn.q_norm", "attn_k_norm": "self_attn.k_norm",
    "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj", "ffn_down": "mlp.down_proj",
    "attn_norm": "input_layernorm", "post_attention_norm": "post_attention_layernorm",
    "attn_qkv": "linear_attn.in_proj_qkv", "attn_gate": "linear_attn.in_proj_z", "ssm_beta": "linear_attn.in_proj_b",
    "ssm_alpha": "linear_attn.in_proj_a", "ssm_conv1d": "linear_attn.conv1d", "ssm_norm": "linear_attn.norm",
    "ssm_out": "linear_attn.out_proj", "ssm_dt": "linear_attn", "ssm_a": "linear_attn",
    "nextn.eh_proj": "eh_proj", "nextn.enorm": "enorm", "nextn.hnorm": "hnorm",
    "nextn.shared_head_norm": "shared_head.norm", "nextn.embed_tokens": "embed_tokens",
    "nextn.shared_head_head": "shared_head.head",
}  # fmt: skip
#: Block tensors whose HF name is not `<module>.<weight | bias>` (without `blk.N.` → without `model.layers.N.`)
TENSOR_NAMES = {"ssm_dt.bias": "linear_attn.dt_bias", "ssm_a": "linear_attn.A_log"}


def config(key: Callable[..., Any], layers: int, head_dim: int) -> dict[str, Any]:
    """Qwen3.5's HF config fields from its metadata (`key(name, kind, default)` as `family_config`'s)."""
    mtp = key("nextn_predict_layers", "count", 0) if key("nextn_predict_layers", "raw", 0) else 0
    main = layers - mtp
    recurrent = key("attention.recurrent_layers", "raw", None)
    if isinstance(recurrent, list):
        types = ["linear_attention" if r else "full_attention" for r in recurrent][:main]
    else:
        every = key("full_attention_interval", "count", 4)
        types = ["linear_attention" if (i + 1) % every else "full_attention" for i in range(main)]
    value_heads = key("ssm.time_step_rank", "count", None)
    return {"num_hidden_layers": main, "mtp_num_hidden_layers": mtp, "layer_types": types,
            "partial_rotary_factor": key("rope.dimension_count", "count", head_dim) / head_dim,
            "linear_conv_kernel_dim": key("ssm.conv_kernel", "count", None),
            "linear_key_head_dim": key("ssm.state_size", "count", None),
            "linear_num_key_heads": key("ssm.group_count", "count", None),
            "linear_num_value_heads": value_heads,
            "linear_value_head_dim": key("ssm.inner_size", "count", None) // value_heads}


def norm_shift(hf_name: str) -> float:
    """1.0 for the norms the converter stored as 1 + w (all but each value head's gated norm), else 0.0."""
    return 1.0 if hf_name.endswith("norm.weight") and not hf_name.endswith("linear_attn.norm.weight") else 0.0


def _grouped(w: torch.Tensor, dim: int, key_heads: int, per_key: int, width: int) -> torch.Tensor:
    """`w` with the value heads along `dim` (each `width` wide) from llama.cpp's tiled order back to HF's grouped
    order (the inverse of the converter's `_reorder_v_heads`)."""
    shape = list(w.shape)
    tiled = w.reshape(*shape[:dim], per_key, key_heads, width, *shape[dim + 1:])
    return tiled.transpose(dim, dim + 1).reshape(shape)


def restore(hf_name: str, w: torch.Tensor, hf: dict[str, Any], reordered: bool = True) -> torch.Tensor:
    """Tensor `hf_name` as `transformers` stores it, from its dequantized GGUF values `w` (float32) and the file's HF
    config `hf` (norm shifts are `norm_shift`'s, applied by the reader); `reordered`: the converter tiled the value
    heads (qwen35; not qwen3next, whose `Qwen3NextModel` keeps HF's order)."""
    if ".linear_attn." not in hf_name:
        return w
    nk, nv = hf["linear_num_key_heads"], hf["linear_num_value_heads"]
    dk, dv = hf["linear_key_head_dim"], hf["linear_value_head_dim"]
    if hf_name.endswith(".A_log"):
        w = torch.log(-w)
    if hf_name.endswith(".conv1d.weight"):
        w = w.reshape(w.shape[0], 1, -1)
    if nk == nv or not reordered:
        return w
    r, keys = nv // nk, 2 * nk * dk
    if hf_name.endswith((".in_proj_qkv.weight", ".conv1d.weight")):
        return torch.cat([w[:keys], _grouped(w[keys:], 0, nk, r, dv)])
    if hf_name.endswith(".in_proj_z.weight"):
        return _grouped(w, 0, nk, r, dv)
    if hf_name.endswith((".in_proj_a.weight", ".in_proj_b.weight", ".A_log", ".dt_bias")):
        return _grouped(w, 0, nk, r, 1)
    if hf_name.endswith(".out_proj.weight"):
        return _grouped(w, 1, nk, r, dv)
    return w


def shape(hf_name: str, stored: list[int]) -> list[int]:
    """HF's shape of tensor `hf_name` stored with shape `stored` (the conv kernel's [channels, 1, taps])."""
    return [stored[0], 1, *stored[1:]] if hf_name.endswith(".conv1d.weight") else stored


def blocks_readable(hf_name: str) -> bool:
    """Whether the file's 4-bit blocks of `hf_name` (a row of them an output channel) may be read as they are: its
    rows are HF's (not a linear-attention tensor), or HF's reordered (the q/k/v and z projections, whose value heads
    the converter tiled: `restore` puts the rows back, on the blocks as on values). out_proj's columns are reordered
    by half super-blocks (a value head of 128 columns): not readable."""
    return ".linear_attn." not in hf_name or hf_name.endswith((".in_proj_qkv.weight", ".in_proj_z.weight"))
