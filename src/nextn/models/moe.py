"""The sparse mixture-of-experts MLP (Qwen3-MoE, Qwen2-MoE, Mixtral, OLMoE, GLM-4.5; DeepSeek-V3's router): a router
picks each token's top-k of E SwiGLU experts, and only those run on it.

Sources: Shazeer et al. 2017 (sparsely-gated MoE), Jiang et al. 2024 ("Mixtral of Experts", §2.1: softmax over the
top-k router logits); HF `transformers` 5.23 `modeling_qwen3_moe.py` (`Qwen3MoeTopKRouter`: softmax over all E, top-k,
renormalised when `norm_topk_prob`; `Qwen3MoeExperts`: experts visited in ascending id, each adding its weighted
output with `index_add_`), `modeling_qwen2_moe.py` (a shared expert scaled by sigmoid(`shared_expert_gate`));
DeepSeek-V3 report §2.1.2 and `modeling_glm4_moe.py` (`Glm4MoeTopkRouter`: sigmoid scores, a correction bias used to
choose only, the top `topk_group` of `n_group` expert groups; shared experts added unscaled).
Parameter names are the released checkpoints' (`mlp.gate.weight`, `mlp.experts.{e}.gate_proj.weight`, ...).

**Routed experts only, batch-invariant.** The (token, expert) assignments are grouped by expert; each expert runs its
three projections on its own tokens' rows only (a `GatedMLP` whose linears are nextn's per-row kernels once loaded:
W4A16 / W4A8 / dense — the weights read in place, never gathered), so a step costs what its active experts cost,
not E / top-k times that. A token's output sums its experts' weighted outputs in ascending expert id (as
`transformers` does), so each row is the same sequence of operations whatever else shares the step. The router's
projection runs on nextn's dense kernel (`use_dense_kernel`, called at load) and its softmax by `row_exact`.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from nextn.models.layers import GatedMLP, row_exact


class Router(nn.Module):
    """Softmax top-k routing; parameter `weight` [num_experts, hidden] (kept in the engine dtype, never quantized:
    it is not an `nn.Linear`).

    Args:
        hidden_size, num_experts, top_k: sizes (top_k ≤ num_experts).
        norm_topk_prob: renormalise the k chosen probabilities to sum to 1 (Qwen3-MoE as configured, Mixtral always;
            gpt-oss's softmax over the top-k logits is this).
        bias: the logits carry a bias `bias` [num_experts] (gpt-oss's `mlp.router.bias`).
    """

    kind = "softmax"  # what a fused CPU op reads to know the routing (plugins/moe_experts.py)

    def __init__(self, hidden_size: int, num_experts: int, top_k: int, norm_topk_prob: bool,
                 bias: bool = False) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(num_experts, hidden_size))
        self.bias = nn.Parameter(torch.zeros(num_experts)) if bias else None
        self.top_k, self.norm_topk_prob = top_k, norm_topk_prob
        self.dense: nn.Module | None = None  # the logits' projection on nextn's dense kernel (use_dense_kernel)

    def use_dense_kernel(self) -> None:
        """Project on nextn's batch-invariant dense CPU kernel from now on (a weight off the CPU: no change)."""
        from nextn.plugins.dense_linear import DTYPES, DenseLinear

        if self.weight.device.type == "cpu" and self.weight.dtype in DTYPES:
            bias = self.bias.detach() if self.bias is not None else None
            self.dense = DenseLinear.from_weight(self.weight.detach(), bias)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x: [N, hidden] → (weights [N, top_k] float32, expert ids [N, top_k] int64), by descending probability."""
        logits = self.dense(x) if self.dense is not None else F.linear(x, self.weight, self.bias)  # [N, E], x's dtype
        probs = row_exact(lambda t: torch.softmax(t, dim=-1), logits.float())
        weights, ids = probs.topk(self.top_k, dim=-1)
        if self.norm_topk_prob:
            weights = weights / weights.sum(-1, keepdim=True)
        return weights, ids


class NoAuxRouter(nn.Module):
    """Sigmoid group-limited top-k routing (DeepSeek-V3's `noaux_tc`, GLM-4.5's); parameters `weight` [E, hidden] and
    `e_score_correction_bias` [E] (float32 in every engine: it only ranks experts).

    Args:
        hidden_size, num_experts, top_k: sizes.
        n_group, topk_group: experts fall in `n_group` equal groups ranked by their two best biased scores; a token
            chooses among the experts of its best `topk_group` groups only.
        norm_topk_prob: renormalise the k chosen scores to sum to 1; routed_scaling_factor: then multiply them.
    Raises:
        ValueError: n_group not dividing num_experts, topk_group above n_group, or top_k above the experts chosen from.
    """

    kind = "sigmoid_grouped"

    def __init__(self, hidden_size: int, num_experts: int, top_k: int, n_group: int = 1, topk_group: int = 1,
                 norm_topk_prob: bool = True, routed_scaling_factor: float = 1.0) -> None:
        super().__init__()
        if num_experts % n_group or not 1 <= topk_group <= n_group or top_k > topk_group * (num_experts // n_group):
            raise ValueError(f"routing {num_experts} experts in {n_group} groups, the best {topk_group} of them, "
                             f"cannot choose {top_k}")
        self.weight = nn.Parameter(torch.zeros(num_experts, hidden_size))
        self.e_score_correction_bias = nn.Parameter(torch.zeros(num_experts, dtype=torch.float32), requires_grad=False)
        self.top_k, self.n_group, self.topk_group = top_k, n_group, topk_group
        self.norm_topk_prob, self.routed_scaling_factor = norm_topk_prob, routed_scaling_factor
        self.dense: nn.Module | None = None  # the scores' fp32 projection on nextn's dense kernel (use_dense_kernel)

    def use_dense_kernel(self) -> None:
        """Score on nextn's batch-invariant dense CPU kernel (fp32) from now on (a weight off the CPU: no change)."""
        from nextn.plugins.dense_linear import DenseLinear

        if self.weight.device.type == "cpu":
            self.dense = DenseLinear.from_weight(self.weight.detach().float())

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x: [N, hidden] → (weights [N, top_k] float32, expert ids [N, top_k] int64)."""
        e, g = self.weight.shape[0], self.n_group
        if self.dense is not None:  # batch-invariant: see layers.row_exact
            scores = row_exact(torch.sigmoid, self.dense(x.float()))  # [N, E]
        else:
            scores = F.linear(x.float(), self.weight.float()).sigmoid()
        choice = scores + self.e_score_correction_bias
        if g > 1:
            group_scores = choice.view(-1, g, e // g).topk(2, dim=-1).values.sum(-1)  # [N, n_group]
            top_groups = group_scores.topk(self.topk_group, dim=-1, sorted=False).indices
            keep = torch.zeros_like(group_scores).scatter_(1, top_groups, 1.0).repeat_interleave(e // g, dim=1)
            choice = choice.masked_fill(keep == 0, float("-inf"))
        ids = choice.topk(self.top_k, dim=-1, sorted=False).indices  # [N, top_k]
        weights = scores.gather(1, ids)
        if self.norm_topk_prob:
            weights = weights / (weights.sum(-1, keepdim=True) + 1e-20)
        return weights * self.routed_scaling_factor, ids


class ClampedSwiGLU(nn.Module):
    """gpt-oss's expert: down(g · σ(alpha · g) · (u + 1)) with g = min(gate(x), limit), u = clamp(up(x), ±limit),
    every projection biased (HF `GptOssExperts._apply_gate`; its fused `gate_up_proj` interleaves gate and up
    columns, split on reading: `models/llama/stored_layout.py`)."""

    act_name = "clamped_swiglu"  # not SiLU: the fused experts op (plugins/moe_experts.py) leaves it to the modules

    def __init__(self, hidden_size: int, width: int, alpha: float, limit: float) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(hidden_size, width, bias=True)
        self.up_proj = nn.Linear(hidden_size, width, bias=True)
        self.down_proj = nn.Linear(width, hidden_size, bias=True)
        self.alpha, self.limit = alpha, limit

    def _glu(self, gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
        gate = gate.clamp(max=self.limit)
        return gate * torch.sigmoid(gate * self.alpha) * (up.clamp(-self.limit, self.limit) + 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x: [N, hidden] → [N, hidden]."""
        gate, up = self.gate_proj(x), self.up_proj(x)
        # on the CPU the sigmoid's ulp must not depend on the row count (as GatedMLP's activation: row_exact)
        glu = row_exact(lambda g: self._glu(g, up), gate) if gate.device.type == "cpu" else self._glu(gate, up)
        return self.down_proj(glu)


def routed_experts(x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor,
                   expert: Callable[[int], Callable[[torch.Tensor], torch.Tensor]], num_experts: int) -> torch.Tensor:
    """Σ_k weights[n, k] · expert(ids[n, k])(x[n]) for every token n, each expert run on its own tokens only.

    Args:
        x: [N, hidden]; weights: [N, top_k] float32; ids: [N, top_k] int64 (a token meets an expert at most once).
        expert: expert e's function [*, hidden] → [*, hidden] (`experts.__getitem__` of a ModuleList).
        num_experts: E.
    Returns:
        [N, hidden] in x's dtype: each row Σ bf16(y_e · w_e) (in x's dtype) over its experts in ascending id.
    Under `torch.compile` and off the CPU (fixed shapes, no host synchronisation: a compiled or CUDA-graphed step,
    the overlap scheduler on a GPU) every expert runs over every token instead and the same sums are taken
    (`sum_ascending`): the same numbers at E / top_k times the work.
    """
    if torch.compiler.is_compiling() or x.device.type != "cpu":
        every = torch.stack([expert(e)(x) for e in range(num_experts)], 1)  # [N, E, hidden]
        return sum_ascending(every.gather(1, ids[..., None].expand(-1, -1, x.shape[-1])), weights, ids)
    n, top_k = ids.shape
    flat = ids.reshape(-1)
    order = torch.argsort(flat, stable=True)  # assignments grouped by expert, tokens ascending within one
    # the counts are host memory already (a CPU step): reading them waits for no device and for no earlier step
    counts = torch.bincount(flat).numpy().tolist()
    tokens = order // top_k
    scale = weights.reshape(-1)[order].to(x.dtype)[:, None]
    out = torch.zeros_like(x)
    start = 0
    for e, count in enumerate(counts):
        if count:
            rows = tokens[start:start + count]
            out.index_add_(0, rows, expert(e)(x[rows]) * scale[start:start + count])
            start += count
    return out


def sum_ascending(y: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """Σ_k bf16(y[n, k] · w[n, k]) in ascending expert id, as `routed_experts` adds them. y: [N, top_k, hidden];
    weights: [N, top_k] float32; ids: [N, top_k] → [N, hidden] in y's dtype."""
    order = ids.argsort(dim=1, stable=True)
    y = y.gather(1, order[..., None].expand_as(y))
    w = weights.gather(1, order).to(y.dtype)
    out = torch.zeros_like(y[:, 0]) + y[:, 0] * w[:, 0:1]
    for j in range(1, ids.shape[1]):
        out = out + y[:, j] * w[:, j:j + 1]
    return out


class SparseMoE(nn.Module):
    """The MoE MLP: `gate` (a `Router`, or the `NoAuxRouter` given), `experts` (E `GatedMLP`s of width
    `moe_intermediate_size`, or what `expert()` makes: gpt-oss's `ClampedSwiGLU`), for Qwen2-MoE `shared_expert` (a
    `GatedMLP`) scaled per token by sigmoid(`shared_expert_gate` · x), for GLM-4.5 `shared_experts` (a `GatedMLP` of
    `shared_experts_width`) added.

    `fused_experts` (set at load by `plugins.decoder_layer.install_fused_layers` where it applies: W4A16 / W4A8 on the
    CPU): the routed experts as one op of nextn's CPU kernels (`plugins.moe_experts`) instead of module by module.
    """

    fused_experts: Any = None

    def __init__(self, hidden_size: int, num_experts: int, top_k: int, width: int, norm_topk_prob: bool,
                 act: str = "silu", shared_width: int | None = None, gate: nn.Module | None = None,
                 shared_experts_width: int | None = None, expert: Callable[[], nn.Module] | None = None) -> None:
        super().__init__()
        self.gate = gate if gate is not None else Router(hidden_size, num_experts, top_k, norm_topk_prob)
        make = expert if expert is not None else lambda: GatedMLP(hidden_size, width, act)
        self.experts = nn.ModuleList(make() for _ in range(num_experts))
        self.shared_expert = GatedMLP(hidden_size, shared_width, act) if shared_width else None
        # the shared expert's gate: a one-output projection, never quantized and on the dense kernel as the router's
        # (only its projection is used: sigmoid, not top-k)
        self.shared_expert_gate = Router(hidden_size, 1, 1, False) if shared_width else None
        self.shared_experts = GatedMLP(hidden_size, shared_experts_width, act) if shared_experts_width else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x: [..., hidden] → [..., hidden]."""
        flat = x.reshape(-1, x.shape[-1])
        weights, ids = self.gate(flat)
        if self.fused_experts is not None and flat.dtype == torch.bfloat16:
            from nextn.plugins.moe_experts import experts_forward

            out = experts_forward(self.fused_experts, flat, weights, ids)
        else:
            out = routed_experts(flat, weights, ids, self.experts.__getitem__, len(self.experts))
        if self.shared_expert is not None:
            gate = self.shared_expert_gate
            logit = gate.dense(flat) if gate.dense is not None else F.linear(flat, gate.weight)  # [N, 1]
            out = out + row_exact(torch.sigmoid, logit) * self.shared_expert(flat)
        if self.shared_experts is not None:
            out = out + self.shared_experts(flat)
        return out.view(x.shape)
