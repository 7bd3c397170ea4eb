"""Engines built on first use: `LLM(path)` accepts a checkpoint as well as an engine directory.

As TensorRT-LLM's LLM API takes an HF model directory and builds its engine behind the scenes, `resolve_engine_dir`
turns a checkpoint (an HF directory with config.json, or a `.gguf` file / a directory holding one) into an engine
directory under a cache, keyed by the checkpoint's content fingerprint (`build/fingerprint.py`), the build options
and the nextn version:

    <cache_dir>/<architecture-free key: sha256(fingerprint, options, version)[:20]>/   an ordinary engine directory

A second `LLM(path)` with the same checkpoint and options reuses the engine; an edited checkpoint (any byte) or other
options get a new one. Builds are serialised by an exclusive lock file per key, so two processes starting at once
build once; `build_engine` writes through a staging directory, so an interrupted build leaves no engine behind.
Each use touches the entry's lock file (its last use); after a build, least-recently-used entries are evicted down
to the cache's size cap (`build/cache_entries.py`, which also lists and clears entries for `nextn cache`).
"""

from __future__ import annotations

import hashlib
import json
import logging
import shutil
from pathlib import Path
from typing import Any

import nextn
from nextn.build.checkpoint import CONFIG_NAME
from nextn.build.fingerprint import fingerprint
from nextn.build.cache_entries import cache_cap_bytes, entry_lock, evict_lru, mark_used
from nextn.build.manifest import MANIFEST_NAME, EngineError, EngineManifest

logger = logging.getLogger(__name__)

#: Default cache root (the CLI may pass another, e.g. from $NEXTN_CACHE_DIR).
DEFAULT_CACHE_DIR = Path.home() / ".cache" / "nextn" / "engines"


def is_engine_dir(path: Path) -> bool:
    """True when `path` is a directory with an nextn manifest (validity is checked when the engine loads)."""
    return path.is_dir() and (path / MANIFEST_NAME).is_file()


def checkpoint_files(path: Path) -> list[Path]:
    """The files that define a checkpoint's content: the `.gguf` file, or config.json and the weight files.

    Raises:
        EngineError: `path` is neither an engine, a `.gguf` file, nor a directory with config.json or a `.gguf`.
    """
    if path.is_file() and path.suffix == ".gguf":
        return [path]
    if path.is_dir():
        if (path / CONFIG_NAME).is_file():
            files = [path / CONFIG_NAME, *sorted(path.glob("*.safetensors")), *sorted(path.glob("*.json"))]
            return sorted(set(files))
        ggufs = sorted(path.glob("*.gguf"))
        if len(ggufs) == 1:
            return ggufs
        if len(ggufs) > 1:
            raise EngineError(f"{path} holds {len(ggufs)} .gguf files ({', '.join(g.name for g in ggufs)}); "
                              "pass the one to use")
    raise EngineError(f"{path} is not an nextn engine directory (no {MANIFEST_NAME}), nor a .gguf file or a "
                      f"checkpoint directory with {CONFIG_NAME}; pass an engine built by `build-engine` or a "
                      "checkpoint")


#: Bumped whenever the same build options produce different engine files (a default changed), so that cached
#: engines of an older layout are rebuilt rather than reused: 2, quantized engines quantize the lm_head; 3, W4A16's
#: default group size 32 and the W8A16 lm_head; 4, W4A16's two-level scales by default from 1B parameters.
ENGINE_LAYOUT = 4


def cache_key(files: list[Path], build_options: dict[str, Any]) -> str:
    """20 hex characters: sha256 over the checkpoint fingerprint, the build options (JSON, sorted), the version and
    `ENGINE_LAYOUT`."""
    root = files[0].parent if len(files) == 1 else None
    payload = json.dumps({"fingerprint": fingerprint(files, root=root), "options": build_options,
                          "nextn_version": nextn.__version__, "layout": ENGINE_LAYOUT}, sort_keys=True)
    return hashlib.sha256(payload.encode()).hexdigest()[:20]


