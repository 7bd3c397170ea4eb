"""The memory-bandwidth floor of one decode step: bytes a step must read (the weights it touches) divided by the
machine's measured read bandwidth. A benchmark helper, printed beside nextn-bench figures so the gap to the
physical limit is visible.

    python -m nextn.bench.bandwidth --engine_dir DIR [--engine_dir DIR ...]
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import torch
from safetensors import safe_open

from nextn.build.manifest import EngineManifest


def read_bandwidth_gbs(size_mib: int = 512, repeats: int = 5) -> float:
    """Best-of-`repeats` read bandwidth in GB/s: a sum over a `size_mib` MiB fp32 tensor (well beyond the caches)."""
    x = torch.ones(size_mib * 2**20 // 4)
    x.sum()
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        x.sum()
        best = min(best, time.perf_counter() - t0)
    return x.numel() * 4 / best / 1e9


def decode_step_bytes(engine_dir: str | Path) -> tuple[int, int]:
    """(bytes one plain decode step reads at batch 1, total weight bytes): every weight but the embedding table
    (a step gathers one row of it, and reads it whole only as a tied lm_head without a quantized copy), the MTP
    layers and Medusa heads (drafting only) and, for MoE layers, only the routed experts a token selects. W4A16
    group scales and zero points count as the bf16 the kernels read (engines store them as float32)."""
    manifest = EngineManifest.load(engine_dir)
    cfg = manifest.model
    total = step = 0
    with safe_open(str(Path(engine_dir) / manifest.weight_files[0]), "pt") as f:
        own_head = "lm_head.weight" in f.keys()  # untied, or a tied model's quantized lm_head copy
        for name in f.keys():
            shape = f.get_slice(name).get_shape()
            n = f.get_slice(name).get_dtype()
            itemsize = {"F32": 4, "BF16": 2, "F16": 2, "I8": 1, "U8": 1}.get(n, 4)
            if name.endswith((".weight_scale", ".weight_zero")) and len(shape) == 2:
                itemsize = min(itemsize, 2)  # W4A16 group scales / zero points: the kernels read them as bf16
            size = itemsize
            for d in shape:
                size *= d
            total += size
            if name.startswith("medusa_heads."):
                continue  # heads run only when drafting
            if name == "model.embed_tokens.weight":
                # one row is gathered; a tied model also reads the whole table as its lm_head
                step += itemsize * shape[-1] if own_head else size
            elif name == "model.embed_tokens_per_layer.weight":  # Gemma 4's per-layer inputs: one row gathered
                step += itemsize * shape[-1]
            elif ".mlp.experts." in name:
                # an expert's tensor (one of E, stored one by one): read by top-k of E tokens' choices on average
                experts = getattr(cfg, "n_routed_experts", None) or shape[0]
                step += size * getattr(cfg, "num_experts_per_tok", 1) // experts
            elif ".layers." in name and int(name.split(".")[2]) >= cfg.num_hidden_layers:
                continue  # MTP layers run only when drafting
            else:
                step += size
    return step, total


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m nextn.bench.bandwidth", description=__doc__.split("\n\n")[0])
    p.add_argument("--engine_dir", action="append", required=True)
    args = p.parse_args(argv)
    bw = read_bandwidth_gbs()
    print(f"measured read bandwidth: {bw:.1f} GB/s ({torch.get_num_threads()} threads)")
    for engine in args.engine_dir:
        step, total = decode_step_bytes(engine)
        floor_ms = step / (bw * 1e9) * 1e3
        print(f"{engine}: {total / 2**20:.1f} MiB of weights, {step / 2**20:.2f} MiB read per batch-1 decode step "
              f"→ floor {floor_ms:.3f} ms/step ({1e3 / floor_ms:,.0f} tokens/s at batch 1)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
