"""Choosing the ISA variant of nextn's CPU kernels (plugins/cpu_kernels.py): the CPU's best by default,
NEXTN_CPU_ISA forcing a lower one, bad names refused by name, the variant reported; the ARM64 variant compiled with a
cross compiler where one is installed (.ci/run installs Debian's g++-aarch64-linux-gnu)."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor

import pytest

from nextn.plugins import cpu_kernels


def test_the_default_is_the_best_variant_the_cpu_runs(monkeypatch):
    monkeypatch.delenv(cpu_kernels.ENV, raising=False)
    assert cpu_kernels._requested() == cpu_kernels.runnable()[0]
    # every CPU runs the portable one: generic, or on ARM64 neon (at::vec's NEON vectors are its portable build)
    assert cpu_kernels.runnable()[-1] == ("neon" if cpu_kernels.platform.machine() in ("aarch64", "arm64") else "generic")


def test_arm64_runs_neon_and_is_not_offered_generic_which_would_compile_as_neon(monkeypatch):
    monkeypatch.setattr(cpu_kernels.platform, "machine", lambda: "aarch64")
    assert cpu_kernels.runnable()[-1] == "neon" and set(cpu_kernels.runnable()) <= {"neon_dotprod", "neon"}
    generic = next(v for v in cpu_kernels.VARIANTS if v.name == "generic")
    assert cpu_kernels.missing(generic) == ["a CPU other than ARM64 (on ARM64 the portable build is the neon variant)"]
    monkeypatch.setenv(cpu_kernels.ENV, "generic")
    with pytest.raises(ValueError, match="generic: this CPU cannot run it .*ARM64.*; it runs .*neon"):
        cpu_kernels._requested()


@pytest.mark.parametrize("name", cpu_kernels.runnable())
def test_nextn_cpu_isa_forces_a_variant_the_cpu_runs(monkeypatch, name):
    monkeypatch.setenv(cpu_kernels.ENV, name.upper())
    assert cpu_kernels._requested() == name


def test_nextn_cpu_isa_refuses_unknown_names_and_variants_the_cpu_lacks(monkeypatch):
    monkeypatch.setenv(cpu_kernels.ENV, "avx1024")
    with pytest.raises(ValueError, match="'avx1024' is not a kernel variant; choose one of avx512_bf16, .*none"):
        cpu_kernels._requested()
    lacking = [v.name for v in cpu_kernels.VARIANTS if cpu_kernels.missing(v)]
    assert lacking  # an x86 CPU lacks neon, an ARM one avx2
    monkeypatch.setenv(cpu_kernels.ENV, lacking[0])
    with pytest.raises(ValueError, match=f"{lacking[0]}: this CPU cannot run it \\(it lacks .*\\); it runs"):
        cpu_kernels._requested()
    monkeypatch.setenv(cpu_kernels.ENV, "none")
    assert cpu_kernels._requested() is None


def test_use_refuses_what_the_cpu_cannot_run():
    lacking = [v.name for v in cpu_kernels.VARIANTS if cpu_kernels.missing(v)]
    with pytest.raises(ValueError, match="cannot run"):
        with cpu_kernels.use(lacking[0]):
            pass
    with pytest.raises(ValueError, match="unknown kernel variant"):
        with cpu_kernels.use("sse9"):
            pass


@pytest.mark.slow
@pytest.mark.parametrize("name", ["avx2", "none"])
def test_a_forced_variant_is_the_one_that_runs_and_is_reported(name):
    """A fresh process with NEXTN_CPU_ISA set: `python -m nextn.plugins.cpu_kernels` names it (the build is cached by
    the kernel tests)."""
    if name != "none" and name not in cpu_kernels.runnable():
        pytest.skip(f"this CPU does not run {name}")
    env = {**os.environ, cpu_kernels.ENV: name}
    r = subprocess.run([sys.executable, "-m", "nextn.plugins.cpu_kernels"], env=env, capture_output=True, text=True,
                       timeout=600)
    if name == "none":
        assert r.returncode == 1 and "off (NEXTN_CPU_ISA=none" in r.stdout
    else:
        assert r.returncode == 0, r.stderr
        # avx2 has no bf16 dot products: its int8 linears take int16 activations (int8_linear_cpu.cpp)
        assert r.stdout.startswith(f"nextn CPU kernels: {name}, int8 linears on int16 activations (this CPU runs ")
    bad = subprocess.run([sys.executable, "-m", "nextn.plugins.cpu_kernels"], capture_output=True, text=True,
                         env={**os.environ, cpu_kernels.ENV: "avx9000"}, timeout=120)
    assert bad.returncode == 1 and "'avx9000' is not a kernel variant" in bad.stdout


def test_no_compiler_gives_one_line_saying_how_to_get_one(monkeypatch):
    monkeypatch.setenv("CXX", "/nonexistent/g++")
    reason = cpu_kernels.build.__wrapped__("generic")
    assert "no C++ compiler" in reason and "apt-get install g++" in reason and "slower" in reason


@pytest.mark.slow
def test_the_arm64_variant_compiles_with_a_cross_compiler(tmp_path):
    """Each kernel source compiled for aarch64 as the neon variant (at::vec's NEON vectors), against torch's headers;
    the object holds the variant's name (`isa()`)."""
    cxx = shutil.which("aarch64-linux-gnu-g++")
    if cxx is None:
        pytest.skip("no aarch64 cross compiler (Debian: apt-get install g++-aarch64-linux-gnu; .ci/run installs it)")
    from torch.utils import cpp_extension

    includes = [f"-I{p}" for p in cpp_extension.include_paths()]
    neon = next(v for v in cpu_kernels.VARIANTS if v.name == "neon")

    def compile_one(src):
        obj = tmp_path / (src.stem + ".o")
        r = subprocess.run([cxx, "-std=c++20", "-O0", "-c", "-fPIC", "-fopenmp", *neon.cflags,
                            f"-DNEXTN_OPS={cpu_kernels.namespace('neon')}", *includes, str(src), "-o", str(obj)],
                           capture_output=True, text=True, timeout=600)
        return src, r, obj

    with ThreadPoolExecutor(max_workers=os.cpu_count() or 1) as pool:  # one compiler a core
        for src, r, obj in pool.map(compile_one, cpu_kernels.SOURCES):
            assert r.returncode == 0, f"{src.name}: {r.stderr[-3000:]}"
            assert obj.stat().st_size > 0
    assert b"neon" in (tmp_path / "woq_linear_cpu.o").read_bytes()


@pytest.mark.slow
def test_neon_dotprod_takes_w4a8_s_products_by_sdot_and_neon_without(tmp_path):
    """W4A8's int4 kernel compiled for both ARM64 variants: `sdot` in neon_dotprod's object, `smull` and no `sdot` in
    neon's (ARMv8.0, what every ARM64 CPU runs)."""
    cxx, objdump = shutil.which("aarch64-linux-gnu-g++"), shutil.which("aarch64-linux-gnu-objdump")
    if cxx is None or objdump is None:
        pytest.skip("no aarch64 cross compiler (Debian: apt-get install g++-aarch64-linux-gnu; .ci/run installs it)")
    from torch.utils import cpp_extension

    includes = [f"-I{p}" for p in cpp_extension.include_paths()]
    source = next(s for s in cpu_kernels.SOURCES if s.name == "woq_linear_cpu.cpp")

    def disassembly(variant):
        v, obj = next(v for v in cpu_kernels.VARIANTS if v.name == variant), tmp_path / f"{variant}.o"
        r = subprocess.run([cxx, "-std=c++20", "-O2", "-c", "-fPIC", "-fopenmp", *v.cflags,
                            f"-DNEXTN_OPS={cpu_kernels.namespace(variant)}", *includes, str(source), "-o", str(obj)],
                           capture_output=True, text=True, timeout=600)
        assert r.returncode == 0, r.stderr[-3000:]
        return subprocess.run([objdump, "-d", str(obj)], capture_output=True, text=True, timeout=120).stdout

    with ThreadPoolExecutor(max_workers=2) as pool:
        dot, base = pool.map(disassembly, ["neon_dotprod", "neon"])
    assert "\tsdot\t" in dot
    assert "\tsdot\t" not in base and "\tsmull\t" in base and "\tsadalp\t" in base


def test_a_variant_that_does_not_build_falls_to_the_next(monkeypatch):
    """The default choice is the best variant that builds (an old compiler may lack -mavx512bf16); a forced one that
    does not build leaves the kernels off, with its reason."""
    monkeypatch.delenv(cpu_kernels.ENV, raising=False)
    monkeypatch.setattr(cpu_kernels, "_active", [])
    best, *rest = cpu_kernels.runnable()
    monkeypatch.setattr(cpu_kernels, "build", lambda v: "no such flag" if v == best else None)
    assert cpu_kernels.variant() == (rest[0] if rest else None)  # ARM64 runs neon only: PyTorch's paths
    monkeypatch.setattr(cpu_kernels, "_active", [])
    monkeypatch.setenv(cpu_kernels.ENV, best)
    assert cpu_kernels.variant() is None and cpu_kernels.unavailable_reason() == "no such flag"


@pytest.mark.parametrize("name", [v for v in cpu_kernels.runnable() if v in ("avx2", "generic", "avx512_bf16")])
def test_the_load_log_names_the_variant_and_its_int8_activations(name):
    """`LLM(...)`'s load line says which variant runs and what its int8 linears multiply x as (int16 on every
    variant but avx512_bf16, which has bf16 dot products)."""
    from nextn.runtime.engine_loader import _kernels_line

    with cpu_kernels.use(name):
        want = "bf16" if name == "avx512_bf16" else "int16"
        assert _kernels_line() == f"{name} (int8 linears on {want} activations)"
    with cpu_kernels.use(None):
        assert _kernels_line() == "None"


def test_avx2_vnni_runs_on_avx_vnni_or_through_its_evex_stand_in(monkeypatch):
    """AVX-VNNI (Alder Lake and later) builds the variant with its own flags; AVX512-VNNI/VL without AVX-VNNI (Zen 4,
    Ice Lake) with the stand-in's (the same instructions' EVEX encoding); plain AVX2 lacks it, by name."""
    v = next(v for v in cpu_kernels.VARIANTS if v.name == "avx2_vnni")
    base = {"avx2", "fma", "f16c"}
    cases = [(base | {"avx_vnni"}, v.cflags), (base | {"avx_vnni", "avx512vl", "avx512_vnni"}, v.cflags),
             (base | {"avx512vl", "avx512_vnni"}, v.stand_in[1])]
    monkeypatch.setattr(cpu_kernels.platform, "machine", lambda: "x86_64")
    for flags, cflags in cases:
        monkeypatch.setattr(cpu_kernels, "cpu_flags", lambda flags=flags: flags)
        assert cpu_kernels.missing(v) == [] and cpu_kernels.compiler_flags(v) == cflags
    assert "-mavxvnni" in v.cflags and "-DNEXTN_VNNI_EVEX" in v.stand_in[1]
    monkeypatch.setattr(cpu_kernels, "cpu_flags", lambda: base | {"avx512vl"})
    assert cpu_kernels.missing(v) == ["avx_vnni"]


@pytest.mark.slow
@pytest.mark.parametrize("flags", ["own", "stand_in"])
def test_avx2_vnni_compiles_its_dot_products_in_each_encoding(tmp_path, flags):
    """The int8 kernels built with avx2_vnni's own flags hold VEX-encoded `vpdpbusd` / `vpdpwssd` on ymm (what
    AVX-VNNI CPUs run, whether or not this one can), with the stand-in's the EVEX ones; neither holds a zmm."""
    cxx, objdump = shutil.which("g++"), shutil.which("objdump")
    if cxx is None or objdump is None or cpu_kernels.platform.machine() not in ("x86_64", "AMD64"):
        pytest.skip("needs an x86-64 machine's g++ and binutils' objdump")
    from torch.utils import cpp_extension

    v = next(v for v in cpu_kernels.VARIANTS if v.name == "avx2_vnni")
    cflags = v.cflags if flags == "own" else v.stand_in[1]
    includes = [f"-I{p}" for p in cpp_extension.include_paths()]

    def disassembly(name):
        src, obj = next(s for s in cpu_kernels.SOURCES if s.name == name), tmp_path / f"{name}.o"
        r = subprocess.run([cxx, "-std=c++20", "-O2", "-c", "-fPIC", "-fopenmp", *cflags,
                            f"-DNEXTN_OPS={cpu_kernels.namespace('avx2_vnni')}", *includes, str(src), "-o", str(obj)],
                           capture_output=True, text=True, timeout=600)
        assert r.returncode == 0, r.stderr[-3000:]
        return subprocess.run([objdump, "-d", str(obj)], capture_output=True, text=True, timeout=120).stdout

    with ThreadPoolExecutor(max_workers=2) as pool:  # W4A8's vpdpbusd, the int8 linear's vpdpwssd
        dis = "".join(pool.map(disassembly, ["woq_linear_cpu.cpp", "int8_linear_cpu.cpp"]))
    dots = [line for line in dis.splitlines() if "vpdpbusd" in line or "vpdpwssd" in line]
    assert any("vpdpbusd" in d for d in dots) and any("vpdpwssd" in d for d in dots)
    assert all("ymm" in d for d in dots) and "zmm" not in dis
    # VEX: GNU objdump prints the {vex} pseudo-prefix; EVEX: the instruction's first byte is 0x62
    if flags == "own":
        assert all("{vex}" in d for d in dots)
    else:
        assert all("\t62 " in d and "{vex}" not in d for d in dots)
