"""Drafters on a real draft/target pair, nextn beside llama.cpp in one invocation (a benchmark, not a test).

On the same chat-templated prompts (HumanEval, MT-bench first turns, or the two alternating), greedy,
`--max_tokens` new tokens with EOS ignored, best of `--runs` after a warm-up, alternating systems so that all see
the same machine:
- nextn: plain decoding, Draft_Target (`--draft` as the draft model, K = `--draft_len`), Draft_Target with
  `adaptive_draft_len`, NGram (K, n = 3) and Suffix decoding (K; its global tree holds the earlier passes' responses,
  so the timed passes repeat requests) without and with `adaptive_draft_len`, and, for a target with MTP modules
  (a `train-draft --method mtp` output or an engine built from one), MTP with K = each of `--mtp_len`, without
  and with `adaptive_draft_len` — one engine format for target and draft (`--format`);
- llama.cpp (when built, ../shared/PEERS.md): `llama-completion` (plain) and, with `--draft`,
  `llama-speculative-simple` (its draft-model speculation, `--draft-max K`) on the same GGUF files
  (`--llama_cpp_model`: the GGUF of a target that is not one).

`--held_out_from HEADS` takes the prompts from a train-draft run's held-out set (never trained on; as
`benchmarks.mtp_tree_al`), so that trained heads are measured on prompts they have not seen.

Batch 1: the prompts one after another; tokens/s is decode only on both sides (nextn: tokens after the first over
first-token → finish time, summed over prompts; llama.cpp: its "decoded N tokens in S seconds"). Batch B > 1
(nextn only): the prompts in waves of B submitted together, total new tokens over the wall time. AL = tokens per
decode step per request (1 + accepted drafts / steps); a speed-up above the AL would be a measurement bug and is
flagged.

    python -m benchmarks.drafters --target runs/models/qwen2.5-coder-1.5b/*.gguf \\
        --draft runs/models/qwen2.5-coder-0.5b/*.gguf --dataset humaneval --num_prompts 8 --max_tokens 128
    python -m benchmarks.drafters --target runs/issue16/qwen05-mtp-1k --held_out_from runs/issue16/qwen05-mtp-1k \\
        --llama_cpp_model runs/models/qwen2.5-coder-0.5b/*.gguf --mtp_len 2 3 --draft_vocab_sizes 32768
"""

from __future__ import annotations

import argparse
import gc
import sys
from pathlib import Path

import torch

from nextn.bench import llama_cpp
from benchmarks.decode_pass import run_nextn
from nextn.bench.outputs import check_report, write_report
from nextn.bench.real_models import load_prompt_texts

FORMATS = {"bf16": None, "fp32": None, "W8A16": {"quant_algo": "W8A16"}, "W4A16": {"quant_algo": "W4A16"},
           "W4A8": {"quant_algo": "W4A8"}}


def _configs(draft: Path | None, k: int, draft_vocab_sizes: list[int] = (), token_map: Path | None = None,
             mtp_lens: list[int] = ()) -> dict[str, dict | None]:
    """Name → speculative_config: plain; Draft_Target (when `draft`), NGram, MTP chains of each of `mtp_lens`
    drafts; the draft-model and MTP heads also cut to each of `draft_vocab_sizes` hot tokens."""
    hot = {} if token_map is None else {"draft_token_map": str(token_map)}

    def with_cuts(name: str, spec: dict) -> dict[str, dict]:
        return {name: spec, **{f"{name} draft_vocab_size={v}": {**spec, "draft_vocab_size": v, **hot}
                               for v in draft_vocab_sizes}}

    out: dict[str, dict | None] = {"plain": None}
    if draft is not None:
        dt = {"decoding_type": "Draft_Target", "max_draft_len": k, "speculative_model_dir": str(draft)}
        out |= with_cuts(f"Draft_Target K={k}", dt)
        out[f"Draft_Target K≤{k} adaptive"] = {**dt, "adaptive_draft_len": True}
    ngram = {"decoding_type": "NGram", "max_draft_len": k, "max_matching_ngram_size": 3}
    out |= {f"NGram K={k}": ngram, f"NGram K≤{k} adaptive": {**ngram, "adaptive_draft_len": True}}
    suffix = {"decoding_type": "Suffix", "max_draft_len": k}  # drafts from earlier responses: pays on repeats
    out |= {f"Suffix K={k}": suffix,
            f"Suffix K≤{k} adaptive": {**suffix, "adaptive_draft_len": True, "step_profile": "auto"}}
    for n in mtp_lens:
        mtp = {"decoding_type": "MTP", "num_nextn_predict_layers": n}
        out |= with_cuts(f"MTP K={n}", mtp) | with_cuts(f"MTP K≤{n} adaptive", {**mtp, "adaptive_draft_len": True})
    return out


