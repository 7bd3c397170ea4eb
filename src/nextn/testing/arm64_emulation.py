"""nextn's kernel tests on ARM64 without an ARM64 machine: an ARM64 Python run by qemu-user, with PyTorch's aarch64
CPU wheel and nextn's ARM64 kernels (`neon_dotprod`, `neon`) cross-compiled on the host.

- The Python is Debian bookworm's `python3.11` for arm64: its packages (and the libraries it links) unpacked into a
  folder (`dpkg -x`, nothing installed on the host), run by `qemu-aarch64 -L <that folder>`.
- PyTorch is 2.10.0's aarch64 wheel from PyPI: the last release whose aarch64 wheel is a CPU build (2.11.0 to 2.13.0
  are CUDA builds: 420 MB, `libtorch_cuda.so`, importing cuBLAS). nextn's other dependencies are its pins, as aarch64
  wheels (`pip install --target --platform`).
- The ARM64 variants' kernels are compiled on the host with Debian's `g++-aarch64-linux-gnu` against that wheel's headers and
  libraries, with the flags `plugins/cpu_kernels.py` builds them with, and loaded in the tests by the pytest plugin
  `nextn.testing.prebuilt_kernels` (g++ under emulation would take hours). qemu's default ARM64 CPU (`max`) has
  ARMv8.2's dot products, so both variants run.

    python -m nextn.testing.arm64_emulation prepare     # runs/arm64: ~1.1 GB, a few minutes (apt-get, pip, g++)
    python -m nextn.testing.arm64_emulation pytest tests/plugins -n 2 --dist loadfile --ignore=tests/plugins/kernels

Needs a Debian-like host with `apt-get` (for the arm64 packages), `qemu-aarch64` (Debian: `qemu-user`) and
`aarch64-linux-gnu-g++` (`g++-aarch64-linux-gnu`); `.ci/run` installs the last two.
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import subprocess
import sys
import tomllib
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from nextn.plugins import cpu_kernels

_ROOT = Path(__file__).resolve().parents[3]
#: Where `prepare` puts the ARM64 Python, its packages and the kernels (git-ignored `runs/`).
DEFAULT_DIR = _ROOT / "runs" / "arm64"
#: The marker of a folder `prepare` made (it refuses to write into any other).
MARKER = ".nextn-arm64-emulation"
#: PyTorch's last aarch64 wheel on PyPI that is a CPU build.
TORCH = "torch==2.10.0"
#: Installed without their dependencies: they require torch, which the resolver would take as 2.13.0's CUDA wheel.
NO_DEPS = ("accelerate", "xgrammar")
#: torch's own dependencies on aarch64 (its wheel's `Requires-Dist` without the x86-64-only CUDA ones).
TORCH_DEPS = ("filelock", "typing-extensions", "sympy", "networkx", "jinja2", "fsspec")
#: Test dependencies the kernel tests import (`cpp_extension` imports setuptools).
TEST_DEPS = ("pytest", "pytest-xdist", "jsonschema", "setuptools")
#: Debian bookworm's arm64 python3.11 and what it links.
DEBIAN_PACKAGES = (
    "python3.11-minimal", "libpython3.11-minimal", "libpython3.11-stdlib", "python3.11", "libc6", "libgcc-s1",
    "libstdc++6", "libgomp1", "zlib1g", "libexpat1", "libffi8", "libssl3", "libbz2-1.0", "liblzma5", "libsqlite3-0",
    "libncursesw6", "libtinfo6", "libreadline8", "libuuid1", "libcrypt1", "libnsl2", "libtirpc3", "libdb5.3",
    "libgdbm6", "libzstd1", "libgssapi-krb5-2", "libkrb5-3", "libk5crypto3", "libkrb5support0", "libcom-err2",
    "libkeyutils1")
#: Set in the tests' environment: what qemu-user does not emulate is skipped, saying so (MADV_PAGEOUT).
UNDER_QEMU = "NEXTN_UNDER_QEMU"
_PLATFORMS = ("manylinux_2_28_aarch64", "manylinux2014_aarch64", "manylinux_2_17_aarch64", "linux_aarch64")
_APT_ARCHES = ("-o", "APT::Architectures::=amd64", "-o", "APT::Architectures::=arm64")


def _step(text: str) -> None:
    print(f"arm64 emulation: {text}", file=sys.stderr, flush=True)


def _run(cmd: list[str], **kwargs) -> None:
    r = subprocess.run(cmd, capture_output=True, text=True, **kwargs)
    if r.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd[:4])} ... failed ({r.returncode}): {(r.stderr or r.stdout)[-2000:]}")


def _tools() -> dict[str, str]:
    """The host tools `prepare` needs, by name. Raises RuntimeError naming what is missing and how to get it."""
    need = {"apt-get": "a Debian-like host", "dpkg": "a Debian-like host",
            "qemu-aarch64": "apt-get install qemu-user", "aarch64-linux-gnu-g++": "apt-get install g++-aarch64-linux-gnu"}
    found = {name: shutil.which(name) for name in need}
    lacking = [f"{name} ({need[name]})" for name, path in found.items() if path is None]
    if lacking:
        raise RuntimeError(f"ARM64 emulation needs {', '.join(lacking)}")
    return found  # type: ignore[return-value]


def _own_dir(directory: Path) -> None:
    """Create `directory`, or accept it where `prepare` made it before. Raises FileExistsError on any other."""
    if directory.exists() and any(directory.iterdir()) and not (directory / MARKER).exists():
        raise FileExistsError(f"{directory} exists and was not made by `arm64_emulation prepare`: not writing there")
    directory.mkdir(parents=True, exist_ok=True)
    (directory / MARKER).touch()


def _python_root(directory: Path) -> Path:
    """Debian's arm64 python3.11 unpacked into `directory/root` (apt's arm64 indexes fetched for the download only)."""
    root = directory / "root"
    if (root / "usr/bin/python3.11").exists():
        return root
    debs = directory / "debs"
    debs.mkdir(exist_ok=True)
    _step("downloading Debian's arm64 python3.11 packages")
    _run(["apt-get", *_APT_ARCHES, "update", "-qq"])
    _run(["apt-get", *_APT_ARCHES, "download", *(f"{p}:arm64" for p in DEBIAN_PACKAGES)], cwd=debs)
    for deb in sorted(debs.glob("*.deb")):
        _run(["dpkg", "-x", str(deb), str(root)])
    return root


def _requirements() -> tuple[list[str], list[str]]:
    """nextn's pinned dependencies and the test ones the kernel tests import, from pyproject.toml: (those resolved with
    their dependencies, those installed without)."""
    project = tomllib.loads((_ROOT / "pyproject.toml").read_text())["project"]
    name = lambda req: re.split(r"[=<>\[ ;]", req, maxsplit=1)[0].lower()  # noqa: E731
    runtime = [r for r in project["dependencies"] if name(r) not in ("torch", *NO_DEPS)]
    test = [r for r in project["optional-dependencies"]["test"] if name(r) in TEST_DEPS]
    unpinned = [t for t in TEST_DEPS if t not in {name(r) for r in test}]
    return [*runtime, *test, *unpinned, *TORCH_DEPS], [TORCH, *(r for r in project["dependencies"] if name(r) in NO_DEPS)]


def _site(directory: Path) -> Path:
    """The aarch64 wheels of nextn's dependencies in `directory/site` (a `--target` folder)."""
    site = directory / "site"
    if (site / "torch").is_dir():
        return site
    plain, no_deps = _requirements()
    platform = [a for p in _PLATFORMS for a in ("--platform", p)]
    common = ["--target", str(site), *platform, "--only-binary=:all:", "--python-version", "3.11",
              "--implementation", "cp", "--quiet", "--disable-pip-version-check"]
    _step(f"installing aarch64 wheels ({TORCH} and {len(plain) + len(no_deps) - 1} more, with their dependencies) into {site}")
    _run([sys.executable, "-m", "pip", "install", *common, *plain])
    _run([sys.executable, "-m", "pip", "install", "--upgrade", "--no-deps", *common, *no_deps])
    return site


