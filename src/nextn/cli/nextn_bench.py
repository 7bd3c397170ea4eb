"""`nextn-bench`: the commands of TensorRT-LLM's `trtllm-bench` (prepare-dataset, throughput, latency) for nextn
engines, with its report sections and JSON keys (see README.md and docs/PERFORMANCE.md for worked runs).

    nextn-bench --engine_dir DIR prepare-dataset [--output FILE] token-norm-dist --num-requests N --input-mean M ...
    nextn-bench --engine_dir DIR prepare-dataset dataset --dataset-local-path mt_bench.jsonl
    nextn-bench --engine_dir DIR throughput --dataset FILE [--concurrency N] [--streaming] [--baseline] [--plot DIR]
    nextn-bench --engine_dir DIR latency --dataset FILE

`--model_dir CKPT` instead of `--engine_dir` builds a temporary engine from a checkpoint first.

Each configuration runs a warm-up, then --passes timed passes of the dataset; its report gives the fastest pass,
every pass's tokens/s and the machine's load, and warns when the passes disagree by more than --max_spread. A
speed-up over --baseline above the acceptance length (AL) cannot be real: it is reported as unreliable, not as a
result.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import logging
import random
import re
import sys
import tempfile
from pathlib import Path

from nextn.cli.spellings import add_spellings, add_version, interrupted
from nextn.bench.dataset import (DatasetError, load_dataset, normal_lengths, prompt_dataset, read_prompt_file,
                                 synthetic_dataset, uniform_lengths, write_dataset)
from nextn.bench.passes import DEFAULT_MAX_SPREAD, speed_up, spread_warning
from nextn.cli.threads import add_threads_argument, apply_threads, available_cores
from nextn.build.output_files import (check_output_file, is_jsonl_with, is_report_of, write_output_file,
                                      written_by)
from nextn.cli.main import USER_ERRORS

PROG = "nextn-bench"
MAX_PASSES = 100  # --passes multiplies the whole dataset's run time


class BenchError(ValueError):
    """A command-line mistake found after parsing (e.g. neither --engine_dir nor --model_dir)."""


class _Parser(argparse.ArgumentParser):
    """argparse with every usage error as `nextn-bench: error: ...` (subcommands included), exit status 2."""

    def error(self, message: str):
        self.print_usage(sys.stderr)
        self.exit(2, f"{PROG}: error: {message} (see `{self.prog} --help`)\n")


# Arguments -------------------------------------------------------------------------------------------------------
def _add_model_args(p: argparse.ArgumentParser, top: bool) -> None:
    kw = {} if top else {"default": argparse.SUPPRESS}  # accepted before or after the subcommand
    p.add_argument("--engine_dir", help="engine directory written by build-engine", **kw)
    p.add_argument("--model_dir", help="HF checkpoint: build a temporary engine from it", **kw)


def _add_prepare(sub) -> None:
    p = sub.add_parser("prepare-dataset", help="write a dataset in trtllm-bench's format (JSON lines)",
                       description="Write a benchmark dataset: synthetic token ids (token-norm-dist, token-unif-dist) "
                                   "or a real prompt file (dataset) tokenized with the engine's tokenizer.")
    _add_model_args(p, top=False)
    p.add_argument("--output", help="output file (default: stdout)")
    p.add_argument("--stdout", action="store_true", help="write to stdout (the default; trtllm-bench's flag)")
    p.add_argument("--random-seed", type=int, default=0, help="seed of lengths and synthetic token ids (default 0)")
    kinds = p.add_subparsers(dest="kind", required=True, metavar="{token-norm-dist,token-unif-dist,dataset}")
    norm = kinds.add_parser("token-norm-dist", help="lengths ~ round(N(mean, stdev)), at least 1")
    norm.add_argument("--num-requests", type=int, required=True)
    for side in ("input", "output"):
        norm.add_argument(f"--{side}-mean", type=float, required=True, help=f"mean {side} tokens")
        norm.add_argument(f"--{side}-stdev", type=float, default=0.0, help=f"stdev of {side} tokens (default 0)")
    unif = kinds.add_parser("token-unif-dist", help="lengths uniform in [min, max]")
    unif.add_argument("--num-requests", type=int, required=True)
    for side in ("input", "output"):
        unif.add_argument(f"--{side}-min", type=int, required=True)
        unif.add_argument(f"--{side}-max", type=int, required=True)
    real = kinds.add_parser("dataset", help="a prompt file: MT-bench, Spec-Bench, HumanEval or GSM8K JSONL(.gz)")
    real.add_argument("--dataset-local-path", "--path", dest="path", required=True, help="the JSONL file")
    real.add_argument("--num-requests", type=int, default=0, help="first N prompts (0 = all)")
    real.add_argument("--output-len-dist", default="128,0", help="output tokens 'MEAN,STDEV' (default 128,0)")
    real.add_argument("--max-input-len", type=int, help="drop prompts longer than this many tokens")
    real.add_argument("--text", action="store_true", help="write prompts as text instead of token ids")
    p.set_defaults(func=_prepare)


def _add_run(sub, name: str) -> None:
    what = ("every request submitted at once, --concurrency of them in flight" if name == "throughput"
            else "batch 1: one request at a time, with TTFT/TPOT")
    p = sub.add_parser(name, help=f"{name} benchmark ({what})", description=f"The {name} benchmark: {what}.")
    _add_model_args(p, top=False)
    p.add_argument("--dataset", required=True, help="trtllm-bench dataset (JSON lines) from prepare-dataset")
    p.add_argument("--num_requests", type=int, default=0, help="measure the first N requests (0 = all)")
    p.add_argument("--warmup", type=int, default=2, help="unmeasured requests run first (default 2)")
    if name == "throughput":
        p.add_argument("--concurrency", type=int, default=-1, help="most requests in flight (-1 = unlimited)")
        p.add_argument("--streaming", action="store_true", help="report TTFT, TPOT and their percentiles")
    p.add_argument("--eos_id", type=int, default=-1, help="-1: ignore EOS, emit exactly output_tokens (default)")
    p.add_argument("--max_batch_size", type=int, help="runtime max batch size (default: the engine's)")
    p.add_argument("--max_num_tokens", type=int, help="token budget of one scheduler step")
    p.add_argument("--max_seq_len", type=int, help="runtime max sequence length (default: the engine's)")
    p.add_argument("--extra_llm_api_options", "--config", dest="extra_llm_api_options",
                   help="YAML of LLM arguments (TensorRT-LLM names), e.g. speculative_config")
    p.add_argument("--sampler_options", metavar="YAML",
                   help="SamplingParams fields every request takes (trtllm-bench's flag), e.g. `temperature: 0.7`, "
                        "`top_p: 0.8`, `top_k: 20`, `seed: 0` (default: greedy)")
    p.add_argument("--report_json", help="write the report as JSON (trtllm-bench keys)")
    p.add_argument("--iteration_log", help="write one JSON line per engine iteration")
    p.add_argument("--plot", metavar="DIR", help="write PNG charts (acceptance per draft position; tokens/s, AL vs K)")
    p.add_argument("--baseline", action="store_true",
                   help="also run the dataset with speculation off and print the speed-up")
    p.add_argument("--draft_lens", help="comma-separated K values: one run per K (MTP), compared side by side")
    add_threads_argument(p)
    p.add_argument("--passes", type=int, default=3,
                   help=f"timed passes of the dataset per configuration, after the warm-up; the report gives the "
                        f"fastest and the spread of all (1..{MAX_PASSES}, default 3)")
    p.add_argument("--max_spread", type=float, default=DEFAULT_MAX_SPREAD,
                   help="warn, and mark a speed-up unreliable, when passes' tokens/s differ by more than this "
                        f"fraction of their median (default {DEFAULT_MAX_SPREAD})")
    p.add_argument("--no_progress", action="store_true", help="no progress bar")
    p.set_defaults(func=_run)


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog=PROG, description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    _add_model_args(parser, top=True)
    parser.add_argument("-v", "--verbose", action="store_true", help="log engine loading")
    add_version(parser)
    sub = parser.add_subparsers(dest="command", required=True)
    _add_prepare(sub)
    _add_run(sub, "throughput")
    _add_run(sub, "latency")
    return add_spellings(parser)


# prepare-dataset -------------------------------------------------------------------------------------------------
def _tokenizer_and_vocab(args):
    """(tokenizer or None, vocab size) of --engine_dir or --model_dir, without loading weights."""
    if args.engine_dir:
        from nextn.build.manifest import EngineManifest
        from nextn.runtime.tokenizer import EngineTokenizer

        m = EngineManifest.load(args.engine_dir)
        return EngineTokenizer.load(Path(args.engine_dir), m.tokenizer_files), m.model.vocab_size
    cfg_path = Path(args.model_dir) / "config.json"
    if not cfg_path.is_file():
        raise BenchError(f"{args.model_dir} is not a checkpoint (no config.json)")
    vocab = json.loads(cfg_path.read_text())["vocab_size"]
    if not any((Path(args.model_dir) / f).is_file() for f in ("tokenizer.json", "tokenizer_config.json")):
        return None, vocab
    from transformers import AutoTokenizer

    from nextn.runtime.tokenizer import EngineTokenizer

    return EngineTokenizer(AutoTokenizer.from_pretrained(args.model_dir, trust_remote_code=False)), vocab


def _prepare(args) -> int:
    rng = random.Random(args.random_seed)
    tokenizer, vocab = _tokenizer_and_vocab(args)
    if args.kind == "dataset":
        try:
            mean, stdev = (float(x) for x in args.output_len_dist.split(","))
        except ValueError:
            raise BenchError(f"--output-len-dist takes 'MEAN,STDEV', got {args.output_len_dist!r}") from None
        fmt, prompts = read_prompt_file(args.path)
        prompts = prompts[:args.num_requests] if args.num_requests > 0 else prompts
        if tokenizer is None and not args.text:
            raise BenchError("this engine has no tokenizer: pass --text to write text prompts, or use an engine "
                             "built from a checkpoint with tokenizer files")
        entries, dropped = prompt_dataset(prompts, normal_lengths(len(prompts), mean, stdev, rng),
                                          None if args.text else tokenizer, args.max_input_len)
        print(f"{PROG}: {len(entries)} prompts from {args.path} ({fmt})"
              + (f", {dropped} longer than {args.max_input_len} tokens dropped" if dropped else ""), file=sys.stderr)
    else:
        n = args.num_requests
        if n < 1:
            raise BenchError(f"--num-requests must be ≥ 1, got {n}")
        if args.kind == "token-norm-dist":
            ins = normal_lengths(n, args.input_mean, args.input_stdev, rng)
            outs = normal_lengths(n, args.output_mean, args.output_stdev, rng)
        else:
            ins = uniform_lengths(n, args.input_min, args.input_max, rng)
            outs = uniform_lengths(n, args.output_min, args.output_max, rng)
        entries = synthetic_dataset(ins, outs, vocab, rng)
    if args.output:
        buf = io.StringIO()
        write_dataset(entries, buf)
        write_output_file(args.output, buf.getvalue(), "--output", is_jsonl_with("task_id"))
    else:
        write_dataset(entries, sys.stdout)
    return 0


# throughput / latency --------------------------------------------------------------------------------------------
CONFIGURED = "configured"  # the speculative config of the YAML, or the engine's default


def _plan(args, configured_spec) -> list:
    """The speculative configs to run, in order: None (the baseline) first, then the configured one or one per K."""
    plan = [None] if args.baseline else []
    if not args.draft_lens:
        return plan + [CONFIGURED]
    try:
        ks = [int(k) for k in args.draft_lens.split(",") if k.strip()]
    except ValueError:
        raise BenchError(f"--draft_lens takes comma-separated integers, got {args.draft_lens!r}") from None
    base = configured_spec.model_dump() if configured_spec is not None else {"decoding_type": "MTP"}
    return plan + [dict(base, num_nextn_predict_layers=k) if k > 0 else None for k in ks]


def _run(args) -> int:
    from nextn.bench.plot import write_plots
    from nextn.bench.report import compute_statistics, format_report, report_dict
    from nextn.bench.runner import run_benchmark
    from nextn.cli.env_options import env_llm_overrides
    from nextn.runtime.llm import LLM

    _check_counts(args)  # fail fast, before loading the engine (main checks them before building one too)
    _check_outputs(args)
    sampler_options = _sampler_options(args.sampler_options)
    entries = load_dataset(args.dataset)
    _, threads_note = apply_threads(args.num_threads, PROG, announce=False)  # said after the report
    overrides = {k: getattr(args, k) for k in ("max_batch_size", "max_num_tokens", "max_seq_len")
                 if getattr(args, k) is not None}
    if args.command == "latency":
        overrides["max_batch_size"] = 1
    overrides |= env_llm_overrides()

    def load(spec):
        kw = {} if spec == CONFIGURED else {"speculative_config": spec}
        return LLM(args.engine_dir, extra_llm_api_options=args.extra_llm_api_options, **kw, **overrides)

    llm, current = (load(CONFIGURED), CONFIGURED) if args.draft_lens else (None, None)
    plan = _plan(args, llm.speculative_config if llm is not None else None)
    results, failed = [], 0
    for i, spec in enumerate(plan):
        if llm is None or spec != current:
            llm = None  # free the previous engine first
            llm, current = load(spec), spec
        run = run_benchmark(llm, entries, mode=args.command, concurrency=getattr(args, "concurrency", 1),
                            warmup=args.warmup, eos_id=args.eos_id, streaming=getattr(args, "streaming", True),
                            num_requests=args.num_requests, record_iterations=bool(args.iteration_log),
                            progress=not args.no_progress, dataset_path=args.dataset,
                            desc=f"{args.command} K={llm.num_draft_tokens}", passes=args.passes,
                            sampler_options=sampler_options)
        for err in run.errors:
            print(f"{PROG}: error: {err}", file=sys.stderr)
        failed += len(run.errors)
        if not run.outputs:
            raise BenchError(f"no request of {args.dataset} completed")
        stats = compute_statistics(run)
        print(format_report(run, stats), flush=True)
        warning = spread_warning(f"{run.decoding_mode} K={run.max_draft_len}", run.spread, args.max_spread)
        if warning:
            print(f"{PROG}: {warning}", file=sys.stderr, flush=True)
        tag = "baseline" if args.baseline and i == 0 else (f"k{run.max_draft_len}" if args.draft_lens else None)
        results.append((tag, run, stats))
    _write_outputs(args, results, report_dict, write_plots)
    _print_comparison(results, args.baseline, args.max_spread)
    if threads_note:
        print(f"{PROG}: {threads_note}", file=sys.stderr)
    return 1 if failed else 0


def _check_counts(args) -> None:
    """Bound what multiplies the run before any work: --passes in 1..MAX_PASSES, --max_spread a positive number."""
    if not 1 <= args.passes <= MAX_PASSES:
        raise BenchError(f"--passes must be in 1..{MAX_PASSES} (each pass runs the whole dataset), got {args.passes}")
    if not 0 < args.max_spread < float("inf"):
        raise BenchError(f"--max_spread must be a positive fraction such as 0.1 (10 %), got {args.max_spread}")
    if args.num_threads is not None and not 1 <= args.num_threads <= available_cores():
        raise BenchError(f"--num_threads must be in 1..{available_cores()} (the cores this process may use), got "
                         f"{args.num_threads}")


#: What the dataset and --eos_id decide for each request: not --sampler_options' to set
_DATASET_FIELDS = ("max_tokens", "ignore_eos", "end_id", "detokenize")


def _sampler_options(path: str | None) -> dict | None:
    """The --sampler_options YAML as SamplingParams fields, checked before any work.

    Raises:
        BenchError: an unreadable file, not a mapping, a field the dataset decides, or an invalid value.
    """
    if path is None:
        return None
    import yaml

    from nextn.runtime.sampling_params import SamplingParams

    try:
        options = yaml.safe_load(Path(path).read_text())
    except (OSError, UnicodeDecodeError, yaml.YAMLError) as e:
        raise BenchError(f"--sampler_options {path}: {e}") from None
    if not isinstance(options, dict):
        raise BenchError(f"--sampler_options {path}: expected a mapping of SamplingParams fields, got "
                         f"{type(options).__name__}")
    fixed = sorted(set(options) & set(_DATASET_FIELDS))
    if fixed:
        raise BenchError(f"--sampler_options {path}: {', '.join(fixed)} come from the dataset and --eos_id")
    try:
        SamplingParams(max_tokens=1, **options)
    except (ValueError, TypeError) as e:
        raise BenchError(f"--sampler_options {path}: {e}") from None
    return options


def _check_outputs(args) -> None:
    """Refuse, before any work, an output path that is a directory, a link, or a file not in the format written
    there (build/output_files.py): --report_json and the FILE.baseline.json / FILE.k{K}.json beside it, the charts
    already in --plot."""
    if args.report_json:
        p = Path(args.report_json)
        tagged = re.compile(re.escape(p.stem) + r"\.(baseline|k\d+)" + re.escape(p.suffix))
        for path in [p, *(q for q in (p.parent.iterdir() if p.parent.is_dir() else ()) if tagged.fullmatch(q.name))]:
            check_output_file(path, "--report_json", is_report_of("bench"))
    if args.iteration_log:
        check_output_file(args.iteration_log, "--iteration_log", is_jsonl_with("iteration"))
    if args.plot:
        from nextn.bench.plot import check_plot_dir

        check_plot_dir(args.plot)


def _write_outputs(args, results, report_dict, write_plots) -> None:
    """--report_json (FILE for the configured run; FILE.baseline.json, FILE.k{K}.json beside it), --iteration_log,
    --plot."""
    if args.report_json:
        base = results[0][2] if args.baseline else None
        for i, (tag, run, stats) in enumerate(results):
            p = Path(args.report_json)
            path = p.with_name(f"{p.stem}.{tag}{p.suffix}") if tag else p
            d = {**written_by("bench"), **report_dict(run, stats)}
            if base is not None and i > 0:
                d["speed_up_over_baseline"] = _speed_up(results[0], (tag, run, stats), args.max_spread).to_dict(
                    base.output_throughput_tok_s)
            write_output_file(path, json.dumps(d, indent=2) + "\n", "--report_json", is_report_of("bench"))
    if args.iteration_log:
        lines = [json.dumps({"iteration": i, "max_draft_len": run.max_draft_len, **entry}) + "\n"
                 for _, run, _ in results for i, entry in enumerate(run.iteration_log)]
        write_output_file(args.iteration_log, "".join(lines), "--iteration_log", is_jsonl_with("iteration"))
    if args.plot:
        for path in write_plots([(run, stats) for _, run, stats in results], args.plot, args.max_spread):
            print(f"{PROG}: wrote {path}", file=sys.stderr)


def _speed_up(base, result, max_spread: float):
    """The verdict (bench/passes.py SpeedUp) on one (tag, run, stats) result against the baseline's."""
    (_, base_run, base_stats), (_, run, stats) = base, result
    return speed_up(stats.output_throughput_tok_s, base_stats.output_throughput_tok_s,
                    stats.global_acceptance_length, run.spread, base_run.spread, max_spread)


