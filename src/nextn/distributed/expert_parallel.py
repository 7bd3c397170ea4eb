"""Expert parallelism for DeepSeek-V3's routed experts, with fixed shapes (no host sync, no boolean-mask indexing).

A rank of the expert-parallel group `moe_ep_rank` holds experts [ep_rank · E_l, (ep_rank + 1) · E_l),
E_l = n_routed_experts / moe_ep_size, and of each the intermediate columns of its `moe_tp_rank` (TensorRT-LLM's
`moe_ep_size` × `moe_tp_size` = `tp_size`). Every rank routes every token (the router is replicated: the same
choice everywhere), computes the assignments to its own experts — the others get weight 0 — and the layer's
output is the all-reduce of the ranks' partial sums, together with the shared experts' row-parallel partial sum.

This is the all-reduce formulation (each rank sees every token): exact, and the same communication as TP for a
decode batch. DeepSeek-V3's deployment exchanges only the routed tokens (all-to-all dispatch/combine, DeepEP);
with few tokens per step (decode) the two move comparable bytes — docs/ARCHITECTURE.md gives the volumes.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from nextn.distributed.comm import Communicator
from nextn.distributed.mapping import MappingError
from nextn.models.deepseek_v3.moe import DeepseekMoE, RoutedExperts


class LocalExperts(RoutedExperts):
    """This rank's routed experts: `gate_up_proj` [E_l, 2·I_l, hidden], `down_proj` [E_l, hidden, I_l].

    Args:
        num_local: E_l experts held, the first being global expert `first`.
        width: I_l intermediate columns of each.
    """

    def __init__(self, full: RoutedExperts, num_local: int, first: int, width: int, moe_tp: tuple[int, int]) -> None:
        nn.Module.__init__(self)
        h = full.gate_up_proj.shape[-1]
        self.num_experts, self.width, self.first, self.full_width = num_local, width, first, full.width
        self.moe_tp_size, self.moe_tp_rank = moe_tp
        with torch.device("meta"):
            self.gate_up_proj = nn.Parameter(torch.empty(num_local, 2 * width, h))
            self.down_proj = nn.Parameter(torch.empty(num_local, h, width))

    def shard(self, gate_up: torch.Tensor, down: torch.Tensor, prefix: str) -> dict[str, torch.Tensor]:
        """This rank's slices of the stacked engine tensors gate_up [E, 2I, H] (gate rows, then up) and down
        [E, H, I], under `prefix` + `gate_up_proj` / `down_proj`."""
        e = slice(self.first, self.first + self.num_experts)
        cols = slice(self.moe_tp_rank * self.width, (self.moe_tp_rank + 1) * self.width)
        gate, up = gate_up[e].split(self.full_width, dim=1)
        return {prefix + "gate_up_proj": torch.cat([gate[:, cols], up[:, cols]], dim=1).contiguous(),
                prefix + "down_proj": down[e][:, :, cols].contiguous()}

    def forward(self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        """This rank's part of Σ_k weights[:, k] · Expert_{ids[:, k]}(x). x: [N, hidden]; weights, ids: [N, top_k]
        (global expert ids) → [N, hidden] partial sum."""
        local = ids - self.first
        mine = (local >= 0) & (local < self.num_experts)  # [N, top_k]
        local = local.clamp(0, self.num_experts - 1)
        n, top_k = ids.shape
        out = self._gathered(x, local) if n * top_k <= self.num_experts else self._local_buffers(x, local, mine)
        return (out * (weights * mine).to(out.dtype)[..., None]).sum(1)

    def _local_buffers(self, x: torch.Tensor, local: torch.Tensor, mine: torch.Tensor) -> torch.Tensor:
        """`RoutedExperts._capacity_buffers` over the local experts: assignments to other ranks' experts go to
        trash rows past the [E_l · N] buffer (computed by no expert, read back as zeros). → [N, top_k, hidden]."""
        n, top_k = local.shape
        e, a = self.num_experts, n * top_k
        flat, keep = local.reshape(-1), mine.reshape(-1)
        one_hot = F.one_hot(flat, e) * keep[:, None]  # [A, E_l], other ranks' assignments counted nowhere
        rank = (one_hot.cumsum(0) - 1).gather(1, flat[:, None]).squeeze(1)
        dest = torch.where(keep, flat * n + rank, e * n + torch.arange(a, device=x.device))  # [A]
        tokens = torch.arange(n, device=x.device).repeat_interleave(top_k)
        buf = x.new_zeros(e * n + a, x.shape[-1]).index_copy_(0, dest, x[tokens])
        gate_up = torch.bmm(buf[: e * n].view(e, n, -1), self.gate_up_proj.transpose(1, 2))  # [E_l, N, 2 I_l]
        gate, up = gate_up.split(self.width, dim=-1)
        out = torch.bmm(F.silu(gate) * up, self.down_proj.transpose(1, 2)).reshape(e * n, -1)
        return torch.cat([out, out.new_zeros(a, out.shape[-1])])[dest].view(n, top_k, -1)


class ParallelMoE(nn.Module):
    """`DeepseekMoE` split over the ranks: replicated router (`gate`), `LocalExperts`, the shared experts' column
    split (their `down_proj` unreduced), and one all-reduce of the summed partial outputs."""

    def __init__(self, moe: DeepseekMoE, comm: Communicator) -> None:
        super().__init__()
        m = comm.mapping
        full = moe.experts
        if full.num_experts % m.moe_ep_size:
            raise MappingError(f"n_routed_experts = {full.num_experts} is not divisible by moe_expert_parallel_size "
                               f"= {m.moe_ep_size}: use a size that divides it")
        if full.width % m.moe_tp_size:
            raise MappingError(f"moe_intermediate_size = {full.width} is not divisible by moe_tp_size = "
                               f"tensor_parallel_size / moe_expert_parallel_size = {m.moe_tp_size}")
        e_local = full.num_experts // m.moe_ep_size
        self.gate = moe.gate
        self.experts = LocalExperts(full, e_local, m.moe_ep_rank * e_local, full.width // m.moe_tp_size,
                                    (m.moe_tp_size, m.moe_tp_rank))
        self.shared_experts = moe.shared_experts
        self.comm = comm

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x: [..., hidden] → [..., hidden], the same on every rank: `DeepseekMoE`'s routing over this rank's
        experts and shared-expert columns (the same attribute names), then the all-reduce of the partial sums."""
        return self.comm.all_reduce(DeepseekMoE.forward(self, x))
