"""Small layers shared by model families: RMSNorm (and Gemma's unit-offset form) and the gated MLP (SwiGLU,
GeGLU)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from nextn.plugins.rms_norm import rms_norm


def row_exact(fn, x: torch.Tensor) -> torch.Tensor:
    """fn(x) (an elementwise transcendental: sigmoid, silu) computed in float64, rounded to x's dtype.

    PyTorch's CPU elementwise kernels run the vector body (SLEEF) over a contiguous buffer and a scalar loop over
    its tail, which can differ in the last ulp: where an element falls — body or tail — depends on the tensor's
    size, i.e. on how many tokens share the step (DeepSeek-V3's router scores [N, 8] at N = 5; a SwiGLU width like
    stories260K's 172 leaves a tail in the last row). In float64 the
    two paths may still differ in the last double ulp, which rounding to fp32/bf16 hides (but for ~2⁻²⁹ of inputs).
    """
    return fn(x.double()).to(x.dtype)


class RMSNorm(nn.Module):
    """Root-mean-square norm (Zhang & Sennrich 2019), computed in fp32 and cast back, as HF's `*RMSNorm`.

    `rms_norm_kernel` (set at load by `plugins.rms_norm.install_rms_norms` where it applies, with `rms_norm_weight`
    = `kernel_weight()`): bf16 inputs run nextn's op (one dispatch)."""

    rms_norm_kernel = False
    rms_norm_weight: torch.Tensor | None = None

    def kernel_weight(self) -> torch.Tensor | None:
        """The op's weight: bf16 w (Llama's w · bf16(x̂)) here, the f32 scale where `fp32_scale` gives one."""
        s = self.fp32_scale()
        return self.weight.detach() if s is None else s

    def _kernel(self, x: torch.Tensor) -> torch.Tensor | None:
        """The op's output for x where it runs (bf16 x, a width that is a multiple of 16), else None."""
        if not self.rms_norm_kernel or x.dtype != torch.bfloat16 or x.shape[-1] % 16:
            return None
        return rms_norm(x, self.rms_norm_weight, self.eps)

    def fp32_scale(self) -> torch.Tensor | None:
        """The f32 factor this norm multiplies the f32 x̂ by before rounding (Gemma's 1 + w, OLMo 2's w), or None for
        Llama's form w · bf16(x̂) (what nextn's fused layer needs to know)."""
        return None

    def __init__(self, dim: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if (y := self._kernel(x)) is not None:
            return y
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * xf.to(x.dtype)


class Fp32WeightRMSNorm(RMSNorm):
    """OLMo 2's RMSNorm: the fp32 normalised x times the weight in fp32, then cast (HF `Olmo2RMSNorm`)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if (y := self._kernel(x)) is not None:
            return y
        xf = x.float()
        return (self.weight * (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps))).to(x.dtype)

    def fp32_scale(self) -> torch.Tensor:
        return self.weight.detach().float()


class WeightlessRMSNorm(nn.Module):
    """x̂ = x / rms(x) in fp32, cast back: an RMSNorm without weight (HF `Gemma4RMSNorm(with_scale=False)`, Gemma 4's
    V norm); `rms_norm_kernel` as `RMSNorm`'s."""

    rms_norm_kernel = False

    def __init__(self, eps: float = 1e-6) -> None:
        super().__init__()
        self.eps = eps

    def kernel_weight(self) -> None:
        return None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.rms_norm_kernel and x.dtype == torch.bfloat16 and x.shape[-1] % 16 == 0:
            return rms_norm(x, None, self.eps)
        xf = x.float()
        return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)).to(x.dtype)


class UnitOffsetRMSNorm(RMSNorm):
    """Gemma's RMSNorm: the fp32 normalised x times (1 + weight) in fp32, then cast (HF `Gemma3RMSNorm`; `weight`
    is stored as HF stores it, zero-centred)."""

    def fp32_scale(self) -> torch.Tensor:
        return 1.0 + self.weight.detach().float()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if (y := self._kernel(x)) is not None:
            return y
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return (xf * (1.0 + self.weight.float())).to(x.dtype)


