"""The decode step under `torch.compile`, with its compiled artifacts stored in the engine directory.

`compile_decode_fn` wraps a decode function (`verify_and_draft_step` or `tree_verify_and_draft_step`) into a
plain callable of the same signature, so the model runner (and a CUDA-graph runner around it) calls it unchanged:

    engine_dir/compiled/  ──torch.compiler.load_cache_artifacts (+ CPU kernel libraries)──▶ inductor caches
    decode_fn ──torch.compile(fullgraph, inductor, dynamic=False + marked dims)──▶ step(...)

Shapes: the batch dimension B of every per-request tensor and the block-table width are marked dynamic
(`torch._dynamo.maybe_mark_dynamic`), so one graph serves all batch sizes and sequence lengths instead of one
compile per shape; sizes 0 and 1 are still specialised by dynamo (B = 1 gets its own graph), and a Python branch
on a size (the MoE dispatch: gathered weights for few tokens, capacity buffers otherwise) guards a range of B.
The draft length K stays static (one graph per K). Block tables of width 1 are padded to 2 (null block).

The artifacts are PyTorch's "mega-cache" (`torch.compiler.save_cache_artifacts`: the FX-graph and AOTAutograd
cache entries of every compile in the process) plus, on CPU, the C++ kernel libraries inductor built (the
mega-cache holds their sources only, and the C++ compiler is most of a CPU compile: measured, the mega-cache
alone saves nothing on CPU). `build-engine --compile_step` writes them after warm-up steps over the engine's
batch sizes (`build/compile_step.py`, in a private inductor cache directory); the manifest records the torch
version, device type and (CPU) thread count they were made with, and a loader that differs in any of them
ignores them with a logged reason (its step then compiles from scratch; nothing fails).
Not used: `mode="reduce-overhead"` (CUDA graphs belong to the CUDA-graph runner) and AOTInductor (it needs
`torch.export` of the model, drafter and acceptance objects and would store a second copy of the weights).
"""

from __future__ import annotations

import functools
import hashlib
import io
import logging
import os
import re
import tarfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch


def inductor_cache() -> tuple[Callable[[], str] | None, Callable[[], Any] | None]:
    """(inductor's `cache_dir`, `fresh_cache`): private helpers, imported on first use (they import TorchDynamo,
    ~1.5 s, which an engine without compile artifacts never needs); (None, None) where torch lacks them (the
    kernels are then neither packed nor unpacked; still correct)."""
    try:
        from torch._inductor.runtime.cache_dir_utils import cache_dir
        from torch._inductor.utils import fresh_cache
    except ImportError:  # pragma: no cover - other torch versions
        return None, None
    return cache_dir, fresh_cache

from nextn.build.manifest import CompiledStepInfo, EngineManifest
from nextn.config.llm_args import TorchCompileConfig
from nextn.speculative.protocol import StepOutput

logger = logging.getLogger(__name__)

ARTIFACTS_FILE = "compiled/torch_compile_cache.bin"  # relative to the engine directory
KERNELS_FILE = "compiled/cpu_kernels.tar"  # inductor's built C++ kernel libraries (CPU)
_KERNEL_NAME = re.compile(r"[a-z0-9]{2}/[a-z0-9]{20,64}(\.main)?\.so")
#: Block tables narrower than this are padded with the null block (0): its keys lie past every query position,
#: so attention masks them; it spares a second graph for width 1.
MIN_TABLE_WIDTH = 2


def cache_api_available() -> bool:
    """Whether this torch has the mega-cache API (`torch.compiler.save/load_cache_artifacts`, torch ≥ 2.7)."""
    return hasattr(torch.compiler, "save_cache_artifacts") and hasattr(torch.compiler, "load_cache_artifacts")


