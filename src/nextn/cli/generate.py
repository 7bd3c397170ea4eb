"""`nextn generate`: complete prompts with a model and print each completion, its acceptance length and speed.

After the completions, one line sums the run up: decode tokens/s over all prompts (tokens after each prompt's first,
over the span from the first request's first token to the last request's end: prompts run batched), mean time to
first token and the overall acceptance length. `--json` prints one object per prompt with the same per-prompt
figures (`tokens_per_s`, `ttft_ms`, `tpot_ms`, `acceptance_length`) and the summary as one JSON object on stderr
(with `cpu_kernels`: the ISA variant of nextn's CPU kernels that ran).
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import dataclass
from typing import Any

from nextn.cli.checkpoint_options import add_checkpoint_options, checkpoint_llm_kwargs
from nextn.cli.threads import add_threads_argument, apply_threads


def _json_object(text: str) -> dict:
    """--chat_template_kwargs: a JSON object (argparse reports the ValueError as a usage error)."""
    try:
        value = json.loads(text)
    except json.JSONDecodeError as e:
        raise argparse.ArgumentTypeError(f"not JSON ({e.msg} at character {e.pos})") from None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError("give a JSON object, e.g. '{\"enable_thinking\": false}'")
    return value


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.description = ("Complete prompts with an engine or a checkpoint (greedy by default, sampled with --temperature "
                     "> 0); print each completion with its acceptance length (emitted tokens per verify-and-draft "
                     "step, prefill counted as one), decode tokens/s and time to first token, then a summary line.")
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--engine_dir", help="engine directory written by build-engine")
    src.add_argument("--model", help="a checkpoint (a .gguf file or an HF directory) or an engine: a checkpoint is "
                                     "built once into nextn's engine cache and reused (as LLM(path))")
    add_checkpoint_options(p)
    p.add_argument("--prompt", action="append", required=True,
                   help="a prompt (repeatable); with --token_ids, comma-separated token ids")
    p.add_argument("--token_ids", action="store_true", help="read each --prompt as comma-separated token ids")
    p.add_argument("--chat", action="store_true",
                   help="send each --prompt as one user message through the model's chat template (stored in the "
                        "engine), as /v1/chat/completions does")
    p.add_argument("--chat_template_kwargs", type=_json_object, metavar="JSON",
                   help="with --chat: more names for the chat template, as a JSON object (vLLM's "
                        "chat_template_kwargs), e.g. '{\"enable_thinking\": false}' for Qwen3's thinking switch")
    p.add_argument("--max_tokens", type=int, default=64, help="tokens to generate per prompt (default 64)")
    p.add_argument("--extra_llm_api_options", "--config", dest="extra_llm_api_options",
                   help="YAML of LLM arguments (TensorRT-LLM names), e.g. speculative_config; relative paths in it "
                        "are relative to the YAML file")
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default); > 0 samples")
    p.add_argument("--top_k", type=int, default=0, help="keep the k most likely tokens (0 = off)")
    p.add_argument("--top_p", type=float, default=1.0, help="nucleus sampling mass (1.0 = off)")
    p.add_argument("--seed", type=int, help="sampling seed (same seed, same output)")
    p.add_argument("--ignore_eos", action="store_true", help="do not stop at EOS")
    p.add_argument("--json", action="store_true", help="print one JSON object per prompt (the summary on stderr)")
    add_threads_argument(p)


@dataclass(frozen=True)
class RunStats:
    """What a generate run measured, over the prompts that did not fail.

    Attributes:
        num_tokens: tokens generated.
        decode_tokens_per_s: tokens after each prompt's first / (last finish − first first-token), tokens/s; None
            when no prompt emitted two tokens.
        mean_ttft_ms: mean time to first token, ms (None without timings).
        acceptance_length: emitted tokens / (decode steps + 1 per prompt), as each prompt's AL.
    """

    num_tokens: int
    decode_tokens_per_s: float | None
    mean_ttft_ms: float | None
    acceptance_length: float

    @classmethod
    def of(cls, completions: list[Any]) -> "RunStats":
        """Stats of `CompletionOutput`s (`.outputs[0]` of each RequestOutput)."""
        tokens = sum(len(c.token_ids) for c in completions)
        steps = sum(c.num_decode_steps + 1 for c in completions if c.token_ids)
        timed = [c for c in completions if c.first_token_time is not None and c.finished_time is not None]
        decode = sum(len(c.token_ids) - 1 for c in timed if c.token_ids)
        span = (max(c.finished_time for c in timed) - min(c.first_token_time for c in timed)) if timed else 0.0
        ttfts = [c.ttft_ms for c in completions if c.ttft_ms is not None]
        return cls(tokens, decode / span if decode and span > 0 else None,
                   sum(ttfts) / len(ttfts) if ttfts else None, tokens / steps if steps else 0.0)

    def as_dict(self) -> dict[str, Any]:
        return {"num_tokens": self.num_tokens, "tokens_per_s": _round(self.decode_tokens_per_s, 2),
                "ttft_ms": _round(self.mean_ttft_ms, 2), "acceptance_length": round(self.acceptance_length, 4)}

    def line(self, num_prompts: int) -> str:
        speed = "n/a" if self.decode_tokens_per_s is None else f"{self.decode_tokens_per_s:.1f}"
        ttft = "n/a" if self.mean_ttft_ms is None else f"{self.mean_ttft_ms:.1f} ms"
        return (f"{num_prompts} prompt(s), {self.num_tokens} tokens: decode {speed} tokens/s, mean TTFT {ttft}, "
                f"acceptance length {self.acceptance_length:.2f}")


def _round(value: float | None, digits: int) -> float | None:
    return None if value is None else round(value, digits)


def completion_stats(c: Any) -> dict[str, Any]:
    """Per-prompt figures: decode tokens/s (1000 / TPOT), TTFT and TPOT in ms, acceptance length."""
    tpot = c.tpot_ms
    return {"tokens_per_s": _round(1e3 / tpot, 2) if tpot else None, "ttft_ms": _round(c.ttft_ms, 2),
            "tpot_ms": _round(tpot, 3), "acceptance_length": round(c.acceptance_length, 4)}


def run(args: argparse.Namespace) -> int:
    from nextn import LLM, SamplingParams
    from nextn.cli.env_options import env_llm_overrides

    if args.chat and args.token_ids:
        print("nextn generate: error: --chat renders text prompts; it cannot take --token_ids", file=sys.stderr)
        return 2
    if args.chat_template_kwargs is not None and not args.chat:
        print("nextn generate: error: --chat_template_kwargs goes with --chat", file=sys.stderr)
        return 2
    try:
        apply_threads(args.num_threads, "nextn generate")
    except ValueError as e:
        print(f"nextn generate: error: {e}", file=sys.stderr)
        return 2
    prompts = [[int(t) for t in p.split(",") if t.strip()] for p in args.prompt] if args.token_ids else args.prompt
    llm = LLM(args.engine_dir or args.model, extra_llm_api_options=args.extra_llm_api_options,
              **checkpoint_llm_kwargs(args), **env_llm_overrides())
    if args.chat:
        if llm.tokenizer is None:
            print("nextn generate: error: --chat needs a tokenizer and this engine has none", file=sys.stderr)
            return 2
        from nextn.runtime.tokenizer import ChatTemplateError
        try:
            prompts = [llm.tokenizer.apply_chat_template([{"role": "user", "content": p}],
                                                         template_kwargs=args.chat_template_kwargs)
                       for p in args.prompt]
        except ChatTemplateError as e:
            print(f"nextn generate: error: {e}", file=sys.stderr)
            return 2
    params = SamplingParams(max_tokens=args.max_tokens, ignore_eos=args.ignore_eos, temperature=args.temperature,
                            top_k=args.top_k, top_p=args.top_p, seed=args.seed)
    outputs = llm.generate(prompts, params)
    done = []
    for i, out in enumerate(outputs):
        c = out.outputs[0]
        if c.finish_reason == "error":
            print(f"nextn generate: error: prompt {i}: {c.error}", file=sys.stderr)
            continue
        done.append(c)
        stats = completion_stats(c)
        if args.json:
            prompt = args.prompt[i] if args.chat else out.prompt  # the user's text, not the rendered ids
            print(json.dumps({"prompt": prompt, "token_ids": c.token_ids, "text": c.text,
                              "finish_reason": c.finish_reason, **stats, "num_draft_tokens": c.num_draft_tokens,
                              "num_accepted_draft_tokens": c.num_accepted_draft_tokens,
                              "accepted_per_position": c.accepted_per_position}))
        else:
            shown = c.text if c.text else " ".join(map(str, c.token_ids))
            speed = "" if stats["tokens_per_s"] is None else f", {stats['tokens_per_s']:.1f} tokens/s"
            ttft = "" if stats["ttft_ms"] is None else f", TTFT {stats['ttft_ms']:.1f} ms"
            print(f"[{i}] {shown}\n    ({len(c.token_ids)} tokens, finish_reason={c.finish_reason}, "
                  f"acceptance length {c.acceptance_length:.2f}{speed}{ttft})")
    if done:
        summary = RunStats.of(done)
        if args.json:
            print(json.dumps({"summary": {"num_prompts": len(done), **summary.as_dict(),
                                          "cpu_kernels": _kernels(llm)}}), file=sys.stderr)
        else:
            print(f"overall: {summary.line(len(done))}")
    return 1 if len(done) < len(outputs) else 0


def _kernels(llm) -> str | None:
    """The ISA variant of nextn's CPU kernels the engine runs (`plugins.cpu_kernels`), None on a GPU or without them."""
    if llm.engine.device.type != "cpu":
        return None
    from nextn.plugins import cpu_kernels

    return cpu_kernels.variant()
