"""Real quantized GGUFs (SmolLM2-135M, Qwen2.5-Coder-0.5B/1.5B): nextn beside `transformers` on the same prompts.

Two measurements, for docs/PERFORMANCE.md (tests/models/test_real_gguf.py checks the exactness part on fewer prompts):
- `agreement`: greedy outputs of nextn in float32 against `transformers` loading the same GGUF in float32
  (`AutoModelForCausalLM.from_pretrained(dir, gguf_file=name, dtype=torch.float32)`, ../shared/PEERS.md), and of
  nextn in bfloat16 against nextn in float32: the share of identical outputs and the first-divergence positions.
- `speed`: plain (non-speculative) greedy tokens/s at batch 1 and 8, nextn (float32, bfloat16) beside `transformers`
  (same dtypes) in the same process on the same prompts, best of `--repeats` runs after a warm-up.
  `generate tok/s` = B · max_tokens / wall time of the whole call (prefill included); `decode tok/s` =
  B · (max_tokens − 1) / (t(max_tokens) − t(1)), i.e. with the prefill and first token subtracted.

Prompts are the first turns of MT-bench and the HumanEval prompts (../shared/data/prompts), chat-templated and
tokenized by `transformers`' tokenizer of the GGUF, so both systems decode the very same token ids. Engines are built
once into `--work_dir` (git-ignored `runs/` by default) and reused.

    python -m nextn.bench.real_models agreement --model SmolLM2-135M-Instruct.Q4_1.gguf --num_prompts 16
    python -m nextn.bench.real_models speed --model A.gguf --model B.gguf --threads 2
"""

from __future__ import annotations

import argparse
import gc
import json
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path

import torch

from nextn.config.prompt_files import json_lines
from nextn.bench.outputs import check_report, write_report

SHARED_DATA = Path(__file__).resolve().parents[3].parent / "shared" / "data"
DEFAULT_WORK_DIR = Path("runs/bench/real_models")


# Prompts ------------------------------------------------------------------------------------------------
def load_prompt_texts(num_mt_bench: int, num_humaneval: int, data_dir: Path = SHARED_DATA) -> list[str]:
    """The first turns of the first `num_mt_bench` MT-bench questions, then the first `num_humaneval` HumanEval
    prompts (function signatures + docstrings), from `data_dir/prompts`.

    Raises:
        DatasetError: a prompt file is absent, not a regular file, over `MAX_PROMPT_FILE_BYTES` (decompressed), or
            not JSON lines (bench/dataset.py).
    """
    prompts = data_dir / "prompts"
    mt = [row["turns"][0] for _, row in json_lines(prompts / "mt_bench.jsonl", "prompt file")][:num_mt_bench]
    he = [row["prompt"] for _, row in json_lines(prompts / "humaneval.jsonl.gz", "prompt file")][:num_humaneval]
    return mt + he


def chat_prompt_ids(tokenizer, texts: Sequence[str]) -> list[list[int]]:
    """Each text as one user turn through the tokenizer's chat template, generation prompt added → token ids; a base
    model without a template (Gemma-3-270M's GGUF) gets the text itself after BOS."""
    out = []
    for text in texts:
        if not getattr(tokenizer, "chat_template", None):
            out.append([int(i) for i in tokenizer(text)["input_ids"]])
            continue
        ids = tokenizer.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True,
                                            tokenize=True)
        ids = ids["input_ids"] if hasattr(ids, "keys") else ids
        out.append([int(i) for i in ids])
    return out


