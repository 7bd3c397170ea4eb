"""How the command lines take a checkpoint where an engine would do: --dtype and --quant_algo, the engine cache.

Kept free of torch so that `--help` stays fast: `QUANT_ALGOS` repeats nextn.quantization.weight_only's (checked
equal by tests/cli/test_help.py).
"""

from __future__ import annotations

import argparse
import os
from typing import Any

#: = nextn.quantization.weight_only.QUANT_ALGOS
QUANT_ALGOS = ("W8A16", "W4A16", "W4A8")
#: Where `LLM(checkpoint)` builds engines, when set (default ~/.cache/nextn/engines).
CACHE_DIR_ENV = "NEXTN_CACHE_DIR"


def add_checkpoint_options(p: argparse.ArgumentParser) -> None:
    """--dtype and --quant_algo: how a checkpoint given as --model is built (`nextn generate`, `nextn serve`)."""
    p.add_argument("--dtype", default="auto", choices=("auto", "bfloat16", "float16", "float32"),
                   help="engine dtype when --model is a checkpoint (default auto: the checkpoint's torch_dtype; "
                        "bfloat16 for FP8 checkpoints; for a quantized GGUF bfloat16 where this machine has fast bf16 "
                        "matmuls, else float32)")
    p.add_argument("--quant_algo", choices=("auto", "none", *QUANT_ALGOS), default="auto",
                   help="quantization when --model is a checkpoint, as build-engine's (default auto: W4A16 for a "
                        "mostly 4-bit GGUF on a CPU with nextn's int4 kernels, else none)")


def checkpoint_llm_kwargs(args: argparse.Namespace) -> dict[str, Any]:
    """`LLM(...)` keywords from --dtype / --quant_algo and the engine cache ($NEXTN_CACHE_DIR)."""
    return {"dtype": args.dtype, "quant_config": {"quant_algo": None if args.quant_algo == "none" else args.quant_algo},
            "engine_cache_dir": os.environ.get(CACHE_DIR_ENV) or None}
