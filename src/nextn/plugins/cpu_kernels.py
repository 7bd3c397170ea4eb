"""Builds nextn's C++ CPU kernels (`*_cpu.cpp` in this folder) for the CPU's best ISA variant and loads them, once.

Kernels: `woq_linear_cpu.cpp` (weight-only int4 / int8 linears, `woq_linear.py`), `paged_attention_cpu.cpp`
(`paged_attention.py`), `decoder_layer_cpu.cpp` (a whole Llama decoder layer over the first two,
`decoder_layer.py`), `dense_linear_cpu.cpp` (batch-invariant bf16 / fp16 / fp32 linears, `dense_linear.py`) and
`moe_cpu.cpp` (an MoE layer's routed experts over the int4 kernel, `moe_experts.py`), `gated_delta_cpu.cpp`
(Gated DeltaNet's recurrence, `gated_delta.py`), `mla_cpu.cpp` (DeepSeek's MLA, absorbed, `mla.py`) and
`rms_norm_cpu.cpp` (the norms of layers that run as modules, `rms_norm.py`);
`cpu_kernels.h` declares what they share, `simd.h` is the SIMD layer they are written over (ATen's `at::vec` plus a
few primitives per ISA), so each kernel is one source for every variant:

| variant       | CPUs                                                     | needs (/proc/cpuinfo flags)                   |
|---------------|----------------------------------------------------------|-----------------------------------------------|
| `avx512_bf16` | AMD Zen 4/5, Intel Sapphire Rapids and later             | AVX-512 F/BW/VL/DQ, VNNI, AVX512-BF16, FMA, F16C |
| `avx512`      | Intel Cascade Lake / Ice Lake, cloud VMs that mask BF16  | AVX-512 F/BW/VL/DQ, VNNI, FMA, F16C             |
| `avx2_vnni`   | Intel Core 12th gen+ (Alder Lake on), Xeon 6 E-cores     | AVX2, FMA, F16C, AVX-VNNI (*)                  |
| `avx2`        | Intel Haswell to Comet Lake, AMD Zen 1-3                 | AVX2, FMA, F16C                                |
| `neon_dotprod`| ARM64 with ARMv8.2's dot products (Graviton 2+, Ampere)  | an aarch64 CPU, `asimddp`                      |
| `neon`        | ARM64 (Apple M, Graviton, Ampere)                        | an aarch64 CPU                                 |
| `generic`     | any other CPU                                            | a C++ compiler, a CPU other than ARM64         |

`neon_dotprod` is `neon` with W4A8's int8 products by `sdot` (outputs bit-identical: integer sums).

(*) `avx2_vnni` is `avx2` with 256-bit int8 / int16 dot products (`vpdpbusd`, `vpdpwssd`: W4A8 and the int8 linears).
A CPU with AVX512-VNNI/VL but not AVX-VNNI (Zen 4, Ice Lake) runs it too, built with those two instructions in their
EVEX encoding (inline assembly; all else compiled as for AVX-VNNI): never its best variant, but how the variant is
tested and measured there.

The best variant the CPU runs (and the compiler builds) is chosen at the first use; `NEXTN_CPU_ISA=<variant>` forces a lower one (`none`:
nextn's kernels off, PyTorch's per-op paths), and a variant the CPU cannot run, or an unknown name, is refused by
name (`ValueError`). Each variant compiles on first use with `torch.utils.cpp_extension` (g++ with OpenMP, ~30-60 s
once per machine and variant; cached under `TORCH_EXTENSIONS_DIR`, default `~/.cache/torch_extensions`, rebuilt
when a source changes) as its own library whose ops are `torch.ops.nextn_<variant>.*`: `ops()` is the chosen
variant's namespace, and several variants can be loaded in one process (the tests compare them). Where no variant
can load (no compiler), `available()` is False with the reason in `unavailable_reason()`, one warning is logged,
and every caller keeps its PyTorch path. The ops get fake (meta) implementations, so `torch.compile` traces them
as opaque calls.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import hashlib
import logging
import os
import platform
import shutil
import sys
from pathlib import Path

import torch

logger = logging.getLogger(__name__)

ENV = "NEXTN_CPU_ISA"
SOURCES = [Path(__file__).with_name(n) for n in ("woq_linear_cpu.cpp", "int8_linear_cpu.cpp",
                                                "paged_attention_cpu.cpp", "decoder_layer_cpu.cpp",
                                                "dense_linear_cpu.cpp", "moe_cpu.cpp", "gated_delta_cpu.cpp",
                                                "mla_cpu.cpp", "rms_norm_cpu.cpp",
                                                "deltanet_layer_cpu.cpp")]
HEADERS = [Path(__file__).with_name(n) for n in ("cpu_kernels.h", "simd.h", "simd_int8.h", "simd_int16.h",
                                                "int4_blocks.h", "layer_parts.h", "gated_deltanet.h")]


@dataclasses.dataclass(frozen=True)
class Variant:
    """One ISA level the kernels are compiled for: its name, the CPU flags it needs (as /proc/cpuinfo spells them),
    the machine it runs on, and the compiler flags (including ATen's `CPU_CAPABILITY` for `at::vec`)."""

    name: str
    machines: tuple[str, ...]
    cpu_flags: tuple[str, ...]
    cflags: tuple[str, ...]
    #: (CPU flags, compiler flags) that build the same instructions in another encoding where `cpu_flags` are lacking
    stand_in: tuple[tuple[str, ...], tuple[str, ...]] | None = None
    #: machines where the variant is not offered, and why
    not_on: tuple[tuple[str, ...], str] | None = None


_X86 = ("x86_64", "AMD64")
_ARM64 = ("aarch64", "arm64")
#: best first: the first one the CPU runs is the default
VARIANTS = (
    Variant("avx512_bf16", _X86,
            ("avx512f", "avx512bw", "avx512vl", "avx512dq", "avx512_vnni", "avx512_bf16", "fma", "f16c"),
            ("-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512dq", "-mavx512vnni", "-mavx512bf16", "-mfma", "-mf16c",
             "-DCPU_CAPABILITY=AVX512", "-DCPU_CAPABILITY_AVX512")),
    Variant("avx512", _X86, ("avx512f", "avx512bw", "avx512vl", "avx512dq", "avx512_vnni", "fma", "f16c"),
            ("-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512dq", "-mavx512vnni", "-mfma", "-mf16c",
             "-DCPU_CAPABILITY=AVX512", "-DCPU_CAPABILITY_AVX512")),
    Variant("avx2_vnni", _X86, ("avx2", "fma", "f16c", "avx_vnni"),
            ("-mavx2", "-mfma", "-mf16c", "-mavxvnni", "-DCPU_CAPABILITY=AVX2", "-DCPU_CAPABILITY_AVX2"),
            stand_in=(("avx2", "fma", "f16c", "avx512vl", "avx512_vnni"),
                      ("-mavx2", "-mfma", "-mf16c", "-DNEXTN_VNNI_EVEX", "-DCPU_CAPABILITY=AVX2",
                       "-DCPU_CAPABILITY_AVX2"))),
    Variant("avx2", _X86, ("avx2", "fma", "f16c"),
            ("-mavx2", "-mfma", "-mf16c", "-DCPU_CAPABILITY=AVX2", "-DCPU_CAPABILITY_AVX2")),
    Variant("neon_dotprod", _ARM64, ("asimddp",), ("-march=armv8.2-a+dotprod", "-DCPU_CAPABILITY=DEFAULT")),
    Variant("neon", _ARM64, (), ("-DCPU_CAPABILITY=DEFAULT",)),
    # at::vec vectorizes with NEON on every ARM64 build (NEON is part of ARMv8-A): compiled there, the portable source
    # is the neon variant
    Variant("generic", (), (), ("-DCPU_CAPABILITY=DEFAULT",),
            not_on=(_ARM64, "a CPU other than ARM64 (on ARM64 the portable build is the neon variant)")),
)
_BY_NAME = {v.name: v for v in VARIANTS}
_COMMON_CFLAGS = ("-O3", "-fopenmp", "-fvisibility=hidden")


@functools.cache
def cpu_flags() -> set[str]:
    """The CPU's feature flags as /proc/cpuinfo spells them (x86 `flags`, ARM `Features`), with, on ARM64 Linux, those
    of the kernel's hardware capabilities (`getauxval(AT_HWCAP)`: what /proc/cpuinfo lists, and all that qemu-user
    reports); empty where unreadable."""
    flags: set[str] = set()
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        text = ""
    for line in text.splitlines():
        if line.startswith(("flags", "Features")):
            flags = set(line.partition(":")[2].split())
            break
    return flags | _arm64_hwcaps()


#: arm64 Linux's AT_HWCAP bits (arch/arm64/include/uapi/asm/hwcap.h) by their /proc/cpuinfo names
_ARM64_HWCAP_BITS = {"asimd": 1, "asimddp": 20, "sve": 22}


def _arm64_hwcaps() -> set[str]:
    if platform.machine() not in _ARM64:
        return set()
    try:
        import ctypes

        getauxval = ctypes.CDLL(None).getauxval
        getauxval.restype, getauxval.argtypes = ctypes.c_ulong, [ctypes.c_ulong]
        bits = getauxval(16)  # AT_HWCAP
    except (OSError, AttributeError):  # not Linux (macOS: no getauxval)
        return set()
    return {name for name, bit in _ARM64_HWCAP_BITS.items() if bits >> bit & 1}


def missing(variant: Variant) -> list[str]:
    """What this machine lacks to run `variant` (empty: it runs it)."""
    if variant.machines and platform.machine() not in variant.machines:
        return [f"a {'/'.join(variant.machines[:1])} CPU (this is {platform.machine()})"]
    if variant.not_on is not None and platform.machine() in variant.not_on[0]:
        return [variant.not_on[1]]
    flags = cpu_flags()
    return [] if _by_stand_in(variant) else [f for f in variant.cpu_flags if f not in flags]


def _by_stand_in(variant: Variant) -> bool:
    """Whether this CPU runs `variant` only through its stand-in (it lacks its own flags, has the stand-in's)."""
    flags = cpu_flags()
    return (variant.stand_in is not None and not all(f in flags for f in variant.cpu_flags)
            and all(f in flags for f in variant.stand_in[0]))


def compiler_flags(variant: Variant) -> tuple[str, ...]:
    """The compiler flags of `variant` on this CPU: its own, or its stand-in's where the CPU runs only that."""
    return variant.stand_in[1] if _by_stand_in(variant) else variant.cflags


def runnable() -> list[str]:
    """The variants this CPU runs, best first."""
    return [v.name for v in VARIANTS if not missing(v)]


def _requested() -> str | None:
    """The variant to use: NEXTN_CPU_ISA when set (validated), else the CPU's best; None for `none`.

    Raises:
        ValueError: NEXTN_CPU_ISA names no variant, or one this CPU cannot run."""
    want = os.environ.get(ENV, "").strip().lower()
    if not want:
        return runnable()[0]
    if want == "none":
        return None
    if want not in _BY_NAME:
        raise ValueError(f"{ENV}={want!r} is not a kernel variant; choose one of "
                         f"{', '.join(_BY_NAME)} or none")
    lacks = missing(_BY_NAME[want])
    if lacks:
        raise ValueError(f"{ENV}={want}: this CPU cannot run it (it lacks {', '.join(lacks)}); it runs "
                         f"{', '.join(runnable())}")
    return want


@functools.cache
def source_digest() -> str:
    """SHA-256 (hex) of the kernels' C++ sources and headers: what a measurement of their speed depends on (a step
    profile is measured again when it changes; the variant is part of its key too)."""
    h = hashlib.sha256()
    for path in (*SOURCES, *HEADERS):
        h.update(path.read_bytes())
    return h.hexdigest()


def _module_name(variant: str) -> str:
    return f"nextn_cpu_kernels_{variant}"


def namespace(variant: str) -> str:
    """The torch op namespace of a variant's kernels (`torch.ops.<namespace>.woq_int4_linear`, ...)."""
    return f"nextn_{variant}"


def build_flags(variant: Variant) -> list[str]:
    """The compiler flags of `variant`'s kernels besides torch's own (includes, `-std`, `-fPIC`): the optimization and
    OpenMP flags, the ISA's (`compiler_flags`), the op namespace and the headers' hash (torch rebuilds when a source or
    a flag changes, not a header: the hash goes in as a flag)."""
    headers = hashlib.sha256(b"".join(h.read_bytes() for h in HEADERS)).hexdigest()[:16]
    return [*_COMMON_CFLAGS, *compiler_flags(variant), f"-DNEXTN_OPS={namespace(variant.name)}",
            f"-DNEXTN_HEADER_HASH={headers}"]


@functools.cache
def build(variant: str) -> str | None:
    """Compile (first use) and load one variant's kernels; returns None on success, else why they are unavailable.
    Does not check that the CPU runs the variant (`missing`): loading is safe, calling is not."""
    v = _BY_NAME[variant]
    if shutil.which(os.environ.get("CXX", "c++")) is None:
        reason = ("no C++ compiler on PATH (install g++: `apt-get install g++`, `dnf install gcc-c++`; macOS: "
                  "`xcode-select --install`); without nextn's kernels decoding runs PyTorch's per-op paths, several "
                  "times slower, and batch invariance is not guaranteed")
        logger.warning("nextn: CPU kernels unavailable: %s", reason)
        return reason
    try:
        from torch.utils import cpp_extension

        name = _module_name(variant)
        if not _built_before(cpp_extension, name):
            print(f"compiling nextn's CPU kernels ({variant}) for this machine (once, ~30-60 s)", file=sys.stderr,
                  flush=True)
        with _ninja_on_path(), _build_lock(Path(cpp_extension._get_build_directory(name, verbose=False))):
            cpp_extension.load(name=name, sources=[str(s) for s in SOURCES], extra_cflags=build_flags(v),
                               extra_ldflags=["-fopenmp"], is_python_module=False, verbose=False)
    except Exception as e:  # no headers, a failed build: callers keep PyTorch's paths
        first = str(e).splitlines()[0] if str(e) else ""
        reason = f"building {', '.join(s.name for s in SOURCES)} ({variant}) failed ({type(e).__name__}: {first})"
        logger.warning("nextn: CPU kernels unavailable, using PyTorch's (slower): %s", reason)
        return reason
    ran = _ops_of(variant).isa()
    if ran != variant:  # the flags and the sources disagree on the variant: never run a kernel under a wrong name
        raise RuntimeError(f"nextn's {variant} kernels report being compiled as {ran!r}")
    _register_fakes(namespace(variant))
    return None


_active: list[str | None] = []  # the variant in use once chosen ([None]: none), so `use` can switch it


def _load() -> str | None:
    """Choose (NEXTN_CPU_ISA or the CPU's best) and load the kernels once; None on success, else why unavailable."""
    if not _active:
        chosen = _requested()
        if chosen is not None and not os.environ.get(ENV, "").strip():
            # the best variant that builds: a compiler too old for one's flags (-mavx512bf16 needs GCC 10) falls to
            # the next instead of to PyTorch's paths
            chosen = next((v for v in runnable() if build(v) is None), chosen)
        _active.append(chosen)
    if _active[0] is None:
        return f"{ENV}=none: nextn's CPU kernels are off"
    return build(_active[0])


def available() -> bool:
    """Whether nextn's CPU kernels are loaded (compiling them on the first call).

    Raises:
        ValueError: NEXTN_CPU_ISA names no variant, or one this CPU cannot run."""
    return _load() is None


def unavailable_reason() -> str | None:
    """Why the kernels are unavailable (None when they are)."""
    return _load()


def variant() -> str | None:
    """The ISA variant of the kernels in use (`avx512_bf16`, `avx512`, `avx2_vnni`, `avx2`, `neon_dotprod`, `neon`,
    `generic`), None where they are unavailable."""
    return _active[0] if available() else None


def ops():
    """The ops of the kernels in use (`torch.ops.nextn_<variant>`); call only where `available()`. Called for every
    kernel call: the namespace is looked up once per variant."""
    return _ops_of(_active[0])


@functools.cache
def _ops_of(variant: str):
    return getattr(torch.ops, namespace(variant))


def describe() -> str:
    """One line: which variant runs and which the CPU offers (what `nextn` prints and the benchmarks record)."""
    try:
        v = variant()
    except ValueError as e:
        return str(e)
    offered = ", ".join(runnable())
    if v is None:
        return f"nextn CPU kernels: off ({unavailable_reason()}); this CPU runs {offered}"
    int8 = ops().int8_linear_activations()  # what W8A16 linears and quantized lm_heads multiply x as here
    return (f"nextn CPU kernels: {v}, int8 linears on {int8} activations (this CPU runs {offered}; {ENV} forces a "
            "lower one)")


@contextlib.contextmanager
def use(name: str | None):
    """Run the block with the kernels of variant `name` (None: off), then restore the previous choice (tests and
    benchmarks comparing variants in one process).

    Raises:
        ValueError: an unknown variant or one this CPU cannot run; RuntimeError: it does not build here."""
    if name is not None:
        if name not in _BY_NAME:
            raise ValueError(f"unknown kernel variant {name!r}; choose one of {', '.join(_BY_NAME)}")
        if missing(_BY_NAME[name]):
            raise ValueError(f"this CPU cannot run the {name} kernels (it lacks {', '.join(missing(_BY_NAME[name]))})")
        reason = build(name)
        if reason is not None:
            raise RuntimeError(reason)
    _load()
    before = _active[0]
    _active[0] = name
    try:
        yield
    finally:
        _active[0] = before


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


@contextlib.contextmanager
def _build_lock(build_dir: Path):
    """Hold an exclusive lock on the build folder while torch builds or loads in it, and clear a stale `lock` file
    first: torch marks a build in progress with that file and waits, forever, for it to go away, so a build that was
    killed (Ctrl-C, a time-out) would hang every later load. A live build holds this lock (the OS drops it with its
    process), so a `lock` file seen while holding it is stale."""
    import fcntl

    build_dir.mkdir(parents=True, exist_ok=True)
    with open(build_dir / "nextn.flock", "w") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            stale = build_dir / "lock"
            if stale.exists():
                logger.warning("nextn: removing %s left by a build that did not finish", stale)
                stale.unlink(missing_ok=True)
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def _built_before(cpp_extension, name: str) -> bool:
    """Whether a build of the kernels already lies in torch's extension cache (best effort)."""
    try:
        return any(Path(cpp_extension._get_build_directory(name, verbose=False)).glob(f"{name}*.so"))
    except Exception:
        return False


def _register_fakes(ns: str) -> None:
    @torch.library.register_fake(f"{ns}::woq_int4_linear")
    def _(x, w, scale, zero8, group_size, bias, int8_activations=False):
        return x.new_empty((*x.shape[:-1], w.shape[0]))

    @torch.library.register_fake(f"{ns}::woq_int8_linear")
    def _(x, w, scale, bias):
        return x.new_empty((*x.shape[:-1], w.shape[0]))

    @torch.library.register_fake(f"{ns}::dense_linear")
    def _(x, w, bias, out_features):
        return x.new_empty((*x.shape[:-1], out_features))

    @torch.library.register_fake(f"{ns}::llama_decoder_layer")
    def _(x, cos_sin, kv_cache, slot_mapping, context_slots, visible, norms, qkv, o, gate_up, down,
          num_heads, num_kv_heads, group_size, eps, scale, int8_activations=False, sandwich=False, qk_norm=False,
          activation=0, residual_multiplier=1.0, pre_norms=True, qk_norm_all_heads=False, attn_softcap=0.0,
          attn_sinks=None, output_gate=False):
        return torch.empty_like(x)

    @torch.library.register_fake(f"{ns}::llama_decoder_stack")
    def _(x, cos_sin, kv_cache, slot_mapping, context_slots, visible, norms, qkv, o, gate_up, down, moe_routers,
          moe_gate_up, moe_down, arity, num_heads, num_kv_heads, group_size, eps, scale, int8_activations=False,
          sandwich=False, qk_norm=False, activation=0, cos_sin_local=None, visible_local=None, sliding=(),
          residual_multiplier=1.0, pre_norms=True, qk_norm_all_heads=False, attn_softcap=0.0, slot_mapping_local=None,
          context_slots_local=None, moe_top_k=0, moe_norm_topk=False):
        return torch.empty_like(x)

    @torch.library.register_fake(f"{ns}::moe_experts")
    def _(x, ids, weights, gate_up, down, group_size, int8_activations, gate_up_bias, down_bias, activation=0,
          alpha=1.702, limit=7.0):
        return torch.empty_like(x)

    @torch.library.register_fake(f"{ns}::mla_attention")
    def _(q_nope, q_pe, kv_b, kv_cache, context_slots, visible, scale):
        b, t, nh, p = q_nope.shape
        return q_nope.new_empty((b, t, nh * (kv_b.shape[1] - p)), dtype=torch.float32)

    @torch.library.register_fake(f"{ns}::rms_norm")
    def _(x, weight, eps):
        return torch.empty_like(x)

    @torch.library.register_fake(f"{ns}::paged_attention")
    def _(q, kv_cache, context_slots, visible, scale, softcap=0.0, sinks=None):
        b, t, nh, d = q.shape
        return q.new_empty((b, t, nh * d))


def main() -> int:
    """`python -m nextn.plugins.cpu_kernels`: build (first use) and name the variant in use, and the ones the CPU runs."""
    from nextn.plugins import cpu_kernels  # this module imported under its package name, not as __main__

    print(cpu_kernels.describe())
    return 0 if cpu_kernels.variant() is not None else 1


if __name__ == "__main__":
    sys.exit(main())
