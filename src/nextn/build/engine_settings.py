"""What an engine build decides from the checkpoint and the build options before it writes anything: the checkpoint
reader, the engine dtype, the manifest's speculative section (MTP or Medusa) and the weight-only quantization plan,
with the refusals that go with them (an explicit max_seq_len above the model's, MTP asked for but absent, a bad
quantization option), each an `EngineError` naming the option. `engine_builder.build_engine` uses them in turn.
"""

from __future__ import annotations

import logging
import math
from pathlib import Path
from typing import Any

import torch

from nextn.build.checkpoint import CONFIG_NAME, CheckpointReader
from nextn.build.gguf_reader import GGUFCheckpoint
from nextn.build.manifest import EngineError, SpeculativeInfo
from nextn.build.medusa_heads import MedusaHeadsCheckpoint
from nextn.config.llm_args import LlmArgs
from nextn.models.deepseek_v3.weights import layer_prefix
from nextn.models.registry import MODEL_CLASSES, ModelConfig
from nextn.plugins import cpu_kernels
from nextn.plugins.cpu_features import fast_bf16
from nextn.quantization import kernel_layout
from nextn.quantization.weight_only import (
    INT4_ALGOS, QUANT_ALGOS, QuantConfig, QuantError, default_group_size, linear_weight_names, quantized_specs,
)  # fmt: skip

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
#: PyTorch's CPU int4 packing (`_convert_weight_to_int4pack_for_cpu`) takes weights whose rows are a multiple of 16.
INT4_ROWS = 16
logger = logging.getLogger(__name__)


def open_checkpoint(model_dir: Path) -> CheckpointReader | GGUFCheckpoint:
    """A GGUF reader for a `.gguf` file or a directory holding one and no config.json; else the HF reader."""
    if model_dir.suffix == ".gguf" or (model_dir.is_dir() and not (model_dir / CONFIG_NAME).exists()
                                       and any(model_dir.glob("*.gguf"))):
        return GGUFCheckpoint(model_dir)
    return CheckpointReader(model_dir)


#: `quant_algo="auto"` quantizes a GGUF whose decoder matrices are at least this share 4-bit (`auto_quant_algo`).
AUTO_W4_MIN_SHARE = 0.5


def auto_quant_algo(reader: CheckpointReader | GGUFCheckpoint, device_type: str | None = None) -> str | None:
    """What `quant_algo="auto"` (the default of `build-engine`, `LLM(checkpoint)` and `nextn generate --model`)
    builds: the int4 format fastest on this CPU's kernels (`woq_linear.fastest_int4_algo`: **W4A16** on
    `avx512_bf16`, **W4A8** on the variants without bf16 dot products) for a GGUF whose decoder matrices are mostly
    4-bit (`GGUFCheckpoint.four_bit_share` ≥ `AUTO_W4_MIN_SHARE`: Q4_0, Q4_1, Q4_K_M, ...) or whose file type is a
    4-bit one (`declares_four_bit`: a Q4_K_M whose odd-width rows llama.cpp stored as Q5_0) — or an HF checkpoint
    whose matrices are mostly MXFP4 (gpt-oss's release: `CheckpointReader.four_bit_share`) — when the engine runs on a
    CPU where nextn's int4 kernels load (`plugins/woq_linear.available()`) and takes every decoder linear's shape,
    else None (the linears stay in the engine dtype).

    Why: the file's 4-bit values are read as they are (one- or two-level scales, `quantization/weight_only.py`),
    nextn's kernels are the fast path, and they compute every row alone, so outputs do not depend on what shares the
    batch (docs/performance-history.md, "Batch invariance by default"). W4A16 keeps bf16 activations where bf16 pairs
    multiply natively; elsewhere W4A8's integer dot products (activations quantized per group of 32 or per
    super-block, llama.cpp's CPU numerics) are ~2x faster than bf16 widened to f32.
    Args:
        device_type: "cpu" or "cuda" (None: CUDA when available), where the engine will run.
    """
    from nextn.plugins import woq_linear

    device_type = device_type or ("cuda" if torch.cuda.is_available() else "cpu")
    if device_type != "cpu" or (reader.four_bit_share < AUTO_W4_MIN_SHARE and not reader.declares_four_bit):
        return None
    if not woq_linear.available():
        logger.info("quant_algo auto: nextn's int4 CPU kernels are unavailable here (%s); the linears stay in the "
                    "engine dtype", woq_linear.unavailable_reason())
        return None
    cfg = reader.model_config
    with torch.device("meta"):
        model = MODEL_CLASSES[cfg.architecture](cfg, max_positions=1)
    shapes = {(m.out_features, m.in_features) for name, m in model.named_modules()
              if name.startswith("model.layers.") and isinstance(m, torch.nn.Linear)}
    odd = sorted(s for s in shapes if not woq_linear.takes("W4A16", *s))
    if odd:
        logger.info("quant_algo auto: the int4 kernel does not take the [out, in] shapes %s; the linears stay in the "
                    "engine dtype", odd)
        return None
    algo = woq_linear.fastest_int4_algo()
    logger.info("quant_algo auto: %s (nextn's %s CPU kernels)", algo, cpu_kernels.variant())
    return algo