def _kernels(directory: Path, site: Path, cxx: str) -> Path:
    """The ARM64 variants' kernels (`neon_dotprod`, `neon`) cross-compiled into `directory/kernels`, one library each
    (again when a source, a header or a flag changed)."""
    out = directory / "kernels"
    out.mkdir(exist_ok=True)
    torch_dir = site / "torch"
    jobs = []
    for variant in (v for v in cpu_kernels.VARIANTS if "aarch64" in v.machines):
        name = f"nextn_cpu_kernels_{variant.name}"
        flags = ["-std=c++20", "-fPIC", "-Wno-psabi", *cpu_kernels.build_flags(variant),
                 f"-DTORCH_EXTENSION_NAME={name}", "-DTORCH_API_INCLUDE_EXTENSION_H", "-isystem",
                 str(torch_dir / "include"), "-isystem", str(torch_dir / "include/torch/csrc/api/include")]
        stamp = out / f"{name}.digest"
        digest = f"{cpu_kernels.source_digest()} {' '.join(flags)}"
        if not ((out / f"{name}.so").exists() and stamp.exists() and stamp.read_text() == digest):
            jobs += [(variant.name, name, flags, source, stamp, digest) for source in cpu_kernels.SOURCES]
    if not jobs:
        return out
    _step(f"cross-compiling the ARM64 kernels ({len(jobs)} sources, {cxx})")

    def compile_one(job) -> Path:
        variant, _, flags, source, _, _ = job
        obj = out / variant / f"{source.stem}.o"
        obj.parent.mkdir(exist_ok=True)
        _run([cxx, *flags, "-c", str(source), "-o", str(obj)], timeout=1800)
        return obj

    with ThreadPoolExecutor(max_workers=os.cpu_count() or 1) as pool:
        objects = list(pool.map(compile_one, jobs))
    for name, stamp, digest in {(j[1], j[4], j[5]) for j in jobs}:
        variant = name.removeprefix("nextn_cpu_kernels_")
        _run([cxx, "-shared", "-fopenmp", *(str(o) for o in objects if o.parent.name == variant),
              f"-L{torch_dir / 'lib'}", "-lc10", "-ltorch_cpu", "-ltorch", "-o", str(out / f"{name}.so")])
        stamp.write_text(digest)
    return out


