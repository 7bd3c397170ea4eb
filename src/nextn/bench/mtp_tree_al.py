"""MTP chain vs MTP trees at the same number of verified tokens per step: greedy acceptance length (issue 18).

AL does not depend on the machine or its load (only on the model, the heads and the prompts), so it is measured
here on trained heads of `nextn train-draft` (their held-out prompts, recorded in train_draft.json) with the public
`LLM` API: plain decoding once, then each speculative config; every output is checked token-identical to plain.
AL = Σ emitted tokens / Σ (decode steps + 1) (trtllm-bench's global AL, REFERENCE.md §7).

    python -m nextn.bench.mtp_tree_al --heads runs/issue16/smol/mtp-eagle-1k --source mt_bench --num_prompts 16
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

MTP = {"decoding_type": "MTP"}


def _tree(nodes: int, depth: int, topk: int) -> list[list[int]]:
    """A static tree of `nodes` rank paths, best-first by the product of assumed per-rank acceptance
    (0.5, 0.2, 0.1, 0.05, ... for ranks 0, 1, 2, 3 at every depth): Medusa's greedy tree construction with a prior."""
    prior = [0.5, 0.2, 0.1, 0.05, 0.03, 0.02][:topk]
    frontier, chosen = [((0,), prior[0])], []
    while len(chosen) < nodes:
        frontier.sort(key=lambda x: -x[1])
        path, score = frontier.pop(0)
        chosen.append(list(path))
        if path[-1] + 1 < len(prior):  # the next sibling
            frontier.append((path[:-1] + (path[-1] + 1,), score / prior[path[-1]] * prior[path[-1] + 1]))
        if len(path) < depth:  # the first child
            frontier.append((path + (0,), score * prior[0]))
    return chosen


def configs(budgets: list[int], depth: int) -> dict[str, dict]:
    """Per budget N (verified tokens with the root): the chain of N − 1 drafts, a static tree and a dynamic tree
    of N − 1 nodes at depth ≤ `depth`."""
    out = {}
    for n in budgets:
        out[f"chain-{n}"] = {**MTP, "num_nextn_predict_layers": n - 1}
        if n > 2:
            out[f"static-{n}"] = {**MTP, "num_nextn_predict_layers": depth, "eagle_choices": _tree(n - 1, depth, 4)}
            for k in (2, 4):
                if k + (depth - 1) * k * k >= n - 1 and depth + (depth - 1) * k <= 2 * (n - 1):
                    out[f"dynamic-top{k}-{n}"] = {**MTP, "num_nextn_predict_layers": depth, "use_dynamic_tree": True,
                                                  "dynamic_tree_max_topK": k, "max_total_draft_tokens": n - 1}
    return out


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
    p.add_argument("--out", type=Path)
    args = p.parse_args(argv)
    from nextn import LLM, SamplingParams

    meta = json.loads((args.heads / "train_draft.json").read_text())
    by_id = dict(zip(meta["eval_prompt_ids"], meta["held_out_prompts"]))
    ids = [i for i in meta["eval_prompt_ids"] if i.startswith(f"{args.source}/")][: args.num_prompts]
    prompts = [by_id[i] for i in ids]
    engine = args.engine or args.heads / "engine-float32"
    sp = SamplingParams(max_tokens=args.max_tokens, ignore_eos=not meta["chat"])
    plain = [o.outputs[0].token_ids for o in LLM(engine, speculative_config=None).generate(prompts, sp)]
    results = {"heads": str(args.heads), "engine": str(engine), "prompt_ids": ids, "max_tokens": args.max_tokens,
               "runs": {}}
    for name, spec in configs(args.budgets, args.depth).items():
        if args.only and name not in args.only:
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
            args.out.parent.mkdir(parents=True, exist_ok=True)
            args.out.write_text(json.dumps(results, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
