"""Structured output on schemas no one here wrote: the JSON-Schema-Test-Suite's schemas (the official suite, shipped
in the `jsonschema` sdist), each used as a `response_format` grammar; the output must parse and validate with the
`jsonschema` library.

    pip download --no-deps --no-binary=:all: jsonschema==4.26.0 && tar xzf jsonschema-4.26.0.tar.gz
    python -m benchmarks.json_schemas --engine ENGINE --suite jsonschema-4.26.0/json/tests/draft2020-12

Every schema of the suite files named by `--keywords` (the keywords xgrammar's JSON-schema grammar enforces;
default below) is tried in file order, up to `--limit`; a schema xgrammar refuses to compile is counted as refused,
not as a failure; an output cut by `--max_tokens` (a schema that allows any value lets a model write on) is counted
as cut; every complete output must validate.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from nextn.bench.outputs import check_report, write_report
from nextn.runtime.llm import LLM
from nextn.runtime.sampling_params import GuidedDecodingParams, SamplingParams

KEYWORDS = ("type", "properties", "required", "items", "enum", "const", "minimum", "maximum", "exclusiveMinimum",
            "exclusiveMaximum", "minLength", "maxLength", "minItems", "maxItems", "pattern", "additionalProperties",
            "anyOf", "oneOf", "allOf", "ref", "defs", "prefixItems", "boolean_schema", "default")
PROMPT = "Answer with one short JSON value."


def suite_schemas(suite: Path, keywords: tuple[str, ...], limit: int) -> list[tuple[str, object]]:
    """(file:description, schema) for each test group of the named suite files, in order, at most `limit`."""
    out = []
    for kw in keywords:
        path = suite / f"{kw}.json"
        if not path.is_file():
            continue
        for group in json.loads(path.read_text()):
            out.append((f"{kw}: {group['description']}", group["schema"]))
    return out[:limit]


def run(args: argparse.Namespace) -> dict:
    import jsonschema

    llm = LLM(args.engine, extra_llm_api_options=args.config, **({} if args.config else {"speculative_config": None}))
    prompt = llm.tokenizer.apply_chat_template([{"role": "user", "content": PROMPT}])
    schemas = suite_schemas(Path(args.suite), tuple(args.keywords), args.limit)
    params = [SamplingParams(max_tokens=args.max_tokens, guided_decoding=GuidedDecodingParams(
        json=s if isinstance(s, dict) else json.dumps(s))) for _, s in schemas]
    outs = llm.generate([prompt] * len(schemas), params)
    rows, counts = [], {"valid": 0, "invalid": 0, "cut": 0, "refused": 0}
    for (name, schema), out in zip(schemas, outs):
        c = out.outputs[0]
        if c.finish_reason == "error":
            verdict, why = "refused", (c.error or "")[:120]
        elif c.finish_reason == "length":
            verdict, why = "cut", f"{len(c.token_ids)} tokens"
        else:
            try:
                jsonschema.validate(json.loads(c.text), schema)
                verdict, why = "valid", ""
            except (json.JSONDecodeError, jsonschema.ValidationError, jsonschema.SchemaError) as e:
                verdict, why = "invalid", f"{type(e).__name__}: {str(e)[:100]}"
        counts[verdict] += 1
        rows.append({"schema": name, "verdict": verdict, "output": c.text[:200], "finish_reason": c.finish_reason,
                     "why": why})
        print(f"{verdict:>8}  {name[:70]:<70} {c.text[:50]!r} {why}", flush=True)
    done = counts["valid"] + counts["invalid"]
    print(f"\n{counts['valid']}/{done} complete outputs valid; {counts['cut']} cut at --max_tokens; "
          f"{counts['refused']} schemas refused by the grammar compiler")
    return {"config": vars(args), "counts": counts, "rows": rows}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.json_schemas", description=__doc__.split("\n\n")[0])
    p.add_argument("--engine", required=True, help="an engine directory or checkpoint (with a tokenizer)")
    p.add_argument("--suite", required=True, help="a JSON-Schema-Test-Suite tests/<draft> folder")
    p.add_argument("--keywords", nargs="+", default=list(KEYWORDS), help="suite files to take schemas from")
    p.add_argument("--limit", type=int, default=200, help="most schemas tried (default 200)")
    p.add_argument("--max_tokens", type=int, default=96, help="tokens per output (default 96)")
    p.add_argument("--config", default=None, help="extra_llm_api_options YAML (a drafter); default: plain decoding")
    p.add_argument("--json", default=None, help="also write the results here")
    args = p.parse_args(argv)
    if not 1 <= args.limit <= 10000 or not 1 <= args.max_tokens <= 4096:
        p.error("--limit in [1, 10000], --max_tokens in [1, 4096]")
    check_report(p, args.json, "json_schemas")
    result = run(args)
    if args.json:
        write_report(args.json, "json_schemas", result)
    return 0 if result["counts"]["invalid"] == 0 else 1


if __name__ == "__main__":
    raise SystemExit(main())
