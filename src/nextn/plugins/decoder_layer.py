"""nextn's fused CPU decoder layer (`decoder_layer_cpu.cpp`): a whole dense-family layer (Llama, Qwen2; Qwen3's q/k
norms; Gemma 3's sandwich and unit-offset norms, GELU-tanh, sliding-window layers) of a W4A16 engine in one op call,
for the decode and verify steps (and prefill: one numerical path for every step).

A small model's decode step is dispatch, not arithmetic: the PyTorch path of one layer runs ~50 ops (RMSNorm,
three projections, RoPE, the cache write, attention, the gated MLP, two residual adds, each a few µs from Python)
around seven matmuls. The op computes the same layer in C++ with nextn's int4 kernel and paged attention, q/k/v as
one matmul and gate/up as one (their weights concatenated at load, the modules' own buffers becoming views of the
concatenation: no extra memory). `llama_decoder_stack` runs every layer of a model in one call (`FusedStack`, the
same layer function in a C++ loop), so a small model's step pays the Python and dispatch of one call, not ~30.

`cpu_kernels.ops().llama_decoder_layer(x [B, T, H] bf16, cos_sin [B, T, 2, D/2] f32, kv_cache [slots, 2·NKV·D]
bf16 (written), slot_mapping [B·T] int64, context_slots [B, S] int64, visible [B, 1, T, S] bool, norms (input,
post, [pre_ff, post_ff], [q, k]: bf16 weights or f32 1 + w scales), qkv, o, gate_up, down ([w, scale, zero8(,
bias)] each, `woq_linear`'s int4 layout), num_heads, num_kv_heads, group_size, eps, scale, int8_activations,
sandwich, qk_norm, activation) → [B, T, H] bf16.`

Numerics: the layer's PyTorch path (the reference: the same module with `fused = None`) with its bf16 roundings
(RMSNorm output, projections, RoPE products, attention output, residual adds, silu and its product); only the
RMSNorm sum of squares and silu's exp are computed in another order, so a rare element differs in its last bf16
bit. Every row is computed alone (batch-invariant: a verify step's rows equal plain steps' bit for bit), which
speculative decoding's token identity needs. `tests/plugins/test_decoder_layer.py` checks both.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from nextn.plugins import cpu_kernels
from nextn.plugins.int4_operands import concat_rows, int4_linears, one_linear


#: The op's activation codes.
ACTIVATIONS = {"silu": 0, "gelu_pytorch_tanh": 1}


@dataclass(frozen=True)
class FusedLayerWeights:
    """One layer's operands for the op: its norms (input, post, [pre_ff, post_ff], [q, k]: bf16 weights, or f32
    scales 1 + w for Gemma's unit-offset norms), each linear as [w, scale, zero8] (+ [bias]), q/k/v and gate/up
    concatenated along the output channels (rows), and the layer options."""

    norms: list[torch.Tensor]
    qkv: list[torch.Tensor]
    o: list[torch.Tensor]
    gate_up: list[torch.Tensor]
    down: list[torch.Tensor]
    group_size: int
    int8_activations: bool = False  # W4A8
    sandwich: bool = False
    qk_norm: bool = False
    activation: int = 0  # ACTIVATIONS
    residual_multiplier: float = 1.0  # Granite
    pre_norms: bool = True  # False: OLMo 2's post-norms (the input and pre-MLP norms absent: empty tensors)
    qk_norm_all_heads: bool = False  # OLMo 2: one q norm over all heads (and one k norm)
    attn_softcap: float = 0.0  # Gemma 2: attention logits soft-capped at this (0: none)
    attn_sinks: torch.Tensor | None = None  # gpt-oss: [num_heads] f32, a logit a head in each softmax (None: none)
    output_gate: bool = False  # Qwen3.5: qkv ends with gate_proj's rows; the attention output × sigmoid(gate)

    @property
    def attention_only(self) -> bool:
        """No gate_up / down: the op stops after the attention's residual add (an MoE layer runs its MLP itself)."""
        return not self.gate_up


