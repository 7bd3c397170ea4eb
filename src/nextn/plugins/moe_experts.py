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

from nextn.plugins import cpu_kernels, page_release
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
    # the layer's shared expert (Qwen2-MoE's `shared_expert`, DeepSeek's `shared_experts`) as a stack of one expert
    # ([w [1, 2 I', H / 2], scale, zero] and [w [1, H, I' / 2], ...]); empty: none, or not on the op's kernel
    shared_gate_up: list[torch.Tensor] = field(default_factory=list)
    shared_down: list[torch.Tensor] = field(default_factory=list)


def fuse_experts(moe: nn.Module) -> FusedExperts | None:
    """The op's operands for a `SparseMoE`, or None where it does not apply: an expert not an int4 linear on nextn's
    kernel (one group size and format for all), biases on some projections but not all, an activation the op lacks
    (SiLU's SwiGLU and gpt-oss's clamped SwiGLU it has), or widths not multiples of 64. The shared expert's operands
    are set where it is an unbiased SiLU `GatedMLP` of the same int4 format (`_fuse_shared`)."""
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
    page_release.trim_heap()  # the experts' own tensors, freed by the stacking: a layer's worth at most at once
    biases = ([gate_up[3].float().contiguous()], [down[3].float().contiguous()]) if True in biased else ([], [])
    first = experts[0]
    shared = _fuse_shared(_shared_mlp(moe), kind)
    return FusedExperts(gate_up[:3], down[:3], *kind, *biases, ACTIVATIONS[next(iter(acts))],
                        float(getattr(first, "alpha", 1.702)), float(getattr(first, "limit", 7.0)), *shared)


def _shared_mlp(moe: nn.Module) -> nn.Module | None:
    """The MoE MLP's shared expert module (Qwen2-MoE's `shared_expert`, DeepSeek's `shared_experts`), or None."""
    return getattr(moe, "shared_expert", None) or getattr(moe, "shared_experts", None)


def _fuse_shared(mlp: nn.Module | None, kind: tuple[int, bool]) -> tuple[list, list]:
    """A shared expert's stacked operands (one expert) where the op computes it: an unbiased SiLU `GatedMLP` whose
    linears are int4 on nextn's kernel in the routed experts' format `kind`, widths multiples of 64; else ([], [])."""
    if mlp is None or getattr(mlp, "act_name", None) != "silu":
        return [], []
    linears = (mlp.gate_proj, mlp.up_proj, mlp.down_proj)
    if int4_linears(*linears) != kind or any(lin.bias is not None for lin in linears) or mlp.gate_proj.out_features % 64:
        return [], []
    return stack_rows([[mlp.gate_proj, mlp.up_proj]]), stack_rows([[mlp.down_proj]])


def experts_forward(fused: FusedExperts, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """Σ_k weights[n, k] · Expert_{ids[n, k]}(x[n]) through the op. x: [N, hidden] bf16; weights: [N, top_k] f32;
    ids: [N, top_k] int64 → [N, hidden] bf16."""
    return cpu_kernels.ops().moe_experts(x.contiguous(), ids.contiguous(), weights.float().contiguous(),
                                         fused.gate_up, fused.down, fused.group_size, fused.int8_activations,
                                         fused.gate_up_bias, fused.down_bias, fused.activation, fused.alpha,
                                         fused.limit)


#: The routers the block op computes (`kind` of models/moe.py's routers → the op's `router_kind`)
ROUTERS = {"softmax": 0, "sigmoid_grouped": 1}


def block_applies(moe: nn.Module, norm: nn.Module) -> bool:
    """Whether `block_forward` computes this MoE MLP (with its pre-MLP `norm`): fused experts, a router the op has
    (`ROUTERS`: the softmax `Router`, gpt-oss's with its bias, or DeepSeek's `NoAuxRouter`) on bf16 weights, the shared
    expert (if any) fused too and its gate (Qwen2-MoE's) on bf16 weights, an RMSNorm with bf16 weights (Llama's form,
    or one whose f32 scale the op takes: `fp32_scale`, gpt-oss's)."""
    gate, fused = getattr(moe, "gate", None), getattr(moe, "fused_experts", None)
    if fused is None or getattr(gate, "kind", None) not in ROUTERS or gate.weight.dtype != torch.bfloat16:
        return False
    shared_gate = getattr(moe, "shared_expert_gate", None)
    if _shared_mlp(moe) is not None and (not fused.shared_gate_up or (
            shared_gate is not None and shared_gate.weight.dtype != torch.bfloat16)):
        return False
    return isinstance(getattr(norm, "weight", None), torch.Tensor) and norm.weight.dtype == torch.bfloat16


def block_forward(moe: nn.Module, norm: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """x + moe(norm(x)) through one op (`block_applies`): the norm, router, top-k, shared expert and residual add in
    C++ beside the experts. x: [..., hidden] bf16 → the same shape."""
    flat = x.reshape(-1, x.shape[-1]).contiguous()
    fused, gate = moe.fused_experts, moe.gate
    scale = norm.fp32_scale() if hasattr(norm, "fp32_scale") else None  # f32 scales: the op's second norm form
    grouped = gate.kind == "sigmoid_grouped"
    bias = gate.e_score_correction_bias if grouped else gate.bias
    shared_gate = getattr(moe, "shared_expert_gate", None)
    out = cpu_kernels.ops().moe_block(
        flat, norm.weight if scale is None else scale.contiguous(), norm.eps, gate.weight, gate.top_k,
        bool(gate.norm_topk_prob), fused.gate_up, fused.down, fused.group_size, fused.int8_activations,
        fused.gate_up_bias, fused.down_bias, fused.shared_gate_up, fused.shared_down,
        router_bias=None if bias is None else bias.float().contiguous(), activation=fused.activation,
        alpha=fused.alpha, limit=fused.limit, router_kind=ROUTERS[gate.kind], n_group=gate.n_group if grouped else 1,
        topk_group=gate.topk_group if grouped else 1,
        routed_scaling=float(gate.routed_scaling_factor) if grouped else 1.0,
        shared_gate=None if shared_gate is None else shared_gate.weight.reshape(-1))
    return out.view(x.shape)
