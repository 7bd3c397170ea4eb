"""Weight-only quantization of linear layers at build time, with the reference dequantization.

TensorRT-LLM's names (`QuantConfig.quant_algo`, `group_size`, `exclude_modules`):
- **W8A16**: int8 weights, one symmetric scale per output channel (`absmax / 127`); activations stay 16-bit.
  Stored as `<linear>.weight` int8 [N, K] and `<linear>.weight_scale` fp32 [N].
- **W4A16**: 4-bit weights, asymmetric per group of `group_size` input channels (q ∈ [0, 15],
  w ≈ q · scale + zero with zero = the group minimum: the "float zero point" form of GPTQ/AWQ and of PyTorch's
  `_weight_int4pack_mm_for_cpu`). Stored portably as `<linear>.weight` uint8 [N, K / 2] (two values a byte, the
  even input channel in the low nibble), `<linear>.weight_scale` and `<linear>.weight_zero` fp32 [N, K / group_size];
  the runtime packs them into the kernel's own layout at load (`quantization/linear.py`).
- **W4A16 with super-blocks** (`super_block_size`; llama.cpp's k-quant scheme, as in Q4_K): the same 4-bit values,
  but each group's scale and zero are 8-bit integers under two fp16 numbers per super-block of groups,
  w = q · (d · scale) + dmin · zero, q ∈ [0, 15]: 4 + 16/g + 32/super bits a weight (4.625 at g = 32, super 256)
  instead of 4 + 64/g (5 at g = 32). Stored as `<linear>.weight` uint8 [N, K / 2], `<linear>.weight_scale` uint8
  and `<linear>.weight_zero` int8 [N, K / group_size], `<linear>.weight_scale_2` fp16 [N, K / super, 2] (d, dmin).
  A layer's super-block is the largest multiple of the group size ≤ `super_block_size` dividing its K.
- **W4A8**: W4A16's weights (stored the same way), multiplied on nextn's CPU kernel by the activations quantized to
  int8 per group of `group_size`, or with super-blocks per super-block (symmetric, max |x| / 127, at run time:
  llama.cpp's numerics on a CPU, where its 4-bit dot products take 8-bit activations: Q8_0 beside Q4_0, Q8_K beside
  Q4_K, so that the 8-bit group scales apply to integer sums). Integer dot products (`vpdpbusd`, 64 multiply-adds an
  instruction) keep the step memory-bound at the K + 1 rows of a verify step; elsewhere (PyTorch's kernels) it runs
  as W4A16.

The engine file stays independent of the CPU kernel's tiling; the kernels are PyTorch's own
(`torch.ops.aten._weight_int8pack_mm`, `_weight_int4pack_mm_for_cpu`).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

import torch

from nextn.quantization import kernel_layout
from nextn.quantization.quant_config import (GROUP_SIZES, INT4_ALGOS, QUANT_ALGOS,  # noqa: F401 (re-exported)
                                             QuantConfig, QuantError)


def default_group_size(in_features: list[int]) -> int:
    """The first of `GROUP_SIZES` (32, 64, 128) that divides every input size (W4A16).

    Raises:
        QuantError: none divides them all.
    """
    for g in GROUP_SIZES:
        if all(k % g == 0 for k in in_features):
            return g
    raise QuantError(f"no W4A16 group size in {GROUP_SIZES} divides every layer's input size {sorted(set(in_features))}"
                     "; use W8A16, or exclude those layers with exclude_modules")


def super_block(k: int, group_size: int, super_block_size: int) -> int:
    """A layer's super-block: the largest multiple of `group_size` ≤ `super_block_size` dividing K (at least one
    group)."""
    best = group_size
    for s in range(group_size, super_block_size + 1, group_size):
        if k % s == 0:
            best = s
    return best


def quantize(w: torch.Tensor, cfg: QuantConfig) -> dict[str, torch.Tensor]:
    """Quantize one linear weight.

    Args:
        w: [N, K] floating weight (out_features × in_features).
    Returns:
        {"weight", "weight_scale"} (W8A16), {"weight", "weight_scale", "weight_zero"} (W4A16) and
        "weight_scale_2" (W4A16 with super-blocks), shapes and dtypes as in the module docstring.
    Raises:
        QuantError: not 2-D, non-finite values, or K not divisible by the group size.
    """
    if w.dim() != 2:
        raise QuantError(f"weight-only quantization takes 2-D linear weights, got shape {tuple(w.shape)}")
    w = w.float()
    if not torch.isfinite(w).all():
        raise QuantError("the weight has NaN or Inf values; it cannot be quantized")
    n, k = w.shape
    if cfg.quant_algo == "W8A16":
        scale = _bf16_exact((w.abs().amax(dim=1) / 127).clamp(min=1e-12))  # [N]
        q = torch.round(w / scale[:, None]).clamp(-127, 127).to(torch.int8)
        return {"weight": q, "weight_scale": scale}
    g = cfg.group_size or default_group_size([k])
    if k % g or k % 2:
        raise QuantError(f"W4A16 group_size {g} does not divide the input size {k}; choose a group size that does")
    wg = w.view(n, k // g, g)
    lo, hi = wg.amin(dim=-1), wg.amax(dim=-1)  # [N, K/g]
    if cfg.super_block_size:
        return _quantize_super(wg, lo, hi, super_block(k, g, cfg.super_block_size) // g)
    scale = _bf16_exact(((hi - lo) / 15).clamp(min=1e-12))
    lo = _bf16_exact(lo + 8 * scale) - 8 * scale  # the kernel's zero point lo + 8·scale is then exact in bf16
    q = torch.round((wg - lo[..., None]) / scale[..., None]).clamp(0, 15).to(torch.uint8).view(n, k)
    packed = q[:, 0::2] | (q[:, 1::2] << 4)  # [N, K/2]
    return {"weight": packed.contiguous(), "weight_scale": scale, "weight_zero": lo}


def _fp16_at_least(x: torch.Tensor) -> torch.Tensor:
    """x (≥ 0) as fp16, rounded up (never below x, never 0), so that 255 · d covers the largest group scale."""
    h = x.clamp(min=2.0 ** -24).half()
    low = h.float() < x
    return torch.where(low, torch.nextafter(h, torch.tensor(float("inf"), dtype=torch.float16)), h)


def _quantize_super(wg: torch.Tensor, lo: torch.Tensor, hi: torch.Tensor, gps: int) -> dict[str, torch.Tensor]:
    """Two-level W4A16 of wg [N, G, g] with group minima / maxima lo, hi [N, G] and `gps` groups a super-block:
    zero = dmin · floor(lo / dmin) (≤ lo), scale = d · sc with sc the smallest 8-bit step covering [zero, hi] or
    one less, whichever gives the group the smaller squared error (llama.cpp's `make_qkx2_quants` searches the
    same two numbers more widely)."""
    n, groups, g = wg.shape
    sup = groups // gps
    d = _fp16_at_least((hi - lo).clamp(min=0).view(n, sup, gps).amax(-1) / 15 / 255)  # [N, S]
    dmin = _fp16_at_least(lo.abs().view(n, sup, gps).amax(-1) / 127)
    df, dminf = d.float().repeat_interleave(gps, 1), dmin.float().repeat_interleave(gps, 1)  # [N, G]
    z = torch.floor(lo / dminf).clamp(-127, 127)
    zero = z * dminf
    top = torch.ceil((hi - zero) / 15 / df).clamp(0, 255)
    best_err, best = None, None
    for sc in (top, (top - 1).clamp(min=0)):
        scale = sc * df
        q = torch.round((wg - zero[..., None]) / scale.clamp(min=1e-30)[..., None]).clamp(0, 15)
        err = (q * scale[..., None] + zero[..., None] - wg).square().sum(-1)
        if best is None:
            best_err, best = err, (sc, q)
        else:
            take = err < best_err
            best = (torch.where(take, sc, best[0]), torch.where(take[..., None], q, best[1]))
            best_err = torch.minimum(err, best_err)
    sc, q = best
    q = q.to(torch.uint8).view(n, groups * g)
    return {"weight": (q[:, 0::2] | (q[:, 1::2] << 4)).contiguous(), "weight_scale": sc.to(torch.uint8),
            "weight_zero": z.to(torch.int8), "weight_scale_2": torch.stack([d, dmin], dim=-1)}


def _bf16_exact(x: torch.Tensor) -> torch.Tensor:
    """x rounded to bfloat16 precision, kept fp32: the kernels read scales in bf16, so the stored values are exact."""
    return x.bfloat16().float()


def unpack_int4(packed: torch.Tensor) -> torch.Tensor:
    """[N, K/2] uint8 (low nibble = even channel) → [N, K] int32 values in [0, 15]."""
    low, high = (packed & 0x0F).to(torch.int32), (packed >> 4).to(torch.int32)
    return torch.stack([low, high], dim=-1).view(packed.shape[0], -1)


def dequantize(t: dict[str, torch.Tensor], cfg: QuantConfig) -> torch.Tensor:
    """The reference dequantization of `quantize`'s output: [N, K] fp32."""
    if cfg.quant_algo == "W8A16":
        return t["weight"].float() * t["weight_scale"].float()[:, None]
    q = unpack_int4(t["weight"]).float()
    n, k = q.shape
    groups = t["weight_scale"].shape[1]
    if "weight_scale_2" in t:
        scale, zero = super_scales(t)
        return (q.view(n, groups, k // groups) * scale[..., None] + zero[..., None]).view(n, k)
    scale, zero8 = t["weight_scale"].float()[..., None], (t["weight_zero"].float() + 8 * t["weight_scale"].float())[..., None]
    w = (q.view(n, groups, k // groups) - 8) * scale + zero8  # as the kernel: (q − 8) · scale + (zero + 8 · scale)
    return w.view(n, k)


def super_scales(t: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """A two-level W4A16 layer's effective per-group scale d · sc and zero dmin · z, [N, G] fp32 (exact)."""
    d2 = t["weight_scale_2"].float()  # [N, S, 2]
    gps = t["weight_scale"].shape[1] // d2.shape[1]
    d, dmin = d2[..., 0].repeat_interleave(gps, 1), d2[..., 1].repeat_interleave(gps, 1)
    return t["weight_scale"].float() * d, t["weight_zero"].float() * dmin


def quantized_specs(name: str, shape: tuple[int, int], cfg: QuantConfig) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
    """The stored tensors' (shape, dtype) for linear weight `name` (ending in `.weight`) of `shape` [N, K]."""
    prefix, (n, k) = name.removesuffix(".weight"), shape
    cfg = cfg.for_module(prefix)
    if cfg.quant_algo == "W8A16":
        return {f"{prefix}.weight": ((n, k), torch.int8), f"{prefix}.weight_scale": ((n,), torch.float32)}
    g = cfg.group_size or default_group_size([k])
    if kernel_layout.applies(prefix, shape, cfg):  # an MoE expert, stored as the kernel reads it
        return kernel_layout.specs(prefix, shape, cfg, k // g, k // super_block(k, g, cfg.super_block_size)
                                   if cfg.super_block_size else None)
    if cfg.super_block_size:
        return {f"{prefix}.weight": ((n, k // 2), torch.uint8), f"{prefix}.weight_scale": ((n, k // g), torch.uint8),
                f"{prefix}.weight_zero": ((n, k // g), torch.int8),
                f"{prefix}.weight_scale_2": ((n, k // super_block(k, g, cfg.super_block_size), 2), torch.float16)}
    return {f"{prefix}.weight": ((n, k // 2), torch.uint8), f"{prefix}.weight_scale": ((n, k // g), torch.float32),
            f"{prefix}.weight_zero": ((n, k // g), torch.float32)}


def linear_weight_names(model: torch.nn.Module, cfg: QuantConfig) -> set[str]:
    """`<name>.weight` of every `nn.Linear` in `model` (built on the meta device) that `cfg` quantizes: all but those
    `cfg` excludes and those the model keeps dense (`keep_dense` set on the module: a projection to a few values per
    head, such as a Gated DeltaNet's decay and write-strength inputs, which quantizing would save nothing on) or
    whose weight it reads directly (`model.weights_read_directly`: MLA's `kv_b_proj`, folded into the query)."""
    read = set(getattr(model, "weights_read_directly", ()))
    return {f"{n}.weight" for n, m in model.named_modules()
            if isinstance(m, torch.nn.Linear) and cfg.applies_to(n) and not getattr(m, "keep_dense", False)
            and n.rpartition(".")[2] not in read}


def quantize_stream(specs: dict[str, tuple[tuple[int, ...], torch.dtype]],
                    tensors: Iterable[tuple[str, torch.Tensor]], names: set[str], cfg: QuantConfig,
                    native: Callable[[str, QuantConfig], dict[str, torch.Tensor] | None] | None = None):
    """Rewrite a build's tensor specs and tensor stream so that the weights in `names` are stored quantized.

    Args:
        specs: name → (shape, dtype) of every engine tensor (the safetensors header is written from these).
        tensors: the (name, tensor) stream in the engine dtype.
        names: linear weights to quantize (`linear_weight_names`); others pass through unchanged.
        native: (name, the layer's config) → the layer's tensors as the source already holds them in that format
            (a GGUF's Q4_K blocks: `GGUFCheckpoint.native_w4a16`), or None to quantize the streamed tensor.
    Returns:
        (new specs, new stream); the stream yields `quantize`'s tensors in place of each quantized weight.
    Raises:
        QuantError: (from the stream) a weight cannot be quantized; the message names it.
    """
    out_specs: dict[str, tuple[tuple[int, ...], torch.dtype]] = {}
    for name, (shape, dtype) in specs.items():
        out_specs.update(quantized_specs(name, shape, cfg) if name in names else {name: (shape, dtype)})

    def stream():
        for name, t in tensors:
            if name not in names:
                yield name, t
                continue
            layer_cfg = cfg.for_module(name.removesuffix(".weight"))
            q = native(name, layer_cfg) if native is not None else None
            if q is not None and tuple(q["weight"].shape) != (t.shape[0], t.shape[1] // 2):
                raise QuantError(f"{name}: the source's quantized tensor is {tuple(q['weight'].shape)} packed, the "
                                 f"weight {tuple(t.shape)}")
            try:
                q = q if q is not None else quantize(t, layer_cfg)
            except QuantError as e:
                raise QuantError(f"{name}: {e}") from e
            prefix = name.removesuffix(".weight")
            if kernel_layout.applies(prefix, tuple(t.shape), layer_cfg):
                q = kernel_layout.to_kernel(q, layer_cfg)
            yield from ((f"{prefix}.{k}", v) for k, v in q.items())

    return out_specs, stream()
