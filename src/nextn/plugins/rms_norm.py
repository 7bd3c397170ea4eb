"""RMSNorm on nextn's CPU kernel (`rms_norm_cpu.cpp`): the norms of the layers that run as modules (Gemma 4's eight
a layer, DeepSeek's MLA, every model's final norm) in one dispatch each instead of eight PyTorch ops, and the PyTorch
reference it is tested against.

A norm module opts in with a `rms_norm_kernel` attribute (False) and a `kernel_weight()` method giving the op's
weight — bf16 [H] for Llama's form w · bf16(x̂), f32 [H] for bf16(x̂ · s) (Gemma's s = 1 + w, OLMo 2's w), None for
bf16(x̂) — as `models/layers.py`'s norms do; `install_rms_norms` turns it on where the kernels run and stores that
weight as the module's `rms_norm_weight`.
"""

from __future__ import annotations

import itertools

import torch
from torch import nn

from nextn.plugins import cpu_kernels


def rms_norm_reference(x: torch.Tensor, weight: torch.Tensor | None, eps: float) -> torch.Tensor:
    """The op's formula in PyTorch: x [..., H] bf16; weight bf16 [H] (w · bf16(x̂)), f32 [H] (bf16(x̂ · s)) or None
    (bf16(x̂)); x̂ = x · rsqrt(mean(x²) + eps) in f32. Returns [..., H] bf16."""
    xf = x.float()
    xh = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    if weight is None:
        return xh.to(x.dtype)
    if weight.dtype == torch.float32:
        return (xh * weight).to(x.dtype)
    return weight * xh.to(x.dtype)


def rms_norm(x: torch.Tensor, weight: torch.Tensor | None, eps: float) -> torch.Tensor:
    """`rms_norm_reference` on nextn's kernel: x [..., H] bf16 on the CPU, H % 16 == 0 (the caller checks).

    Raises:
        RuntimeError: a weight of another shape or dtype (the op's check)."""
    return cpu_kernels.ops().rms_norm(x, weight, eps)


def install_rms_norms(model: nn.Module) -> int:
    """Switch every norm module of `model` that offers the kernel (`rms_norm_kernel`) to it where it applies: CPU
    bf16 weights or none, a width that is a multiple of 16, the kernels built. The module then runs the op on bf16
    inputs (others keep its PyTorch path).

    Returns:
        How many modules use the kernel (0 where it does not apply).
    """
    if not cpu_kernels.available():
        return 0
    count = 0
    for module in model.modules():
        if not hasattr(module, "rms_norm_kernel"):
            continue
        tensor = next(itertools.chain(module.parameters(), module.buffers()), None)
        if tensor is not None and (tensor.device.type != "cpu" or tensor.dtype != torch.bfloat16):
            continue
        weight = module.kernel_weight()
        if weight is not None and weight.shape[-1] % 16:
            continue
        module.rms_norm_weight = weight  # computed once here (Gemma's f32 1 + w)
        module.rms_norm_kernel = True
        count += 1
    return count
