"""Batch invariance, measured: a request's greedy tokens must be the plain decoder's alone, whatever shares its steps.

nextn promises that under greedy decoding speculation changes only the speed, and that a request's output does not
depend on the other requests in flight (docs/RELIABILITY.md). This module runs that promise as a matrix over one
model: engine formats (fp32, bf16, W8A16, W4A16, W4A8) × drafters (none, NGram, Draft_Target, MTP, Medusa) ×
scenarios, each scenario's greedy outputs compared token for token with the reference — each prompt alone, plain
decoding, no prefix cache:

- `alone`: each prompt alone with the drafter (speculation alone changes nothing);
- `batch`: the prompts in batches of `batch_size`;
- `staggered`: requests added at different steps (`LLM.add_request` / `LLM.step`), so prefill and decode steps
  and batch sizes interleave;
- `chunked`: the batch again, prompts prefilled in chunks (`enable_chunked_prefill`, a small `max_num_tokens`);
- `prefix`: prefix-cache hits: the same prompts again after a first pass, and prompts sharing a long prefix with
  one already run (their references are computed alone too);
- `sampled`: seeded sampling requests (temperature 0.8) alone vs in a batch with the greedy ones: same seed → same
  tokens.

`python -m nextn.testing.batch_invariance --model stories260K.gguf --formats fp32 bf16 W4A16 --drafters none NGram
--prompts 32 --max_tokens 128` builds the engines (Medusa: seeded random heads, 1 layer each; Draft_Target: the same
model in another format as the draft) and prints the table: format × drafter × scenario → identical n/N.
`tests/runtime/test_batch_invariance.py` runs a slice of it.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

#: Engine formats: (build dtype, quant_algo).
FORMATS: dict[str, tuple[str, str | None]] = {
    "fp32": ("float32", None), "bf16": ("bfloat16", None), "fp16": ("float16", None),
    "W8A16": ("bfloat16", "W8A16"), "W4A16": ("bfloat16", "W4A16"), "W4A8": ("bfloat16", "W4A8"),
}
DRAFTERS = ("none", "NGram", "Draft_Target", "MTP", "Medusa")
SCENARIOS = ("alone", "batch", "staggered", "chunked", "prefix", "sampled")
MAX_DRAFT_LEN = 4
#: LLM arguments every run shares (the reference's too), so that only the scenario differs.
COMMON_ARGS: dict[str, Any] = {"max_batch_size": 12, "kv_cache_config": {"tokens_per_block": 8},
                               "disable_overlap_scheduler": False}


def speculative_config(drafter: str, draft_engine: Path | None = None) -> dict | None:
    """The `speculative_config` of a drafter name (Draft_Target needs `draft_engine`)."""
    if drafter == "none":
        return None
    if drafter == "NGram":
        return {"decoding_type": "NGram", "max_draft_len": MAX_DRAFT_LEN, "max_matching_ngram_size": 3}
    if drafter == "Draft_Target":
        if draft_engine is None:
            raise ValueError("Draft_Target needs a draft engine")
        return {"decoding_type": "Draft_Target", "max_draft_len": MAX_DRAFT_LEN,
                "speculative_model_dir": str(draft_engine)}
    if drafter == "MTP":
        return {"decoding_type": "MTP", "num_nextn_predict_layers": 1}
    if drafter == "Medusa":
        return {"decoding_type": "Medusa", "medusa_choices": [[0], [1], [0, 0], [0, 1], [1, 0], [0, 0, 0]]}
    raise ValueError(f"unknown drafter {drafter!r}; valid: {', '.join(DRAFTERS)}")


@dataclass
class Result:
    """One cell: how many of a scenario's outputs equal the reference's."""

    format: str
    drafter: str
    scenario: str
    identical: int
    total: int
    first_mismatch: str = ""  # the first differing prompt and position, for the report

    @property
    def ok(self) -> bool:
        return self.identical == self.total


@dataclass
class Prompts:
    """The prompts a matrix runs: `main` (checked), `shared` (checked; sharing a long prefix), `fillers` (batch
    company, not checked: each batch of main prompts is topped up with them to the batch size, so that a short
    reference still meets full batches)."""

    main: list[list[int]]
    shared: list[list[int]] = field(default_factory=list)
    fillers: list[list[int]] = field(default_factory=list)


def text_prompts(tokenize: Callable[[str], list[int]], count: int, data_dir: Path, min_len: int = 6,
                 max_len: int = 48) -> Prompts:
    """`count` prompts from MT-bench's first turns (data_dir/prompts/mt_bench.jsonl, cycled), tokenized and cut to
    lengths spread over [min_len, max_len] (so batches mix short and long prompts), and 3 prompts sharing the first
    `max_len` − 8 tokens of a long one."""
    lines = (data_dir / "prompts" / "mt_bench.jsonl").read_text().splitlines()
    texts = [" ".join(json.loads(line)["turns"]) for line in lines if line.strip()]
    main = []
    for i in range(count):
        ids = tokenize(texts[i % len(texts)])
        want = min_len + (i * 11) % (max_len - min_len + 1)
        main.append((ids * (want // max(len(ids), 1) + 1))[:want])
    long = tokenize(" ".join(texts[:4]))
    prefix = long[:max_len - 8]
    shared = [prefix + tokenize(texts[j])[:4 + j] for j in range(4, 7)]
    return Prompts(main, shared)


def id_prompts(count: int, vocab_size: int, min_len: int = 6, max_len: int = 40, seed: int = 0,
               num_fillers: int = 0) -> Prompts:
    """Seeded token-id prompts for a model without a tokenizer (ids in [3, vocab_size)): `count` of lengths spread
    over [min_len, max_len], 3 sharing their first max_len − 8 tokens with a fourth (`Prompts.shared`), and
    `num_fillers` more as batch company."""
    g = torch.Generator().manual_seed(seed)
    fillers = [torch.randint(3, vocab_size, (min_len + (i * 7) % (max_len - min_len + 1),), generator=g).tolist()
               for i in range(num_fillers)]
    main = [torch.randint(3, vocab_size, (min_len + (i * 11) % (max_len - min_len + 1),), generator=g).tolist()
            for i in range(count)]
    prefix = torch.randint(3, vocab_size, (max_len - 8,), generator=g).tolist()
    shared = [prefix + torch.randint(3, vocab_size, (4 + j,), generator=g).tolist() for j in range(3)]
    return Prompts(main, shared, fillers)


def _greedy(max_tokens: int):
    from nextn import SamplingParams

    return SamplingParams(max_tokens=max_tokens, ignore_eos=True, temperature=0.0)


def _sampled(max_tokens: int, seed: int):
    from nextn import SamplingParams

    return SamplingParams(max_tokens=max_tokens, ignore_eos=True, temperature=0.8, top_p=0.95, seed=seed)


def _ids(outputs) -> list[list[int]]:
    return [list(o.outputs[0].token_ids) for o in outputs]


def _alone(llm, prompts: Sequence[list[int]], params) -> list[list[int]]:
    outs = []
    for p in prompts:
        llm.reset_prefix_cache()
        outs.append(list(llm.generate(p, params).outputs[0].token_ids))
    return outs


def _batched(llm, prompts: Sequence[list[int]], params, batch_size: int,
             fillers: Sequence[list[int]] = ()) -> list[list[int]]:
    """The prompts in batches of `batch_size` (topped up with `fillers`); the prompts' outputs, in order."""
    out: list[list[int]] = []
    for i in range(0, len(prompts), batch_size):
        batch = list(prompts[i:i + batch_size])
        n = len(batch)
        batch += list(fillers[:batch_size - n])
        out += _ids(llm.generate(batch, params))[:n]
    return out


