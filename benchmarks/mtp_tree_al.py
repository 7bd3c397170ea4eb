"""MTP chain vs MTP trees at the same number of verified tokens per step: greedy acceptance length.

AL does not depend on the machine or its load (only on the model, the heads and the prompts), so it is measured
here on trained heads of `nextn train-draft` (their held-out prompts, recorded in train_draft.json) with the public
`LLM` API: plain decoding once, then each speculative config; every output is checked token-identical to plain.
AL = Σ emitted tokens / Σ (decode steps + 1) (trtllm-bench's global AL, trtllm-bench docs). Heads whose
train_draft.json has `rank_acceptance` also run `static-cal-N`, the tree built from it (`train/tree_calibration.py`);
the prompts exclude the top-1 meter's, on which that acceptance was measured.

    python -m benchmarks.mtp_tree_al --heads runs/issue16/smol/mtp-eagle-1k --source mt_bench --num_prompts 16

`--speed R`: also batch-1 decode tokens/s (prompts one after another, EOS ignored; tokens after the first over
first-token → finish time), plain decoding and each config alternating, best of R passes after a warm-up — on a
faster engine of the same heads with `--engine` (e.g. `build-engine --model_dir HEADS --quant_algo W4A16`);
`--speed_batch B` measures total throughput at B requests at once instead; `--compare_policies` runs each config
under its draft-length schedule, the schedule with `adaptive_draft_len`, and `adaptive_draft_len` alone, beside a
second plain engine whose ratio to the first is the run's noise.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

from nextn.bench.outputs import check_report, write_report
from nextn.train.session import read_train_record

MTP = {"decoding_type": "MTP"}


def _tree(nodes: int, depth: int, topk: int) -> list[list[int]]:
    """A static tree of `nodes` rank paths, best-first by the product of assumed per-rank acceptance
    (0.5, 0.2, 0.1, 0.05, ... for ranks 0, 1, 2, 3 at every depth): Medusa's greedy tree construction with a prior
    (`draft_gain.prior_tree`)."""
    from nextn.speculative.draft_gain import prior_tree

    return prior_tree(depth, nodes, topk)


def configs(budgets: list[int], depth: int, acceptance: list[list[float]] | None = None) -> dict[str, dict]:
    """Per budget N (verified tokens with the root): the chain of N − 1 drafts, a static tree and a dynamic tree
    of N − 1 nodes at depth ≤ `depth`; with `acceptance` (the heads' measured per-rank acceptance, train_draft.json)
    also the static tree built from it (`static-cal-N`)."""
    from nextn.speculative.draft_gain import best_first_tree

    out = {}
    for n in budgets:
        out[f"chain-{n}"] = {**MTP, "num_nextn_predict_layers": n - 1}
        if n > 2:
            out[f"static-{n}"] = {**MTP, "num_nextn_predict_layers": depth, "eagle_choices": _tree(n - 1, depth, 4)}
            if acceptance is not None:  # as deep as the heads' calibration went (the module applied again)
                tree = best_first_tree(acceptance, n - 1)
                out[f"static-cal-{n}"] = {**MTP, "num_nextn_predict_layers": max(map(len, tree)),
                                          "eagle_choices": tree}
            for k in (2, 4):
                if k + (depth - 1) * k * k >= n - 1 and depth + (depth - 1) * k <= 2 * (n - 1):
                    out[f"dynamic-top{k}-{n}"] = {**MTP, "num_nextn_predict_layers": depth, "use_dynamic_tree": True,
                                                  "dynamic_tree_max_topK": k, "max_total_draft_tokens": n - 1}
    return out


def held_out_prompts(meta: dict, source: str, n: int) -> tuple[list[str], list[list[int]]]:
    """(ids, rendered token ids) of the first `n` held-out prompts of `source` ("humaneval", "mt_bench") in a
    train-draft run's record `meta` (its train_draft.json): never trained on, and not the top-1 meter's prompts
    either (the calibrated tree was chosen on those)."""
    by_id = dict(zip(meta["eval_prompt_ids"], meta["held_out_prompts"]))
    meter = set(meta["eval_prompt_ids"][: meta["data_config"]["num_top1_prompts"]])
    ids = [i for i in meta["eval_prompt_ids"] if i.startswith(f"{source}/") and i not in meter][:n]
    return ids, [by_id[i] for i in ids]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--heads", type=Path, required=True, help="a train-draft MTP output directory")
    p.add_argument("--engine", type=Path, help="default: HEADS/engine-float32")
    p.add_argument("--source", default="mt_bench")
    p.add_argument("--num_prompts", type=int, default=16)
    p.add_argument("--max_tokens", type=int, default=96)
    p.add_argument("--budgets", type=int, nargs="+", default=[4, 8, 16])
    p.add_argument("--depth", type=int, default=3, help="the trees' depth (num_nextn_predict_layers)")
    p.add_argument("--only", nargs="*", help="run only these config names")
    p.add_argument("--draft_vocab_size", type=int,
                   help="also run each config with the module's head cut to this many hot tokens")
    p.add_argument("--draft_token_map", type=Path, help="the hot tokens' ranking (`nextn token-map`)")
    p.add_argument("--speed", type=int, default=0, metavar="R",
                   help="also measure batch-1 tokens/s, best of R passes (default 0: AL only)")
    p.add_argument("--speed_batch", type=int, default=1, metavar="B",
                   help="with --speed: requests decoded at once (default 1: tokens/s per request; B > 1: total "
                   "throughput of in-flight batching at max_batch_size B)")
    p.add_argument("--draft_len_schedule", type=json.loads, metavar="JSON",
                   help="added to every speculative config (capped at its draft nodes), e.g. "
                   "'{\"1\": 15, \"2\": 7, \"4\": 3}' (configs/mtp_tree.yaml's: batch size → verified draft "
                   "nodes; above the largest size speculation is off)")
    p.add_argument("--adaptive_draft_len", action="store_true",
                   help="every speculative config with adaptive_draft_len: true (nodes per step from measured step "
                   "times and acceptance; 0 = plain decoding when none pays)")
    p.add_argument("--compare_policies", action="store_true",
                   help="each config three times: with --draft_len_schedule, with it and adaptive_draft_len, with "
                   "adaptive_draft_len alone; --speed also times a second plain engine (the run's noise)")
    p.add_argument("--out", type=Path,
                   help="write the results here, after each config (an existing file only when a run of this "
                   "benchmark wrote it)")
    args = p.parse_args(argv)
    check_report(p, args.out, "mtp_tree_al", "--out")
    if args.compare_policies and not args.draft_len_schedule:
        p.error("--compare_policies needs --draft_len_schedule")
    meta = read_train_record(p, args.heads)
    from nextn import LLM, SamplingParams

    args.acceptance = meta.get("rank_acceptance")
    ids, prompts = held_out_prompts(meta, args.source, args.num_prompts)
    engine = args.engine or args.heads / "engine-float32"
    sp = SamplingParams(max_tokens=args.max_tokens, ignore_eos=not meta["chat"])
    plain = [o.outputs[0].token_ids for o in LLM(engine, speculative_config=None).generate(prompts, sp)]
    results = {"heads": str(args.heads), "engine": str(engine), "prompt_ids": ids, "max_tokens": args.max_tokens,
               "runs": {}}
    for name, spec in _all_configs(args).items():
        if args.only and name.split(" ")[0] not in args.only:
            continue
        start = time.perf_counter()
        outs = [o.outputs[0] for o in LLM(engine, speculative_config=spec).generate(prompts, sp)]
        tokens, steps = sum(len(o.token_ids) for o in outs), sum(o.num_decode_steps for o in outs)
        run = {"acceptance_length": tokens / (steps + len(outs)), "tokens": tokens, "decode_steps": steps,
               "identical_to_plain": sum(o.token_ids == q for o, q in zip(outs, plain)), "num_prompts": len(outs),
               "seconds": time.perf_counter() - start, "speculative_config": spec}
        results["runs"][name] = run
        print(f"{name:18s} AL {run['acceptance_length']:.3f}  identical {run['identical_to_plain']}/{len(outs)}",
              flush=True)
        if args.out:
            write_report(args.out, "mtp_tree_al", results, "--out")
    if args.speed:
        results["speed"] = _speed(engine, prompts, args, [n for n in results["runs"]])
        if args.out:
            write_report(args.out, "mtp_tree_al", results, "--out")
    return 0


def _all_configs(args) -> dict[str, dict]:
    """`configs`, each also with the head cut (name + " cut") when --draft_vocab_size is given."""
    out = {}
    for name, spec in configs(args.budgets, args.depth, getattr(args, "acceptance", None)).items():
        schedule = None
        if getattr(args, "draft_len_schedule", None):  # capped at each config's own draft nodes
            most = len(spec.get("eagle_choices") or []) or spec.get("max_total_draft_tokens") or \
                spec["num_nextn_predict_layers"]
            schedule = {int(k): min(v, most) for k, v in args.draft_len_schedule.items()}
        variants = {name: {**spec, **({"draft_len_schedule": schedule} if schedule else {}),
                           **({"adaptive_draft_len": True} if getattr(args, "adaptive_draft_len", False) else {})}}
        if getattr(args, "compare_policies", False):
            variants = {f"{name} schedule": {**spec, "draft_len_schedule": schedule},
                        f"{name} schedule+adaptive": {**spec, "draft_len_schedule": schedule,
                                                      "adaptive_draft_len": True},
                        f"{name} adaptive": {**spec, "adaptive_draft_len": True}}
        for label, variant in variants.items():
            out[label] = variant
            if args.draft_vocab_size:
                out[f"{label} cut"] = {**variant, "draft_vocab_size": args.draft_vocab_size,
                                       **({"draft_token_map": str(args.draft_token_map)} if args.draft_token_map
                                          else {})}
    return out


def _speed(engine: Path, prompts: list[list[int]], args, names: list[str]) -> dict[str, dict]:
    """Batch-1 tokens/s of plain decoding and each named config, alternating, best of `args.speed` passes."""
    from nextn import LLM
    from benchmarks.decode_pass import run_nextn

    control = {"plain (a second engine: the noise)": None} if getattr(args, "compare_policies", False) else {}
    specs = {"plain": None, **control, **{n: s for n, s in _all_configs(args).items() if n in names}}
    b = args.speed_batch
    llms = {n: LLM(engine, speculative_config=s, max_batch_size=b) for n, s in specs.items()}
    for llm in llms.values():  # warm-up
        run_nextn(llm, prompts[:b], 8, b)
    best: dict[str, dict] = {}
    for _ in range(args.speed):
        for name, llm in llms.items():
            r = run_nextn(llm, prompts, args.max_tokens, b)
            if name not in best or r["tps"] > best[name]["tps"]:
                best[name] = r
    plain = best["plain"]
    print(f"| batch {b}, {len(prompts)} prompts × {args.max_tokens} tokens | tokens/s | AL | vs plain | identical |")
    print("|---|---:|---:|---:|---|")
    for name, r in best.items():
        same = "yes" if r["tokens"] == plain["tokens"] else "NO"
        print(f"| {name} | {r['tps']:.2f} | {r['al']:.2f} | {r['tps'] / plain['tps']:.2f}× | {same} |", flush=True)
    return {n: {k: v for k, v in r.items() if k != "tokens"} for n, r in best.items()}


if __name__ == "__main__":
    raise SystemExit(main())
