"""Compile an HF DeepSeek-V3 checkpoint (with MTP layers) into an nextn engine directory.

    checkpoint ──CheckpointReader──▶ HF tensors (FP8 dequantized) ──to_runtime──▶ engine tensors
               ──streamed──▶ engine_dir/model.safetensors + tokenizer files + manifest.json

The weights are written one tensor at a time into a pre-sized safetensors file (header first, computed from
`runtime_weight_specs`), so peak memory is one converted tensor (one layer's stacked experts), not the model.
The engine is assembled in a staging directory beside `output_dir` and swapped in only when complete: a failed
build leaves an existing engine untouched and nothing in `output_dir`.
The decisions taken before anything is written (reader, dtype, speculative section, quantization plan) live in
`engine_settings.py`, the streaming writer in `safetensors_writer.py`; both are re-exported here.

What a build refuses before it writes (each error names the tensor, field or file):
- an `output_dir` that is not empty and is not an nextn engine (its manifest must validate), and an engine that also
  holds files its manifest does not list, unless `force` (the message lists them). Replacing an engine removes exactly
  the files found at the check, never a whole directory tree it did not list;
- a checkpoint tensor that is not floating point (or block FP8), holds NaN/Inf, or overflows the engine dtype;
- config sizes the checkpoint's tensors contradict (shapes read from the headers before any data, GGUF included),
  layer counts above the stored layers, stored tensors the engine would not read (unless `allow_unused_tensors`),
  a tokenizer with ids past the embedding, an engine far larger than its checkpoint (a wrong size in config.json),
  or more than the free disk space;
- an explicit `max_seq_len` above the model's `max_position_embeddings`.
The weights' SHA-256 is computed while they are written; every engine file's size and SHA-256 go into the manifest
(`EngineManifest.checksums`), checked at load (`manifest.verify_engine_files`).
"""


from __future__ import annotations

import itertools
import logging
import os
import math
import shutil
from collections.abc import Iterator
from pathlib import Path

import torch

import nextn
from nextn.build.checkpoint import CONFIG_NAME, check_tokenizer_fits, read_json
from nextn.build.engine_settings import (
    DTYPES, INT4_ROWS, auto_quant_algo, check_mtp_layers, check_seq_len, medusa_speculative, open_checkpoint,
    quantized_specs_all,
    resolve_dtype, resolve_quant, resolve_speculative,
)  # fmt: skip
from nextn.build.fingerprint import fingerprint
from nextn.build.gguf_reader import GGUFCheckpoint
from nextn.build.manifest import BuildOptions, EngineError, EngineManifest, SourceInfo, file_checksum
from nextn.build.medusa_heads import check_fits, read_medusa_heads
from nextn.build.output_dir import plan_output_dir, staging_dir
from nextn.build.safetensors_writer import write_safetensors_streaming
from nextn.build.tensor_inventory import check_all_read
from nextn.build.weight_checks import check_engine_size, check_source_tensors, checked_getter, default_max_seq_len
from nextn.config.llm_args import LlmArgs, load_llm_args_yaml, parse_llm_args
from nextn.models.registry import WEIGHT_LAYOUTS
from nextn.quantization.weight_only import quantize_stream
from nextn.runtime.tokenizer import check_saved_chat_template

__all__ = [
    "AUX_FILES", "DTYPES", "EMBED_NAME", "INT4_ROWS", "MEDUSA_PREFIX", "TOKENIZER_FILES", "WEIGHTS_NAME",
    "build_engine", "medusa_speculative", "open_checkpoint", "quantized_specs_all", "resolve_dtype", "resolve_quant",
    "resolve_speculative", "with_lm_head_copy", "write_safetensors_streaming",
]  # fmt: skip

WEIGHTS_NAME = "model.safetensors"
#: Copied into the engine and listed in `manifest.tokenizer_files` when the checkpoint has them.
TOKENIZER_FILES = (
    "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "tokenizer.model",
    "vocab.json", "merges.txt", "added_tokens.json", "chat_template.jinja",
)  # fmt: skip
#: Copied when present but not tokenizer files (sampling defaults, EOS ids).
AUX_FILES = ("generation_config.json",)
EMBED_NAME = "model.embed_tokens.weight"
MEDUSA_PREFIX = "medusa_heads."
logger = logging.getLogger(__name__)


