"""`release_thread_pool`: hand back the calling thread's OpenMP worker threads before another thread takes over the
engine.

Why: torch's CPU kernels and nextn's (`at::parallel_for`) run on OpenMP, and GNU libgomp keeps one worker pool per
thread that ever opened a parallel region. While the process holds more libgomp threads than it may use CPUs, libgomp
cuts its spin-wait between parallel regions from ~300,000 iterations to ~1,000, so the workers go to sleep between
every pair of kernels and each region pays a futex wake-up. A model loaded on the main thread and then stepped by
`EngineLoop`'s thread leaves two pools (2 + 2 threads on 2 cores): on the 2-core reference machine that made a
Qwen2.5-Coder-1.5B W4A8 decode step through the loop 15-25 % slower than the same step on the main thread
(docs/PERFORMANCE.md, history "One OpenMP pool for the engine loop"). Freeing the loading thread's pool first leaves
one. Source: libgomp `wait.h` (`do_spin`: `gomp_managed_threads > gomp_available_cpus` → throttled spin count) and
`team.c` (`gomp_pause_host`, behind OpenMP 5.0's `omp_pause_resource_all`).
"""

from __future__ import annotations

import ctypes
import functools
import logging
from pathlib import Path

logger = logging.getLogger(__name__)

_OMP_PAUSE_SOFT = 1  # omp_pause_soft: free the threads; the next parallel region on this thread starts new ones
_RUNTIMES = ("libgomp", "libiomp5", "libomp")


@functools.lru_cache(maxsize=1)
def _pause_fn():
    """`omp_pause_resource_all` of the OpenMP runtime loaded in this process (torch's), or None where there is none
    (no /proc: not Linux; a runtime before OpenMP 5.0)."""
    maps = Path("/proc/self/maps")
    try:
        lines = maps.read_text().splitlines()
    except OSError:
        return None
    for line in lines:
        fields = line.split()  # address, perms, offset, dev, inode[, path]
        path = fields[5] if len(fields) >= 6 else ""
        if any(Path(path).name.startswith(name) for name in _RUNTIMES):
            try:
                fn = ctypes.CDLL(path).omp_pause_resource_all
            except (OSError, AttributeError):
                continue
            fn.argtypes, fn.restype = [ctypes.c_int], ctypes.c_int
            return fn
    return None


def release_thread_pool() -> bool:
    """Free the calling thread's OpenMP worker threads (not the calling thread; other threads' pools untouched).

    The next parallel region this thread opens starts a new pool, so this is always safe; it only costs that thread
    one pool start-up. Call it on the thread that loaded or stepped the engine, before another thread steps it.

    Returns:
        True when the runtime freed the pool (or there was none), False where no OpenMP 5.0 runtime is loaded or it
        refused (called inside a parallel region).
    """
    import torch  # noqa: F401 - its OpenMP runtime must be loaded for the lookup

    fn = _pause_fn()
    if fn is None:
        return False
    ok = fn(_OMP_PAUSE_SOFT) == 0
    if not ok:
        logger.debug("omp_pause_resource_all refused on this thread")
    return ok
