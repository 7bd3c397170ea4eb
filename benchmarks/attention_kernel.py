"""nextn's CPU paged-attention kernel (`plugins/paged_attention_cpu.cpp`) timed at a decode step's, a verify step's
and a prefill's shapes (a benchmark).

For each (T query tokens, S cached keys) pair: one sequence, causal (query t sees keys ≤ S − T + t), the cache rows
in order; prints ms per call of one layer's attention (median of `--iters` after a warm-up) and that times the
layer count, what a whole step or prefill spends in attention. Default heads: Qwen2.5-1.5B's (12 query heads, 2 KV
heads, head_dim 128, 28 layers).

    python -m benchmarks.attention_kernel --shapes 1x700 5x700 700x700 1400x1400
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch


def time_attention(t: int, s: int, heads: int, kv_heads: int, head_dim: int, iters: int) -> float:
    """Median ms of one `paged_attention` kernel call over T = t queries and S = s keys (bf16).

    Raises:
        RuntimeError: the CPU kernels are unavailable here (`plugins.cpu_kernels.unavailable_reason`).
    """
    from nextn.plugins import cpu_kernels

    if not cpu_kernels.available():
        raise RuntimeError(f"nextn's CPU kernels are unavailable: {cpu_kernels.unavailable_reason()}")
    gen = torch.Generator().manual_seed(0)
    kv = torch.randn(s, 2 * kv_heads * head_dim, generator=gen).bfloat16()
    q = torch.randn(1, t, heads, head_dim, generator=gen).bfloat16()
    slots = torch.arange(s)[None]
    visible = torch.ones(t, s, dtype=torch.bool).tril(s - t)[None, None].contiguous()
    scale = head_dim ** -0.5
    op = cpu_kernels.ops().paged_attention
    op(q, kv, slots, visible, scale)
    times = []
    for _ in range(iters):
        t0 = time.perf_counter()
        op(q, kv, slots, visible, scale)
        times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1e3


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.attention_kernel", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shapes", nargs="+", default=["1x700", "5x700", "700x700", "1400x1400"],
                   help="TxS pairs: T query tokens (1 decode, K+1 verify, the prompt for a prefill) over S keys")
    p.add_argument("--heads", type=int, nargs=3, default=[12, 2, 128], metavar=("NH", "NKV", "D"))
    p.add_argument("--layers", type=int, default=28)
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--threads", type=int, default=2)
    args = p.parse_args(argv)
    pairs = []
    for shape in args.shapes:
        try:
            t, s = (int(x) for x in shape.lower().split("x"))
        except ValueError:
            p.error(f"--shapes takes TxS pairs such as 1x700, got {shape!r}")
        if not 1 <= t <= s <= 32768:
            p.error(f"{shape}: need 1 ≤ T ≤ S ≤ 32768")
        pairs.append((t, s))
    torch.set_num_threads(args.threads)
    nh, nkv, d = args.heads
    print(f"{nh} query heads, {nkv} KV heads, head_dim {d}, {args.threads} threads; ms per layer (× {args.layers})")
    for t, s in pairs:
        ms = time_attention(t, s, nh, nkv, d, args.iters)
        print(f"T={t:>5} S={s:>5}  {ms:9.3f} ms  ({ms * args.layers:9.1f} ms for {args.layers} layers)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
