"""The overlap scheduler against the synchronous one (`disable_overlap_scheduler`), end to end through `LLM`, on a
random-weight Llama at a real model's shape (no download, no tokenizer: token-id prompts), with CUDA graphs on CUDA.

    python -m benchmarks.overlap --device cuda --shapes smollm2-135m qwen2.5-0.5b --batch_sizes 1 8 32 --json $OUT/o.json

Each batch size runs overlap, sync, overlap, sync (each its own `LLM`, a warm-up, then the best of `--repeats`),
and reports output tokens/s of each and their ratio; the greedy tokens of every pass are compared with the first's.
Random weights make the step's cost real and its tokens meaningless: this times the scheduler, not a model.
"""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path

from benchmarks.decode_pass import best_of
from nextn.bench.outputs import check_report, write_report

# transformers `LlamaConfig` fields of each shape (tied embeddings; the published models' sizes).
SHAPES = {
    "tiny": dict(hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, vocab_size=512),
    "smollm2-135m": dict(hidden_size=576, intermediate_size=1536, num_hidden_layers=30, num_attention_heads=9,
                         num_key_value_heads=3, vocab_size=49152),
    "qwen2.5-0.5b": dict(hidden_size=896, intermediate_size=4864, num_hidden_layers=24, num_attention_heads=14,
                         num_key_value_heads=2, vocab_size=151936),
}
PROMPT_LEN = 64


def random_checkpoint(shape: str, out: Path, seed: int = 0) -> Path:
    """Save a seeded bf16 `LlamaForCausalLM` of `SHAPES[shape]` to `out` (safetensors + config.json); returns `out`."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    cfg = LlamaConfig(max_position_embeddings=2048, tie_word_embeddings=True, **SHAPES[shape])
    LlamaForCausalLM(cfg).to(torch.bfloat16).save_pretrained(out)
    return out


def run(args: argparse.Namespace, workdir: Path) -> dict:
    import torch

    from nextn.runtime.llm import LLM
    from nextn.runtime.sampling_params import SamplingParams

    params = SamplingParams(max_tokens=args.max_tokens, temperature=0.0, ignore_eos=True)
    warm = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    graphs = {"cuda_graph_config": {}} if args.device == "cuda" else {}
    results = {}
    for shape in args.shapes:
        ckpt = random_checkpoint(shape, workdir / shape)
        gen = torch.Generator().manual_seed(1)
        vocab = SHAPES[shape]["vocab_size"]
        for batch in args.batch_sizes:
            prompts = [torch.randint(4, vocab, (PROMPT_LEN,), generator=gen).tolist() for _ in range(batch)]
            passes, reference = [], None
            for overlap in (True, False) * args.rounds:
                llm = LLM(str(ckpt), device=args.device, max_batch_size=batch, disable_overlap_scheduler=not overlap,
                          engine_cache_dir=str(workdir / "engines"), **graphs)
                llm.generate(prompts[:2], warm)
                best, tokens = best_of(llm, prompts, params, args.repeats)
                reference = reference or tokens
                passes.append({"overlap": overlap, "tokens_per_s": sum(map(len, tokens)) / best,
                               "identical": sum(a == b for a, b in zip(tokens, reference))})
                del llm
            on = max(p["tokens_per_s"] for p in passes if p["overlap"])
            off = max(p["tokens_per_s"] for p in passes if not p["overlap"])
            same = min(p["identical"] for p in passes)
            results[f"{shape}_b{batch}"] = {"overlap_tokens_per_s": on, "sync_tokens_per_s": off,
                                            "speed_up": on / off, "identical": same, "requests": batch,
                                            "passes": passes}
            print(f"{shape:<13} batch {batch:>3}: overlap {on:>8.0f} tok/s   sync {off:>8.0f} tok/s   "
                  f"overlap / sync {on / off:.2f}x   identical {same}/{batch}", flush=True)
    return {"config": vars(args), "results": results}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.overlap", description=__doc__.split("\n\n")[0])
    p.add_argument("--device", default="cuda", help="torch device (default cuda)")
    p.add_argument("--shapes", nargs="+", default=["smollm2-135m"], choices=sorted(SHAPES),
                   help="model shapes with random weights (default smollm2-135m)")
    p.add_argument("--batch_sizes", nargs="+", type=int, default=[1, 8, 32], help="requests generated together")
    p.add_argument("--max_tokens", type=int, default=128, help="new tokens per request, EOS ignored (default 128)")
    p.add_argument("--repeats", type=int, default=4, help="timed runs per pass, best kept (default 4)")
    p.add_argument("--rounds", type=int, default=2, help="overlap/sync pass pairs, alternating (default 2)")
    p.add_argument("--json", default=None, help="also write the results here (an existing file only when a run of "
                                                "this benchmark wrote it)")
    args = p.parse_args(argv)
    if min(args.batch_sizes) < 1 or max(args.batch_sizes) > 256:
        p.error("--batch_sizes must lie in 1..256")
    if not (1 <= args.max_tokens <= 4096 and 1 <= args.repeats <= 50 and 1 <= args.rounds <= 10):
        p.error("--max_tokens must lie in 1..4096, --repeats in 1..50, --rounds in 1..10")
    check_report(p, args.json, "overlap")
    with tempfile.TemporaryDirectory(prefix="nextn-overlap-") as tmp:
        result = run(args, Path(tmp))
    if args.json:
        write_report(args.json, "overlap", result)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
