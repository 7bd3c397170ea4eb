"""The Llama family (Llama 2/3, TinyLlama, Karpathy's llama2.c models): RMSNorm, RoPE (incl. Llama-3 scaling), GQA,
SwiGLU, tied or untied embeddings, over nextn's paged KV cache."""

from nextn.models.llama.config import Llama3RopeScaling, LlamaModelConfig
from nextn.models.llama.model import LlamaForCausalLM
from nextn.models.llama.weights import runtime_weight_specs, to_runtime

__all__ = ["Llama3RopeScaling", "LlamaForCausalLM", "LlamaModelConfig", "runtime_weight_specs", "to_runtime"]
