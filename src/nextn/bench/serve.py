"""A serving benchmark in the shape of `vllm bench serve`: nextn serve's configs and llama.cpp's llama-server on the
same GGUF, threads and prompts, each started, measured at every concurrency level and stopped in one invocation.

    python -m nextn.bench.serve --model M.gguf --nextn_configs none configs/ngram.yaml --llama_cpp plain ngram-mod \\
        --concurrency 1 2 4 8 16 --dataset mt_bench --max_tokens 128 --output_dir runs/serve_bench

Each server config in turn: start it on a free loopback port (only one server runs at a time), wait for /health,
send one warm-up request (a fixed prompt, none of the dataset's), then for each `--concurrency` level `--runs`
passes of `--num_requests` streamed greedy (or, with `--temperature`, sampled) requests (EOS ignored; Poisson
arrivals with `--request_rate`), keep the fastest pass by output tokens/s, read AL from the server's /metrics
counters, and stop the server (SIGTERM, then SIGKILL). `--restart_per_pass` starts a fresh server (and warm-up) for every pass of every level instead, so a
drafter that learns from what it served (suffix trees, acceptance statistics) is equally cold in each pass and the
fastest of `--runs` passes is a fair best. `--url` measures servers already running instead (nothing started or
stopped). The client runs in this process: on a small machine it takes CPU from the server, the same for every config.

Workloads (bench/serve_workload.py): `--dataset spec_bench:CATEGORY` (or spec_bench_summarization, spec_bench_rag)
sends one Spec-Bench task; `--turns 2` sends MT-bench's two turns as a conversation, turn 2 carrying turn 1's
answer, and reports each turn as its own row; `--repeat N` sends the same requests N times in a row and reports
every pass as its own row (pass 1 sees the prompts first, unless an earlier level sent them: a drafter that learns
from past outputs, as suffix decoding's global tree does, is cold in pass 1 of the first level only).

`--output_dir` (new, empty, or written by an earlier run of this benchmark) receives serve.md (the table),
serve.json (every number, every pass), serve.png (tokens/s and TPOT p50 against concurrency) and logs/ (each
server's output). Greedy outputs of each speculative nextn config are compared with nextn plain's, prompt by
prompt (llama.cpp's are not: other numerics); a mismatch is reported and makes the exit status 1, as does a
failed request or server. Metric definitions: bench/serve_client.py; counters: bench/serve_servers.py.
"""

from __future__ import annotations

import argparse
import asyncio
import math
import os
import shlex
import sys
import time
from pathlib import Path

from nextn.bench import llama_cpp
from nextn.bench.dataset import DatasetError
from nextn.bench.outputs import write_report
from nextn.bench.passes import load_average
from nextn.bench.serve_client import (DEFAULT_REQUEST_TIMEOUT_S, Sampling, level_metrics, open_client, run_level,
                                      send_request,
                                      served_model)
from nextn.bench.serve_report import (ConfigResult, LevelResult, lossless_mismatches, lossless_text, markdown_table,
                                      plot, row_label)
from nextn.bench.serve_servers import (LLAMA_CPP_MODES, ServerError, ServerSpec, SpecCounters, llama_cpp_spec,
                                       nextn_spec, running, spec_counters)
from nextn.bench.serve_workload import (MAX_REPEAT, MAX_TURNS, Phase, Workload, dataset_names, level_phases,
                                        load_workload)
from nextn.build.output_files import OutputPathError, claim_output_dir, write_output_file

