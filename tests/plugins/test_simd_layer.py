"""The SIMD layer the kernels are written over (`plugins/simd.h`: at::vec plus per-ISA primitives) against scalar
references (`simd_check.cpp`, a program of its own: torch's headers, not its library): natively for every x86
variant this CPU runs, and the ARM64 (NEON) variant cross-compiled and run under qemu-user, in CI. (The kernel tests
themselves run on ARM64 under qemu too, with PyTorch's last aarch64 CPU wheel: `nextn.testing.arm64_emulation`, a
command, not CI: it downloads ~1 GB.)"""

from __future__ import annotations

import re
import shutil
import subprocess
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
from torch.utils import cpp_extension

from nextn.plugins import cpu_kernels

HERE = Path(__file__).parent
PLUGINS = Path(cpu_kernels.__file__).parent
X86 = [v for v in cpu_kernels.runnable() if not v.startswith("neon")]


def _build(cxx: str, variant: str, out: Path, *extra: str) -> Path:
    flags = cpu_kernels.compiler_flags(next(v for v in cpu_kernels.VARIANTS if v.name == variant))
    includes = [f"-I{p}" for p in cpp_extension.include_paths()]
    r = subprocess.run([cxx, "-std=c++20", "-O2", *flags, *extra, *includes, f"-I{PLUGINS}",
                        str(HERE / "simd_check.cpp"), "-o", str(out)], capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    return out


def _run(cmd: list[str]) -> tuple[int, str]:
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    return r.returncode, r.stdout


def _result(stdout: str) -> tuple[str, int, int]:
    m = re.search(r"^(\w+): (\d+) checks, (\d+) failures$", stdout, re.M)
    assert m, stdout[-2000:]
    return m[1], int(m[2]), int(m[3])


@pytest.mark.slow
def test_every_x86_variant_this_cpu_runs_passes(tmp_path):
    cxx = shutil.which("g++") or shutil.which("c++")
    if cxx is None or not X86:
        pytest.skip("no C++ compiler, or no x86 variant runs here")
    with ThreadPoolExecutor(max_workers=2) as pool:
        built = list(pool.map(lambda v: (v, _build(cxx, v, tmp_path / v)), X86))
    for variant, exe in built:
        rc, out = _run([str(exe)])
        name, checks, failures = _result(out)
        assert (rc, name, failures) == (0, variant, 0), out[-2000:]
        assert checks > 10_000


@pytest.mark.slow
def test_the_checks_catch_an_inexact_build(tmp_path):
    """The control: the portable variant built with -ffast-math (reciprocal division, reassociated sums) fails."""
    cxx = shutil.which("g++")
    if cxx is None or "generic" not in cpu_kernels.runnable():
        pytest.skip("no g++, or the portable variant does not run here")
    rc, out = _run([str(_build(cxx, "generic", tmp_path / "fast", "-ffast-math"))])
    assert rc == 1 and _result(out)[2] > 0, out[-2000:]


@pytest.mark.slow
@pytest.mark.parametrize("variant", ["neon", "neon_dotprod"])
def test_the_arm64_variants_pass_under_qemu(tmp_path, variant):
    """qemu-user's default ARM64 CPU (`max`) has ARMv8.2's dot products: both ARM64 variants run."""
    cxx, qemu = shutil.which("aarch64-linux-gnu-g++"), shutil.which("qemu-aarch64")
    if cxx is None or qemu is None:
        pytest.skip("needs Debian's g++-aarch64-linux-gnu and qemu-user (.ci/run installs both)")
    exe = _build(cxx, variant, tmp_path / variant, "-static")
    rc, out = _run([qemu, str(exe)])
    name, checks, failures = _result(out)
    assert (rc, name, failures) == (0, variant, 0), out[-2000:]
    assert checks > 10_000