def _print_comparison(results, baseline: bool, max_spread: float = DEFAULT_MAX_SPREAD) -> None:
    """A table of the runs (K, tokens/s, TPOT, AL, and with a baseline the speed-up and speed-up / AL); a speed-up
    above the AL is printed as n/a and flagged unreliable with every pass's tokens/s and the machine's load."""
    if len(results) < 2:
        return
    base = results[0] if baseline else None
    print(f"\n{'K':>3}{'tokens/s':>12}{'TPOT (ms)':>11}{'AL':>8}"
          + (f"{'speed-up':>10}{'speed-up/AL':>13}" if base else ""))
    for result in results:
        _, run, s = result
        row = (f"{run.max_draft_len:>3}{s.output_throughput_tok_s:>12.2f}{s.tpot_ms.average:>11.2f}"
               f"{s.global_acceptance_length:>8.3f}")
        if base:
            up = _speed_up(base, result, max_spread).shown
            ratio = f"{up:>9.3f}x{up / s.global_acceptance_length:>13.3f}" if up is not None else None
            row += ratio or f"{'n/a':>10}{'n/a':>13}"
        print(row)
    if base is None:
        return
    b_run, b = base[1], base[2]
    for result in results[1:]:
        _, run, s = result
        v = _speed_up(base, result, max_spread)
        label = f"Speed-up over no speculation ({run.decoding_mode} K={run.max_draft_len})"
        figures = (f"{s.output_throughput_tok_s:.2f} vs {b.output_throughput_tok_s:.2f} output tokens/s, fastest of "
                   f"each, AL {s.global_acceptance_length:.3f}")
        if v.reliable:
            print(f"{label}: {v.ratio:.3f}x ({figures})")
            continue
        shown = "not measured reliably" if v.impossible else f"{v.ratio:.3f}x, UNRELIABLE"
        print(f"{label}: {shown} ({figures}): {v.reason}")
        for name, r in (("baseline", b_run), (f"K={run.max_draft_len}", run)):
            if r.spread is not None:
                print(f"    {name} passes (output tokens/s): {r.spread.passes_text()}; {r.spread.noise_text()}")
        print("    rerun on an idle machine (other processes slow some passes more than others), or with more --passes")


