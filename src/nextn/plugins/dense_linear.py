"""nextn's batch-invariant dense CPU linear (`dense_linear_cpu.cpp`): bf16 / fp16 / fp32 weights, 1–8+ rows.

nextn promises that under greedy decoding a request's tokens are the plain decoder's, whatever else shares the step
(other requests, a verify step's K + 1 rows). PyTorch's dense CPU linears do not keep it: oneDNN (bf16, also
`PackedLinear`) and MKL (fp32) pick their blocking and summation order by the row count, so one row's result
changes with M (measured, 2 threads: fp32 `F.linear` at M ∈ {1, 2, 3, 5, 6, 7, 9} against 4-row calls; bf16 at
M = 1 for [1536, 8960] and [8960, 1536]). This kernel computes every output y[m, n] with the same sequence of
operations whatever M, the row's position, the thread count or the split across threads: one f32 accumulator per
(row, channel), the input channels in order (no split-K), then the bias. `tests/plugins/test_dense_linear.py`
checks it bit for bit.

The math, by the weight's dtype (the output is rounded to x's dtype):
- bf16: x rounded to bf16, exact products, f32 sums (`vdpbf16ps`, two input channels an instruction);
- fp16: the weight widened to f32 (exact), x in f32, f32 FMA;
- fp32: x in f32, f32 FMA: an fp32 engine stays within fp32 tolerance of transformers' float32.
It stays memory-bound at 1–8 rows like the int kernels (`woq_linear.py`): a block of 16 output channels is read
once and multiplied against up to 8 rows from registers (more rows: chunks of 8), the next blocks prefetched.

The C++ source is compiled on first use with nextn's other CPU kernels for the CPU's ISA variant (`cpu_kernels.py`).
Where that is not possible, `available()` is False with the reason in
`unavailable_reason()`; `dense_linear_reference` computes the same math in PyTorch (its summation order is
PyTorch's, so it is not batch-invariant unless `rows_alone`).

Op (`cpu_kernels.ops().dense_linear`, usable under `torch.compile` through the fake implementation in
`cpu_kernels.py`): `dense_linear(x [..., K] bf16|fp16|f32, w [N', K'] (`pack`'s layout), bias [N] | None,
out_features N) → [..., N] in x's dtype`.
"""

from __future__ import annotations

from types import SimpleNamespace

import torch
from torch import nn

from nextn.plugins import cpu_kernels

DTYPES = (torch.bfloat16, torch.float16, torch.float32)


def available() -> bool:
    """Whether the kernel is loaded (compiling nextn's CPU kernels on the first call: `cpu_kernels`)."""
    return cpu_kernels.available()


def unavailable_reason() -> str | None:
    """Why the kernel is unavailable (None when it is)."""
    return cpu_kernels.unavailable_reason()


