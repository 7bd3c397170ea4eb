"""Gated DeltaNet: the linear-attention token mixer of Qwen3.5 and Qwen3-Next, over per-request recurrent state.

Per token t and value head h (key head h // (value_heads / key_heads)), with the recurrent state S [key_dim,
value_dim] (Yang, Kautz & Hatamizadeh 2025, "Gated Delta Networks", eq. 10; HF `modeling_qwen3_5.py`, the oracle:
`torch_recurrent_gated_delta_rule`):

    q, k, v = split(silu(causal_depthwise_conv(in_proj_qkv(x))))      conv over the last `kernel` tokens
    q, k    = l2norm(q) / sqrt(key_dim), l2norm(k)
    beta    = sigmoid(in_proj_b(x)),  g = −exp(A_log) · softplus(in_proj_a(x) + dt_bias)
    S       = exp(g) · S;   S = S + k ⊗ (beta · (v − kᵀS));   o = qᵀS
    out     = out_proj(rmsnorm(o) · w · silu(in_proj_z(x)))          per value head

Everything after the projections runs in float32, token by token (a verify step's K + 1 tokens, or a prefill chunk;
HF's prefill uses the chunked form of the same recurrence, equal up to float32 rounding). Each row is computed alone
with fixed-order reductions, and the transcendental functions through `row_exact`, so a row's numbers do not depend
on the batch. The states live in `RecurrentState` (models/recurrent_state.py), which keeps a verify step's tokens'
updates pending so that only accepted tokens are committed.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from nextn.models.layers import row_exact
from nextn.plugins import cpu_kernels, gated_delta
from nextn.models.recurrent_state import RecurrentRows, RecurrentState


class GatedRMSNorm(nn.Module):
    """RMSNorm of each value head's output times w, then × silu(gate), in float32 (HF `Qwen3_5RMSNormGated`;
    `weight` as stored, centred on 1)."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
        """x, gate: [..., dim] float32 → [..., dim] float32."""
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight.float() * x * row_exact(F.silu, gate)