# main ------------------------------------------------------------------------------------------------------------
def main(argv: list[str] | None = None) -> int:
    """Run `nextn-bench`; returns the exit status (2: usage or input error, 1: some requests failed)."""
    parser = build_parser()
    try:
        args = parser.parse_args(argv)
    except SystemExit as e:  # argparse already printed "nextn-bench: error: ..." (or the help)
        return int(e.code or 0)
    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING, format="%(levelname)s %(message)s")
    try:
        if bool(args.engine_dir) == bool(args.model_dir):
            raise BenchError("give exactly one of --engine_dir (an engine) and --model_dir (a checkpoint)")
        with contextlib.ExitStack() as stack:
            if args.model_dir and args.command != "prepare-dataset":
                _check_counts(args)  # before the build: a refusal must not cost one
                _check_outputs(args)
                _sampler_options(args.sampler_options)
                from nextn.build.engine_builder import build_engine

                tmp = stack.enter_context(tempfile.TemporaryDirectory(prefix="nextn-bench-"))
                build_engine(args.model_dir, Path(tmp) / "engine", progress=False)
                args.engine_dir = str(Path(tmp) / "engine")
            return args.func(args)
    except KeyboardInterrupt:
        return interrupted(PROG)
    except (BenchError, DatasetError, *USER_ERRORS) as e:
        print(f"{PROG}: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
