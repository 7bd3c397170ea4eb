"""nextn's CPU gated delta rule (`gated_delta_cpu.cpp`): a Gated DeltaNet layer's recurrence over its ring of
per-request states, one op per layer in place of ~6 tensor ops per token.

`cpu_kernels.ops().gated_delta_rule(q [B, T, H, Dk], k, v [B, T, H, Dv], decay [B, T, H], beta [B, T, H],
ssm [slots, H, Dk, Dv], pending [slots, R, H, Dk + Dv + 1], slots [B], committed [B], fresh [B], valid [B, T]) → out
[B, T, H, Dv]`, float32: from the slot's state with its first `committed` pending updates applied (zeros where fresh),
S = decay · S, S += k ⊗ beta · (v − kᵀS), out = qᵀS per valid token; the state before the last R valid tokens and
their updates kept as the slot's (models/recurrent_state.py).
Yang, Kautz & Hatamizadeh 2025 ("Gated Delta Networks", eq. 10); the reference is `reference` below, the module's
PyTorch path (HF's `torch_recurrent_gated_delta_rule` in a loop, as `tests/plugins/test_gated_delta.py` checks).

`cpu_kernels.ops().gated_deltanet_layer(x, norms, qkvz, ba, out, gate_up, down, <the mixer's operands>, key_heads,
group_size, eps, mix_eps, int8_activations) → [B, T, H] bf16` runs a whole decoder layer of a W4A16 / W4A8 engine
(`deltanet_layer_cpu.cpp`: norms, the projections — q/k/v with z, b with a, gate with up, each one matmul over
concatenated weights — the mixer, out_proj, the MLP, the residual adds): one call in place of ~25 module calls.

`cpu_kernels.ops().gated_deltanet_mix(qkv, z, b, a, conv_w, a_log, dt_bias, norm_w, conv_ring, ssm, pending, slots,
committed, fresh, valid, key_heads, eps) → [B, T, Hv · Dv]` is the layer's whole token mixer between its input projections and
out_proj (conv over the kept conv state, silu, l2 norms, gates, this rule, the gated RMSNorm, the conv states kept as
the recurrent ones): one call in place of ~70 tensor ops; its reference is `GatedDeltaNet`'s PyTorch path.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from nextn.plugins import cpu_kernels
from nextn.plugins.dense_linear import unpack
from nextn.plugins.int4_operands import concat_rows, int4_linears, one_linear


def reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, decay: torch.Tensor, beta: torch.Tensor,
              ssm: torch.Tensor, pending: torch.Tensor, slots: torch.Tensor, committed: torch.Tensor,
              fresh: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
    """What the kernel computes, in PyTorch f32 (shapes as the op's; `ssm` and `pending` written in place)."""
    dk, dv, r = k.shape[-1], v.shape[-1], pending.shape[1]
    s = ssm[slots]
    for j in range(r):  # the committed updates of the slot's last forward, in order: S = decay · S; S = S + k ⊗ d
        u = pending[slots, j]  # [B, H, Dk + Dv + 1]
        s_new = s * u[..., -1, None, None]
        s_new = s_new + u[..., :dk, None] * u[..., None, dk:dk + dv]
        s = torch.where((committed > j)[:, None, None, None], s_new, s)
    s = torch.where(fresh[:, None, None, None], 0.0, s)
    n_valid = valid.sum(-1)
    first = (n_valid - r).clamp(min=0)  # the forward's last R valid tokens stay pending
    outs = []
    for t in range(q.shape[1]):
        keep = valid[:, t]
        at_first = keep & (first == t)  # the state before them: the slot's state from now on
        ssm[slots[at_first]] = s[at_first]
        s_dec = s * decay[:, t, :, None, None]
        k_t = k[:, t, :, :, None]
        d = (v[:, t] - (s_dec * k_t).sum(-2)) * beta[:, t, :, None]  # [B, H, Dv]
        s = torch.where(keep[:, None, None, None], s_dec + k_t * d[:, :, None, :], s)
        outs.append(torch.where(keep[:, None, None], (s * q[:, t, :, :, None]).sum(-2), 0.0))
        put = keep & (t >= first)
        unit = torch.cat([k[:, t], d, decay[:, t, :, None]], dim=-1)
        pending[slots[put], (t - first)[put]] = unit[put]
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
    for module in model.modules():
        if mix and hasattr(module, "fused_deltanet") and count:
            module.fused_deltanet = fuse_deltanet_layer(module)
    return count


@dataclass(frozen=True)
class DeltaNetLayerWeights:
    """A Gated DeltaNet decoder layer's operands for `gated_deltanet_layer`: its norms (input, post: bf16 weights or
    f32 scales), in_proj_qkv with in_proj_z and gate with up (each concatenated along the output channels, the
    modules' buffers views of it), in_proj_b with in_proj_a as one bf16 [2 · Hv, H] weight, out_proj, down.
    `attention_only` (an MoE MLP: gate_up and down empty): the op stops after the mixer's residual add, x + mixer(
    norm(x)), and the layer runs its MLP half as `moe_experts.block_forward` (or its modules)."""

    norms: list[torch.Tensor]
    qkvz: list[torch.Tensor]
    ba: torch.Tensor
    out: list[torch.Tensor]
    gate_up: list[torch.Tensor]
    down: list[torch.Tensor]
    group_size: int
    int8_activations: bool

    @property
    def attention_only(self) -> bool:
        return not self.gate_up


def fuse_deltanet_layer(layer: nn.Module) -> DeltaNetLayerWeights | None:
    """The op's operands for a `LinearAttentionDecoderLayer` whose mixer runs `gated_deltanet_mix`, or None where
    the op does not apply: a non-SiLU MLP, projections not all W4A16 (or all W4A8) with one group size, b / a not
    bf16, norms of mixed kinds, or sizes the int4 kernel does not take (hidden, value width, intermediate % 64). An MoE
    MLP (Qwen3-Next, Qwen3.5-MoE: `experts`) gives the attention-only operands (`attention_only`)."""
    mixer, mlp = layer.linear_attn, layer.mlp
    moe = hasattr(mlp, "experts")
    if mixer.mix_operands is None or not (moe or hasattr(mlp, "gate_proj")) or (
            not moe and getattr(mlp, "act_name", "silu") != "silu"):
        return None
    mlp_linears = () if moe else (mlp.gate_proj, mlp.up_proj, mlp.down_proj)
    kind = int4_linears(mixer.in_proj_qkv, mixer.in_proj_z, mixer.out_proj, *mlp_linears)
    ba = [_bf16_weight(mixer.in_proj_b), _bf16_weight(mixer.in_proj_a)]
    norms = _norms(layer.input_layernorm, layer.post_attention_layernorm)
    hidden, values = mixer.out_proj.out_features, mixer.out_proj.in_features
    sizes = (hidden, values) if moe else (hidden, values, mlp.gate_proj.out_features)
    if (kind is None or any(w is None for w in ba) or norms is None
            or any(n % 64 or n % kind[0] for n in sizes) or (mixer.conv_dim + values) % 16):
        return None
    mixer_half = (norms, concat_rows([mixer.in_proj_qkv, mixer.in_proj_z]), torch.cat(ba).contiguous(),
                  one_linear(mixer.out_proj))
    if moe:
        return DeltaNetLayerWeights(*mixer_half, [], [], *kind)
    return DeltaNetLayerWeights(*mixer_half, concat_rows([mlp.gate_proj, mlp.up_proj]), one_linear(mlp.down_proj),
                                *kind)


def _bf16_weight(linear: nn.Module) -> torch.Tensor | None:
    """A dense projection's bf16 weight [out, in] (an `nn.Linear`'s, or a `DenseLinear`'s unpacked), else None."""
    w = getattr(linear, "weight", None)
    if isinstance(w, torch.Tensor):
        return w.detach() if w.dtype == torch.bfloat16 else None
    packed = getattr(linear, "packed", None)
    if isinstance(packed, torch.Tensor) and packed.dtype == torch.bfloat16:
        return unpack(packed, linear.out_features, linear.in_features)
    return None


def _norms(*norms: nn.Module) -> list[torch.Tensor] | None:
    """The norms as the op reads them: all f32 scales (`fp32_scale`: Qwen3.5's 1 + w) or all bf16 weights."""
    scales = [n.fp32_scale() for n in norms]
    if all(s is not None for s in scales):
        return [s.contiguous() for s in scales]
    if all(s is None for s in scales) and all(n.weight.dtype == torch.bfloat16 for n in norms):
        return [n.weight.detach().contiguous() for n in norms]
    return None


def layer_forward(layer: nn.Module, x: torch.Tensor, meta) -> torch.Tensor:
    """Run a `LinearAttentionDecoderLayer` (with `fused_deltanet` set) through the op: x [B, T, H] bf16 → the same
    (attention-only operands: x + mixer(norm(x)), the MLP half left to the caller); keeps its states for
    `meta.recurrent`'s rows."""
    f: DeltaNetLayerWeights = layer.fused_deltanet
    mixer = layer.linear_attn
    state, rows = meta.recurrent
    return cpu_kernels.ops().gated_deltanet_layer(
        x, f.norms, f.qkvz, f.ba, f.out, f.gate_up, f.down, *mixer.mix_operands, state.conv[mixer.state_index],
        state.ssm[mixer.state_index], state.pending[mixer.state_index], rows.slots, rows.committed, rows.fresh,
        rows.valid, mixer.key_heads, f.group_size, layer.post_attention_layernorm.eps, mixer.norm.eps,
        f.int8_activations)