class GatedDeltaNet(nn.Module):
    """One linear-attention layer (HF parameter names: `in_proj_qkv`, `in_proj_z`, `in_proj_b`, `in_proj_a`,
    `conv1d`, `dt_bias`, `A_log`, `norm`, `out_proj`).

    Args:
        cfg: the model config (`linear_*` sizes, `hidden_size`, `rms_norm_eps`).
        state_index: this layer's index among the model's linear-attention layers (its rows of `RecurrentState`).

    `recurrence_kernel` (set at load by `plugins.gated_delta.install_gated_delta` where it applies): the recurrence
    as nextn's CPU op, one call per layer, in place of its per-token PyTorch reference (`gated_delta.reference`);
    `mix_operands` (set there too): the float32 conv weight [C, kernel], A_log, dt_bias and norm weight with which
    the whole token mixer after the input projections runs as one op (`gated_deltanet_mix`).
    """

    recurrence_kernel = False
    mix_operands: tuple[torch.Tensor, ...] | None = None

    def __init__(self, cfg, state_index: int) -> None:
        super().__init__()
        h = cfg.hidden_size
        self.key_heads, self.value_heads = cfg.linear_num_key_heads, cfg.linear_num_value_heads
        self.key_dim, self.value_dim = cfg.linear_key_head_dim, cfg.linear_value_head_dim
        self.kernel = cfg.linear_conv_kernel_dim
        keys, values = self.key_heads * self.key_dim, self.value_heads * self.value_dim
        self.conv_dim = 2 * keys + values
        self.in_proj_qkv = nn.Linear(h, self.conv_dim, bias=False)
        self.in_proj_z = nn.Linear(h, values, bias=False)
        self.in_proj_b = nn.Linear(h, self.value_heads, bias=False)
        self.in_proj_a = nn.Linear(h, self.value_heads, bias=False)
        self.in_proj_b.keep_dense = self.in_proj_a.keep_dense = True  # a few values per head: never quantized
        self.conv1d = nn.Conv1d(self.conv_dim, self.conv_dim, self.kernel, groups=self.conv_dim, bias=False,
                                padding=self.kernel - 1)  # only its weight [conv_dim, 1, kernel] is used
        self.dt_bias = nn.Parameter(torch.ones(self.value_heads))
        self.A_log = nn.Parameter(torch.zeros(self.value_heads))
        self.norm = GatedRMSNorm(self.value_dim, cfg.rms_norm_eps)
        self.out_proj = nn.Linear(values, h, bias=False)
        self.state_index = state_index

    def forward(self, x: torch.Tensor, cos_sin: torch.Tensor, kv_cache: torch.Tensor | None, meta) -> torch.Tensor:
        """x: [B, T, hidden] normalised hidden states → [B, T, hidden]; reads and keeps this layer's state for the
        rows of `meta.recurrent` (`RecurrentState` and `RecurrentRows`). cos_sin and kv_cache are unused (no
        positions, no KV: the signature is the attention layers')."""
        state: RecurrentState
        state, rows = meta.recurrent
        if self.mix_operands is not None:
            mixed = cpu_kernels.ops().gated_deltanet_mix(
                self.in_proj_qkv(x), self.in_proj_z(x), self.in_proj_b(x), self.in_proj_a(x), *self.mix_operands,
                state.conv[self.state_index], state.ssm[self.state_index], state.pending[self.state_index],
                rows.slots, rows.committed, rows.fresh, rows.valid, self.key_heads, self.norm.eps)
            return self.out_proj(mixed)
        b, t, _ = x.shape
        conv0 = state.initial_conv(self.state_index, rows)  # [B, C, kernel-1]
        window = torch.cat([conv0, self.in_proj_qkv(x).float().transpose(1, 2)], dim=2)  # [B, C, kernel-1+T]
        w = self.conv1d.weight.float()[:, 0]  # [C, kernel]
        mixed = w[None, :, 0, None] * window[:, :, :t]
        for j in range(1, self.kernel):
            mixed = mixed + w[None, :, j, None] * window[:, :, j:j + t]
        # [B, T, C] contiguous: every reduction below then runs over a row's own contiguous values, the same
        # way whatever T (a strided one would vectorise across tokens)
        mixed = row_exact(F.silu, mixed).transpose(1, 2).contiguous()
        keys = self.key_heads * self.key_dim
        q, k, v = mixed.split([keys, keys, self.value_heads * self.value_dim], dim=-1)
        rep = self.value_heads // self.key_heads
        q = _l2norm(q.reshape(b, t, self.key_heads, self.key_dim)).repeat_interleave(rep, dim=2)
        k = _l2norm(k.reshape(b, t, self.key_heads, self.key_dim)).repeat_interleave(rep, dim=2)
        q = q * self.key_dim ** -0.5
        v = v.reshape(b, t, self.value_heads, self.value_dim)
        beta = row_exact(torch.sigmoid, self.in_proj_b(x).float())  # [B, T, Hv]
        decay = row_exact(torch.exp, -row_exact(torch.exp, self.A_log.float())
                          * row_exact(F.softplus, self.in_proj_a(x).float() + self.dt_bias.float()))
        # the recurrence, keeping the last R valid tokens' updates pending: nextn's op, or its PyTorch reference
        rule = cpu_kernels.ops().gated_delta_rule if self.recurrence_kernel else gated_delta.reference
        o = rule(q, k, v, decay, beta, state.ssm[self.state_index], state.pending[self.state_index], rows.slots,
                 rows.committed, rows.fresh, rows.valid)
        state.store_conv(self.state_index, rows, window)
        return self._output(o, x)

    def _output(self, o: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        """out_proj(gated norm of each value head's output o [B, T, Hv, Dv] float32, by silu(in_proj_z(x)))."""
        b, t = o.shape[:2]
        z = self.in_proj_z(x).float().reshape(b, t, self.value_heads, self.value_dim)
        return self.out_proj(self.norm(o, z).reshape(b, t, -1).to(x.dtype))


def _l2norm(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """x / sqrt(Σ x² + eps) over the last dim (HF's `l2norm`, as the FLA kernels)."""
    return x * torch.rsqrt((x * x).sum(-1, keepdim=True) + eps)


__all__ = ["GatedDeltaNet", "GatedRMSNorm", "RecurrentRows"]