def pack(w: torch.Tensor) -> torch.Tensor:
    """A weight [N, K] → the kernel's layout (a copy), in the weight's dtype.

    Args:
        w: [N, K] bfloat16, float16 or float32 (`nn.Linear.weight`: out × in features).
    Returns:
        [N', K'] in w's dtype, N' = N rounded up to 16 (the extra channels zeros), blocks of 16 output channels
        (16·K' values each, in block order). bf16: K' = K rounded up to 2 (a zero column); per 2 input channels
        k, k+1 of a block, 32 values, element 2c + j = w[c][k + j] (one 64-byte load). fp16 / fp32: K' = K; per
        input channel k of a block, 16 values, element c = w[c][k].
    Raises:
        ValueError: w is not a 2-D tensor of those dtypes with N, K ≥ 1.
    """
    if w.dim() != 2 or w.dtype not in DTYPES or 0 in w.shape:
        raise ValueError(f"dense_linear packs a 2-D bfloat16/float16/float32 weight with N, K >= 1, "
                         f"got {w.dtype} {tuple(w.shape)}")
    n, k = w.shape
    w = torch.nn.functional.pad(w.detach(), (0, k % 2 if w.dtype == torch.bfloat16 else 0, 0, -n % 16))
    n, k = w.shape
    if w.dtype == torch.bfloat16:
        return w.reshape(n // 16, 16, k // 2, 2).transpose(1, 2).reshape(n, k).contiguous()
    return w.reshape(n // 16, 16, k).transpose(1, 2).reshape(n, k).contiguous()


def unpack(packed: torch.Tensor, out_features: int, in_features: int) -> torch.Tensor:
    """`pack`'s inverse: the weight [out_features, in_features] in channel order, in packed's dtype."""
    n, k = packed.shape
    if packed.dtype == torch.bfloat16:
        w = packed.reshape(n // 16, k // 2, 16, 2).transpose(1, 2)
    else:
        w = packed.reshape(n // 16, k, 16).transpose(1, 2)
    return w.reshape(n, k)[:out_features, :in_features]


def dense_linear(x: torch.Tensor, packed: torch.Tensor, out_features: int,
                 bias: torch.Tensor | None = None) -> torch.Tensor:
    """y = x Wᵀ + b on the kernel, batch-invariant.

    Args:
        x: [..., K] bfloat16, float16 or float32 on the CPU.
        packed: `pack(W)` for W [out_features, K].
        out_features: N (packed holds N rounded up to 16 rows).
        bias: [N] (any float dtype; added in f32) or None.
    Returns:
        [..., N] in x's dtype.
    Raises:
        RuntimeError: (the op's checks) operands of the wrong device, dtype, layout or shape, named.

    The op exists once the kernels are loaded: call `available()` first.
    """
    return cpu_kernels.ops().dense_linear(x, packed, bias, out_features)


def dense_linear_reference(x: torch.Tensor, packed: torch.Tensor, out_features: int,
                           bias: torch.Tensor | None = None, rows_alone: bool = False) -> torch.Tensor:
    """What `dense_linear` computes, in PyTorch (f32, PyTorch's summation order): x [..., K] (rounded to bf16 for a
    bf16 weight, else f32) times `unpack(packed)` in f32, plus bias, rounded to x's dtype → [..., N].

    `rows_alone` computes each row in its own call (one row at a time: batch-invariant by construction, slow past a
    few rows), for a CPU without the kernel that must keep the promise.
    """
    k = x.shape[-1]
    w = unpack(packed, out_features, k).float()
    xf = (x.to(torch.bfloat16) if packed.dtype == torch.bfloat16 else x).float()
    if rows_alone:
        flat = xf.reshape(-1, k)
        y = torch.cat([flat[i:i + 1] @ w.T for i in range(flat.shape[0])]).reshape(*x.shape[:-1], out_features)
    else:
        y = xf @ w.T
    return (y if bias is None else y + bias.float()).to(x.dtype)


class DenseLinear(nn.Module):
    """y = x Wᵀ + b over `dense_linear` (W held in `pack`'s layout, not part of any state dict).

    Args:
        linear: an `nn.Linear` on the CPU with a bf16, fp16 or fp32 weight (copied; the original can be freed).
    Raises:
        ValueError: the layer is not on the CPU or its weight not of those dtypes.
        RuntimeError: the kernel is unavailable on this machine (`unavailable_reason()`; keep the `nn.Linear`).
    """

    def __init__(self, linear: nn.Linear) -> None:
        super().__init__()
        w = linear.weight.detach()
        if w.device.type != "cpu" or w.dtype not in DTYPES:
            raise ValueError(f"DenseLinear takes a bf16/fp16/fp32 CPU weight, got {w.dtype} on {w.device}")
        if not available():
            raise RuntimeError(f"nextn's dense CPU kernel is unavailable: {unavailable_reason()}")
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.register_buffer("packed", pack(w), persistent=False)
        bias = None if linear.bias is None else linear.bias.detach().float()
        self.register_buffer("bias", bias, persistent=False)

    @classmethod
    def from_weight(cls, weight: torch.Tensor, bias: torch.Tensor | None = None) -> "DenseLinear":
        """The layer y = x weightᵀ + bias for a weight [out, in] held elsewhere (e.g. a tied lm_head's embedding)."""
        return cls(SimpleNamespace(weight=weight, bias=bias, in_features=weight.shape[1],  # type: ignore[arg-type]
                                   out_features=weight.shape[0]))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x: [..., in_features] bf16/fp16/fp32 → [..., out_features] in x's dtype."""
        return dense_linear(x, self.packed, self.out_features, self.bias)

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, "
                f"batch-invariant {str(self.packed.dtype).removeprefix('torch.')}")


def install_dense_linears(model: nn.Module, prefix: str | tuple[str, ...] | None = None) -> list[str]:
    """Make a dense CPU engine batch-invariant: every bf16 / fp16 / fp32 CPU `nn.Linear` whose name starts with
    `prefix` becomes a `DenseLinear`, except layers whose weight the model reads directly
    (`model.weights_read_directly`, e.g. MLA's `kv_b_proj`); and the target's lm_head, unless quantized, gets a
    `DenseLinear` copy as `model.dense_lm_head` (`SelfDraftingCausalLM.logits` uses it; a tied lm_head keeps sharing
    the embedding's weight for lookups). `prefix` defaults to the target's decoder layers (`model.layers.{i}.` for
    i < num_hidden_layers): MTP layers only draft, so they keep their `nn.Linear`s.

    Returns:
        The names replaced ("lm_head" included); empty where the kernel is unavailable (`unavailable_reason()`),
        in which case nothing changes.
    """
    if not any(isinstance(p, torch.Tensor) and p.device.type == "cpu" for p in model.parameters()) or not available():
        return []
    if prefix is None:
        prefix = tuple(f"model.layers.{i}." for i in range(model.cfg.num_hidden_layers))
    replaced = []
    keep = set(getattr(model, "weights_read_directly", ()))
    for name, module in list(model.named_modules()):
        if not (name.startswith(prefix) and type(module) is nn.Linear) or name.rpartition(".")[2] in keep:
            continue
        if module.weight.device.type != "cpu" or module.weight.dtype not in DTYPES:
            continue
        parent, _, child = name.rpartition(".")
        setattr(model.get_submodule(parent), child, DenseLinear(module))
        replaced.append(name)
    for name, module in model.named_modules():  # matmuls a model runs itself (DeepSeek-V3's router and experts)
        if name.startswith(prefix) and hasattr(module, "use_dense_kernel"):
            module.use_dense_kernel()
            replaced.append(name)
    head = getattr(model, "lm_head", None)
    weight = getattr(head, "weight", None)
    if (not getattr(model, "lm_head_quantized", False) and isinstance(weight, torch.Tensor)
            and weight.device.type == "cpu" and weight.dtype in DTYPES and weight.dim() == 2):
        model.dense_lm_head = DenseLinear.from_weight(weight)
        replaced.append("lm_head")
    return replaced