def _python(directory: Path, root: Path, qemu: str) -> Path:
    """A `python3` script running the ARM64 Python under qemu; `sys.executable` names it, so the subprocesses tests
    start (pytest-xdist's workers) run under qemu too."""
    script = directory / "bin" / "python3"
    script.parent.mkdir(exist_ok=True)
    script.write_text(f'#!/bin/sh\nexec {qemu} -L {root} -0 {script} {root}/usr/bin/python3.11 "$@"\n')
    script.chmod(0o755)
    return script


def prepare(directory: Path = DEFAULT_DIR) -> Path:
    """Make (or bring up to date) the ARM64 Python, its packages and the neon kernels in `directory`; returns the
    `python3` that runs it.

    Raises:
        RuntimeError: a host tool is missing, or a download or a build failed (its output's tail).
        FileExistsError: `directory` holds files `prepare` did not make."""
    tools = _tools()
    _own_dir(directory)
    root = _python_root(directory)
    site = _site(directory)
    _kernels(directory, site, tools["aarch64-linux-gnu-g++"])
    python = _python(directory, root, tools["qemu-aarch64"])
    r = subprocess.run([str(python), "-c", "import platform, torch; print(platform.machine(), torch.__version__)"],
                       capture_output=True, text=True, env=_env(directory), timeout=600)
    if r.returncode != 0:
        raise RuntimeError(f"the ARM64 Python does not start: {r.stderr[-2000:]}")
    _step(f"ready: {r.stdout.strip()} under {tools['qemu-aarch64']}")
    return python


def _env(directory: Path) -> dict[str, str]:
    from nextn.testing import prebuilt_kernels

    return {**os.environ, "PYTHONPATH": os.pathsep.join([str(directory / "site"), str(_ROOT / "src")]),
            prebuilt_kernels.ENV: str(directory / "kernels"), UNDER_QEMU: "1"}


def run_pytest(args: list[str], directory: Path = DEFAULT_DIR) -> int:
    """pytest under the ARM64 Python, with the prebuilt kernels; returns its exit status."""
    python = directory / "bin" / "python3"
    if not python.exists():
        raise FileNotFoundError(f"{python}: run `python -m nextn.testing.arm64_emulation prepare` first")
    cmd = [str(python), "-m", "pytest", "-p", "nextn.testing.prebuilt_kernels", "-p", "no:cacheprovider", *args]
    return subprocess.run(cmd, env=_env(directory), cwd=_ROOT).returncode


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m nextn.testing.arm64_emulation", description=__doc__.split("\n\n")[0])
    p.add_argument("--dir", type=Path, default=DEFAULT_DIR, help=f"the working folder (default {DEFAULT_DIR})")
    sub = p.add_subparsers(dest="command", required=True)
    sub.add_parser("prepare", help="the ARM64 Python, its packages and the cross-compiled neon kernels")
    sub.add_parser("pytest", help="run pytest under it (the arguments after `pytest` go to pytest)",
                   add_help=False)
    args, rest = p.parse_known_args(argv)
    try:
        if args.command == "prepare":
            prepare(args.dir)
            return 0
        return run_pytest(rest, args.dir)
    except (RuntimeError, FileExistsError, FileNotFoundError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
