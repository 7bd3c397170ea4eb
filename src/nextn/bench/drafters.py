"""Drafters on a real draft/target pair, nextn beside llama.cpp in one invocation (a benchmark, not a test).

On the same chat-templated prompts (HumanEval, MT-bench first turns, or the two alternating), greedy,
`--max_tokens` new tokens with EOS ignored, best of `--runs` after a warm-up, alternating systems so that all see
the same machine:
- nextn: plain decoding, Draft_Target (`--draft` as the draft model, K = `--draft_len`), Draft_Target with
  `adaptive_draft_len`, and NGram (K, n = 3) without and with `adaptive_draft_len` — one engine format for target
  and draft (`--format`);
- llama.cpp (when built, ../shared/PEERS.md): `llama-completion` (plain) and `llama-speculative-simple` (its
  draft-model speculation, `--draft-max K`) on the same GGUF files.

Batch 1: the prompts one after another; tokens/s is decode only on both sides (nextn: tokens after the first over
first-token → finish time, summed over prompts; llama.cpp: its "decoded N tokens in S seconds"). Batch B > 1
(nextn only): all prompts submitted at once, B in flight, total new tokens over the wall time. AL = tokens per
decode step per request (1 + accepted drafts / steps); a speed-up above the AL would be a measurement bug and is
flagged.

    python -m nextn.bench.drafters --target runs/models/qwen2.5-coder-1.5b/*.gguf \\
        --draft runs/models/qwen2.5-coder-0.5b/*.gguf --dataset humaneval --num_prompts 8 --max_tokens 128
"""

from __future__ import annotations

import argparse
import gc
import json
import sys
import time
from pathlib import Path

import torch

from nextn.bench import llama_cpp
from nextn.bench.real_models import load_prompt_texts

FORMATS = {"bf16": None, "fp32": None, "W8A16": {"quant_algo": "W8A16"}, "W4A16": {"quant_algo": "W4A16"},
           "W4A8": {"quant_algo": "W4A8"}}


def _configs(draft: Path, k: int, draft_vocab_sizes: list[int] = (), token_map: Path | None = None
             ) -> dict[str, dict | None]:
    dt = {"decoding_type": "Draft_Target", "max_draft_len": k, "speculative_model_dir": str(draft)}
    ngram = {"decoding_type": "NGram", "max_draft_len": k, "max_matching_ngram_size": 3}
    hot = {} if token_map is None else {"draft_token_map": str(token_map)}
    cut = {f"Draft_Target K={k} draft_vocab_size={v}": {**dt, "draft_vocab_size": v, **hot} for v in draft_vocab_sizes}
    return {"plain": None, f"Draft_Target K={k}": dt, **cut,
            f"Draft_Target K≤{k} adaptive": {**dt, "adaptive_draft_len": True},
            f"NGram K={k}": ngram, f"NGram K≤{k} adaptive": {**ngram, "adaptive_draft_len": True}}


def _llm(target: Path, fmt: str, spec: dict | None, cache: Path | None, max_batch: int):
    from nextn import LLM

    return LLM(target, speculative_config=spec, dtype="float32" if fmt == "fp32" else "bfloat16",
               quant_config=FORMATS[fmt], engine_cache_dir=cache, max_batch_size=max_batch, max_seq_len=2048)


def run_nextn(llm, prompts: list[list[int]], max_tokens: int, batch: int) -> dict:
    """One pass over the prompts: decode tokens/s (batch 1) or throughput (batch > 1), AL and acceptance rate."""
    from nextn import SamplingParams

    params = SamplingParams(max_tokens=max_tokens, ignore_eos=True, detokenize=False)
    t0 = time.perf_counter()
    if batch == 1:
        outs = [llm.generate([p], params)[0].outputs[0] for p in prompts]
        seconds = sum(o.finished_time - o.first_token_time for o in outs)
        tokens = sum(len(o.token_ids) - 1 for o in outs)
    else:
        outs = [r.outputs[0] for r in llm.generate(prompts, params)]
        seconds, tokens = time.perf_counter() - t0, sum(len(o.token_ids) for o in outs)
    steps = sum(o.num_decode_steps for o in outs)
    drafts = sum(o.num_draft_tokens for o in outs)
    accepted = sum(o.num_accepted_draft_tokens for o in outs)
    return {"tps": tokens / seconds, "al": 1 + accepted / steps if steps else 1.0,
            "acceptance_rate": accepted / drafts if drafts else 0.0,
            "tokens": [list(o.token_ids) for o in outs]}


def run_llama_cpp(bin_dir: Path, target: Path, draft: Path, texts: list[str], max_tokens: int, k: int,
                  threads: int) -> dict[str, dict]:
    plain = [llama_cpp.complete(bin_dir, target, t, max_tokens, threads) for t in texts]
    spec = [llama_cpp.speculative(bin_dir, target, draft, t, max_tokens, k, threads) for t in texts]
    drafted, accepted = sum(r.num_drafted for r in spec), sum(r.num_accepted for r in spec)
    return {"llama.cpp plain": {"tps": sum(r.tokens for r in plain) / sum(r.seconds for r in plain), "al": 1.0,
                                "acceptance_rate": 0.0},
            f"llama.cpp draft-model K={k}": {"tps": sum(r.tokens for r in spec) / sum(r.seconds for r in spec),
                                             "al": float("nan"),
                                             "acceptance_rate": accepted / drafted if drafted else 0.0}}


