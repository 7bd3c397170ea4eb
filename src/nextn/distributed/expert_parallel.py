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
from nextn.models.moe import SparseMoE


class LocalExperts(nn.Module):
    """This rank's routed experts, stacked: `gate_up_proj` [E_l, 2·I_l, hidden] (gate rows, then up rows),
    `down_proj` [E_l, hidden, I_l] (fixed-shape dispatch: one tensor indexed on the device).

    Args:
        hidden: the model's hidden size.
        num_local: E_l experts held, the first being global expert `first`.
        width: I_l intermediate columns of each, of the full `full_width`; moe_tp: (moe_tp_size, moe_tp_rank).
    """

    def __init__(self, hidden: int, num_local: int, first: int, width: int, full_width: int,
                 moe_tp: tuple[int, int]) -> None:
        super().__init__()
        self.num_experts, self.width, self.first, self.full_width = num_local, width, first, full_width
        self.moe_tp_size, self.moe_tp_rank = moe_tp
        with torch.device("meta"):
            self.gate_up_proj = nn.Parameter(torch.empty(num_local, 2 * width, hidden))
            self.down_proj = nn.Parameter(torch.empty(num_local, hidden, width))

    def shard(self, src: dict[str, torch.Tensor], prefix: str, num_experts: int) -> dict[str, torch.Tensor]:
        """Pop every expert's engine tensors (`prefix` + `{e}.gate_proj.weight` [I, H], `up_proj`, `down_proj`
        [H, I], e < num_experts) from `src` and return this rank's stacked slices under `prefix` + `gate_up_proj` /
        `down_proj`."""
        parts = {(e, p): src.pop(f"{prefix}{e}.{p}.weight") for e in range(num_experts)
                 for p in ("gate_proj", "up_proj", "down_proj")}
        mine = range(self.first, self.first + self.num_experts)
        cols = slice(self.moe_tp_rank * self.width, (self.moe_tp_rank + 1) * self.width)
        gate_up = [torch.cat([parts[e, "gate_proj"][cols], parts[e, "up_proj"][cols]]) for e in mine]
        return {prefix + "gate_up_proj": torch.stack(gate_up),
                prefix + "down_proj": torch.stack([parts[e, "down_proj"][:, cols] for e in mine])}

    def forward(self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        """This rank's part of Σ_k weights[:, k] · Expert_{ids[:, k]}(x). x: [N, hidden]; weights, ids: [N, top_k]
        (global expert ids) → [N, hidden] partial sum."""
        local = ids - self.first
        mine = (local >= 0) & (local < self.num_experts)  # [N, top_k]
        local = local.clamp(0, self.num_experts - 1)
        n, top_k = ids.shape
        out = self._gathered(x, local) if n * top_k <= self.num_experts else self._local_buffers(x, local, mine)
        return (out * (weights * mine).to(out.dtype)[..., None]).sum(1)

    def _gathered(self, x: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        """Per-assignment weight gather (few assignments: decode): [N, top_k, hidden]."""
        gate_up = torch.einsum("nh,nkih->nki", x, self.gate_up_proj[ids])
        gate, up = gate_up.split(self.width, dim=-1)
        return torch.einsum("nki,nkhi->nkh", F.silu(gate) * up, self.down_proj[ids])

    def _local_buffers(self, x: torch.Tensor, local: torch.Tensor, mine: torch.Tensor) -> torch.Tensor:
        """Per-expert buffers of fixed capacity N (a token meets an expert at most once; many assignments:
        prefill), one bmm per projection; assignments to other ranks' experts go to trash rows past the [E_l · N]
        buffer (computed by no expert, read back as zeros). → [N, top_k, hidden]."""
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
    """A `SparseMoE` (DeepSeek-V3's: no gated shared expert) split over the ranks: replicated router (`gate`),
    `LocalExperts`, the shared experts' column split (their `down_proj` unreduced), and one all-reduce of the summed
    partial outputs.

    Raises:
        MappingError: E or the expert width not divisible by the parallel sizes, or a gated shared expert
            (Qwen2-MoE's).
    """

    def __init__(self, moe: SparseMoE, comm: Communicator) -> None:
        super().__init__()
        m = comm.mapping
        num, hidden = len(moe.experts), moe.experts[0].down_proj.out_features
        width = moe.experts[0].gate_proj.out_features
        if moe.shared_expert is not None:
            raise MappingError("a gated shared expert (Qwen2-MoE's) is not split across ranks yet: use "
                               "tensor_parallel_size 1")
        if num % m.moe_ep_size:
            raise MappingError(f"n_routed_experts = {num} is not divisible by moe_expert_parallel_size "
                               f"= {m.moe_ep_size}: use a size that divides it")
        if width % m.moe_tp_size:
            raise MappingError(f"moe_intermediate_size = {width} is not divisible by moe_tp_size = "
                               f"tensor_parallel_size / moe_expert_parallel_size = {m.moe_tp_size}")
        e_local = num // m.moe_ep_size
        self.gate = moe.gate
        self.experts = LocalExperts(hidden, e_local, m.moe_ep_rank * e_local, width // m.moe_tp_size, width,
                                    (m.moe_tp_size, m.moe_tp_rank))
        self.num_experts = num
        self.shared_experts = moe.shared_experts
        self.comm = comm

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x: [..., hidden] → [..., hidden], the same on every rank: the routing over this rank's experts and
        shared-expert columns, then the all-reduce of the partial sums."""
        flat = x.reshape(-1, x.shape[-1])
        weights, ids = self.gate(flat)
        out = self.experts(flat, weights, ids)
        if self.shared_experts is not None:
            out = out + self.shared_experts(flat)
        return self.comm.all_reduce(out.view(x.shape))
