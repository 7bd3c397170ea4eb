"""The normalised DeepSeek-V3 model configuration, read from either spelling of an HF `config.json`.

Two spellings occur in the wild and both load (deepseek-ai/DeepSeek-V3's config.json):
- DeepSeek's release: `rope_theta` + `rope_scaling: {type: yarn, ...}`, `torch_dtype`;
- what `transformers` 5 writes: `rope_parameters: {rope_type: yarn, rope_theta, ...}`, `dtype`.
`DeepseekV3ModelConfig.from_hf` maps both onto one frozen pydantic model that the engine manifest stores
and the runtime builds its modules from. Fields keep the HF names.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from nextn.models import yarn

SUPPORTED_ARCHITECTURES = ("DeepseekV3ForCausalLM",)
#: Architectures read as DeepSeek-V3 (`_glm4_moe_lite`)
GLM_LITE = ("Glm4MoeLiteForCausalLM",)
#: Most decoder layers (main or MTP) a config may declare; the largest released models have ~130. Every layer count
#: is also checked against the layers a checkpoint stores (`nextn.build.tensor_inventory`).
MAX_LAYERS = 1024
#: Most routed experts a config may declare (DeepSeek-V3: 256; Kimi-K2: 384); each is a tensor read at build time.
MAX_EXPERTS = 1 << 16
#: Largest count or size a GGUF header may state (an int32); in a config, sizes are bounded by the stored tensors'
#: shapes and the checkpoint's bytes at build time (`build.weight_checks`).
MAX_SIZE = 2**31 - 1

#: A width, head count or vocabulary of at least 1: a Python/JSON int (a bool, float or string is refused, not
#: coerced).
Size = Annotated[int, Field(strict=True, ge=1)]
#: A number of decoder layers (main ones: at least 1).
Layers = Annotated[int, Field(strict=True, ge=1, le=MAX_LAYERS)]
#: A number of MTP modules (0: none).
MtpLayers = Annotated[int, Field(strict=True, ge=0, le=MAX_LAYERS)]


class ConfigError(ValueError):
    """A checkpoint's `config.json` is missing a field or holds an unsupported value."""


class RopeConfig(BaseModel):
    """RoPE on the `qk_rope_head_dim` dims, optionally YaRN-scaled (HF `modeling_rope_utils._compute_yarn_parameters`)."""

    model_config = ConfigDict(frozen=True, extra="forbid", allow_inf_nan=False)

    rope_type: Literal["default", "yarn"] = "default"
    rope_theta: float = Field(default=10000.0, gt=0)
    factor: float | None = None  # YaRN context-extension factor (V3: 40)
    beta_fast: float = 32.0  # YaRN ramp boundary, in rotations (extrapolation side)
    beta_slow: float = 1.0  # YaRN ramp boundary, in rotations (interpolation side)
    mscale: float | None = None  # numerator of the cos/sin attention factor
    mscale_all_dim: float | None = None  # also scales the softmax by mscale(factor, mscale_all_dim)**2
    original_max_position_embeddings: int | None = None  # pre-training context (V3: 4096)
    attention_factor: float | None = None  # explicit cos/sin factor; inferred from mscale when null
    truncate: bool = True  # floor/ceil the YaRN correction range, as HF does by default


