"""`plugins/page_release.py`: the pages of an mmap'd engine tensor whose values were copied leave the resident set,
the tensor stays readable with the same values (the hint is non-destructive), and anonymous memory is untouched."""

from __future__ import annotations

import os
import re
import sys

import pytest
import torch
from safetensors.torch import load_file, save_file

from nextn.plugins import page_release

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="madvise and /proc/self/smaps: Linux")


def _resident_bytes(path_part: str) -> int:
    """Rss of this process's mappings of the file whose path contains `path_part` (kB from smaps → bytes)."""
    total, inside = 0, False
    for line in open("/proc/self/smaps"):
        if re.match(r"^[0-9a-f]+-[0-9a-f]+ ", line):
            inside = path_part in line
        elif inside and line.startswith("Rss:"):
            total += int(line.split()[1]) * 1024
    return total


def test_released_file_pages_leave_the_resident_set_and_keep_their_values(tmp_path):
    if os.environ.get("NEXTN_UNDER_QEMU"):  # nextn.testing.arm64_emulation
        pytest.skip("qemu-user answers madvise(MADV_PAGEOUT) with success and pages nothing out")
    path = tmp_path / "released.safetensors"
    want = torch.randn(4096, 1024)  # 16 MiB
    save_file({"w": want}, str(path))
    t = load_file(str(path))["w"]
    assert torch.equal(t, want)  # every page read: resident
    before = _resident_bytes("released.safetensors")
    assert before >= 15 << 20
    advised = page_release.release([t])
    if advised == 0:
        pytest.skip("madvise(MADV_PAGEOUT) unavailable here (Linux < 5.4 or no libc)")
    assert advised >= 15 << 20
    assert _resident_bytes("released.safetensors") < before // 4
    assert torch.equal(t, want)  # read back from the file


def test_anonymous_memory_keeps_its_values():
    t = torch.randn(1 << 20)
    copy = t.clone()
    page_release.release([t, torch.empty(0), t[1:7]])
    assert torch.equal(t, copy)
    page_release.trim_heap()
    assert torch.equal(t, copy)