def compile_decode_fn(decode_fn: Callable[..., StepOutput], engine_dir: str | Path | None = None,
                      device: str | torch.device = "cpu", config: TorchCompileConfig | None = None,
                      manifest: EngineManifest | None = None) -> Callable[..., StepOutput]:
    """`decode_fn` compiled with `torch.compile`, after loading the engine's stored compile artifacts if usable.

    Compilation itself is lazy: it happens at the first call for each new guard set (B = 1, B ≥ 2, a new K, ...).
    With usable artifacts the compile at that call reads the stored inductor output instead of generating and
    building kernels (dynamo still traces the step: a few seconds, not minutes).

    Args:
        decode_fn: the step, `(model, drafter, acceptance, kv_cache, input_ids [B, K+1], kv_lens [B],
            block_tables [B, W], sampling, drafter_state, accept_state, block_size) -> StepOutput`.
        engine_dir: the engine directory whose `manifest.compiled_step` artifacts to load; None: load nothing.
        device: the device the step runs on (its type must match the artifacts' device type).
        config: `torch_compile_config` (fullgraph, inductor); None: the defaults.
        manifest: the engine's manifest when already read (else read from `engine_dir`).
    Returns:
        A callable with `decode_fn`'s signature and result.
    """
    config = config or TorchCompileConfig()
    if engine_dir is not None:
        load_compile_artifacts(engine_dir, device, manifest)
    backend = "inductor" if config.enable_inductor else "aot_eager"
    compiled = torch.compile(decode_fn, fullgraph=config.enable_fullgraph, dynamic=False, backend=backend)

    @functools.wraps(decode_fn)
    def step(model, drafter, acceptance, kv_cache, input_ids, kv_lens, block_tables, sampling, drafter_state,
             accept_state, block_size, draft_lens=None, num_drafts=None):
        if sampling.host_work or draft_lens is not None or num_drafts is not None:
            # logit processing / log-probabilities (their sparse indices vary per step), per-row draft lengths or
            # on-demand drafts (a step compiled after load, `LLM.compile_decode_step`): eager
            return decode_fn(model, drafter, acceptance, kv_cache, input_ids, kv_lens, block_tables, sampling,
                             drafter_state, accept_state, block_size, draft_lens=draft_lens, num_drafts=num_drafts)
        if block_tables.shape[1] < MIN_TABLE_WIDTH:  # one graph for every width (dynamo specialises width 1)
            block_tables = torch.nn.functional.pad(block_tables, (0, MIN_TABLE_WIDTH - block_tables.shape[1]))
        mark_dynamic_dims(input_ids, kv_lens, block_tables, sampling, drafter_state, accept_state)
        return compiled(model, drafter, acceptance, kv_cache, input_ids, kv_lens, block_tables, sampling,
                        drafter_state, accept_state, block_size)

    step.compiled = compiled  # type: ignore[attr-defined]
    return step


def mark_dynamic_dims(input_ids: torch.Tensor, kv_lens: torch.Tensor, block_tables: torch.Tensor, sampling: Any,
                      drafter_state: tuple, accept_state: tuple) -> None:
    """Mark the batch dim of every per-request tensor and the block-table width as dynamic (not specialised)."""
    per_request = [input_ids, kv_lens, block_tables, *drafter_state, *accept_state,
                   *(getattr(sampling, f) for f in ("temperature", "top_k", "top_p", "seed"))]
    for t in per_request:
        if isinstance(t, torch.Tensor) and t.dim() > 0:
            torch._dynamo.maybe_mark_dynamic(t, 0)
    torch._dynamo.maybe_mark_dynamic(block_tables, 1)


# Stored artifacts --------------------------------------------------------------------------------------
def artifacts_usable(info: CompiledStepInfo | None, device: str | torch.device) -> tuple[bool, str]:
    """Whether artifacts described by `info` can be loaded here, and why not (a sentence) when they cannot."""
    if info is None:
        return False, "the engine has no stored compile artifacts (build it with --compile_step)"
    if not cache_api_available():
        return False, f"torch {torch.__version__} has no torch.compiler.load_cache_artifacts"
    if info.torch_version != torch.__version__:
        return False, f"they were made with torch {info.torch_version}, this is torch {torch.__version__}"
    kind = torch.device(device).type
    if info.device_type != kind:
        return False, f"they were made for device type {info.device_type}, this engine runs on {kind}"
    if kind == "cpu" and info.cpu_threads and info.cpu_threads != torch.get_num_threads():
        # Inductor's CPU code (and so its cache keys) depends on the thread count: every lookup would miss.
        return False, (f"they were made with {info.cpu_threads} torch threads, this process uses "
                       f"{torch.get_num_threads()} (torch.set_num_threads)")
    return True, ""


def load_compile_artifacts(engine_dir: str | Path, device: str | torch.device,
                           manifest: EngineManifest | None = None) -> bool:
    """Load the engine's stored compile artifacts into PyTorch's compile caches (and its kernel libraries into
    inductor's cache directory).

    Returns:
        True when loaded; False (with the reason logged) when absent, made with another torch version or device
        type, missing, corrupt, or rejected by torch. Never raises for a bad artifact: the step then compiles
        from scratch.
    """
    engine_dir = Path(engine_dir)
    manifest = manifest or EngineManifest.load(engine_dir)
    info = manifest.compiled_step
    ok, reason = artifacts_usable(info, device)
    if not ok:
        (logger.debug if info is None else logger.warning)("compile artifacts of %s ignored: %s", engine_dir, reason)
        return False
    assert info is not None  # usable artifacts exist
    data = _read_checked(engine_dir, info.file, info.sha256)
    if data is None:
        return False
    try:
        loaded = torch.compiler.load_cache_artifacts(data)
    except Exception as e:  # a torch-internal format error must not stop the engine from loading
        logger.warning("compile artifacts of %s ignored: torch could not load %s (%s: %s)", engine_dir, info.file,
                       type(e).__name__, e)
        return False
    if loaded is None:  # torch logs the cause (e.g. a corrupt file) and returns None
        logger.warning("compile artifacts of %s ignored: torch could not load %s (see torch's log)", engine_dir,
                       info.file)
        return False
    kernels = 0
    cache_dir, _ = inductor_cache() if info.kernels_file else (None, None)
    if info.kernels_file and cache_dir is not None:
        blob = _read_checked(engine_dir, info.kernels_file, info.kernels_sha256)
        kernels = _unpack_kernels(blob, Path(cache_dir())) if blob is not None else 0
    logger.info("loaded compile artifacts of %s (%d bytes, %d kernel libraries; torch %s, %s)", engine_dir,
                len(data), kernels, info.torch_version, info.device_type)
    return True


