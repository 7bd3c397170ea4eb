"""What every nextn command line shares: each long option in both spellings (`--max_tokens` and `--max-tokens`, as
TensorRT-LLM and vLLM users type them), vLLM's names where ours differ (`--max-model-len` for `--max_seq_len`),
`--version`, and Ctrl-C as one line with exit status 130 (128 + SIGINT), never a traceback.

Applied once a parser is complete (`add_spellings`), to its sub-commands too: the other names are parsed but not
listed, so `--help` shows each option once. Imports nothing heavy (`--help` stays fast).
"""

from __future__ import annotations

import argparse
import sys

#: our option → the other names users bring from vLLM / trtllm-serve (both spellings of each are added too)
PEER_NAMES: dict[str, tuple[str, ...]] = {
    "--max_seq_len": ("--max-model-len",),
    "--tp_size": ("--tensor-parallel-size",),
    "--ep_size": ("--expert-parallel-size",),
    "--engine_dir": ("--engine",),
}


def _other_spelling(option: str) -> str | None:
    body = option[2:]
    if not option.startswith("--") or ("_" in body) == ("-" in body):  # none or both: leave it
        return None
    return "--" + (body.replace("_", "-") if "_" in body else body.replace("-", "_"))


def add_spellings(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Give every long option of `parser` (and of its sub-commands) its other spelling and its peers' names
    (`PEER_NAMES`), where the parser has no option of that name already. Returns `parser`."""
    for action in list(parser._actions):
        if isinstance(action, argparse._SubParsersAction):
            for sub in action.choices.values():
                add_spellings(sub)
            continue
        names = list(action.option_strings)
        for name in names:
            names += [n for n in PEER_NAMES.get(name, ()) if n not in names]
        names += [alt for alt in map(_other_spelling, names) if alt is not None]
        for name in names:  # parsed, not listed: --help shows each option once, as documented
            parser._option_string_actions.setdefault(name, action)
    return parser


def add_version(parser: argparse.ArgumentParser) -> None:
    """`--version`: prints `PROG VERSION` and exits 0."""
    from nextn import __version__

    parser.add_argument("--version", action="version", version=f"%(prog)s {__version__}")


def interrupted(prog: str, detail: str = "") -> int:
    """Ctrl-C's one line (`PROG: interrupted[; DETAIL]`) on stderr; returns 130, the exit status shells expect."""
    print(f"\n{prog}: interrupted" + (f"; {detail}" if detail else ""), file=sys.stderr)
    return 130
