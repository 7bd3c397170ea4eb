"""MoE experts stored in the int4 CPU kernel's own layout, so that a loaded engine reads them in place.

An int4 linear is stored portably (`weight_only.quantize`: `weight` [N, K/2] nibbles in channel order, per-group
`weight_scale` / `weight_zero` [N, G]) and repacked at load into the layout nextn's kernel reads (`woq_linear`:
blocks of 16 output channels). For an MoE's experts — most of its bytes — the repacked copy is anonymous memory:
not shared between processes serving the same engine, and a second copy beside the file's pages while loading. So
the builder stores the routed and shared experts' int4 linears, where the kernel takes their shape, already in the
kernel's layout, under the buffers' names (`<linear>.qweight`, `.scales`, `.zeros`), and orders them in the file the
way the MoE op stacks them (`file_order`); the loader maps the file and makes the op's stacked operands views of it
(`int4_operands.stack_rows`). Where the kernel does not run (another device, no compiler), `to_portable` gives
the portable tensors back (scales and zero points rounded to bf16, as the kernel reads them).

Kernel layout, per linear of N outputs, K inputs, G groups (S super-blocks):
- `qweight` [N, K/2] uint8: `woq_linear.pack_int4` (W4A16) or `pack_int4_vnni` (W4A8);
- one-level scales: `scales` and `zeros` [N/16, G, 16] bf16 (`woq_linear.block_scales` of scale and zero + 8·scale);
- two-level (k-quants): `scales` [N/16, G, 2, 16] uint8 (scale, zero pairs), `zeros` [N/16, S, 2, 16] fp16 (d, dmin).
"""

from __future__ import annotations

import re

import torch

from nextn.plugins import woq_linear
from nextn.quantization.quant_config import INT4_ALGOS, QuantConfig

#: the linears stored in the kernel's layout: an MoE layer's routed experts and its shared expert
_EXPERT = re.compile(r"^(?P<moe>.+\.mlp\.)(?:experts\.(?P<e>\d+)|(?P<shared>shared_experts?))\."
                     r"(?P<proj>gate_proj|up_proj|down_proj)$")
FIELDS = ("qweight", "scales", "zeros")


def applies(prefix: str, shape: tuple[int, int], cfg: QuantConfig) -> bool:
    """Whether linear `prefix` (no `.weight`) of weight shape [N, K] is stored in the kernel's layout: an expert's
    projection, int4, a shape the kernel takes."""
    return (cfg.quant_algo in INT4_ALGOS and _EXPERT.match(prefix) is not None
            and woq_linear.takes(cfg.quant_algo, shape[0], shape[1]))


def specs(prefix: str, shape: tuple[int, int], cfg: QuantConfig, groups: int,
          super_blocks: int | None) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
    """The stored tensors' (shape, dtype) of a linear `applies` takes: [N, K] weight, `groups` scale groups,
    `super_blocks` super-blocks (None: one-level scales)."""
    n, k = shape
    if super_blocks is None:
        scales = ((n // 16, groups, 16), torch.bfloat16)
        zeros = ((n // 16, groups, 16), torch.bfloat16)
    else:
        scales = ((n // 16, groups, 2, 16), torch.uint8)
        zeros = ((n // 16, super_blocks, 2, 16), torch.float16)
    return {f"{prefix}.qweight": ((n, k // 2), torch.uint8), f"{prefix}.scales": scales, f"{prefix}.zeros": zeros}


def to_kernel(q: dict[str, torch.Tensor], cfg: QuantConfig) -> dict[str, torch.Tensor]:
    """`quantize`'s tensors of one linear → the kernel's (`FIELDS`), as `WeightOnlyLinear` repacks them at load."""
    pack = woq_linear.pack_int4_vnni if cfg.quant_algo == "W4A8" else woq_linear.pack_int4
    out = {"qweight": pack(q["weight"])}
    if "weight_scale_2" in q:
        pairs = torch.stack([q["weight_scale"], q["weight_zero"].view(torch.uint8)], dim=-1)
        out["scales"] = woq_linear.block_scales(pairs)
        out["zeros"] = woq_linear.block_scales(q["weight_scale_2"].half())
    else:
        scale, zero = q["weight_scale"].float(), q["weight_zero"].float()
        out["scales"] = woq_linear.block_scales(scale.to(torch.bfloat16))
        out["zeros"] = woq_linear.block_scales((zero + 8 * scale).to(torch.bfloat16))
    return out


def to_portable(t: dict[str, torch.Tensor], cfg: QuantConfig) -> dict[str, torch.Tensor]:
    """The kernel's tensors of one linear → `quantize`'s (the inverse of `to_kernel`, up to the bf16 rounding of
    one-level scales and zero points), for a linear that does not run on the kernel."""
    w = t["qweight"]
    q = (woq_linear.unpack_int4_vnni_layout(w) if cfg.quant_algo == "W4A8"
         else woq_linear.unpack_int4_kernel_layout(w))  # [N, K] values
    n = w.shape[0]
    out = {"weight": (q[:, 0::2] | (q[:, 1::2] << 4)).contiguous()}
    scales, zeros = t["scales"], t["zeros"]
    if scales.dim() == 4:  # two-level: [N/16, G, 2, 16] → [N, G, 2]
        pairs = scales.permute(0, 3, 1, 2).reshape(n, scales.shape[1], 2)
        out["weight_scale"] = pairs[..., 0].contiguous()
        out["weight_zero"] = pairs[..., 1].contiguous().view(torch.int8)
        out["weight_scale_2"] = zeros.permute(0, 3, 1, 2).reshape(n, zeros.shape[1], 2).contiguous()
    else:
        scale = scales.transpose(1, 2).reshape(n, -1).float()
        out["weight_scale"] = scale
        out["weight_zero"] = zeros.transpose(1, 2).reshape(n, -1).float() - 8 * scale
    return out


def file_order(names: list[str]) -> list[str]:
    """`names` (an engine's tensors in the builder's order) with the kernel-layout experts' tensors first, in the
    order the MoE op stacks them (`moe_experts.fuse_experts`): per MoE layer and field, every expert's gate then up
    projection, then every expert's down projection, then the shared expert's gate, up and down. A stacked operand
    is then one contiguous run of the file, which the loader maps as it is."""
    keyed, rest = [], []
    for name in names:
        prefix, _, field = name.rpartition(".")
        m = _EXPERT.match(prefix)
        if m is None or field not in FIELDS:
            rest.append(name)
            continue
        proj = ("gate_proj", "up_proj", "down_proj").index(m["proj"])
        shared = m["shared"] is not None
        # (layer, field, gate/up before down, routed before shared, expert, gate before up)
        keyed.append(((m["moe"], FIELDS.index(field), 2 * shared + (proj == 2), int(m["e"] or 0), proj), name))
    layer_order = {moe: i for i, moe in enumerate(dict.fromkeys(k[0] for k, _ in keyed))}
    keyed.sort(key=lambda kn: (layer_order[kn[0][0]], *kn[0][1:]))
    return [n for _, n in keyed] + rest
