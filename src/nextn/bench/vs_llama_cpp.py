"""Plain decoding of one GGUF by nextn and by llama.cpp, side by side in one invocation (a benchmark, not a test).

For each nextn weight format asked for (`--formats bf16 W8A16 W4A16`), the GGUF is built once into an engine (LLM's
engine cache) and decoded greedily at batch 1 (and `--batch` for total throughput): the same prompt, `--max_tokens`
new tokens with EOS ignored, best of `--runs` after a warm-up, each format's runs alternating with llama.cpp's so both
see the same machine. Decode tokens/s excludes the prefill on both sides: nextn's is (N − 1) tokens over
t(N) − t(1); llama.cpp's is `llama-bench -p 0 -n N`'s. The step's memory floor is the bytes one decode step reads
(`bench/bandwidth.py`) over the read bandwidth measured in the same run; `floor ratio` = step time ÷ that floor.

    python -m nextn.bench.vs_llama_cpp --model ../shared/data/models/smollm2-135m-instruct/SmolLM2-135M-Instruct.Q4_1.gguf
    python -m nextn.bench.vs_llama_cpp --model runs/models/qwen2.5-coder-1.5b/*.gguf --formats W8A16 W4A16 --batch 8
    python -m nextn.bench.vs_llama_cpp --model M.gguf --formats W4A16 W4A8 --batch 1 8 --variants avx512_bf16 avx2 \
        --llama_cpp_bin native=runs/peers/.../build/bin avx2=runs/peers/.../build-avx2/bin

`--depths 2048 8192` measures batch-1 decode after that much context instead (llama.cpp: `llama-bench -d`, flash
attention off and on, the faster counts). `--variants` measures nextn's CPU kernels of each ISA variant in the same run (NEXTN_CPU_ISA's names), beside each
llama.cpp build; pair a variant with the build of the same ISA level. llama.cpp's batch > 1 is `llama-batched-bench`'s
decode tokens/s over that many sequences of the prompt's length.
"""

from __future__ import annotations

import argparse
import contextlib
import sys
import time
from pathlib import Path

import torch

from nextn.bench import llama_cpp
from nextn.bench.outputs import check_report, write_report
from nextn.bench.bandwidth import decode_step_bytes, read_bandwidth_gbs

PROMPT = "Write a Python function that checks whether a number is prime, and explain how it works."
FORMATS: dict[str, dict | None] = {"bf16": None, "fp32": None, "W8A16": {"quant_algo": "W8A16"},
                                   "W4A16": {"quant_algo": "W4A16"},
                                   "W4A16-lmhead4": {"quant_algo": "W4A16", "lm_head_quant_algo": "W4A16"},
                                   "W4A16-sb256": {"quant_algo": "W4A16", "super_block_size": 256},
                                   "W4A16-one-level": {"quant_algo": "W4A16", "super_block_size": 0},
                                   "W4A8": {"quant_algo": "W4A8"}}


def _nextn_llm(model: Path, fmt: str, cache: Path | None, speculative_config: dict | None = None,
               max_seq_len: int = 1024):
    """The LLM for a format name: `bf16`, `fp32`, `W8A16`, `W4A16`, `W4A16-lmhead4` (the lm_head 4-bit too), each
    optionally `+compile` (the decode step under `torch.compile`, `torch_compile_config: {}`), `+layers` (the
    fused decoder layers called one by one, not as one `llama_decoder_stack` call: the A/B of that op) or `+packed`
    (a dense engine's linears on oneDNN / PyTorch as before nextn's batch-invariant dense kernel: the A/B of
    invariance's cost)."""
    from unittest import mock

    from nextn import LLM

    base, _, extra = fmt.partition("+")
    quant = FORMATS[base]
    dtype = "float32" if base == "fp32" else "bfloat16"
    with mock.patch("nextn.runtime.model_loader.install_dense_linears", lambda model: []) if extra == "packed" \
            else contextlib.nullcontext():
        llm = LLM(model, speculative_config=speculative_config, dtype=dtype, quant_config=quant,
                  engine_cache_dir=cache, max_batch_size=8, max_seq_len=max_seq_len,
                  torch_compile_config={} if extra == "compile" else None)
    if extra == "layers":
        llm.disable_fused_decoder_stack()
    return llm


