"""The main job on an embedded default: make a tiny DeepSeek-V3 checkpoint with MTP weights (HF `save_pretrained`
plus DeepSeek's MTP layout, MTP modules self-distilled on the model's own greedy outputs), build it into an engine,
decode MT-bench prompts with MTP (K draft tokens per step) and without, and report acceptance length, tokens/s and
whether the outputs are identical."""

from __future__ import annotations

import argparse
import shutil
import tempfile
import time
from pathlib import Path

from nextn.cli.prompts import load_prompts


def add_checkpoint_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--num_mtp_modules", type=int, default=1, help="MTP modules in the checkpoint (1: Eagle; K: Vanilla)")
    p.add_argument("--distill_steps", type=int, default=300,
                   help="self-distillation steps for the MTP modules (0: leave them random; default 300)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--fp8", action="store_true", help="write FP8 e4m3 weights with 128x128 block scales")


def make_checkpoint(out: Path, num_mtp_modules: int, distill_steps: int, seed: int, fp8: bool = False,
                    prompts: list[str] | None = None) -> dict | None:
    """Write the tiny checkpoint to `out` and distill its MTP modules; returns the distillation metrics."""
    from nextn.testing import TinyDeepseekSpec, distill_mtp, make_tiny_checkpoint

    make_tiny_checkpoint(out, TinyDeepseekSpec(num_mtp_modules=num_mtp_modules, seed=seed, fp8=fp8))
    if distill_steps <= 0 or num_mtp_modules == 0:
        return None
    return distill_mtp(out, steps=distill_steps, seed=seed, prompts=prompts)


def make_checkpoint_cmd(args: argparse.Namespace) -> int:
    out = Path(args.output_dir)
    if out.exists() and any(out.iterdir()):
        print(f"nextn make-checkpoint: error: {out} exists and is not empty; choose another --output_dir")
        return 2
    prompts, _ = load_prompts(32)
    metrics = make_checkpoint(out, args.num_mtp_modules, args.distill_steps, args.seed, args.fp8, prompts)
    print(f"wrote {out}" + (f"; MTP top-1 (held out) {metrics['top1_before']} -> {metrics['top1_after']}" if metrics else ""))
    return 0


def add_arguments(p: argparse.ArgumentParser) -> None:
    add_checkpoint_arguments(p)
    p.add_argument("--work_dir", help="where the checkpoint and engine go (default: a temporary directory)")
    p.add_argument("--num_prompts", type=int, default=4, help="MT-bench prompts to decode (default 4)")
    p.add_argument("--max_tokens", type=int, default=64, help="tokens per prompt (default 64)")
    p.add_argument("-k", "--num_draft_tokens", type=int, default=3, help="MTP draft tokens per step, K (default 3)")


def _decode(engine: Path, prompts: list[str], max_tokens: int, spec: dict | None) -> tuple[list, float]:
    from nextn import LLM, SamplingParams

    llm = LLM(engine, speculative_config=spec)
    params = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
    llm.generate(prompts[:1], SamplingParams(max_tokens=4))  # warm-up
    t0 = time.perf_counter()
    outs = llm.generate(prompts, params)
    return outs, time.perf_counter() - t0


def run(args: argparse.Namespace) -> int:
    from nextn.build.engine_builder import build_engine

    tmp = None if args.work_dir else tempfile.mkdtemp(prefix="nextn-demo-")
    work = Path(args.work_dir or tmp)
    try:
        ckpt, engine = work / "checkpoint", work / "engine"
        prompts, source = load_prompts(args.num_prompts)
        if ckpt.exists():
            shutil.rmtree(ckpt)
        print(f"1/3 checkpoint: tiny DeepSeek-V3 (MLA + MoE, {args.num_mtp_modules} MTP module(s)) -> {ckpt}")
        metrics = make_checkpoint(ckpt, args.num_mtp_modules, args.distill_steps, args.seed, args.fp8, prompts)
        if metrics:
            print(f"    MTP self-distillation: top-1 on held-out target outputs {metrics['top1_before']} -> "
                  f"{[round(a, 3) for a in metrics['top1_after']]} in {metrics['seconds']:.0f}s")
        print(f"2/3 build-engine -> {engine}")
        build_engine(ckpt, engine, max_seq_len=1024, progress=False)
        print(f"3/3 decode {len(prompts)} prompts ({source}), {args.max_tokens} tokens each, greedy")
        plain, t_plain = _decode(engine, prompts, args.max_tokens, None)
        spec = {"decoding_type": "MTP", "num_nextn_predict_layers": args.num_draft_tokens}
        mtp, t_mtp = _decode(engine, prompts, args.max_tokens, spec)
        n_plain = sum(len(o.outputs[0].token_ids) for o in plain)
        n_mtp = sum(len(o.outputs[0].token_ids) for o in mtp)
        same = all(a.outputs[0].token_ids == b.outputs[0].token_ids for a, b in zip(plain, mtp))
        steps = sum(o.outputs[0].num_decode_steps + 1 for o in mtp)
        print(f"    first completion: {mtp[0].outputs[0].text[:100]!r}")
        print(f"{'':24}{'tokens':>8}{'seconds':>9}{'tokens/s':>10}{'AL':>7}")
        print(f"{'no MTP':24}{n_plain:>8}{t_plain:>9.2f}{n_plain / t_plain:>10.1f}{1.0:>7.2f}")
        print(f"{f'MTP K={args.num_draft_tokens}':24}{n_mtp:>8}{t_mtp:>9.2f}{n_mtp / t_mtp:>10.1f}{n_mtp / steps:>7.2f}")
        print(f"outputs identical to plain decoding: {'yes' if same else 'NO'}")
        if n_mtp / t_mtp < n_plain / t_plain:
            print("note: on this tiny model the 129k-vocabulary lm_head is most of the work, so verifying K+1 rows per "
                  "request costs nearly K+1 plain steps at batch > 1; see docs/PERFORMANCE.md for batch-1 figures")
        return 0 if same else 1
    finally:
        if tmp:
            shutil.rmtree(tmp, ignore_errors=True)
