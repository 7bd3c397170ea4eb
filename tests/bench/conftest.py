"""Benchmark tests run tiny engine steps: pin torch to one thread while they run."""

from __future__ import annotations

import pytest
import torch


@pytest.fixture(autouse=True, scope="module")
def _one_thread():
    """One torch thread: on a busy 2-core machine, two spinning OpenMP threads make these tiny steps 10-100x slower."""
    old = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(old)
