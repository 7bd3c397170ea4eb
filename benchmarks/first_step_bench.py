"""First-step acceptance of disaggregated prefill/decode, per `first_mtp_step` mode (docs/PERFORMANCE.md).

    python -m benchmarks.first_step_bench ENGINE [--num_prompts 32] [--k 2] [--max_tokens 8]

For each mode ("drafts", "hidden_state", "zero_hidden") it runs the same seeded random prompts through a
`DisaggregatedLLM` and prints the mean drafts accepted in the first decode step (out of K), the mean over all
steps (AL − 1), and whether every output equals the single engine's.
"""

from __future__ import annotations

import argparse
import random
import time

from nextn.distributed.disaggregated import DisaggregatedLLM
from nextn.runtime.llm import LLM
from nextn.runtime.sampling_params import SamplingParams

MODES = ("drafts", "hidden_state", "zero_hidden")


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("engine")
    ap.add_argument("--num_prompts", type=int, default=32)
    ap.add_argument("--k", type=int, default=2, help="num_nextn_predict_layers (MTP Eagle drafts per step)")
    ap.add_argument("--max_tokens", type=int, default=8)
    ap.add_argument("--vocab", type=int, default=500, help="prompt token ids are drawn below this")
    a = ap.parse_args(argv)
    rng = random.Random(0)
    prompts = [[rng.randrange(3, a.vocab) for _ in range(rng.randrange(2, 40))] for _ in range(a.num_prompts)]
    sp = SamplingParams(max_tokens=a.max_tokens, ignore_eos=True)
    mtp = {"decoding_type": "MTP", "num_nextn_predict_layers": a.k}
    ref = [o.outputs[0].token_ids for o in LLM(a.engine, speculative_config=mtp).generate(prompts, sp)]
    print(f"| first_mtp_step | first-step accepted (of {a.k}) | accepted per step, all steps | identical | s |")
    print("|---|---|---|---|---|")
    for mode in MODES:
        t0 = time.perf_counter()
        llm = DisaggregatedLLM(a.engine, {"first_mtp_step": mode}, speculative_config=mtp)
        try:
            outs, first = llm.generate(prompts, sp)
        finally:
            llm.close()
        steps = sum(sum(o.outputs[0].steps_per_draft_len.values()) for o in outs)
        accepted = sum(o.outputs[0].num_accepted_draft_tokens for o in outs)
        same = [o.outputs[0].token_ids for o in outs] == ref
        print(f"| {mode} | {sum(first) / len(first):.3f} | {accepted / max(steps, 1):.3f} | {same} "
              f"| {time.perf_counter() - t0:.1f} |")


if __name__ == "__main__":
    main()