def load_transformers(gguf_file: Path, dtype: torch.dtype = torch.float32):
    """(model, tokenizer) of `transformers` loading the GGUF (dequantized into `dtype`), the numerical oracle."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(gguf_file.parent, gguf_file=gguf_file.name, trust_remote_code=False)
    model = AutoModelForCausalLM.from_pretrained(gguf_file.parent, gguf_file=gguf_file.name, dtype=dtype,
                                                 trust_remote_code=False)
    return model.eval().requires_grad_(False), tok


# Greedy decoding on both sides --------------------------------------------------------------------------
def transformers_greedy(model, prompts: Sequence[list[int]], max_tokens: int, ignore_eos: bool = False,
                        pad_token_id: int = 0) -> list[list[int]]:
    """Greedy continuations by `model.generate(do_sample=False)`: one call for all prompts (left-padded, with an
    attention mask) → per prompt the new token ids (up to `max_tokens`; EOS ends one unless `ignore_eos`)."""
    width = max(len(p) for p in prompts)
    ids = torch.tensor([[pad_token_id] * (width - len(p)) + list(p) for p in prompts])
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
    extra = {"min_new_tokens": max_tokens} if ignore_eos else {}
    with torch.inference_mode():
        out = model.generate(ids, attention_mask=mask, max_new_tokens=max_tokens, do_sample=False,
                             pad_token_id=pad_token_id, **extra)
    eos = model.generation_config.eos_token_id
    eos = set(eos if isinstance(eos, list) else [eos]) if eos is not None else set()
    results = []
    for row in out[:, width:].tolist():
        cut = next((i + 1 for i, t in enumerate(row) if t in eos), len(row)) if not ignore_eos else len(row)
        results.append(row[:cut])
    return results


def nextn_greedy(llm, prompts: Sequence[list[int]], max_tokens: int, ignore_eos: bool = False) -> list[list[int]]:
    """Greedy continuations by `LLM.generate` (all prompts in one in-flight batch) → the new token ids each."""
    from nextn.runtime.sampling_params import SamplingParams

    params = SamplingParams(max_tokens=max_tokens, ignore_eos=ignore_eos, detokenize=False)
    return [list(r.outputs[0].token_ids) for r in llm.generate(list(prompts), params)]


def up_to_first_eos(tokens: Sequence[int], eos_ids: set[int]) -> list[int]:
    """`tokens` cut after the first end-of-generation id (both systems stop there; which ids count may differ)."""
    return list(tokens[: next((i + 1 for i, t in enumerate(tokens) if t in eos_ids), len(tokens))])


def first_divergence(a: Sequence[int], b: Sequence[int]) -> int | None:
    """Index of the first differing token (a length difference counts at the shorter length); None if equal."""
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


def build_cached_engine(gguf_file: Path, dtype: str, work_dir: Path) -> Path:
    """`build-engine` of `gguf_file` in `dtype` into `work_dir/<stem>-<dtype>`, reused when already built."""
    from nextn.build.engine_builder import build_engine

    out = work_dir / f"{gguf_file.stem}-{dtype}"
    if not (out / "manifest.json").is_file():
        build_engine(gguf_file, out, dtype=dtype, max_batch_size=8, max_seq_len=1024, progress=False)
    return out


def fitting_max_seq_len(prompts: Sequence[list[int]], max_tokens: int) -> int:
    """The longest prompt + `max_tokens`, rounded up to 64: the decode step attends over block tables as wide as
    max_seq_len (fixed shapes), so a loose max_seq_len costs every step time."""
    return -(-(max(len(p) for p in prompts) + max_tokens) // 64) * 64


def load_llm(engine_dir: Path, max_batch_size: int = 8, max_seq_len: int = 1024):
    """`LLM` over an engine, plain decoding on the CPU."""
    from nextn.runtime.llm import LLM

    return LLM(engine_dir, speculative_config=None, max_batch_size=max_batch_size, max_seq_len=max_seq_len,
               device="cpu")


# agreement ----------------------------------------------------------------------------------------------
def _summary(pairs: list[tuple[list[int], list[int]]]) -> dict:
    divs = [first_divergence(a, b) for a, b in pairs]
    diverged = sorted(d for d in divs if d is not None)
    return {"prompts": len(pairs), "identical": sum(d is None for d in divs),
            "first_divergence": diverged,
            "median_first_divergence": statistics.median(diverged) if diverged else None}


def agreement(gguf_file: Path, num_prompts: int, max_tokens: int, work_dir: Path, vs_transformers: bool) -> dict:
    """nextn bf16 vs nextn fp32 (and, with `vs_transformers`, nextn fp32 vs transformers fp32) on `num_prompts`
    MT-bench + `num_prompts` HumanEval prompts × `max_tokens` greedy tokens (EOS ends a sequence on both sides)."""
    hf, tok = load_transformers(gguf_file)
    prompts = chat_prompt_ids(tok, load_prompt_texts(num_prompts, num_prompts))
    outputs = {}
    for dtype in ("float32", "bfloat16"):
        llm = load_llm(build_cached_engine(gguf_file, dtype, work_dir),
                       max_seq_len=fitting_max_seq_len(prompts, max_tokens))
        outputs[dtype] = nextn_greedy(llm, prompts, max_tokens)
        eos = set(llm.eos_ids)
        del llm
        gc.collect()
    result = {"model": gguf_file.name, "max_tokens": max_tokens,
              "bf16_vs_fp32": _summary(list(zip(outputs["bfloat16"], outputs["float32"])))}
    if vs_transformers:
        ref = [transformers_greedy(hf, [p], max_tokens)[0] for p in prompts]  # batch 1: no padding in the oracle
        eos |= set(hf.generation_config.eos_token_id if isinstance(hf.generation_config.eos_token_id, list)
                   else [hf.generation_config.eos_token_id])
        result["fp32_vs_transformers"] = _summary([(up_to_first_eos(a, eos), up_to_first_eos(b, eos))
                                                   for a, b in zip(outputs["float32"], ref)])
    return result


# speed --------------------------------------------------------------------------------------------------
def _best_time(fn: Callable[[], object], repeats: int) -> float:
    fn()  # warm-up
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best


def _rates(run: Callable[[list[list[int]], int], object], prompts: list[list[int]], batch_sizes: Sequence[int],
           max_tokens: int, repeats: int) -> dict[int, dict[str, float]]:
    rates = {}
    for b in batch_sizes:
        batch = (prompts * b)[:b]
        full = _best_time(lambda: run(batch, max_tokens), repeats)
        first = _best_time(lambda: run(batch, 1), repeats)
        rates[b] = {"generate_tok_s": b * max_tokens / full,
                    "decode_tok_s": b * (max_tokens - 1) / max(full - first, 1e-9)}
    return rates


def speed(gguf_file: Path, batch_sizes: Sequence[int], max_tokens: int, repeats: int, work_dir: Path,
          dtypes: Sequence[str]) -> dict:
    """Tokens/s of nextn and transformers for each dtype and batch size (every sequence runs `max_tokens` tokens)."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(gguf_file.parent, gguf_file=gguf_file.name, trust_remote_code=False)
    prompts = chat_prompt_ids(tok, load_prompt_texts(max(batch_sizes), 0))
    result: dict = {"model": gguf_file.name, "max_tokens": max_tokens, "repeats": repeats,
                    "prompt_lens": [len(p) for p in prompts], "nextn": {}, "transformers": {}}
    for dtype in dtypes:
        llm = load_llm(build_cached_engine(gguf_file, dtype, work_dir), max_batch_size=max(batch_sizes),
                       max_seq_len=fitting_max_seq_len(prompts, max_tokens))
        result["nextn"][dtype] = _rates(lambda b, n: nextn_greedy(llm, b, n, ignore_eos=True), prompts, batch_sizes,
                                        max_tokens, repeats)
        del llm
        gc.collect()
        hf, _ = load_transformers(gguf_file, getattr(torch, dtype))
        pad = tok.pad_token_id if tok.pad_token_id is not None else 0
        result["transformers"][dtype] = _rates(lambda b, n: transformers_greedy(hf, b, n, ignore_eos=True, pad_token_id=pad),
                                               prompts, batch_sizes, max_tokens, repeats)
        del hf
        gc.collect()
    return result


