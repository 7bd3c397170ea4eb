"""The Llama family (Llama 2/3, TinyLlama, Karpathy's llama2.c models): RMSNorm, RoPE (incl. Llama-3 scaling), GQA,
SwiGLU, tied or untied embeddings, over nextn's paged KV cache."""

from typing import Any

from nextn.models.llama.config import Llama3RopeScaling, LlamaModelConfig

__all__ = ["Llama3RopeScaling", "LlamaForCausalLM", "LlamaModelConfig", "runtime_weight_specs", "to_runtime"]

#: loaded on first use (they import torch; the configs do not)
_LAZY = {"LlamaForCausalLM": "nextn.models.llama.model", "runtime_weight_specs": "nextn.models.llama.weights",
         "to_runtime": "nextn.models.llama.weights"}


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
