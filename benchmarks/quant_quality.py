"""Quality of weight-only quantized engines against the bf16 engine of the same GGUF (a benchmark, not a test).

For each format (`bf16`; `W8A16`; `W4A16` = group 32 with a W8A16 lm_head, the defaults; its variants
`W4A16-lmhead4` (a 4-bit lm_head), `W4A16-lmhead16` (a bf16 lm_head), `W4A16-g64` (group 64)):
- **greedy agreement** with the bf16 engine: `--num_prompts` MT-bench first turns + as many HumanEval prompts
  (chat template applied), `--max_tokens` new tokens each (EOS ignored, so every pair has the same length): the
  share of identical outputs, the median first-divergence index and the share of tokens equal position by position;
- **perplexity** on a held-out slice of `../shared/data/corpora` (the last `--ppl_tokens` tokens of the Python 3.11
  docs and of tinyshakespeare, in windows of `--window` tokens, each scored from its start): exp of the mean
  negative log-likelihood of every token after the first of a window, computed by the engine's own model over its
  paged KV cache (the same forward as a prefill) and its (quantized) lm_head.

    python -m benchmarks.quant_quality --model ../shared/data/models/smollm2-135m-instruct/SmolLM2-135M-Instruct.Q4_1.gguf
    python -m benchmarks.quant_quality --model runs/models/qwen2.5-coder-1.5b/*.gguf --num_prompts 8 --max_tokens 64
"""

from __future__ import annotations

import argparse
import gc
import json
import math
import statistics
import sys
from pathlib import Path

import torch

from nextn.bench.outputs import check_report, write_report
from nextn.bench.real_models import (
    SHARED_DATA, first_divergence, load_prompt_texts, nextn_greedy)

#: format → LLM(quant_config=...) (None: the bf16 engine, the reference)
FORMATS: dict[str, dict | None] = {
    "bf16": None,
    "W8A16": {"quant_algo": "W8A16"},
    "W4A16": {"quant_algo": "W4A16"},  # group 32, lm_head W8A16 (the defaults)
    "W4A16-lmhead4": {"quant_algo": "W4A16", "lm_head_quant_algo": "W4A16"},
    "W4A16-sb256": {"quant_algo": "W4A16", "super_block_size": 256},  # two-level scales (llama.cpp's k-quants)
    "W4A16-one-level": {"quant_algo": "W4A16", "super_block_size": 0},
    "W4A8": {"quant_algo": "W4A8"},  # W4A16's weights, int8 activations per group on nextn's CPU kernel  # bf16 scale and zero per group,
    "W4A16-lmhead16": {"quant_algo": "W4A16", "exclude_modules": ["lm_head"]},
    "W4A16-g64": {"quant_algo": "W4A16", "group_size": 64},
}
CORPORA = ("python311_docs_rst.txt", "tinyshakespeare.txt")


def heldout_windows(tokenizer, num_tokens: int, window: int, data_dir: Path = SHARED_DATA) -> list[list[int]]:
    """The last `num_tokens` tokens of each corpus file, cut into windows of `window` tokens (the rest dropped)."""
    out = []
    for name in CORPORA:
        text = (data_dir / "corpora" / name).read_text(encoding="utf-8")
        ids = tokenizer.encode(text[-8 * num_tokens:])[-num_tokens:]  # ~8 characters per token is ample
        out += [ids[i:i + window] for i in range(0, len(ids) - window + 1, window)]
    return out


def window_nll(llm, windows: list[list[int]]) -> tuple[float, int]:
    """(summed negative log-likelihood in nats, tokens scored) of every window token after the first, each window
    alone from position 0 (`LLM.prompt_logits`; no request may be running)."""
    total, count = 0.0, 0
    for ids in windows:
        logits = llm.prompt_logits(ids)[:-1].cpu()  # [t − 1, vocab] fp32
        nll = torch.nn.functional.cross_entropy(logits, torch.tensor(ids[1:]), reduction="sum")
        total, count = total + float(nll), count + len(ids) - 1
    return total, count


