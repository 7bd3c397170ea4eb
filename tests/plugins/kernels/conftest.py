"""Kernel tests run the Triton kernels on CPU tensors through Triton's interpreter.

`TRITON_INTERPRET=1` must be in the environment before a kernel is decorated: the kernel modules build their
`@triton.jit` functions on first launch, and nothing launches a kernel on CPU unless forced, so setting it here at
import time is early enough even when other test folders have imported `nextn` already.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

# Not on a GPU machine: there the kernels compile for real, and a kernel built under the interpreter here would be
# one the CUDA graph tests of the same session cannot launch (wrap_triton refuses an interpreted function).
if not os.environ.get("CUDA_VISIBLE_DEVICES") and not Path("/dev/nvidia0").exists():
    os.environ.setdefault("TRITON_INTERPRET", "1")


@pytest.fixture
def kernels():
    """Force every dispatcher through its Triton launcher for the test (skips when triton is absent or the
    interpreter is off, since CPU tensors cannot reach a compiled kernel)."""
    pytest.importorskip("triton")
    if os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("TRITON_INTERPRET is not 1: kernels cannot run on CPU tensors")
    from nextn.plugins.kernels import dispatch
    from nextn.plugins.kernels.slot_mapping import slot_mapping_kernel
    from triton.runtime.interpreter import InterpretedFunction

    assert isinstance(slot_mapping_kernel, InterpretedFunction), "kernels were built before TRITON_INTERPRET=1"
    with dispatch.forced_kernels():
        yield
