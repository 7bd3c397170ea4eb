"""`build-engine`: compile a checkpoint (DeepSeek-V3 or Llama-family HF safetensors, or a GGUF) into an engine directory.

Usage:
    build-engine --model_dir CHECKPOINT --output_dir ENGINE [--dtype auto|bfloat16|float16|float32]
                 [--quant_algo W8A16|W4A16|W4A8 [--group_size G] [--super_block_size S]]
                 [--max_batch_size N] [--max_seq_len N] [--extra_llm_api_options YAML] [--force]
                 [--allow_unused_tensors] [--no-progress]
                 [--compile_step [--compile_batch_sizes N ...] [--compile_device cpu|cuda]]

Exit status: 0 on success; 2 for invalid arguments, an unreadable/unsupported checkpoint, bad YAML or an output
directory that is not an engine (message on stderr, no traceback); 1 for an I/O failure (disk full, permissions).
A failed build (SIGINT, SIGTERM and SIGHUP included: exit status 128 + the signal) leaves --output_dir as it
was, with no staging directory; a second build into the same --output_dir while one runs is refused (status 2); an existing engine is replaced only when its directory holds nothing
but the files its manifest lists (--force removes the others, named in the refusal).
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Sequence
from pathlib import Path

from nextn.cli.spellings import add_spellings, add_version, interrupted
from nextn.cli.checkpoint_options import QUANT_ALGOS
from nextn.cli.threads import add_threads_argument, apply_threads
from nextn.config.llm_args import MAX_BATCH_SIZE, MAX_INT

PROG = "build-engine"


def _user_errors() -> tuple[type[Exception], ...]:
    """The errors reported as `build-engine: error: ...`, exit status 2 (imported here, not at start-up: `--help`
    stays free of torch)."""
    from nextn.build.checkpoint import CheckpointError
    from nextn.build.manifest import EngineError
    from nextn.build.medusa_heads import MedusaHeadsError
    from nextn.config.llm_args import LlmArgsError
    from nextn.models.config import ConfigError
    from nextn.models.deepseek_v3.weights import WeightError
    from nextn.runtime.template_render import ChatTemplateError

    return (CheckpointError, ConfigError, WeightError, EngineError, LlmArgsError, MedusaHeadsError, ChatTemplateError)


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog=PROG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
        description=(
            "Compile a checkpoint into an nextn engine directory: a DeepSeek-V3 or Llama-family (Llama, Qwen2)\n"
            "Hugging Face checkpoint (BF16/FP32 or block-FP8 safetensors, single file or sharded, with its MTP\n"
            "layers), or a GGUF as people download it (F32/F16/BF16 or quantized, e.g. Q4_K_M, dequantized with\n"
            "the gguf library). The engine holds model.safetensors in the runtime layout (optionally weight-only\n"
            "quantized: W8A16 / W4A16), the tokenizer files, and manifest.json (model, dtype, speculative setup,\n"
            "quantization, build options, checksums)."
        ),
        epilog=(
            "example:\n"
            "  build-engine --model_dir ./DeepSeek-V3 --output_dir ./engine --extra_llm_api_options mtp.yaml\n"
            "  with mtp.yaml:\n"
            "    speculative_config:\n"
            "      decoding_type: MTP\n"
            "      num_nextn_predict_layers: 3\n"
            "\n"
            "exit status: 0 built; 2 bad arguments, checkpoint, YAML or output directory; 1 I/O failure"
        ),
    )
    p.add_argument("--model_dir", required=True, type=Path, metavar="DIR",
                   help="the checkpoint: an HF checkpoint directory (config.json plus model.safetensors or model.safetensors.index.json), "
                   "or a .gguf file / a directory holding one (Llama family)")
    p.add_argument("--medusa_model_dir", type=Path, metavar="DIR",
                   help="Medusa heads to pack into the engine: a directory with medusa_lm_head.safetensors or "
                   "medusa_lm_head.pt (loaded with weights_only=True), or the file itself")
    p.add_argument("--output_dir", required=True, type=Path, metavar="DIR",
                   help="engine directory to create; an existing nextn engine there is replaced (only the files its "
                   "manifest lists are removed), any other non-empty directory is refused")
    p.add_argument("--force", action="store_true",
                   help="replace an existing engine in --output_dir even when it also holds files its manifest does "
                   "not list (they are removed); a directory that is not an nextn engine is refused even so")
    p.add_argument("--dtype", choices=("auto", "bfloat16", "float16", "float32"), default="auto",
                   help="engine weight dtype; auto = the checkpoint's torch_dtype, bfloat16 for FP8 checkpoints, and "
                   "for a quantized GGUF bfloat16 where this machine has fast bf16 matmuls, else float32 (default: "
                   "%(default)s)")
    p.add_argument("--max_batch_size", type=int, default=8, metavar="N",
                   help="default max concurrent requests recorded in the engine (default: %(default)s)")
    p.add_argument("--max_seq_len", type=int, metavar="N",
                   help="default max tokens per request, at most the model's max_position_embeddings (default: the "
                   "YAML's max_seq_len, else max_position_embeddings, capped with a note where the KV cache of "
                   "--max_batch_size sequences would not fit the memory)")
    p.add_argument("--extra_llm_api_options", "--config", dest="extra_llm_api_options", type=Path, metavar="YAML",
                   help="LLM-args YAML (TensorRT-LLM keys); its speculative_config sets the default drafting: "
                   "decoding_type MTP with num_nextn_predict_layers K, or null for none. Without it an MTP "
                   "checkpoint drafts as many tokens as it has MTP modules")
    p.add_argument("--compile_step", action="store_true",
                   help="compile the decode step with torch.compile after writing the weights (warm-up requests at "
                   "each batch size) and store the artifacts in ENGINE/compiled/, so that loading with "
                   "torch_compile_config does not recompile; they serve loaders with the same torch version and "
                   "device type only")
    p.add_argument("--compile_batch_sizes", type=int, nargs="+", metavar="N",
                   help="warm-up batch sizes for --compile_step (default: cuda_graph_config.batch_sizes from the "
                   "YAML, else 1, 2, 4, ... up to --max_batch_size)")
    p.add_argument("--compile_device", choices=("cpu", "cuda"),
                   help="device to compile for with --compile_step (default: cuda when available)")
    p.add_argument("--quant_algo", choices=("auto", "none", *QUANT_ALGOS), default="auto",
                   help="quantization of the linear layers and the lm_head (TensorRT-LLM's names): W8A16 = int8 "
                   "weights per output channel, W4A16 = 4-bit weights per group (both weight-only: bf16 activations), "
                   "W4A8 = W4A16's weights times activations quantized to int8 (per group, or per super-block with "
                   "two-level scales) on nextn's CPU kernel "
                   "(llama.cpp's CPU numerics, faster); embedding and norms stay in --dtype; none = every linear in "
                   "--dtype; auto (default) = for a mostly 4-bit GGUF (Q4_0, Q4_1, Q4_K_M, ...) the int4 format fastest on "
                   "this CPU's kernel variant (W4A16 with AVX512-BF16, else W4A8) unless --dtype float32/float16, "
                   "else none")
    p.add_argument("--group_size", type=int, metavar="G",
                   help="W4A16 input channels per scale (default: the first of 32, 64, 128 dividing every layer)")
    p.add_argument("--super_block_size", type=int, metavar="S",
                   help="W4A16 with two-level scales, llama.cpp's k-quant scheme: 8-bit group scales and zeros under "
                   "fp16 scales per super-block of at most S input channels (256 = Q4_K's; 4.625 bits a weight at "
                   "group 32 instead of 5); default 256 for models of 1B parameters and more (their step is bound by "
                   "weight bytes), else 0 = one-level bf16 scales")
    p.add_argument("--exclude_modules", nargs="+", metavar="NAME",
                   help="linear layers kept in --dtype with --quant_algo, by name or prefix (e.g. lm_head)")
    p.add_argument("--lm_head_quant_algo", choices=("W8A16", "W4A16"),
                   help="the lm_head's format with --quant_algo (default W8A16: 4 bits there cost far more "
                   "accuracy than in the decoder layers)")
    p.add_argument("--allow_unused_tensors", action="store_true",
                   help="build even when the checkpoint stores tensors the engine would not read (named in a warning), "
                   "e.g. MTP layers a config with num_nextn_predict_layers: 0 leaves out; refused by default")
    add_threads_argument(p)
    p.add_argument("--no-progress", dest="progress", action="store_false", help="hide the progress bar")
    add_version(p)
    return add_spellings(p)


def _size(engine_dir: Path) -> str:
    n = float(sum(f.stat().st_size for f in engine_dir.rglob("*") if f.is_file()))
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} TiB"


def _compiled(manifest, requested: bool) -> str:
    c = manifest.compiled_step
    if c is None:
        if requested:
            return "no artifacts stored (torch could not save them; see the log)"
        return "no (--compile_step stores torch.compile artifacts)"
    return (f"{c.file}, {c.num_bytes / 2**20:.1f} MiB, torch {c.torch_version} {c.device_type}, K={c.draft_len}, "
            f"batch sizes {c.batch_sizes}")


def main(argv: Sequence[str] | None = None) -> int:
    """Run the CLI; returns the exit status (0) or exits with 1/2 after printing `build-engine: error: ...`."""
    args = _parser().parse_args(argv)
    from nextn.build.output_dir import BuildInterrupted, output_lock, signals_interrupt_build

    start = time.perf_counter()
    try:
        threads, threads_note = apply_threads(args.num_threads, PROG, announce=False)  # said in the summary
    except ValueError as e:
        print(f"{PROG}: error: {e}", file=sys.stderr)
        sys.exit(2)
    try:
        _check_sizes(args)
        with signals_interrupt_build(), output_lock(args.output_dir):
            manifest = _build(args)
    except BuildInterrupted as e:
        print(f"{PROG}: {e}; nothing was written to {args.output_dir}", file=sys.stderr)
        sys.exit(128 + e.signum)
    except KeyboardInterrupt:
        sys.exit(interrupted(PROG, f"nothing was written to {args.output_dir}"))
    except Exception as e:
        if not isinstance(e, (*_user_errors(), OSError)):
            raise
        print(f"{PROG}: error: {e}", file=sys.stderr)
        sys.exit(1 if isinstance(e, OSError) and not isinstance(e, _user_errors()) else 2)
    _report(args, manifest, time.perf_counter() - start, threads, threads_note)
    return 0


def _check_sizes(args: argparse.Namespace) -> None:
    """Sizes the engine records must be ones an engine load accepts (LlmArgs' bounds, runtime/engine_sizes.py):
    refused before anything is read or written."""
    from nextn.build.manifest import EngineError

    if not 1 <= args.max_batch_size <= MAX_BATCH_SIZE:
        raise EngineError(f"--max_batch_size {args.max_batch_size} must be in [1, {MAX_BATCH_SIZE}] (concurrent "
                          "requests an engine can load with)")
    if args.max_seq_len is not None and not 2 <= args.max_seq_len <= MAX_INT:
        raise EngineError(f"--max_seq_len {args.max_seq_len} must be in [2, {MAX_INT}] and at most the model's "
                          "max_position_embeddings (a request needs a prompt token and an output token)")


def _build(args: argparse.Namespace):
    from nextn.build.engine_builder import build_engine

    return build_engine(
            args.model_dir, args.output_dir, dtype=args.dtype, max_batch_size=args.max_batch_size,
            max_seq_len=args.max_seq_len, extra_llm_api_options=args.extra_llm_api_options, progress=args.progress,
            medusa_model_dir=args.medusa_model_dir, compile_step=args.compile_step,
            compile_batch_sizes=args.compile_batch_sizes, compile_device=args.compile_device, force=args.force,
            quant_algo=None if args.quant_algo == "none" else args.quant_algo, group_size=args.group_size,
            exclude_modules=args.exclude_modules,
            lm_head_quant_algo=args.lm_head_quant_algo, super_block_size=args.super_block_size,
            allow_unused_tensors=args.allow_unused_tensors,
        )  # fmt: skip


def _report(args: argparse.Namespace, manifest, seconds: float, threads: int, threads_note: str | None) -> None:
    from nextn.models.registry import WEIGHT_LAYOUTS

    spec = manifest.speculative
    drafting = (f"MTP, {spec.num_mtp_modules} module(s), K={spec.max_draft_len}, "
                f"{'vanilla' if spec.use_mtp_vanilla else 'eagle'}" if spec.method == "mtp" else
                f"Medusa, {spec.num_medusa_heads} head(s) of {spec.medusa_num_layers} ResBlock(s)"
                if spec.method == "medusa" else f"none ({spec.num_mtp_modules} MTP module(s) stored)")
    print(f"engine:     {args.output_dir}\n"
          f"dtype:      {manifest.dtype}"
          f"{f' ({manifest.quant_config.quant_algo} linear layers)' if manifest.quant_config else ''}\n"
          f"drafting:   {drafting}\n"
          f"max_seq_len: {manifest.build_options.max_seq_len} (model: {manifest.model.max_position_embeddings})\n"
          f"tensors:    {len(WEIGHT_LAYOUTS[manifest.architecture].runtime_weight_specs(manifest.model))}\n"
          f"size:       {_size(args.output_dir)}\n"
          f"tokenizer:  {', '.join(manifest.tokenizer_files) or 'none (token-id prompts only)'}\n"
          f"compiled:   {_compiled(manifest, args.compile_step)}\n"
          f"threads:    {threads}{f' ({threads_note})' if threads_note else ''}\n"
          f"time:       {seconds:.1f} s")


if __name__ == "__main__":
    sys.exit(main())
