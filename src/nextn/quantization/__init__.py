"""Weight-only quantization (TensorRT-LLM's W8A16 / W4A16): build-time quantization and the runtime linear layer.

`QuantConfig` and the algorithm names import without torch; `quantize` / `dequantize` load
`quantization/weight_only.py` (torch) on first use.
"""

from typing import Any

from nextn.quantization.quant_config import QUANT_ALGOS, QuantConfig, QuantError

__all__ = ["QUANT_ALGOS", "QuantConfig", "QuantError", "dequantize", "quantize"]


def __getattr__(name: str) -> Any:
    if name in ("dequantize", "quantize"):
        from nextn.quantization import weight_only

        return getattr(weight_only, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
