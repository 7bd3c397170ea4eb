"""nextn's CPU paged attention (`paged_attention_cpu.cpp`): one op per layer in place of a gather, two einsums, a
mask and a softmax, reading the KV cache through the block tables in place.

`cpu_kernels.ops().paged_attention(q [B, T, NH, D], kv_cache [slots, 2·NKV·D], context_slots [B, S] int64,
visible [B, 1, T, S] bool, scale, softcap=0, sinks=None) → [B, T, NH·D]` in q's dtype; q and kv_cache both bf16 or
both f32, 1 ≤ D ≤ 512 (Gemma 4's full layers: 512); kv_cache's rows may be the first columns of wider ones (a
row-strided view: Gemma 4's narrower layers in a cache as wide as its widest); sinks [NH] f32: an attention sink per query head (gpt-oss), one more logit in each softmax.
f32 scores, softmax and weighted sum; every query row computed alone (batch-invariant: a verify step's rows equal
plain steps' bit for bit, `tests/plugins/test_paged_attention.py`). The attention of Vaswani et al. 2017 with GQA
(Ainslie et al. 2023) over vLLM's paged cache layout (Kwon et al. 2023); the reference is `reference` below, the
einsum path of `models/llama/model.py`.
"""

from __future__ import annotations

import itertools

import torch
import torch.nn.functional as F
from torch import nn

from nextn.plugins import cpu_kernels


def reference(q: torch.Tensor, kv_cache: torch.Tensor, context_slots: torch.Tensor, visible: torch.Tensor,
              scale: float, softcap: float = 0.0, sinks: torch.Tensor | None = None) -> torch.Tensor:
    """What the kernel computes, in PyTorch f32: shapes as the op's (scores soft-capped, cap · tanh(s / cap), where
    `softcap` > 0: Gemma 2, HF `Gemma2Attention`; `sinks` [NH]: one more logit a head in the softmax, dropped after
    it — HF `GptOssAttention`'s `eager_attention_forward`)."""
    b, t, nh, d = q.shape
    nkv = kv_cache.shape[1] // (2 * d)
    ctx = kv_cache[context_slots].float().view(b, -1, 2, nkv, d)  # [B, S, 2, NKV, D]
    k, v = ctx.unbind(2)
    group = nh // nkv
    scores = torch.einsum("btkgd,bskd->bkgts", q.float().view(b, t, nkv, group, d), k) * scale
    if softcap > 0:
        scores = torch.tanh(scores / softcap) * softcap
    scores = scores.reshape(b, nh, t, -1).masked_fill(~visible, float("-inf"))
    if sinks is not None:
        s = scores.shape[-1]
        scores = torch.cat([scores, sinks.float().view(1, nh, 1, 1).expand(b, nh, t, 1)], dim=-1)
        probs = F.softmax(scores, dim=-1)[..., :s].reshape(b, nkv, group, t, s)
    else:
        probs = F.softmax(scores, dim=-1).view(b, nkv, group, t, -1)
    return torch.einsum("bkgts,bskd->btkgd", probs, v).reshape(b, t, nh * d).to(q.dtype)


def install_paged_attention(model: nn.Module) -> int:
    """Switch every attention module of `model` that offers the kernel (a `paged_attention_kernel` attribute:
    `LlamaAttention`) to it, where it applies: CPU weights in bfloat16 or float32 (a float16 engine keeps PyTorch's
    attention), head_dim ≤ 512, the kernels built (`cpu_kernels`).

    Returns:
        How many modules use the kernel (0 where it does not apply).
    """
    count = 0
    for module in model.modules():
        if not hasattr(module, "paged_attention_kernel") or module.head_dim > 512:
            continue
        # quantized and packed linears hold their weights as buffers, not parameters
        tensor = next(itertools.chain(module.parameters(), module.buffers()), None)
        if tensor is None or tensor.device.type != "cpu" or not cpu_kernels.available():
            continue
        floats = (t.dtype for t in itertools.chain(module.parameters(), module.buffers()) if t.is_floating_point())
        if next(floats, torch.float32) not in (torch.bfloat16, torch.float32):
            continue
        module.paged_attention_kernel = True
        count += 1
    return count