def normalized_build_options(path: Path, build_options: dict[str, Any]) -> dict[str, Any]:
    """`build_options` with "auto" resolved as the build would resolve it here (the dtype, `quant_algo`: an absent
    one is "auto", `build_engine`'s default) and None values dropped, so that every path to the same engine — the
    demo's explicit W4A16, `nextn generate --model`'s defaults, `LLM(path)` — shares one cache entry.

    Raises:
        As `open_checkpoint` / `build_engine`'s readers (CheckpointError, ConfigError).
    """
    from nextn.build.engine_settings import auto_quant_algo, open_checkpoint, resolve_dtype

    options = {k: v for k, v in build_options.items() if v is not None or k == "quant_algo"}
    dtype, quant = options.get("dtype", "auto"), options.get("quant_algo", "auto")
    if dtype == "auto" or quant == "auto":
        with open_checkpoint(path) as reader:
            if quant == "auto":
                quant = auto_quant_algo(reader) if dtype in ("auto", "bfloat16") else None
            if dtype == "auto":
                dtype = resolve_dtype("auto", reader.model_config, reader.is_fp8,
                                      getattr(reader, "is_quantized", False))
    options.update(dtype=dtype, quant_algo=quant)
    return {k: v for k, v in options.items() if v is not None}


def resolve_engine_dir(path: str | Path, cache_dir: str | Path | None = None, progress: bool = True,
                       what: str = "LLM", max_cache_bytes: int | None = None, **build_options: Any) -> Path:
    """The engine directory for `path`: `path` itself when it is an engine, else the cached build of the checkpoint.

    Args:
        path: an engine directory, an HF checkpoint directory, or a `.gguf` file (or a directory holding one).
        cache_dir: where built engines live; default `~/.cache/nextn/engines`.
        progress: show build-engine's progress bar on a first build.
        what: who asks, for the one line a first build logs ("LLM", "the draft model", ...).
        max_cache_bytes: the cache's size cap (`cache_cap_bytes()` when None): after a build, least-recently-used
            entries are evicted down to it (`evict_lru`).
        **build_options: `build_engine` keyword arguments (dtype, max_seq_len, ...); "auto" values are resolved
            and None values dropped (`normalized_build_options`); the result is the cache key's options.
    Returns:
        An engine directory (built now if it was not cached).
    Raises:
        EngineError: `path` is not an engine nor a checkpoint, a bad $NEXTN_CACHE_MAX_GB; the build's own errors (CheckpointError,
            ConfigError, WeightError, EngineError) propagate unchanged.
    """
    path = Path(path)
    if is_engine_dir(path):
        return path
    if not path.exists():
        raise EngineError(f"{path} does not exist; pass an engine directory, a checkpoint directory or a .gguf file")
    files = checkpoint_files(path)
    options = normalized_build_options(files[0] if len(files) == 1 else path, build_options)
    root = Path(cache_dir) if cache_dir is not None else DEFAULT_CACHE_DIR
    cap = cache_cap_bytes() if max_cache_bytes is None else max_cache_bytes
    engine = root / cache_key(files, options)
    root.mkdir(parents=True, exist_ok=True)
    with entry_lock(root, engine.name):
        if is_engine_dir(engine):
            try:
                EngineManifest.load(engine)
                logger.info("using the cached engine %s for %s", engine, path)
                mark_used(root, engine.name)
                return engine
            except EngineError as e:
                logger.warning("cached engine %s is unusable (%s); rebuilding it", engine, e)
        if engine.exists():  # a broken or partial entry of our own cache (never a user's directory)
            shutil.rmtree(engine)
        from nextn.build.engine_builder import build_engine

        logger.warning("%s: building an engine for %s into %s (once; later loads reuse it)", what, path, engine)
        build_engine(path, engine, progress=progress, **{"quant_algo": None, **options})
        mark_used(root, engine.name)
    evict_lru(root, cap, keep=engine.name)
    return engine
