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

    python -m nextn.bench.kernels --shape 8960 1536 --rows 1 4 5 8
    python -m nextn.bench.kernels --shape 8960 1536 --rows 1 4 5 --copies 96 --iters 20   # ~660 MB of int4
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable

import torch
import torch.nn.functional as F

from nextn.plugins import woq_linear
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
            return torch.ops.nextn.woq_int8_linear(x, *int8[turn["int8"]], None)

        def nextn_int4(x):
            turn["int4"] = (turn["int4"] + 1) % copies
            return torch.ops.nextn.woq_int4_linear(x, *int4[turn["int4"]], group, None)

        def nextn_int4k(x):
            turn["int4k"] = (turn["int4k"] + 1) % copies
            return torch.ops.nextn.woq_int4_linear(x, *int4k[turn["int4k"]], group, None)

        def nextn_int4a8(x):  # W4A8 (the same bytes; the vpdpbusd layout is a permutation of them)
            turn["int4k"] = (turn["int4k"] + 1) % copies
            return torch.ops.nextn.woq_int4_linear(x, *int4k[turn["int4k"]], group, None, True)

        out["nextn int8"] = (nextn_int8, n * k + 4 * n)
        out[f"nextn int4 g{group}"] = (nextn_int4, n * k // 2 + 4 * n * (k // group))
        out[f"nextn int4 g{group} super {sb}"] = (nextn_int4k, n * k // 2 + 2 * n * (k // group) + 4 * n * (k // sb))
        out[f"nextn W4A8 g{group} super {sb}"] = (nextn_int4a8, n * k // 2 + 2 * n * (k // group) + 4 * n * (k // sb))
    if copies == 1 and packing_supported(torch.device("cpu"), torch.bfloat16):
        packed = torch.ops.mkldnn._reorder_linear_weight(w, None)
        out["bf16 packed"] = (lambda x: packed_linear(x, packed, None), 2 * n * k)
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m nextn.bench.kernels", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shape", type=int, nargs=2, default=[8960, 1536], metavar=("N", "K"),
                   help="weight [out, in] (default Qwen2.5-1.5B's MLP up projection, 8960 1536)")
    p.add_argument("--rows", type=int, nargs="+", default=[1, 4, 5, 8], help="row counts M (default 1 4 5 8)")
    p.add_argument("--iters", type=int, default=200)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--copies", type=int, default=1,
                   help="distinct copies of the matrix, cycled (weights from DRAM); nextn's kernels only when > 1")
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    n, k = args.shape
    table = kernels(n, k, copies=args.copies)
    where = f", {args.copies} copies cycled (from DRAM)" if args.copies > 1 else ""
    print(f"[{n}, {k}] weight{where}, {args.threads} threads; µs per call (weight GB read per second)")
    print("rows  " + "".join(f"{name:>20}" for name in table))
    for m in args.rows:
        x = torch.randn(m, k, dtype=torch.bfloat16)
        cells = []
        for fn, nbytes in table.values():
            us = _time(lambda: fn(x), args.iters)
            cells.append(f"{us:9.0f} ({nbytes / us / 1e3:4.1f} GB/s)")
        print(f"{m:>4}  " + "".join(f"{c:>20}" for c in cells))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
