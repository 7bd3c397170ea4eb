"""`nextn`: the runtime's command line (generate, demo, bench, make-checkpoint, train-draft, token-map, triton-repo,
serve, cache).

`--help` stays fast: the parser imports no torch. Only the chosen command's module is imported (its own imports
may be heavy), and the error types the CLI reports are imported when a command runs.
"""

from __future__ import annotations

import argparse
import importlib
import logging
import sys
from collections.abc import Callable
from typing import Any

from nextn.cli.spellings import add_spellings, add_version, interrupted

#: The project errors a command reports as `nextn CMD: error: ...` with exit status 2 (loaded on first use).
_USER_ERROR_NAMES = (("nextn.build.manifest", "EngineError"), ("nextn.config.llm_args", "LlmArgsError"),
                     ("nextn.runtime.sampling_params", "SamplingParamsError"),
                     ("nextn.build.checkpoint", "CheckpointError"), ("nextn.models.config", "ConfigError"),
                     ("nextn.models.deepseek_v3.weights", "WeightError"),
                     ("nextn.runtime.tokenizer", "ChatTemplateError"))


def user_errors() -> tuple[type[Exception], ...]:
    """The error types a command turns into a one-line message and exit status 2 (imports them: torch)."""
    return tuple(getattr(importlib.import_module(m), name) for m, name in _USER_ERROR_NAMES)


def __getattr__(name: str) -> Any:  # `from nextn.cli.main import USER_ERRORS` keeps working, lazily
    if name == "USER_ERRORS":
        return user_errors()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def _lazy(module: str, func: str) -> Callable[[argparse.Namespace], int]:
    """A command function imported when the command runs."""
    def run(args: argparse.Namespace) -> int:
        return getattr(importlib.import_module(module), func)(args)
    return run


def _add_generate(p: argparse.ArgumentParser) -> None:
    from nextn.cli import generate

    generate.add_arguments(p)
    p.set_defaults(func=_lazy("nextn.cli.generate", "run"))


def _add_demo(p: argparse.ArgumentParser) -> None:
    from nextn.cli import demo

    p.description, p.formatter_class = demo.__doc__, argparse.RawDescriptionHelpFormatter
    demo.add_arguments(p)
    p.set_defaults(func=_lazy("nextn.cli.demo", "run"))


def _add_bench(p: argparse.ArgumentParser) -> None:
    from nextn.cli import bench

    p.description = bench.__doc__
    bench.add_arguments(p)
    p.set_defaults(func=bench.run)


def _add_make_checkpoint(p: argparse.ArgumentParser) -> None:
    from nextn.cli import demo

    p.description = ("Write a tiny random DeepSeek-V3 checkpoint with MTP layers (HF save_pretrained plus DeepSeek's "
                     "MTP layout) for trying build-engine and the runtime without a download; --distill_steps trains "
                     "its MTP modules on the model's own outputs so that drafts get accepted.")
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


def _add_module(module: str, raw: bool = True) -> Callable[[argparse.ArgumentParser], None]:
    """A command whose module has `add_arguments(p)`, `run(args)` and its description as docstring."""
    def add(p: argparse.ArgumentParser) -> None:
        mod = importlib.import_module(module)
        p.description = mod.__doc__
        if raw:
            p.formatter_class = argparse.RawDescriptionHelpFormatter
        mod.add_arguments(p)
        p.set_defaults(func=mod.run)
    return add


#: name -> (one-line help for `nextn --help`, the function that adds its arguments, importing its module)
COMMANDS: dict[str, tuple[str, Callable[[argparse.ArgumentParser], None]]] = {
    "generate": ("complete prompts with a model (sampling or greedy) and print each completion, its acceptance "
                 "length and tokens/s", _add_generate),
    "demo": ("the main job: decode chat prompts with a real model (SmolLM2 from ../shared), plainly and with "
             "speculative decoding; compare AL, tokens/s and outputs", _add_demo),
    "bench": ("tokens/s of nextn (no MTP, MTP K) against transformers generate", _add_bench),
    "make-checkpoint": ("write a tiny DeepSeek-V3 checkpoint with MTP layers (HF save_pretrained + DeepSeek's MTP "
                        "layout), optionally distilling its MTP modules", _add_make_checkpoint),
    "train-draft": ("train draft modules on a frozen base by self-distillation: MTP modules, Medusa heads or a "
                    "student", _add_module("nextn.cli.train_draft")),
    "token-map": ("rank a model's tokens by corpus frequency (a draft head cut to its hot tokens: draft_token_map)",
                  _add_module("nextn.cli.token_map")),
    "triton-repo": ("write a Triton Inference Server model repository serving an engine (Python backend, "
                    "TensorRT-LLM tensor names)", _add_module("nextn.cli.triton_repo", raw=False)),
    "serve": ("OpenAI-compatible HTTP server over an engine or a checkpoint (completions, chat, SSE streaming, "
              "/metrics)", _add_module("nextn.cli.serve", raw=False)),
    "cache": ("list the engines built from checkpoints (nextn's engine cache) or remove them",
              _add_module("nextn.cli.cache")),
}


def build_parser(command: str | None = None) -> argparse.ArgumentParser:
    """The `nextn` parser; only `command`'s arguments are set up (None: every command's, importing their modules),
    the others are listed by name and help."""
    parser = argparse.ArgumentParser(prog="nextn", description="nextn: LLM engines with speculative decoding (MTP, "
                                     "Medusa, draft models, n-grams) in a fused verify-and-draft step; checkpoints "
                                     "(HF safetensors or GGUF) are built into engines once and cached.")
    parser.add_argument("-v", "--verbose", action="store_true", help="log engine loading and iterations")
    add_version(parser)
    sub = parser.add_subparsers(dest="command", required=True)
    for name, (help_, add) in COMMANDS.items():
        p = sub.add_parser(name, help=help_, description=help_)
        if command is None or command == name:
            add(p)
    return add_spellings(parser)


def _command_of(argv: list[str]) -> str | None:
    """The command named in `argv` (the first word that is not an option), or None."""
    return next((a for a in argv if not a.startswith("-")), None)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    command = _command_of(argv)
    args = build_parser(command if command in COMMANDS else "").parse_args(argv)
    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING, format="%(levelname)s %(message)s")
    try:
        return args.func(args)
    except KeyboardInterrupt:
        return interrupted(f"nextn {args.command}")
    except Exception as e:
        if isinstance(e, user_errors()):
            print(f"nextn {args.command}: error: {e}", file=sys.stderr)
            return 2
        raise


if __name__ == "__main__":
    sys.exit(main())