class DeepseekV3ModelConfig(BaseModel):
    """DeepSeek-V3 hyper-parameters (HF field names, as deepseek-ai/DeepSeek-V3's config.json has them)."""

    model_config = ConfigDict(frozen=True, extra="forbid", allow_inf_nan=False)

    architecture: Literal["DeepseekV3ForCausalLM"] = "DeepseekV3ForCausalLM"
    vocab_size: Size
    hidden_size: Size
    intermediate_size: Size  # dense-MLP width (first_k_dense_replace layers)
    moe_intermediate_size: Size  # width of each routed / shared expert
    num_hidden_layers: Layers
    num_attention_heads: Size
    q_lora_rank: Size | None = None  # null: q_proj is a plain Linear
    kv_lora_rank: Size  # width of the cached latent c_kv
    qk_nope_head_dim: Size
    qk_rope_head_dim: Size  # one rope key head shared by all heads
    v_head_dim: Size
    rms_norm_eps: float = Field(default=1e-6, gt=0)
    # null: every layer is dense
    n_routed_experts: Annotated[int, Field(strict=True, ge=1, le=MAX_EXPERTS)] | None = None
    n_shared_experts: Annotated[int, Field(strict=True, ge=0, le=MAX_EXPERTS)] = 0
    num_experts_per_tok: Size = 1  # top-k routed experts per token
    n_group: Size = 1  # expert groups for group-limited routing
    topk_group: Size = 1  # groups kept per token
    # layers below this index use the dense MLP
    first_k_dense_replace: Annotated[int, Field(strict=True, ge=0, le=MAX_LAYERS)] = 0
    moe_layer_freq: Size = 1  # every moe_layer_freq-th layer (after the dense ones) is MoE
    norm_topk_prob: bool = True  # renormalise the top-k sigmoid scores to sum 1
    routed_scaling_factor: float = 1.0  # multiplies routed-expert weights (V3: 2.5)
    scoring_func: Literal["sigmoid"] = "sigmoid"
    topk_method: Literal["noaux_tc"] = "noaux_tc"
    hidden_act: Literal["silu"] = "silu"
    rope: RopeConfig = RopeConfig()
    rope_interleave: bool = True  # rope dims stored as adjacent pairs (DeepSeek's layout)
    max_position_embeddings: Size = 4096
    num_nextn_predict_layers: MtpLayers = 0  # MTP modules stored after the main layers
    tie_word_embeddings: bool = False
    attention_bias: bool = False
    bos_token_id: int | None = None
    eos_token_id: int | list[int] | None = None
    torch_dtype: str = "float32"  # dtype the checkpoint was saved in

    @model_validator(mode="after")
    def _check(self) -> "DeepseekV3ModelConfig":
        if self.n_routed_experts is not None:
            if self.n_routed_experts % self.n_group:
                raise ValueError(f"n_routed_experts={self.n_routed_experts} is not divisible by n_group={self.n_group}")
            if not 1 <= self.topk_group <= self.n_group:
                raise ValueError(f"topk_group={self.topk_group} must be in [1, n_group={self.n_group}]")
            if self.num_experts_per_tok > self.n_routed_experts:
                raise ValueError("num_experts_per_tok exceeds n_routed_experts")
            per_group = self.n_routed_experts // self.n_group
            if self.topk_group * per_group < self.num_experts_per_tok:
                raise ValueError("topk_group groups hold fewer experts than num_experts_per_tok")
        if self.qk_rope_head_dim % 2:
            raise ValueError("qk_rope_head_dim must be even")
        return self

    # Derived sizes -------------------------------------------------------------------------------
    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    @property
    def kv_cache_dim(self) -> int:
        """Values cached per token per layer by absorbed MLA: c_kv and the roped key (576 for V3)."""
        return self.kv_lora_rank + self.qk_rope_head_dim

    @property
    def num_mtp_layers(self) -> int:
        return self.num_nextn_predict_layers

    def is_moe_layer(self, layer_idx: int) -> bool:
        """Whether decoder layer `layer_idx` (MTP layers included) has a MoE MLP."""
        return (
            self.n_routed_experts is not None
            and layer_idx >= self.first_k_dense_replace
            and layer_idx % self.moe_layer_freq == 0
        )

    @property
    def softmax_scale(self) -> float:
        """qk_head_dim**-0.5, times mscale(factor, mscale_all_dim)**2 under YaRN (0.135234 for V3)."""
        scale = self.qk_head_dim**-0.5
        r = self.rope
        if r.rope_type == "yarn" and r.mscale_all_dim:
            m = yarn.mscale(r.factor or 1.0, r.mscale_all_dim)
            scale *= m * m
        return scale

    # Loading -------------------------------------------------------------------------------------
    @classmethod
    def from_hf(cls, hf: dict[str, Any]) -> "DeepseekV3ModelConfig":
        """Normalise an HF `config.json` dict (either spelling).

        Raises:
            ConfigError: unsupported architecture/model_type, a missing required field, or an invalid value;
                the message names the field.
        """
        archs = hf.get("architectures") or []
        model_type = hf.get("model_type")
        arch = archs[0] if archs else None
        if arch in GLM_LITE or model_type == "glm4_moe_lite":
            hf = _glm4_moe_lite(hf)
        elif arch not in SUPPORTED_ARCHITECTURES and model_type != "deepseek_v3":
            raise ConfigError(
                f"unsupported architecture {arch or model_type!r}: nextn builds "
                f"{', '.join(SUPPORTED_ARCHITECTURES)} (model_type 'deepseek_v3')"
            )
        fields: dict[str, Any] = {"architecture": "DeepseekV3ForCausalLM"}
        for name in cls.model_fields:
            if name in ("architecture", "rope", "torch_dtype", "num_nextn_predict_layers"):
                continue
            if name in hf and hf[name] is not None:
                fields[name] = hf[name]
            elif name in ("q_lora_rank", "n_routed_experts") and name in hf:
                fields[name] = None
        required = [
            "vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
            "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim",
        ]  # fmt: skip
        missing = [k for k in required if k not in fields]
        if missing:
            raise ConfigError(f"config.json lacks required field(s) {missing} for a DeepSeek-V3 checkpoint")
        fields.setdefault("moe_intermediate_size", fields["intermediate_size"])
        mtp = hf.get("num_nextn_predict_layers", hf.get("num_mtp_layers"))
        fields["num_nextn_predict_layers"] = 0 if mtp is None else mtp
        fields["torch_dtype"] = str(hf.get("dtype") or hf.get("torch_dtype") or "float32").removeprefix("torch.")
        fields["rope"] = _rope_from_hf(hf)
        try:
            return cls(**fields)
        except ValueError as e:  # pydantic.ValidationError is a ValueError
            raise ConfigError(f"invalid DeepSeek-V3 config.json: {e}") from e