def _staggered(llm, prompts: Sequence[list[int]], params, fillers: Sequence[list[int]] = ()) -> list[list[int]]:
    """Add the prompts (fillers between them) one by one, 0–2 steps apart (a fixed pattern), stepping until all
    finish; the prompts' outputs, in order."""
    ids: dict[int, int] = {}
    outs: dict[int, list[int]] = {}
    pending = [(i, p) for i, p in enumerate(prompts)]
    for j, f in enumerate(fillers):
        pending.insert(min(2 * j + 1, len(pending)), (-1 - j, f))
    tick = 0
    while pending or llm.has_unfinished_requests:
        if pending and tick % 3 != 2:
            i, p = pending.pop(0)
            ids[llm.add_request(p, params)] = i
        for o in llm.step():
            outs[ids[o.request_id]] = list(o.outputs[0].token_ids)
        tick += 1
    return [outs[i] for i in range(len(prompts))]


def _compare(reference: list[list[int]], got: list[list[int]]) -> tuple[int, str]:
    same = sum(a == b for a, b in zip(reference, got))
    first = ""
    for i, (a, b) in enumerate(zip(reference, got)):
        if a != b:
            pos = next((j for j, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
            first = f"prompt {i} at token {pos}"
            break
    return same, first


def _llm(engine: Path, spec: dict | None, **args):
    from nextn import LLM

    merged = {**COMMON_ARGS, **args}
    return LLM(engine, speculative_config=spec, device="cpu", **merged)


class Reference:
    """Each prompt alone, plain decoding, no prefix cache: the outputs every scenario must equal (per engine)."""

    def __init__(self, engine: Path, prompts: Prompts, max_tokens: int) -> None:
        llm = _llm(engine, None, kv_cache_config={**COMMON_ARGS["kv_cache_config"], "enable_block_reuse": False})
        self.main = _alone(llm, prompts.main, _greedy(max_tokens))
        self.shared = _alone(llm, prompts.shared, _greedy(max_tokens))
        llm.shutdown()


def run_cell(engine: Path, fmt: str, drafter: str, spec: dict | None, prompts: Prompts, ref: Reference,
             max_tokens: int, scenarios: Iterable[str] = SCENARIOS, batch_size: int = 12,
             chunk_tokens: int = 12, num_sampled: int = 3) -> list[Result]:
    """Every scenario of one (engine, drafter) against the reference; one `Result` each. `sampled` compares
    `num_sampled` seeded requests alone with the same requests in a batch (a sampling drafter draws differently
    from plain decoding: only its own solo output is the reference)."""
    scenarios = set(scenarios)
    greedy = _greedy(max_tokens)
    results = []

    def record(scenario: str, reference: list[list[int]], got: list[list[int]]) -> None:
        same, first = _compare(reference, got)
        results.append(Result(fmt, drafter, scenario, same, len(reference), first))

    llm = _llm(engine, spec)
    if "alone" in scenarios and spec is not None:
        record("alone", ref.main, _alone(llm, prompts.main, greedy))
    if "batch" in scenarios or "prefix" in scenarios:
        llm.reset_prefix_cache()
        batched = _batched(llm, prompts.main, greedy, batch_size, prompts.fillers)
        if "batch" in scenarios:
            record("batch", ref.main, batched)
    if "prefix" in scenarios:  # the cache now holds every main prompt's full blocks
        again = _batched(llm, prompts.main, greedy, batch_size, prompts.fillers)
        first = list(llm.generate(prompts.shared[0], greedy).outputs[0].token_ids)
        rest = _ids(llm.generate(prompts.shared[1:], greedy)) if len(prompts.shared) > 1 else []
        record("prefix", ref.main + ref.shared, again + [first] + rest)
    if "staggered" in scenarios:
        llm.reset_prefix_cache()
        record("staggered", ref.main, _staggered(llm, prompts.main, greedy, prompts.fillers))
    if "sampled" in scenarios and num_sampled:  # seeded: this drafter's tokens alone (its acceptance rule's draws)
        alone = [list(llm.generate(prompts.main[i], _sampled(max_tokens, i)).outputs[0].token_ids)
                 for i in range(num_sampled)]
        batch = (prompts.main + prompts.fillers)[:batch_size]
        params = [_sampled(max_tokens, s) for s in range(num_sampled)] + [greedy] * (len(batch) - num_sampled)
        outs = _ids(llm.generate(batch, params))
        record("sampled", alone, outs[:num_sampled])
    llm.shutdown()
    if "chunked" in scenarios:
        chunked = _llm(engine, spec, enable_chunked_prefill=True, max_num_tokens=chunk_tokens)
        record("chunked", ref.main, _batched(chunked, prompts.main, greedy, batch_size, prompts.fillers))
        chunked.shutdown()
    return results


def build_format(model: str | Path, fmt: str, out: Path, medusa_heads: Path | None = None,
                 model_cfg: dict | None = None, max_seq_len: int | None = 512) -> Path:
    """Build `model` as engine format `fmt` (a `FORMATS` key) into `out` (reused when it already holds one).

    W4A16 / W4A8 keep the MLPs in bf16 where no int4 group size divides their width (`model_cfg[
    "intermediate_size"]`; stories260K: 172, which the int4 packing cannot take as output channels either), as
    `build-engine --exclude_modules` would.
    """
    from nextn.build.engine_builder import build_engine

    if (out / "manifest.json").is_file():
        return out
    dtype, quant = FORMATS[fmt]
    exclude = None
    if quant in ("W4A16", "W4A8") and model_cfg and model_cfg["intermediate_size"] % 32:
        exclude = [f"model.layers.{i}.mlp" for i in range(model_cfg["num_hidden_layers"])]
    build_engine(model, out, dtype=dtype, quant_algo=quant, progress=False, medusa_model_dir=medusa_heads,
                 max_seq_len=max_seq_len, max_batch_size=12, exclude_modules=exclude)
    return out


def random_medusa_heads(out: Path, num_heads: int, hidden: int, vocab: int, seed: int = 0) -> Path:
    """Seeded random Medusa heads (1 layer each) written as `build-engine --medusa_model_dir` reads them."""
    from safetensors.torch import save_file

    from nextn.models.medusa import MedusaHeads

    torch.manual_seed(seed)
    heads = MedusaHeads(num_heads, 1, hidden, vocab)
    out.mkdir(parents=True, exist_ok=True)
    save_file({k: v.contiguous() for k, v in heads.state_dict().items()}, str(out / "medusa_lm_head.safetensors"))
    (out / "config.json").write_text(json.dumps({"medusa_num_heads": num_heads, "medusa_num_layers": 1}))
    return out


def format_table(results: Sequence[Result]) -> str:
    """format × drafter rows, one column per scenario: "n/N" ("—" where not run), mismatches marked."""
    rows: dict[tuple[str, str], dict[str, Result]] = {}
    for r in results:
        rows.setdefault((r.format, r.drafter), {})[r.scenario] = r
    lines = [f"{'format':<7} {'drafter':<13}" + "".join(f"{s:>11}" for s in SCENARIOS)]
    for (fmt, drafter), cells in rows.items():
        line = f"{fmt:<7} {drafter:<13}"
        for s in SCENARIOS:
            r = cells.get(s)
            line += f"{'—' if r is None else (f'{r.identical}/{r.total}' + ('' if r.ok else '*')):>11}"
        lines.append(line)
    for r in results:
        if not r.ok:
            lines.append(f"* {r.format} {r.drafter} {r.scenario}: first mismatch {r.first_mismatch}")
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m nextn.testing.batch_invariance", description=__doc__.split("\n")[0])
    parser.add_argument("--model", required=True, help="a GGUF file or HF checkpoint directory")
    parser.add_argument("--formats", nargs="+", default=["fp32", "bf16", "W8A16", "W4A16", "W4A8"],
                        choices=sorted(FORMATS))
    parser.add_argument("--drafters", nargs="+", default=["none", "NGram", "Draft_Target", "Medusa"],
                        choices=DRAFTERS)
    parser.add_argument("--scenarios", nargs="+", default=list(SCENARIOS), choices=SCENARIOS)
    parser.add_argument("--prompts", type=int, default=32)
    parser.add_argument("--max_tokens", type=int, default=128)
    parser.add_argument("--data_dir", type=Path, default=Path("../shared/data"))
    parser.add_argument("--work_dir", type=Path, default=None, help="where engines are built (default: a temp dir)")
    args = parser.parse_args(argv)
    work = args.work_dir or Path(tempfile.mkdtemp(prefix="nextn-inv-"))
    results = run_matrix(args.model, args.formats, args.drafters, args.scenarios, args.prompts, args.max_tokens,
                         args.data_dir, work, log=lambda s: print(s, file=sys.stderr, flush=True))
    print(format_table(results))
    return 0 if all(r.ok for r in results) else 1


def run_matrix(model: str | Path, formats: Sequence[str], drafters: Sequence[str], scenarios: Sequence[str],
               num_prompts: int, max_tokens: int, data_dir: Path, work: Path,
               log: Callable[[str], None] = lambda s: None) -> list[Result]:
    """Build each format of `model` (with Medusa heads when asked), run every drafter × scenario; the results."""

    probe = build_format(model, "fp32", work / "fp32-plain")  # its manifest: the model's sizes; a draft engine
    cfg = json.loads((probe / "manifest.json").read_text())["model"]
    heads = random_medusa_heads(work / "heads", 3, cfg["hidden_size"], cfg["vocab_size"]) if "Medusa" in drafters else None
    engines = {fmt: build_format(model, fmt, work / fmt, heads, cfg) for fmt in formats}
    log(f"built {', '.join(formats)}")
    first = _llm(engines[formats[0]], None)
    prompts = text_prompts(first.tokenizer.encode, num_prompts, data_dir)
    first.shutdown()
    results: list[Result] = []
    for fmt in formats:
        ref = Reference(engines[fmt], prompts, max_tokens)
        for drafter in drafters:
            draft = probe if fmt != "fp32" else build_format(model, "bf16", work / "bf16-plain")
            cell = run_cell(engines[fmt], fmt, drafter, speculative_config(drafter, draft), prompts, ref,
                            max_tokens, scenarios)
            results += cell
            log(format_table(cell))
    return results


if __name__ == "__main__":
    raise SystemExit(main())
