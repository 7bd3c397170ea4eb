"""CPU threads for every command that runs a model (`-t / --num_threads`, llama.cpp's flag): a default that does not
collapse when the machine is busy.

torch runs its CPU kernels on one OpenMP thread per core. A decode step is hundreds of short parallel regions; when
another process holds a core, the thread sharing it finishes each region a scheduler slice late and the others wait
at the barrier, so a step runs 4-8x slower than on one thread, and at random (docs/performance-history.md,
"threads under load"). So the default is the cores that are idle now: `/proc/stat` sampled over `SAMPLE_S` (the
1-minute load average lags a job that started seconds ago), a core counted when at least `IDLE_SHARE` of it is free,
at least one. `-t N` sets it (1 ≤ N ≤ the cores this process may run on).
"""

from __future__ import annotations

import argparse
import math
import os
import sys
import time

SAMPLE_S = 0.2  # how long the idle share of the cores is measured at start
IDLE_SHARE = 0.75  # a core counts as idle when at least this share of it was idle over the sample


def available_cores() -> int:
    """The cores this process may run on (its CPU affinity), at least 1."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except (AttributeError, OSError):
        return max(1, os.cpu_count() or 1)


def _cpu_times() -> tuple[int, int] | None:
    """(idle, total) jiffies of all CPUs from /proc/stat, or None where it cannot be read."""
    try:
        with open("/proc/stat", encoding="ascii") as f:
            fields = f.readline().split()
    except OSError:
        return None
    if not fields or fields[0] != "cpu":
        return None
    values = [int(v) for v in fields[1:9]]  # user nice system idle iowait irq softirq steal
    return values[3] + values[4], sum(values)


def idle_cores(sample_s: float = SAMPLE_S) -> float | None:
    """How many cores were idle over the last `sample_s` seconds (machine-wide, 0..os.cpu_count()), or None where
    /proc/stat is unavailable."""
    first = _cpu_times()
    if first is None:
        return None
    time.sleep(sample_s)
    second = _cpu_times()
    if second is None or second[1] <= first[1]:
        return None
    return (second[0] - first[0]) / (second[1] - first[1]) * (os.cpu_count() or 1)


def default_threads() -> tuple[int, str | None]:
    """The default thread count and, when it is below the available cores, why (a line for the user)."""
    cores = available_cores()
    idle = idle_cores()
    if idle is None:
        return cores, None
    threads = max(1, min(cores, math.floor(idle + 1 - IDLE_SHARE)))
    if threads >= cores:
        return cores, None
    return threads, (f"the machine is busy ({idle:.1f} of {os.cpu_count()} cores idle): {threads} thread"
                     f"{'s' if threads > 1 else ''} instead of {cores}, since threads on shared cores slow every step; "
                     "-t N chooses")


def add_threads_argument(parser: argparse.ArgumentParser) -> None:
    """`-t / --num_threads N` (default: the idle cores, `default_threads`)."""
    parser.add_argument("-t", "--num_threads", type=int, metavar="N",
                        help="CPU threads (default: the cores idle at start, at least 1; all of them on a quiet "
                             "machine). Threads on cores another process uses slow every step 4-8x")


def apply_threads(num_threads: int | None, prog: str, announce: bool = True) -> tuple[int, str | None]:
    """Set torch's CPU threads to `num_threads`, or to `default_threads()`; return the count and, when the default
    is below the cores, why (printed to stderr as "`prog`: why" when `announce`).

    Raises:
        ValueError: `num_threads` outside 1..`available_cores()` (every thread is a spinning OpenMP worker).
    """
    import torch

    cores, why = available_cores(), None
    if num_threads is not None:
        if not 1 <= num_threads <= cores:
            raise ValueError(f"--num_threads must be in 1..{cores} (the cores this process may use), got "
                             f"{num_threads}")
        threads = num_threads
    else:
        threads, why = default_threads()
        if why and announce:
            print(f"{prog}: {why}", file=sys.stderr, flush=True)
    torch.set_num_threads(threads)
    return threads, why
