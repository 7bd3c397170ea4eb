"""The rope scalings of the dense families, as `LlamaModelConfig.rope_scaling` holds them (pydantic, no torch)."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator


class Llama3RopeScaling(BaseModel):
    """Llama-3.1 frequency-dependent RoPE scaling (HF `modeling_rope_utils._compute_llama3_parameters`)."""

    model_config = ConfigDict(frozen=True, extra="forbid", allow_inf_nan=False)

    rope_type: Literal["llama3"] = "llama3"
    factor: float = Field(gt=0)  # long wavelengths are divided by this (Llama 3.1: 8)
    low_freq_factor: float = Field(default=1.0, gt=0)  # wavelengths above orig_ctx / low_freq_factor are scaled
    high_freq_factor: float = Field(default=4.0, gt=0)  # wavelengths below orig_ctx / high_freq_factor are kept
    original_max_position_embeddings: int = Field(default=8192, gt=0)  # pre-training context (Llama 3: 8192)

    @model_validator(mode="after")
    def _check(self) -> "Llama3RopeScaling":
        if self.high_freq_factor <= self.low_freq_factor:
            raise ValueError("llama3 rope scaling needs high_freq_factor > low_freq_factor")
        return self


class LinearRopeScaling(BaseModel):
    """Position interpolation: every inverse frequency divided by `factor` (HF `_compute_linear_scaling_rope_parameters`;
    Gemma 3's full-attention layers from 4B up: 8)."""

    model_config = ConfigDict(frozen=True, extra="forbid", allow_inf_nan=False)

    rope_type: Literal["linear"] = "linear"
    factor: float = Field(gt=0)


class LongRopeScaling(BaseModel):
    """LongRoPE (Phi-3 / Phi-3.5 / Phi-4-mini): each rotated frequency divided by its own factor — `short_factor`
    for a context up to `original_max_position_embeddings`, `long_factor` beyond — and cos / sin times
    `attention_factor` (Ding et al. 2024, "LongRoPE", arXiv:2402.13753; HF `_compute_longrope_parameters`).

    Which factors an engine uses is fixed when its rope table is made, from the table's length (the engine's
    max_seq_len), as llama.cpp chooses them from its context size (`rope_factors_long` when n_ctx exceeds the original
    context); transformers switches per forward pass on the longest position, which agrees up to the original context.
    """

    model_config = ConfigDict(frozen=True, extra="forbid", allow_inf_nan=False)

    rope_type: Literal["longrope"] = "longrope"
    short_factor: tuple[float, ...]  # [rotary_dim // 2] divisors of the inverse frequencies, short contexts
    long_factor: tuple[float, ...]  # [rotary_dim // 2], contexts longer than original_max_position_embeddings
    original_max_position_embeddings: int = Field(gt=0)  # pre-training context (Phi-3: 4096)
    attention_factor: float = Field(default=1.0, gt=0)  # cos and sin × this (HF's default: √(1 + ln s / ln orig))

    @model_validator(mode="after")
    def _check(self) -> "LongRopeScaling":
        if len(self.short_factor) != len(self.long_factor) or not all(
                f > 0 for f in (*self.short_factor, *self.long_factor)):
            raise ValueError("longrope scaling needs short_factor and long_factor of one length, all positive")
        return self


class YarnRopeScaling(BaseModel):
    """YaRN (Peng et al. 2023, "YaRN: Efficient Context Window Extension of Large Language Models",
    arXiv:2309.00071; HF `modeling_rope_utils._compute_yarn_parameters`): inverse frequency i is interpolated (÷
    `factor`) below the dims that turn `beta_slow` times over the original context, kept above those that turn
    `beta_fast` times, blended on a linear ramp between; cos and sin × `attention_factor` (HF's default
    0.1·ln(factor) + 1, or mscale / mscale_all_dim's ratio: resolved when the config is read). Qwen3 / Qwen2.5's
    long-context settings, SmolLM3, gpt-oss."""

    model_config = ConfigDict(frozen=True, extra="forbid", allow_inf_nan=False)

    rope_type: Literal["yarn"] = "yarn"
    factor: float = Field(gt=0)  # context-extension factor (Qwen3: 4 over 32,768 positions)
    original_max_position_embeddings: int = Field(gt=0)  # pre-training context
    beta_fast: float = Field(default=32.0, gt=0)  # ramp boundary, rotations (extrapolation side)
    beta_slow: float = Field(default=1.0, gt=0)  # ramp boundary, rotations (interpolation side)
    attention_factor: float = Field(default=1.0, gt=0)  # cos and sin × this
    truncate: bool = True  # floor / ceil the ramp's ends (HF's default; gpt-oss: false)
