"""Rotary position embedding for MLA's rope dims: YaRN scaling and DeepSeek's interleaved pair layout.

Sources: YaRN (Peng et al. 2023, "YaRN: Efficient Context Window Extension", §3.2–3.4); the frequency ramp and
attention factor follow HF `transformers` `modeling_rope_utils._compute_yarn_parameters`, the numerical oracle.
"""

from __future__ import annotations


import torch

from nextn.models import yarn
from nextn.models.config import RopeConfig


def inv_freq_and_attention_factor(rope: RopeConfig, dim: int, max_position_embeddings: int) -> tuple[torch.Tensor, float]:
    """Inverse frequencies [dim // 2] (fp32) and the cos/sin attention factor for `dim` rotary dims."""
    base = rope.rope_theta
    pos_freqs = base ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim)
    if rope.rope_type == "default":
        return 1.0 / pos_freqs, 1.0
    factor = rope.factor or max_position_embeddings / rope.original_max_position_embeddings
    attention_factor = yarn.attention_factor(factor, rope.attention_factor, rope.mscale, rope.mscale_all_dim)
    orig = rope.original_max_position_embeddings or max_position_embeddings
    return yarn.inv_freq(base, dim, factor, orig, rope.beta_fast, rope.beta_slow, rope.truncate), attention_factor


def rope_cache(rope: RopeConfig, dim: int, max_position_embeddings: int, num_positions: int) -> torch.Tensor:
    """cos and sin per position and pair: [num_positions, 2, dim // 2] fp32, already times the attention factor."""
    inv_freq, factor = inv_freq_and_attention_factor(rope, dim, max_position_embeddings)
    angles = torch.arange(num_positions, dtype=torch.float32)[:, None] * inv_freq[None, :]
    return torch.stack([angles.cos() * factor, angles.sin() * factor], dim=1)


def apply_rope(x: torch.Tensor, cos_sin: torch.Tensor, interleaved: bool = True) -> torch.Tensor:
    """Rotate adjacent pairs (x0, x1), (x2, x3), ... of the last dim (or (x_i, x_{i+d/2}) when not interleaved).

    Args:
        x: [..., T, heads, dim] (or [..., T, dim] with cos_sin broadcast accordingly).
        cos_sin: [..., T, 2, dim // 2] from `rope_cache` gathered at the tokens' positions.
    Returns:
        The rotated tensor with the pairs split into halves: [evens rotated, odds rotated]. q and k get the same
        permutation, so q·k is that of the interleaved rotation (HF's `apply_rotary_pos_emb_interleave` does likewise).
    """
    cos, sin = cos_sin[..., 0, :].to(x.dtype), cos_sin[..., 1, :].to(x.dtype)
    if x.dim() == cos.dim() + 1:  # a heads dim sits between T and dim
        cos, sin = cos.unsqueeze(-2), sin.unsqueeze(-2)
    half = x.shape[-1] // 2
    x1, x2 = (x[..., 0::2], x[..., 1::2]) if interleaved else (x[..., :half], x[..., half:])
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)
