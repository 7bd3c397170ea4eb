"""Checks a build makes on the checkpoint's tensors and sizes, and the default max_seq_len that fits memory.

- `check_source_tensors`: before any data is read, the shape and dtype of every tensor the checkpoint stores under
  an engine name, from the safetensors headers (a size in config.json that the weights contradict is named with the
  config fields it came from);
- `check_engine_size`: the engine's byte size against its checkpoint's (a wrong size in config.json makes an engine
  of terabytes) and against the free disk space;
- `checked_getter`: every tensor as it is read — floating point (or block FP8, dequantized), finite, and within
  the engine dtype's range;
- `default_max_seq_len`: the model's max_position_embeddings, capped where the KV cache would not fit memory.
"""

from __future__ import annotations

import math
import os
import shutil
from collections.abc import Callable
from pathlib import Path

import torch

from nextn.build.manifest import EngineError
from nextn.models.deepseek_v3.weights import WeightError
from nextn.models.registry import ModelConfig

#: An engine more than this many times its checkpoint's bytes means a wrong size in the config (a 2-bit GGUF with
#: tied embeddings stored twice in float32 is ~25x; DeepSeek FP8 → bfloat16 is ~2x).
MAX_ENGINE_GROWTH = 32
#: Share of the available memory the default max_seq_len may give the weights plus the KV cache (half: the runtime
#: allocates the whole cache up front, and the machine runs other things).
MEMORY_SHARE = 0.5
#: Elements checked for NaN/Inf at a time (bounds the temporary boolean mask).
CHUNK_ELEMENTS = 1 << 24
_FLOAT_DTYPES = {"F64", "F32", "F16", "BF16", "F8_E4M3"}

Specs = dict[str, tuple[tuple[int, ...], torch.dtype]]


def _gib(n: float) -> str:
    return f"{n / 2**30:.1f} GiB"


def _fields_with(cfg: ModelConfig, values: set[int]) -> list[str]:
    """Config fields whose integer value is one of `values` (to name the field behind a wrong dimension)."""
    return [f"{k}={v}" for k, v in cfg.model_dump().items() if type(v) is int and v in values]


def check_source_tensors(reader: object, specs: Specs, cfg: ModelConfig) -> None:
    """Compare the stored shape and dtype of every engine-named checkpoint tensor with the spec, reading headers only.

    Readers without `tensor_info` (GGUF) are checked tensor by tensor as they are read instead.

    Raises:
        WeightError: a tensor is not floating point, or its shape differs from what config.json implies (the
            message names the tensor and the config fields of the differing dimensions).
    """
    info = getattr(reader, "tensor_info", None)
    if info is None:
        return
    for name, (shape, _) in specs.items():
        if not reader.has(name):  # type: ignore[attr-defined]
            continue  # stacked experts, a tied lm_head, Medusa heads: checked as they are read
        st_dtype, stored = info(name)
        if st_dtype not in _FLOAT_DTYPES:
            raise WeightError(f"checkpoint tensor {name!r} has dtype {st_dtype}; nextn builds from floating-point "
                              "(F32, BF16, F16) or block-FP8 weights: the checkpoint is corrupt or not a model")
        if tuple(stored) != tuple(shape):
            wrong = {e for e, s in zip(shape, stored) if e != s} if len(shape) == len(stored) else set(shape)
            fields = _fields_with(cfg, wrong)
            why = f" (from the config's {' or '.join(fields)})" if fields else ""
            raise WeightError(f"tensor {name!r} has shape {list(stored)}, expected {list(shape)}{why}: the config "
                              "does not match the weights")


