"""Builds and loads nextn's C++ CPU kernels (`*_cpu.cpp` in this folder) as one PyTorch extension, once.

Kernels: `woq_linear_cpu.cpp` (weight-only int4 / int8 linears, `woq_linear.py`), `paged_attention_cpu.cpp`
(`paged_attention.py`), `decoder_layer_cpu.cpp` (a whole Llama decoder layer over the first two,
`decoder_layer.py`) and `dense_linear_cpu.cpp` (batch-invariant bf16 / fp16 / fp32 linears, `dense_linear.py`);
`cpu_kernels.h` declares what they share. They are compiled on first use with `torch.utils.cpp_extension` (g++ with OpenMP, ~30–60 s
once per machine; cached under `TORCH_EXTENSIONS_DIR`, default `~/.cache/torch_extensions`, and rebuilt when a
source changes) and only on x86-64 CPUs with AVX-512 F/BW/VL, AVX512-BF16 and FMA. Where that is not possible
(another CPU, no compiler), `available()` is False with the reason in `unavailable_reason()`, one warning is logged,
and every caller keeps its PyTorch path. The ops get fake (meta) implementations here, so `torch.compile` traces
them as opaque calls.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import logging
import os
import platform
import sys
from pathlib import Path

import torch

logger = logging.getLogger(__name__)

_NAME = "nextn_cpu_kernels"
SOURCES = [Path(__file__).with_name(n) for n in ("woq_linear_cpu.cpp", "paged_attention_cpu.cpp",
                                                "decoder_layer_cpu.cpp", "dense_linear_cpu.cpp")]
HEADER = Path(__file__).with_name("cpu_kernels.h")
_CPU_FLAGS = ("avx512f", "avx512bw", "avx512vl", "avx512_bf16", "avx512_vnni", "fma")
_CFLAGS = ["-O3", "-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512bf16", "-mavx512vnni", "-mfma", "-fopenmp"]


def _cpu_flags() -> set[str]:
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return set()
    for line in text.splitlines():
        if line.startswith("flags"):
            return set(line.partition(":")[2].split())
    return set()


@functools.cache
def source_digest() -> str:
    """SHA-256 (hex) of the kernels' C++ sources and header: what a measurement of their speed depends on (a step
    profile is measured again when it changes)."""
    h = hashlib.sha256()
    for path in (*SOURCES, HEADER):
        h.update(path.read_bytes())
    return h.hexdigest()


@functools.cache
def _load() -> str | None:
    """Compile and load the kernels once; returns None on success, else why they are unavailable."""
    if platform.machine() not in ("x86_64", "AMD64"):
        return f"needs an x86-64 CPU (this is {platform.machine()})"
    missing = [f for f in _CPU_FLAGS if f not in _cpu_flags()]
    if missing:
        return f"the CPU lacks {', '.join(missing)}"
    try:
        from torch.utils import cpp_extension

        if not _built_before(cpp_extension):
            print("compiling nextn's CPU kernels for this machine (once, ~30-60 s)", file=sys.stderr, flush=True)
        with _ninja_on_path():
            # torch rebuilds when a source or a flag changes, not a header: the header's hash goes in as a flag
            header = hashlib.sha256(HEADER.read_bytes()).hexdigest()[:16]
            cpp_extension.load(name=_NAME, sources=[str(s) for s in SOURCES],
                               extra_cflags=[*_CFLAGS, f"-DNEXTN_HEADER_HASH={header}"],
                               extra_ldflags=["-fopenmp"], is_python_module=False, verbose=False)
    except Exception as e:  # no compiler, no headers, a failed build: callers keep PyTorch's paths
        first = str(e).splitlines()[0] if str(e) else ""
        reason = f"building {', '.join(s.name for s in SOURCES)} failed ({type(e).__name__}: {first})"
        logger.warning("nextn: CPU kernels unavailable, using PyTorch's (slower): %s", reason)
        return reason
    _register_fakes()
    return None


@contextlib.contextmanager
def _ninja_on_path():
    """cpp_extension runs `ninja` from PATH; the `ninja` wheel (a dependency) puts it in the venv, which is not on
    PATH when Python is started as .venv/bin/python. Prepend it for the build, then restore PATH."""
    try:
        import ninja
    except ImportError:
        yield
        return
    old = os.environ.get("PATH", "")
    os.environ["PATH"] = ninja.BIN_DIR + os.pathsep + old
    try:
        yield
    finally:
        os.environ["PATH"] = old


def _built_before(cpp_extension) -> bool:
    """Whether a build of the kernels already lies in torch's extension cache (best effort)."""
    try:
        return any(Path(cpp_extension._get_build_directory(_NAME, verbose=False)).glob(f"{_NAME}*.so"))
    except Exception:
        return False


def available() -> bool:
    """Whether nextn's CPU kernels are loaded (compiling them on the first call)."""
    return _load() is None


def unavailable_reason() -> str | None:
    """Why the kernels are unavailable (None when they are)."""
    return _load()


def _register_fakes() -> None:
    @torch.library.register_fake("nextn::woq_int4_linear")
    def _(x, w, scale, zero8, group_size, bias, int8_activations=False):
        return x.new_empty((*x.shape[:-1], w.shape[0]))

    @torch.library.register_fake("nextn::woq_int8_linear")
    def _(x, w, scale, bias):
        return x.new_empty((*x.shape[:-1], w.shape[0]))

    @torch.library.register_fake("nextn::dense_linear")
    def _(x, w, bias, out_features):
        return x.new_empty((*x.shape[:-1], out_features))

    @torch.library.register_fake("nextn::llama_decoder_layer")
    def _(x, cos_sin, kv_cache, slot_mapping, context_slots, visible, input_norm, post_norm, qkv, o, gate_up, down,
          num_heads, num_kv_heads, group_size, eps, scale, int8_activations=False):
        return torch.empty_like(x)

    @torch.library.register_fake("nextn::llama_decoder_stack")
    def _(x, cos_sin, kv_cache, slot_mapping, context_slots, visible, norms, qkv, o, gate_up, down, arity, num_heads,
          num_kv_heads, group_size, eps, scale, int8_activations=False):
        return torch.empty_like(x)

    @torch.library.register_fake("nextn::paged_attention")
    def _(q, kv_cache, context_slots, visible, scale):
        b, t, nh, d = q.shape
        return q.new_empty((b, t, nh * d))
