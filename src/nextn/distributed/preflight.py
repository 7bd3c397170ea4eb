"""Checks of the parallel sizes made before any worker process starts: every count that becomes processes must fit
the model (each split dimension divisible, as `tensor_parallel.shard_model` and `expert_parallel.ParallelMoE` split
it) and the machine (one rank per CPU core, or per GPU). A size that fails is a `MappingError` naming both numbers
and the fix; nothing has been started, so nothing is left to clean up.
"""

from __future__ import annotations

import os

import torch

from nextn.distributed.mapping import Mapping, MappingError


def _divides(n: int, parts: int, what: str, size_name: str) -> None:
    if n % parts:
        raise MappingError(f"{what} = {n} is not divisible by {parts}: use a {size_name} that divides it")


def check_model_split(cfg, mapping: Mapping, quantized: bool = False) -> None:
    """Every dimension the ranks split must divide by its parallel size.

    Args:
        cfg: the engine's model config (`LlamaModelConfig` or `DeepseekV3ModelConfig`).
        mapping: the parallel sizes (any rank).
        quantized: the engine holds weight-only quantized linears (not split yet).
    Raises:
        MappingError: naming the model field, its value, the size and the fix.
    """
    tp, ep, moe_tp = mapping.tp_size, mapping.moe_ep_size, mapping.moe_tp_size
    experts = getattr(cfg, "n_routed_experts", None)
    if ep > 1 and not experts:
        raise MappingError(f"moe_expert_parallel_size = {ep} but this model has no routed experts: leave it unset")
    if tp == 1:
        return
    if quantized:
        raise MappingError("weight-only quantized engines run with tensor_parallel_size 1 for now: build the engine "
                           "with --quant_algo none to split it")
    tp_name = "tensor_parallel_size"
    unsplit = [name for name, on in (("embedding_multiplier", getattr(cfg, "embedding_multiplier", None) not in
                                      (None, 1.0)),
                                     ("qk_norm_over: all_heads", getattr(cfg, "qk_norm_over", "head") == "all_heads"),
                                     ("num_experts", getattr(cfg, "num_experts", 0) > 0))
               if on]
    # the vocabulary-parallel embedding has no multiplier; a norm over all heads spans every rank's heads; the
    # softmax-routed MoE layer (models/moe.py) is not split across ranks yet
    if unsplit:
        raise MappingError(f"{cfg.architecture} ({', '.join(unsplit)}) runs with tensor_parallel_size 1 for now")
    if hasattr(cfg, "num_key_value_heads"):  # Llama family: KV heads first, their split bounds the query heads'
        _divides(cfg.num_key_value_heads, tp, "num_key_value_heads", tp_name)
    _divides(cfg.num_attention_heads, tp, "num_attention_heads", tp_name)
    num_layers = cfg.num_hidden_layers + getattr(cfg, "num_nextn_predict_layers", 0)
    is_moe = getattr(cfg, "is_moe_layer", lambda i: False)
    if not all(is_moe(i) for i in range(num_layers)):
        _divides(cfg.intermediate_size, tp, "intermediate_size", tp_name)
    if experts:
        _divides(experts, ep, "n_routed_experts", "moe_expert_parallel_size")
        if cfg.moe_intermediate_size % moe_tp:
            raise MappingError(f"moe_intermediate_size = {cfg.moe_intermediate_size} is not divisible by "
                               f"moe_tp_size = tensor_parallel_size / moe_expert_parallel_size = {moe_tp}: choose "
                               "sizes whose quotient divides it")
        if cfg.n_shared_experts:
            _divides(cfg.moe_intermediate_size * cfg.n_shared_experts, tp,
                     "moe_intermediate_size × n_shared_experts (the shared experts' width)", tp_name)


def available_ranks(device: str | torch.device) -> tuple[int, str]:
    """How many ranks this machine can run (one per GPU on CUDA, one per usable CPU core otherwise) and what
    was counted."""
    if torch.device(device).type == "cuda":
        return torch.cuda.device_count(), "CUDA devices (torch.cuda.device_count())"
    try:
        cores = len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        cores = os.cpu_count() or 1
    return cores, "CPU cores available to this process"


def check_machine(mapping: Mapping, device: str | torch.device) -> None:
    """The ranks `LLM` would start on this machine must fit it: at most one per GPU (CUDA) or CPU core.

    Raises:
        MappingError: naming tensor_parallel_size and what the machine has.
    """
    have, what = available_ranks(device)
    if mapping.world_size > have:
        raise MappingError(f"tensor_parallel_size = {mapping.world_size} needs {mapping.world_size} ranks on this "
                           f"machine but it has {have} {what}: use a tensor_parallel_size of at most {have} "
                           "(or launch the ranks across machines with torchrun)")