def check_engine_size(engine_bytes: int, source_files: list[Path], specs: Specs, cfg: ModelConfig,
                      output_dir: Path) -> None:
    """Refuse an engine far larger than its checkpoint (a wrong size in the config) or larger than the free disk.

    Raises:
        EngineError: naming the largest tensor, its shape and the config fields behind it, or the bytes needed
            and free.
    """
    source_bytes = sum(f.stat().st_size for f in source_files)
    if engine_bytes > MAX_ENGINE_GROWTH * source_bytes + (64 << 20):
        name, (shape, _) = max(specs.items(), key=lambda kv: math.prod(kv[1][0]))
        fields = _fields_with(cfg, set(shape))
        raise EngineError(f"the config describes an engine of {_gib(engine_bytes)} from {_gib(source_bytes)} of "
                          f"weights; its largest tensor {name!r} would be {list(shape)} "
                          f"({', '.join(fields) or 'see config.json'}): a size in the config is wrong")
    target = output_dir.parent if not output_dir.exists() else output_dir
    while not target.exists():
        target = target.parent
    free = shutil.disk_usage(target).free
    if engine_bytes > free:
        raise EngineError(f"the engine needs {_gib(engine_bytes)} but {target} has {_gib(free)} free; free some "
                          "space or choose another --output_dir")


def num_nonfinite(t: torch.Tensor) -> int:
    """How many NaN/±Inf values a tensor holds (0 for integer tensors), in bounded chunks."""
    if not t.is_floating_point():
        return 0
    flat = t.reshape(-1)
    bad = 0
    for i in range(0, flat.numel(), CHUNK_ELEMENTS):
        chunk = flat[i:i + CHUNK_ELEMENTS]
        if not bool(torch.isfinite(chunk).all()):
            bad += int((~torch.isfinite(chunk)).sum())
    return bad


def checked_getter(get: Callable[[str], torch.Tensor], engine_dtype: torch.dtype) -> Callable[[str], torch.Tensor]:
    """`get`, refusing a tensor that is not floating point, holds NaN/Inf, or overflows `engine_dtype`.

    Raises (from the returned function):
        WeightError: naming the tensor, its dtype or its number of non-finite values.
    """
    limit = torch.finfo(engine_dtype).max

    def checked(name: str) -> torch.Tensor:
        t = get(name)
        if not t.is_floating_point():
            raise WeightError(f"checkpoint tensor {name!r} has dtype {t.dtype}; nextn builds from floating-point "
                              "(or block-FP8) weights: the checkpoint is corrupt or not a model")
        bad = num_nonfinite(t)
        if bad:
            raise WeightError(f"checkpoint tensor {name!r} holds {bad} NaN/Inf value(s) of {t.numel()}: the "
                              "checkpoint is corrupt or diverged; re-download it or use another")
        if torch.finfo(t.dtype).max > limit and t.numel() and float(t.abs().max()) > limit:
            raise WeightError(f"checkpoint tensor {name!r} has values up to {float(t.abs().max()):.3g}, beyond "
                              f"{engine_dtype}'s range ({limit:.3g}); build with --dtype bfloat16 or float32")
        return t

    return checked


def available_memory() -> int:
    """Bytes of memory available to a new process (MemAvailable of /proc/meminfo; else physical memory)."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (OSError, ValueError):
        return 1 << 40


def default_max_seq_len(cfg: ModelConfig, max_batch_size: int, kv_itemsize: int, weight_bytes: int,
                        memory_bytes: int | None = None) -> tuple[int, str | None]:
    """The model's max_position_embeddings, capped where weights + KV cache exceed MEMORY_SHARE of the memory.

    The KV cache of the runtime is max_batch_size × max_seq_len tokens × (layers incl. MTP) × kv_cache_dim values
    of `kv_itemsize` bytes (runtime/engine.py). The cap is rounded down to a multiple of 256 tokens (at least 256).

    Returns:
        (max_seq_len, a one-line note when capped, else None).
    """
    limit = cfg.max_position_embeddings
    per_token = (cfg.num_hidden_layers + cfg.num_nextn_predict_layers) * cfg.kv_cache_dim * kv_itemsize
    memory = available_memory() if memory_bytes is None else memory_bytes
    budget = MEMORY_SHARE * memory - weight_bytes
    fits = int(budget // (max_batch_size * per_token)) if budget > 0 else 0
    if limit <= fits:
        return limit, None
    capped = max(256, fits // 256 * 256)
    if capped >= limit:
        return limit, None
    need = max_batch_size * limit * per_token
    return capped, (f"max_seq_len {capped}: the model's max_position_embeddings {limit} would need a "
                    f"{_gib(need)} KV cache at max_batch_size {max_batch_size} beside {_gib(weight_bytes)} of "
                    f"weights, and {_gib(memory)} of memory is available; pass --max_seq_len to choose")
