"""Tokens/s of nextn (plain decoding and MTP with K draft tokens) against Hugging Face `transformers` `generate` on
the same checkpoint and prompts, greedy, batch 1 (each prompt alone) and nextn batched. A benchmark, not a test:
record its figures with the command line in docs/PERFORMANCE.md."""

from __future__ import annotations

import argparse
import platform
import shutil
import tempfile
import time
from pathlib import Path

from nextn.cli.prompts import load_prompts


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model_dir", help="HF checkpoint (default: make the demo's tiny checkpoint)")
    p.add_argument("--engine_dir", help="its engine (default: build one from --model_dir)")
    p.add_argument("--num_prompts", type=int, default=8)
    p.add_argument("--max_tokens", type=int, default=128)
    p.add_argument("-k", "--num_draft_tokens", type=int, default=3)
    p.add_argument("--batch_size", type=int, default=8, help="batch size of the batched nextn rows")
    p.add_argument("--skip_transformers", action="store_true")


def _timed(fn) -> tuple[object, float]:
    t0 = time.perf_counter()
    out = fn()
    return out, time.perf_counter() - t0


def _nextn_rows(engine: Path, prompts: list[str], max_tokens: int, k: int, batch: int) -> list[tuple[str, int, float, float]]:
    from nextn import LLM, SamplingParams

    rows = []
    params = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
    for name, spec in (("nextn, no MTP", None), (f"nextn, MTP K={k}", {"decoding_type": "MTP", "num_nextn_predict_layers": k})):
        llm = LLM(engine, speculative_config=spec, max_batch_size=batch)
        llm.generate(prompts[:1], SamplingParams(max_tokens=8))  # warm-up
        outs, dt = _timed(lambda: [llm.generate(p, params) for p in prompts])
        n = sum(len(o.outputs[0].token_ids) for o in outs)
        al = n / sum(o.outputs[0].num_decode_steps + 1 for o in outs)
        rows.append((f"{name} (batch 1)", n, dt, al))
        outs, dt = _timed(lambda: llm.generate(prompts, params))
        n = sum(len(o.outputs[0].token_ids) for o in outs)
        al = n / sum(o.outputs[0].num_decode_steps + 1 for o in outs)
        rows.append((f"{name} (batch {min(batch, len(prompts))})", n, dt, al))
    return rows


def _transformers_row(model_dir: Path, prompts: list[str], max_tokens: int) -> tuple[str, int, float, float]:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_dir, trust_remote_code=False)
    model = AutoModelForCausalLM.from_pretrained(model_dir, trust_remote_code=False).eval()
    ids = [tok(p, return_tensors="pt").input_ids for p in prompts]
    kw = dict(max_new_tokens=max_tokens, min_new_tokens=max_tokens, do_sample=False, pad_token_id=tok.eos_token_id)
    with torch.inference_mode():
        model.generate(ids[0], max_new_tokens=8, do_sample=False, pad_token_id=tok.eos_token_id)  # warm-up
        outs, dt = _timed(lambda: [model.generate(x, **kw) for x in ids])
    n = sum(o.shape[1] - x.shape[1] for o, x in zip(outs, ids))
    return ("transformers generate (batch 1)", n, dt, 1.0)


def run(args: argparse.Namespace) -> int:
    import torch

    from nextn.build.engine_builder import build_engine
    from nextn.cli.demo import make_checkpoint

    tmp = tempfile.mkdtemp(prefix="nextn-bench-")
    try:
        prompts, source = load_prompts(args.num_prompts)
        model_dir = Path(args.model_dir) if args.model_dir else Path(tmp) / "checkpoint"
        if not args.model_dir:
            print(f"making the demo checkpoint in {model_dir} ...")
            make_checkpoint(model_dir, 1, 300, 0, prompts=prompts)
        engine = Path(args.engine_dir) if args.engine_dir else Path(tmp) / "engine"
        if not args.engine_dir:
            build_engine(model_dir, engine, max_seq_len=1024, max_batch_size=args.batch_size, progress=False)
        print(f"prompts: {len(prompts)} from {source}; {args.max_tokens} new tokens each, greedy; "
              f"torch {torch.__version__}, {torch.get_num_threads()} threads, {platform.processor() or platform.machine()}")
        rows = _nextn_rows(engine, prompts, args.max_tokens, args.num_draft_tokens, args.batch_size)
        if not args.skip_transformers:
            rows.append(_transformers_row(model_dir, prompts, args.max_tokens))
        print(f"{'':34}{'tokens':>8}{'seconds':>9}{'tokens/s':>10}{'AL':>7}")
        for name, n, dt, al in rows:
            print(f"{name:34}{n:>8}{dt:>9.2f}{n / dt:>10.1f}{al:>7.2f}")
        return 0
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