def gelu_tanh(x: torch.Tensor) -> torch.Tensor:
    """GELU, tanh approximation (HF's `gelu_pytorch_tanh`)."""
    return F.gelu(x, approximate="tanh")


#: The gate activations of the gated MLP, by HF `hidden_act` name.
ACTIVATIONS = {"silu": F.silu, "gelu_pytorch_tanh": gelu_tanh}


class GatedMLP(nn.Module):
    """down(act(gate(x)) · up(x)): the dense MLP (SwiGLU; GeGLU with `act` "gelu_pytorch_tanh"), and DeepSeek's
    shared experts."""

    def __init__(self, hidden_size: int, intermediate_size: int, act: str = "silu") -> None:
        super().__init__()
        self.gate_proj = nn.Linear(hidden_size, intermediate_size, bias=False)
        self.up_proj = nn.Linear(hidden_size, intermediate_size, bias=False)
        self.down_proj = nn.Linear(intermediate_size, hidden_size, bias=False)
        self.act_name = act
        self.act = ACTIVATIONS[act]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate = self.gate_proj(x)
        # on the CPU the activation's ulp must not depend on the row count: row_exact (a GPU's kernels are per element)
        act = row_exact(self.act, gate) if gate.device.type == "cpu" else self.act(gate)
        return self.down_proj(act * self.up_proj(x))


class PreNormDecoderLayer(nn.Module):
    """The pre-norm transformer block: x + attn(norm(x)), then h + mlp(norm(h)); with placement "sandwich" (Gemma
    2/3) the attention and MLP outputs are normalised too: h = x + post_attn_norm(attn(norm(x))), h + post_ff_norm(mlp(
    pre_ff_norm(h))); "post" (OLMo 2) normalises the outputs only: h = x + post_attn_norm(attn(x)), ...

    `self_attn` takes (x, cos_sin, kv_cache, meta) and writes its KV into the paged cache; parameter names are HF's
    (`self_attn`, `mlp`, `input_layernorm`, `post_attention_layernorm`, and for sandwich norms
    `pre_feedforward_layernorm`, `post_feedforward_layernorm`: HF Gemma's `post_attention_layernorm` normalises the
    attention output, where Llama's normalises the MLP input).
    """

    def __init__(self, self_attn: nn.Module, mlp: nn.Module, hidden_size: int, eps: float, placement: str = "pre",
                 norm: type[RMSNorm] = RMSNorm, residual_multiplier: float = 1.0) -> None:
        super().__init__()
        self.self_attn = self_attn
        self.mlp = mlp
        self.sandwich = placement != "pre"  # the branch outputs are normalised (sandwich and post)
        self.pre_norms = placement != "post"  # the branch inputs are normalised (pre and sandwich)
        self.residual_multiplier = residual_multiplier  # Granite: x + r · branch (1.0: x + branch)
        if self.pre_norms:
            self.input_layernorm = norm(hidden_size, eps=eps)
        self.post_attention_layernorm = norm(hidden_size, eps=eps)
        if placement == "sandwich":
            self.pre_feedforward_layernorm = norm(hidden_size, eps=eps)
        if self.sandwich:
            self.post_feedforward_layernorm = norm(hidden_size, eps=eps)

    def forward(self, x: torch.Tensor, cos_sin: torch.Tensor, kv_cache: torch.Tensor, meta) -> torch.Tensor:
        """x: [B, T, hidden] → [B, T, hidden]; writes this layer's KV (kv_cache: [num_slots, kv dim])."""
        if self.sandwich:
            h = self.input_layernorm(x) if self.pre_norms else x
            x = x + self.post_attention_layernorm(self.self_attn(h, cos_sin, kv_cache, meta))
            h = self.pre_feedforward_layernorm(x) if self.pre_norms else x
            return x + self.post_feedforward_layernorm(self.mlp(h))
        r = self.residual_multiplier
        if r != 1.0:
            x = x + self.self_attn(self.input_layernorm(x), cos_sin, kv_cache, meta) * r
            return x + self.mlp(self.post_attention_layernorm(x)) * r
        x = x + self.self_attn(self.input_layernorm(x), cos_sin, kv_cache, meta)
        return x + self.mlp(self.post_attention_layernorm(x))
