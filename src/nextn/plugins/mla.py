"""nextn's CPU Multi-head Latent Attention (`mla_cpu.cpp`): a DeepSeek-V3 / GLM-4.7-Flash attention layer's
absorbed queries, attention over the paged latent cache and value up-projection in one op, every query row computed
alone (batch-invariant: a verify step's rows equal plain steps' bit for bit, `tests/plugins/test_mla.py`).

`cpu_kernels.ops().mla_attention(q_nope [B, T, NH, P], q_pe [B, T, NH, R], kv_b [NH, P + V, C], kv_cache
[slots, C + R], context_slots [B, S] int64, visible [B, 1, T, S] bool, scale, kv_b_scale [NH, P + V] | None) →
[B, T, NH · V]` float32; the tensors all bf16 or all f32 (P = qk_nope_head_dim, R = qk_rope_head_dim, V =
v_head_dim, C = kv_lora_rank; `kv_b` is `kv_b_proj.weight` viewed per head), or `kv_b` int8 with its rows' f32
scales (`quantize_kv_b`: what a weight-quantized engine reads, half of bf16's bytes — the op streams kv_b from DRAM
once a step, 9.2 MB a layer in bf16 at GLM-4.7-Flash's shapes). DeepSeek-V2 report §2.1 (MLA), absorption as in vLLM's `mla/common.py`; the
reference is `reference` below, the module's PyTorch path (`models/deepseek_v3/mla.py`).
"""

from __future__ import annotations

import torch
from torch import nn

from nextn.plugins import cpu_kernels
from nextn.plugins.kernels.mla_attention import mla_attention_reference


def reference(q_nope: torch.Tensor, q_pe: torch.Tensor, kv_b: torch.Tensor, kv_cache: torch.Tensor,
              context_slots: torch.Tensor, visible: torch.Tensor, scale: float,
              dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """What the kernel computes, in PyTorch (shapes as the op's; products in `dtype`: f32 as the kernel, or the
    engine's as the module's path without the kernels, `benchmarks/mla.py`)."""
    b, t, nh, p = q_nope.shape
    w = kv_b.to(dtype)
    q_lat = torch.einsum("btnd,ndc->btnc", q_nope.to(dtype), w[:, :p])
    o_lat = mla_attention_reference(q_lat, q_pe.to(dtype), kv_cache.to(dtype), context_slots, visible, scale)
    return torch.einsum("btnc,nvc->btnv", o_lat, w[:, p:]).reshape(b, t, -1)


def quantize_kv_b(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """`kv_b_proj`'s weight [NH · (P + V), C] → (int8 [NH, P + V, C], f32 scales [NH, P + V]): symmetric per row of C,
    scale = max |w| / 127 (an all-zero row: scale 1), q = round(w / scale) (the W8A16 rule, `quantization/`'s int8).
    Args: w: float tensor; its rows are grouped per head by the op's shapes (the caller views it [NH, P + V, C])."""
    w = w.float()
    scale = w.abs().amax(dim=-1) / 127.0
    scale = torch.where(scale > 0, scale, torch.ones_like(scale))
    q = torch.round(w / scale[..., None]).clamp(-127, 127).to(torch.int8)
    return q, scale.contiguous()


def install_mla(model: nn.Module, int8_kv_b: bool = False) -> int:
    """Switch every module of `model` that offers the kernel (an `mla_kernel` attribute: `MLAttention`) to it where it
    applies: CPU weights in bfloat16 or float32, the kernels built (`cpu_kernels`). With `int8_kv_b` (a
    weight-quantized engine: its other linears are int4 / int8 already) the op reads `kv_b_proj` as int8 with per-row
    scales (`quantize_kv_b`, set as the module's `kv_b_int8`). Returns how many modules use it."""
    count = 0
    for module in model.modules():
        if not hasattr(module, "mla_kernel"):
            continue
        w = module.kv_b_proj.weight
        if w.device.type != "cpu" or w.dtype not in (torch.bfloat16, torch.float32) or not cpu_kernels.available():
            continue
        module.mla_kernel = True
        if int8_kv_b:
            nh = module.num_heads
            module.kv_b_int8 = quantize_kv_b(w.detach().view(nh, -1, w.shape[-1]))
        count += 1
    return count
