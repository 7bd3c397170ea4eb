"""Sampled decoding's cost of top-k / top-p: `python -m benchmarks.sampled_decode --model GGUF [--format W4A8]`.

Decode tokens/s of one engine (`--config`: with a speculative config) at each batch size, greedy and sampled with common settings (Qwen's recommended
temperature 0.7 / top-p 0.8 / top-k 20; OpenAI-style top-p 0.95 alone), the filters' thresholds taken from each
row's `CANDIDATES` largest logits (nextn's CPU path) and, alternating in the same process, from a sort of every row
(what the filters cost before it: `CANDIDATES` above the vocabulary). Real-text prompts (HumanEval) so that the
model's distributions are a real model's. Best of `--runs` after a warm-up.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import yaml

SETTINGS = {"greedy": {}, "T0.7 top-p 0.8 top-k 20": dict(temperature=0.7, top_p=0.8, top_k=20),
            "T0.7 top-p 0.95": dict(temperature=0.7, top_p=0.95)}


def main(argv: list[str] | None = None) -> int:
    from nextn import SamplingParams
    from nextn.bench.dataset import read_prompt_file
    from nextn.bench.vs_llama_cpp import _nextn_llm
    import nextn.plugins.sampling as sampling

    p = argparse.ArgumentParser(prog="python -m benchmarks.sampled_decode", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", required=True, type=Path, help="a GGUF (or an engine directory)")
    p.add_argument("--format", default="W4A8", help="nextn's weight format (vs_llama_cpp's names)")
    p.add_argument("--prompts", type=Path, default=Path("../shared/data/prompts/humaneval.jsonl.gz"))
    p.add_argument("--config", type=Path, help="an extra_llm_api_options YAML whose speculative_config to decode with")
    p.add_argument("--batch", nargs="+", type=int, default=[1, 8])
    p.add_argument("--max_tokens", type=int, default=64)
    p.add_argument("--runs", type=int, default=3)
    p.add_argument("--engine_cache", type=Path, default=Path("runs/engines"))
    args = p.parse_args(argv)

    spec = yaml.safe_load(args.config.read_text()).get("speculative_config") if args.config else None
    llm = _nextn_llm(args.model, args.format, args.engine_cache, speculative_config=spec)
    tok = llm.tokenizer
    texts = read_prompt_file(args.prompts)[1][:max(args.batch)]
    prompts = [tok.encode(t) for t in texts]
    paths = {"candidates": sampling.CANDIDATES, "every row sorted": 1 << 30}
    rows = []
    for batch in args.batch:
        for name, params in SETTINGS.items():
            sps = [SamplingParams(max_tokens=args.max_tokens, ignore_eos=True, seed=i, **params) for i in range(batch)]
            best: dict[str, float] = {}
            for run in range(args.runs + 1):
                for path, c in paths.items():
                    if not params and path != "candidates":
                        continue
                    sampling.CANDIDATES = c
                    t0 = time.perf_counter()
                    outs = llm.generate(prompts[:batch], sps)
                    dt = time.perf_counter() - t0
                    if run:
                        tps = sum(len(o.outputs[0].token_ids) for o in outs) / dt
                        best[path] = max(best.get(path, 0.0), tps)
                        if spec:
                            best["AL"] = sum(o.outputs[0].acceptance_length for o in outs) / len(outs)
            sampling.CANDIDATES = paths["candidates"]
            rows.append({"batch": batch, "sampling": name, **{k: round(v, 1) for k, v in best.items()}})
            print(json.dumps(rows[-1]), flush=True)
    llm.shutdown()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
