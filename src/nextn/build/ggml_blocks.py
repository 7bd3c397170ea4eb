"""ggml tensor layouts nextn reads as they are: llama.cpp's q/k row permutation, and Q4_K blocks as nextn's
two-level W4A16 tensors (no dequantize-requantize round trip)."""

from __future__ import annotations

import numpy as np
import torch


def unpermute_rope_rows(w: torch.Tensor, num_heads: int) -> torch.Tensor:
    """Undo llama.cpp's q/k row permutation: [heads · d, ...] interleaved-pair rows → HF rotate-half rows (weights
    [heads · d, hidden] and biases [heads · d] alike)."""
    d = w.shape[0] // num_heads
    return w.reshape(num_heads, d // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def q4_k_two_level(blocks: np.ndarray, n: int, k: int) -> dict[str, torch.Tensor]:
    """A Q4_K tensor's blocks as nextn's two-level W4A16 tensors, value for value (`quantization/weight_only.py`).

    Q4_K (llama.cpp's `block_q4_K`, 144 bytes per 256 weights of a row): fp16 d and dmin, twelve bytes packing the
    eight sub-blocks' 6-bit scales and mins (unpacked by `gguf.quants.Q4_K.get_scale_min`), 128 bytes of nibbles
    (per 64 weights, 32 bytes: the first 32 weights in the low nibbles, the next 32 in the high ones);
    w = d · scale · q − dmin · min. nextn's form w = q · (d · scale) + dmin' · zero holds it with zero = min and
    dmin' = −dmin.

    Args:
        blocks: the tensor's raw bytes, [n, k / 256 · 144] uint8 (k % 256 == 0).
    Returns:
        {"weight" [n, k/2] uint8, "weight_scale" [n, k/32] uint8, "weight_zero" [n, k/32] int8,
         "weight_scale_2" [n, k/256, 2] float16}.
    """
    import gguf

    s = k // 256
    b = np.ascontiguousarray(blocks).reshape(n, s, 144)
    d = b[..., 0:2].copy().view(np.float16)[..., 0]
    dmin = b[..., 2:4].copy().view(np.float16)[..., 0]
    sc, mn = gguf.quants.Q4_K.get_scale_min(b[..., 4:16].reshape(n * s, 12))
    qs = b[..., 16:].reshape(n, s, 4, 1, 32) >> np.array([0, 4], dtype=np.uint8).reshape(1, 1, 1, 2, 1)
    q = torch.from_numpy((qs & 0x0F).reshape(n, k).astype(np.uint8))
    return {"weight": (q[:, 0::2] | (q[:, 1::2] << 4)).contiguous(),
            "weight_scale": torch.from_numpy(sc.reshape(n, 8 * s).astype(np.uint8)),
            "weight_zero": torch.from_numpy(mn.reshape(n, 8 * s).astype(np.int8)),
            "weight_scale_2": torch.from_numpy(np.stack([d, -dmin], axis=-1))}