def _texts(dataset: str, n: int) -> list[str]:
    if dataset != "mixed":
        return load_prompt_texts(n if dataset == "mt_bench" else 0, n if dataset == "humaneval" else 0)
    texts = load_prompt_texts(n // 2, n - n // 2)
    chat, code = texts[:n // 2], texts[n // 2:]
    return [t for pair in zip(code, chat) for t in pair] + code[len(chat):]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m nextn.bench.drafters", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--target", required=True, type=Path, help="the target GGUF")
    p.add_argument("--draft", required=True, type=Path, help="the draft GGUF (same vocabulary)")
    p.add_argument("--dataset", choices=("humaneval", "mt_bench", "mixed"), default="humaneval",
                   help="prompt set; mixed: MT-bench and HumanEval alternating (a batch of requests whose drafts "
                        "are accepted at different rates)")
    p.add_argument("--num_prompts", type=int, default=8)
    p.add_argument("--max_tokens", type=int, default=128)
    p.add_argument("--draft_len", type=int, default=4, help="K (default 4)")
    p.add_argument("--draft_vocab_sizes", type=int, nargs="+", default=[],
                   help="also run Draft_Target with the draft head cut to each of these many hot tokens "
                        "(`draft_vocab_size`)")
    p.add_argument("--draft_token_map", type=Path,
                   help="which tokens are hot for --draft_vocab_sizes: a token map (`nextn token-map`); default: the "
                        "lowest ids")
    p.add_argument("--format", choices=list(FORMATS), default="W4A16", help="nextn weight format (default W4A16)")
    p.add_argument("--batch", type=int, nargs="+", default=[1], help="nextn batch sizes (default 1)")
    p.add_argument("--configs", nargs="+", help="subset of nextn configurations (default all)")
    p.add_argument("--runs", type=int, default=2, help="timed passes after a warm-up; best counts (default 2)")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--no_llama_cpp", action="store_true", help="skip llama.cpp")
    p.add_argument("--llama_cpp_bin", help="llama.cpp build/bin (default: $LLAMA_CPP_BIN_DIR or runs/peers/...)")
    p.add_argument("--engine_cache_dir", type=Path, default=Path("runs/engines"))
    p.add_argument("--json", type=Path, help="also write the figures here")
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)

    configs = _configs(args.draft, args.draft_len, args.draft_vocab_sizes, args.draft_token_map)
    if args.configs:
        configs = {name: c for name, c in configs.items() if any(name.startswith(s) for s in args.configs)}
    llms = {name: _llm(args.target, args.format, spec, args.engine_cache_dir, max(args.batch))
            for name, spec in configs.items()}
    tok = next(iter(llms.values())).tokenizer
    texts = _texts(args.dataset, args.num_prompts)
    chats = [tok.tok.apply_chat_template([{"role": "user", "content": t}], tokenize=False,
                                               add_generation_prompt=True) for t in texts]
    prompts = [tok.apply_chat_template([{"role": "user", "content": t}]) for t in texts]
    bin_dir = None if args.no_llama_cpp else llama_cpp.find_bin_dir(args.llama_cpp_bin)
    if bin_dir is None and not args.no_llama_cpp:
        print("llama.cpp: skipped (no build; ../shared/PEERS.md)", file=sys.stderr)
    for llm in llms.values():  # warm-up
        run_nextn(llm, prompts[:1], 8, 1)
    rows: dict[str, dict] = {}
    for _ in range(max(1, args.runs)):
        for name, llm in llms.items():
            for b in args.batch:
                r = run_nextn(llm, prompts, args.max_tokens, b)
                key = f"nextn {name} (batch {b})"
                if key not in rows or r["tps"] > rows[key]["tps"]:
                    rows[key] = r
        if bin_dir is not None:
            for key, r in run_llama_cpp(bin_dir, args.target, args.draft, chats, args.max_tokens, args.draft_len,
                                        args.threads).items():
                if key not in rows or r["tps"] > rows[key]["tps"]:
                    rows[key] = r
    plain = {b: rows[f"nextn plain (batch {b})"] for b in args.batch if f"nextn plain (batch {b})" in rows}
    print(f"{args.target.name} ← {args.draft.name}; {args.dataset} × {len(prompts)}, {args.max_tokens} tokens, "
          f"greedy, nextn {args.format}, {args.threads} threads, best of {args.runs}")
    print(f"| system | tokens/s | AL | acceptance rate | vs own plain | identical to plain |")
    print("|---|---:|---:|---:|---:|---|")
    for key, r in rows.items():
        b = int(key.rsplit("batch ", 1)[1].rstrip(")")) if "(batch" in key else 1
        base = plain.get(b)
        speedup = r["tps"] / base["tps"] if base and key.startswith("nextn") else None
        same = "" if "tokens" not in r or not base else ("yes" if r["tokens"] == base["tokens"] else "NO")
        flag = " (above AL: measurement bug)" if speedup and speedup > r["al"] + 0.05 else ""
        print(f"| {key} | {r['tps']:.2f} | {r['al']:.2f} | {100 * r['acceptance_rate']:.1f} % | "
              f"{f'{speedup:.2f}×' if speedup else ''}{flag} | {same} |")
    if "llama.cpp plain" in rows:
        best_peer = max(v["tps"] for k, v in rows.items() if k.startswith("llama.cpp"))
        best_ours = max(v["tps"] for k, v in rows.items() if k.startswith("nextn") and k.endswith("(batch 1)"))
        print(f"nextn's fastest batch-1 configuration / llama.cpp's fastest: {best_ours / best_peer:.2f}×")
    if args.json:
        args.json.write_text(json.dumps({k: {kk: vv for kk, vv in v.items() if kk != "tokens"}
                                         for k, v in rows.items()}, indent=1))
    del llms
    gc.collect()
    return 0


if __name__ == "__main__":
    sys.exit(main())
