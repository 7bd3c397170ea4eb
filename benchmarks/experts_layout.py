"""Decode speed of an MoE engine whose experts are read in place from the engine file (engine layout 7, the file's
pages: `quantization/kernel_layout.py`) against the same model's experts repacked at load into anonymous memory
(the layout before): both engines loaded in one process, their runs alternating, best of `--runs` after a warm-up.

    python -m benchmarks.experts_layout --model runs/models/moe-a3b/moe-a3b-e128-l16-Q4_K_M.gguf --format W4A16

The two engines come from `--engine_cache` and its `-portable-experts` sibling (as `benchmarks.resident_memory`
builds them). Greedy outputs must be identical (the same values, only where they live differs).
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path


def main(argv: list[str] | None = None) -> int:
    from benchmarks.resident_memory import _load
    from nextn import SamplingParams
    from nextn.bench.dataset import read_prompt_file

    p = argparse.ArgumentParser(prog="python -m benchmarks.experts_layout", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", required=True, type=Path, help="an MoE GGUF (or checkpoint)")
    p.add_argument("--format", default="W4A16", help="nextn's weight format (vs_llama_cpp's names)")
    p.add_argument("--prompts", type=Path, default=Path("../shared/data/prompts/humaneval.jsonl.gz"))
    p.add_argument("--batch", nargs="+", type=int, default=[1, 8])
    p.add_argument("--max_tokens", type=int, default=64)
    p.add_argument("--runs", type=int, default=3)
    p.add_argument("--engine_cache", type=Path, default=Path("runs/engines"))
    args = p.parse_args(argv)

    portable_cache = args.engine_cache.with_name(args.engine_cache.name + "-portable-experts")
    llms = {"in place (file pages)": _load(args.model, args.format, args.engine_cache, False),
            "repacked at load": _load(args.model, args.format, portable_cache, True)}
    tok = next(iter(llms.values())).tokenizer
    prompts = [tok.encode(t) for t in read_prompt_file(args.prompts)[1][:max(args.batch)]]
    for batch in args.batch:
        sp = SamplingParams(max_tokens=args.max_tokens, ignore_eos=True)
        best: dict[str, float] = {}
        outputs: dict[str, list] = {}
        for run in range(args.runs + 1):
            for name, llm in llms.items():
                t0 = time.perf_counter()
                outs = llm.generate(prompts[:batch], sp)
                dt = time.perf_counter() - t0
                outputs[name] = [o.outputs[0].token_ids for o in outs]
                if run:
                    best[name] = max(best.get(name, 0.0), sum(len(t) for t in outputs[name]) / dt)
        a, b = best.values()
        same = len({json.dumps(o) for o in outputs.values()}) == 1
        print(json.dumps({"batch": batch, **{k: round(v, 1) for k, v in best.items()}, "ratio": round(a / b, 3),
                          "outputs identical": same}), flush=True)
    for llm in llms.values():
        llm.shutdown()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
