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
