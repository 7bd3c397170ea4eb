"""nextn's CPU gated delta rule (`gated_delta_cpu.cpp`): a Gated DeltaNet layer's recurrence over its ring of
per-request states, one op per layer in place of ~6 tensor ops per token.

`cpu_kernels.ops().gated_delta_rule(q [B, T, H, Dk], k, v [B, T, H, Dv], decay [B, T, H], beta [B, T, H],
ring [slots, R, H, Dk, Dv], slots [B], entry [B], fresh [B], valid [B, T]) → out [B, T, H, Dv]`, all float32: from the
state in ring[slots[b], entry[b]] (zeros where fresh), S = decay · S, S += k ⊗ beta · (v − kᵀS), out = qᵀS per valid
token, the state after each of the last R valid tokens kept in ring[slots[b], t mod R] (models/recurrent_state.py).
Yang, Kautz & Hatamizadeh 2025 ("Gated Delta Networks", eq. 10); the reference is `reference` below, the module's
PyTorch path (HF's `torch_recurrent_gated_delta_rule` in a loop, as `tests/plugins/test_gated_delta.py` checks).

`cpu_kernels.ops().gated_deltanet_mix(qkv, z, b, a, conv_w, a_log, dt_bias, norm_w, conv_ring, ring, slots, entry,
fresh, valid, key_heads, eps) → [B, T, Hv · Dv]` is the layer's whole token mixer between its input projections and
out_proj (conv over the kept conv state, silu, l2 norms, gates, this rule, the gated RMSNorm, the conv states kept as
the recurrent ones): one call in place of ~70 tensor ops; its reference is `GatedDeltaNet`'s PyTorch path.
"""

from __future__ import annotations

import torch
from torch import nn

from nextn.plugins import cpu_kernels


def reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, decay: torch.Tensor, beta: torch.Tensor,
              ring: torch.Tensor, slots: torch.Tensor, entry: torch.Tensor, fresh: torch.Tensor,
              valid: torch.Tensor) -> torch.Tensor:
    """What the kernel computes, in PyTorch f32 (shapes as the op's; `ring` written in place)."""
    s = torch.where(fresh[:, None, None, None], 0.0, ring[slots, entry])
    outs = []
    r = ring.shape[1]
    for t in range(q.shape[1]):
        s_new = s * decay[:, t, :, None, None]
        k_t = k[:, t, :, :, None]
        s_new = s_new + k_t * ((v[:, t] - (s_new * k_t).sum(-2)) * beta[:, t, :, None])[:, :, None, :]
        keep = valid[:, t]
        s = torch.where(keep[:, None, None, None], s_new, s)
        outs.append(torch.where(keep[:, None, None], (s * q[:, t, :, :, None]).sum(-2), 0.0))
        ring[slots, t % r] = torch.where(keep[:, None, None, None], s, ring[slots, t % r])
    return torch.stack(outs, dim=1)


def install_gated_delta(model: nn.Module, mix: bool = True) -> int:
    """Switch every module of `model` that offers the kernel (a `recurrence_kernel` attribute: `GatedDeltaNet`) to
    it where it applies: CPU weights, the kernels built (`cpu_kernels`); with `mix`, the whole token mixer after the
    input projections too (`gated_deltanet_mix`: its float32 operands copied once). Returns how many modules use
    it."""
    count = 0
    for module in model.modules():
        if not hasattr(module, "recurrence_kernel"):
            continue
        tensor = next(module.parameters(), None)
        if tensor is None or tensor.device.type != "cpu" or not cpu_kernels.available():
            continue
        module.recurrence_kernel = True
        if mix:
            module.mix_operands = tuple(t.detach().float().contiguous() for t in (
                module.conv1d.weight[:, 0], module.A_log, module.dt_bias, module.norm.weight))
        count += 1
    return count