def save_compile_artifacts(engine_dir: str | Path, device: str | torch.device, batch_sizes: list[int],
                           draft_len: int, config: TorchCompileConfig,
                           kernels_dir: Path | None = None) -> CompiledStepInfo | None:
    """Write every compile artifact of this process to `engine_dir/compiled/` and describe it for the manifest.

    Args:
        kernels_dir: a private inductor cache directory whose built kernel libraries (`*.so`) to pack too: on
            CPU the cache artifacts hold kernel sources only, and rebuilding them with the C++ compiler is most of
            a compile. None: no kernels stored.
    Returns:
        The manifest entry, or None (logged) when torch has no mega-cache API or produced no artifacts.
    """
    if not cache_api_available():
        logger.warning("torch %s cannot save compile artifacts (no torch.compiler.save_cache_artifacts)",
                       torch.__version__)
        return None
    saved = torch.compiler.save_cache_artifacts()
    if not saved or not saved[0]:
        logger.warning("torch.compile produced no cache artifacts to store")
        return None
    data, cache_info = saved
    engine_dir = Path(engine_dir)
    (engine_dir / ARTIFACTS_FILE).parent.mkdir(parents=True, exist_ok=True)
    (engine_dir / ARTIFACTS_FILE).write_bytes(data)
    kernels = _pack_kernels(kernels_dir) if kernels_dir is not None else (b"", 0)
    if kernels[0]:
        (engine_dir / KERNELS_FILE).write_bytes(kernels[0])
    kinds = {kind: len(keys) for kind, keys in getattr(cache_info, "artifacts", {}).items() if keys}
    return CompiledStepInfo(
        file=ARTIFACTS_FILE, sha256=hashlib.sha256(data).hexdigest(), num_bytes=len(data), artifacts=kinds,
        kernels_file=KERNELS_FILE if kernels[0] else None, num_kernels=kernels[1],
        kernels_sha256=hashlib.sha256(kernels[0]).hexdigest() if kernels[0] else "",
        torch_version=torch.__version__, device_type=torch.device(device).type, draft_len=draft_len,
        cpu_threads=torch.get_num_threads() if torch.device(device).type == "cpu" else 0,
        batch_sizes=sorted(batch_sizes), enable_fullgraph=config.enable_fullgraph,
        enable_inductor=config.enable_inductor,
    )


def _read_checked(engine_dir: Path, name: str, sha256: str) -> bytes | None:
    path = engine_dir / name
    try:
        data = path.read_bytes()
    except OSError as e:
        logger.warning("compile artifacts of %s ignored: cannot read %s (%s)", engine_dir, path, e)
        return None
    if sha256 and hashlib.sha256(data).hexdigest() != sha256:
        logger.warning("compile artifacts of %s ignored: %s does not match the manifest's sha256", engine_dir, path)
        return None
    return data


def _pack_kernels(root: Path) -> tuple[bytes, int]:
    """A tar of the kernel libraries under inductor's cache dir `root` (`xx/<hash>[.main].so`), and their count."""
    files = sorted(f for f in root.glob("*/*.so") if _KERNEL_NAME.fullmatch(f.relative_to(root).as_posix()))
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w") as tar:
        for f in files:
            tar.add(f, arcname=f.relative_to(root).as_posix(), recursive=False)
    return (buf.getvalue() if files else b""), len(files)


def _unpack_kernels(blob: bytes, root: Path) -> int:
    """Write the kernel libraries of a `_pack_kernels` tar into `root` (existing files are kept); their count.

    Only regular files named like inductor's kernels are written (no links, no other paths); each one goes
    through a temporary file and an atomic rename, since other processes may share the cache directory.
    """
    count = 0
    with tarfile.open(fileobj=io.BytesIO(blob), mode="r") as tar:
        for member in tar.getmembers():
            if not (member.isfile() and _KERNEL_NAME.fullmatch(member.name)):
                continue
            dest = root / member.name
            if not dest.exists():
                dest.parent.mkdir(parents=True, exist_ok=True)
                tmp = dest.with_name(f".{dest.name}.{os.getpid()}.tmp")
                stream = tar.extractfile(member)
                if stream is None:  # (a regular file always has one)
                    continue
                tmp.write_bytes(stream.read())
                tmp.chmod(0o755)
                os.replace(tmp, dest)
            count += 1
    return count


# Build time --------------------------------------------------------------------------------------------
def default_warmup_batch_sizes(max_batch_size: int, cuda_graph_batch_sizes: list[int] | None = None) -> list[int]:
    """The batch sizes to warm up: the CUDA-graph sizes when configured, else 1, 2, 4, … and max_batch_size."""
    if cuda_graph_batch_sizes:
        return sorted({b for b in cuda_graph_batch_sizes if 0 < b <= max_batch_size} or {1})
    sizes, b = {max_batch_size}, 1
    while b < max_batch_size:
        sizes.add(b)
        b *= 2
    return sorted(sizes)