PROG = "python -m nextn.bench.serve"
MODULE = "serve"
DEFAULT_PROMPTS_DIR = Path("../shared/data/prompts")
MAX_CONCURRENCY = 256
MAX_PROMPTS = 1024
MAX_REQUESTS = 4096  # per level and pass
MAX_TOKENS = 8192
MAX_RUNS = 20
MAX_CONFIGS = 16
MD_MARK = "<!-- written by nextn bench.serve -->"
#: The warm-up request's prompt: none of a dataset's, so no measured prompt's answer is in a drafter's history.
WARMUP_PROMPT = "Say hello."


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog=PROG, description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", type=Path, help="the GGUF every started server serves (not needed with --url alone)")
    p.add_argument("--nextn_model", type=Path,
                   help="what nextn serve loads instead of --model: an engine directory built from the same GGUF "
                        "(e.g. W4A8 by `nextn build-engine --quant_algo W4A8`) or a checkpoint (default: --model)")
    p.add_argument("--nextn_configs", nargs="*", default=["none"], metavar="YAML",
                   help="nextn serve configs: `none` (plain) or an --extra_llm_api_options YAML each, e.g. none "
                        "configs/ngram.yaml configs/draft_target.yaml (default: none; no value: no nextn server)")
    p.add_argument("--llama_cpp", nargs="*", default=["plain"], choices=LLAMA_CPP_MODES, metavar="MODE",
                   help=f"llama-server modes: {', '.join(LLAMA_CPP_MODES)} (default: plain; no value: none)")
    p.add_argument("--draft_model", type=Path, help="the draft GGUF of llama.cpp's `draft` mode (-md)")
    p.add_argument("--spec_draft_n_max", type=int, default=3, help="llama.cpp draft tokens per step (default 3)")
    p.add_argument("--llama_cpp_bin", help="llama.cpp build/bin (default: $LLAMA_CPP_BIN_DIR or runs/peers/...)")
    p.add_argument("--llama_cpp_args", default="", help="extra llama-server arguments, one string (e.g. "
                                                        "'--spec-ngram-mod-n-min 8')")
    p.add_argument("--ctx_per_slot", type=int, default=2048,
                   help="llama-server context per slot, tokens (-c = slots × this; default 2048)")
    p.add_argument("--url", nargs="*", default=[], metavar="URL",
                   help="OpenAI-compatible servers already running (e.g. http://127.0.0.1:8000), measured as is")
    p.add_argument("--dataset", default="mt_bench",
                   help=f"prompts: {', '.join(dataset_names())} (in --prompts_dir; CATEGORY one of the set's, e.g. "
                        "spec_bench:translation) or a prompt file (default mt_bench)")
    p.add_argument("--turns", type=int, default=1,
                   help=f"user turns of each row sent as one conversation, turn k carrying the answers to turns "
                        f"1..k-1, each turn reported as its own row (1..{MAX_TURNS}; chat endpoint; default 1: the "
                        f"first turn alone; 2 with mt_bench)")
    p.add_argument("--repeat", type=int, default=1,
                   help=f"passes over the same requests in each level, each reported as its own row: pass 1 cold "
                        f"(at the first level), the later ones warm (1..{MAX_REPEAT}, default 1; takes --runs 1)")
    p.add_argument("--prompts_dir", type=Path, default=DEFAULT_PROMPTS_DIR,
                   help=f"where the named datasets are (default {DEFAULT_PROMPTS_DIR})")
    p.add_argument("--num_prompts", type=int, default=8, help=f"first N prompts (1..{MAX_PROMPTS}, default 8)")
    p.add_argument("--num_requests", type=int, default=0,
                   help=f"requests per level, pass and turn, prompts reused in turn (0 = max(num_prompts, 2 × "
                        f"concurrency); at most {MAX_REQUESTS})")
    p.add_argument("--concurrency", type=int, nargs="+", default=[1, 2, 4, 8, 16],
                   help=f"levels of requests in flight, each measured (1..{MAX_CONCURRENCY}; default 1 2 4 8 16)")
    p.add_argument("--request_rate", type=float, default=math.inf,
                   help="requests/s arriving as a Poisson process (default inf: all at once, so each level is "
                        "`concurrency` clients back to back)")
    p.add_argument("--max_tokens", type=int, default=128, help=f"tokens per request (1..{MAX_TOKENS}, default 128)")
    p.add_argument("--endpoint", choices=["chat", "completions"], default="chat",
                   help="/v1/chat/completions (the prompt as one user message, after the conversation so far with "
                        "--turns; default) or /v1/completions")
    p.add_argument("--runs", type=int, help=f"passes per level, fastest kept (1..{MAX_RUNS}; default 3, or 1 with "
                                            "--repeat)")
    p.add_argument("--restart_per_pass", action="store_true",
                   help="start each server afresh for every pass of every level, so each pass is cold (no suffix "
                        "tree, learned acceptance or prefix cache from earlier passes): --runs then keeps the "
                        "fastest of equal passes for drafters that learn (not with --url)")
    p.add_argument("-t", "--threads", type=int, default=_cores(),
                   help="threads of every started server (default: the cores this process may use)")
    p.add_argument("--startup_timeout", type=float, default=900.0,
                   help="seconds a server may take to become healthy (a first nextn start builds the engine; "
                        "default 900)")
    p.add_argument("--request_timeout", type=float, default=DEFAULT_REQUEST_TIMEOUT_S,
                   help=f"seconds one request may take before it counts as failed (default "
                        f"{DEFAULT_REQUEST_TIMEOUT_S:g})")
    p.add_argument("--seed", type=int, default=0, help="seed of the Poisson arrivals and of the sampled requests "
                   "(each request's: this + its prompt's index; default 0)")
    p.add_argument("--temperature", type=float, default=0.0,
                   help="0 = greedy (default); above 0 every request samples, with --top_p / --top_k. nextn's outputs "
                   "with a speculative config are still compared with its plain outputs: with a seed per request "
                   "they are equal where the drafts are deterministic (MTP, NGram, Suffix)")
    p.add_argument("--top_p", type=float, default=1.0, help="nucleus sampling's mass, (0, 1] (default 1: off)")
    p.add_argument("--top_k", type=int, default=0, help="sample among the k most likely tokens (default 0: off)")
    p.add_argument("--output_dir", type=Path, required=True,
                   help="serve.md, serve.json, serve.png and logs/ (new, empty, or this benchmark's earlier output)")
    return p


