"""Where a kernel runs, and how launchers stay traceable.

A dispatcher calls its kernel only where it can run: CUDA tensors, triton importable, a CUDA device present;
everywhere else it calls the PyTorch reference, so CPU behaviour is the reference's exactly. Tests force the
kernel path on CPU tensors under `TRITON_INTERPRET=1` with `forced_kernels()`.

On a CUDA machine every launcher is registered once as a custom op with `torch.library.triton_op` (its kernels
launched through `torch.library.wrap_triton`), so a step that calls them compiles under
`torch.compile(fullgraph=True)` (dynamo sees one opaque op; AOT autograd decomposes it into the kernel launches,
its fake implementation is the launcher traced with fake tensors) and can be captured in a CUDA graph (launchers
allocate their outputs and never read device values on the host). Both APIs exist since torch 2.6.
"""

from __future__ import annotations

import contextlib
import importlib.util
from collections.abc import Callable, Iterator
from typing import Any

import torch

#: Whether triton can be imported at all (checked without importing it).
HAS_TRITON = importlib.util.find_spec("triton") is not None

_forced = False


_CUDA_OK = HAS_TRITON and torch.cuda.is_available()


def use_kernel(*tensors: torch.Tensor) -> bool:
    """True where the kernel path applies: forced (tests), or every tensor on CUDA with triton and a device."""
    if _forced:
        return True
    return _CUDA_OK and all(t.is_cuda for t in tensors)


@contextlib.contextmanager
def forced_kernels() -> Iterator[None]:
    """Run every dispatcher through its Triton launcher, whatever the tensors' device (tests only: on CPU tensors
    this needs `TRITON_INTERPRET=1` set before the first kernel is built)."""
    global _forced
    if not HAS_TRITON:
        raise RuntimeError("forced_kernels() needs triton installed (pip install triton)")
    prev, _forced = _forced, True
    try:
        yield
    finally:
        _forced = prev


def launch(kernel: Any) -> Any:
    """`kernel` wrapped for tracing (`torch.library.wrap_triton`); under the interpreter, the kernel itself."""
    return torch.library.wrap_triton(kernel)


#: Every launcher body by op name (registered as `nextn::<name>` on CUDA machines); tests register them elsewhere.
OPS: dict[str, tuple[Callable, tuple[str, ...]]] = {}


def register_op(name: str, fn: Callable, mutates_args: tuple[str, ...] = ()) -> Callable:
    """`fn` as the custom op `nextn::name` on CUDA machines (the callable to use on CUDA tensors); `fn` itself
    elsewhere (registration imports torch._inductor, which CPU-only runs need not pay for)."""
    OPS[name] = (fn, mutates_args)
    if not _CUDA_OK:
        return fn
    return torch.library.triton_op(f"nextn::{name}", fn, mutates_args=mutates_args)


def next_pow2(n: int, minimum: int = 1) -> int:
    """The smallest power of two ≥ max(n, minimum) (Triton block sizes)."""
    n = max(n, minimum)
    return 1 << (n - 1).bit_length()


def cdiv(a: int, b: int) -> int:
    """⌈a / b⌉ for grid sizes."""
    return (a + b - 1) // b
