"""What the device offers the kernels: a question asked by the builder (the engine dtype), the engine (the draft
head's dtype) and draft-head training alike, so it lives below all of them."""

from __future__ import annotations

import torch


def fast_bf16(device: torch.device) -> bool:
    """Whether bf16 is the fast inference dtype on `device`: CUDA, or a CPU where nextn's kernels load (every ISA
    variant: AVX512-BF16 multiplies bf16 pairs, the others widen bf16 to f32 in registers, so a bf16 engine reads
    half an fp32 engine's bytes and stays batch-invariant), or else where PyTorch's own bf16 CPU matmuls are native
    (`native_bf16`). Raises ValueError for a bad NEXTN_CPU_ISA (`cpu_kernels`)."""
    if device.type == "cuda":
        return True
    if device.type != "cpu":
        return False
    from nextn.plugins import cpu_kernels

    return cpu_kernels.available() or native_bf16(device)


def native_bf16(device: torch.device) -> bool:
    """Whether PyTorch's own bf16 matmuls are fast on `device`: CUDA, or a CPU with bf16 dot products (x86-64
    AVX512-BF16 or AMX-BF16, ARM64 BF16), which training, running PyTorch's ops, asks. Not oneDNN's
    `_is_mkldnn_bf16_supported`: it also says yes on AVX-512 without BF16, where oneDNN emulates bf16 slowly."""
    if device.type == "cuda":
        return True
    if device.type != "cpu":
        return False
    from nextn.plugins import cpu_kernels

    return bool(cpu_kernels.cpu_flags() & {"avx512_bf16", "amx_bf16", "bf16"})
