"""`nextn train-draft`: train draft heads on a frozen base by self-distillation (its own greedy continuations).

Usage:
    nextn train-draft --model_dir BASE --method mtp --num_heads 1 --num_draft_steps 3 --data FILE [FILE ...]
                      --output_dir OUT [--steps N] [--max_minutes M] [--eval_mtp 3]
    nextn train-draft --model_dir BASE --method medusa --num_heads 4 --data FILE [FILE ...] --output_dir OUT
                      [--eval_medusa_choices choices.json [--eval_tree mc_sim_7b_63]]
    nextn train-draft --model_dir TEACHER --method student --data FILE [FILE ...] --output_dir OUT [--eval_mtp K]

BASE: a `.gguf` file (llama, qwen2), a directory holding one, or an HF checkpoint. FILE: prompt files (MT-bench,
Spec-Bench, HumanEval, GSM8K JSON lines, optionally gzipped) and text corpora (paragraphs; lines for a plain LM).
The base continues the training prompts greedily with nextn's own engine (chat template applied when the base has
one), its hidden states are computed once, and both are cached in `--cache_dir` (default OUT/train_cache) with the
resumable training state: the same command after an interruption or `--max_minutes` continues where it stopped.
MT-bench question ids and HumanEval task ids are split by `--benchmark_held_out_fraction`, the rest by
`--held_out_fraction`, under `--seed`; the held-out ids are recorded in OUT/train_draft.json and never trained on.

Output: Medusa: `medusa_lm_head.safetensors` + `config.json` (what `build-engine --medusa_model_dir` reads). MTP
(`train/mtp.py`, Llama / Qwen2 base): `--num_heads` modules, 1 for Eagle-style use (trained unrolled
`--num_draft_steps` times) or K for Vanilla, as an HF checkpoint with the modules as extra layers
`model.layers.{L + i}` and `num_nextn_predict_layers` (DeepSeek-V3's layout) that `build-engine` reads. Student
(`train/student.py`): a tiny DeepSeek-V3 with one MTP module. `--eval_mtp K` / `--eval_medusa_choices` then build
an engine with the heads (kept in OUT/engine-<dtype>) and measure the greedy acceptance length on held-out
prompts, checking the output against plain decoding.

Exit status: 0 trained (or, with `--max_minutes`, stopped and saved mid-training); 2 bad arguments, an unreadable
base or data, or an unsupported method; 3 the time budget ran out during data generation (the same command resumes).
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from pathlib import Path

from nextn.config.llm_args import MAX_TREE_DRAFT_TOKENS
from nextn.config.user_files import check_user_file, read_user_json

PROG = "nextn train-draft"


#: The data group's numeric options: flag, type, default, help (the help ends with the default).
_DATA_NUMBERS = (
    ("--seed", int, 0, "seed of the split, the batches and the init"),
    ("--num_tokens", int, 96, "tokens the base adds per prompt (a chat model stops earlier at EOS)"),
    ("--prompt_len", int, 16, "plain LM: prompt tokens per sequence, BOS included"),
    ("--max_prompt_len", int, 256, "chat model: prompts rendering to more tokens are skipped"),
    ("--held_out_fraction", float, 0.1, "share of the other prompts held out"),
    ("--benchmark_held_out_fraction", float, 0.5, "share of MT-bench question ids and HumanEval task ids held out"),
    ("--num_top1_prompts", int, 32, "held-out prompts also continued, for the held-out top-1 meter"),
)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model_dir", required=True, type=Path, metavar="BASE",
                   help="the frozen base: a .gguf file, a directory holding one, or an HF checkpoint directory")
    p.add_argument("--method", required=True, choices=("medusa", "mtp", "student"),
                   help="medusa heads, MTP modules, or a distilled DeepSeek-V3 student with one MTP module")
    p.add_argument("--num_heads", type=int,
                   help="Medusa heads (default 4), or MTP modules (default 1: one module for Eagle-style use; "
                   "K > 1: Vanilla, module k drafts token k)")
    p.add_argument("--num_layers", type=int, default=1, help="ResBlocks per Medusa head (default 1, as Medusa-1)")
    p.add_argument("--train_projection", action="store_true",
                   help="Medusa: also train each head's own vocabulary projection (default: the base lm_head's copy)")
    p.add_argument("--data", required=True, nargs="+", type=Path, metavar="FILE",
                   help="prompt files (.jsonl[.gz]: MT-bench, Spec-Bench, HumanEval, GSM8K) and text corpora")
    p.add_argument("--output_dir", required=True, type=Path, metavar="OUT", help="directory for the trained heads")
    p.add_argument("--cache_dir", type=Path, help="data and resumable state (default OUT/train_cache)")
    g = p.add_argument_group("data")
    for flag, kind, default, text in _DATA_NUMBERS:
        g.add_argument(flag, type=kind, default=default, help=f"{text} (default {default})")
    g.add_argument("--max_prompts", type=int, help="training prompts, round-robin over the files (default: all)")
    g.add_argument("--no_chat_template", dest="chat", action="store_false", default=None,
                   help="raw-text prompts even when the base has a chat template")
    g.add_argument("--num_text_prompts", type=int, default=0,
                   help="more training prompts only read by the base, no continuation (their positions train on "
                   "the base's own predictions; ~7× cheaper a token than generating)")
    g.add_argument("--gen_batch_size", type=int, default=32, help="requests the engine generates at once (32)")
    g.add_argument("--gen_dtype", default="auto", choices=("auto", "float32", "bfloat16"),
                   help="dtype of the engine that generates the data (default auto: bfloat16 where fast)")
    g = p.add_argument_group("training")
    g.add_argument("--steps", type=int, default=2000, help="optimizer steps (default 2000)")
    g.add_argument("--batch_size", type=int, default=64, help="sequences per step (default 64)")
    g.add_argument("--lr", type=float, default=1e-3, help="Adam learning rate, decayed linearly to 0 (default 1e-3)")
    g.add_argument("--warmup_steps", type=int, default=0, help="steps of linear warm-up (default 0)")
    g.add_argument("--bf16", action="store_true",
                   help="train under bfloat16 autocast (matmuls in bf16, weights and Adam in float32; ~2.5× faster "
                   "on a CPU with bf16 instructions)")
    g.add_argument("--max_minutes", type=float,
                   help="budget of the whole run, data included: training stops at it, writes the heads as they "
                   "are and saves its state (the same command resumes)")
    g.add_argument("--max_context", type=int, default=64,
                   help="prompt tokens kept before the generated ones in training (default 64; -1: all)")
    g.add_argument("--no_prompt_positions", dest="train_on_prompts", action="store_false",
                   help="train only on generated positions (default: prompt positions too, on the base's "
                   "predictions there)")
    g.add_argument("--loss_vocab", choices=("data", "full"), default="data",
                   help="softmax over the tokens of the training data (default; much cheaper) or the whole vocabulary")
    g.add_argument("--feature_loss_weight", type=float, default=0.0,
                   help="MTP: weight of EAGLE's feature loss (smooth L1 to the base's state; default 0)")
    g.add_argument("--mtp_init", choices=("base", "random"), default="base",
                   help="MTP: start as the base's own next-token head (default) or from a random block")
    g.add_argument("--num_draft_steps", type=int, default=3,
                   help="MTP with one module: draft steps it is trained for, fed its own hidden states (default 3)")
    g.add_argument("--mtp_lambda", type=float, default=0.3,
                   help="student: weight of the MTP loss against the next-token loss (default 0.3, DeepSeek-V3's "
                   "first-phase λ)")
    g.add_argument("--tree_nodes", type=int, default=15,
                   help="MTP Eagle: draft nodes of the static tree chosen from the trained module's held-out per-rank "
                   "acceptance, written to train_draft.json as eagle_choices (default 15: 16 verified tokens)")
    g.add_argument("--tree_depth", type=int, default=0,
                   help="MTP Eagle: the deepest draft step that tree may use, the module applied again past its "
                   "trained steps (default 0: twice --num_draft_steps); run it with num_nextn_predict_layers ≥ the "
                   "depth printed")
    g.add_argument("--eval_every", type=int, default=100, help="steps between held-out top-1 figures in the bar")
    g.add_argument("--checkpoint_every", type=float, default=120.0, help="seconds between resumable checkpoints")
    g.add_argument("--no-progress", dest="progress", action="store_false", help="no progress bars")
    g = p.add_argument_group("evaluation (held-out prompts, greedy, through nextn's LLM)")
    g.add_argument("--eval_mtp", type=int, metavar="K",
                   help="MTP / student: measure the acceptance length with K draft tokens (Eagle for one module, "
                   "Vanilla for several) and check it against plain decoding")
    g.add_argument("--eval_medusa_choices", type=Path, metavar="JSON",
                   help="Medusa: measure it with this tree file: a JSON list of paths, or an object of named trees")
    g.add_argument("--eval_tree", default="mc_sim_7b_63",
                   help="tree name in --eval_medusa_choices (default mc_sim_7b_63)")
    g.add_argument("--eval_prompts", type=int, default=64, help="held-out prompts to decode (default 64)")
    g.add_argument("--eval_source", metavar="NAME",
                   help="only the held-out prompts of this source (mt_bench, humaneval; default: all recorded)")
    g.add_argument("--eval_tokens", type=int, help="tokens per prompt (default --num_tokens)")
    g.add_argument("--eval_dtype", default="float32", choices=("float32", "bfloat16"),
                   help="engine dtype (default float32: speculative output must equal plain decoding exactly)")
    g.add_argument("--eval_only", action="store_true",
                   help="skip training; measure the heads already in OUT on its train_draft.json's held-out prompts")


#: --num_heads: Medusa heads or MTP modules (MTPDecodingConfig.num_nextn_predict_layers ≤ 16).
MAX_HEADS = 16


def _load_choices(path: Path, name: str) -> list[list[int]]:
    data = read_user_json(path, "--eval_medusa_choices")
    if isinstance(data, dict):
        if name not in data:
            raise ValueError(f"{path} has no tree {name!r}; it has {', '.join(data)}")
        data = data[name]
    return data


def run(args: argparse.Namespace) -> int:
    """Run the parsed command; a user error (bad base, data or tree file, method) prints one line and gives 2."""
    from nextn.build.checkpoint import CheckpointError
    from nextn.build.manifest import EngineError
    from nextn.models.config import ConfigError
    from nextn.train.data import BudgetExhausted

    try:
        return _run(args)
    except BudgetExhausted as e:
        print(f"{PROG}: {e}", file=sys.stderr)
        return 3
    except (CheckpointError, ConfigError, EngineError, ValueError, OSError) as e:
        print(f"{PROG}: error: {e}", file=sys.stderr)
        return 2


def _configs(args: argparse.Namespace):
    from nextn.train.data import DataConfig
    from nextn.train.session import TrainSettings

    data = DataConfig(files=tuple(str(f) for f in args.data), seed=args.seed, prompt_len=args.prompt_len,
                      max_prompt_len=args.max_prompt_len, num_tokens=args.num_tokens, max_prompts=args.max_prompts,
                      num_top1_prompts=args.num_top1_prompts, held_out_fraction=args.held_out_fraction,
                      benchmark_held_out_fraction=args.benchmark_held_out_fraction, chat=args.chat,
                      gen_dtype=args.gen_dtype, gen_batch_size=args.gen_batch_size,
                      num_text_prompts=args.num_text_prompts)
    settings = TrainSettings(steps=args.steps, batch=args.batch_size, lr=args.lr, seed=args.seed,
                             warmup=args.warmup_steps, bf16=args.bf16,
                             max_minutes=args.max_minutes, loss_vocab=args.loss_vocab,
                             max_context=None if args.max_context < 0 else args.max_context,
                             feature_weight=args.feature_loss_weight, checkpoint_every_s=args.checkpoint_every,
                             eval_every=args.eval_every, tree_nodes=args.tree_nodes, tree_depth=args.tree_depth,
                             init=args.mtp_init,
                             train_on_prompts=args.train_on_prompts, progress=args.progress)
    return data, settings


def _check_counts(args: argparse.Namespace) -> None:
    """Bound the counts that size the heads and the tree before any work (ValueError naming the option)."""
    bounds = (("--num_heads", args.num_heads, 1, MAX_HEADS), ("--num_layers", args.num_layers, 1, MAX_HEADS),
              ("--num_draft_steps", args.num_draft_steps, 1, MAX_HEADS),
              ("--tree_nodes", args.tree_nodes, 1, MAX_TREE_DRAFT_TOKENS), ("--tree_depth", args.tree_depth, 0, 64))
    for flag, value, low, high in bounds:
        if value is not None and not low <= value <= high:
            raise ValueError(f"{flag} must be in [{low}, {high}], got {value}")


def _run(args: argparse.Namespace) -> int:
    _check_counts(args)
    missing = [str(f) for f in args.data if not f.exists()]
    if missing:
        raise ValueError(f"data file(s) not found: {', '.join(missing)}")
    from nextn.config.prompt_files import MAX_PROMPT_FILE_BYTES

    for f in args.data:
        check_user_file(f, "data file", max_bytes=MAX_PROMPT_FILE_BYTES)
    from nextn.train.session import claim_train_output, is_train_output

    if args.eval_only and not is_train_output(args.output_dir):
        raise ValueError(f"--eval_only: {args.output_dir} holds no train-draft output (train_draft.json)")
    claim_train_output(args.model_dir, args.data, args.output_dir, args.cache_dir,
                       [args.eval_medusa_choices] if args.eval_medusa_choices else [])
    choices = _load_choices(args.eval_medusa_choices, args.eval_tree) if args.eval_medusa_choices else None
    if args.eval_only:
        return _evaluate(args, _record(args.output_dir), choices)
    data_cfg, settings = _configs(args)
    if args.method == "medusa":
        from nextn.train.medusa import VICUNA_7B_TOP1, train_medusa

        r = train_medusa(args.model_dir, data_cfg, args.output_dir, settings, num_heads=4 if args.num_heads is None else args.num_heads,
                         num_layers=args.num_layers, train_projection=args.train_projection,
                         cache_dir=args.cache_dir)
        what, label, names = f"{r.num_heads} Medusa heads ({args.num_layers} ResBlock each)", "head", None
        reference = ("Medusa paper, Vicuna-7B", VICUNA_7B_TOP1[: r.num_heads])
    elif args.method == "mtp":
        from nextn.train.mtp import train_mtp

        r = train_mtp(args.model_dir, data_cfg, args.output_dir, settings, num_modules=1 if args.num_heads is None else args.num_heads,
                      num_draft_steps=args.num_draft_steps, cache_dir=args.cache_dir)
        what = (f"1 MTP module (Eagle, {r.num_draft_steps} draft steps)" if r.mode == "eagle"
                else f"{r.num_heads} MTP modules (Vanilla)")
        label, names, reference = ("step" if r.mode == "eagle" else "module"), None, None
    else:
        from nextn.train.student import train_student

        r = train_student(args.model_dir, data_cfg, args.output_dir, settings, mtp_lambda=args.mtp_lambda,
                          num_draft_steps=args.num_draft_steps, cache_dir=args.cache_dir)
        what, label, reference = f"a DeepSeek-V3 student with 1 MTP module ({r.num_draft_steps} draft steps)", \
            "step", None
        names = ["next", *(f"s{i + 1}" for i in range(r.num_draft_steps))]  # the student's own next-token head first
    s, cpu = r.seconds, r.cpu_seconds
    print(f"trained {what}: {r.steps_done}/{r.steps} steps{'' if r.complete else ' (time budget; rerun resumes)'}; "
          f"final loss {r.final_loss:.3f}; softmax over {r.loss_vocab_size} tokens")
    print(f"data: {r.num_train} training sequences, {r.num_tokens_generated} tokens generated, {r.num_held_out} "
          f"prompts held out; wall s: load {s['load_base']:.0f}, generate {s['generate']:.0f}, hidden states "
          f"{s['hidden']:.0f}, train {s['train']:.0f} (CPU s: data {cpu['data']:.0f}, train {cpu['train']:.0f})")
    names = names or [f"{label[0]}{i + 1}" for i in range(len(r.top1_after))]
    print(f"held-out top-1 per {label}   " + "  ".join(f"{n:<5}" for n in names))
    print("  before training          " + "  ".join(f"{a:.3f}" for a in r.top1_before))
    print("  trained                  " + "  ".join(f"{a:.3f}" for a in r.top1_after))
    if reference is not None:
        print(f"  {reference[0]:<24} " + "  ".join(f"{a:.3f}" for a in reference[1]))
    meta = _record(args.output_dir)
    if "eagle_choices" in meta:
        depth = max(len(p) for p in meta["eagle_choices"])
        print(f"static tree for these heads ({len(meta['eagle_choices'])} nodes, depth {depth}, expected AL "
              f"{meta['expected_acceptance_length']:.2f} from held-out per-rank acceptance): "
              f"num_nextn_predict_layers: {depth}, eagle_choices: {json.dumps(meta['eagle_choices'])}")
    print(f"wrote {args.output_dir} (train_draft.json with the split and these figures)")
    if args.eval_mtp or choices is not None:
        return _evaluate(args, meta, choices)
    return 0


def _evaluate(args: argparse.Namespace, meta: dict, choices: list[list[int]] | None) -> int:
    """Greedy AL on the held-out prompts recorded in `meta`; recorded in train_draft.json under "acceptance"."""
    from nextn.build.output_files import write_output_file
    from nextn.train.evaluate import evaluate_heads

    method = meta["method"]
    if method == "medusa" and choices is None:
        raise ValueError("measuring Medusa heads needs --eval_medusa_choices")
    if method != "medusa" and not args.eval_mtp:
        raise ValueError("--eval_only needs --eval_mtp K (MTP) or --eval_medusa_choices (Medusa)")
    chat = meta["chat"]
    ids = [i for i in meta["eval_prompt_ids"] if args.eval_source is None or i.startswith(f"{args.eval_source}/")]
    if not ids:
        raise ValueError(f"no held-out prompt of source {args.eval_source!r}; the recorded ones are from "
                         f"{sorted({i.split('/')[0] for i in meta['eval_prompt_ids']})}")
    by_id = dict(zip(meta["eval_prompt_ids"], meta["held_out_prompts"]))
    ids = ids[: args.eval_prompts]
    prompts = [by_id[i] for i in ids]
    tokens = args.eval_tokens or meta["data_config"]["num_tokens"]
    m = evaluate_heads(meta["base_model"], args.output_dir, "medusa" if method == "medusa" else "mtp", prompts,
                       num_draft_tokens=args.eval_mtp or 0, use_mtp_vanilla=meta.get("num_modules", 1) > 1,
                       medusa_choices=choices, max_tokens=tokens, ignore_eos=not chat, dtype=args.eval_dtype)
    what = f"Medusa {args.eval_tree}" if method == "medusa" else \
        f"MTP {'Vanilla' if meta.get('num_modules', 1) > 1 else 'Eagle'}, K={args.eval_mtp}"
    print(f"greedy acceptance length on {m['num_prompts']} held-out prompts ({what}, {tokens} tokens, "
          f"{args.eval_dtype}): AL {m['acceptance_length']:.3f}, draft acceptance rate "
          f"{m['draft_acceptance_rate']:.3f}; identical to plain decoding: {m['num_identical']}/{m['num_prompts']}")
    print(f"engine with the heads: {m['engine_dir']}")
    meta.setdefault("acceptance_runs", []).append({**m, "tree": args.eval_tree if method == "medusa" else None,
                                                    "prompt_ids": ids})
    meta["acceptance"] = meta["acceptance_runs"][-1]
    write_output_file(args.output_dir / "train_draft.json", json.dumps(meta) + "\n", "train_draft.json", force=True)
    return 0


def _record(output_dir: Path) -> dict:
    meta = read_user_json(output_dir / "train_draft.json", "train_draft.json")
    if not isinstance(meta, dict):
        raise ValueError(f"{output_dir / 'train_draft.json'} is not a train-draft record (a JSON object)")
    return meta


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog=PROG, description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    add_arguments(p)
    return run(p.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
