"""`nextn train-draft`: train draft heads on a frozen base by self-distillation (its own greedy continuations).

Usage:
    nextn train-draft --model_dir BASE --method medusa --num_heads K --data FILE [FILE ...] --output_dir OUT
                      [--steps N] [--seed S] [--num_layers 1]
                      [--eval_medusa_choices choices.json [--eval_tree mc_sim_7b_63]]
    nextn train-draft --model_dir BASE --method mtp --num_heads K --data FILE [FILE ...] --output_dir OUT
                      [--steps N] [--seed S] [--num_draft_steps 3] [--eval_mtp K]
    nextn train-draft --model_dir TEACHER --method student --data FILE [FILE ...] --output_dir OUT
                      [--steps N] [--seed S] [--mtp_lambda 0.3] [--eval_mtp K]

Medusa writes `medusa_lm_head.safetensors` + `config.json` (what `build-engine --medusa_model_dir` reads) and
`train_draft.json` (metrics, held-out prompt ids). With `--eval_medusa_choices` it then builds an engine with the
heads and measures the greedy acceptance length on the held-out prompts.

MTP (Llama-family base; `train/mtp.py`): `--num_heads` MTP modules, 1 for Eagle-style use (trained unrolled
`--num_draft_steps` times) or K for Vanilla; writes an HF checkpoint (the base + `model.layers.{L + i}`,
`num_nextn_predict_layers` in config.json, tokenizer files) that `build-engine` reads. Student (`train/student.py`):
a tiny DeepSeek-V3 (MLA + MoE + one MTP module, trained jointly) distilled from the base's generations, written as
a DeepSeek-V3 checkpoint. With `--eval_mtp K` either then builds an engine and measures the greedy acceptance
length with K drafts on the held-out prompts, and checks the output against plain decoding.

Exit status: 0 trained; 2 bad arguments, an unreadable base or data, or an unsupported method.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from pathlib import Path

from nextn.build.checkpoint import CheckpointError
from nextn.models.config import ConfigError

PROG = "nextn train-draft"


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model_dir", required=True, type=Path, metavar="BASE",
                   help="the frozen base: a .gguf file, a directory holding one, or an HF checkpoint directory")
    p.add_argument("--method", required=True, choices=("medusa", "mtp", "student"),
                   help="medusa heads, MTP modules, or a distilled DeepSeek-V3 student with one MTP module")
    p.add_argument("--num_heads", type=int,
                   help="Medusa heads (default 4), or MTP modules (default 1: one module for Eagle-style use; "
                   "K > 1: Vanilla, module k drafts token k)")
    p.add_argument("--num_layers", type=int, default=1, help="ResBlocks per Medusa head (default 1, as Medusa-1)")
    p.add_argument("--data", required=True, nargs="+", type=Path, metavar="FILE",
                   help="text files; every non-empty line's first --prompt_len tokens are a prompt")
    p.add_argument("--output_dir", required=True, type=Path, metavar="OUT", help="directory for the trained heads")
    p.add_argument("--steps", type=int, default=2000, help="optimizer steps (default 2000)")
    p.add_argument("--seed", type=int, default=0, help="seed of the prompt split, batches and init (default 0)")
    p.add_argument("--batch_size", type=int, default=64, help="sequences per step (default 64)")
    p.add_argument("--lr", type=float, default=1e-3, help="Adam learning rate, decayed linearly to 0 (default 1e-3)")
    p.add_argument("--prompt_len", type=int, default=16, help="prompt tokens per sequence, BOS included (default 16)")
    p.add_argument("--num_tokens", type=int, default=96, help="greedy tokens the base adds per prompt (default 96)")
    p.add_argument("--max_prompts", type=int, help="use at most this many prompts (default: all)")
    p.add_argument("--held_out_fraction", type=float, default=0.1, help="prompts kept for evaluation (default 0.1)")
    p.add_argument("--eval_medusa_choices", type=Path, metavar="JSON",
                   help="measure acceptance length on the held-out prompts with this Medusa tree file: a JSON list "
                   "of paths, or an object of named trees (see --eval_tree)")
    p.add_argument("--eval_tree", default="mc_sim_7b_63",
                   help="tree name in --eval_medusa_choices (default mc_sim_7b_63)")
    p.add_argument("--eval_prompts", type=int, default=64, help="held-out prompts to decode for it (default 64)")
    p.add_argument("--num_draft_steps", type=int, default=3,
                   help="MTP with one module: draft steps it is trained for, fed its own hidden states (default 3)")
    p.add_argument("--eval_mtp", type=int, metavar="K",
                   help="MTP / student: measure the greedy acceptance length with K draft tokens on the held-out "
                   "prompts (Eagle for one module, Vanilla for several) and check it against plain decoding")
    p.add_argument("--eval_only", action="store_true",
                   help="MTP / student: skip training; measure --eval_mtp on the checkpoint already in --output_dir "
                   "(its train_draft.json's held-out prompts)")
    p.add_argument("--mtp_lambda", type=float, default=0.3,
                   help="student: weight of the MTP loss against the next-token loss (default 0.3, DeepSeek-V3's "
                   "first-phase λ)")
    p.add_argument("--no-progress", dest="progress", action="store_false", help="no progress bar")


def _load_choices(path: Path, name: str) -> list[list[int]]:
    data = json.loads(path.read_text())
    if isinstance(data, dict):
        if name not in data:
            raise ValueError(f"{path} has no tree {name!r}; it has {', '.join(data)}")
        data = data[name]
    return data


def run(args: argparse.Namespace) -> int:
    """Run the parsed command; a user error (bad base, data or tree file, method) prints one line and gives 2."""
    try:
        return _run(args)
    except (CheckpointError, ConfigError, ValueError, OSError) as e:
        print(f"{PROG}: error: {e}", file=sys.stderr)
        return 2


def _run(args: argparse.Namespace) -> int:
    from nextn.train.medusa import VICUNA_7B_TOP1, measure_acceptance, train_medusa

    missing = [str(f) for f in args.data if not f.is_file()]
    if missing:
        raise ValueError(f"data file(s) not found: {', '.join(missing)}")
    if args.method in ("mtp", "student"):
        return _run_mtp(args)
    choices = _load_choices(args.eval_medusa_choices, args.eval_tree) if args.eval_medusa_choices else None
    r = train_medusa(args.model_dir, args.data, args.output_dir, num_heads=args.num_heads or 4, num_layers=args.num_layers,
                     steps=args.steps, seed=args.seed, batch=args.batch_size, lr=args.lr, prompt_len=args.prompt_len,
                     num_tokens=args.num_tokens, max_prompts=args.max_prompts,
                     held_out_fraction=args.held_out_fraction, progress=args.progress)
    print(f"trained {r.num_heads} Medusa heads ({r.num_layers} ResBlock each) in {r.steps} steps: "
          f"{r.data_seconds:.1f} s data ({r.num_train} train / {r.num_held_out} held-out sequences), "
          f"{r.train_seconds:.1f} s training; final loss {r.final_loss:.3f}")
    print("held-out top-1 per head   " + "  ".join(f"h{i + 1}" + " " * 3 for i in range(r.num_heads)))
    print("  untrained (lm_head copy) " + "  ".join(f"{a:.3f}" for a in r.top1_before))
    print("  trained                  " + "  ".join(f"{a:.3f}" for a in r.top1_after))
    print("  Medusa paper, Vicuna-7B  " + "  ".join(f"{a:.3f}" for a in VICUNA_7B_TOP1[: r.num_heads]))
    print(f"wrote {args.output_dir}/medusa_lm_head.safetensors, config.json, train_draft.json")
    if choices is not None:
        m = measure_acceptance(args.model_dir, args.output_dir, choices, r.held_out_prompts[: args.eval_prompts],
                               max_tokens=args.num_tokens)
        print(f"greedy acceptance length on {m['num_prompts']} held-out prompts ({args.eval_tree}, {args.num_tokens} "
              f"tokens each): {m['acceptance_length']:.3f}; lossless vs plain decoding: {m['lossless']}")
        meta = json.loads((args.output_dir / "train_draft.json").read_text())
        meta["acceptance"] = {"tree": args.eval_tree, **m}
        (args.output_dir / "train_draft.json").write_text(json.dumps(meta) + "\n")
    return 0


def _run_mtp(args: argparse.Namespace) -> int:
    from nextn.train.mtp import train_mtp
    from nextn.train.student import train_student

    common = dict(steps=args.steps, seed=args.seed, batch=args.batch_size, lr=args.lr, prompt_len=args.prompt_len,
                  num_tokens=args.num_tokens, max_prompts=args.max_prompts, held_out_fraction=args.held_out_fraction,
                  progress=args.progress)
    if args.eval_only:
        return _eval_mtp(args, json.loads((args.output_dir / "train_draft.json").read_text()))
    if args.method == "mtp":
        r = train_mtp(args.model_dir, args.data, args.output_dir, num_modules=args.num_heads or 1,
                      num_draft_steps=args.num_draft_steps, **common)
        what = (f"1 MTP module (Eagle, {r.num_draft_steps} draft steps)" if r.mode == "eagle"
                else f"{r.num_modules} MTP modules (Vanilla)")
        label = "step" if r.mode == "eagle" else "module"
    else:
        r = train_student(args.model_dir, args.data, args.output_dir, mtp_lambda=args.mtp_lambda,
                          num_draft_steps=args.num_draft_steps, **common)
        what, label = f"a DeepSeek-V3 student with 1 MTP module ({r.num_draft_steps} draft steps)", "step"
    print(f"trained {what} in {r.steps} steps: {r.data_seconds:.1f} s data ({r.num_train} train / "
          f"{r.num_held_out} held-out sequences), {r.train_seconds:.1f} s training (CPU time: "
          f"{r.data_cpu_seconds:.1f} s + {r.train_cpu_seconds:.1f} s); final loss {r.final_loss:.3f}")
    names = [f"{label[0]}{i + 1}" for i in range(r.num_draft_steps if label == "step" else r.num_modules)]
    if args.method == "student":
        names = ["next", *names]  # the student's own next-token head first
    print(f"held-out top-1 per {label}  " + "  ".join(f"{n:<5}" for n in names))
    print("  before training         " + "  ".join(f"{a:.3f}" for a in r.top1_before))
    print("  trained                 " + "  ".join(f"{a:.3f}" for a in r.top1_after))
    print(f"wrote {args.output_dir} (config.json, model*.safetensors, tokenizer files, train_draft.json)")
    return _eval_mtp(args, json.loads((args.output_dir / "train_draft.json").read_text())) if args.eval_mtp else 0


def _eval_mtp(args: argparse.Namespace, meta: dict) -> int:
    """Greedy AL with `--eval_mtp` drafts on the held-out prompts in `meta`; recorded in train_draft.json."""
    from nextn.train.mtp import measure_mtp_acceptance

    if not args.eval_mtp:
        raise ValueError("--eval_only needs --eval_mtp K")
    m = measure_mtp_acceptance(args.output_dir, meta["held_out_prompts"][: args.eval_prompts],
                               num_draft_tokens=args.eval_mtp, use_mtp_vanilla=meta["num_modules"] > 1,
                               max_tokens=args.num_tokens)
    print(f"greedy acceptance length on {m['num_prompts']} held-out prompts (MTP {m['mode']}, K={args.eval_mtp}, "
          f"{args.num_tokens} tokens each): {m['acceptance_length']:.3f}; lossless vs plain decoding: {m['lossless']}")
    meta["acceptance"] = m
    (args.output_dir / "train_draft.json").write_text(json.dumps(meta) + "\n")
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog=PROG, description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    add_arguments(p)
    return run(p.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
