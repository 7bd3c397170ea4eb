"""The linear-layer kernels a decode or verify step can use, timed at the few rows those steps have (a benchmark).

For one weight matrix [N, K] and each row count M (1 = a plain decode step; K + 1 = a verify step over K drafts):
- int8: `torch.ops.aten._weight_int8pack_mm` (W8A16 on PyTorch's kernel);
- int4: `torch.ops.aten._weight_int4pack_mm_for_cpu`, group 32 (W4A16 on PyTorch's kernel);
- nextn int8 / nextn int4 / nextn int4 super S: nextn's own kernels (`plugins/woq_linear.py`; what
  `quantization/linear.py` uses where the CPU has AVX512-BF16), int4 with one-level bf16 group scales and with
  two-level ones (8-bit group scales under fp16 per super-block of S input channels: llama.cpp's k-quants), and
  W4A8 (the same weights times activations quantized to int8 per group, `vpdpbusd`);
- bf16: `F.linear`;
- bf16 packed: oneDNN's pre-packed weight (`plugins/packed_linear.py`, what nextn's bf16 engines run).
Prints µs per call (median of `--iters` after a warm-up) and the weight bytes read per µs. A matrix that fits in the
CPU's last-level cache measures the kernel, not DRAM: the decode step reads every matrix once from memory.
`--copies C` times nextn's kernels over C distinct copies of the matrix, one after another (as a decode step walks
its layers), so that the weights stream from DRAM: the figure a real step sees.

`--dense` times the dense linears instead (`dense`): nextn's batch-invariant kernel (`plugins/dense_linear.py`)
against oneDNN's packed bf16 (`PackedLinear`) and `F.linear` in fp32, by default at M = 1, 5, 8, 12 on SmolLM2-135M's
and Qwen2.5-1.5B's matrices (`DENSE_SHAPES`), each variant cycling copies of at least `--stream-mb` MB in all.

    python -m benchmarks.kernels --shape 8960 1536 --rows 1 4 5 8
    python -m benchmarks.kernels --shape 8960 1536 --rows 1 4 5 --copies 96 --iters 20   # ~660 MB of int4
    python -m benchmarks.kernels --dense --stream-mb 256 --iters 50                     # every DENSE_SHAPES matrix
    python -m benchmarks.kernels --copies 48 --iters 48 --rounds 5 --variants avx2 avx2_vnni  # per ISA variant

`--variants` times nextn's kernels under each named ISA variant (`plugins/cpu_kernels.py`) in this one process,
alternating them `--rounds` times at each row count and keeping each kernel's best median: a same-process A/B, what
a noisy VM allows.
"""

from __future__ import annotations

import argparse
import contextlib
import math
import statistics
import time
from collections.abc import Callable

import torch
import torch.nn.functional as F

from nextn.plugins import cpu_kernels, dense_linear, woq_linear
from nextn.plugins.packed_linear import packed_linear, packing_supported
from nextn.quantization.weight_only import super_block


def _time(fn: Callable[[], torch.Tensor], iters: int) -> float:
    """Median µs per call of `fn` over `iters` calls, after 10 warm-up calls."""
    for _ in range(10):
        fn()
    times = []
    for _ in range(iters):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1e6


