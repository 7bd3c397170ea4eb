"""What the device offers the kernels: a question asked by the builder (the engine dtype), the engine (the draft
head's dtype) and draft-head training alike, so it lives below all of them."""

from __future__ import annotations

import torch


def fast_bf16(device: torch.device) -> bool:
    """Whether bf16 matmuls are fast on `device`: CUDA, or a CPU with bf16 instructions (oneDNN's check)."""
    if device.type == "cuda":
        return True
    return device.type == "cpu" and bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
