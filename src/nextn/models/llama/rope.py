"""Rotary position embedding for Llama: plain RoPE and its scalings (Llama 3.1, linear, LongRoPE, YaRN), in HF
Llama's rotate-half layout.

Sources: RoFormer (Su et al. 2021, §3.4); the frequency scalings and the (x_i, x_{i+d/2}) pair layout follow HF
`transformers` (`modeling_rope_utils._compute_llama3_parameters`, `_compute_yarn_parameters`,
`modeling_llama.rotate_half`), the oracle; YaRN: Peng et al. 2023 (arXiv:2309.00071, §3.2-3.4).
"""

from __future__ import annotations

import math

import torch

from nextn.models import yarn
from nextn.models.llama.config import LlamaModelConfig


def _plain(theta: float, dim: int) -> torch.Tensor:
    return 1.0 / (theta ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))


def inv_freq(cfg: LlamaModelConfig, num_positions: int | None = None) -> torch.Tensor:
    """Inverse frequencies [rotary_dim // 2] fp32 of the full-attention layers, Llama-3-scaled when `cfg.rope_scaling`
    is llama3 (transformers' `_compute_llama3_parameters`), divided by its factor when linear, by LongRoPE's short
    factors — its long ones for a table of more than `original_max_position_embeddings` positions (`num_positions`)
    —, blended on YaRN's ramp (`models/yarn.py`), or divided by `cfg.rope_freq_factors` (a GGUF's `rope_freqs`, as ggml's
    rope divides theta by its freq_factors)."""
    if cfg.rope_proportion is not None:  # Gemma 4: the first pairs of a global_head_dim-wide rope, the rest still
        dim = cfg.global_head_dim or cfg.head_dim
        return _plain(cfg.rope_theta, dim)[:int(cfg.rope_proportion * dim // 2)]
    dim = cfg.rotary_dim or cfg.head_dim
    freqs = _plain(cfg.rope_theta, dim)
    if cfg.rope_freq_factors is not None:
        return freqs / torch.tensor(cfg.rope_freq_factors, dtype=torch.float32)
    s = cfg.rope_scaling
    if s is None:
        return freqs
    if s.rope_type == "linear":
        return freqs / s.factor
    if s.rope_type == "longrope":
        long = num_positions is not None and num_positions > s.original_max_position_embeddings
        return freqs / torch.tensor(s.long_factor if long else s.short_factor, dtype=torch.float32)
    if s.rope_type == "yarn":
        return yarn.inv_freq(cfg.rope_theta, dim, s.factor, s.original_max_position_embeddings, s.beta_fast,
                             s.beta_slow, s.truncate)
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
    then the sliding layers' (unscaled, as transformers' `sliding_attention` rope).

    Partial rotary (`cfg.rotary_dim` < head_dim): the pairs past rotary_dim // 2 get cos 1, sin 0 (they pass through);
    the engine's q and k rows are ordered so that pair i is HF's (i, i + rotary_dim / 2) for i < rotary_dim / 2
    (`partial_rotary_order`). LongRoPE's and YaRN's attention factor scales the rotated pairs' cos and sin (HF's
    `attention_scaling`)."""
    positions = torch.arange(num_positions, dtype=torch.float32)[:, None]
    half = max(cfg.head_dim, cfg.global_head_dim or 0) // 2  # Gemma 4: a narrower layer reads its first pairs
    tables = [inv_freq(cfg, num_positions)] + ([_plain(cfg.rope_local_theta, cfg.head_dim)] if cfg.rope_local_theta
                                               else [])
    scale = cfg.rope_scaling.attention_factor if cfg.rope_scaling is not None and \
        cfg.rope_scaling.rope_type in ("longrope", "yarn") else 1.0
    parts = []
    for f in tables:
        angles = positions * f[None, :]
        cos, sin = angles.cos(), angles.sin()
        if scale != 1.0:
            cos, sin = cos * scale, sin * scale
        rotated = f.shape[0]
        if rotated < half:  # pass-through pairs
            cos = torch.cat([cos, torch.ones(num_positions, half - rotated)], 1)
            sin = torch.cat([sin, torch.zeros(num_positions, half - rotated)], 1)
        parts.append(torch.stack([cos, sin], dim=1))
    return torch.cat(parts, 1)


def partial_rotary_order(head_dim: int, rotary_dim: int, interleaved: bool = False) -> torch.Tensor:
    """The order [head_dim] int64 of a head's q / k dims in the engine under partial rotary: HF rotates the pairs
    (j, j + r/2) of its first r = rotary_dim dims (`rotate_half` over q[..., :r]) and passes the rest; the engine
    rotates the pairs (i, i + head_dim/2). Engine dim i < head_dim/2 is HF dim i for i < r/2, else HF dim
    r/2 + i (the first half of the pass-through dims); engine dim head_dim/2 + i is HF dim r/2 + i for i < r/2, else
    HF dim r + (head_dim - r)/2 + (i - r/2). Applied to q and k alike (and their per-head norms), it leaves every
    q · k unchanged. `interleaved` (GLM-4): HF's pairs are (2j, 2j + 1), so engine dims i and head_dim/2 + i are
    HF dims 2i and 2i + 1 for i < r/2."""
    r, half, rest = rotary_dim, head_dim // 2, (head_dim - rotary_dim) // 2
    if interleaved:
        first = [2 * j for j in range(r // 2)] + [r + j for j in range(rest)]
        second = [2 * j + 1 for j in range(r // 2)] + [r + rest + j for j in range(rest)]
    else:
        first = list(range(r // 2)) + [r + j for j in range(rest)]
        second = [r // 2 + j for j in range(r // 2)] + [r + rest + j for j in range(rest)]
    assert len(first) == half and len(second) == half
    return torch.tensor(first + second, dtype=torch.int64)


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
