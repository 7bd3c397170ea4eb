"""On a CUDA machine: the compiled kernels against the references, under torch.compile(fullgraph=True) and in a
CUDA graph (`gpu_check.py`, in a fresh process: this folder's conftest turns the interpreter on)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_compiled_kernels_on_cuda():
    pytest.importorskip("triton")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    out = subprocess.run([sys.executable, str(Path(__file__).with_name("gpu_check.py"))], env=env,
                         capture_output=True, text=True, timeout=1200)
    assert out.returncode == 0 and out.stdout.strip().endswith("OK"), out.stdout[-4000:] + out.stderr[-4000:]
