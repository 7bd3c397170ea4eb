"""Tiny DeepSeek-V3 checkpoints with MTP layers, written inside the tests of `nextn.build` (for these tests only).

`make_ckpt(name, **options)` writes a checkpoint directory the way real ones look:
- the main model comes from `transformers` `DeepseekV3ForCausalLM(cfg).save_pretrained` (per-expert tensor names);
- MTP module i is layer N+i of a second HF model with N+K layers (its saved per-expert tensors), plus the MTP-only
  tensors `enorm`, `hnorm`, `eh_proj`, `shared_head.norm` and the copies `embed_tokens` / `shared_head.head`
  (REFERENCE.md §2), because `save_pretrained` never writes MTP weights;
- options: config spelling (transformers 5 or DeepSeek's release), one file or two shards with an index, block-FP8
  quantization of the 2-D projection weights, tokenizer files.
"""

from __future__ import annotations

import json
import tempfile
from dataclasses import dataclass, field
from functools import lru_cache
from pathlib import Path
from typing import Any, Callable

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import DeepseekV3Config, DeepseekV3ForCausalLM

from nextn.build.fp8 import quantize_block_fp8

NUM_LAYERS = 3
HIDDEN = 64
SHARD_NAMES = ("model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors")
TOKENIZER_CONTENT = {
    "tokenizer.json": '{"version": "1.0", "model": {"type": "WordLevel", "vocab": {"<unk>": 0}}}\n',
    "tokenizer_config.json": '{"model_max_length": 512}\n',
    "special_tokens_map.json": '{"eos_token": "<unk>"}\n',
}


def tiny_hf_config(num_layers: int = NUM_LAYERS, q_lora_rank: int | None = 48) -> DeepseekV3Config:
    """vocab 256, hidden 64, layer 0 dense, 8 routed experts in 2 groups, MLA ranks 48/32, rope dims 8/16/16."""
    return DeepseekV3Config(
        vocab_size=256, hidden_size=HIDDEN, intermediate_size=128, moe_intermediate_size=32,
        num_hidden_layers=num_layers, num_attention_heads=4, num_key_value_heads=4, first_k_dense_replace=1,
        n_routed_experts=8, n_shared_experts=1, num_experts_per_tok=2, n_group=2, topk_group=1,
        kv_lora_rank=32, q_lora_rank=q_lora_rank, qk_rope_head_dim=8, qk_nope_head_dim=16, v_head_dim=16,
        max_position_embeddings=4096,
    )  # fmt: skip


def _saved(model: DeepseekV3ForCausalLM) -> tuple[dict[str, torch.Tensor], dict[str, Any], dict[str, str]]:
    """save_pretrained's tensors (per-expert names), config.json and generation_config.json of `model`."""
    with tempfile.TemporaryDirectory() as d:
        model.save_pretrained(d)
        tensors = load_file(str(Path(d) / "model.safetensors"))
        config = json.loads((Path(d) / "config.json").read_text())
        side = {p.name: p.read_text() for p in Path(d).glob("generation_config.json")}
    return tensors, config, side


@lru_cache(maxsize=None)
def _source(
    num_mtp: int, q_lora_rank: int | None, seed: int
) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor], dict[str, Any], dict[str, str]]:
    """(checkpoint tensors, main model's in-memory state dict, config.json, side files); cached per options."""
    torch.manual_seed(seed)
    main = DeepseekV3ForCausalLM(tiny_hf_config(NUM_LAYERS, q_lora_rank))
    # Random (not 1/0) norms and router bias, so a mix-up between tensors shows in the values.
    with torch.no_grad():
        for name, p in main.named_parameters():
            if p.dim() == 1:
                p.copy_(1.0 + 0.1 * torch.randn_like(p))
        for mod in main.modules():
            if hasattr(mod, "e_score_correction_bias"):
                mod.e_score_correction_bias.copy_(0.01 * torch.randn_like(mod.e_score_correction_bias))
    tensors, config, side = _saved(main)
    in_memory = {k: v.detach().clone() for k, v in main.state_dict().items()}
    if num_mtp:
        torch.manual_seed(seed + 1)
        donor_tensors, _, _ = _saved(DeepseekV3ForCausalLM(tiny_hf_config(NUM_LAYERS + num_mtp, q_lora_rank)))
        for i in range(num_mtp):
            p = f"model.layers.{NUM_LAYERS + i}."
            tensors.update({k: v for k, v in donor_tensors.items() if k.startswith(p)})
            tensors[p + "enorm.weight"] = 1.0 + 0.1 * torch.randn(HIDDEN)
            tensors[p + "hnorm.weight"] = 1.0 + 0.1 * torch.randn(HIDDEN)
            tensors[p + "shared_head.norm.weight"] = 1.0 + 0.1 * torch.randn(HIDDEN)
            tensors[p + "eh_proj.weight"] = 0.02 * torch.randn(HIDDEN, 2 * HIDDEN)
            tensors[p + "embed_tokens.weight"] = tensors["model.embed_tokens.weight"].clone()
            tensors[p + "shared_head.head.weight"] = tensors["lm_head.weight"].clone()
    config["num_nextn_predict_layers"] = num_mtp
    return tensors, in_memory, config, side


