"""Weight-only quantization (TensorRT-LLM's W8A16 / W4A16): build-time quantization and the runtime linear layer."""

from nextn.quantization.weight_only import QUANT_ALGOS, QuantConfig, QuantError, dequantize, quantize

__all__ = ["QUANT_ALGOS", "QuantConfig", "QuantError", "dequantize", "quantize"]
