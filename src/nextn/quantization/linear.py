"""`WeightOnlyLinear`: a linear layer over W8A16 / W4A16 weights, on nextn's CPU kernels or PyTorch's.

On CPUs with AVX-512 BF16, nextn's own kernels (`plugins/woq_linear.py`; 1.7–1.9× PyTorch's at one row, more at
the rows of a verify step, and batch-invariant: docs/PERFORMANCE.md). Elsewhere, or for shapes ours do not take
(`woq_linear.takes`), PyTorch's:
- W8A16: `torch.ops.aten._weight_int8pack_mm(x [M, K] bf16, w [N, K] int8, scales [N] bf16)`.
- W4A16: `torch.ops.aten._weight_int4pack_mm_for_cpu(x [M, K] bf16, packed, group_size, scales_and_zeros
  [K/g, N, 2] bf16)`, with the weight packed at load by `_convert_weight_to_int4pack_for_cpu` from [N, K] int32 values;
  the kernel computes w = (q − 8) · scale + zero', so zero' = zero + 8 · scale.
Activations are cast to bfloat16 for the kernel and the result back to the input dtype. Where a kernel is not
available (another device), the layer dequantizes on the fly with the reference (`weight_only.dequantize`).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from nextn.plugins import cpu_kernels, dense_linear, page_release, woq_linear
from nextn.quantization import kernel_layout
from nextn.quantization.weight_only import INT4_ALGOS, QuantConfig, dequantize, super_scales, unpack_int4


class WeightOnlyLinear(nn.Module):
    """y = x Wᵀ + b with W stored quantized (buffers are not part of the state dict: built from the engine tensors).

    Args:
        tensors: `quantize`'s output for this layer, plus "bias" [N] when the layer has one.
        cfg: the engine's quant config.
    """

    def __init__(self, tensors: dict[str, torch.Tensor], cfg: QuantConfig) -> None:
        super().__init__()
        self.cfg = cfg
        prepacked = "qweight" in tensors  # stored in the kernel's layout (`kernel_layout`: an MoE expert)
        if prepacked and not _kernel_takes(tensors["qweight"], cfg):
            bias = {"bias": tensors["bias"]} if "bias" in tensors else {}
            tensors = kernel_layout.to_portable(tensors, cfg) | bias
            prepacked = False
        w = tensors["qweight"] if prepacked else tensors["weight"]
        self.out_features = w.shape[0]
        self.int4 = cfg.quant_algo in INT4_ALGOS  # W4A16 / W4A8: two 4-bit values a byte
        self.in_features = w.shape[1] * (2 if self.int4 else 1)
        # W4A8 on nextn's kernel: activations quantized to int8 per group, the weight in the `vpdpbusd` layout
        self.int8_activations = cfg.quant_algo == "W4A8"
        self.register_buffer("bias", tensors.get("bias"), persistent=False)
        self._tensors = {k: v for k, v in tensors.items() if k != "bias"}
        self.use_kernel = w.device.type == "cpu"
        self.kernel = "aten"
        if self.use_kernel and woq_linear.available() and woq_linear.takes(cfg.quant_algo, self.out_features,
                                                                           self.in_features):
            self.kernel = "nextn"
        elif self.use_kernel and cfg.quant_algo == "W8A16" and self.in_features % 8:
            # PyTorch's `_weight_int8pack_mm` reads past the row when K % 8 != 0 (a segmentation fault, e.g.
            # stories260K's down_proj, K = 172): the dequantized weight, on nextn's dense kernel where it loads
            self.use_kernel = False
        if prepacked:  # read in place: the engine file's pages (`model_loader.read_weights` maps it)
            self.group_size = self.in_features // tensors["scales"].shape[1]
            for name in kernel_layout.FIELDS:
                self.register_buffer(name, tensors[name], persistent=False)
        elif cfg.quant_algo == "W8A16" and self.kernel == "nextn":
            # the kernel's layout, rows padded to a multiple of 16 (the output is cut back to N)
            self.register_buffer("qweight", woq_linear.pack_int8(w), persistent=False)
            scale = tensors["weight_scale"].float()
            scale = torch.cat([scale, scale.new_zeros(self.qweight.shape[0] - self.out_features)])
            self.register_buffer("scales", scale.contiguous(), persistent=False)
        elif cfg.quant_algo == "W8A16":
            # a fresh allocation: tensors loaded from safetensors sit at 8-byte offsets in the file's buffer, and
            # vector loads of an unaligned weight crash (found with SmolLM2)
            self.register_buffer("qweight", w.clone(memory_format=torch.contiguous_format), persistent=False)
            self.register_buffer("scales", tensors["weight_scale"].to(torch.bfloat16).contiguous(), persistent=False)
        elif "weight_scale_2" in tensors and self.kernel == "nextn":
            # two-level scales read as stored: `scales` the 8-bit (scale, zero) pairs [N/16, G, 2, 16] uint8, `zeros`
            # the fp16 (d, dmin) of each super-block [N/16, S, 2, 16] (woq_linear_cpu.cpp)
            self.group_size = self.in_features // tensors["weight_scale"].shape[1]
            self.register_buffer("qweight", self._pack(w), persistent=False)
            pairs = torch.stack([tensors["weight_scale"], tensors["weight_zero"].view(torch.uint8)], dim=-1)
            self.register_buffer("scales", woq_linear.block_scales(pairs), persistent=False)
            self.register_buffer("zeros", woq_linear.block_scales(tensors["weight_scale_2"].half()), persistent=False)
        else:
            if "weight_scale_2" in tensors:  # two-level scales on PyTorch's kernel: their per-group values
                scale, zero = super_scales(tensors)
            else:
                scale, zero = tensors["weight_scale"].float(), tensors["weight_zero"].float()
            self.group_size = self.in_features // scale.shape[1]
            if self.kernel == "nextn":
                self.register_buffer("qweight", self._pack(w), persistent=False)
                self.register_buffer("scales", woq_linear.block_scales(scale.to(torch.bfloat16)), persistent=False)
                self.register_buffer("zeros", woq_linear.block_scales((zero + 8 * scale).to(torch.bfloat16)),
                                     persistent=False)
            else:
                q = unpack_int4(w)  # [N, K] int32
                self.register_buffer("qweight", torch.ops.aten._convert_weight_to_int4pack_for_cpu(q, 1)
                                     if self.use_kernel else w, persistent=False)
                sz = torch.stack([scale, zero + 8 * scale], dim=-1)  # [N, K/g, 2]
                self.register_buffer("scales", sz.transpose(0, 1).contiguous().to(torch.bfloat16), persistent=False)
        if self.kernel == "nextn" and self.bias is not None:
            self.bias = self.bias.float()
            if self.qweight.shape[0] != self.out_features:  # int8 rows padded to 16
                self.bias = torch.cat([self.bias, self.bias.new_zeros(self.qweight.shape[0] - self.out_features)])
        self.dense_kernel: nn.Module | None = None  # the dequantized weight on nextn's batch-invariant dense kernel
        if not self.use_kernel:
            self.register_buffer("dense", dequantize(self._tensors, cfg), persistent=False)
            if self.dense.device.type == "cpu" and dense_linear.available():
                self.dense_kernel = dense_linear.DenseLinear.from_weight(self.dense.to(torch.bfloat16), self.bias)
                self.kernel = "nextn"
        del self._tensors

    def _pack(self, w: torch.Tensor) -> torch.Tensor:
        return woq_linear.pack_int4_vnni(w) if self.int8_activations else woq_linear.pack_int4(w)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x: [..., in_features] → [..., out_features] in x's dtype."""
        if self.dense_kernel is not None:
            return self.dense_kernel(x)
        if not self.use_kernel:
            return F.linear(x, self.dense.to(x.dtype), None if self.bias is None else self.bias.to(x.dtype))
        if self.kernel == "nextn":
            if self.cfg.quant_algo == "W8A16":
                y = cpu_kernels.ops().woq_int8_linear(x, self.qweight, self.scales, self.bias)
                return y if y.shape[-1] == self.out_features else y[..., :self.out_features].contiguous()
            return cpu_kernels.ops().woq_int4_linear(x, self.qweight, self.scales, self.zeros, self.group_size, self.bias,
                                                   self.int8_activations)
        shape = x.shape
        x2 = x.reshape(-1, self.in_features).to(torch.bfloat16)
        if self.cfg.quant_algo == "W8A16":
            y = torch.ops.aten._weight_int8pack_mm(x2, self.qweight, self.scales)
        else:
            y = torch.ops.aten._weight_int4pack_mm_for_cpu(x2, self.qweight, self.group_size, self.scales)
        y = y.to(x.dtype).view(*shape[:-1], self.out_features)
        return y if self.bias is None else y + self.bias.to(x.dtype)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, {self.cfg.quant_algo}, {self.kernel} kernel"