def _cores() -> int:
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except (AttributeError, OSError):
        return max(1, os.cpu_count() or 1)


def check_args(p: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """Every count bounded and every input present before any server starts; a refusal is `p.error` (exit 2).
    Sets `args.runs` when it was not given."""
    if args.runs is None:
        args.runs = 1 if args.repeat > 1 else 3
    bounds = [("--num_prompts", args.num_prompts, 1, MAX_PROMPTS), ("--num_requests", args.num_requests, 0,
              MAX_REQUESTS), ("--max_tokens", args.max_tokens, 1, MAX_TOKENS), ("--runs", args.runs, 1, MAX_RUNS),
              ("--turns", args.turns, 1, MAX_TURNS), ("--repeat", args.repeat, 1, MAX_REPEAT),
              ("--spec_draft_n_max", args.spec_draft_n_max, 1, 64), ("--ctx_per_slot", args.ctx_per_slot, 16, 1 << 20),
              ("--threads", args.threads, 1, _cores())]
    bounds += [("--concurrency", c, 1, MAX_CONCURRENCY) for c in args.concurrency]
    bounds += [("--temperature", args.temperature, 0.0, 100.0), ("--top_k", args.top_k, 0, 1 << 20)]
    if not 0.0 < args.top_p <= 1.0:
        p.error(f"--top_p must be in (0, 1], got {args.top_p}")
    for flag, value, low, high in bounds:
        if not low <= value <= high:
            p.error(f"{flag} must be in {low}..{high}, got {value}")
    if args.repeat > 1 and args.runs > 1:
        p.error(f"--repeat reports every pass, --runs keeps the fastest: give --runs 1 with --repeat (got --runs "
                f"{args.runs})")
    if args.restart_per_pass and args.url:
        p.error("--restart_per_pass starts the servers it measures: it cannot restart --url servers")
    if args.turns > 1 and args.endpoint != "chat":
        p.error("--turns > 1 sends conversations: it needs --endpoint chat")
    if len(set(args.concurrency)) != len(args.concurrency):
        p.error(f"--concurrency repeats a level: {args.concurrency}")
    if not args.request_rate > 0:  # also refuses NaN
        p.error(f"--request_rate must be > 0 requests/s (inf: all at once), got {args.request_rate}")
    for flag, value in (("--startup_timeout", args.startup_timeout), ("--request_timeout", args.request_timeout)):
        if not 0 < value < math.inf:
            p.error(f"{flag} must be a positive number of seconds, got {value}")
    num_configs = len(args.nextn_configs) + len(args.llama_cpp) + len(args.url)
    if num_configs == 0:
        p.error("nothing to measure: give --nextn_configs, --llama_cpp or --url")
    if num_configs > MAX_CONFIGS:
        p.error(f"at most {MAX_CONFIGS} server configs, got {num_configs}")
    if len(set(args.nextn_configs)) != len(args.nextn_configs) or len(set(args.llama_cpp)) != len(args.llama_cpp):
        p.error("a server config is given twice")
    if args.nextn_configs or args.llama_cpp:
        if args.model is None:
            p.error("--model GGUF is needed to start servers (or measure running ones with --url alone)")
        if not args.model.is_file():
            p.error(f"--model {args.model} is not a file")
    if args.nextn_model is not None and not args.nextn_model.exists():
        p.error(f"--nextn_model {args.nextn_model} does not exist")
    for config in args.nextn_configs:
        if config != "none" and not Path(config).is_file():
            p.error(f"--nextn_configs {config} is not a file (give `none` for plain decoding)")
    if "draft" in args.llama_cpp and (args.draft_model is None or not args.draft_model.is_file()):
        p.error("llama.cpp mode `draft` needs --draft_model, an existing GGUF")
    for url in args.url:
        if not url.startswith(("http://", "https://")):
            p.error(f"--url {url} is not an http(s) URL")
    try:
        shlex.split(args.llama_cpp_args)
    except ValueError as e:
        p.error(f"--llama_cpp_args cannot be split into arguments: {e}")
    try:
        claim_output_dir(args.output_dir, f"bench.{MODULE}", _inputs(args), check_only=True)
    except OutputPathError as e:
        p.error(str(e))


def _load(x: float | None) -> str:
    return "unknown" if x is None else f"{x:.2f}"


def _inputs(args) -> list[Path]:
    configs = [Path(c) for c in args.nextn_configs if c != "none"]
    return [x for x in (args.model, args.nextn_model, args.draft_model, *configs) if x is not None]


def server_specs(args, bin_dir: Path | None) -> list[ServerSpec]:
    """The servers to start, in order: nextn's configs, then llama.cpp's modes (none when its build is absent)."""
    most = max(args.concurrency)
    nextn_model = args.nextn_model or args.model
    specs = [nextn_spec(nextn_model, args.threads, None if c == "none" else c, most) for c in args.nextn_configs]
    if args.llama_cpp and bin_dir is not None:
        specs += [llama_cpp_spec(bin_dir / "llama-server", args.model, args.threads, mode, most,
                                 args.ctx_per_slot, args.draft_model, args.spec_draft_n_max,
                                 tuple(shlex.split(args.llama_cpp_args))) for mode in args.llama_cpp]
    return specs


def _histories(workload: Workload, turn: int, num_requests: int,
               answers: dict[int, list[str | None]]) -> list[list[dict[str, str]] | None] | None:
    """Request i's conversation before its turn-`turn` prompt: [user 1, answer 1, ...]; None where an answer failed."""
    if turn == 1:
        return None
    out = []
    for i in range(num_requests):
        turns = workload.conversations[i % len(workload.conversations)]
        said = [answers[k][i] for k in range(1, turn)]
        out.append(None if None in said else [m for k, a in enumerate(said) for m in (
            {"role": "user", "content": turns[k]}, {"role": "assistant", "content": a})])
    return out


def _add(a: SpecCounters | None, b: SpecCounters | None) -> SpecCounters | None:
    if a is None or b is None:
        return b if a is None else a
    return SpecCounters(a.drafts + b.drafts, a.draft_tokens + b.draft_tokens, a.accepted_tokens + b.accepted_tokens)


class _LevelPasses:
    """One concurrency level's passes so far, per phase: each pass's metrics, the speculative counters summed over
    passes, and each prompt's first text."""

    def __init__(self, c: int, phases: list[Phase]):
        self.c, self.phases = c, phases
        self.passes: dict[Phase, list] = {ph: [] for ph in phases}
        self.texts: dict[Phase, dict[int, str]] = {ph: {} for ph in phases}
        self.counters: dict[Phase, SpecCounters | None] = dict.fromkeys(phases)

    def results(self) -> list[LevelResult]:
        """Each phase's LevelResult: its fastest pass, every pass's tokens/s, the summed AL counters."""
        levels = []
        for ph in self.phases:
            best, delta = max(self.passes[ph], key=lambda m: m.output_tok_s), self.counters[ph]
            levels.append(LevelResult(self.c, best, [m.output_tok_s for m in self.passes[ph]],
                                      sum(m.num_failed for m in self.passes[ph]),
                                      delta.acceptance_length if delta else None,
                                      delta.draft_acceptance_rate if delta else None, self.texts[ph], ph.label,
                                      ph.turn, ph.repetition))
        return levels


def _sampling(args) -> Sampling:
    return Sampling(args.temperature, args.top_p, args.top_k, args.seed)


async def measure_pass(client, model: str, url: str, args, workload: Workload, level: _LevelPasses) -> None:
    """One pass of every phase of `level` in order (turn k after turn k-1's answers), added to `level`."""
    num_requests = args.num_requests or min(MAX_REQUESTS, max(len(workload.conversations), 2 * level.c))
    answers: dict[int, list[str | None]] = {}  # turn → each request's answer in this pass
    for ph in level.phases:
        before = await asyncio.to_thread(spec_counters, url)
        results, wall = await run_level(client, model, workload.prompts(ph.turn), num_requests, level.c,
                                        args.max_tokens, args.request_rate, args.endpoint == "chat", args.seed,
                                        _histories(workload, ph.turn, num_requests, answers), _sampling(args))
        after = await asyncio.to_thread(spec_counters, url)
        if after is not None and before is not None:
            level.counters[ph] = _add(level.counters[ph], after - before)
        answers[ph.turn] = [r.text if r.ok else None for r in results]
        level.passes[ph].append(level_metrics(results, wall))
        for r in results:
            if r.ok:
                level.texts[ph].setdefault(r.prompt_index, r.text)


def _report(result: ConfigResult, levels: list[LevelResult]) -> None:
    for level in levels:
        result.levels.append(level)
        best = level.best
        al = f", AL {level.acceptance_length:.2f}" if level.acceptance_length else ""
        print(f"{row_label(result.label, level.phase)} c={level.concurrency}: {best.output_tok_s:.1f} tok/s (passes "
              f"{' / '.join(f'{t:.1f}' for t in level.passes_tok_s)}), TTFT p50 {best.ttft_ms_p50:.0f} ms, "
              f"TPOT p50 {best.tpot_ms_p50:.1f} ms{al}, {level.failed_requests} failed", file=sys.stderr, flush=True)


async def measure(url: str, args, workload: Workload, levels: list[_LevelPasses], runs: int,
                  result: ConfigResult | None = None) -> None:
    """Warm up the server at `url`, then `runs` passes of each level in turn, added to `levels`; with `result`, each
    level's rows are reported into it as it completes."""
    client = open_client(f"{url.rstrip('/')}/v1", args.request_timeout)
    try:
        model = await served_model(client)
        warm = await send_request(client, model, WARMUP_PROMPT, 0, min(args.max_tokens, 16), args.endpoint == "chat")
        if not warm.ok:
            raise ServerError(f"the warm-up request failed: {warm.error}")
        for level in levels:
            for _ in range(runs):
                await measure_pass(client, model, url, args, workload, level)
            if result is not None:
                _report(result, level.results())
    finally:
        await client.close()


def run_config(spec: ServerSpec | None, url: str | None, args, workload: Workload, logs: Path) -> ConfigResult:
    """Start `spec` (or use the running `url`), measure it, stop it; a failure is recorded in the result. With
    `--restart_per_pass` each pass of each level has a server of its own, started cold."""
    if spec is not None:
        result = ConfigResult(spec.label, spec.family, spec.speculative, list(spec.argv))
    else:
        result = ConfigResult(f"url {url}", "url", False, [])
    print(f"{PROG}: {result.label}", file=sys.stderr, flush=True)
    phases = level_phases(workload.turns, args.repeat)
    try:
        if spec is None:
            asyncio.run(measure(url, args, workload, [_LevelPasses(c, phases) for c in args.concurrency], args.runs,
                                result))
        elif not args.restart_per_pass:
            log = logs / f"{_slug(spec.label)}.log"
            with running(spec, log, args.startup_timeout) as server_url:
                asyncio.run(measure(server_url, args, workload,
                                    [_LevelPasses(c, phases) for c in args.concurrency], args.runs, result))
        else:
            for c in args.concurrency:
                level = _LevelPasses(c, phases)
                for i in range(args.runs):
                    log = logs / f"{_slug(spec.label)}.c{c}.pass{i + 1}.log"
                    with running(spec, log, args.startup_timeout) as server_url:
                        asyncio.run(measure(server_url, args, workload, [level], 1))
                _report(result, level.results())
    except (ServerError, RuntimeError, OSError) as e:
        result.error = str(e)
        print(f"{PROG}: error: {result.label}: {e}", file=sys.stderr, flush=True)
    return result


def _slug(label: str) -> str:
    return label.replace(" ", "_").replace("/", "_")


def main(argv: list[str] | None = None) -> int:
    p = build_parser()
    args = p.parse_args(argv)
    check_args(p, args)
    try:
        workload = load_workload(args.dataset, args.prompts_dir, args.num_prompts, args.turns)
    except DatasetError as e:
        p.error(str(e))
    bin_dir = None
    if args.llama_cpp:
        bin_dir = llama_cpp.find_bin_dir(args.llama_cpp_bin, tool="llama-server")
        if bin_dir is None or not (bin_dir / "llama-server").is_file():
            print(f"{PROG}: llama.cpp skipped: no llama-server found (../shared/PEERS.md says how to build it; or "
                  "set --llama_cpp_bin / LLAMA_CPP_BIN_DIR)", file=sys.stderr)
            bin_dir = None
    out = claim_output_dir(args.output_dir, f"bench.{MODULE}", _inputs(args))
    logs = out / "logs"
    logs.mkdir(exist_ok=True)
    load_before, started = load_average(), time.time()
    results = [run_config(spec, None, args, workload, logs) for spec in server_specs(args, bin_dir)]
    results += [run_config(None, url, args, workload, logs) for url in args.url]
    load_after = load_average()
    mismatches, compared = lossless_mismatches(results)
    shape = (f", {args.turns} turns" if args.turns > 1 else "") + (f", {args.repeat} passes" if args.repeat > 1 else "")
    title = (f"{args.model.name if args.model else 'running servers'}: {args.dataset} ({len(workload.conversations)} "
             f"prompts, {workload.format}{shape}), {args.max_tokens} tokens, {_sampling(args).describe()}, "
             f"{args.threads} threads, "
             f"{args.endpoint}")
    table = markdown_table(results, args.concurrency)
    lossless = lossless_text(mismatches, compared)
    load = f"load average {_load(load_before)} before, {_load(load_after)} after, on {os.cpu_count()} cores"
    cold = ", each on a freshly started server" if args.restart_per_pass else ""
    text = (f"{MD_MARK}\n# Serving benchmark\n\n{title}; best of {args.runs} passes{cold}; {load}.\n\n{table}\n"
            f"{lossless}")
    write_output_file(out / "serve.md", text, "--output_dir", lambda head: head.startswith(MD_MARK.encode()))
    write_report(out / "serve.json", MODULE, {
        "title": title, "argv": sys.argv if argv is None else argv, "dataset": args.dataset, "format": workload.format,
        "category": workload.category, "turns": args.turns, "repeat": args.repeat,
        "num_prompts": len(workload.conversations), "max_tokens": args.max_tokens, "threads": args.threads,
        "endpoint": args.endpoint, "sampling": _sampling(args).describe(), "request_rate": args.request_rate if math.isfinite(args.request_rate) else "inf",
        "runs": args.runs, "restart_per_pass": args.restart_per_pass, "concurrency": args.concurrency, "started_unix_s": started, "load_before": load_before,
        "load_after": load_after, "cpu_count": os.cpu_count(), "configs": [r.to_dict() for r in results],
        "lossless": {"compared": compared, "mismatches": [m.to_dict() for m in mismatches]}}, flag="--output_dir")
    if any(r.levels for r in results):
        plot(results, out / "serve.png", title)
    print(table + "\n" + lossless + f"{PROG}: wrote {out}/serve.md, serve.json, serve.png", flush=True)
    failed = any(r.error or any(lv.failed_requests for lv in r.levels) for r in results)
    return 1 if failed or mismatches else 0


if __name__ == "__main__":
    raise SystemExit(main())