def _llm(target: Path, fmt: str, spec: dict | None, cache: Path | None, max_batch: int):
    from nextn import LLM

    return LLM(target, speculative_config=spec, dtype="float32" if fmt == "fp32" else "bfloat16",
               quant_config=FORMATS[fmt], engine_cache_dir=cache, max_batch_size=max_batch, max_seq_len=2048)


def run_llama_cpp(bin_dir: Path, target: Path, draft: Path | None, texts: list[str], max_tokens: int, k: int,
                  threads: int) -> dict[str, dict]:
    """llama.cpp's plain decoding of `target` and (with `draft`) its draft-model speculation over `texts`."""
    plain = [llama_cpp.complete(bin_dir, target, t, max_tokens, threads) for t in texts]
    out = {"llama.cpp plain": {"tps": sum(r.tokens for r in plain) / sum(r.seconds for r in plain), "al": 1.0,
                               "acceptance_rate": 0.0}}
    if draft is not None:
        spec = [llama_cpp.speculative(bin_dir, target, draft, t, max_tokens, k, threads) for t in texts]
        drafted, accepted = sum(r.num_drafted for r in spec), sum(r.num_accepted for r in spec)
        out[f"llama.cpp draft-model K={k}"] = {"tps": sum(r.tokens for r in spec) / sum(r.seconds for r in spec),
                                              "al": float("nan"),
                                              "acceptance_rate": accepted / drafted if drafted else 0.0}
    return out