# Tables -------------------------------------------------------------------------------------------------
def agreement_table(results: list[dict]) -> str:
    lines = ["| model | comparison | identical outputs | first divergence (token index) of the others |",
             "|---|---|---|---|"]
    for r in results:
        for key, label in (("fp32_vs_transformers", "nextn fp32 vs transformers fp32"),
                           ("bf16_vs_fp32", "nextn bf16 vs nextn fp32")):
            if key in r:
                s = r[key]
                divs = ", ".join(map(str, s["first_divergence"])) or "—"
                med = f" (median {s['median_first_divergence']})" if s["first_divergence"] else ""
                lines.append(f"| {r['model']} | {label} | {s['identical']}/{s['prompts']} | {divs}{med} |")
    return "\n".join(lines)


def speed_table(results: list[dict]) -> str:
    lines = ["| model | dtype | batch | nextn generate tok/s | transformers generate tok/s | nextn decode tok/s | "
             "transformers decode tok/s | nextn / transformers (decode) |", "|---|---|---|---|---|---|---|---|"]
    for r in results:
        for dtype, per_batch in r["nextn"].items():
            for b, ours in per_batch.items():
                theirs = r["transformers"][dtype][b]
                lines.append(f"| {r['model']} | {dtype} | {b} | {ours['generate_tok_s']:.1f} | "
                             f"{theirs['generate_tok_s']:.1f} | {ours['decode_tok_s']:.1f} | "
                             f"{theirs['decode_tok_s']:.1f} | {ours['decode_tok_s'] / theirs['decode_tok_s']:.2f}× |")
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m nextn.bench.real_models", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="command", required=True)
    a = sub.add_parser("agreement", help="share of identical greedy outputs: bf16 vs fp32, fp32 vs transformers")
    s = sub.add_parser("speed", help="plain greedy tokens/s at batch 1 and 8, nextn beside transformers")
    for q in (a, s):
        q.add_argument("--model", action="append", type=Path, required=True, metavar="GGUF",
                       help="a .gguf file (repeat for several models)")
        q.add_argument("--max_tokens", type=int, default=64, help="new tokens per prompt (default 64)")
        q.add_argument("--work_dir", type=Path, default=DEFAULT_WORK_DIR,
                       help=f"where engines are built and reused (default {DEFAULT_WORK_DIR})")
        q.add_argument("--threads", type=int, default=2, help="torch CPU threads (default 2)")
        q.add_argument("--json", type=Path, help="also write the raw results here ({\"written_by\": ..., \"results\": "
                       "[...]}; an existing file only when a run of this benchmark wrote it)")
    a.add_argument("--num_prompts", type=int, default=16, help="MT-bench and as many HumanEval prompts (default 16)")
    a.add_argument("--no_transformers", action="store_true", help="skip the nextn fp32 vs transformers comparison")
    s.add_argument("--batch_sizes", type=int, nargs="+", default=[1, 8])
    s.add_argument("--repeats", type=int, default=3, help="timed runs after one warm-up; the best counts (default 3)")
    s.add_argument("--dtypes", nargs="+", default=["float32", "bfloat16"], choices=("float32", "bfloat16"))
    args = p.parse_args(argv)
    check_report(p, args.json, "real_models")
    torch.set_num_threads(args.threads)
    results = []
    for model in args.model:
        if args.command == "agreement":
            results.append(agreement(model, args.num_prompts, args.max_tokens, args.work_dir,
                                     vs_transformers=not args.no_transformers))
        else:
            results.append(speed(model, args.batch_sizes, args.max_tokens, args.repeats, args.work_dir, args.dtypes))
        print(json.dumps(results[-1]), file=sys.stderr, flush=True)
    print(agreement_table(results) if args.command == "agreement" else speed_table(results))
    if args.json:
        write_report(args.json, "real_models", {"command": args.command, "results": results})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