def medusa_speculative(heads: MedusaHeadsCheckpoint, llm_args: LlmArgs | None) -> SpeculativeInfo:
    """The manifest's speculative section for an engine with Medusa heads (the tree is chosen at load time)."""
    spec = llm_args.speculative_config if llm_args is not None else None
    if spec is not None and spec.decoding_type != "Medusa":
        raise EngineError(f"--medusa_model_dir was given but speculative_config asks for {spec.decoding_type}")
    n = spec.num_medusa_heads if spec is not None and spec.num_medusa_heads else heads.num_heads
    if n > heads.num_heads:
        raise EngineError(f"num_medusa_heads={n} but {heads.source} holds {heads.num_heads} heads")
    return SpeculativeInfo(method="medusa", num_medusa_heads=heads.num_heads, medusa_num_layers=heads.num_layers,
                           max_draft_len=n)


def resolve_dtype(dtype: str, cfg: ModelConfig, is_fp8: bool, is_quantized: bool = False) -> str:
    """The engine dtype: `dtype` unless "auto"; auto = checkpoint `torch_dtype`, FP8 checkpoints → bfloat16,
    block-quantized GGUFs (no float dtype to keep) → bfloat16 where bf16 matmuls are fast here (CUDA, or a CPU with
    bf16 instructions: `plugins.cpu_features.fast_bf16`), else float32."""
    if dtype != "auto":
        return dtype
    if is_fp8:
        return "bfloat16"
    if is_quantized:
        device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
        return "bfloat16" if fast_bf16(device) else "float32"
    if cfg.torch_dtype not in DTYPES:
        raise EngineError(f"cannot derive the engine dtype from the checkpoint's torch_dtype {cfg.torch_dtype!r}; "
                          f"pass --dtype ({', '.join(DTYPES)})")
    return cfg.torch_dtype