def _norm_operands(layer: nn.Module) -> list[torch.Tensor] | None:
    """The layer's norms in the op's order — input, post, [pre_ff, post_ff], [q, k] — as bf16 weights (Llama's
    RMSNorm), or as f32 scales 1 + w (Gemma's `UnitOffsetRMSNorm`, the product the module computes); None for other
    dtypes or a mix of the two kinds."""
    pre = getattr(layer, "pre_norms", True)
    mods = [layer.input_layernorm if pre else None, layer.post_attention_layernorm]
    if getattr(layer, "sandwich", False):
        mods += [layer.pre_feedforward_layernorm if pre else None, layer.post_feedforward_layernorm]
    if getattr(layer.self_attn, "qk_norm", False):
        mods += [layer.self_attn.q_norm, layer.self_attn.k_norm]
    present = [m for m in mods if m is not None]
    scales = [m.fp32_scale() for m in present]  # the models' RMSNorm classes say how they apply their weight
    if all(s is not None for s in scales):
        it = iter(scales)  # an absent pre-norm (OLMo 2) is an empty tensor: the op skips it
        return [next(it).contiguous() if m is not None else torch.empty(0) for m in mods]
    if all(s is None for s in scales) and all(m.weight.dtype == torch.bfloat16 for m in present):
        empty = torch.empty(0, dtype=torch.bfloat16)  # an absent pre-norm (EXAONE 4's post-norms)
        return [m.weight.detach().contiguous() if m is not None else empty for m in mods]
    return None


def fuse_layer(layer: nn.Module) -> FusedLayerWeights | None:
    """The op's operands for a `LlamaDecoderLayer` (Qwen3.5's gated attention too: gate_proj's rows after v), or None
    where the op does not apply: not every projection a W4A16 linear on nextn's kernel with one group size, q/k/v biases on some but not all, attention not on nextn's
    paged kernel, norms not bf16 (or Gemma's, any dtype), an activation the op lacks, or shapes the op does not take
    (hidden / intermediate % 64, head_dim % 32)."""
    attn, mlp = layer.self_attn, layer.mlp
    if _gemma4(layer):
        return None
    qkv = _qkv(attn)
    if not hasattr(mlp, "gate_proj"):  # an MoE MLP (models/moe.py): the op runs the attention, the module the MLP
        return _fuse_attention(layer)
    kind = int4_linears(*qkv, attn.o_proj, mlp.gate_proj, mlp.up_proj, mlp.down_proj)
    if kind is None or not attn.paged_attention_kernel or len({lin.bias is None for lin in qkv}) != 1:
        return None
    norms = _norm_operands(layer)
    hidden, inter = attn.o_proj.out_features, mlp.gate_proj.out_features
    activation = ACTIVATIONS.get(getattr(mlp, "act_name", "silu"))
    residual = float(getattr(layer, "residual_multiplier", 1.0))
    if (norms is None or activation is None or hidden % 64 or inter % 64 or attn.head_dim % 32
            or attn.head_dim > 256 or (residual != 1.0 and getattr(layer, "sandwich", False))):
        return None
    return FusedLayerWeights(norms, concat_rows(qkv), one_linear(attn.o_proj), concat_rows([mlp.gate_proj, mlp.up_proj]),
                             one_linear(mlp.down_proj), *kind, sandwich=getattr(layer, "sandwich", False),
                             qk_norm=getattr(attn, "qk_norm", False), activation=activation,
                             residual_multiplier=residual, pre_norms=getattr(layer, "pre_norms", True),
                             qk_norm_all_heads=getattr(attn, "qk_norm_all_heads", False),
                             attn_softcap=float(getattr(attn, "softcap", None) or 0.0), attn_sinks=_sinks(attn),
                             output_gate=len(qkv) == 4)


def _qkv(attn: nn.Module) -> list[nn.Module]:
    """The projections the op runs as one matmul: q, k, v, and with an output gate (Qwen3.5) its gate_proj."""
    gate = [attn.gate_proj] if getattr(attn, "output_gate", False) else []
    return [attn.q_proj, attn.k_proj, attn.v_proj] + gate


