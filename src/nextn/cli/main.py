"""`nextn`: the runtime's command line (generate, demo, bench, make-checkpoint, train-draft, token-map, triton-repo,
serve)."""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys

from nextn.build.checkpoint import CheckpointError
from nextn.build.manifest import EngineError
from nextn.config.llm_args import LlmArgsError
from nextn.models.config import ConfigError
from nextn.models.deepseek_v3.weights import WeightError
from nextn.quantization.weight_only import QUANT_ALGOS
from nextn.runtime.sampling_params import SamplingParamsError
from nextn.runtime.tokenizer import ChatTemplateError

USER_ERRORS = (EngineError, LlmArgsError, SamplingParamsError, CheckpointError, ConfigError, WeightError,
               ChatTemplateError)


def _add_generate(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("generate", help="decode prompts with an engine and print completions and acceptance length",
                       description="Decode prompts greedily with an engine; print each completion and its acceptance "
                                   "length (emitted tokens per verify-and-draft step, prefill counted as one).")
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--engine_dir", help="engine directory written by build-engine")
    src.add_argument("--model", help="a checkpoint (a .gguf file or an HF directory) or an engine: a checkpoint is "
                                     "built once into nextn's engine cache and reused (as LLM(path))")
    p.add_argument("--dtype", default="auto", choices=("auto", "bfloat16", "float32"),
                   help="engine dtype when --model is a checkpoint (default auto: bfloat16 where this CPU has fast "
                        "bf16, else the checkpoint's)")
    p.add_argument("--quant_algo", choices=("auto", "none", *QUANT_ALGOS), default="auto",
                   help="quantization when --model is a checkpoint, as build-engine's (default auto: W4A16 for a "
                        "mostly 4-bit GGUF on a CPU with nextn's int4 kernels, else none)")
    p.add_argument("--prompt", action="append", required=True,
                   help="a prompt (repeatable); with --token_ids, comma-separated token ids")
    p.add_argument("--token_ids", action="store_true", help="read each --prompt as comma-separated token ids")
    p.add_argument("--chat", action="store_true",
                   help="send each --prompt as one user message through the model's chat template (stored in the "
                        "engine), as /v1/chat/completions does")
    p.add_argument("--max_tokens", type=int, default=64, help="tokens to generate per prompt (default 64)")
    p.add_argument("--extra_llm_api_options", "--config", dest="extra_llm_api_options",
                   help="YAML of LLM arguments (TensorRT-LLM names), e.g. speculative_config")
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default); > 0 samples")
    p.add_argument("--top_k", type=int, default=0, help="keep the k most likely tokens (0 = off)")
    p.add_argument("--top_p", type=float, default=1.0, help="nucleus sampling mass (1.0 = off)")
    p.add_argument("--seed", type=int, help="sampling seed (same seed, same output)")
    p.add_argument("--ignore_eos", action="store_true", help="do not stop at EOS")
    p.add_argument("--json", action="store_true", help="print one JSON object per prompt")
    p.set_defaults(func=_generate)


def _generate(args: argparse.Namespace) -> int:
    from nextn import LLM, SamplingParams
    from nextn.cli.env_options import env_llm_overrides

    if args.chat and args.token_ids:
        print("nextn generate: error: --chat renders text prompts; it cannot take --token_ids", file=sys.stderr)
        return 2
    prompts = [[int(t) for t in p.split(",") if t.strip()] for p in args.prompt] if args.token_ids else args.prompt
    llm = LLM(args.engine_dir or args.model, extra_llm_api_options=args.extra_llm_api_options, dtype=args.dtype,
              quant_config={"quant_algo": None if args.quant_algo == "none" else args.quant_algo},
              engine_cache_dir=os.environ.get("NEXTN_CACHE_DIR"), **env_llm_overrides())
    if args.chat:
        if llm.tokenizer is None:
            print("nextn generate: error: --chat needs a tokenizer and this engine has none", file=sys.stderr)
            return 2
        prompts = [llm.tokenizer.apply_chat_template([{"role": "user", "content": p}]) for p in args.prompt]
    params = SamplingParams(max_tokens=args.max_tokens, ignore_eos=args.ignore_eos, temperature=args.temperature,
                            top_k=args.top_k, top_p=args.top_p, seed=args.seed)
    outputs = llm.generate(prompts, params)
    failed = 0
    for i, out in enumerate(outputs):
        c = out.outputs[0]
        if c.finish_reason == "error":
            failed += 1
            print(f"nextn generate: error: prompt {i}: {c.error}", file=sys.stderr)
            continue
        if args.json:
            prompt = args.prompt[i] if args.chat else out.prompt  # the user's text, not the rendered ids
            print(json.dumps({"prompt": prompt, "token_ids": c.token_ids, "text": c.text,
                              "finish_reason": c.finish_reason, "acceptance_length": round(c.acceptance_length, 4),
                              "num_draft_tokens": c.num_draft_tokens,
                              "num_accepted_draft_tokens": c.num_accepted_draft_tokens,
                              "accepted_per_position": c.accepted_per_position}))
        else:
            shown = c.text if c.text else " ".join(map(str, c.token_ids))
            print(f"[{i}] {shown}\n    ({len(c.token_ids)} tokens, finish_reason={c.finish_reason}, "
                  f"acceptance length {c.acceptance_length:.2f})")
    return 1 if failed else 0