def kernels(n: int, k: int, group: int = 32, copies: int = 1
            ) -> dict[str, tuple[Callable[[torch.Tensor], torch.Tensor], int]]:
    """name → (fn(x [M, k] bf16) → [M, n], weight bytes per call) for a random [n, k] matrix; with `copies` > 1 only
    nextn's kernels, each call on the next of `copies` distinct matrices."""
    torch.manual_seed(0)
    out = {}
    if copies == 1:
        w = torch.randn(n, k, dtype=torch.bfloat16)
        q8, s8 = torch.randint(-127, 128, (n, k), dtype=torch.int8), torch.rand(n, dtype=torch.bfloat16)
        q4 = torch.ops.aten._convert_weight_to_int4pack_for_cpu(torch.randint(0, 16, (n, k), dtype=torch.int32), 1)
        sz = torch.rand(k // group, n, 2, dtype=torch.bfloat16)
        out = {
            "int8": (lambda x: torch.ops.aten._weight_int8pack_mm(x, q8, s8), n * k + 2 * n),
            f"int4 g{group}": (lambda x: torch.ops.aten._weight_int4pack_mm_for_cpu(x, q4, group, sz),
                               n * k // 2 + 4 * n * (k // group)),
            "bf16": (lambda x: F.linear(x, w), 2 * n * k),
        }
    if woq_linear.available() and woq_linear.takes("W4A16", n, k):
        int8 = [(torch.randint(-127, 128, (n, k), dtype=torch.int8), torch.rand(n)) for _ in range(copies)]
        int4 = [(torch.randint(0, 256, (n, k // 2), dtype=torch.uint8), torch.rand(n // 16, k // group, 16).bfloat16(),
                 torch.rand(n // 16, k // group, 16).bfloat16()) for _ in range(copies)]
        sb = super_block(k, group, 256)  # two-level scales (W4A16's default super-block from 1B parameters)
        int4k = [(torch.randint(0, 256, (n, k // 2), dtype=torch.uint8),
                  torch.randint(0, 256, (n // 16, k // group, 2, 16), dtype=torch.uint8),
                  (torch.rand(n // 16, k // sb, 2, 16) * 1e-3).half()) for _ in range(copies)]
        turn = {"int8": 0, "int4": 0, "int4k": 0}

        def nextn_int8(x):
            turn["int8"] = (turn["int8"] + 1) % copies
            return cpu_kernels.ops().woq_int8_linear(x, *int8[turn["int8"]], None)

        def nextn_int4(x):
            turn["int4"] = (turn["int4"] + 1) % copies
            return cpu_kernels.ops().woq_int4_linear(x, *int4[turn["int4"]], group, None)

        def nextn_int4k(x):
            turn["int4k"] = (turn["int4k"] + 1) % copies
            return cpu_kernels.ops().woq_int4_linear(x, *int4k[turn["int4k"]], group, None)

        def nextn_int4a8(x):  # W4A8 (the same bytes; the vpdpbusd layout is a permutation of them)
            turn["int4k"] = (turn["int4k"] + 1) % copies
            return cpu_kernels.ops().woq_int4_linear(x, *int4k[turn["int4k"]], group, None, True)

        out["nextn int8"] = (nextn_int8, n * k + 4 * n)
        out[f"nextn int4 g{group}"] = (nextn_int4, n * k // 2 + 4 * n * (k // group))
        out[f"nextn int4 g{group} super {sb}"] = (nextn_int4k, n * k // 2 + 2 * n * (k // group) + 4 * n * (k // sb))
        out[f"nextn W4A8 g{group} super {sb}"] = (nextn_int4a8, n * k // 2 + 2 * n * (k // group) + 4 * n * (k // sb))
    if copies == 1 and packing_supported(torch.device("cpu"), torch.bfloat16):
        packed = torch.ops.mkldnn._reorder_linear_weight(w, None)
        out["bf16 packed"] = (lambda x: packed_linear(x, packed, None), 2 * n * k)
    return out


DENSE_SHAPES = {  # [N, K] (out, in) of each model's linears: q/o, kv, MLP up/gate, down, lm_head
    "SmolLM2-135M": [(576, 576), (1536, 576), (576, 1536), (49152, 576)],
    "Qwen2.5-1.5B": [(1536, 1536), (256, 1536), (8960, 1536), (1536, 8960), (151936, 1536)],
}


def dense_kernels(n: int, k: int, copies: int = 1
                  ) -> dict[str, tuple[Callable[[torch.Tensor], torch.Tensor], int, torch.dtype]]:
    """name → (fn(x [M, k]) → [M, n], weight bytes per call, x's dtype) for random [n, k] matrices, each call on the
    next of `copies` distinct ones: nextn's dense kernel in bf16 and fp32 (where available), oneDNN's packed bf16
    (where the CPU has bf16 instructions), `F.linear` in fp32."""
    torch.manual_seed(0)
    w32 = [torch.randn(n, k) for _ in range(copies)]
    turn = {}

    def cycled(name: str, weights: list, call: Callable) -> Callable[[torch.Tensor], torch.Tensor]:
        turn[name] = 0

        def fn(x):
            turn[name] = (turn[name] + 1) % copies
            return call(x, weights[turn[name]])
        return fn

    out = {}
    if dense_linear.available():
        bf = [dense_linear.pack(w.bfloat16()) for w in w32]
        f32 = [dense_linear.pack(w) for w in w32]
        out["nextn bf16"] = (cycled("nb", bf, lambda x, p: dense_linear.dense_linear(x, p, n)), 2 * n * k,
                             torch.bfloat16)
        out["nextn fp32"] = (cycled("nf", f32, lambda x, p: dense_linear.dense_linear(x, p, n)), 4 * n * k,
                             torch.float32)
    if packing_supported(torch.device("cpu"), torch.bfloat16):
        packed = [torch.ops.mkldnn._reorder_linear_weight(w.bfloat16(), None) for w in w32]
        out["bf16 packed"] = (cycled("pb", packed, lambda x, p: packed_linear(x, p, None)), 2 * n * k, torch.bfloat16)
    out["fp32 F.linear"] = (cycled("f", w32, F.linear), 4 * n * k, torch.float32)
    return out


def dense(shapes: list[tuple[int, int]] | None = None, rows: tuple[int, ...] = (1, 5, 8, 12), iters: int = 100,
          stream_mb: float = 0.0, threads: int = 2) -> list[dict]:
    """Times the dense linears (`dense_kernels`) on each [N, K] of `shapes` (default: every `DENSE_SHAPES` matrix) at
    each row count, printing a table per shape; each variant cycles enough copies of its matrix to read at least
    `stream_mb` MB (0: one copy, cache-resident when it fits).

    Returns:
        One dict per (shape, rows, kernel): n, k, rows, kernel, us (median µs per call), gb_s (weight GB/s).
    """
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        return _dense_tables(shapes, rows, iters, stream_mb, threads)
    finally:
        torch.set_num_threads(before)


def _dense_tables(shapes: list[tuple[int, int]] | None, rows: tuple[int, ...], iters: int, stream_mb: float,
                  threads: int) -> list[dict]:
    """`dense`'s tables, under the thread count it set."""
    shapes = shapes or [s for model in DENSE_SHAPES.values() for s in model]
    results = []
    for n, k in shapes:
        copies = max(1, math.ceil(stream_mb * 1e6 / (2 * n * k)))
        table = dense_kernels(n, k, copies)
        print(f"[{n}, {k}] weight, {copies} copies cycled, {threads} threads; µs per call (weight GB read per second)")
        print("rows  " + "".join(f"{name:>22}" for name in table))
        for m in rows:
            x = torch.randn(m, k)
            cells = []
            for name, (fn, nbytes, dtype) in table.items():
                xd = x.to(dtype)
                us = _time(lambda: fn(xd), iters)
                results.append(dict(n=n, k=k, rows=m, kernel=name, us=us, gb_s=nbytes / us / 1e3))
                cells.append(f"{us:9.0f} ({nbytes / us / 1e3:5.1f} GB/s)")
            print(f"{m:>4}  " + "".join(f"{c:>22}" for c in cells))
    return results


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.kernels", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shape", type=int, nargs=2, default=None, metavar=("N", "K"),
                   help="weight [out, in] (default Qwen2.5-1.5B's MLP up projection, 8960 1536; with --dense, every "
                        "DENSE_SHAPES matrix)")
    p.add_argument("--rows", type=int, nargs="+", default=None,
                   help="row counts M (default 1 4 5 8; with --dense 1 5 8 12)")
    p.add_argument("--iters", type=int, default=200)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--copies", type=int, default=1,
                   help="distinct copies of the matrix, cycled (weights from DRAM); nextn's kernels only when > 1")
    p.add_argument("--dense", action="store_true",
                   help="time the dense linears (nextn's batch-invariant kernel, oneDNN bf16, F.linear fp32) instead")
    p.add_argument("--stream-mb", type=float, default=0.0,
                   help="with --dense: copies of each matrix cycled, at least this many MB a kernel (default one copy)")
    p.add_argument("--variants", nargs="+", default=None,
                   help="time nextn's kernels under each of these ISA variants, alternated (default: the one in use)")
    p.add_argument("--rounds", type=int, default=1,
                   help="times every kernel at each row count, alternating them; the best median is printed")
    args = p.parse_args(argv)
    if args.dense:
        dense([tuple(args.shape)] if args.shape else None, tuple(args.rows or (1, 5, 8, 12)), args.iters,
              args.stream_mb, args.threads)
        return 0
    args.shape, args.rows = args.shape or [8960, 1536], args.rows or [1, 4, 5, 8]
    torch.set_num_threads(args.threads)
    n, k = args.shape
    table = kernels(n, k, copies=args.copies)
    # (column, fn, weight bytes, variant): every kernel once, or nextn's once per variant named
    columns = [(name, fn, nbytes, None) for name, (fn, nbytes) in table.items()]
    if args.variants:
        columns = [(f"{name} [{v}]", fn, nbytes, v) for v in args.variants
                   for name, (fn, nbytes) in table.items() if name.startswith("nextn")]
    where = f", {args.copies} copies cycled (from DRAM)" if args.copies > 1 else ""
    print(f"[{n}, {k}] weight{where}, {args.threads} threads; µs per call (weight GB read per second)")
    width = max(20, *(len(c[0]) + 2 for c in columns))
    print("rows  " + "".join(f"{c[0]:>{width}}" for c in columns))
    for m in args.rows:
        x = torch.randn(m, k, dtype=torch.bfloat16)
        best = [math.inf] * len(columns)
        for _ in range(args.rounds):
            for i, (_, fn, _, variant) in enumerate(columns):
                with cpu_kernels.use(variant) if variant else contextlib.nullcontext():
                    best[i] = min(best[i], _time(lambda: fn(x), args.iters))
        cells = [f"{us:9.0f} ({c[2] / us / 1e3:4.1f} GB/s)" for us, c in zip(best, columns)]
        print(f"{m:>4}  " + "".join(f"{c:>{width}}" for c in cells))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
