"""Gated DeltaNet's recurrence on the CPU: nextn's op (`gated_delta_rule`, per ISA variant) against its PyTorch
reference (the per-token loop `models/gated_deltanet.py` runs without the kernels), at the layer shapes of
Qwen3.5-9B's linear-attention layers (16 key heads, 32 value heads, 128-wide heads: `transformers`'
`Qwen3_5TextConfig` defaults), for a decode step (T = 1), a verify step (T = K + 1 = 4) and a prefill chunk.

    python -m benchmarks.gated_delta --batch 1 8 --tokens 1 4 256 --variants avx512_bf16 avx2

Prints milliseconds per layer call (best of --runs after a warm-up) and the speed-up; the pending updates are sized
for K = 3 (R = 4), as an engine with 3 drafts allocates them (models/recurrent_state.py).
"""

from __future__ import annotations

import argparse

import torch

from benchmarks.kernel_table import print_table
from nextn.plugins import gated_delta


def _inputs(b: int, t: int, h: int = 32, dk: int = 128, dv: int = 128, ring: int = 4):
    gen = torch.Generator().manual_seed(0)
    q = torch.nn.functional.normalize(torch.randn(b, t, h, dk, generator=gen), dim=-1) * dk ** -0.5
    k = torch.nn.functional.normalize(torch.randn(b, t, h, dk, generator=gen), dim=-1)
    v = torch.randn(b, t, h, dv, generator=gen)
    decay, beta = torch.rand(b, t, h, generator=gen), torch.rand(b, t, h, generator=gen)
    ssm, pending = torch.zeros(b, h, dk, dv), torch.zeros(b, ring, h, dk + dv + 1)
    slots, committed = torch.arange(b), torch.ones(b, dtype=torch.int64)  # one pending update committed, as in decode
    fresh, valid = torch.zeros(b, dtype=torch.bool), torch.ones(b, t, dtype=torch.bool)
    return q, k, v, decay, beta, ssm, pending, slots, committed, fresh, valid


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batch", type=int, nargs="+", default=[1, 8])
    ap.add_argument("--tokens", type=int, nargs="+", default=[1, 4, 256])
    ap.add_argument("--variants", nargs="+", default=None, help="ISA variants (default: those this CPU runs)")
    ap.add_argument("--runs", type=int, default=5)
    a = ap.parse_args()
    print_table("gated_delta_rule", [(b, t) for b in a.batch for t in a.tokens], ["B", "T"], _inputs,
                gated_delta.reference, a.variants, a.runs)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