def build_engine(
    model_dir: str | Path,
    output_dir: str | Path,
    dtype: str = "auto",
    max_batch_size: int = 8,
    max_seq_len: int | None = None,
    extra_llm_api_options: str | Path | None = None,
    progress: bool = True,
    medusa_model_dir: str | Path | None = None,
    compile_step: bool = False,
    compile_batch_sizes: list[int] | None = None,
    compile_device: str | None = None,
    force: bool = False,
    quant_algo: str | None = "auto",
    group_size: int | None = None,
    exclude_modules: list[str] | None = None,
    lm_head_quant_algo: str | None = None,
    super_block_size: int | None = None,
    allow_unused_tensors: bool = False,
) -> EngineManifest:
    """Build an engine directory from a DeepSeek-V3 or Llama-family checkpoint, optionally with Medusa heads.

    Args:
        model_dir: HF checkpoint directory (config.json + safetensors, single or sharded, BF16/FP32 or block FP8;
            a Hugging Face cache snapshot of symlinks into blobs/ is fine), or a `.gguf` file / a directory holding
            one (Llama family).
        medusa_model_dir: Medusa heads (`medusa_lm_head.safetensors` or `.pt`, FasterDecoding/Medusa) to pack in.
        output_dir: engine directory to create; an empty directory; or an existing nextn engine, replaced
            atomically (only the files its manifest lists are removed).
        dtype: engine weight dtype: "auto" (the checkpoint's `torch_dtype`; FP8 checkpoints → bfloat16; quantized
            GGUFs → bfloat16 where bf16 is fast here, else float32: `resolve_dtype`),
            "float32", "bfloat16" or "float16". `e_score_correction_bias` always stays float32.
        max_batch_size: default max concurrent requests recorded in the manifest (> 0).
        max_seq_len: default max tokens per request (> 0, ≤ the model's max_position_embeddings). None: the YAML's
            `max_seq_len`, else the model's `max_position_embeddings`, capped (with a logged note) where the
            weights plus a KV cache of max_batch_size × max_seq_len tokens would exceed half the available memory.
        extra_llm_api_options: optional LLM-args YAML (TensorRT-LLM llm_args.py); its `speculative_config` sets the
            engine's draft method: MTP with K = `num_nextn_predict_layers`, or `null` for none. Without it an
            MTP checkpoint gets method "mtp" with K = its module count.
        progress: show a tqdm bar over the tensors (and the compile warm-up) on stderr.
        compile_step: after writing the weights, load the engine, compile its decode step with torch.compile
            (warm-up requests at each batch size) and store the artifacts under `compiled/`, recorded in
            `manifest.compiled_step` with the torch version and device type (build/compile_step.py).
        compile_batch_sizes: warm-up batch sizes; None: the YAML's cuda_graph_config.batch_sizes, else
            1, 2, 4, … up to max_batch_size.
        compile_device: device to compile for ("cpu", "cuda"); None: CUDA when available. Artifacts only serve
            loaders on the same device type and torch version.
        force: replace an existing engine in `output_dir` even when it also holds files its manifest does not
            list (they are removed). A directory that is not an nextn engine is refused even with `force`.
        quant_algo: weight-only quantization of the decoder's linear layers, TensorRT-LLM's names: "W8A16" (int8,
            per output channel), "W4A16" (4-bit, per group) or "W4A8" (W4A16's weights, int8 activations); None keeps
            them in `dtype`; "auto" (default): W4A16 for a mostly 4-bit GGUF on a CPU with nextn's int4 kernels when
            `dtype` is "auto" or "bfloat16", else None (`engine_settings.auto_quant_algo`). The lm_head is
            quantized too, as `lm_head_quant_algo` (a tied model gets a quantized lm_head copy beside its
            embedding) unless `exclude_modules` names it; the embedding and norms stay in `dtype`
            (`quantization/weight_only.py`).
        group_size: W4A16 input channels per scale (must divide every layer's input size); None: the first of
            32, 64, 128 that does.
        exclude_modules: linear layers (names or prefixes, TensorRT-LLM's `QuantConfig.exclude_modules`) kept in
            `dtype`, e.g. ["lm_head"]; None: none.
        lm_head_quant_algo: the lm_head's format when quantized: None → "W8A16" (`QuantConfig.lm_head_quant_algo`).
        super_block_size: W4A16 with two-level scales (llama.cpp's k-quants): 8-bit group scales and zeros under
            fp16 scales per super-block of at most this many input channels (`QuantConfig.super_block_size`);
            None: 256 for models of ≥ 1B quantized weights, else none; 0: none (`resolve_quant`).
        allow_unused_tensors: build even when the checkpoint stores tensors the engine would not read (a warning
            names them), e.g. MTP layers a config with `num_nextn_predict_layers: 0` leaves out; by default such a
            build is refused (`tensor_inventory.check_all_read`).
    Returns:
        The manifest written to `output_dir/manifest.json`.
    Raises:
        EngineError: bad options; `output_dir` is non-empty and not an engine, or an engine holding other files
            (without `force`); `output_dir` holds the checkpoint; an explicit max_seq_len too large; MTP requested
            but absent; the engine would not fit the disk or is far larger than the checkpoint (a wrong size).
        CheckpointError, ConfigError, WeightError: unreadable checkpoint file, bad config.json (non-finite or
            invalid field, a layer count above the stored layers), missing, misshapen, non-float or non-finite
            tensor, stored tensors the engine would not read (each message names the file, field or tensor).
        LlmArgsError: the YAML is missing or invalid.
    """
    model_dir, output_dir = Path(model_dir), Path(output_dir)
    if dtype != "auto" and dtype not in DTYPES:
        raise EngineError(f"unknown dtype {dtype!r}; choose auto, {', '.join(DTYPES)}")
    if max_batch_size <= 0 or (max_seq_len is not None and max_seq_len <= 0):
        raise EngineError(f"max_batch_size ({max_batch_size}) and max_seq_len ({max_seq_len}) must be positive")
    replaced = plan_output_dir(output_dir, model_dir, force)
    yaml_data = load_llm_args_yaml(extra_llm_api_options) if extra_llm_api_options is not None else None
    llm_args = parse_llm_args(yaml_data) if yaml_data is not None else None

    heads = read_medusa_heads(medusa_model_dir) if medusa_model_dir is not None else None
    with open_checkpoint(model_dir) as reader:
        cfg = reader.model_config
        layout = WEIGHT_LAYOUTS[cfg.architecture]
        if heads is not None:
            check_fits(heads, cfg.hidden_size, cfg.vocab_size)
        if max_seq_len is not None:
            check_seq_len(max_seq_len, "--max_seq_len", cfg)
        if llm_args is not None and llm_args.max_seq_len is not None:
            check_seq_len(llm_args.max_seq_len, f"max_seq_len in {extra_llm_api_options}", cfg)
            max_seq_len = max_seq_len or llm_args.max_seq_len
        # `speculative_config: null` in the YAML turns drafting off (an absent key keeps the checkpoint's default).
        spec_disabled = (llm_args is not None and "speculative_config" in yaml_data
                         and llm_args.speculative_config is None)
        cfg = check_mtp_layers(reader, cfg, drop_if_absent=spec_disabled,
                               names=layout.stored_view(reader, cfg).names())
        speculative = (resolve_speculative(cfg, yaml_data, llm_args, model_dir) if heads is None
                       else medusa_speculative(heads, llm_args))
        if quant_algo == "auto":
            quant_algo = auto_quant_algo(reader, compile_device) if dtype in ("auto", "bfloat16") else None
        engine_dtype = resolve_dtype(dtype, cfg, reader.is_fp8, getattr(reader, "is_quantized", False))
        torch_dtype = DTYPES[engine_dtype]
        specs = {n: (s, layout.runtime_weight_dtype(n, torch_dtype)) for n, s in layout.runtime_weight_specs(cfg).items()}
        if heads is not None:
            specs.update({MEDUSA_PREFIX + n: (tuple(t.shape), torch_dtype) for n, t in heads.tensors.items()})
        stored = layout.stored_view(reader, cfg)  # the family's fused or reordered tensors in the engine's layout
        check_source_tensors(stored, specs, cfg)
        check_all_read(layout.unread_tensors(stored.names(), cfg), cfg.num_hidden_layers,
                       cfg.num_nextn_predict_layers, allow_unused_tensors)
        if isinstance(reader, GGUFCheckpoint):  # its token list was checked against its embedding on opening
            reader.check_chat_template()
        else:
            check_tokenizer_fits(model_dir, cfg.vocab_size)
            check_saved_chat_template(model_dir, [n for n in TOKENIZER_FILES if (model_dir / n).is_file()])
        quant, quant_names = resolve_quant(quant_algo, group_size, cfg, specs, exclude_modules, lm_head_quant_algo,
                                           super_block_size)
        untie = quant is not None and quant.applies_to("lm_head") and "lm_head.weight" not in specs
        if untie:  # a tied model's quantized lm_head is a copy of the embedding
            specs["lm_head.weight"] = specs[EMBED_NAME]
            quant_names.add("lm_head.weight")
        stored_specs = quantized_specs_all(specs, quant_names, quant) if quant is not None else specs
        engine_bytes = sum(math.prod(s) * dt.itemsize for s, dt in stored_specs.values())
        check_engine_size(engine_bytes, reader.files, specs, cfg, output_dir)
        if max_seq_len is None:
            max_seq_len, note = default_max_seq_len(cfg, max_batch_size, torch_dtype.itemsize, engine_bytes)
            if note:
                logger.warning("%s", note)
        if isinstance(reader, GGUFCheckpoint):
            source = SourceInfo(path=os.path.abspath(reader.path), format="gguf",  # `..` folded
                                fingerprint=fingerprint([reader.path], root=reader.path.parent))
        else:
            extra_files = [p for p in (reader.index_file,) if p is not None]
            source = SourceInfo(
                path=os.path.abspath(model_dir),
                format="safetensors-fp8" if reader.is_fp8 else "safetensors",
                fingerprint=fingerprint([model_dir / CONFIG_NAME, *extra_files, *reader.files], root=model_dir),
            )
        with staging_dir(output_dir, replaced) as staging:
            get = checked_getter(stored.get, torch_dtype)
            tensors = layout.to_runtime(get, stored.has, cfg, torch_dtype)
            if heads is not None:
                tensors = itertools.chain(tensors, ((MEDUSA_PREFIX + n, t.to(torch_dtype).contiguous())
                                                    for n, t in heads.tensors.items()))
            if untie:
                tensors = with_lm_head_copy(tensors)
            if quant is not None:
                # a GGUF's Q4_K tensors are taken as they are where the engine's format holds them (not re-quantized)
                _, tensors = quantize_stream(specs, tensors, quant_names, quant,
                                             native=getattr(stored, "native_w4a16", None))
            checksums = {WEIGHTS_NAME: write_safetensors_streaming(staging / WEIGHTS_NAME, stored_specs, tensors,
                                                                   progress=progress)}
            if isinstance(reader, GGUFCheckpoint):  # tokenizer files, and generation_config.json (the EOS ids)
                tokenizer_files = reader.write_tokenizer_files(staging)
                aux_files = [name for name in AUX_FILES if (staging / name).is_file()]
            else:
                tokenizer_files, aux_files = _copy_side_files(model_dir, staging)
            for name in (*tokenizer_files, *aux_files):
                checksums[name] = file_checksum(staging / name)
            manifest = EngineManifest(
                nextn_version=nextn.__version__,
                architecture=cfg.architecture,
                dtype=engine_dtype,
                model=cfg,
                speculative=speculative,
                build_options=BuildOptions(max_batch_size=max_batch_size, max_seq_len=max_seq_len,
                                           extra_llm_api_options=yaml_data),
                source=source,
                weight_files=[WEIGHTS_NAME],
                tokenizer_files=tokenizer_files,
                aux_files=aux_files,
                checksums=checksums,
                quant_config=quant,
            )
            manifest.save(staging)
            if compile_step:
                manifest = _compile_step(staging, manifest, llm_args, compile_batch_sizes, compile_device, progress)
    return manifest


