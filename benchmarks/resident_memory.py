"""The memory an engine takes once loaded, against its size on disk (a benchmark: one engine a process).

    python -m benchmarks.resident_memory --model runs/models/glm-flash/glm-flash-e64-l16-Q4_K_M.gguf --format W4A16
    python -m benchmarks.resident_memory --model ... --format W4A16 --no-release   # the A/B: without page_release

Builds (or takes from `--engine_cache`) the engine of `--model` in `--format` (`nextn.bench.vs_llama_cpp`'s format
names), loads it, reads every weight page once (`touch_weights`: a warm engine) and prints: the engine's weight
files on disk, the peak resident set during the load (`ru_maxrss`), and the resident set after it split into the engine file's mapped pages and the rest (`/proc/self/smaps`). The fused
ops copy some weights (concatenated q/k/v and gate/up, an MoE layer's stacked experts) and repacking makes
intermediates: `--no-release` turns `plugins/page_release.py`'s hints into no-ops to show what they save.
`--processes N` loads the engine in N processes at once and prints each one's private and shared resident memory
and their proportional sum (`/proc/self/smaps_rollup`: what the N cost the machine together); `--portable_experts`
builds the engine with the MoE experts stored portably (repacked and stacked at load, as before engine layout 7:
the A/B of `quantization/kernel_layout.py`, in its own engine cache). Linux only (smaps).

    python -m benchmarks.resident_memory --model ... --format W4A16 --processes 2 [--portable_experts]
"""

from __future__ import annotations

import argparse
import re
import resource
from pathlib import Path
from unittest import mock


def resident_split(file_part: str) -> tuple[int, int]:
    """(bytes resident in mappings of files whose path contains `file_part`, bytes resident elsewhere)."""
    mapped = other = 0
    inside = False
    for line in open("/proc/self/smaps"):
        if re.match(r"^[0-9a-f]+-[0-9a-f]+ ", line):
            inside = file_part in line
        elif line.startswith("Rss:"):
            kb = int(line.split()[1]) * 1024
            mapped, other = (mapped + kb, other) if inside else (mapped, other + kb)
    return mapped, other


def rollup() -> dict[str, int]:
    """This process's `/proc/self/smaps_rollup` fields (Rss, Pss, Shared_Clean, Private_Dirty, ...) in bytes."""
    out = {}
    for line in open("/proc/self/smaps_rollup"):
        parts = line.split()
        if len(parts) == 3 and parts[2] == "kB":
            out[parts[0].rstrip(":")] = int(parts[1]) * 1024
    return out


def touch_weights(llm) -> None:
    """Read one byte of every page of every weight, as serving a while would (each expert chosen at some point):
    the memory figures are then those of a warm engine, not of pages mapped but never read."""
    import torch

    with torch.inference_mode():
        for t in (*llm.engine.model.parameters(), *llm.engine.model.buffers()):
            if t.device.type == "cpu" and t.numel() and t.is_contiguous():
                t.reshape(-1).view(torch.uint8)[::4096].sum()


def _load_and_hold(model: Path, fmt: str, cache: Path, portable: bool, loaded, done, results) -> None:
    """One process of `--processes`: load, report its memory once every process has loaded, hold until told."""
    llm = _load(model, fmt, cache, portable)
    touch_weights(llm)
    loaded.wait()  # every process loaded: the shared pages are counted once among them
    r = rollup()
    results.put({k: r.get(k, 0) for k in ("Rss", "Pss", "Shared_Clean", "Private_Clean", "Private_Dirty")})
    done.wait()
    llm.shutdown()


def _load(model: Path, fmt: str, cache: Path, portable: bool):
    from nextn.bench.vs_llama_cpp import _nextn_llm
    from nextn.quantization import kernel_layout

    if portable:  # every expert stored portably: repacked and stacked at load (the layout before 7)
        with mock.patch.object(kernel_layout, "applies", lambda *a: False):
            return _nextn_llm(model, fmt, cache)
    return _nextn_llm(model, fmt, cache)


def processes(args: argparse.Namespace) -> int:
    """`--processes N`: N processes hold the engine at once; each one's memory and the sum of their Pss."""
    import multiprocessing as mp

    _load(args.model, args.format, args.engine_cache, args.portable_experts).shutdown()  # built once, first
    ctx = mp.get_context("spawn")
    loaded, done, results = ctx.Barrier(args.processes), ctx.Event(), ctx.Queue()
    procs = [ctx.Process(target=_load_and_hold, args=(args.model, args.format, args.engine_cache,
                                                       args.portable_experts, loaded, done, results))
             for _ in range(args.processes)]
    for proc in procs:
        proc.start()
    rows = [results.get(timeout=3600) for _ in procs]
    done.set()
    for proc in procs:
        proc.join()
    layout = "experts portable (repacked at load)" if args.portable_experts else "experts in the kernel's layout"
    for i, r in enumerate(rows):
        print(f"process {i}: resident {r['Rss'] / 1e9:.2f} GB (shared {r['Shared_Clean'] / 1e9:.2f}, private "
              f"{(r['Private_Clean'] + r['Private_Dirty']) / 1e9:.2f}), proportional {r['Pss'] / 1e9:.2f} GB")
    print(f"{args.model.name} {args.format}, {layout}: {args.processes} processes take "
          f"{sum(r['Pss'] for r in rows) / 1e9:.2f} GB together (sum of Pss)")
    return 0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.resident_memory", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", type=Path, required=True, help="a GGUF file, HF checkpoint or engine directory")
    p.add_argument("--format", default="W4A16", help="W4A16, W4A8, bf16, ... (nextn.bench.vs_llama_cpp.FORMATS)")
    p.add_argument("--engine_cache", type=Path, default=Path("runs/engines"))
    p.add_argument("--no-release", action="store_true", help="page_release's hints off (the A/B)")
    p.add_argument("--processes", type=int, default=0, help="load it in this many processes at once (≥ 1)")
    p.add_argument("--portable_experts", action="store_true",
                   help="MoE experts stored portably, repacked at load (the A/B of engine layout 7)")
    args = p.parse_args(argv)
    if args.portable_experts:
        args.engine_cache = args.engine_cache.with_name(args.engine_cache.name + "-portable-experts")
    if args.processes:
        return processes(args)

    from nextn.plugins import page_release

    off = mock.patch.multiple(page_release, release=lambda tensors: 0, trim_heap=lambda: None)
    if args.no_release:
        off.start()
    llm = _load(args.model, args.format, args.engine_cache, args.portable_experts)
    touch_weights(llm)
    engine_dir = Path(llm.engine_dir)
    on_disk = sum(f.stat().st_size for f in engine_dir.glob("*.safetensors"))
    mapped, other = resident_split(str(engine_dir))
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    print(f"{args.model.name} {args.format}{' (no release)' if args.no_release else ''}: engine weights "
          f"{on_disk / 1e9:.2f} GB on disk; peak resident during load {peak / 1e9:.2f} GB; resident after "
          f"{(mapped + other) / 1e9:.2f} GB (engine file pages {mapped / 1e9:.2f}, other {other / 1e9:.2f})")
    llm.shutdown()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
