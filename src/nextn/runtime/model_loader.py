"""The target model of an engine directory: its weights read and verified, the model built on the meta device and
filled, its linears and attention put on nextn's kernels, and whether the result is batch-invariant.

Kernel choice (docs/ARCHITECTURE.md, "The engine directory"): quantized linears become `WeightOnlyLinear`, dense
decoder linears and the lm_head nextn's per-row `DenseLinear` (else oneDNN's `PackedLinear`), Llama/Qwen attention
the paged CPU kernel, and all-W4A16 decoder layers one fused op each.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from pathlib import Path

import torch
from torch import nn

from nextn.build.manifest import EngineError, EngineManifest, verify_engine_files
from nextn.build.safetensors_map import map_safetensors
from nextn.models.medusa import MedusaHeads
from nextn.models.registry import MODEL_CLASSES
from nextn.plugins.decoder_layer import install_fused_layers
from nextn.plugins.dense_linear import install_dense_linears
from nextn.plugins.dense_linear import unavailable_reason as dense_linear_unavailable_reason
from nextn.plugins.packed_linear import install_packed_linears
from nextn.plugins.gated_delta import install_gated_delta
from nextn.plugins import page_release
from nextn.plugins.mla import install_mla
from nextn.plugins.paged_attention import install_paged_attention
from nextn.plugins.rms_norm import install_rms_norms
from nextn.quantization.linear import install_weight_only_linears

logger = logging.getLogger(__name__)

MEDUSA_PREFIX = "medusa_heads."

Weights = dict[str, torch.Tensor]
#: This rank's share of the model and its weights (tensor parallelism: distributed/tensor_parallel.py).
ShardFn = Callable[[nn.Module, Weights], Weights]


def read_weights(engine_dir: Path, manifest: EngineManifest, verify: str, device: torch.device) -> Weights:
    """Every tensor of the engine's weight files, on `device`, after checking presence, sizes, headers and SHA-256 of
    every listed file as `verify` (LlmArgs.verify_weights) says.

    Raises:
        EngineError: a missing, truncated or corrupt file.
    """
    verify_engine_files(engine_dir, manifest, verify)
    weights: Weights = {}
    for f in manifest.weight_files:
        try:
            mapped = map_safetensors(engine_dir / f)  # views of one mapping: read in place where the layout allows
        except (EngineError, OSError) as e:
            raise EngineError(f"cannot read engine weights {engine_dir / f}: {e}; rebuild the engine") from e
        weights.update(mapped if device.type == "cpu" else {k: v.to(device) for k, v in mapped.items()})
    return weights


def pop_medusa_heads(weights: Weights, manifest: EngineManifest) -> MedusaHeads | None:
    """Pop the Medusa heads out of the engine weights (None when the engine has none).

    Raises:
        EngineError: the heads' tensors do not match the manifest's head count and sizes.
    """
    s, cfg = manifest.speculative, manifest.model
    if s.num_medusa_heads == 0:
        return None
    state = {k.removeprefix(MEDUSA_PREFIX): weights.pop(k) for k in list(weights) if k.startswith(MEDUSA_PREFIX)}
    with torch.device("meta"):
        heads = MedusaHeads(s.num_medusa_heads, s.medusa_num_layers, cfg.hidden_size, cfg.vocab_size)
    try:
        heads.load_state_dict(state, strict=True, assign=True)
    except RuntimeError as e:
        raise EngineError(f"engine Medusa heads do not match its manifest: {e}") from e
    return heads.eval().requires_grad_(False)


def load_model(manifest: EngineManifest, weights: Weights, device: torch.device, max_positions: int,
               shard: ShardFn | None = None) -> tuple[nn.Module, bool]:
    """The target model (its family from the manifest) with the engine weights and a rope table for
    `max_positions`, on nextn's kernels where they apply.

    Args:
        shard: this rank's heads, columns, experts and vocabulary of the model and weights (tensor parallelism).
    Returns:
        (model, batch_invariant): whether every linear and attention of the target computes each row alone.
    Raises:
        EngineError: the weights do not match the manifest's model.
    """
    with torch.device("meta"):
        model = MODEL_CLASSES[manifest.architecture](manifest.model, max_positions=1)
    if manifest.quant_config is not None:
        replaced = install_weight_only_linears(model, weights, manifest.quant_config)
        model.lm_head_quantized = "lm_head" in replaced
        page_release.trim_heap()  # repacking's intermediate tensors, back to the system before the next copies
    if shard is not None:
        weights = shard(model, weights)
    try:
        model.load_state_dict(weights, strict=True, assign=True)
    except RuntimeError as e:
        raise EngineError(f"engine weights do not match its manifest: {e}") from e
    model.rope_table = model.rope_table_for(max_positions).to(device)
    # the target's dense linears and lm_head on nextn's batch-invariant CPU kernel; the bf16 linears left (MTP
    # layers, which only draft, or every layer where that kernel cannot load) on oneDNN's pre-packed kernel
    install_dense_linears(model)
    install_packed_linears(model)
    install_paged_attention(model)  # nextn's CPU attention kernel where it applies
    install_rms_norms(model)  # the norms of layers that run as modules, one dispatch each
    install_gated_delta(model)  # nextn's CPU recurrence of Gated DeltaNet layers where it applies
    # nextn's CPU MLA (DeepSeek-V3's attention) where it applies; kv_b_proj in int8 where the linears are quantized
    install_mla(model, int8_kv_b=manifest.quant_config is not None)
    install_fused_layers(model)  # W4A16 on the CPU: one op per decoder layer
    page_release.trim_heap()  # what copying operands into the fused ops' tensors freed, back to the system
    varying = batch_dependent_linear(model) or batch_dependent_attention(model)
    if varying is not None:
        why = (f"{device.type} kernels pick their reduction order by the batch" if device.type != "cpu"
               else "PyTorch's attention over the batch's widest context (head_dim > 256, or a float16 engine)"
               if varying.endswith("self_attn") else f"nextn's dense CPU kernel: {dense_linear_unavailable_reason()}")
        logger.warning("this %s engine is not batch-invariant here (%s runs outside nextn's per-row kernels: %s): "
                       "a request's greedy tokens may depend on what shares its batch", manifest.dtype, varying, why)
    return model.eval().requires_grad_(False), varying is None


def batch_dependent_attention(model: nn.Module) -> str | None:
    """The first of the target's attention modules that offers nextn's paged CPU kernel (or its MLA op) but does not
    run on it (PyTorch's attention instead: head_dim > 256, or off the CPU), whose reductions span the batch's widest
    context; None when every one that offers it does (the kernels compute each query row alone)."""
    layers = tuple(f"model.layers.{i}." for i in range(model.cfg.num_hidden_layers))
    for name, module in model.named_modules():
        if name.startswith(layers) and False in (getattr(module, "paged_attention_kernel", None),
                                                 getattr(module, "mla_kernel", None)):
            return name
    return None


def batch_dependent_linear(model: nn.Module) -> str | None:
    """The first of the target's linears (decoder layers and lm_head) whose rows are not computed alone — PyTorch's
    dense or weight-only kernels, oneDNN's packed one — or None when all run on nextn's per-row CPU kernels (then a
    request's greedy tokens do not depend on the batch: docs/RELIABILITY.md, README "Batch invariance")."""
    from nextn.plugins.packed_linear import PackedLinear
    from nextn.quantization.linear import WeightOnlyLinear

    layers = tuple(f"model.layers.{i}." for i in range(model.cfg.num_hidden_layers))
    read = set(getattr(model, "weights_read_directly", ()))  # by their attention module (`batch_dependent_attention`)
    for name, module in model.named_modules():
        if not name.startswith(layers) or name.rpartition(".")[2] in read:
            continue
        if isinstance(module, WeightOnlyLinear) and module.kernel != "nextn":
            return name
        if isinstance(module, (nn.Linear, PackedLinear)):
            return name
    head = getattr(model, "lm_head", None)
    if getattr(model, "lm_head_quantized", False):
        return None if getattr(head, "kernel", None) == "nextn" else "lm_head"
    return None if getattr(model, "dense_lm_head", None) is not None else "lm_head"