def _kernel_takes(qweight: torch.Tensor, cfg: QuantConfig) -> bool:
    """Whether a linear stored in the kernel's layout runs on it here (else it is given back portably)."""
    n, k = qweight.shape[0], 2 * qweight.shape[1]
    return qweight.device.type == "cpu" and woq_linear.available() and woq_linear.takes(cfg.quant_algo, n, k)


def install_weight_only_linears(model: nn.Module, weights: dict[str, torch.Tensor], cfg: QuantConfig) -> list[str]:
    """Replace every module of `model` whose weights are stored quantized (an `nn.Linear`, or a tied model's
    lm_head, which the engine stores as a quantized copy of the embedding) by a `WeightOnlyLinear`.

    The layer's tensors (`weight`, `weight_scale`, [`weight_zero`], [`weight_scale_2`], [`bias`]) are popped from
    `weights`, so the rest loads with `load_state_dict(strict=True)`.
    Returns:
        The names of the replaced layers.
    """
    replaced = []
    since_trim = 0  # bytes repacked since the heap was last trimmed
    for name, module in list(model.named_modules()):
        if not name or (f"{name}.weight_scale" not in weights and f"{name}.qweight" not in weights):
            continue
        keys = [s for s in ("weight", "weight_scale", "weight_zero", "weight_scale_2", *kernel_layout.FIELDS, "bias")
                if f"{name}.{s}" in weights]
        stored = {s: weights.pop(f"{name}.{s}") for s in keys}
        layer = WeightOnlyLinear(stored, cfg.for_module(name))
        # the stored tensors the layer repacked (not kept as they are): their mmap'd engine pages, read for the copy,
        # need not stay resident beside it
        kept = {t.data_ptr() for t in (*layer.state_dict().values(), *layer.buffers())}
        page_release.release(t for t in stored.values() if t.data_ptr() not in kept)
        since_trim += sum(t.numel() * t.element_size() for t in stored.values())
        if since_trim > 512 << 20:  # repacking's freed intermediates back to the system as it goes: the peak
            page_release.trim_heap()  # resident size stays near the engine's (measured: 10.1 GB for 5.6 without)
            since_trim = 0
        parent, _, child = name.rpartition(".")
        setattr(model.get_submodule(parent) if parent else model, child, layer)
        replaced.append(name)
    return replaced
