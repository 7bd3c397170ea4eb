"""What the CPU kernel benchmarks (`benchmarks.gated_delta`, `benchmarks.mla`) share: the best time of a call, and the
table of an op against its PyTorch reference for each ISA variant and shape."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Sequence

import torch

from nextn.plugins import cpu_kernels


def best_ms(fn: Callable[[], object], runs: int, repeat: int = 1) -> float:
    """Milliseconds of one `fn()` call: the best of `runs` timings of `repeat` calls each, after a warm-up call."""
    fn()
    best = float("inf")
    for _ in range(runs):
        t0 = time.perf_counter()
        for _ in range(repeat):
            fn()
        best = min(best, (time.perf_counter() - t0) / repeat)
    return best * 1e3


def print_table(op_name: str, shapes: Iterable[Sequence[int]], columns: Sequence[str], make_args: Callable,
                reference: Callable, variants: Sequence[str] | None, runs: int, repeat: int = 1) -> None:
    """For each ISA variant (default: those this CPU runs) and shape, the op `cpu_kernels.ops().<op_name>` on
    `make_args(*shape)` against `reference(*args)`: milliseconds and the speed-up, one row each."""
    torch.set_grad_enabled(False)
    print(f"CPU threads {torch.get_num_threads()}; {cpu_kernels.describe()}")
    print(f"{'variant':>12} " + " ".join(f"{c:>7}" for c in columns)
          + f" {'kernel ms':>10} {'PyTorch ms':>11} {'speed-up':>9}")
    shapes = list(shapes)
    for variant in variants or cpu_kernels.runnable():
        with cpu_kernels.use(variant):
            op = getattr(cpu_kernels.ops(), op_name)
            for shape in shapes:
                args = make_args(*shape)
                kernel = best_ms(lambda: op(*args), runs, repeat)
                ref = best_ms(lambda: reference(*args), runs, repeat)
                print(f"{variant:>12} " + " ".join(f"{v:>7}" for v in shape)
                      + f" {kernel:>10.3f} {ref:>11.3f} {ref / kernel:>8.1f}x", flush=True)
