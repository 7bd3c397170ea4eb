"""Load time and step time of the decode step: eager, compiled from scratch, compiled from stored artifacts.

    python -m benchmarks.compile_step --engine ENGINE [--engine ENGINE2 ...] [--batch_sizes 1 8]
        [--processes 3] [--repeats 3] [--max_tokens 64] [--prompt_len 32] [--num_threads 1] [--json OUT]

Each engine should be built with `build-engine --compile_step` (else the "artifacts" mode equals "compiled").
Every measurement runs in a fresh worker process with an empty inductor cache directory
(`TORCHINDUCTOR_CACHE_DIR`), so "compiled" really compiles and "artifacts" gets only what the engine stores.
Modes run round-robin (eager, compiled, artifacts, eager, ...) so that load from other processes on a shared
machine hits them alike; the table gives medians with the [min, max] spread over every run.

Per worker: `load_s` = `LLM(...)` plus loading the artifacts; `ready_s` = load_s plus one greedy request per
batch size (the first decode steps compile); then `--repeats` timed runs per batch size of B requests with
`--max_tokens` tokens each (synchronous scheduler): `step_ms` = median decode iteration latency, `tok_s` =
output tokens / wall time of the run, AL = output tokens / (decode iterations + 1) per request. A "compiled"
worker compiles from scratch in an empty cache, as `build-engine --compile_step` does (its log gives the time).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from nextn.bench.outputs import check_report, write_report

MODES = ("eager", "compiled", "artifacts")


def _prompts(b: int, length: int, vocab: int) -> list[list[int]]:
    return [[(1000 + 37 * i + 11 * j) % vocab for j in range(length)] for i in range(b)]


def worker(engine: str, mode: str, batch_sizes: list[int], repeats: int, max_tokens: int, prompt_len: int,
           num_threads: int) -> dict:
    """One measurement in this process (see the module docstring); returns the figures as a dict."""
    import torch
    from torch._dynamo.utils import counters

    if num_threads > 0:
        torch.set_num_threads(num_threads)  # also the OpenMP threads of inductor's CPU kernels

    from nextn import LLM, SamplingParams

    t0 = time.perf_counter()
    llm = LLM(engine, device="cpu", disable_overlap_scheduler=True, max_batch_size=max(batch_sizes))
    if mode != "eager":
        llm.compile_decode_step(use_artifacts=mode == "artifacts")
    load_s = time.perf_counter() - t0
    vocab = llm.vocab_size
    warm = {}
    for b in batch_sizes:
        t = time.perf_counter()
        llm.generate(_prompts(b, prompt_len, vocab), SamplingParams(max_tokens=8, ignore_eos=True))
        warm[b] = time.perf_counter() - t
    runs: dict[int, list[dict]] = {b: [] for b in batch_sizes}
    digest = hashlib.sha256()
    for _ in range(repeats):
        for b in batch_sizes:
            llm.iteration_log = []
            t = time.perf_counter()
            outs = llm.generate(_prompts(b, prompt_len, vocab), SamplingParams(max_tokens=max_tokens, ignore_eos=True))
            wall = time.perf_counter() - t
            decode = [e["latency_ms"] for e in llm.iteration_log if e["kind"] == "decode"]
            tokens = sum(len(o.outputs[0].token_ids) for o in outs)
            digest.update(json.dumps([o.outputs[0].token_ids for o in outs]).encode())
            runs[b].append({"step_ms": statistics.median(decode), "tok_s": tokens / wall,
                            "al": tokens / (b * (len(decode) + 1))})
    return {"engine": engine, "mode": mode, "load_s": load_s, "ready_s": load_s + sum(warm.values()),
            "warmup_s": warm, "runs": runs, "outputs_sha256": digest.hexdigest()[:16],
            "graphs": counters["stats"]["unique_graphs"],
            "fxgraph_cache_hit": counters["inductor"]["fxgraph_cache_hit"],
            "fxgraph_cache_miss": counters["inductor"]["fxgraph_cache_miss"], "threads": torch.get_num_threads()}


def _spawn(engine: str, mode: str, args: argparse.Namespace) -> dict:
    with tempfile.TemporaryDirectory(prefix="nextn-inductor-") as cache:
        # the worker imports this study as `benchmarks.compile_step`: the repository root on its path, whatever the cwd
        root = str(Path(__file__).resolve().parents[1])
        env = {**os.environ, "TORCHINDUCTOR_CACHE_DIR": cache,
               "PYTHONPATH": os.pathsep.join(p for p in (root, os.environ.get("PYTHONPATH")) if p)}
        cmd = [sys.executable, "-m", "benchmarks.compile_step", "--_worker", json.dumps(
            [engine, mode, args.batch_sizes, args.repeats, args.max_tokens, args.prompt_len, args.num_threads])]
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True)
    if proc.returncode != 0:
        raise RuntimeError(f"worker {mode} on {engine} failed:\n{proc.stderr[-4000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def _fmt(values: list[float], digits: int) -> str:
    return f"{statistics.median(values):.{digits}f} [{min(values):.{digits}f}, {max(values):.{digits}f}]"


def table(results: list[dict], batch_sizes: list[int]) -> str:
    """The results as a fixed-width table: one row per engine and mode."""
    head = f"{'engine':<24} {'mode':<10} {'load s':<22} {'ready s':<22}"
    for b in batch_sizes:
        head += f" {f'step ms b{b}':<22} {f'tok/s b{b}':<22}"
    lines = [head + "  AL / same tokens / graphs", "-" * len(head)]
    engines = list(dict.fromkeys(r["engine"] for r in results))
    for engine in engines:
        eager = [r for r in results if r["engine"] == engine and r["mode"] == "eager"]
        for mode in MODES:
            rs = [r for r in results if r["engine"] == engine and r["mode"] == mode]
            if not rs:
                continue
            line = f"{Path(engine).name[:24]:<24} {mode:<10} {_fmt([r['load_s'] for r in rs], 2):<22} " \
                   f"{_fmt([r['ready_s'] for r in rs], 1):<22}"
            for b in batch_sizes:
                runs = [x for r in rs for x in r["runs"][str(b)]]
                line += f" {_fmt([x['step_ms'] for x in runs], 1):<22} {_fmt([x['tok_s'] for x in runs], 0):<22}"
            al = statistics.median(x["al"] for r in rs for b in batch_sizes for x in r["runs"][str(b)])
            same = all(r["outputs_sha256"] == eager[0]["outputs_sha256"] for r in rs) if eager else "?"
            lines.append(line + f"  {al:.2f} / {'yes' if same is True else same if same == '?' else 'NO'} / "
                         f"{max(r['graphs'] for r in rs)}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.compile_step", description=__doc__.split("\n")[0])
    p.add_argument("--engine", action="append", help="engine directory (repeatable); built with --compile_step")
    p.add_argument("--modes", nargs="+", choices=MODES, default=list(MODES))
    p.add_argument("--batch_sizes", type=int, nargs="+", default=[1, 8])
    p.add_argument("--processes", type=int, default=3, help="worker processes per engine and mode (default 3)")
    p.add_argument("--cold_processes", type=int, default=None,
                   help="worker processes for the 'compiled' mode (compiles from scratch; default --processes)")
    p.add_argument("--repeats", type=int, default=3, help="timed runs per batch size in each worker (default 3)")
    p.add_argument("--max_tokens", type=int, default=64)
    p.add_argument("--prompt_len", type=int, default=32)
    p.add_argument("--num_threads", type=int, default=1,
                   help="torch threads in each worker (default 1: on a busy machine two spinning OpenMP threads "
                   "make tiny steps 10-100x slower; 0 keeps torch's default)")
    p.add_argument("--json", type=Path, help="also write every worker's raw figures here, after each worker "
                   "({\"written_by\": ..., \"results\": [...]}; an existing file only when a run of this benchmark "
                   "wrote it)")
    p.add_argument("--_worker", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args._worker:
        print(json.dumps(worker(*json.loads(args._worker))))
        return 0
    if not args.engine:
        p.error("give at least one --engine")
    check_report(p, args.json, "compile_step")
    results = []
    for engine in args.engine:
        for i in range(args.processes):
            for mode in args.modes:
                if mode == "compiled" and i >= (args.cold_processes or args.processes):
                    continue
                r = _spawn(engine, mode, args)
                results.append(r)
                print(f"[{Path(engine).name} {mode} #{i + 1}] load {r['load_s']:.2f}s ready {r['ready_s']:.1f}s "
                      f"graphs {r['graphs']} fx hit/miss {r['fxgraph_cache_hit']}/{r['fxgraph_cache_miss']}",
                      file=sys.stderr, flush=True)
                if args.json:
                    write_report(args.json, "compile_step", {"results": results})
    print(table(results, args.batch_sizes))
    return 0


if __name__ == "__main__":
    sys.exit(main())