def _glm4_moe_lite(hf: dict[str, Any]) -> dict[str, Any]:
    """GLM-4.7-Flash (`Glm4MoeLiteForCausalLM`, HF `Glm4MoeLiteConfig`) as the DeepSeek-V3 config it is: the same
    layer (MLA, sigmoid group-limited routing, shared experts, DeepSeek-style MTP layers), the dense layers named by
    `mlp_layer_types` (dense ones first) instead of `first_k_dense_replace`.

    Raises:
        ConfigError: `mlp_layer_types` with a dense layer after a sparse one.
    """
    types = hf.get("mlp_layer_types")
    layers = hf.get("num_hidden_layers")
    if types is None and type(layers) is int:
        types = ["dense"] + ["sparse"] * (layers - 1)
    dense = 0
    for t in types or ():
        if t != "dense":
            break
        dense += 1
    if any(t != "sparse" for t in (types or ())[dense:]):
        raise ConfigError(f"Glm4MoeLiteForCausalLM: mlp_layer_types {types} has a dense layer after a sparse one")
    return {**hf, "first_k_dense_replace": dense, "architectures": ["DeepseekV3ForCausalLM"]}


def _rope_from_hf(hf: dict[str, Any]) -> RopeConfig:
    """Read `rope_parameters` (transformers 5) or `rope_scaling` + `rope_theta` (DeepSeek's release)."""
    params = dict(hf.get("rope_parameters") or hf.get("rope_scaling") or {})
    theta = params.pop("rope_theta", None) or hf.get("rope_theta") or 10000.0
    rope_type = params.pop("rope_type", None) or params.pop("type", None) or "default"
    if rope_type not in ("default", "yarn"):
        raise ConfigError(f"unsupported rope type {rope_type!r}: nextn supports 'default' and 'yarn'")
    keep = {k: v for k, v in params.items() if k in RopeConfig.model_fields and v is not None}
    if rope_type == "yarn":
        if keep.get("factor") is None:
            raise ConfigError("YaRN rope scaling needs 'factor' in rope_scaling/rope_parameters")
        keep.setdefault("original_max_position_embeddings", hf.get("max_position_embeddings", 4096))
    return RopeConfig(rope_type=rope_type, rope_theta=float(theta), **keep)
