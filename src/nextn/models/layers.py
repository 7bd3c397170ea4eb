"""Small layers shared by model families: RMSNorm and the gated (SwiGLU) MLP."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


def row_exact(fn, x: torch.Tensor) -> torch.Tensor:
    """fn(x) (an elementwise transcendental: sigmoid, silu) computed in float64, rounded to x's dtype.

    PyTorch's CPU elementwise kernels run the vector body (SLEEF) over a contiguous buffer and a scalar loop over
    its tail, which can differ in the last ulp: where an element falls — body or tail — depends on the tensor's
    size, i.e. on how many tokens share the step (DeepSeek-V3's router scores [N, 8] at N = 5; a SwiGLU width like
    stories260K's 172 leaves a tail in the last row). In float64 the
    two paths may still differ in the last double ulp, which rounding to fp32/bf16 hides (but for ~2⁻²⁹ of inputs).
    """
    return fn(x.double()).to(x.dtype)


class RMSNorm(nn.Module):
    """Root-mean-square norm (Zhang & Sennrich 2019), computed in fp32 and cast back, as HF's `*RMSNorm`."""

    def __init__(self, dim: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * xf.to(x.dtype)


class GatedMLP(nn.Module):
    """down(silu(gate(x)) · up(x)): the dense MLP, and DeepSeek's shared experts."""

    def __init__(self, hidden_size: int, intermediate_size: int) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(hidden_size, intermediate_size, bias=False)
        self.up_proj = nn.Linear(hidden_size, intermediate_size, bias=False)
        self.down_proj = nn.Linear(intermediate_size, hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate = self.gate_proj(x)
        # on the CPU the silu's ulp must not depend on the row count: row_exact (a GPU's kernels are per element)
        return self.down_proj((row_exact(F.silu, gate) if gate.device.type == "cpu" else F.silu(gate)) * self.up_proj(x))


class PreNormDecoderLayer(nn.Module):
    """The pre-norm transformer block both families use: x + attn(norm(x)), then h + mlp(norm(h)).

    `self_attn` takes (x, cos_sin, kv_cache, meta) and writes its KV into the paged cache; parameter names are HF's
    (`self_attn`, `mlp`, `input_layernorm`, `post_attention_layernorm`).
    """

    def __init__(self, self_attn: nn.Module, mlp: nn.Module, hidden_size: int, eps: float) -> None:
        super().__init__()
        self.self_attn = self_attn
        self.mlp = mlp
        self.input_layernorm = RMSNorm(hidden_size, eps=eps)
        self.post_attention_layernorm = RMSNorm(hidden_size, eps=eps)

    def forward(self, x: torch.Tensor, cos_sin: torch.Tensor, kv_cache: torch.Tensor, meta) -> torch.Tensor:
        """x: [B, T, hidden] → [B, T, hidden]; writes this layer's KV (kv_cache: [num_slots, kv dim])."""
        x = x + self.self_attn(self.input_layernorm(x), cos_sin, kv_cache, meta)
        return x + self.mlp(self.post_attention_layernorm(x))
