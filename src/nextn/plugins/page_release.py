"""Giving back the memory a fused op's operands leave behind at load.

The fused ops take some weights concatenated (a layer's q/k/v, gate/up: `int4_operands.concat_rows`) or stacked (an
MoE layer's experts: `stack_rows`), copied once into new tensors. The sources are the engine's memory-mapped
safetensors pages, which reading them for the copy made resident: without a hint they stay in the process's
resident set beside the copy (measured: a 5.6 GB GLM-4.7-Flash-shaped engine, 16 layers, resident at 15.6 GB after
load, 11.6 GB after `malloc_trim`; the file's pages 5.6 GB of it). `release` asks the kernel to reclaim the sources'
pages (`madvise(MADV_PAGEOUT)`, Linux ≥ 5.4: non-destructive — a file page touched again is read back from the file,
anonymous memory without swap is left as it is), and `trim_heap` returns the allocator's freed memory to the system
(glibc `malloc_trim`). Both are hints: where the call is missing (another libc, an older kernel) nothing changes but
the resident size.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import mmap
import sys
from collections.abc import Iterable
from functools import cache

import torch

MADV_PAGEOUT = 21  # <linux/mman.h>


@cache
def _libc():
    if not sys.platform.startswith("linux"):
        return None
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
    except OSError:
        return None
    libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    return libc


def release(tensors: Iterable[torch.Tensor]) -> int:
    """Hint that the CPU tensors' memory will not be read again soon (their values live on in a copy): the whole
    pages inside each tensor's bytes are reclaimed where they are file-backed. Returns the bytes advised (0 where the
    hint is unavailable)."""
    libc = _libc()
    if libc is None:
        return 0
    page = mmap.PAGESIZE
    advised = 0
    for t in tensors:
        if t.device.type != "cpu" or t.numel() == 0:
            continue
        start = t.data_ptr()
        end = start + t.numel() * t.element_size()
        first, last = -(-start // page) * page, end // page * page
        if last - first >= page and libc.madvise(first, last - first, MADV_PAGEOUT) == 0:
            advised += last - first
    return advised


def trim_heap() -> None:
    """Return the C allocator's free memory to the system (glibc `malloc_trim(0)`; elsewhere nothing)."""
    libc = _libc()
    trim = getattr(libc, "malloc_trim", None) if libc is not None else None
    if trim is not None:
        trim(0)
