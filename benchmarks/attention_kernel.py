"""nextn's CPU paged-attention kernel (`plugins/paged_attention_cpu.cpp`) timed at a decode step's, a verify step's
and a prefill's shapes (a benchmark).

For each (T query tokens, S cached keys) pair: one sequence, causal (query t sees keys ≤ S − T + t), the cache rows
in order; one timed pass calls the kernel once per layer, each layer on its own cache as in an engine's step (the
caches then come from memory once they outgrow the last-level cache; `--one_cache`: every layer on the same cache,
the kernel's in-cache speed). Prints ms per layer and per pass (median of `--iters` passes after a warm-up), and the
KV bytes a pass reads per second. Default heads: Qwen2.5-1.5B's (12 query heads, 2 KV heads, head_dim 128, 28
layers). `--variants` alternates ISA variants in one process (each pass per variant in turn).

    python -m benchmarks.attention_kernel --shapes 1x700 5x700 700x700 1400x1400
    python -m benchmarks.attention_kernel --shapes 1x2048 1x8192 --variants avx512_bf16 avx2
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import time

import torch


MAX_CACHE_BYTES = 4 << 30  # the bf16 caches of a pass, allocated before timing


def time_attention(t: int, s: int, heads: int, kv_heads: int, head_dim: int, iters: int, layers: int = 1,
                   one_cache: bool = False, variants: list[str | None] | None = None) -> dict[str | None, float]:
    """Median ms of a pass of `layers` `paged_attention` calls over T = t queries and S = s keys (bf16), per variant.

    Each layer reads its own [s, 2 · kv_heads · head_dim] cache unless `one_cache`. `variants` (None: the loaded one)
    are alternated, a pass each in turn, so that they share the machine's state.

    Raises:
        RuntimeError: the CPU kernels are unavailable here (`plugins.cpu_kernels.unavailable_reason`), or a
            variant cannot run on this CPU (`cpu_kernels.use`).
    """
    from nextn.plugins import cpu_kernels

    if not cpu_kernels.available():
        raise RuntimeError(f"nextn's CPU kernels are unavailable: {cpu_kernels.unavailable_reason()}")
    variants = variants or [None]
    gen = torch.Generator().manual_seed(0)
    caches = [torch.randn(s, 2 * kv_heads * head_dim, generator=gen).bfloat16()
              for _ in range(1 if one_cache else layers)]
    q = torch.randn(1, t, heads, head_dim, generator=gen).bfloat16()
    slots = torch.arange(s)[None]
    visible = torch.ones(t, s, dtype=torch.bool).tril(s - t)[None, None].contiguous()
    scale = head_dim ** -0.5

    def one_pass(variant: str | None) -> float:
        with cpu_kernels.use(variant) if variant else contextlib.nullcontext():
            op = cpu_kernels.ops().paged_attention
            t0 = time.perf_counter()
            for i in range(layers):
                op(q, caches[i % len(caches)], slots, visible, scale)
            return time.perf_counter() - t0

    times: dict[str | None, list[float]] = {v: [] for v in variants}
    for v in variants:
        one_pass(v)
    for _ in range(iters):
        for v in variants:
            times[v].append(one_pass(v))
    return {v: statistics.median(ts) * 1e3 for v, ts in times.items()}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.attention_kernel", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shapes", nargs="+", default=["1x700", "5x700", "700x700", "1400x1400"],
                   help="TxS pairs: T query tokens (1 decode, K+1 verify, the prompt for a prefill) over S keys")
    p.add_argument("--heads", type=int, nargs=3, default=[12, 2, 128], metavar=("NH", "NKV", "D"))
    p.add_argument("--layers", type=int, default=28)
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--one_cache", action="store_true",
                   help="every layer on the same cache (the kernel's in-cache speed; default: a cache per layer)")
    p.add_argument("--variants", nargs="+", metavar="ISA",
                   help="ISA variants to alternate in one process (default: the one loaded)")
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
    nh, nkv, d = args.heads
    if args.layers < 1 or args.iters < 1:
        p.error("--layers and --iters must be at least 1")
    cache_bytes = max(s for _, s in pairs) * 2 * nkv * d * 2 * (1 if args.one_cache else args.layers)
    if cache_bytes > MAX_CACHE_BYTES:
        p.error(f"the caches would take {cache_bytes / 2**30:.1f} GiB (at most {MAX_CACHE_BYTES / 2**30:.0f}): "
                "fewer --layers, shorter shapes, or --one_cache")
    torch.set_num_threads(args.threads)
    where = "one cache" if args.one_cache else "a cache per layer"
    print(f"{nh} query heads, {nkv} KV heads, head_dim {d}, {args.threads} threads, {where}; "
          f"ms per layer and per pass of {args.layers} layers")
    for t, s in pairs:
        kv_bytes = args.layers * s * 2 * nkv * d * 2
        for v, ms in time_attention(t, s, nh, nkv, d, args.iters, args.layers, args.one_cache,
                                    args.variants).items():
            name = f"{v:>12} " if v else ""
            print(f"{name}T={t:>5} S={s:>5}  {ms / args.layers:9.3f} ms  ({ms:9.1f} ms for {args.layers} layers, "
                  f"KV read at {kv_bytes / ms / 1e6:6.1f} GB/s)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