def resolve_speculative(
    cfg: ModelConfig, yaml_data: dict[str, Any] | None, llm_args: LlmArgs | None, model_dir: Path
) -> SpeculativeInfo:
    """The manifest's speculative section from the checkpoint's MTP module count and the YAML's speculative_config.

    Raises:
        EngineError: the YAML asks for MTP but the checkpoint has no MTP layers, or asks for MTP Vanilla with more
            draft tokens than the checkpoint has modules.
    """
    modules = cfg.num_nextn_predict_layers
    if yaml_data is None or "speculative_config" not in yaml_data:
        if modules == 0:
            return SpeculativeInfo()
        return SpeculativeInfo(method="mtp", num_mtp_modules=modules, max_draft_len=modules,
                               use_mtp_vanilla=modules > 1)
    spec = llm_args.speculative_config if llm_args is not None else None
    if spec is None:
        return SpeculativeInfo(method="none", num_mtp_modules=modules)
    if spec.decoding_type not in ("MTP",):
        # drafters that need no weights in this engine (NGram, Draft_Target): chosen at load time from the YAML
        # kept in build_options (speculative/registry.py default_config)
        return SpeculativeInfo(method="none", num_mtp_modules=modules)
    if modules == 0:
        raise EngineError(f"speculative_config asks for decoding_type {spec.decoding_type} but checkpoint {model_dir} "
                          "has no MTP layers (num_nextn_predict_layers is 0 in its config.json); set "
                          "speculative_config: null or use a checkpoint with MTP weights")
    k = spec.num_nextn_predict_layers
    vanilla = spec.use_mtp_vanilla or modules > 1
    if vanilla and k > modules:
        raise EngineError(f"MTP Vanilla drafts token k with module k, so num_nextn_predict_layers={k} needs {k} MTP "
                          f"modules but checkpoint {model_dir} has {modules}; lower it or use MTP Eagle "
                          "(use_mtp_vanilla: false with a one-module checkpoint)")
    return SpeculativeInfo(method="mtp", num_mtp_modules=modules, max_draft_len=k, use_mtp_vanilla=vanilla)


def check_seq_len(value: int, what: str, cfg: ModelConfig) -> None:
    """Refuse a max_seq_len (`what` names where it came from) above the model's max_position_embeddings."""
    if value > cfg.max_position_embeddings:
        raise EngineError(f"{what} {value} exceeds the model's max_position_embeddings "
                          f"{cfg.max_position_embeddings} (config.json)")


def check_mtp_layers(
    reader: CheckpointReader, cfg: ModelConfig, drop_if_absent: bool, names: list[str] | None = None
) -> ModelConfig:
    """Detect a config that declares MTP layers whose tensors are entirely absent (as `save_pretrained` writes).
    `names`: the tensors under the engine's names where the family stores them otherwise (Qwen3.5's `mtp.*`);
    default the reader's.

    Returns `cfg`, or a copy with no MTP layers when they are absent and drafting is disabled (`drop_if_absent`).
    Raises EngineError when they are absent and drafting is wanted; partial layers fail later naming the tensor.
    """
    n, k = cfg.num_hidden_layers, cfg.num_nextn_predict_layers
    if k == 0:
        return cfg
    prefixes = tuple(layer_prefix(n + i) for i in range(k))
    if any(name.startswith(prefixes) for name in (reader.names() if names is None else names)):
        return cfg
    if drop_if_absent:
        return cfg.model_copy(update={"num_nextn_predict_layers": 0})
    raise EngineError(
        f"{reader.model_dir / CONFIG_NAME} declares num_nextn_predict_layers={k} but the checkpoint holds no tensors "
        f"for MTP layer(s) {prefixes[0]}… (transformers' save_pretrained drops them); add the MTP weights, set "
        "num_nextn_predict_layers to 0, or pass an --extra_llm_api_options YAML with speculative_config: null"
    )


# Quantization ------------------------------------------------------------------------------------------
#: W4A16's default super-block (two-level scales, llama.cpp's Q4_K) for models whose quantized linears hold at least
#: TWO_LEVEL_MIN_PARAMS weights; smaller ones keep one-level bf16 scales. Measured (docs/PERFORMANCE.md): a GGUF's
#: Q4_K tensors are then read exactly (Qwen2.5-Coder-1.5B perplexity +0.55 % over bf16 against +1.73 %), with 6 % fewer
#: bytes a step; the kernel takes a few more instructions, so W4A16's batch-1 speed moves −9 % to +9 % with the
#: machine's memory speed (SmolLM2-135M, bound by instructions: −6 %); W4A8 runs them at either speed.
DEFAULT_SUPER_BLOCK = 256
TWO_LEVEL_MIN_PARAMS = 1_000_000_000


