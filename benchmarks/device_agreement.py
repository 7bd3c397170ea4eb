"""One checkpoint end to end through `LLM` on each device: greedy tokens of plain decoding and of an NGram drafter,
eager and with the decode step captured in CUDA graphs (on CUDA, with the overlap scheduler and without it:
`disable_overlap_scheduler`), each against the first device's plain decoding, and decode tokens/s of a fixed batch
(best of `--repeats` after a warm-up).

    python -m benchmarks.device_agreement --model stories260K.gguf --devices cuda,cpu --json $OUT/agreement.json

On a GPU this is the end-to-end check that the Triton kernels and the graph runner change no token; on CPU alone it
runs plain and NGram only.
"""

from __future__ import annotations

import argparse

from benchmarks.decode_pass import best_of
from nextn.bench.outputs import check_report, write_report
from nextn.runtime.llm import LLM
from nextn.runtime.sampling_params import SamplingParams

PROMPTS = ["Once upon a time", "The little dog", "Lily and Tom went to the park", "One day, a big bird",
           "Sam had a red ball", "There was a girl named Sue", "The sun was hot", "Tim wanted to play"]
NGRAM = {"decoding_type": "NGram", "max_draft_len": 4}


def cases(device: str) -> list[tuple[str, dict | None, dict]]:
    """(name, speculative_config, extra `LLM` arguments) for one device: CUDA graphs, and the synchronous scheduler
    beside the overlap scheduler (the default), only on CUDA."""
    out = [("plain", None, {}), ("ngram", NGRAM, {})]
    if device == "cuda":
        graphs = {"cuda_graph_config": {}}
        sync = {**graphs, "disable_overlap_scheduler": True}
        out += [("plain_graph", None, graphs), ("ngram_graph", NGRAM, graphs),
                ("plain_graph_sync", None, sync), ("ngram_graph_sync", NGRAM, sync)]
    return out


def run(args: argparse.Namespace) -> dict:
    params = SamplingParams(max_tokens=args.max_tokens, temperature=0.0, ignore_eos=True)
    prompts = (PROMPTS * -(-args.batch // len(PROMPTS)))[:args.batch]
    results, reference = {}, None
    for device in args.devices.split(","):
        for name, spec, extra in cases(device):
            llm = LLM(args.model, speculative_config=spec, device=device, engine_cache_dir=args.engine_cache_dir,
                      max_batch_size=args.batch, **extra)
            llm.generate(prompts[:2], SamplingParams(max_tokens=8, temperature=0.0))  # warm-up (and graph capture)
            best, tokens = best_of(llm, prompts, params, args.repeats)
            reference = reference or tokens
            same = sum(a == b for a, b in zip(tokens, reference))
            results[f"{device}_{name}"] = {"tokens_per_s": sum(map(len, tokens)) / best,
                                           "identical": same, "requests": len(tokens)}
            print(f"{device:>5} {name:<12} {results[f'{device}_{name}']['tokens_per_s']:>9.0f} tok/s   "
                  f"identical to {args.devices.split(',')[0]} plain: {same}/{len(tokens)}", flush=True)
            del llm
    for name in ("plain_graph", "ngram_graph"):
        on, off = results.get(f"cuda_{name}"), results.get(f"cuda_{name}_sync")
        if on and off:
            print(f"overlap scheduler speed-up, {name}: {on['tokens_per_s'] / off['tokens_per_s']:.2f}x", flush=True)
    return {"config": vars(args), "results": results}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.device_agreement", description=__doc__.split("\n\n")[0])
    p.add_argument("--model", required=True, help="a GGUF file, HF checkpoint or engine directory")
    p.add_argument("--devices", default="cuda,cpu", help="comma-separated; the first device's plain decoding is the "
                                                          "reference (default cuda,cpu)")
    p.add_argument("--batch", type=int, default=8, help="requests generated together (default 8)")
    p.add_argument("--max_tokens", type=int, default=96, help="new tokens per request, EOS ignored (default 96)")
    p.add_argument("--repeats", type=int, default=3, help="timed runs per case, best kept (default 3)")
    p.add_argument("--engine_cache_dir", default=None, help="where a checkpoint's engine is built (default "
                                                            "~/.cache/nextn/engines)")
    p.add_argument("--json", default=None, help="also write the results here (an existing file only when a run of "
                                                "this benchmark wrote it)")
    args = p.parse_args(argv)
    if args.batch < 1 or args.max_tokens < 1 or args.repeats < 1:
        p.error("--batch, --max_tokens and --repeats must be at least 1")
    check_report(p, args.json, "device_agreement")
    result = run(args)
    if args.json:
        write_report(args.json, "device_agreement", result)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