def _fuse_attention(layer: nn.Module) -> FusedLayerWeights | None:
    """The op's operands for the attention half of a pre-norm layer whose MLP is not a `GatedMLP` (an MoE layer): no
    gate_up / down (`attention_only`: the op returns the hidden state after the attention's residual add)."""
    attn = layer.self_attn
    if _gemma4(layer):
        return None
    qkv = _qkv(attn)
    kind = int4_linears(*qkv, attn.o_proj)
    if (kind is None or not attn.paged_attention_kernel or len({lin.bias is None for lin in qkv}) != 1
            or getattr(layer, "sandwich", False) or not getattr(layer, "pre_norms", True)
            or float(getattr(layer, "residual_multiplier", 1.0)) != 1.0):
        return None
    norms = _norm_operands(layer)
    hidden = attn.o_proj.out_features
    if norms is None or hidden % 64 or attn.head_dim % 32 or attn.head_dim > 256:
        return None
    return FusedLayerWeights(norms, concat_rows(qkv), one_linear(attn.o_proj), [], [], *kind,
                             qk_norm=getattr(attn, "qk_norm", False),
                             qk_norm_all_heads=getattr(attn, "qk_norm_all_heads", False),
                             attn_softcap=float(getattr(attn, "softcap", None) or 0.0), attn_sinks=_sinks(attn),
                             output_gate=len(qkv) == 4)


def _gemma4(layer: nn.Module) -> bool:
    """Whether the layer has a part of Gemma 4's the op lacks: V's norm, KV read from another layer, per-layer inputs,
    a layer scalar (these layers run as modules; nextn's paged-attention kernel still serves their attention)."""
    attn = layer.self_attn
    return (getattr(attn, "v_norm", None) is not None or getattr(attn, "kv_shared", False)
            or getattr(layer, "per_layer_input", False) or getattr(layer, "scaled", False))


def _sinks(attn: nn.Module) -> torch.Tensor | None:
    """The attention's sinks as the op reads them ([num_heads] f32, contiguous), or None without."""
    sinks = getattr(attn, "sinks", None)
    return None if sinks is None else sinks.detach().float().contiguous()


@dataclass(frozen=True)
class FusedStack:
    """Every decoder layer's operands for `llama_decoder_stack` (all the layers in one op call), layer after layer:
    `norms` 2 a layer (4 with sandwich norms, + 2 with q/k norms), each linear kind `arity` tensors a layer; the
    layer options, and which layers are sliding-window ones (`sliding`, empty when none)."""

    norms: list[torch.Tensor]
    qkv: list[torch.Tensor]
    o: list[torch.Tensor]
    gate_up: list[torch.Tensor]
    down: list[torch.Tensor]
    arity: list[int]  # tensors a layer of qkv, o, gate_up, down (3, or 4 with a bias)
    num_heads: int
    num_kv_heads: int
    group_size: int
    eps: float
    scale: float
    int8_activations: bool
    sandwich: bool = False
    qk_norm: bool = False
    activation: int = 0
    sliding: list[int] = ()
    residual_multiplier: float = 1.0
    pre_norms: bool = True
    qk_norm_all_heads: bool = False
    attn_softcap: float = 0.0
    moe: MoeStack | None = None  # MoE layers: their MLP halves (`moe_block`'s), gate_up / down then empty


@dataclass(frozen=True)
class MoeStack:
    """The MLP halves of a stack's MoE layers for `llama_decoder_stack` (what `moe_experts.block_forward` passes
    `moe_block`, layer after layer): each layer's router weight [E, H] bf16 and its experts' stacked [w, scale, zero]
    of gate/up and of down (3 a layer). Softmax routers without a bias, SwiGLU experts without biases, no shared
    expert (Qwen3-MoE, Mixtral, OLMoE); other MoE layers take their two ops one layer at a time."""

    routers: list[torch.Tensor]
    gate_up: list[torch.Tensor]
    down: list[torch.Tensor]
    top_k: int
    norm_topk: bool