def resolve_quant(quant_algo: str | None, group_size: int | None, cfg: ModelConfig,
                  specs: dict[str, tuple[tuple[int, ...], torch.dtype]],
                  exclude_modules: list[str] | None = None,
                  lm_head_quant_algo: str | None = None,
                  super_block_size: int | None = None) -> tuple[QuantConfig | None, set[str]]:
    """The engine's quant config and the weights it quantizes: every `nn.Linear` (the lm_head included) but
    those `exclude_modules` names. A tied lm_head is not in `specs`: the caller adds its copy.

    Raises:
        EngineError: an unknown algorithm, a group size or super-block with W8A16, a group size that does not
            divide a layer's input, a super-block smaller than the group.

    W4A16's `super_block_size`: None picks `DEFAULT_SUPER_BLOCK` for models of ≥ `TWO_LEVEL_MIN_PARAMS` quantized
    weights, else none; 0 asks for none (one-level scales).
    """
    if quant_algo is None:
        if group_size is not None or super_block_size is not None:
            raise EngineError("--group_size and --super_block_size apply to --quant_algo W4A16 / W4A8 only")
        return None, set()
    if quant_algo not in QUANT_ALGOS:
        raise EngineError(f"unknown quant_algo {quant_algo!r}; choose one of {', '.join(QUANT_ALGOS)}")
    if quant_algo == "W8A16" and (group_size is not None or super_block_size is not None):
        raise EngineError("W8A16 scales each output channel; --group_size and --super_block_size apply to W4A16 / W4A8 "
                          "only")
    with torch.device("meta"):
        model = MODEL_CLASSES[cfg.architecture](cfg, max_positions=1)
    exclude = list(exclude_modules or [])
    if lm_head_quant_algo in INT4_ALGOS and cfg.vocab_size % INT4_ROWS and "lm_head" not in exclude:
        logger.warning("the lm_head is stored as W8A16, not W4A16 (vocabulary %d is not a multiple of %d, which "
                       "the int4 kernel's packing needs)", cfg.vocab_size, INT4_ROWS)
        lm_head_quant_algo = "W8A16"
    probe = QuantConfig(quant_algo=quant_algo, exclude_modules=exclude)
    names = {n for n in linear_weight_names(model, probe) if n in specs and len(specs[n][0]) == 2}
    if quant_algo in INT4_ALGOS:
        try:
            ks = [specs[n][0][1] for n in names if n != "lm_head.weight"]
            group_size = group_size or default_group_size(ks)
            bad = sorted({k for k in ks if k % group_size})
            if bad:
                raise QuantError(f"--group_size {group_size} does not divide the input sizes {bad}")
            if super_block_size is None:
                params = sum(math.prod(specs[n][0]) for n in names)
                super_block_size = DEFAULT_SUPER_BLOCK if params >= TWO_LEVEL_MIN_PARAMS else 0
            if 0 < super_block_size < group_size:
                raise QuantError(f"--super_block_size {super_block_size} is smaller than the group size {group_size}; "
                                 "a super-block holds whole groups (256 = llama.cpp's Q4_K; 0 = none)")
        except QuantError as e:
            raise EngineError(f"{quant_algo}: {e}") from e
    return QuantConfig(quant_algo=quant_algo, group_size=group_size, exclude_modules=probe.exclude_modules,
                       lm_head_quant_algo=lm_head_quant_algo or "W8A16",
                       super_block_size=super_block_size or None), names


def quantized_specs_all(specs: dict[str, tuple[tuple[int, ...], torch.dtype]], names: set[str],
                        quant: QuantConfig) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
    """`specs` with each weight in `names` replaced by its quantized tensors, in the file's order: the MoE experts
    stored in the int4 kernel's layout first, as the MoE op stacks them (`kernel_layout.file_order`), then the rest
    in `specs`' order."""
    out: dict[str, tuple[tuple[int, ...], torch.dtype]] = {}
    for name, (shape, dtype) in specs.items():
        out.update(quantized_specs(name, shape, quant) if name in names else {name: (shape, dtype)})
    return {name: out[name] for name in kernel_layout.file_order(list(out))}