def verify_step_seconds(llm, prompt_ids: list[int], num_tokens: int) -> float:
    """Seconds per decode step of a speculative LLM (every step verifies K + 1 rows): (t(N) − t(1)) over the decode
    steps the N-token run took, read from the engine's iteration log."""
    from nextn import SamplingParams

    def run(n: int) -> tuple[float, int]:
        llm.iteration_log = []
        t0 = time.perf_counter()
        llm.generate([prompt_ids], SamplingParams(max_tokens=n, ignore_eos=True))
        dt = time.perf_counter() - t0
        return dt, sum(e["kind"] == "decode" for e in llm.iteration_log)

    (t1, s1), (tn, sn) = run(1), run(num_tokens)
    return max(tn - t1, 1e-9) / max(sn - s1, 1)


def nextn_decode_tps(llm, prompt_ids: list[int], num_tokens: int, batch: int) -> tuple[float, float]:
    """(decode tokens/s in total over the batch, seconds per decode step) excluding the prefill."""
    from nextn import SamplingParams

    def run(n: int) -> float:
        t0 = time.perf_counter()
        llm.generate([prompt_ids] * batch, SamplingParams(max_tokens=n, ignore_eos=True))
        return time.perf_counter() - t0

    t1, tn = run(1), run(num_tokens)
    step = max(tn - t1, 1e-9) / (num_tokens - 1)
    return batch / step, step


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m nextn.bench.vs_llama_cpp", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", required=True, type=Path, help="the GGUF both decode")
    p.add_argument("--formats", nargs="+", default=["bf16", "W8A16", "W4A16"],
                   choices=[*FORMATS, *(f"{f}+{x}" for f in FORMATS for x in ("compile", "layers", "packed"))],
                   help="nextn weight formats to measure, `+compile` for the step under torch.compile, `+layers` "
                   "for the fused layers called one by one, `+packed` for a dense format's linears on oneDNN / "
                   "PyTorch instead of nextn's batch-invariant kernel (default: bf16 W8A16 W4A16)")
    p.add_argument("--verify_k", type=int, default=0, metavar="K",
                   help="also time a verify step of K + 1 rows (n-gram drafting, K drafts) per format, beside "
                   "its plain step (issue 14: verify ≤ 1.3× plain)")
    p.add_argument("--max_tokens", type=int, default=256, help="new tokens per run (default 256)")
    p.add_argument("--runs", type=int, default=3, help="timed runs per system after a warm-up; best is kept")
    p.add_argument("--batch", type=int, nargs="*", default=[1], help="nextn batch sizes (default 1; e.g. 1 8)")
    p.add_argument("--threads", type=int, default=2, help="threads for both (default 2: this machine's cores)")
    p.add_argument("--llama_cpp_bin", nargs="*", default=[], metavar="[LABEL=]DIR",
                   help="llama.cpp build/bin folders, each labelled (e.g. native=.../build/bin avx2=.../build-avx2/bin; "
                   "default: $LLAMA_CPP_BIN_DIR or runs/peers/...); batch > 1 needs their llama-batched-bench")
    p.add_argument("--variants", nargs="+", metavar="ISA",
                   help="nextn CPU kernel variants to measure in this run (e.g. avx512_bf16 avx512 avx2; default: the "
                   "one in use, `python -m nextn.plugins.cpu_kernels`)")
    p.add_argument("--depths", type=int, nargs="+", metavar="D",
                   help="instead: batch-1 decode after D tokens of context (nextn: a D-token prompt, the decode "
                   "timed past its prefill; llama.cpp: `llama-bench -d D`, flash attention off and on, the faster)")
    p.add_argument("--flash_attn", type=int, nargs="+", default=[0, 1], choices=[0, 1],
                   help="with --depths: llama.cpp's flash attention settings to run, the fastest counts (default 0 1)")
    p.add_argument("--engine_cache_dir", type=Path, default=Path("runs/engines"))
    p.add_argument("--json", type=Path,
                   help="also write the figures here (an existing file only when a run of this benchmark wrote it)")
    args = p.parse_args(argv)
    check_report(p, args.json, "vs_llama_cpp")
    if args.depths:
        return _long_context(args)

    from nextn.plugins import cpu_kernels

    torch.set_num_threads(args.threads)
    variants = args.variants or [cpu_kernels.variant()]
    bins = _peer_bins(args.llama_cpp_bin)
    if not bins:
        print("llama.cpp: skipped (no build found; ../shared/PEERS.md says how to build it, or set "
              "--llama_cpp_bin / LLAMA_CPP_BIN_DIR)", file=sys.stderr)
    bandwidth = read_bandwidth_gbs()
    llms = {fmt: _nextn_llm(args.model, fmt, args.engine_cache_dir) for fmt in args.formats}
    prompt_ids = next(iter(llms.values())).tokenizer.encode(PROMPT)
    rows: dict[str, dict] = {}
    for v in variants:
        for fmt, llm in llms.items():  # warm-up
            with _variant(v):
                nextn_decode_tps(llm, prompt_ids, 8, 1)
            step_bytes, _ = decode_step_bytes(llm.engine_dir)
            rows[f"{v} {fmt}"] = {"variant": v, "format": fmt, "tps": {b: 0.0 for b in args.batch},
                                  "step_s": float("inf"), "step_bytes": step_bytes, "verify_s": float("inf")}
    spec = {"decoding_type": "NGram", "max_draft_len": args.verify_k, "max_matching_ngram_size": 2}
    verifiers = {fmt: _nextn_llm(args.model, fmt, args.engine_cache_dir, spec) for fmt in args.formats} \
        if args.verify_k else {}
    peers: dict[str, dict[int, float]] = {label: {b: 0.0 for b in args.batch} for label in bins}
    for _ in range(max(1, args.runs)):
        for v in variants:
            with _variant(v):
                for fmt, llm in llms.items():
                    r = rows[f"{v} {fmt}"]
                    for b in args.batch:
                        tps, step = nextn_decode_tps(llm, prompt_ids, args.max_tokens, b)
                        r["tps"][b] = max(r["tps"][b], tps)
                        if b == 1:
                            r["step_s"] = min(r["step_s"], step)
                    if fmt in verifiers:
                        r["verify_s"] = min(r["verify_s"],
                                            verify_step_seconds(verifiers[fmt], prompt_ids, args.max_tokens))
        for label, bin_dir in bins.items():
            for b in args.batch:
                got = (llama_cpp.bench_decode(bin_dir, args.model, args.max_tokens, args.threads, 1) if b == 1 else
                       llama_cpp.bench_batched_decode(bin_dir, args.model, args.max_tokens, b, args.threads,
                                                      len(prompt_ids)))
                peers[label][b] = max(peers[label][b], got.tokens_per_s)

    print(f"model: {args.model.name}; {args.max_tokens} new tokens, greedy, {args.threads} threads; "
          f"read bandwidth {bandwidth:.1f} GB/s (measured now); CPU: {_cpu_name()}")
    head = f"{'system':34}" + "".join(f"{f'batch {b} tok/s':>16}" for b in args.batch)
    verify = f"{f'verify K={args.verify_k} ms':>17}{'/ plain':>9}" if args.verify_k else ""
    vs = "".join(f"{f'b{b} vs {label}':>16}" for label in bins for b in args.batch)
    print(head + f"{'step ms':>10}{'MB/step':>10}{'floor ratio':>13}" + vs + verify)
    for name, r in rows.items():
        floor_s = r["step_bytes"] / (bandwidth * 1e9)
        ratios = "".join(f"{r['tps'][b] / peers[label][b]:>15.2f}x" if peers[label][b] else f"{'':>16}"
                         for label in bins for b in args.batch)
        print(f"{'nextn ' + name:34}" + "".join(f"{r['tps'][b]:>16.1f}" for b in args.batch)
              + f"{r['step_s'] * 1e3:>10.2f}{r['step_bytes'] / 1e6:>10.1f}{r['step_s'] / floor_s:>13.2f}" + ratios
              + (f"{r['verify_s'] * 1e3:>17.2f}{r['verify_s'] / r['step_s']:>9.2f}" if args.verify_k else ""))
    for label in bins:
        print(f"{'llama.cpp ' + label:34}" + "".join(f"{peers[label][b]:>16.1f}" for b in args.batch))
    if args.json:
        write_report(args.json, "vs_llama_cpp", {"model": str(args.model), "bandwidth_gbs": bandwidth,
                                                 "cpu": _cpu_name(), "llama_cpp_tps": peers, "nextn": rows},
                     indent=2)
    return 0


