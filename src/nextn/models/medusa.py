"""Medusa heads (Cai et al. 2024, §2.1.1): head i = [ResBlock]×L then its own vocabulary projection.

ResBlock(x) = x + SiLU(Linear(H, H, bias)(x)). Head i predicts the token i + 2 positions after the hidden state's
(the base lm_head predicts +1). Parameter names follow the released files (FasterDecoding/Medusa), under the engine
prefix `medusa_heads.`: `{i}.{l}.linear.weight/bias` for the ResBlocks, `{i}.{L}.weight` for the projection.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class ResBlock(nn.Module):
    def __init__(self, hidden_size: int) -> None:
        super().__init__()
        self.linear = nn.Linear(hidden_size, hidden_size, bias=True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + F.silu(self.linear(x))


class MedusaHeads(nn.ModuleList):
    """`num_heads` heads over the base model's final hidden state; `forward` gives logits [num_heads, ..., V] fp32."""

    def __init__(self, num_heads: int, num_layers: int, hidden_size: int, vocab_size: int) -> None:
        super().__init__(
            nn.Sequential(*[ResBlock(hidden_size) for _ in range(num_layers)],
                          nn.Linear(hidden_size, vocab_size, bias=False))
            for _ in range(num_heads)
        )
        self.num_layers = num_layers

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden [..., H] → logits [num_heads, ..., V] fp32 (heads' own projections; see vocab_projection)."""
        from nextn.models.deepseek_v3.model import vocab_projection

        outs = []
        for head in self:
            x = hidden
            for block in head[: self.num_layers]:
                x = block(x)
            outs.append(vocab_projection(head[self.num_layers].weight, x).float())
        return torch.stack(outs)
