"""`nextn cache`: the engines nextn built from checkpoints (`LLM(path)`, `generate --model`, `serve --model`, a
Draft_Target draft given as a checkpoint).

Usage:
    nextn cache list [--cache_dir DIR]
    nextn cache clear (--all | KEY [KEY ...] | --older_than DAYS) [--cache_dir DIR]

The cache is $NEXTN_CACHE_DIR, default ~/.cache/nextn/engines: one directory per checkpoint and build options (its
name is the cache key), beside a lock file whose mtime is the entry's last use. `list` prints each entry's key,
size, last use, dtype / quantization and the checkpoint it was built from (path, format, fingerprint). `clear`
removes only entries that validate as engines of the cache (a manifest that loads, no files it does not list) and
their lock files; anything else in the folder is left alone and named — a symbolic link or a file where an entry
belongs is listed with what it is and the command that removes it — and an entry another process holds (a build) is
kept. After every build the cache is held under $NEXTN_CACHE_MAX_GB (default 20 GB) by evicting the
least recently used engines.

Exit status: 0 done; 2 an unknown key or a bad argument.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

from nextn.cli.checkpoint_options import CACHE_DIR_ENV


def _days(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = float("nan")
    if not 0 <= value < 1e6:  # also refuses NaN
        raise argparse.ArgumentTypeError(f"must be a number of days >= 0, got {text!r}")
    return value


def add_arguments(p: argparse.ArgumentParser) -> None:
    sub = p.add_subparsers(dest="action", required=True)
    listing = sub.add_parser("list", help="each cached engine: key, size, last use, format, source checkpoint")
    clear = sub.add_parser("clear", help="remove cached engines (only engines of this cache, never other files)")
    for q in (listing, clear):
        q.add_argument("--cache_dir", type=Path,
                       help=f"the engine cache (default: ${CACHE_DIR_ENV}, else ~/.cache/nextn/engines)")
    which = clear.add_mutually_exclusive_group(required=True)
    which.add_argument("keys", nargs="*", default=[], metavar="KEY",
                       help="the entries to remove, by key (as `nextn cache list` prints it; a unique prefix of "
                            "at least 6 characters will do)")
    which.add_argument("--all", action="store_true", help="remove every engine of the cache")
    which.add_argument("--older_than", type=_days, metavar="DAYS", help="remove the engines unused for DAYS days")


def cache_root(args: argparse.Namespace) -> Path:
    from nextn.build.cache_entries import DEFAULT_CACHE_DIR

    return args.cache_dir or Path(os.environ.get(CACHE_DIR_ENV) or DEFAULT_CACHE_DIR)


def run(args: argparse.Namespace) -> int:
    if args.action == "clear" and not (args.all or args.keys or args.older_than is not None):
        print("nextn cache clear: error: give --all, --older_than DAYS or the KEYs to remove", file=sys.stderr)
        return 2
    root = cache_root(args)
    return _list(root) if args.action == "list" else _clear(root, args)


def _when(stamp: float) -> str:
    return time.strftime("%Y-%m-%d %H:%M", time.localtime(stamp)) if stamp else "never"


def _list(root: Path) -> int:
    from nextn.build.cache_entries import cache_cap_bytes, format_bytes, list_entries

    entries = list_entries(root)
    if not entries:
        print(f"{root}: no cached engines")
        return 0
    total = sum(e.num_bytes for e in entries if e.removable)
    print(f"{root}: {sum(e.removable for e in entries)} engine(s), {format_bytes(total)} (cap "
          f"{format_bytes(cache_cap_bytes())}), least recently used first")
    for e in entries:
        if e.manifest is None or e.problem:
            print(f"{e.key}  {format_bytes(e.num_bytes):>9}  left alone: {e.problem}")
            continue
        m = e.manifest
        fmt = f"{m.dtype}{f' {m.quant_config.quant_algo}' if m.quant_config else ''}"
        print(f"{e.key}  {format_bytes(e.num_bytes):>9}  last used {_when(e.last_used)}  {m.architecture} {fmt}\n"
              f"    from {m.source.path} ({m.source.format}, fingerprint {m.source.fingerprint[:16]})")
    return 0


def _select(root: Path, entries: list, args: argparse.Namespace) -> list:
    """The entries `clear` names. Raises EngineError for a key that names no entry or several."""
    from nextn.build.manifest import EngineError

    if args.all:
        return entries
    if args.older_than is not None:
        cutoff = time.time() - args.older_than * 86400
        return [e for e in entries if e.last_used < cutoff]
    chosen = []
    for key in args.keys:
        matches = [e for e in entries if e.key == key or (len(key) >= 6 and e.key.startswith(key))]
        if len(matches) != 1:
            why = "no entry" if not matches else f"{len(matches)} entries"
            raise EngineError(f"{key!r} names {why} of the engine cache {root}; "
                              "`nextn cache list` prints the keys")
        chosen.append(matches[0])
    return chosen


def _clear(root: Path, args: argparse.Namespace) -> int:
    from nextn.build.cache_entries import format_bytes, list_entries, remove_entry
    from nextn.build.manifest import EngineError

    entries = list_entries(root)
    chosen = _select(root, entries, args)
    freed, removed = 0, 0
    for e in chosen:
        if not e.removable:
            print(f"left alone: {e.path} ({e.problem})", file=sys.stderr)
            continue
        try:
            done = remove_entry(e)
        except EngineError as err:  # it changed since it was listed: named by remove_entry
            print(f"left alone: {err}", file=sys.stderr)
            continue
        except OSError as err:
            print(f"could not remove {e.path} ({err.strerror or err}): check its permissions, or remove it as a "
                  "user who may write there", file=sys.stderr)
            continue
        if done:
            removed, freed = removed + 1, freed + e.num_bytes
            print(f"removed {e.key} ({format_bytes(e.num_bytes)}, from {e.manifest.source.path})")
        else:
            print(f"kept {e.key}: another process holds it (a build or a load)", file=sys.stderr)
    print(f"{root}: removed {removed} engine(s), {format_bytes(freed)} freed")
    return 0
