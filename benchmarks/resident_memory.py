"""The memory an engine takes once loaded, against its size on disk (a benchmark: one engine a process).

    python -m benchmarks.resident_memory --model runs/models/glm-flash/glm-flash-e64-l16-Q4_K_M.gguf --format W4A16
    python -m benchmarks.resident_memory --model ... --format W4A16 --no-release   # the A/B: without page_release

Builds (or takes from `--engine_cache`) the engine of `--model` in `--format` (`nextn.bench.vs_llama_cpp`'s format
names), loads it and prints: the engine's weight files on disk, the peak resident set during the load (`ru_maxrss`),
and the resident set after it split into the engine file's mapped pages and the rest (`/proc/self/smaps`). The fused
ops copy some weights (concatenated q/k/v and gate/up, an MoE layer's stacked experts) and repacking makes
intermediates: `--no-release` turns `plugins/page_release.py`'s hints into no-ops to show what they save.
Linux only (smaps).
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


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.resident_memory", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", type=Path, required=True, help="a GGUF file, HF checkpoint or engine directory")
    p.add_argument("--format", default="W4A16", help="W4A16, W4A8, bf16, ... (nextn.bench.vs_llama_cpp.FORMATS)")
    p.add_argument("--engine_cache", type=Path, default=Path("runs/engines"))
    p.add_argument("--no-release", action="store_true", help="page_release's hints off (the A/B)")
    args = p.parse_args(argv)

    from nextn.bench.vs_llama_cpp import _nextn_llm
    from nextn.plugins import page_release

    off = mock.patch.multiple(page_release, release=lambda tensors: 0, trim_heap=lambda: None)
    if args.no_release:
        off.start()
    llm = _nextn_llm(args.model, args.format, args.engine_cache)
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