def _long_context(args: argparse.Namespace) -> int:
    """`--depths`: batch-1 decode tokens/s after each depth of context, per format and variant, beside llama.cpp."""
    from nextn.plugins import cpu_kernels

    torch.set_num_threads(args.threads)
    variants = args.variants or [cpu_kernels.variant()]
    bins = _peer_bins(args.llama_cpp_bin)
    from nextn import SamplingParams

    longest = max(args.depths) + args.max_tokens + 64
    llms = {fmt: _nextn_llm(args.model, fmt, args.engine_cache_dir, max_seq_len=longest) for fmt in args.formats}
    ids = next(iter(llms.values())).tokenizer.encode(PROMPT)
    rows: dict[str, dict[int, float]] = {f"{v} {fmt}": {d: 0.0 for d in args.depths} for v in variants
                                         for fmt in args.formats}
    peers = {f"{label} fa={fa}": {d: 0.0 for d in args.depths} for label in bins for fa in args.flash_attn}
    for d in args.depths:  # the prompt prefilled once: every timed run below hits the prefix cache alike
        for llm in llms.values():
            llm.generate([(ids * (d // len(ids) + 1))[:d]], SamplingParams(max_tokens=1, ignore_eos=True))
    for _ in range(max(1, args.runs)):
        for d in args.depths:
            prompt = (ids * (d // len(ids) + 1))[:d]
            for v in variants:
                with _variant(v):
                    for fmt, llm in llms.items():  # the prefix cache holds the prompt after the first call
                        tps, _ = nextn_decode_tps(llm, prompt, args.max_tokens, 1)
                        rows[f"{v} {fmt}"][d] = max(rows[f"{v} {fmt}"][d], tps)
            for label, bin_dir in bins.items():
                for fa in args.flash_attn:
                    got = llama_cpp.bench_decode(bin_dir, args.model, args.max_tokens, args.threads, 1, depth=d,
                                                 flash_attn=bool(fa), timeout_s=3600)
                    peers[f"{label} fa={fa}"][d] = max(peers[f"{label} fa={fa}"][d], got.tokens_per_s)
    print(f"model: {args.model.name}; batch 1, {args.max_tokens} new tokens after D tokens of context, greedy, "
          f"{args.threads} threads; CPU: {_cpu_name()}")
    print(f"{'system':34}" + "".join(f"{f'D={d} tok/s':>14}" for d in args.depths)
          + "".join(f"{f'D={d} vs {label}':>20}" for label in bins for d in args.depths))
    best = {label: {d: max(peers[f"{label} fa={fa}"][d] for fa in args.flash_attn) for d in args.depths}
            for label in bins}
    for name, r in rows.items():
        ratios = "".join(f"{r[d] / best[label][d]:>19.2f}x" if best[label][d] else f"{'':>20}"
                         for label in bins for d in args.depths)
        print(f"{'nextn ' + name:34}" + "".join(f"{r[d]:>14.1f}" for d in args.depths) + ratios)
    for name, r in peers.items():
        print(f"{'llama.cpp ' + name:34}" + "".join(f"{r[d]:>14.1f}" for d in args.depths))
    if args.json:
        write_report(args.json, "vs_llama_cpp", {"model": str(args.model), "cpu": _cpu_name(), "depths": args.depths,
                                                 "llama_cpp_tps": peers, "nextn": rows}, indent=2)
    return 0


def _peer_bins(entries: list[str]) -> dict[str, Path]:
    """{label: llama.cpp bin dir} from `LABEL=DIR` / `DIR` entries (none given: the default build, if any)."""
    if not entries:
        found = llama_cpp.find_bin_dir(None)
        return {"llama.cpp": found} if found is not None else {}
    bins = {}
    for i, entry in enumerate(entries):
        label, _, path = entry.rpartition("=")
        found = llama_cpp.find_bin_dir(path)
        if found is None:
            raise SystemExit(f"vs_llama_cpp: error: no llama-bench in {path}")
        bins[label or f"build{i}"] = found
    return bins


@contextlib.contextmanager
def _variant(name: str | None):
    """nextn's CPU kernels of variant `name` for the block (None: as they are)."""
    from nextn.plugins import cpu_kernels

    with cpu_kernels.use(name) if name else contextlib.nullcontext():
        yield


def _cpu_name() -> str:
    """The CPU's model name and the kernel variants it runs (a VM's model name can hide its generation)."""
    from nextn.plugins import cpu_kernels

    name = "unknown CPU"
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                name = line.partition(":")[2].strip()
                break
    except OSError:
        pass
    return f"{name}, runs {', '.join(cpu_kernels.runnable())}"


if __name__ == "__main__":
    raise SystemExit(main())
