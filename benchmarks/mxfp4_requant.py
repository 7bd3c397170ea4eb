"""What re-quantizing MXFP4 experts to nextn's int4 costs (gpt-oss's experts: nextn's engines store them as W4A16 /
W4A8 int4, llama.cpp reads MXFP4 as it is): the relative RMS error of the weights, against the MXFP4 values (the
checkpoint's: gpt-oss's experts were trained in MXFP4) and against the float weights they came from, beside int4
quantization of the float weights directly. Random N(0, 0.02) weights of gpt-oss-20b's expert width (2880), MXFP4 by
the `gguf` library's reference quantizer.

    python -m benchmarks.mxfp4_requant
"""

from __future__ import annotations

import argparse


def main(argv: list[str] | None = None) -> int:
    import numpy as np
    import torch
    from gguf import GGMLQuantizationType, quants

    from nextn.quantization import QuantConfig, dequantize, quantize

    p = argparse.ArgumentParser(prog="python -m benchmarks.mxfp4_requant", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rows", type=int, default=512)
    p.add_argument("--cols", type=int, default=2880)
    args = p.parse_args(argv)
    w = (np.random.default_rng(0).standard_normal((args.rows, args.cols)) * 0.02).astype(np.float32)
    mx = quants.dequantize(quants.quantize(w, GGMLQuantizationType.MXFP4), GGMLQuantizationType.MXFP4)
    w, mx = torch.from_numpy(w), torch.from_numpy(np.ascontiguousarray(mx).reshape(w.shape))

    def rel(a: torch.Tensor, b: torch.Tensor) -> float:
        return float((a - b).norm() / b.norm())

    print(f"MXFP4 against the float weights: {rel(mx, w):.4f}")
    for name, cfg in {"W4A16 / W4A8, group 32": QuantConfig(quant_algo="W4A16", group_size=32),
                      "two-level (Q4_K-like)": QuantConfig(quant_algo="W4A16", group_size=32, super_block_size=256)}.items():
        d = dequantize(quantize(mx, cfg), cfg).float()
        direct = dequantize(quantize(w, cfg), cfg).float()
        print(f"int4 {name} of the MXFP4 values: {rel(d, mx):.4f} against MXFP4, {rel(d, w):.4f} against the float "
              f"weights (int4 of the float weights directly: {rel(direct, w):.4f})")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
