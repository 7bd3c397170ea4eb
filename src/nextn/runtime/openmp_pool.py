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


@functools.lru_cache(maxsize=None)
def _pause_of(path: str):
    """`omp_pause_resource_all` of the OpenMP runtime at `path`, or None (a runtime before OpenMP 5.0)."""
    try:
        fn = ctypes.CDLL(path).omp_pause_resource_all
    except (OSError, AttributeError):
        return None
    fn.argtypes, fn.restype = [ctypes.c_int], ctypes.c_int
    return fn


def _pause_fns() -> list:
    """`omp_pause_resource_all` of every OpenMP runtime loaded in this process now: torch's, and any other (a
    compiled step's kernels may load the system's libgomp beside torch's own copy; each keeps its own pools). Empty
    where there is none or no /proc (not Linux)."""
    try:
        lines = Path("/proc/self/maps").read_text().splitlines()
    except OSError:
        return []
    paths = dict.fromkeys(fields[5] for fields in (line.split() for line in lines)
                          if len(fields) >= 6 and any(Path(fields[5]).name.startswith(n) for n in _RUNTIMES))
    return [fn for fn in map(_pause_of, paths) if fn is not None]


def release_thread_pool() -> bool:
    """Free the calling thread's OpenMP worker threads (not the calling thread; other threads' pools untouched).

    The next parallel region this thread opens starts a new pool, so this is always safe; it only costs that thread
    one pool start-up. Call it on the thread that loaded or stepped the engine, before another thread steps it.

    Returns:
        True when every loaded OpenMP runtime freed its pool (or there was none), False where no OpenMP 5.0 runtime
        is loaded or one refused (called inside a parallel region).
    """
    import torch  # noqa: F401 - its OpenMP runtime must be loaded for the lookup

    fns = _pause_fns()
    if not fns:
        return False
    ok = all([fn(_OMP_PAUSE_SOFT) == 0 for fn in fns])  # every runtime's pool of this thread
    if not ok:
        logger.debug("omp_pause_resource_all refused on this thread")
    return ok
