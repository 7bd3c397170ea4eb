"""`PackedLinear`: a bf16 linear layer over oneDNN's pre-packed weight, for the eager CPU step.

PyTorch's `F.linear` on a bf16 CPU tensor re-lays the weight out for every call; oneDNN (mkldnn) reorders it once
into its blocked layout (`torch.ops.mkldnn._reorder_linear_weight`) and multiplies with `_linear_pointwise`, the
kernel inductor itself swaps in when it freezes a graph (`torch/_inductor/fx_passes/mkldnn_fusion.py`). Measured
on this machine's CPU (AMD EPYC, AVX512-BF16, 2 threads; docs/PERFORMANCE.md), one Qwen2.5-1.5B MLP matrix
[8960, 1536]: 1,196 µs → 439 µs for one row, 1,369 µs → 563 µs for the five rows of a K=4 verify step, with
bit-identical results. A weight is packed once at load, when the CPU has bf16 instructions
(`torch.ops.mkldnn._is_mkldnn_bf16_supported()`) and a probe of the op runs; elsewhere layers stay `nn.Linear`.

Under `torch.compile` the call is an opaque custom op (`nextn::packed_linear`): inductor's own lowering of
`_linear_pointwise` accepts only weights it froze itself, so the op is called as an external kernel, eager and
compiled steps alike.
"""

from __future__ import annotations

import functools

import torch
from torch import nn


@torch.library.custom_op("nextn::packed_linear", mutates_args=())
def packed_linear(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """x [..., in] bf16 contiguous, packed: `_reorder_linear_weight` of W [out, in] bf16, bias [out] or None →
    [..., out] bf16."""
    return torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")


@packed_linear.register_fake
def _(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    return x.new_empty((*x.shape[:-1], packed.shape[0]))


def packing_supported(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether bf16 linears on `device` can use oneDNN's packed kernel (a CPU with bf16 instructions, and a PyTorch
    build whose op runs: `_packed_kernel_runs`)."""
    return (device.type == "cpu" and dtype == torch.bfloat16 and torch.backends.mkldnn.is_available()
            and bool(torch.ops.mkldnn._is_mkldnn_bf16_supported()) and _packed_kernel_runs())


@functools.cache
def _packed_kernel_runs() -> bool:
    """One tiny packed linear, checked against its exact value (once a process). False where the op raises: PyTorch
    2.10's aarch64 wheel packs the weight, but its custom-op alias check cannot read the packed (opaque) tensor."""
    try:
        packed = torch.ops.mkldnn._reorder_linear_weight(torch.ones(8, 8, dtype=torch.bfloat16), None)
        y = packed_linear(torch.ones(1, 8, dtype=torch.bfloat16), packed, None)
    except (RuntimeError, NotImplementedError):
        return False
    return bool(torch.equal(y, torch.full((1, 8), 8.0, dtype=torch.bfloat16)))


class PackedLinear(nn.Module):
    """y = x Wᵀ + b with W [out, in] bf16 held in oneDNN's blocked layout (not part of any state dict).

    Args:
        linear: a bf16 `nn.Linear` on the CPU; its weight is reordered (a copy; the original can be freed).
    Raises:
        ValueError: the layer is not bf16 on the CPU.
    """

    def __init__(self, linear: nn.Linear) -> None:
        super().__init__()
        w = linear.weight.detach()
        if w.dtype != torch.bfloat16 or w.device.type != "cpu":
            raise ValueError(f"PackedLinear takes a bf16 CPU weight, got {w.dtype} on {w.device}")
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.register_buffer("packed", torch.ops.mkldnn._reorder_linear_weight(w, None), persistent=False)
        bias = None if linear.bias is None else linear.bias.detach().to(torch.bfloat16)
        self.register_buffer("bias", bias, persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x: [..., in_features] → [..., out_features] in x's dtype (computed in bf16, fp32 accumulation)."""
        return packed_linear(x.to(torch.bfloat16).contiguous(), self.packed, self.bias).to(x.dtype)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, oneDNN-packed bf16"


def install_packed_linears(model: nn.Module, prefix: str = "model.layers.") -> list[str]:
    """Replace every bf16 CPU `nn.Linear` whose name starts with `prefix` (the decoder and MTP layers; the
    lm_head and any tied weight stay as they are) by a `PackedLinear`, except layers whose weight the model reads
    directly (`model.weights_read_directly`: e.g. MLA's `kv_b_proj`, folded into the query).

    Returns:
        The names of the replaced layers (empty where packing is not supported).
    """
    replaced = []
    keep = set(getattr(model, "weights_read_directly", ()))
    for name, module in list(model.named_modules()):
        if not (name.startswith(prefix) and type(module) is nn.Linear) or name.rpartition(".")[2] in keep:
            continue
        if not packing_supported(module.weight.device, module.weight.dtype):
            continue
        parent, _, child = name.rpartition(".")
        setattr(model.get_submodule(parent), child, PackedLinear(module))
        replaced.append(name)
    return replaced
