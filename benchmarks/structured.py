"""What structured output costs: decode tokens/s of the same requests unconstrained, with penalties only (the
synchronous, eager steps any processed request runs), and under a JSON-schema grammar, at each batch size, with an
engine's drafter on or off — one invocation, best of `--runs` (the modes interleaved) after a warm-up.

    python -m benchmarks.structured --engine ENGINE --batch 1 8 --max_tokens 64 [--config configs/ngram.yaml]

Every request runs to `--max_tokens` (EOS ignored; the grammar's own end is allowed, so its outputs may stop
earlier: tokens/s counts the tokens emitted). Prefill is excluded: each run's time starts at the last request's first token.
"""

from __future__ import annotations

import argparse

from nextn.bench.outputs import check_report, write_report
from nextn.runtime.llm import LLM
from nextn.runtime.sampling_params import GuidedDecodingParams, SamplingParams

SCHEMA = {"type": "object", "properties": {
    "name": {"type": "string", "maxLength": 40}, "age": {"type": "integer"},
    "languages": {"type": "array", "items": {"type": "string", "maxLength": 20}, "maxItems": 4},
    "city": {"type": "string", "maxLength": 30}, "employed": {"type": "boolean"}},
    "required": ["name", "age", "languages", "city", "employed"], "additionalProperties": False}
PROMPT = ("Write a JSON object describing a fictional software engineer with the fields name, age, languages, "
          "city and employed.")
MODES = ("plain", "penalties", "json_schema")


def params(mode: str, max_tokens: int) -> SamplingParams:
    extra = {"plain": {}, "penalties": {"presence_penalty": 0.01},
             "json_schema": {"guided_decoding": GuidedDecodingParams(json=SCHEMA)}}[mode]
    return SamplingParams(max_tokens=max_tokens, ignore_eos=mode != "json_schema", **extra)


def decode_rate(llm: LLM, batch: int, sp: SamplingParams) -> tuple[float, int]:
    """(decode tokens/s of one batch, tokens emitted after each request's first): from the last first token (every
    request decoding) to the last finish."""
    prompt = llm.tokenizer.apply_chat_template([{"role": "user", "content": PROMPT}])
    outs = [o.outputs[0] for o in llm.generate([prompt] * batch, sp)]
    start = max(c.first_token_time for c in outs)
    tokens = sum(len(c.token_ids) - 1 for c in outs)
    return tokens / (max(c.finished_time for c in outs) - start), tokens


def run(args: argparse.Namespace) -> dict:
    llm = LLM(args.engine, extra_llm_api_options=args.config, max_batch_size=max(args.batch),
              **({} if args.config else {"speculative_config": None}))
    decode_rate(llm, 1, params("json_schema", 8))  # warm-up (and the grammar compiled once)
    rows = []
    for b in args.batch:
        row = {"batch": b, **{m: 0.0 for m in MODES}}
        for _ in range(args.runs):  # the modes interleaved, so the machine's drift hits each alike
            for mode in MODES:
                row[mode] = max(row[mode], decode_rate(llm, b, params(mode, args.max_tokens))[0])
        row["penalties_vs_plain"] = row["penalties"] / row["plain"]
        row["json_schema_vs_plain"] = row["json_schema"] / row["plain"]
        print(f"batch {b}: plain {row['plain']:.1f} tok/s, penalties {row['penalties']:.1f} "
              f"({row['penalties_vs_plain']:.2f}x), JSON schema {row['json_schema']:.1f} "
              f"({row['json_schema_vs_plain']:.2f}x)", flush=True)
        rows.append(row)
    return {"config": vars(args), "rows": rows}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.structured", description=__doc__.split("\n\n")[0])
    p.add_argument("--engine", required=True, help="an engine directory or checkpoint (with a tokenizer)")
    p.add_argument("--batch", type=int, nargs="+", default=[1, 8], help="batch sizes (default 1 8)")
    p.add_argument("--max_tokens", type=int, default=64, help="tokens per request (default 64)")
    p.add_argument("--runs", type=int, default=3, help="timed runs per point, best kept (default 3)")
    p.add_argument("--config", default=None, help="extra_llm_api_options YAML (a drafter); default: plain decoding")
    p.add_argument("--json", default=None, help="also write the results here")
    args = p.parse_args(argv)
    if min(args.batch) < 1 or max(args.batch) > 256 or args.max_tokens < 2 or not 1 <= args.runs <= 20:
        p.error("--batch in [1, 256], --max_tokens ≥ 2, --runs in [1, 20]")
    check_report(p, args.json, "structured")
    result = run(args)
    if args.json:
        write_report(args.json, "structured", result)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
