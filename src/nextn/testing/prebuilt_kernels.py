"""A pytest plugin that loads nextn's CPU kernels from libraries built beforehand instead of compiling them at first
use: how the kernel tests run where the machine cannot compile them itself in reasonable time — an ARM64 Python
under qemu-user, whose kernels are cross-compiled on the host (`nextn.testing.arm64_emulation`).

    NEXTN_PREBUILT_KERNELS=DIR pytest -p nextn.testing.prebuilt_kernels tests/plugins ...

`DIR` holds `nextn_cpu_kernels_<variant>.so` per variant; `plugins/cpu_kernels.build` then loads that file
(`torch.ops.load_library`) where it would have called `torch.utils.cpp_extension.load`. A variant without a file
there fails to load, saying so (the tests asking for it fail: nothing is skipped silently). Everything after the load
is unchanged: `build` still checks that the library reports the variant it was loaded as (`isa()`).
"""

from __future__ import annotations

import os
from pathlib import Path

ENV = "NEXTN_PREBUILT_KERNELS"


def _load_prebuilt(directory: Path):
    def load(name: str, *args, **kwargs) -> None:
        library = directory / f"{name}.so"
        if not library.is_file():
            raise FileNotFoundError(f"{ENV}={directory}: no prebuilt {library.name} there")
        import torch

        torch.ops.load_library(str(library))

    return load


def pytest_configure(config) -> None:
    directory = os.environ.get(ENV)
    if not directory:
        raise RuntimeError(f"-p nextn.testing.prebuilt_kernels needs {ENV}=<folder of nextn_cpu_kernels_*.so>")
    from torch.utils import cpp_extension

    cpp_extension.load = _load_prebuilt(Path(directory))
