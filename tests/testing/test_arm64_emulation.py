"""The ARM64 emulation harness (`nextn.testing.arm64_emulation`, a command: its ~1 GB download is not CI's) and the
pytest plugin it runs the kernel tests with (`nextn.testing.prebuilt_kernels`), checked natively: the plugin loads
this machine's own kernels from a folder instead of compiling them, the harness pins a CPU build of torch for
aarch64 and refuses to write where it did not create."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from nextn.plugins import cpu_kernels
from nextn.testing import arm64_emulation, prebuilt_kernels


@pytest.mark.slow
def test_the_plugin_loads_a_prebuilt_library_instead_of_compiling(tmp_path):
    """This CPU's best variant, built as usual, copied into a folder; a fresh process with the plugin loads it from
    there (the compiler is made unreachable: a build would fail) and runs it under its own name."""
    best = cpu_kernels.runnable()[0]
    if cpu_kernels.build(best) is not None:
        pytest.skip(f"the {best} kernels do not build here: {cpu_kernels.build(best)}")
    from torch.utils import cpp_extension

    name = f"nextn_cpu_kernels_{best}"
    # run by the harness itself (under qemu), the kernels in use were loaded from its folder: copy that one
    where = os.environ.get(prebuilt_kernels.ENV) or cpp_extension._get_build_directory(name, verbose=False)
    built = next(Path(where).glob(f"{name}*.so"))
    (tmp_path / f"{name}.so").write_bytes(built.read_bytes())
    code = ("from nextn.testing import prebuilt_kernels; prebuilt_kernels.pytest_configure(None)\n"
            "from nextn.plugins import cpu_kernels; print(cpu_kernels.describe())")
    env = {**os.environ, prebuilt_kernels.ENV: str(tmp_path), "PATH": "/nonexistent", "CXX": sys.executable,
           "TORCH_EXTENSIONS_DIR": str(tmp_path / "ext")}
    r = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    assert r.stdout.startswith(f"nextn CPU kernels: {best}, "), r.stdout
    (tmp_path / f"{name}.so").unlink()  # the control: without the file, the variant fails to load, saying why
    r = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    assert "off (" in r.stdout and f"no prebuilt {name}.so there" in r.stdout, r.stdout


def test_the_plugin_refuses_to_run_without_its_folder(monkeypatch):
    monkeypatch.delenv(prebuilt_kernels.ENV, raising=False)
    with pytest.raises(RuntimeError, match=f"needs {prebuilt_kernels.ENV}="):
        prebuilt_kernels.pytest_configure(None)


def test_the_harness_pins_torch_s_last_aarch64_cpu_wheel_and_nextn_s_other_pins():
    resolved, no_deps = arm64_emulation._requirements()
    assert no_deps[0] == "torch==2.10.0" and not any(r.startswith("torch==2.13") for r in resolved + no_deps)
    assert "numpy==1.26.4" in resolved and "pytest-xdist==3.8.0" in resolved and "setuptools" in resolved
    # accelerate and xgrammar require torch: installed without dependencies, else the resolver takes 2.13's CUDA wheel
    assert [r.split("==")[0] for r in no_deps[1:]] == ["accelerate", "xgrammar"]


def test_the_harness_writes_only_into_a_folder_it_made(tmp_path):
    foreign = tmp_path / "mine"
    foreign.mkdir()
    (foreign / "notes.txt").write_text("keep")
    with pytest.raises(FileExistsError, match="was not made by"):
        arm64_emulation._own_dir(foreign)
    assert (foreign / "notes.txt").read_text() == "keep" and not (foreign / arm64_emulation.MARKER).exists()
    ours = tmp_path / "arm64"
    arm64_emulation._own_dir(ours)
    (ours / "root").mkdir()
    arm64_emulation._own_dir(ours)  # made before: accepted


def test_pytest_before_prepare_says_what_to_run(tmp_path, capsys):
    assert arm64_emulation.main(["--dir", str(tmp_path / "none"), "pytest", "-q"]) == 1
    assert "arm64_emulation prepare` first" in capsys.readouterr().err
