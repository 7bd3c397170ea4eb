"""YaRN rope scaling, shared by the dense families' rope (`models/llama/rope.py`) and MLA's (`models/deepseek_v3/
rope.py`): the blended inverse frequencies and the attention factor that scales cos and sin.

Sources: Peng et al. 2023, "YaRN: Efficient Context Window Extension of Large Language Models" (arXiv:2309.00071,
§3.2-3.4, eq. 22); HF `transformers` `modeling_rope_utils._compute_yarn_parameters`, the numerical oracle
(`tests/models/test_rope_yarn.py`, `tests/models/test_deepseek_v3.py`).
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch


def mscale(scale: float, m: float = 1.0) -> float:
    """YaRN's attention temperature (eq. 22): 0.1·m·ln(scale) + 1 for scale > 1, else 1."""
    return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0


def attention_factor(factor: float, given: float | None = None, m: float | None = None,
                     m_all_dim: float | None = None) -> float:
    """The factor cos and sin are multiplied by: `given` when the config sets it, else mscale(factor, m) /
    mscale(factor, m_all_dim) when both are set (DeepSeek-V3), else mscale(factor)."""
    if given is not None:
        return float(given)
    if m and m_all_dim:
        return mscale(factor, m) / mscale(factor, m_all_dim)
    return mscale(factor)


def inv_freq(base: float, dim: int, factor: float, original_context: int, beta_fast: float = 32.0,
             beta_slow: float = 1.0, truncate: bool = True) -> "torch.Tensor":
    """Inverse frequencies [dim // 2] fp32 of `dim` rotary dims at rope base `base`: ÷ `factor` (interpolated) for
    the dims that turn fewer than `beta_slow` times over `original_context` positions, kept (extrapolated) for those
    that turn more than `beta_fast` times, blended on a linear ramp between (its ends floored / ceiled when
    `truncate`, HF's default; gpt-oss sets it false)."""
    import torch

    def correction_dim(rotations: float) -> float:  # the dim whose wavelength fits `rotations` times in the context
        return dim * math.log(original_context / (rotations * 2 * math.pi)) / (2 * math.log(base))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # HF's guard against a zero-width ramp
    pos_freqs = base ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim)
    extrapolation = 1 - ((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    return (1.0 / (factor * pos_freqs)) * (1 - extrapolation) + (1.0 / pos_freqs) * extrapolation