def _moe_stack(layers: list[nn.Module]) -> MoeStack | None:
    """`MoeStack` of layers that all run `moe_block` with one top-k, the attention's weight format and no biases,
    else None."""
    if not all(getattr(layer, "moe_block", False) for layer in layers):
        return None
    moes = [layer.mlp for layer in layers]
    kinds = {(m.gate.top_k, bool(m.gate.norm_topk_prob), m.fused_experts.group_size, m.fused_experts.int8_activations,
              layer.fused.group_size, layer.fused.int8_activations) for m, layer in zip(moes, layers)}
    if (len(kinds) != 1 or any(m.gate.kind != "softmax" or m.gate.bias is not None or m.fused_experts.gate_up_bias
                               or m.fused_experts.activation or m.fused_experts.shared_gate_up for m in moes)):
        return None
    top_k, norm_topk, group, int8, attn_group, attn_int8 = kinds.pop()
    if (group, int8) != (attn_group, attn_int8):
        return None
    return MoeStack([m.gate.weight for m in moes], [t for m in moes for t in m.fused_experts.gate_up],
                    [t for m in moes for t in m.fused_experts.down], top_k, norm_topk)


def fuse_stack(layers: list[nn.Module], layer_types: tuple[str, ...] | None = None) -> FusedStack | None:
    """`FusedStack` of `layers` (each with its `fused` operands set; `layer_types` the model's, None: all full
    attention), or None unless every layer takes the op with the same group size, activations, biases, heads, eps,
    softmax scale and options (then the op calls run one by one) — MoE layers all (`MoeStack`) or none."""
    if not layers or any(getattr(layer, "fused", None) is None or layer.fused.attn_sinks is not None
                         or layer.fused.output_gate for layer in layers):
        return None
    moe = _moe_stack(layers) if layers[0].fused.attention_only else None
    if any(layer.fused.attention_only != (moe is not None) for layer in layers):
        return None
    fs: list[FusedLayerWeights] = [layer.fused for layer in layers]

    def shape(layer: nn.Module, f: FusedLayerWeights) -> tuple:
        attn = layer.self_attn
        return (f.group_size, f.int8_activations, len(f.qkv), len(f.o), len(f.gate_up), len(f.down), attn.num_heads,
                attn.num_kv_heads, float(layer.post_attention_layernorm.eps), float(attn.scale), f.sandwich, f.qk_norm,
                f.activation, f.norms[1].dtype, f.residual_multiplier, f.pre_norms, f.qk_norm_all_heads, f.attn_softcap)

    shapes = {shape(layer, f) for layer, f in zip(layers, fs)}
    if len(shapes) != 1 or any(":" in t for t in layer_types or ()):
        return None  # NoPE layers (SmolLM3) take the op one layer at a time, each with its rope rows
    (group, int8, *arity, heads, kv_heads, eps, scale, sandwich, qk_norm, activation, _, residual, pre_norms,
     all_heads, softcap) = shapes.pop()
    sliding = [int(t == "sliding_attention") for t in layer_types] if layer_types else []
    return FusedStack([n for f in fs for n in f.norms], [t for f in fs for t in f.qkv],
                      [t for f in fs for t in f.o], [t for f in fs for t in f.gate_up], [t for f in fs for t in f.down],
                      list(arity), heads, kv_heads, group, eps, scale, int8, sandwich, qk_norm, activation, sliding,
                      residual, pre_norms, all_heads, softcap, moe)


