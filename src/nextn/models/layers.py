"""Small layers shared by model families: RMSNorm and the gated (SwiGLU) MLP."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


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
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


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
