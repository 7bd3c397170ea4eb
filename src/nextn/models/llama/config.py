"""The normalised dense-decoder configuration, read from an HF `config.json` (either rope spelling) or a GGUF.

One config covers Llama (`LlamaForCausalLM`), Mistral (sliding-window layers where its config sets a window), Qwen2
(q/k/v biases), Qwen3 (q/k norms), Gemma 3 text (sandwich norms, GELU-tanh, scaled embeddings, sliding-window
layers), SmolLM3 (NoPE layers), Granite (embedding, attention, residual and logit multipliers), OLMo 2
(post-norms, q/k norms over all heads) and Gemma 4 text (wider full-attention heads, V = K, per-layer inputs, layers
that read an earlier layer's KV): one model with layer options, not a copy per family (`families.py` sets them
per architecture).

Two spellings of the rotary settings occur and both load:
- older `transformers` / Meta releases: `rope_theta` + `rope_scaling: {rope_type: llama3, factor, ...}` (or null);
- `transformers` 5: `rope_parameters: {rope_type: default | llama3, rope_theta, ...}`.
`LlamaModelConfig.from_hf` maps both onto one frozen pydantic model with HF field names, which the engine manifest
stores and the runtime builds `LlamaForCausalLM` from.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from nextn.models.config import MAX_EXPERTS, ConfigError, Layers, MtpLayers, Size
from nextn.models.llama.families import family_options
from nextn.models.llama.rope_config import Llama3RopeScaling, LinearRopeScaling, LongRopeScaling, YarnRopeScaling

__all__ = ["LLAMA_ARCHITECTURES", "LayerType", "LinearRopeScaling", "Llama3RopeScaling", "LlamaModelConfig",
           "LongRopeScaling", "YarnRopeScaling"]

#: HF architecture → model_type of the checkpoints this family reads (each one's layer options: `families.py`).
LLAMA_ARCHITECTURES = {"LlamaForCausalLM": "llama", "MistralForCausalLM": "mistral", "Qwen2ForCausalLM": "qwen2",
                       "Qwen3ForCausalLM": "qwen3", "Gemma3ForCausalLM": "gemma3_text", "SmolLM3ForCausalLM": "smollm3",
                       "GraniteForCausalLM": "granite", "Olmo2ForCausalLM": "olmo2", "Phi3ForCausalLM": "phi3",
                       "Gemma2ForCausalLM": "gemma2", "Exaone4ForCausalLM": "exaone4", "Olmo3ForCausalLM": "olmo3",
                       "SeedOssForCausalLM": "seed_oss", "Glm4ForCausalLM": "glm4",
                       # mixture-of-experts families (`models/moe.py`): the same layer with a sparse MoE MLP
                       "Qwen3MoeForCausalLM": "qwen3_moe", "Qwen2MoeForCausalLM": "qwen2_moe",
                       "MixtralForCausalLM": "mixtral", "OlmoeForCausalLM": "olmoe", "Glm4MoeForCausalLM": "glm4_moe",
                       # hybrid: Gated DeltaNet layers (`models/gated_deltanet.py`) between gated attention ones
                       "Qwen3_5ForCausalLM": "qwen3_5_text", "Qwen3NextForCausalLM": "qwen3_next",
                       "Qwen3_5MoeForCausalLM": "qwen3_5_moe_text",
                       # attention sinks, biased router and experts, clamped SwiGLU (`families._gpt_oss`)
                       "GptOssForCausalLM": "gpt_oss",
                       # per-layer inputs, KV shared across layers, wider full-attention heads (`families._gemma4`)
                       "Gemma4ForCausalLM": "gemma4_text"}
#: What a layer attends to: every earlier key, the last `sliding_window` keys, or none (a Gated DeltaNet layer: its
#: recurrent state instead of a KV cache) — HF `layer_types` values.
LayerType = Literal["full_attention", "sliding_attention", "linear_attention"]


class LlamaModelConfig(BaseModel):
    """Dense decoder hyper-parameters (HF field names where HF has one) with the layer options that tell the families
    apart (`families.py` sets them per architecture): Qwen2 sets `qkv_bias`; Qwen3 `qk_norm`; Gemma 3 `qk_norm`,
    `norm_style`, `norm_placement`, `embedding_multiplier`, GELU-tanh, `query_pre_attn_scalar`, sliding-window
    layers with their own rope base (`rope_local_theta`)."""

    model_config = ConfigDict(frozen=True, extra="forbid", allow_inf_nan=False)

    architecture: Literal["LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM",
                          "Gemma3ForCausalLM", "SmolLM3ForCausalLM", "GraniteForCausalLM",
                          "Olmo2ForCausalLM", "Phi3ForCausalLM", "Gemma2ForCausalLM",
                          "Exaone4ForCausalLM", "Olmo3ForCausalLM", "SeedOssForCausalLM",
                          "Glm4ForCausalLM", "Qwen3MoeForCausalLM", "Qwen2MoeForCausalLM",
                          "MixtralForCausalLM", "OlmoeForCausalLM", "Glm4MoeForCausalLM",
                          "Qwen3_5ForCausalLM", "Qwen3NextForCausalLM", "GptOssForCausalLM",
                          "Qwen3_5MoeForCausalLM", "Gemma4ForCausalLM"] = "LlamaForCausalLM"
    vocab_size: Size
    hidden_size: Size
    intermediate_size: Size  # SwiGLU width
    num_hidden_layers: Layers
    num_attention_heads: Size
    num_key_value_heads: Size  # GQA: heads of K and V (= num_attention_heads for MHA)
    head_dim: Size  # per-head width; HF's default is hidden_size // num_attention_heads
    rms_norm_eps: float = Field(default=1e-6, gt=0)
    rope_theta: float = Field(default=10000.0, gt=0)  # RoPE base
    rope_scaling: Llama3RopeScaling | LinearRopeScaling | LongRopeScaling | YarnRopeScaling | None = Field(
        default=None, discriminator="rope_type")
    #: dims of a head RoPE rotates, the first ones (HF `partial_rotary_factor` × head_dim: Phi-4-mini 0.75); None: all
    rotary_dim: Size | None = None
    #: RoPE rotates the pairs (2j, 2j + 1) of those dims (GLM-4's `rotate_half`), not (j, j + rotary_dim / 2)
    rope_interleaved: bool = False
    #: per-frequency divisors of RoPE's inverse frequencies [head_dim // 2], as a GGUF carries Llama-3 scaling
    #: (llama.cpp's `rope_freqs` tensor, which convert_hf_to_gguf.py computes from `rope_scaling`); None: none
    rope_freq_factors: tuple[float, ...] | None = None
    max_position_embeddings: Size = 2048
    tie_word_embeddings: bool = False  # lm_head is embed_tokens (stored once in the engine)
    attention_bias: bool = False  # q/k/v/o projections carry biases (HF LlamaConfig)
    qkv_bias: bool = False  # q/k/v (not o) projections carry biases (Qwen2; implied by attention_bias)
    mlp_bias: Literal[False] = False  # biased MLPs are not supported (no released Llama uses them)
    hidden_act: Literal["silu", "gelu_pytorch_tanh"] = "silu"  # the gate's activation (Gemma: GELU, tanh form)
    # Layer options ------------------------------------------------------------------------------
    qk_norm: bool = False  # RMSNorm of q and k before RoPE (`q_norm`, `k_norm`: Qwen3, Gemma 3, OLMo 2)
    qk_norm_over: Literal["head", "all_heads"] = "head"  # each head alone, or all heads of q (of k) as one (OLMo 2)
    #: how an RMSNorm applies its weight: "llama" w · bf16(x̂); "unit_offset" bf16(x̂ · (1 + w)) in fp32 (Gemma);
    #: "fp32_weight" bf16(x̂ · w) in fp32 (OLMo 2's `Olmo2RMSNorm`)
    norm_style: Literal["llama", "unit_offset", "fp32_weight"] = "llama"
    #: "pre": Llama's two pre-norms; "sandwich": Gemma's four — `post_attention_layernorm` normalises the attention
    #: output before its residual add, `pre_feedforward_layernorm` / `post_feedforward_layernorm` wrap the MLP;
    #: "post": OLMo 2's — the attention and MLP outputs normalised, their inputs not
    norm_placement: Literal["pre", "sandwich", "post"] = "pre"
    embedding_multiplier: float | None = Field(default=None, gt=0)  # embeddings × this (Gemma: √hidden_size)
    query_pre_attn_scalar: float | None = Field(default=None, gt=0)  # softmax scale 1/√this (default: head_dim)
    sliding_window: Size | None = None  # keys a `sliding_attention` layer sees: the query's and the window − 1 before
    layer_types: tuple[LayerType, ...] | None = None  # per decoder layer; None: every layer full_attention
    rope_local_theta: float | None = Field(default=None, gt=0)  # RoPE base of sliding layers (None: rope_theta)
    #: per decoder layer 1 = RoPE, 0 = none (NoPE: SmolLM3's every 4th layer; HF `no_rope_layers`); None: RoPE on all
    no_rope_layers: tuple[Literal[0, 1], ...] | None = None
    attention_multiplier: float | None = Field(default=None, gt=0)  # the softmax scale itself (Granite)
    residual_multiplier: float = Field(default=1.0, gt=0)  # each residual branch × this before its add (Granite)
    logits_scaling: float = Field(default=1.0, gt=0)  # logits ÷ this (Granite)
    attn_logit_softcapping: float | None = Field(default=None, gt=0)  # scores → cap · tanh(scores / cap) (Gemma 2)
    final_logit_softcapping: float | None = Field(default=None, gt=0)  # logits → cap · tanh(logits / cap) (Gemma 2)
    #: a learned logit per query head (`self_attn.sinks`) joins every softmax of the attention, as a key with no
    #: value would: probabilities exp(s_j) / (Σ exp(s) + exp(sink)) (gpt-oss; Xiao et al. 2023, "attention sinks")
    attn_sinks: bool = False
    bos_token_id: int | None = None
    eos_token_id: int | list[int] | None = None
    torch_dtype: str = "float32"  # dtype the checkpoint was saved in
    num_nextn_predict_layers: MtpLayers = 0  # MTP modules at model.layers.{num_hidden_layers + i}
    #: a chained MTP step reads the previous step's output after `shared_head.norm` (the released MTP layers of
    #: Qwen3.5 / Qwen3-Next and GLM-4.5, as `transformers`' MtpModel and llama.cpp chain them), not the block output
    #: (the modules `nextn train-draft` trains, which write `mtp_chain_normed: false`; `mtp_chain_hidden`)
    mtp_chain_normed: bool = False
    # Mixture of experts (`models/moe.py`; 0 experts: dense) ---------------------------------------
    num_experts: int = Field(default=0, strict=True, ge=0, le=MAX_EXPERTS)  # routed experts of an MoE layer
    num_experts_per_tok: int = Field(default=0, strict=True, ge=0, le=MAX_EXPERTS)  # top-k: experts run per token
    moe_intermediate_size: Size | None = None  # an expert's SwiGLU width
    norm_topk_prob: bool = False  # the top-k probabilities renormalised to sum to 1
    decoder_sparse_step: Size = 1  # layer i is MoE when (i + 1) % step == 0 and i is not in mlp_only_layers
    mlp_only_layers: tuple[int, ...] = ()  # decoder layers with a dense MLP (of intermediate_size)
    shared_expert_intermediate_size: Size | None = None  # Qwen2-MoE's shared expert, gated by a sigmoid
    #: "softmax": top-k of softmax(router logits); "sigmoid_grouped": DeepSeek-V3 / GLM-4.5's `noaux_tc` (sigmoid
    #: scores, `e_score_correction_bias` to choose, the best `topk_group` of `n_group` groups, × routed_scaling_factor)
    moe_router: Literal["softmax", "sigmoid_grouped"] = "softmax"
    n_group: Size = 1
    topk_group: Size = 1
    routed_scaling_factor: float = Field(default=1.0, gt=0)
    n_shared_experts: int = Field(default=0, strict=True, ge=0, le=MAX_EXPERTS)  # GLM-4.5's ungated shared experts
    mtp_moe: bool = False  # the MTP modules' MLP is the MoE one (GLM-4.5's released MTP layer), else dense
    router_bias: bool = False  # the softmax router's logits carry a bias (`mlp.gate.bias`: gpt-oss)
    #: the experts' gated unit: "swiglu" down(silu(gate) · up); "clamped_swiglu" gpt-oss's down(g · σ(alpha · g) ·
    #: (u + 1)) with g = min(gate, limit), u = clamp(up, ±limit), every projection biased (HF `GptOssExperts`)
    expert_act: Literal["swiglu", "clamped_swiglu"] = "swiglu"
    swiglu_alpha: float = Field(default=1.702, gt=0)
    swiglu_limit: float = Field(default=7.0, gt=0)
    # Gated attention and Gated DeltaNet layers (Qwen3.5 / Qwen3-Next) -----------------------------------------
    #: attention output × sigmoid(gate_proj(x)) per head dim before o_proj (HF stores gate_proj's rows inside
    #: q_proj, head by head: `Qwen3_5Attention`)
    attn_output_gate: bool = False
    linear_num_key_heads: Size | None = None  # a Gated DeltaNet layer's q / k heads
    linear_num_value_heads: Size | None = None  # its v heads (each q / k head serves value_heads / key_heads)
    linear_key_head_dim: Size | None = None
    linear_value_head_dim: Size | None = None
    linear_conv_kernel_dim: Size | None = None  # taps of its causal depthwise conv over q, k, v
    # Gemma 4 (`Gemma4ForCausalLM`, HF `modeling_gemma4.py`) ------------------------------------------------------
    global_head_dim: Size | None = None  # head_dim of the full_attention layers (None: head_dim)
    global_num_key_value_heads: Size | None = None  # their KV heads (None: num_key_value_heads)
    #: the full layers' V is their K projection (no v_proj), normalised as V (`attention_k_eq_v`)
    attention_k_eq_v: bool = False
    v_norm: bool = False  # V normalised per head by an RMSNorm without weight before caching (Gemma 4)
    #: the last N decoder layers compute no K/V: each attends to the cache of the last earlier layer of its type
    num_kv_shared_layers: int = Field(default=0, strict=True, ge=0)
    double_wide_mlp: bool = False  # those N layers' MLP is 2 · intermediate_size wide (`use_double_wide_mlp`)
    #: per-layer inputs (PLE): a per-layer embedding of width this, gated into each layer's output (0: none)
    hidden_size_per_layer_input: int = Field(default=0, strict=True, ge=0)
    vocab_size_per_layer_input: Size | None = None
    layer_scalar: bool = False  # each layer's output × a learned scalar (`model.layers.{i}.layer_scalar`)
    #: full layers' rope is "proportional" (Gemma 4): the first ⌊f · head_dim / 2⌋ pairs rotate at 1/θ^(2j/head_dim),
    #: the rest pass through (this f; None: every pair rotates as `rotary_dim` says)
    rope_proportion: float | None = Field(default=None, gt=0, le=1)

    @model_validator(mode="before")
    @classmethod
    def _defaults(cls, data: Any) -> Any:
        if isinstance(data, dict):
            data = dict(data)
            if data.get("num_key_value_heads") is None and "num_attention_heads" in data:
                data["num_key_value_heads"] = data["num_attention_heads"]
            hidden, heads = data.get("hidden_size"), data.get("num_attention_heads")
            if data.get("head_dim") is None and type(hidden) is int and type(heads) is int and heads > 0:
                data["head_dim"] = hidden // heads  # a non-int or zero is refused by the fields' own checks
        return data

    @model_validator(mode="after")
    def _check(self) -> "LlamaModelConfig":
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(f"num_attention_heads={self.num_attention_heads} is not a multiple of "
                             f"num_key_value_heads={self.num_key_value_heads}")
        if self.head_dim % 2:
            raise ValueError(f"head_dim={self.head_dim} must be even (RoPE rotates pairs)")
        rotary = self.rotary_dim or self.head_dim
        if rotary % 2 or rotary > self.head_dim:
            raise ValueError(f"rotary_dim={rotary} must be even and at most head_dim={self.head_dim}")
        if self.rope_scaling is not None and self.rope_scaling.rope_type == "longrope" and len(
                self.rope_scaling.short_factor) != rotary // 2:
            raise ValueError(f"longrope scaling lists {len(self.rope_scaling.short_factor)} factors; "
                             f"rotary_dim // 2 is {rotary // 2}")
        factors = self.rope_freq_factors
        if factors is not None:
            if len(factors) != self.head_dim // 2 or not all(f > 0 for f in factors):
                raise ValueError(f"rope_freq_factors needs head_dim // 2 = {self.head_dim // 2} positive values, got "
                                 f"{len(factors)}")
            if self.rope_scaling is not None:
                raise ValueError("rope_freq_factors and rope_scaling are two spellings of one scaling: give one")
        if self.layer_types is not None:
            if len(self.layer_types) != self.num_hidden_layers:
                raise ValueError(f"layer_types lists {len(self.layer_types)} layers; num_hidden_layers is "
                                 f"{self.num_hidden_layers}")
            if "sliding_attention" in self.layer_types and self.sliding_window is None:
                raise ValueError("layer_types has sliding_attention layers but sliding_window is not set")
            linear = (self.linear_num_key_heads, self.linear_num_value_heads, self.linear_key_head_dim,
                      self.linear_value_head_dim, self.linear_conv_kernel_dim)
            if "linear_attention" in self.layer_types and (None in linear or linear[1] % linear[0]):
                raise ValueError("layer_types has linear_attention layers: linear_num_key_heads, "
                                 "linear_num_value_heads (a multiple of the key heads), linear_key_head_dim, "
                                 "linear_value_head_dim and linear_conv_kernel_dim must be set")
        if self.num_experts and not (1 <= self.num_experts_per_tok <= self.num_experts
                                     and self.moe_intermediate_size is not None):
            raise ValueError(f"an MoE config needs 1 <= num_experts_per_tok <= num_experts ({self.num_experts}), "
                             f"got {self.num_experts_per_tok}, and moe_intermediate_size "
                             f"(got {self.moe_intermediate_size})")
        if self.num_experts and self.moe_router == "sigmoid_grouped" and (
                self.num_experts % self.n_group or self.topk_group > self.n_group
                or self.num_experts_per_tok > self.topk_group * (self.num_experts // self.n_group)):
            raise ValueError(f"routing {self.num_experts} experts in n_group={self.n_group} groups, the best "
                             f"topk_group={self.topk_group} of them, cannot choose {self.num_experts_per_tok}")
        if self.num_kv_shared_layers:
            first = self.num_hidden_layers - self.num_kv_shared_layers
            types = self.layer_types or ("full_attention",) * self.num_hidden_layers
            if first < 1 or not set(types[first:]) <= set(types[:first]) or self.linear_layers:
                raise ValueError(f"num_kv_shared_layers={self.num_kv_shared_layers}: each shared layer needs an "
                                 "earlier attention layer of its type to read the KV of")
        if self.hidden_size_per_layer_input and self.vocab_size_per_layer_input is None:
            raise ValueError("hidden_size_per_layer_input is set but vocab_size_per_layer_input is not")
        if self.no_rope_layers is not None and len(self.no_rope_layers) != self.num_hidden_layers:
            raise ValueError(f"no_rope_layers lists {len(self.no_rope_layers)} layers; num_hidden_layers is "
                             f"{self.num_hidden_layers}")
        return self

    # Derived sizes -------------------------------------------------------------------------------
    @property
    def has_qkv_bias(self) -> bool:
        """Whether q_proj, k_proj and v_proj carry biases (`attention_bias` or `qkv_bias`)."""
        return self.attention_bias or self.qkv_bias

    def is_moe_layer(self, i: int) -> bool:
        """Whether decoder layer `i` has the sparse MoE MLP (HF `Qwen3MoeDecoderLayer`'s rule); MTP layers
        (i ≥ num_hidden_layers) where `mtp_moe`."""
        if i >= self.num_hidden_layers:
            return self.num_experts > 0 and self.mtp_moe
        return (self.num_experts > 0 and i not in self.mlp_only_layers and (i + 1) % self.decoder_sparse_step == 0)

    def is_global_layer(self, i: int) -> bool:
        """Whether decoder layer `i` is a full-attention one with Gemma 4's global head shape (`global_head_dim`,
        `global_num_key_value_heads`); MTP layers are not."""
        return (i < self.num_hidden_layers and (self.global_head_dim or self.global_num_key_value_heads) is not None
                and (self.layer_types is None or self.layer_types[i] == "full_attention"))

    def layer_head_dim(self, i: int) -> int:
        """Decoder layer `i`'s head width: `global_head_dim` for a full-attention layer where set, else head_dim."""
        return (self.global_head_dim or self.head_dim) if self.is_global_layer(i) else self.head_dim

    def layer_kv_heads(self, i: int) -> int:
        """Decoder layer `i`'s KV heads: `global_num_key_value_heads` for a full-attention layer where set."""
        g = self.global_num_key_value_heads
        return (g or self.num_key_value_heads) if self.is_global_layer(i) else self.num_key_value_heads

    def is_kv_shared(self, i: int) -> bool:
        """Whether decoder layer `i` reads another layer's KV (one of the last `num_kv_shared_layers`)."""
        return self.num_hidden_layers - self.num_kv_shared_layers <= i < self.num_hidden_layers

    def kv_source(self, i: int) -> int:
        """The decoder layer whose KV cache layer `i` attends to: `i` itself, or for one of the last
        `num_kv_shared_layers` layers the last earlier unshared layer of its type (HF `kv_sharing_modes`)."""
        first = self.num_hidden_layers - self.num_kv_shared_layers
        if i < first or i >= self.num_hidden_layers:
            return i
        types = self.layer_types or ("full_attention",) * self.num_hidden_layers
        return max(j for j in range(first) if types[j] == types[i])

    @property
    def kv_cache_dim(self) -> int:
        """Values cached per token per cache row: K then V of every KV head, 2 · num_key_value_heads · head_dim (with
        per-layer widths, Gemma 4's, the widest layer's: narrower layers share rows, `kv_cache_layout`)."""
        return max(2 * self.layer_kv_heads(i) * self.layer_head_dim(i) for i in range(self.num_hidden_layers))

    @property
    def kv_cache_layout(self) -> tuple[tuple[int, int], ...] | None:
        """Per decoder layer, (its cache row, the row's first column of its K and V), where layers of different
        widths share rows: each attention layer that computes KV takes the first row with room for it, in layer
        order (Gemma 4 E2B: two sliding layers' 512 values in one 1,024-wide row, a full layer's row to itself — 3
        rows for its first 5 layers instead of 5); a KV-shared layer its source's place, a linear-attention layer
        row −1. None where every layer is as wide as a row (one row a layer, in order)."""
        own = [i for i in range(self.num_hidden_layers) if i not in self.linear_layers and not self.is_kv_shared(i)]
        width = {i: 2 * self.layer_kv_heads(i) * self.layer_head_dim(i) for i in own}
        row_width = self.kv_cache_dim
        if all(w == row_width for w in width.values()):
            return None
        used: list[int] = []  # columns taken in each row
        place: dict[int, tuple[int, int]] = {}
        for i in own:
            row = next((r for r, u in enumerate(used) if row_width - u >= width[i]), len(used))
            if row == len(used):
                used.append(0)
            place[i] = (row, used[row])
            used[row] += width[i]
        return tuple((-1, 0) if i in self.linear_layers else place[self.kv_source(i)]
                     for i in range(self.num_hidden_layers))

    @property
    def softmax_scale(self) -> float:
        if self.attention_multiplier is not None:
            return self.attention_multiplier
        return (self.query_pre_attn_scalar or self.head_dim) ** -0.5

    @property
    def linear_layers(self) -> tuple[int, ...]:
        """The decoder layers that are Gated DeltaNet layers (no KV cache: a recurrent state per request)."""
        return tuple(i for i, t in enumerate(self.layer_types or ()) if t == "linear_attention")

    @property
    def num_cache_layers(self) -> int:
        """KV-cache rows: the attention decoder layers' (fewer where narrow layers share rows: `kv_cache_layout`),
        then the MTP layers'."""
        layout = self.kv_cache_layout
        rows = (self.num_hidden_layers - len(self.linear_layers) - self.num_kv_shared_layers if layout is None
                else 1 + max(r for r, _ in layout))
        return rows + self.num_nextn_predict_layers

    @property
    def has_sliding_layers(self) -> bool:
        return "sliding_attention" in (self.layer_types or ())

    @property
    def layer_cache_rows(self) -> tuple[int, ...]:
        """Per decoder layer its KV-cache row: −1 for a linear-attention layer, a KV-shared layer its source's,
        the row `kv_cache_layout` gives where narrow layers share rows, else the next row in layer order."""
        if (layout := self.kv_cache_layout) is not None:
            return tuple(r for r, _ in layout)
        rows: list[int] = []
        n = 0
        for i in range(self.num_hidden_layers):
            rows.append(-1 if i in self.linear_layers else rows[self.kv_source(i)] if self.is_kv_shared(i) else n)
            n += i not in self.linear_layers and not self.is_kv_shared(i)
        return tuple(rows)

    @property
    def sliding_cache_rows(self) -> tuple[int, ...]:
        """The KV-cache rows that only sliding-window layers read (runtime/sliding_blocks.py); empty where every
        layer slides (the block table itself releases blocks there) or none does."""
        types = self.layer_types or ("full_attention",) * self.num_hidden_layers
        pairs = [(r, t == "sliding_attention") for r, t in zip(self.layer_cache_rows, types) if r >= 0]
        sliding = {r for r, s in pairs if s} - {r for r, s in pairs if not s}
        return tuple(sorted(sliding)) if len(sliding) < len({r for r, _ in pairs}) else ()

    @property
    def layer_input_keys(self) -> tuple[str, ...] | None:
        """Per decoder layer, the `attention_inputs` entry it reads: its layer type, with ":nope" for a NoPE layer;
        None where every layer is a full-attention RoPE one."""
        if not self.has_sliding_layers and not self.linear_layers and 0 not in (self.no_rope_layers or ()):
            return None
        types = self.layer_types or ("full_attention",) * self.num_hidden_layers
        ropes = self.no_rope_layers or (1,) * self.num_hidden_layers
        return tuple(t if r else f"{t}:nope" for t, r in zip(types, ropes))

    # Loading -------------------------------------------------------------------------------------
    @classmethod
    def from_hf(cls, hf: dict[str, Any]) -> "LlamaModelConfig":
        """Normalise an HF `config.json` dict (either rope spelling).

        Raises:
            ConfigError: unsupported architecture/model_type or rope type, a missing required field, or an invalid
                value; the message names the field.
        """
        archs = hf.get("architectures") or []
        model_types = {t: a for a, t in LLAMA_ARCHITECTURES.items()}
        arch = archs[0] if archs else model_types.get(hf.get("model_type"))
        if arch not in LLAMA_ARCHITECTURES:
            raise ConfigError(f"unsupported architecture {arch or hf.get('model_type')!r}: the Llama family reads "
                              + ", ".join(f"{a} (model_type {t!r})" for a, t in LLAMA_ARCHITECTURES.items()))
        options = family_options(arch, hf)
        skip = ("architecture", "torch_dtype", *options)
        fields: dict[str, Any] = {k: hf[k] for k in cls.model_fields if k not in skip and hf.get(k) is not None}
        fields.update({k: v for k, v in options.items() if v is not None})
        required = ["vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads"]
        missing = [k for k in required if k not in fields]
        if missing:
            raise ConfigError(f"config lacks required field(s) {missing} for a {arch} checkpoint")
        fields["torch_dtype"] = str(hf.get("dtype") or hf.get("torch_dtype") or "float32").removeprefix("torch.")
        fields["architecture"] = arch
        try:
            return cls(**fields)
        except ValueError as e:  # pydantic.ValidationError is a ValueError
            raise ConfigError(f"invalid {arch} config: {e}") from e

