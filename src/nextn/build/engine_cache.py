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

The cache owns its entries, so a damaged one is rebuilt, not reported: an entry whose manifest does not load, or
whose files fail the size and header check made on every use (a truncated weights file), is rebuilt by
`resolve_engine_dir`; one whose files fail the full SHA-256 check of the load (a flipped bit) is rebuilt by
`load_through_cache`, which `LLM` loads through. Each rebuild logs a warning naming the key and why. Only what a
build made is ever removed (a real directory holding a manifest.json, nothing its manifest does not list): a
symbolic link, a file or a foreign directory where an entry belongs is refused by name and left alone, and an entry
that cannot be removed or is damaged again after its rebuild is an EngineError naming `nextn cache clear KEY`.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import re
import shutil
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

import nextn
from nextn.build.checkpoint import CONFIG_NAME
from nextn.build.fingerprint import fingerprint
from nextn.build.cache_entries import (DEFAULT_CACHE_DIR, cache_cap_bytes, entry_lock, evict_lru, mark_used,
                                       read_entry)
from nextn.build.manifest import MANIFEST_NAME, EngineError, EngineFileError, EngineManifest, verify_engine_files

logger = logging.getLogger(__name__)


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
#: default group size 32 and the W8A16 lm_head; 4, W4A16's two-level scales by default from 1B parameters; 5,
#: DeepSeek-family routed experts stored one by one (`mlp.experts.{e}.*`, quantized like any linear); 6, Qwen3.5
#: GGUFs' Q4_K q/k/v and z blocks read as they are (`gguf_qwen35.blocks_readable`), not re-quantized; 7, int4 MoE
#: experts stored in the CPU kernel's layout, side by side as the MoE op stacks them (`quantization.kernel_layout`).
ENGINE_LAYOUT = 7


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
        An engine directory (built now if it was not cached, or rebuilt if its entry was damaged: a manifest that
        does not load, a listed file missing or of another size or safetensors header than recorded).
    Raises:
        EngineError: `path` is not an engine nor a checkpoint, a bad $NEXTN_CACHE_MAX_GB, a cache folder that is
            not a directory, an entry the cache did not make where this one belongs (a symbolic link, a file: left
            alone, named) or a damaged one it cannot remove (naming `nextn cache clear KEY`); the build's own errors
            (CheckpointError, ConfigError, WeightError, EngineError) propagate unchanged.
    """
    path = Path(path)
    if is_engine_dir(path):
        return path
    if not path.exists():
        raise EngineError(f"{path} does not exist; pass an engine directory, a checkpoint directory or a .gguf file")
    files = checkpoint_files(path)
    root = Path(cache_dir) if cache_dir is not None else DEFAULT_CACHE_DIR
    if root.exists() and not root.is_dir():
        raise EngineError(f"the engine cache {root} is not a directory; remove or move it, or choose another cache "
                          "(engine_cache_dir, $NEXTN_CACHE_DIR)")
    alias = _alias_path(root, files, build_options)
    known = _read_alias(alias)
    if known is not None and (root / known).is_dir():  # "auto" resolved here before: the checkpoint stays closed
        with entry_lock(root, known):
            if _entry_problem(root / known) is None:
                logger.info("using the cached engine %s for %s", root / known, path)
                mark_used(root, known)
                return root / known
    options = normalized_build_options(files[0] if len(files) == 1 else path, build_options)
    cap = cache_cap_bytes() if max_cache_bytes is None else max_cache_bytes
    engine = root / cache_key(files, options)
    root.mkdir(parents=True, exist_ok=True)
    _cached_or_built(path, root, engine, options, what, progress)
    if alias is not None:
        _write_alias(alias, engine.name)
    evict_lru(root, cap, keep=engine.name)
    return engine


def _cached_or_built(path: Path, root: Path, engine: Path, options: dict[str, Any], what: str, progress: bool
                     ) -> Path:
    """`engine` (the entry of `options`), checked, or built now under its lock."""
    with entry_lock(root, engine.name):
        problem = _entry_problem(engine)
        if problem is None:
            logger.info("using the cached engine %s for %s", engine, path)
            mark_used(root, engine.name)
            return engine
        if engine.exists() or engine.is_symlink():  # a damaged entry: rebuilt when the cache made it
            discard_entry(engine, problem)
        from nextn.build.engine_builder import build_engine

        logger.warning("%s: building an engine for %s into %s (once; later loads reuse it)", what, path, engine)
        build_engine(path, engine, progress=progress, **{"quant_algo": None, **options})
        mark_used(root, engine.name)
    return engine


_KEY = re.compile(r"^[0-9a-f]{20}$")
_ALIAS_PREFIX = ".alias-"
#: The version of what "auto" resolves to (`engine_settings.auto_quant_algo`, `auto_dtype`), part of an alias's key:
#: bumped when those rules change, so an engine the old rules chose is not reused under the new ones (2: a GGUF whose
#: file type is 4-bit builds W4A16 / W4A8 however many of its tensors llama.cpp stored in 5 bits).
AUTO_RULES = 2


def _alias_path(root: Path, files: list[Path], build_options: dict[str, Any]) -> Path | None:
    """Where the entry key of these options with "auto" in them is remembered (`<root>/.alias-<key>`), or None when
    nothing is "auto" (resolving them then opens nothing). The alias's key covers the checkpoint (its fingerprint),
    the options as given, what "auto" depends on on this machine (the device, fast bf16, the int4 format) and the
    version of the rules (`AUTO_RULES`)."""
    raw = {k: v for k, v in build_options.items() if v is not None or k == "quant_algo"}
    if raw.get("dtype", "auto") != "auto" and raw.get("quant_algo", "auto") != "auto":
        return None
    import torch

    from nextn.plugins import woq_linear
    from nextn.plugins.cpu_features import fast_bf16

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    facts = {"device": device.type, "fast_bf16": fast_bf16(device),
             "int4": woq_linear.fastest_int4_algo() if woq_linear.available() else None, "rules": AUTO_RULES}
    return root / (_ALIAS_PREFIX + cache_key(files, {"as_given": raw, "machine": facts}))


def _read_alias(alias: Path | None) -> str | None:
    """The entry key an alias names, or None (no alias, a link, not one of ours)."""
    if alias is None or alias.is_symlink() or not alias.is_file():
        return None
    try:
        with open(alias, "rb") as f:
            text = f.read(64).decode("ascii", "replace").strip()
    except OSError:
        return None
    return text if _KEY.match(text) else None


def _write_alias(alias: Path, key: str) -> None:
    """Remember `key` at `alias`, atomically; never over a link or a file that is not an alias."""
    if alias.is_symlink() or (alias.exists() and _read_alias(alias) is None):
        return
    tmp = alias.with_name(f"{alias.name}.{uuid.uuid4().hex[:8]}.tmp")
    try:
        with open(tmp, "x") as f:
            f.write(key + "\n")
        os.replace(tmp, alias)
    except OSError as e:
        logger.info("engine cache: could not record %s (%s)", alias, e.strerror or e)
        tmp.unlink(missing_ok=True)


def _entry_problem(engine: Path) -> str | None:
    """Why the entry `engine` cannot be used as it is (None: usable): absent, its manifest does not load, or a file
    it lists is missing or of another size or safetensors header than recorded — checked on every use, as it costs
    a stat and a header read per file (the SHA-256 of the data is the load's, `load_through_cache`)."""
    if not engine.exists() and not engine.is_symlink():
        return "absent"
    if not engine.is_dir():
        return "a link to nothing" if engine.is_symlink() else "not a directory"
    try:
        manifest = EngineManifest.load(engine)
        if manifest.checksums:  # an engine of this layout always has them
            verify_engine_files(engine, manifest, "size")
    except EngineError as e:
        return _reason(e)
    return None


def _reason(e: EngineError) -> str:
    """The error's finding without its advice to rebuild by hand (the cache rebuilds)."""
    return str(e).split("; rebuild")[0]


def discard_entry(engine: Path, why: str) -> None:
    """Remove the damaged cache entry `engine` so that it is built again (the caller holds its lock); logs a warning
    naming the key and why.

    Only a directory a build made is removed: a real directory (not a link) holding a manifest.json and, when that
    manifest loads, nothing it does not list (an empty directory goes too). It is renamed aside first and then
    removed, so a failure leaves the whole entry or none of it.

    Raises:
        EngineError: `engine` is a symbolic link, a file or another directory (refused by name, left alone, saying
            what to do), or it cannot be renamed away (naming `nextn cache clear KEY`).
    """
    key, root = engine.name, engine.parent
    refused = ("it was not made by nextn's engine cache, so it was left alone: move or remove it yourself, then "
               "load again to rebuild the engine there")
    if engine.is_symlink():
        raise EngineError(f"the engine cache entry {engine} is a symbolic link (to {os.readlink(engine)}) whose engine "
                          f"is unusable ({why}); {refused} (or repair what it points to)")
    if not engine.is_dir():
        raise EngineError(f"the engine cache entry {engine} is a file, not an engine directory; {refused}")
    if any(engine.iterdir()):
        if not (engine / MANIFEST_NAME).is_file():
            raise EngineError(f"the engine cache entry {engine} is a directory without {MANIFEST_NAME}; {refused}")
        entry = read_entry(engine)
        if entry.manifest is not None and not entry.removable:
            raise EngineError(f"the engine cache entry {engine} is damaged ({why}) and {entry.problem}; it was left "
                              f"alone: move those files out, then run `nextn cache clear {key} --cache_dir {root}` "
                              "and load again")
    logger.warning("engine cache entry %s is damaged (%s): removing it to rebuild it", key, why)
    aside = root / f".{key}.damaged-{uuid.uuid4().hex[:8]}"
    try:
        os.rename(engine, aside)
    except OSError as e:
        raise EngineError(f"the engine cache entry {key} ({engine}) is damaged ({why}) and cannot be removed to be "
                          f"rebuilt ({e.strerror or e}): run `nextn cache clear {key} --cache_dir {root}` as a user "
                          "who may write there, then load again") from None
    try:
        shutil.rmtree(aside)
    except OSError as e:
        logger.warning("engine cache: could not remove the damaged entry %s renamed to %s (%s); remove it yourself",
                       key, aside, e.strerror or e)


T = TypeVar("T")


def load_through_cache(load: Callable[[Callable[..., Path]], T]) -> T:
    """`load(resolve)`, rebuilding a cache entry whose files the load finds damaged.

    `resolve` is `resolve_engine_dir` noting the entries it returns from the cache. When `load` raises an
    EngineFileError (`verify_engine_files`: a flipped bit the SHA-256 check finds, a file changed since
    `resolve`) on a file of one of them, that entry is discarded (`discard_entry`, a warning naming its key and
    why) and `load` runs again, rebuilding it: an `LLM(checkpoint)` whose cached engine was damaged loads and
    generates as before. Entries another process rebuilt meanwhile are used as they are.

    Returns:
        What `load` returns.
    Raises:
        EngineError: an entry damaged again after its rebuild (a failing disk?) or one the cache cannot remove,
            naming `nextn cache clear KEY`; anything else `load` raises, unchanged (an engine directory given by
            the user is never rebuilt).
    """
    rebuilt: set[Path] = set()
    while True:
        entries: dict[Path, tuple[int, int]] = {}

        def resolve(path: str | Path, **kwargs: Any) -> Path:
            engine = resolve_engine_dir(path, **kwargs)
            if engine != Path(path):
                entries[Path(os.path.abspath(engine))] = _identity(engine)
            return engine

        try:
            return load(resolve)
        except EngineFileError as e:
            damaged = Path(os.path.abspath(e.path))
            entry = next((p for p in entries if p in damaged.parents), None)
            if entry is None:
                raise
            key, root = entry.name, entry.parent
            if entry in rebuilt:
                raise EngineError(f"{e}\nThe engine cache rebuilt entry {key} once in this load and it is damaged "
                                  f"again (a failing disk or memory?): check the machine, then run `nextn cache clear "
                                  f"{key} --cache_dir {root}`") from e
            with entry_lock(root, key):
                if _identity(entry) == entries[entry]:  # not rebuilt by another process meanwhile
                    discard_entry(entry, _reason(e))
            rebuilt.add(entry)


def _identity(engine: Path) -> tuple[int, int]:
    """The (inode, mtime) of an entry's manifest: a rebuild writes a new one."""
    try:
        st = (engine / MANIFEST_NAME).stat()
    except OSError:
        return (0, 0)
    return (st.st_ino, st.st_mtime_ns)


def draft_engine_spec(spec: Any, target: Any, resolve: Callable[..., Path] | None = None) -> Any:
    """`spec` with a Draft_Target draft model given as a checkpoint replaced by its engine: built once into the engine
    cache like `LLM(path)` builds one, in the target's dtype and weight-only quantization (drafting reads the
    draft's weights K times a step, so its bytes matter as much as the target's), except that a W4A16 / W4A8
    draft's lm_head is 4-bit too, in the target's format: drafts only propose (the target verifies every token), and
    the head is ~40 % of a small draft model's bytes (Qwen2.5-0.5B: 136 MB at 8 bits of 360 MB); W4A8's kernel reads
    it fastest where int8 products are cheaper than bf16 ones (a [151936, 896] head, one row, Zen 3 AVX2: 3.1 ms
    against W4A16's 5.3). Other specs are returned unchanged.

    Args:
        target: the target engine's `EngineManifest`.
        resolve: `resolve_engine_dir` (default) or `load_through_cache`'s, which notes the entries it returns.
    Raises:
        EngineError / build errors: an unusable draft path.
    """
    from nextn.quantization.quant_config import INT4_ALGOS

    resolve = resolve or resolve_engine_dir
    if (inner := getattr(spec, "combine_with", None)) is not None:  # a combined drafter's model drafter
        spec = spec.model_copy(update={"combine_with": draft_engine_spec(inner, target, resolve)})
    draft = getattr(spec, "speculative_model_dir", None)
    if draft is None or getattr(spec, "decoding_type", None) != "Draft_Target":  # others read theirs as it is
        return spec
    quant = target.quant_config.model_dump(exclude_defaults=True) if target.quant_config else {"quant_algo": None}
    if quant.get("quant_algo") in INT4_ALGOS:
        quant["lm_head_quant_algo"] = quant["quant_algo"]
    draft_dir = resolve(draft, what="Draft_Target: the draft model", progress=True, dtype=target.dtype, **quant)
    return spec.model_copy(update={"speculative_model_dir": str(draft_dir)})