def quality(gguf_file: Path, formats: list[str], num_prompts: int, max_tokens: int, ppl_tokens: int,
            window: int, cache: Path | None) -> list[dict]:
    """One row per format: agreement with the bf16 engine's greedy outputs, and perplexity."""
    from nextn import LLM

    rows, reference, prompts, windows = [], None, None, None
    for fmt in ["bf16", *[f for f in formats if f != "bf16"]]:
        llm = LLM(gguf_file, speculative_config=None, dtype="bfloat16", quant_config=FORMATS[fmt],
                  engine_cache_dir=cache, max_batch_size=8, max_seq_len=max(1024, window + 64))
        if prompts is None:
            prompts = [llm.tokenizer.apply_chat_template([{"role": "user", "content": text}])
                       for text in load_prompt_texts(num_prompts, num_prompts)]
            windows = heldout_windows(llm.tokenizer, ppl_tokens, window)
        outputs = nextn_greedy(llm, prompts, max_tokens, ignore_eos=True)
        nll, n = window_nll(llm, windows)
        reference = reference or outputs
        divs = [first_divergence(a, b) for a, b in zip(outputs, reference)]
        same = sum(x == y for a, b in zip(outputs, reference) for x, y in zip(a, b))
        rows.append({"format": fmt, "identical": sum(d is None for d in divs), "prompts": len(divs),
                     "median_first_divergence": statistics.median([d for d in divs if d is not None] or [max_tokens]),
                     "tokens_equal": same / sum(map(len, reference)), "perplexity": math.exp(nll / n),
                     "ppl_tokens": n})
        print(json.dumps(rows[-1]), file=sys.stderr, flush=True)
        del llm
        gc.collect()
    base = rows[0]["perplexity"]
    for r in rows:
        r["ppl_vs_bf16"] = r["perplexity"] / base - 1
    return rows


def table(model: str, rows: list[dict], max_tokens: int) -> str:
    out = [f"{model}: greedy agreement with bf16 ({max_tokens} tokens) and held-out perplexity",
           "| format | identical outputs | median first divergence | tokens equal | perplexity | vs bf16 |",
           "|---|---:|---:|---:|---:|---:|"]
    for r in rows:
        out.append(f"| {r['format']} | {r['identical']}/{r['prompts']} | {r['median_first_divergence']} | "
                   f"{100 * r['tokens_equal']:.1f} % | {r['perplexity']:.3f} | {100 * r['ppl_vs_bf16']:+.2f} % |")
    return "\n".join(out)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.quant_quality", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", required=True, type=Path, help="a GGUF (llama or qwen2)")
    p.add_argument("--formats", nargs="+", default=list(FORMATS), choices=list(FORMATS))
    p.add_argument("--num_prompts", type=int, default=16, help="MT-bench and as many HumanEval prompts (default 16)")
    p.add_argument("--max_tokens", type=int, default=128, help="greedy tokens per prompt (default 128)")
    p.add_argument("--ppl_tokens", type=int, default=4096, help="held-out tokens per corpus file (default 4096)")
    p.add_argument("--window", type=int, default=512, help="perplexity window in tokens (default 512)")
    p.add_argument("--engine_cache_dir", type=Path, default=None, help="where engines are built (default: LLM's)")
    p.add_argument("--threads", type=int, default=2, help="torch CPU threads (default 2)")
    p.add_argument("--json", type=Path, help="also write the rows here ({\"written_by\": ..., \"model\": ..., "
                   "\"rows\": [...]}; an existing file only when a run of this benchmark wrote it)")
    args = p.parse_args(argv)
    check_report(p, args.json, "quant_quality")
    torch.set_num_threads(args.threads)
    rows = quality(args.model, args.formats, args.num_prompts, args.max_tokens, args.ppl_tokens, args.window,
                   args.engine_cache_dir)
    print(table(args.model.name, rows, args.max_tokens))
    if args.json:
        write_report(args.json, "quant_quality", {"model": str(args.model), "rows": rows})
    return 0


if __name__ == "__main__":
    sys.exit(main())