def install_fused_layers(model: nn.Module) -> int:
    """Give every layer of `model` that offers the op (a `fused` attribute: `LlamaDecoderLayer`) its operands, where
    it applies (`fuse_layer`; the kernels built: `cpu_kernels`), and a model that offers it (a `fused_stack`
    attribute: `SelfDraftingCausalLM`) its decoder layers as one `FusedStack` when all of them take the op. Call after
    the weight-only linears and the paged attention kernel are installed.

    Returns:
        How many layers use the op (0 where it does not apply).
    """
    if not cpu_kernels.available():
        return 0
    from nextn.plugins.moe_experts import block_applies, fuse_experts

    count = 0
    for module in model.modules():
        if hasattr(module, "fused"):
            module.fused = fuse_layer(module)
            count += module.fused is not None
        if hasattr(module, "fused_experts"):  # an MoE layer's routed experts (models/moe.py) as one op
            module.fused_experts = fuse_experts(module)
    for module in model.modules():  # an MoE layer's whole MLP half (norm, router, experts, residual) as one op
        if not hasattr(module, "moe_block"):
            continue
        if hasattr(module, "fused"):  # a Llama-family layer: where its attention op stops before the MLP half
            module.moe_block = (module.fused is not None and module.fused.attention_only
                                and module.residual_multiplier == 1.0
                                and block_applies(module.mlp, module.post_attention_layernorm))
        elif hasattr(module, "fused_deltanet"):  # a Gated DeltaNet layer: where its op stops after the mixer
            module.moe_block = (module.fused_deltanet is not None and module.fused_deltanet.attention_only
                                and block_applies(module.mlp, module.post_attention_layernorm))
        else:  # a pre-norm layer of its own attention (DeepSeek's MLA)
            module.moe_block = block_applies(module.mlp, module.post_attention_layernorm)
    if hasattr(model, "fused_stack"):
        model.fused_stack = fuse_stack(list(model.model.layers)[:model.cfg.num_hidden_layers],
                                       getattr(model, "layer_types", None))
    return count


def fused_forward(layer: nn.Module, x: torch.Tensor, cos_sin: torch.Tensor, kv_cache: torch.Tensor,
                  meta) -> torch.Tensor:
    """Run `layer` (with `layer.fused` set) through the op: shapes as `PreNormDecoderLayer.forward`'s."""
    f: FusedLayerWeights = layer.fused
    attn = layer.self_attn
    return cpu_kernels.ops().llama_decoder_layer(
        x, cos_sin, kv_cache, meta.slot_mapping.reshape(-1), meta.context_slots, meta.visible, f.norms, f.qkv, f.o,
        f.gate_up, f.down, attn.num_heads, attn.num_kv_heads, f.group_size, layer.post_attention_layernorm.eps,
        attn.scale,
        f.int8_activations, f.sandwich, f.qk_norm, f.activation, f.residual_multiplier, f.pre_norms,
        f.qk_norm_all_heads, f.attn_softcap, f.attn_sinks, f.output_gate)


def stack_forward(stack: FusedStack, x: torch.Tensor, inputs: dict, kv_cache: torch.Tensor) -> torch.Tensor:
    """All the decoder layers of `stack` in one op call: x [B, T, H] bf16 → [B, T, H] bf16; inputs: the model's
    `attention_inputs` ((cos_sin, metadata) by layer type); kv_cache: the model's whole cache [layers, slots, kv dim]
    (layer i writes kv_cache[i])."""
    cos_sin, meta = inputs["full_attention"]
    local_cs, local_meta = inputs.get("sliding_attention", (None, None))
    moe = stack.moe
    own = local_meta is not None and local_meta.slot_mapping is not meta.slot_mapping  # sliding blocks of their own
    return cpu_kernels.ops().llama_decoder_stack(
        x, cos_sin, kv_cache, meta.slot_mapping.reshape(-1), meta.context_slots, meta.visible, stack.norms, stack.qkv,
        stack.o, stack.gate_up, stack.down, *((moe.routers, moe.gate_up, moe.down) if moe else ([], [], [])),
        stack.arity, stack.num_heads, stack.num_kv_heads, stack.group_size,
        stack.eps, stack.scale, stack.int8_activations, stack.sandwich, stack.qk_norm, stack.activation,
        local_cs.contiguous() if local_cs is not None else None,
        local_meta.visible if local_meta is not None else None, list(stack.sliding), stack.residual_multiplier,
        stack.pre_norms, stack.qk_norm_all_heads, stack.attn_softcap,
        local_meta.slot_mapping.reshape(-1) if own else None, local_meta.context_slots if own else None,
        moe.top_k if moe else 0, moe.norm_topk if moe else False)