def _texts(dataset: str, n: int) -> list[str]:
    if dataset != "mixed":
        return load_prompt_texts(n if dataset == "mt_bench" else 0, n if dataset == "humaneval" else 0)
    texts = load_prompt_texts(n // 2, n - n // 2)
    chat, code = texts[:n // 2], texts[n // 2:]
    return [t for pair in zip(code, chat) for t in pair] + code[len(chat):]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.drafters", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--target", required=True, type=Path,
                   help="the target: a GGUF, or a checkpoint / engine directory (e.g. a train-draft MTP output)")
    p.add_argument("--draft", type=Path, help="the draft GGUF (same vocabulary; default: no Draft_Target runs)")
    p.add_argument("--mtp_len", type=int, nargs="+", default=[],
                   help="also run MTP with these many drafts a step (the target must carry MTP modules)")
    p.add_argument("--held_out_from", type=Path, metavar="HEADS",
                   help="prompts from this train-draft output's held-out set (--dataset humaneval or mt_bench)")
    p.add_argument("--llama_cpp_model", type=Path,
                   help="the GGUF llama.cpp runs (default: --target when it is a .gguf; else llama.cpp is skipped)")
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
    p.add_argument("--config_files", type=Path, nargs="+", default=[],
                   help="also run the speculative_config of each of these YAML files (e.g. configs/mtp_tree.yaml), "
                        "named by the file")
    p.add_argument("--runs", type=int, default=2, help="timed passes after a warm-up; best counts (default 2)")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--no_llama_cpp", action="store_true", help="skip llama.cpp")
    p.add_argument("--llama_cpp_bin", help="llama.cpp build/bin (default: $LLAMA_CPP_BIN_DIR or runs/peers/...)")
    p.add_argument("--engine_cache_dir", type=Path, default=Path("runs/engines"))
    p.add_argument("--json", type=Path, help="also write the figures here ({\"written_by\": ..., \"systems\": {...}}; "
                   "an existing file only when a run of this benchmark wrote it)")
    args = p.parse_args(argv)
    check_report(p, args.json, "drafters")
    torch.set_num_threads(args.threads)

    if args.held_out_from is not None and args.dataset == "mixed":
        p.error("--held_out_from takes --dataset humaneval or mt_bench")
    if args.held_out_from is not None:  # before any model loads
        from nextn.train.session import read_train_record

        meta = read_train_record(p, args.held_out_from, "--held_out_from")
    configs = _configs(args.draft, args.draft_len, args.draft_vocab_sizes, args.draft_token_map, args.mtp_len)
    if args.configs:
        configs = {name: c for name, c in configs.items() if any(name.startswith(s) for s in args.configs)}
    for path in args.config_files:
        from nextn.config.llm_args import LlmArgsError, load_llm_args_yaml

        try:
            configs[path.name] = load_llm_args_yaml(path).get("speculative_config")
        except (LlmArgsError, OSError) as e:
            p.error(f"--config_files {path}: {e}")
    peer_model = args.llama_cpp_model or (args.target if args.target.suffix == ".gguf" else None)
    bin_dir = None if args.no_llama_cpp or peer_model is None else llama_cpp.find_bin_dir(args.llama_cpp_bin)
    if bin_dir is None and not args.no_llama_cpp:
        why = "no GGUF: --llama_cpp_model" if peer_model is None else "no build; ../shared/PEERS.md"
        print(f"llama.cpp: skipped ({why})", file=sys.stderr)
    tools = ["llama-completion"] + (["llama-speculative-simple"] if args.draft is not None else [])
    missing = [t for t in tools if bin_dir is not None and not (bin_dir / t).is_file()]
    if missing:  # before any engine is built or timed
        p.error(f"{bin_dir} lacks {', '.join(missing)}: `cmake --build build --target {' '.join(missing)}` in "
                "llama.cpp, or --no_llama_cpp")
    llms = {name: _llm(args.target, args.format, spec, args.engine_cache_dir, max(args.batch))
            for name, spec in configs.items()}
    tok = next(iter(llms.values())).tokenizer
    if args.held_out_from is not None:
        from benchmarks.mtp_tree_al import held_out_prompts

        _, prompts = held_out_prompts(meta, args.dataset, args.num_prompts)
        chats = [tok.tok.decode(ids, skip_special_tokens=False) for ids in prompts]
    else:
        texts = _texts(args.dataset, args.num_prompts)
        chats = [tok.tok.apply_chat_template([{"role": "user", "content": t}], tokenize=False,
                                             add_generation_prompt=True) for t in texts]
        prompts = [tok.apply_chat_template([{"role": "user", "content": t}]) for t in texts]
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
            for key, r in run_llama_cpp(bin_dir, peer_model, args.draft, chats, args.max_tokens, args.draft_len,
                                        args.threads).items():
                if key not in rows or r["tps"] > rows[key]["tps"]:
                    rows[key] = r
    plain = {b: rows[f"nextn plain (batch {b})"] for b in args.batch if f"nextn plain (batch {b})" in rows}
    drafter = f" ← {args.draft.name}" if args.draft is not None else ""
    held = f" (held out by {args.held_out_from})" if args.held_out_from is not None else ""
    print(f"{args.target.name}{drafter}; {args.dataset}{held} × {len(prompts)}, {args.max_tokens} tokens, "
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
        write_report(args.json, "drafters",
                     {"systems": {k: {kk: vv for kk, vv in v.items() if kk != "tokens"} for k, v in rows.items()}})
    del llms
    gc.collect()
    return 0


if __name__ == "__main__":
    sys.exit(main())