def _add_demo(sub: argparse._SubParsersAction) -> None:
    from nextn.cli import demo

    p = sub.add_parser("demo", help="the main job: decode chat prompts with a real model (SmolLM2 from ../shared), "
                                    "plainly and with speculative decoding; compare AL, tokens/s and outputs",
                       description=demo.__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    demo.add_arguments(p)
    p.set_defaults(func=demo.run)


def _add_bench(sub: argparse._SubParsersAction) -> None:
    from nextn.cli import bench

    p = sub.add_parser("bench", help="tokens/s of nextn (no MTP, MTP K) against transformers generate",
                       description=bench.__doc__)
    bench.add_arguments(p)
    p.set_defaults(func=bench.run)


def _add_make_checkpoint(sub: argparse._SubParsersAction) -> None:
    from nextn.cli import demo

    p = sub.add_parser("make-checkpoint", help="write a tiny DeepSeek-V3 checkpoint with MTP layers (HF save_pretrained "
                                               "+ DeepSeek's MTP layout), optionally distilling its MTP modules")
    demo.add_checkpoint_arguments(p)
    p.add_argument("--output_dir", required=True,
                   help="a new or empty directory (or one an earlier make-checkpoint wrote); other folders are refused")
    p.set_defaults(func=_make_checkpoint)


def _make_checkpoint(args: argparse.Namespace) -> int:
    """make-checkpoint into a directory it may claim (build/output_files.py): never over a user's files."""
    from nextn.build.output_files import claim_output_dir
    from nextn.cli import demo

    claim_output_dir(args.output_dir, "make-checkpoint")
    return demo.make_checkpoint_cmd(args)


def _add_train_draft(sub: argparse._SubParsersAction) -> None:
    from nextn.cli import train_draft

    p = sub.add_parser("train-draft", help="train draft heads (Medusa) on a frozen base by self-distillation",
                       description=train_draft.__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    train_draft.add_arguments(p)
    p.set_defaults(func=train_draft.run)


def _add_token_map(sub: argparse._SubParsersAction) -> None:
    from nextn.cli import token_map

    p = sub.add_parser("token-map", help="rank a model's tokens by corpus frequency (a Draft_Target draft head cut to "
                                         "its hot tokens: draft_token_map)", description=token_map.__doc__,
                       formatter_class=argparse.RawDescriptionHelpFormatter)
    token_map.add_arguments(p)
    p.set_defaults(func=token_map.run)


def _add_triton_repo(sub: argparse._SubParsersAction) -> None:
    from nextn.cli import triton_repo

    p = sub.add_parser("triton-repo", help="write a Triton Inference Server model repository serving an engine "
                                           "(Python backend, TensorRT-LLM tensor names)", description=triton_repo.__doc__)
    triton_repo.add_arguments(p)
    p.set_defaults(func=triton_repo.run)


def _add_serve(sub: argparse._SubParsersAction) -> None:
    from nextn.cli import serve

    p = sub.add_parser("serve", help="OpenAI-compatible HTTP server over an engine (completions, chat, SSE "
                                     "streaming, /metrics)", description=serve.__doc__)
    serve.add_arguments(p)
    p.set_defaults(func=serve.run)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="nextn", description="nextn: engines with a fused verify-and-draft step "
                                     "for self-drafting checkpoints (DeepSeek MTP).")
    parser.add_argument("-v", "--verbose", action="store_true", help="log engine loading and iterations")
    sub = parser.add_subparsers(dest="command", required=True)
    _add_generate(sub)
    _add_demo(sub)
    _add_bench(sub)
    _add_make_checkpoint(sub)
    _add_train_draft(sub)
    _add_token_map(sub)
    _add_triton_repo(sub)
    _add_serve(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING, format="%(levelname)s %(message)s")
    try:
        return args.func(args)
    except USER_ERRORS as e:
        print(f"nextn {args.command}: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
