"""DeepSeek's Multi-head Latent Attention on the CPU: nextn's op (`mla_attention`, per ISA variant: absorption,
attention over the paged latent cache and value up-projection) against the PyTorch path the module runs without the
kernels (two einsums around `mla_attention_reference`), at GLM-4.7-Flash's layer shape (20 heads, q/k 192 + 64 rope,
v 256, latent 512: `transformers`' `Glm4MoeLiteConfig` defaults), bf16, for a decode step (T = 1) and a verify step
(T = K + 1 = 4) over a cached context.

    python -m benchmarks.mla --tokens 1 4 --context 512 2048 --variants avx512_bf16 avx2

Prints milliseconds per layer call (best of --runs after a warm-up) and the speed-up.
"""

from __future__ import annotations

import argparse

import torch

from nextn.models.attention_metadata import AttentionMetadata, slots_for_positions
from benchmarks.kernel_table import print_table
from nextn.plugins import mla

BLOCK = 16


def _inputs(t: int, ctx: int, nh: int = 20, p: int = 192, r: int = 64, v: int = 256, c: int = 512):
    gen = torch.Generator().manual_seed(0)
    per = -(-(ctx + t) // BLOCK)
    tables = torch.arange(1, 1 + per)[None]
    kv = torch.randn((1 + per) * BLOCK, c + r, generator=gen).bfloat16()
    pos = (torch.arange(t) + ctx)[None]
    meta = AttentionMetadata.create(pos, slots_for_positions(tables, pos, BLOCK), tables, BLOCK)
    q_nope = torch.randn(1, t, nh, p, generator=gen).bfloat16()
    q_pe = torch.randn(1, t, nh, r, generator=gen).bfloat16()
    kv_b = (torch.randn(nh, p + v, c, generator=gen) * c ** -0.5).bfloat16()
    return q_nope, q_pe, kv_b, kv, meta.context_slots, meta.visible, (p + r) ** -0.5


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, nargs="+", default=[1, 4])
    ap.add_argument("--context", type=int, nargs="+", default=[512, 2048])
    ap.add_argument("--variants", nargs="+", default=None, help="ISA variants (default: those this CPU runs)")
    ap.add_argument("--runs", type=int, default=5)
    a = ap.parse_args()
    print_table("mla_attention", [(t, ctx) for ctx in a.context for t in a.tokens], ["T", "context"], _inputs,
                lambda *args: mla.reference(*args, dtype=torch.bfloat16), a.variants, a.runs, repeat=10)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
