"""DeepSeek-V3 MoE: sigmoid group-limited (noaux_tc) routing, stacked routed experts, shared experts.

Sources: DeepSeek-V3 report §2.1.2 (auxiliary-loss-free balancing: the correction bias is used for selection
only); deepseek-ai/DeepSeek-V3's modeling_deepseek.py has the router step by step. Dispatch has fixed shapes
and no host synchronisation (no `.item()`, no boolean-mask indexing), so the step that contains it can be captured
in one CUDA graph:
- few assignments (decode): gather each assignment's expert weights, as gpt-fast's Mixtral does;
- many assignments (prefill): scatter tokens into per-expert buffers of fixed capacity (one row per token: no
  token is ever dropped, so routing stays lossless), one batched matmul per projection, gather back.
The choice depends on shapes only, never on values.

Batch invariance on the CPU (`use_dense_kernel`, called at load by `plugins.dense_linear.install_dense_linears`):
both paths above change a token's arithmetic with the number of tokens in the step (gather vs buffers, then the
matmul's blocking by row count), so a request's output would depend on what shares its step. There the router and
every expert run on nextn's batch-invariant dense kernel, each expert on its own tokens only (`moe.routed_experts`,
the layer the softmax-routed families share: a step costs its active experts, not all E), a token's outputs summed
in ascending expert id — each output row is the same sequence of operations alone or among others.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from nextn.models.config import DeepseekV3ModelConfig
from nextn.models.layers import GatedMLP, row_exact
from nextn.models.moe import NoAuxRouter, routed_experts


class RoutedExperts(nn.Module):
    """E SwiGLU experts stacked: `gate_up_proj` [E, 2·I, hidden] (gate rows, then up rows), `down_proj` [E, hidden, I]."""

    def __init__(self, cfg: DeepseekV3ModelConfig) -> None:
        super().__init__()
        e, w, h = cfg.n_routed_experts, cfg.moe_intermediate_size, cfg.hidden_size
        self.num_experts, self.width = e, w
        self.gate_up_proj = nn.Parameter(torch.zeros(e, 2 * w, h))
        self.down_proj = nn.Parameter(torch.zeros(e, h, w))
        #: Per expert, gate_up and down on nextn's batch-invariant dense kernel (`use_dense_kernel`).
        self.dense: nn.ModuleList | None = None

    def use_dense_kernel(self) -> None:
        """Run every expert on nextn's batch-invariant dense CPU kernel over the capacity buffers, whatever the
        number of tokens (the kernel must be available; the weights are packed: E × (2I·H + H·I) values). Weights
        off the CPU or not bf16 / fp16 / fp32: no change."""
        from nextn.plugins.dense_linear import DTYPES, DenseLinear

        w = self.gate_up_proj
        if w.device.type != "cpu" or w.dtype not in DTYPES or type(self) is not RoutedExperts:
            return

        self.dense = nn.ModuleList(nn.ModuleList([DenseLinear.from_weight(gu), DenseLinear.from_weight(d)])
                                   for gu, d in zip(self.gate_up_proj.detach(), self.down_proj.detach()))

    def forward(self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        """Σ_k weights[:, k] · Expert_{ids[:, k]}(x). x: [N, hidden]; weights, ids: [N, top_k] → [N, hidden]."""
        n, top_k = ids.shape
        if self.dense is not None:  # the routed experts only, each row alone (batch-invariant)
            return routed_experts(x, weights, ids, self._dense_experts, self.num_experts)
        if n * top_k <= self.num_experts:
            out = self._gathered(x, ids)
        else:
            out = self._capacity_buffers(x, ids)
        return (out * weights.to(out.dtype)[..., None]).sum(1)

    def _dense_experts(self, e: int) -> Callable[[torch.Tensor], torch.Tensor]:
        """Expert `e` on the dense kernel: rows [n, hidden] → [n, hidden]."""
        gate_up, down = self.dense[e]
        return lambda rows: down(_swiglu(gate_up(rows), self.width, exact=True))

    def _gathered(self, x: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        """Per-assignment weight gather: [N, top_k, hidden]; cost ∝ N·top_k experts."""
        gate_up = torch.einsum("nh,nkih->nki", x, self.gate_up_proj[ids])
        gate, up = gate_up.split(self.width, dim=-1)
        return torch.einsum("nki,nkhi->nkh", F.silu(gate) * up, self.down_proj[ids])

    def _capacity_buffers(self, x: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        """Scatter into [E, capacity = N, hidden] buffers (a token meets an expert at most once), bmm, gather."""
        n, top_k = ids.shape
        e = self.num_experts
        flat = ids.reshape(-1)  # [N·top_k] assignments, token-major
        one_hot = F.one_hot(flat, e)  # [A, E]
        rank = (one_hot.cumsum(0) - 1).gather(1, flat[:, None]).squeeze(1)  # row of each assignment in its expert
        dest = flat * n + rank  # [A] into the [E·N] buffer
        tokens = torch.arange(n, device=x.device).repeat_interleave(top_k)
        buf = x.new_zeros(e * n, x.shape[-1]).index_copy_(0, dest, x[tokens]).view(e, n, -1)
        gate_up = torch.bmm(buf, self.gate_up_proj.transpose(1, 2))  # [E, N, 2I]
        out = torch.bmm(_swiglu(gate_up, self.width), self.down_proj.transpose(1, 2))  # [E, N, hidden]
        return out.reshape(e * n, -1)[dest].view(n, top_k, -1)


def _swiglu(gate_up: torch.Tensor, width: int, exact: bool = False) -> torch.Tensor:
    """[..., 2·width] (gate, then up) → silu(gate) · up [..., width]; `exact`: the silu by `layers.row_exact`."""
    gate, up = gate_up.split(width, dim=-1)
    return (row_exact(F.silu, gate) if exact else F.silu(gate)) * up


class DeepseekMoE(nn.Module):
    """Routed experts plus shared experts: Σ w_k E_k(x) + Shared(x)."""

    def __init__(self, cfg: DeepseekV3ModelConfig) -> None:
        super().__init__()
        self.gate = NoAuxRouter(cfg.hidden_size, cfg.n_routed_experts, cfg.num_experts_per_tok, cfg.n_group,
                                cfg.topk_group, cfg.norm_topk_prob, cfg.routed_scaling_factor)
        self.experts = RoutedExperts(cfg)
        self.shared_experts = (
            GatedMLP(cfg.hidden_size, cfg.moe_intermediate_size * cfg.n_shared_experts) if cfg.n_shared_experts else None
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x: [..., hidden] → [..., hidden]."""
        shape = x.shape
        flat = x.reshape(-1, shape[-1])
        weights, ids = self.gate(flat)
        out = self.experts(flat, weights, ids)
        if self.shared_experts is not None:
            out = out + self.shared_experts(flat)
        return out.view(shape)