def is_fp8_target(name: str, t: torch.Tensor) -> bool:
    """The tensors DeepSeek's FP8 release quantizes: 2-D `*_proj.weight` except `eh_proj` (norms, router, embedding,
    lm_head stay unquantized)."""
    return t.dim() == 2 and name.endswith("_proj.weight") and not name.endswith("eh_proj.weight")


@dataclass
class TinyCheckpoint:
    """A checkpoint written by `make_ckpt`.

    tensors: HF name → fp32 tensor as generated (before any FP8 quantization), MTP tensors included.
    in_memory: the main HF model's state dict (fused experts `mlp.experts.gate_up_proj` [E, 2I, H]).
    dequantized: for FP8 checkpoints, HF name → the exact dequantized fp32 value of each quantized tensor.
    """

    path: Path
    tensors: dict[str, torch.Tensor]
    in_memory: dict[str, torch.Tensor]
    config: dict[str, Any]
    num_mtp: int
    files: list[Path] = field(default_factory=list)
    dequantized: dict[str, torch.Tensor] = field(default_factory=dict)
    fp8_block: tuple[int, int] = (128, 128)


def write_checkpoint(
    path: Path,
    *,
    num_mtp: int = 1,
    q_lora_rank: int | None = 48,
    spelling: str = "transformers",
    sharded: bool = False,
    fp8: bool = False,
    fp8_block: tuple[int, int] = (128, 128),
    tokenizer: bool = False,
    seed: int = 0,
    drop: tuple[str, ...] = (),
    replace: dict[str, torch.Tensor] | None = None,
    config_update: dict[str, Any] | None = None,
) -> TinyCheckpoint:
    """Write a tiny DeepSeek-V3 checkpoint directory at `path` (see the module docstring).

    spelling: "transformers" (rope_parameters, dtype) or "deepseek" (rope_theta + rope_scaling {type: yarn},
        torch_dtype).
    drop / replace: tensors to leave out / overwrite in the written files (for error tests).
    """
    src, in_memory, config, side = _source(num_mtp, q_lora_rank, seed)
    tensors = dict(src)
    config = json.loads(json.dumps(config))
    if spelling == "deepseek":
        config.pop("rope_parameters", None)
        config.pop("dtype", None)
        config["rope_theta"] = 10000.0
        config["rope_scaling"] = {"type": "yarn", "factor": 4.0, "beta_fast": 32, "beta_slow": 1, "mscale": 1.0,
                                  "mscale_all_dim": 1.0, "original_max_position_embeddings": 1024}
        config["torch_dtype"] = "bfloat16"
    elif spelling != "transformers":
        raise ValueError(spelling)
    stored = {k: v for k, v in tensors.items() if k not in drop}
    stored.update(replace or {})
    dequantized = {}
    if fp8:
        config["quantization_config"] = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                                         "weight_block_size": list(fp8_block)}
        for name in [n for n, t in stored.items() if is_fp8_target(n, t)]:
            q, s = quantize_block_fp8(stored[name], fp8_block)
            stored[name], stored[name + "_scale_inv"] = q, s
            bm, bn = fp8_block
            per_elem = s.repeat_interleave(bm, 0)[: q.shape[0]].repeat_interleave(bn, 1)[:, : q.shape[1]]
            dequantized[name] = q.float() * per_elem
    config.update(config_update or {})

    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    for name, text in side.items():
        (path / name).write_text(text)
    if tokenizer:
        for name, text in TOKENIZER_CONTENT.items():
            (path / name).write_text(text)
    files = []
    if sharded:
        mtp_prefixes = tuple(f"model.layers.{NUM_LAYERS + i}." for i in range(num_mtp))
        names = sorted(stored)
        if num_mtp:
            second = {n for n in names if n.startswith(mtp_prefixes)}
        else:
            second = {n for n in names[len(names) // 2:] if not n.endswith("_scale_inv")}
        second |= {n + "_scale_inv" for n in second if n + "_scale_inv" in stored}
        weight_map = {n: SHARD_NAMES[1] if n in second else SHARD_NAMES[0] for n in names}
        for shard in SHARD_NAMES:
            save_file({n: stored[n] for n in names if weight_map[n] == shard}, str(path / shard),
                      metadata={"format": "pt"})
            files.append(path / shard)
        total = sum(t.numel() * t.element_size() for t in stored.values())
        index = {"metadata": {"total_size": total}, "weight_map": weight_map}
        (path / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")
    else:
        save_file(stored, str(path / "model.safetensors"), metadata={"format": "pt"})
        files.append(path / "model.safetensors")
    return TinyCheckpoint(path, tensors, in_memory, config, num_mtp, files, dequantized, tuple(fp8_block))


@pytest.fixture
def make_ckpt(tmp_path: Path) -> Callable[..., TinyCheckpoint]:
    """`make_ckpt(name="ckpt", **write_checkpoint options)` → a TinyCheckpoint under this test's tmp_path."""

    def make(name: str = "ckpt", **options: Any) -> TinyCheckpoint:
        return write_checkpoint(tmp_path / name, **options)

    return make


@pytest.fixture
def write_yaml(tmp_path: Path) -> Callable[[str, str], Path]:
    """`write_yaml(text, name="llm_args.yaml")` → path of a YAML file under tmp_path."""

    def write(text: str, name: str = "llm_args.yaml") -> Path:
        p = tmp_path / name
        p.write_text(text)
        return p

    return write

