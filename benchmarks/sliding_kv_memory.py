"""The KV cache's resident memory with and without the sliding-window layers' own blocks (a benchmark, not a test).

A model mixing sliding-window and full layers (Gemma 2 / 3 / 4, gpt-oss, ...) decodes `--requests` long requests
together; the resident size of the KV cache's memory map (`/proc/self/smaps`: the pages written) is read after, once
with the sliding layers' rows in blocks of their own (`runtime/sliding_blocks.py`, the default) and once with those
rows in the pool's blocks (`--pool_blocks`: the engine before them), each in its own process, and the tokens compared.

    python -m benchmarks.sliding_kv_memory --engine runs/eng/gemma3-270m-w4a8 --requests 4 --max_tokens 2000
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path


def _resident_mib(tensor) -> tuple[float, float]:
    """(resident, mapped) MiB of the memory mapping holding `tensor` (Linux /proc/self/smaps)."""
    addr = tensor.data_ptr()
    lines = Path("/proc/self/smaps").read_text().splitlines()
    for i, line in enumerate(lines):
        head = line.split()[0]
        if "-" in head and all(c in "0123456789abcdef-" for c in head):
            lo, hi = (int(x, 16) for x in head.split("-"))
            if lo <= addr < hi:
                rss = next(int(x.split()[1]) for x in lines[i + 1:] if x.startswith("Rss:"))
                return rss / 1024, (hi - lo) / 2**20
    raise RuntimeError("no mapping holds the KV cache (not a CPU engine?)")


def measure(engine: Path, requests: int, max_tokens: int, pool_blocks: bool) -> dict:
    from nextn import LLM, SamplingParams
    from nextn.runtime import engine_loader

    if pool_blocks:
        engine_loader.sliding_plan = lambda *args: None  # the engine before sliding blocks
    llm = LLM(engine, device="cpu", max_batch_size=requests, max_seq_len=max_tokens + 128,
              enable_chunked_prefill=True, max_num_tokens=512, kv_cache_config={"enable_block_reuse": False})
    prompts = [[2] + [1000 + 17 * i + j for j in range(64)] for i in range(requests)]
    t = time.perf_counter()
    outs = llm.generate(prompts, SamplingParams(max_tokens=max_tokens, ignore_eos=True))
    seconds = time.perf_counter() - t
    resident, mapped = _resident_mib(llm.engine.runner.kv_cache)
    sliding = llm.engine.pool.sliding
    llm.shutdown()
    return {"resident_mib": round(resident, 1), "mapped_mib": round(mapped, 1), "seconds": round(seconds, 1),
            "sliding_blocks": sliding.num_blocks if sliding else None,
            "peak_sliding_blocks": sliding.peak_in_use if sliding else None,
            "tokens": [o.outputs[0].token_ids for o in outs]}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--engine", type=Path, required=True, help="a CPU engine of a sliding + full model")
    p.add_argument("--requests", type=int, default=4)
    p.add_argument("--max_tokens", type=int, default=2000)
    p.add_argument("--pool_blocks", action="store_true", help=argparse.SUPPRESS)  # one side, in its own process
    p.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.child:
        print(json.dumps(measure(args.engine, args.requests, args.max_tokens, args.pool_blocks)))
        return 0
    runs = {}
    for side in ("sliding blocks", "pool blocks"):
        cmd = [sys.executable, "-m", "benchmarks.sliding_kv_memory", "--engine", str(args.engine), "--requests",
               str(args.requests), "--max_tokens", str(args.max_tokens), "--child"] + (
            ["--pool_blocks"] if side == "pool blocks" else [])
        runs[side] = json.loads(subprocess.run(cmd, check=True, capture_output=True, text=True).stdout.splitlines()[-1])
    same = runs["sliding blocks"].pop("tokens") == runs["pool blocks"].pop("tokens")
    for side, r in runs.items():
        print(f"{side:15s} KV resident {r['resident_mib']:7.1f} MiB of {r['mapped_mib']:.1f} mapped, "
              f"{r['seconds']:.1f} s; sliding blocks {r['sliding_blocks']} (peak {r['peak_sliding_blocks']})")
    print(f"{args.requests} requests × {args.max_tokens} tokens; outputs identical: {'yes' if same else 'NO'}")
    return 0 if same else 1


if __name__ == "__main__":
    sys.exit(main())
