"""The frames a worker process (`runtime/worker_pool.py`) and its parent exchange, and the worker's own setup.

A frame is an 8-byte big-endian length, then that many bytes of UTF-8 JSON: no pickle either way, so the parent never
unpickles what untrusted input produced. Imported by the worker scripts (`template_worker.py`, `grammar_worker.py`)
run as `python -P SCRIPT`: it imports nothing beyond the standard library.
"""

from __future__ import annotations

import json
import os
import struct
import threading
import time
from typing import Any, BinaryIO

HEADER = struct.Struct(">Q")


def write_frame(out: BinaryIO, obj: Any) -> None:
    """Write `obj` as one frame (length, then UTF-8 JSON) and flush."""
    data = json.dumps(obj, ensure_ascii=False).encode("utf-8", "surrogatepass")
    out.write(HEADER.pack(len(data)) + data)
    out.flush()


def read_frame(inp: BinaryIO, max_bytes: int) -> Any:
    """One frame's JSON value, or None at end of input.

    Raises:
        ValueError: a frame longer than `max_bytes`, cut short, or not UTF-8 JSON.
    """
    head = inp.read(HEADER.size)
    if not head:
        return None
    if len(head) != HEADER.size:
        raise ValueError("frame header cut short")
    (size,) = HEADER.unpack(head)
    if size > max_bytes:
        raise ValueError(f"a frame of {size} bytes exceeds {max_bytes}")
    data = inp.read(size)
    if len(data) != size:
        raise ValueError(f"frame cut short ({len(data)} of {size} bytes)")
    return json.loads(data.decode("utf-8", "surrogatepass"))


def _watch_parent(parent: int) -> None:
    """Exit when the parent is gone (reparented), even in the middle of a piece of work."""
    while os.getppid() == parent:
        time.sleep(1.0)
    os._exit(0)


def become_worker(memory_bytes: int) -> None:
    """The worker's setup once its imports are done: exit with its parent, nice 10 (its work yields to the
    engine's), address space capped at what the imports took plus `memory_bytes` (`RLIMIT_AS`: MemoryError
    beyond)."""
    import resource

    threading.Thread(target=_watch_parent, args=(os.getppid(),), daemon=True).start()
    os.nice(10)
    with open("/proc/self/statm") as f:
        base = int(f.read().split()[0]) * os.sysconf("SC_PAGE_SIZE")
    resource.setrlimit(resource.RLIMIT_AS, (base + memory_bytes, base + memory_bytes))