def with_lm_head_copy(tensors: Iterator[tuple[str, torch.Tensor]]) -> Iterator[tuple[str, torch.Tensor]]:
    """The engine tensor stream plus `lm_head.weight` = the embedding, last (a tied model whose lm_head is
    quantized: the embedding lookup stays in the engine dtype, the vocabulary projection reads the quantized copy)."""
    embed = None
    for name, t in tensors:
        if name == EMBED_NAME:
            embed = t
        yield name, t
    if embed is None:
        raise EngineError(f"the checkpoint stream has no {EMBED_NAME} to copy into a quantized lm_head")
    yield "lm_head.weight", embed


def _compile_step(engine_dir: Path, manifest: EngineManifest, llm_args: LlmArgs | None,
                  batch_sizes: list[int] | None, device: str | None, progress: bool) -> EngineManifest:
    """Compile the decode step of the engine being built and record its artifacts in the manifest (saved)."""
    from nextn.build.compile_step import compile_engine_step
    from nextn.runtime.compiled_step import default_warmup_batch_sizes

    if batch_sizes is not None and any(b <= 0 or b > manifest.build_options.max_batch_size for b in batch_sizes):
        raise EngineError(f"--compile_batch_sizes {batch_sizes} must lie in [1, max_batch_size "
                          f"{manifest.build_options.max_batch_size}]")
    graph = llm_args.cuda_graph_config if llm_args is not None else None
    sizes = batch_sizes or default_warmup_batch_sizes(manifest.build_options.max_batch_size,
                                                      graph.batch_sizes if graph is not None else None)
    device = device or ("cuda" if torch.cuda.is_available() else "cpu")
    compile_cfg = llm_args.torch_compile_config if llm_args is not None else None
    info = compile_engine_step(engine_dir, sizes, device, compile_cfg, progress)
    if info is None:
        return manifest
    manifest = manifest.model_copy(update={"compiled_step": info})
    manifest.save(engine_dir)
    return manifest


def _copy_side_files(model_dir: Path, engine_dir: Path) -> tuple[list[str], list[str]]:
    """Copy the tokenizer and auxiliary files that exist (symlinks followed); return (tokenizer, aux) names.

    Raises:
        CheckpointError: a JSON side file is not a valid JSON object (a corrupt tokenizer fails the build, not the
            first load).
    """
    copied: tuple[list[str], list[str]] = ([], [])
    for name in (*TOKENIZER_FILES, *AUX_FILES):
        if (model_dir / name).is_file():
            if name.endswith(".json"):
                read_json(model_dir / name, "a valid JSON file")
            shutil.copyfile(model_dir / name, engine_dir / name)
            copied[name in AUX_FILES].append(name)
    return copied
