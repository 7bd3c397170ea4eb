"""An MoE layer's routed experts as one op of nextn's CPU kernels (`moe_cpu.cpp`), for W4A16 / W4A8 engines.

`models.moe.SparseMoE` runs each expert's three projections as modules (three kernel calls and a dozen PyTorch ops an
expert, from Python); where every expert is an int4 `WeightOnlyLinear` on nextn's kernel, `install_fused_layers`
gives the layer a `FusedExperts` and the op runs the grouping, the experts (gate and up rows as one matmul, as the
fused decoder layer does) and the weighted sum in C++: the same arithmetic as the modules (bf16 roundings at the same
places; SiLU's exp in f32 where the module computes it in f64, a last-bit difference), batch-invariant, the weights
read in place (the modules' buffers become views of the experts' stacked tensors, `stack_rows`: no second copy).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import nn

from nextn.plugins import cpu_kernels
from nextn.plugins.int4_operands import int4_linears, stack_rows


#: The experts' activations the op computes (`act_name` of the expert modules → the op's `activation`)
ACTIVATIONS = {"silu": 0, "clamped_swiglu": 1}


@dataclass(frozen=True)
class FusedExperts:
    """The op's operands: the E experts' [w, scale, zero] stacked (`stack_rows`: w [E, 2 I, H / 2] of each expert's
    gate-then-up rows, [E, H, I / 2] of its down projection); with biased experts (gpt-oss) their biases as one f32
    tensor each ([E, 2 I] gate then up, [E, H] down); the activation (`ACTIVATIONS`) and the clamped SwiGLU's alpha
    and limit."""

    gate_up: list[torch.Tensor]
    down: list[torch.Tensor]
    group_size: int
    int8_activations: bool
    gate_up_bias: list[torch.Tensor] = field(default_factory=list)
    down_bias: list[torch.Tensor] = field(default_factory=list)
    activation: int = 0
    alpha: float = 1.702
    limit: float = 7.0


def fuse_experts(moe: nn.Module) -> FusedExperts | None:
    """The op's operands for a `SparseMoE`, or None where it does not apply: an expert not an int4 linear on nextn's
    kernel (one group size and format for all), biases on some projections but not all, an activation the op lacks
    (SiLU's SwiGLU and gpt-oss's clamped SwiGLU it has), or widths not multiples of 64."""
    experts = list(moe.experts)
    linears = [lin for ex in experts for lin in (ex.gate_proj, ex.up_proj, ex.down_proj)]
    kind = int4_linears(*linears)
    acts = {getattr(ex, "act_name", "silu") for ex in experts}
    biased = {lin.bias is not None for lin in linears}
    if kind is None or len(biased) != 1 or len(acts) != 1 or next(iter(acts)) not in ACTIVATIONS:
        return None
    hidden, width = experts[0].down_proj.out_features, experts[0].gate_proj.out_features
    if hidden % 64 or width % 64 or hidden % kind[0] or width % kind[0]:
        return None
    gate_up = stack_rows([[ex.gate_proj, ex.up_proj] for ex in experts])  # [w, scale, zero] (+ [bias])
    down = stack_rows([[ex.down_proj] for ex in experts])
    biases = ([gate_up[3].float().contiguous()], [down[3].float().contiguous()]) if True in biased else ([], [])
    first = experts[0]
    return FusedExperts(gate_up[:3], down[:3], *kind, *biases, ACTIVATIONS[next(iter(acts))],
                        float(getattr(first, "alpha", 1.702)), float(getattr(first, "limit", 7.0)))


def experts_forward(fused: FusedExperts, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """Σ_k weights[n, k] · Expert_{ids[n, k]}(x[n]) through the op. x: [N, hidden] bf16; weights: [N, top_k] f32;
    ids: [N, top_k] int64 → [N, hidden] bf16."""
    return cpu_kernels.ops().moe_experts(x.contiguous(), ids.contiguous(), weights.float().contiguous(),
                                         fused.gate_up, fused.down, fused.group_size, fused.int8_activations,
                                         fused.gate_up_bias, fused.down_bias, fused.activation, fused.alpha,
                                         fused.limit)


def block_applies(moe: nn.Module, norm: nn.Module) -> bool:
    """Whether `block_forward` computes this MoE MLP (with its pre-MLP `norm`): fused experts, the softmax `Router`
    (gpt-oss's with its bias) on bf16 weights, no shared expert, an RMSNorm with bf16 weights (Llama's form, or one
    whose f32 scale the op takes: `fp32_scale`, gpt-oss's)."""
    gate = getattr(moe, "gate", None)
    return (getattr(moe, "fused_experts", None) is not None and getattr(gate, "kind", None) == "softmax"
            and gate.weight.dtype == torch.bfloat16 and moe.shared_expert is None and moe.shared_experts is None
            and isinstance(getattr(norm, "weight", None), torch.Tensor) and norm.weight.dtype == torch.bfloat16)


def block_forward(moe: nn.Module, norm: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """x + moe(norm(x)) through one op (`block_applies`): the norm, router, top-k and residual add in C++ beside the
    experts. x: [..., hidden] bf16 → the same shape."""
    flat = x.reshape(-1, x.shape[-1]).contiguous()
    fused = moe.fused_experts
    scale = norm.fp32_scale() if hasattr(norm, "fp32_scale") else None  # f32 scales: the op's second norm form
    bias = moe.gate.bias
    out = cpu_kernels.ops().moe_block(flat, norm.weight if scale is None else scale.contiguous(), norm.eps,
                                      moe.gate.weight, moe.gate.top_k, moe.gate.norm_topk_prob, fused.gate_up,
                                      fused.down, fused.group_size, fused.int8_activations, fused.gate_up_bias,
                                      fused.down_bias, None if bias is None else bias.float().contiguous(),
                                      fused.activation, fused.alpha, fused.limit)
    return out.view(x.shape)
