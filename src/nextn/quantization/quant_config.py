"""The engine's weight-only quantization as the manifest records it (`QuantConfig`), its algorithms and group sizes.

Free of torch, so that reading a manifest (`nextn cache list`, `--help`) does not import it; the quantizers and
kernels are `quantization/weight_only.py`'s.
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

QUANT_ALGOS = ("W8A16", "W4A16", "W4A8")
#: The 4-bit formats: stored alike; W4A8 multiplies activations quantized to int8 per group, or per super-block with
#: two-level scales (llama.cpp's CPU numerics: Q8_0 / Q8_K)
INT4_ALGOS = ("W4A16", "W4A8")
#: Group sizes tried in order when `group_size` is not given. 32 first (TensorRT-LLM's default is 128): it is the
#: block of llama.cpp's 4-bit formats (Q4_0, Q4_1, Q4_K's sub-blocks), so a 4-bit GGUF re-quantizes almost exactly —
#: measured on SmolLM2-135M Q4_1, held-out perplexity +0.13 % over bf16 at 32 against +25.7 % at 64
#: (docs/PERFORMANCE.md), for at most ~10 % more kernel time.
GROUP_SIZES = (32, 64, 128)


class QuantError(ValueError):
    """A weight that cannot be quantized as asked (shape not divisible by the group size, ...); names the fix."""


class QuantConfig(BaseModel):
    """The engine's weight-only quantization (recorded in the manifest as `quant_config`).

    Attributes:
        quant_algo: "W8A16" (int8 per-channel), "W4A16" (4-bit per-group) or "W4A8" (W4A16's weights, int8
            activations per group or super-block on nextn's CPU kernel).
        group_size: input channels per scale for W4A16 (must divide every quantized layer's input size); None for
            W8A16.
        exclude_modules: linear layers kept in the engine dtype, by name or name prefix (e.g. "lm_head").
        lm_head_quant_algo: the lm_head's own format when it is quantized (None: `quant_algo`). Builds set
            "W8A16": the vocabulary projection decides every token, and 4 bits there cost SmolLM2 +4.3 % held-out
            perplexity where 4-bit decoder layers cost +0.13 % (docs/PERFORMANCE.md).
        super_block_size: W4A16 / W4A8 only: 8-bit group scales and zeros under fp16 scales per super-block of at most
            this many input channels (llama.cpp's k-quants; 256 is Q4_K's); None: bf16 scales and zeros per group.
    """

    model_config = ConfigDict(frozen=True, extra="forbid")

    quant_algo: Literal["W8A16", "W4A16", "W4A8"]
    group_size: int | None = Field(default=None, gt=0)
    exclude_modules: list[str] = Field(default_factory=list)
    lm_head_quant_algo: Literal["W8A16", "W4A16", "W4A8"] | None = None
    super_block_size: int | None = Field(default=None, gt=0)

    def applies_to(self, linear_name: str) -> bool:
        """Whether the linear layer `linear_name` (without `.weight`) is quantized."""
        return not any(linear_name == m or linear_name.startswith(m + ".") for m in self.exclude_modules)

    def for_module(self, linear_name: str) -> "QuantConfig":
        """The config one layer is quantized with: the lm_head's own algorithm for `lm_head`, else this one."""
        algo = self.lm_head_quant_algo
        if linear_name != "lm_head" or algo is None or algo == self.quant_algo:
            return self
        w4 = algo in INT4_ALGOS
        return QuantConfig(quant_algo=algo, group_size=self.group_size if w4 else None,
                           super_block_size=self.super_block_size if w4 else None)


