"""Running one engine over several processes with `torch.distributed`: tensor parallelism (Megatron-LM's split of
attention heads and MLP columns/rows, vocab-parallel embedding and lm_head), expert parallelism for DeepSeek-V3's
routed experts, the rank-0-drives / workers-mirror step protocol, the `LLM` worker launcher, and disaggregated
prefill/decode. See docs/ARCHITECTURE.md, "Beyond one device".
"""

from nextn.distributed.mapping import Mapping

__all__ = ["Mapping"]
