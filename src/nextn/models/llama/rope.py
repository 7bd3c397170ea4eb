"""Rotary position embedding for Llama: plain RoPE and Llama-3.1 scaling, in HF Llama's rotate-half layout.

Sources: RoFormer (Su et al. 2021, §3.4); the Llama-3 frequency scaling and the (x_i, x_{i+d/2}) pair layout follow
HF `transformers` (`modeling_rope_utils._compute_llama3_parameters`, `modeling_llama.rotate_half`), the oracle.
"""

from __future__ import annotations

import math

import torch

from nextn.models.llama.config import LlamaModelConfig


def _plain(theta: float, dim: int) -> torch.Tensor:
    return 1.0 / (theta ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))


def inv_freq(cfg: LlamaModelConfig) -> torch.Tensor:
    """Inverse frequencies [head_dim // 2] fp32 of the full-attention layers, Llama-3-scaled when `cfg.rope_scaling`
    is llama3 (transformers' `_compute_llama3_parameters`), divided by its factor when linear, or divided by
    `cfg.rope_freq_factors` (a GGUF's `rope_freqs`, as ggml's rope divides theta by its freq_factors)."""
    dim = cfg.head_dim
    freqs = _plain(cfg.rope_theta, dim)
    if cfg.rope_freq_factors is not None:
        return freqs / torch.tensor(cfg.rope_freq_factors, dtype=torch.float32)
    s = cfg.rope_scaling
    if s is None:
        return freqs
    if s.rope_type == "linear":
        return freqs / s.factor
    old_ctx = s.original_max_position_embeddings
    low_freq_wavelen = old_ctx / s.low_freq_factor
    high_freq_wavelen = old_ctx / s.high_freq_factor
    wavelen = 2 * math.pi / freqs
    scaled = torch.where(wavelen > low_freq_wavelen, freqs / s.factor, freqs)  # long wavelengths: divided
    smooth = (old_ctx / wavelen - s.low_freq_factor) / (s.high_freq_factor - s.low_freq_factor)
    smoothed = (1 - smooth) * scaled / s.factor + smooth * scaled  # in between: interpolated
    medium = (wavelen >= high_freq_wavelen) & (wavelen <= low_freq_wavelen)
    return torch.where(medium, smoothed, scaled)


def rope_cache(cfg: LlamaModelConfig, num_positions: int) -> torch.Tensor:
    """cos and sin per position and frequency: [num_positions, 2, head_dim // 2] fp32; with a rope base of its own
    for sliding layers (`cfg.rope_local_theta`: Gemma 3) [num_positions, 4, head_dim // 2]: the full layers' cos, sin,
    then the sliding layers' (unscaled, as transformers' `sliding_attention` rope)."""
    positions = torch.arange(num_positions, dtype=torch.float32)[:, None]
    tables = [inv_freq(cfg)] + ([_plain(cfg.rope_local_theta, cfg.head_dim)] if cfg.rope_local_theta else [])
    return torch.cat([torch.stack([a.cos(), a.sin()], dim=1) for a in (positions * f[None, :] for f in tables)], 1)


def apply_rope(x: torch.Tensor, cos_sin: torch.Tensor) -> torch.Tensor:
    """Rotate the pairs (x_i, x_{i + d/2}) of the last dim (HF Llama's `rotate_half` layout).

    Args:
        x: [B, T, heads, head_dim].
        cos_sin: [B, T, 2, head_dim // 2] from `rope_cache` gathered at the tokens' positions.
    Returns:
        [B, T, heads, head_dim], same dtype as x.
    """
    cos = cos_sin[..., 0, :].to(x.dtype).unsqueeze(-2)  # [B, T, 1, d/2]
    sin = cos_sin[..., 1, :].to(x.dtype).unsqueeze(-2)
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)
