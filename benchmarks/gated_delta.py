"""Gated DeltaNet's recurrence on the CPU: nextn's op (`gated_delta_rule`, per ISA variant) against its PyTorch
reference (the per-token loop `models/gated_deltanet.py` runs without the kernels), at the layer shapes of
Qwen3.5-9B's linear-attention layers (16 key heads, 32 value heads, 128-wide heads: `transformers`'
`Qwen3_5TextConfig` defaults), for a decode step (T = 1), a verify step (T = K + 1 = 4) and a prefill chunk.

    python -m benchmarks.gated_delta --batch 1 8 --tokens 1 4 256 --variants avx512_bf16 avx2

Prints milliseconds per layer call (best of --runs after a warm-up) and the speed-up; the ring of states is sized
for K = 3 (R = 4), as an engine with 3 drafts allocates it.
"""

from __future__ import annotations

import argparse
import time

import torch

from nextn.plugins import cpu_kernels, gated_delta


def _inputs(b: int, t: int, h: int = 32, dk: int = 128, dv: int = 128, ring: int = 4):
    gen = torch.Generator().manual_seed(0)
    q = torch.nn.functional.normalize(torch.randn(b, t, h, dk, generator=gen), dim=-1) * dk ** -0.5
    k = torch.nn.functional.normalize(torch.randn(b, t, h, dk, generator=gen), dim=-1)
    v = torch.randn(b, t, h, dv, generator=gen)
    decay, beta = torch.rand(b, t, h, generator=gen), torch.rand(b, t, h, generator=gen)
    buf = torch.zeros(b, ring, h, dk, dv)
    slots, entry = torch.arange(b), torch.zeros(b, dtype=torch.int64)
    fresh, valid = torch.zeros(b, dtype=torch.bool), torch.ones(b, t, dtype=torch.bool)
    return q, k, v, decay, beta, buf, slots, entry, fresh, valid


def _best(fn, runs: int) -> float:
    fn()
    best = float("inf")
    for _ in range(runs):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best * 1e3


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batch", type=int, nargs="+", default=[1, 8])
    ap.add_argument("--tokens", type=int, nargs="+", default=[1, 4, 256])
    ap.add_argument("--variants", nargs="+", default=None, help="ISA variants (default: those this CPU runs)")
    ap.add_argument("--runs", type=int, default=5)
    a = ap.parse_args()
    torch.set_grad_enabled(False)
    print(f"CPU threads {torch.get_num_threads()}; {cpu_kernels.describe()}")
    print(f"{'variant':>12} {'B':>3} {'T':>4} {'kernel ms':>10} {'PyTorch ms':>11} {'speed-up':>9}")
    for variant in a.variants or cpu_kernels.runnable():
        with cpu_kernels.use(variant):
            op = cpu_kernels.ops().gated_delta_rule
            for b in a.batch:
                for t in a.tokens:
                    args = _inputs(b, t)
                    kernel = _best(lambda: op(*args), a.runs)
                    ref = _best(lambda: gated_delta.reference(*args), max(1, a.runs // 2))
                    print(f"{variant:>12} {b:>3} {t:>4} {kernel:>10.3f} {ref:>11.3f} {ref / kernel:>8.1f}x", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
