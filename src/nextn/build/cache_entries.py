"""The engine cache's entries: their locks and last use, listing, removal, and the size cap (LRU eviction).

An entry is `<cache>/<key>/` (key: 20 hex characters, `engine_cache.cache_key`) beside its lock file
`<cache>/<key>.lock`. Every use of an entry touches the lock file, so its mtime is the entry's last use. Only an
entry that *validates* is ever removed: a 20-hex-named real directory (not a link) whose manifest loads and which
holds nothing but the files its manifest lists — then the directory and its lock file go, nothing else; anything
else in the cache folder (a user's file, a build's staging directory, a broken entry) is listed and left alone.
Removal takes the entry's lock without waiting: an entry another process holds (a build, a load) is kept. A
symbolic link or a file where an entry belongs is listed with what it is and what to do, and never removed.
"""

from __future__ import annotations

import logging
import math
import os
import re
import shutil
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from nextn.build.file_lock import lock_file
from nextn.build.manifest import MANIFEST_NAME, EngineError, EngineManifest

#: where built engines live unless a cache dir is given (`LLM(engine_cache_dir=...)`, $NEXTN_CACHE_DIR)
DEFAULT_CACHE_DIR = Path.home() / ".cache" / "nextn" / "engines"

logger = logging.getLogger(__name__)

#: Size cap of the cache when $NEXTN_CACHE_MAX_GB is not set, GB (10^9 bytes).
DEFAULT_CACHE_MAX_GB = 20.0
#: The environment variable that sets the cap (read here: `LLM(path)` builds through the cache without the CLI).
CACHE_MAX_GB_ENV = "NEXTN_CACHE_MAX_GB"
KEY_PATTERN = re.compile(r"[0-9a-f]{20}")


def cache_cap_bytes() -> int:
    """The cache's size cap in bytes: $NEXTN_CACHE_MAX_GB (GB, > 0; `inf` for none) or `DEFAULT_CACHE_MAX_GB`.

    Raises:
        EngineError: $NEXTN_CACHE_MAX_GB is not a positive number.
    """
    text = os.environ.get(CACHE_MAX_GB_ENV, "").strip()
    if not text:
        return int(DEFAULT_CACHE_MAX_GB * 1e9)
    try:
        gb = float(text)
    except ValueError:
        gb = float("nan")
    if not gb > 0:  # also refuses NaN
        raise EngineError(f"${CACHE_MAX_GB_ENV} must be a positive number of GB (or inf), got {text!r}")
    return int(gb * 1e9) if math.isfinite(gb) else 2**63


def lock_path(root: Path, key: str) -> Path:
    return Path(root) / f"{key}.lock"


@contextmanager
def entry_lock(root: Path, key: str, wait: bool = True) -> Iterator[bool]:
    """Hold the exclusive lock of entry `key` (flock on `<root>/<key>.lock`, created when missing); yields True, or
    False without waiting when `wait` is false and another process holds it. Re-checks the file after locking, as
    removal unlinks it while held."""
    fd = lock_file(lock_path(root, key), wait)
    if fd is None:
        yield False
        return
    try:
        yield True
    finally:
        os.close(fd)


def mark_used(root: Path, key: str) -> None:
    """Record a use of entry `key` now (its lock file's mtime)."""
    path = lock_path(root, key)
    path.touch()
    os.utime(path)


@dataclass(frozen=True)
class CacheEntry:
    """One directory of the cache.

    Attributes:
        key: the directory's name.
        path: the directory.
        num_bytes: bytes of its files (links not followed).
        last_used: seconds since the epoch (its lock file's mtime, else the manifest's).
        manifest: the engine's manifest; None when the entry does not validate.
        problem: why it does not validate (it is then never removed), else None.
    """

    key: str
    path: Path
    num_bytes: int
    last_used: float
    manifest: EngineManifest | None
    problem: str | None

    @property
    def removable(self) -> bool:
        return self.problem is None


def _files(root: Path) -> tuple[list[str], list[str], int]:
    """Relative files (links included, not followed) and directories under `root`, and the files' bytes."""
    files, dirs, size = [], [], 0
    for dirpath, dirnames, filenames in os.walk(root, followlinks=False):
        rel = Path(dirpath).relative_to(root)
        for d in list(dirnames):
            if (Path(dirpath) / d).is_symlink():
                files.append((rel / d).as_posix())
                dirnames.remove(d)
            else:
                dirs.append((rel / d).as_posix())
        for f in filenames:
            files.append((rel / f).as_posix())
            try:
                size += (Path(dirpath) / f).lstat().st_size
            except OSError:  # removed meanwhile (a build swapping the entry, another `nextn cache clear`)
                pass
    return files, dirs, size


def read_entry(path: Path) -> CacheEntry:
    """The entry at `path` (a directory of the cache), validated: see the module docstring. Its `problem` says what
    it is when the cache did not make it (a symbolic link, a file) and what to do."""
    files, dirs, size = _files(path) if path.is_dir() and not path.is_symlink() else ([], [], 0)
    manifest, problem = None, None
    if path.is_symlink():
        try:
            target = os.readlink(path)
        except OSError:
            target = "?"
        problem = (f"a symbolic link (to {target}), not a directory this cache made; nextn never removes it: "
                   f"remove the link yourself (rm {path}) if it is not wanted")
    elif not path.is_dir():
        problem = (f"a file, not an engine directory this cache made; nextn never removes it: move or remove it "
                   f"yourself (rm {path}), the next load of its checkpoint rebuilds the engine there")
    elif not KEY_PATTERN.fullmatch(path.name):
        problem = "not named as a cache key"
    else:
        try:
            manifest = EngineManifest.load(path)
        except EngineError as e:
            problem = f"not a valid engine: {e}"
    if manifest is not None:
        listed = {MANIFEST_NAME, *manifest.data_files()}
        parents = {p.as_posix() for f in listed for p in Path(f).parents if p != Path(".")}
        extra = [f for f in files if f not in listed] + [d + "/" for d in dirs if d not in parents]
        if extra:
            problem = f"holds {len(extra)} file(s) its manifest does not list ({', '.join(sorted(extra)[:3])})"
    lock = lock_path(path.parent, path.name)
    stamp = lock if lock.is_file() else path / MANIFEST_NAME
    try:
        last_used = stamp.stat().st_mtime
    except OSError:
        last_used = 0.0
    return CacheEntry(path.name, path, size, last_used, manifest, problem)


def list_entries(root: Path) -> list[CacheEntry]:
    """Every directory of the cache `root` (none when it does not exist), and every link or file named as a key
    (where an entry belongs: listed, never removed), least recently used first. Lock files and other files are not
    entries; a build's staging directory and a damaged entry being removed (dot names) are skipped.

    Raises:
        EngineError: `root` is not a directory, or cannot be read.
    """
    root = Path(root)
    if not root.exists():
        return []
    if not root.is_dir():
        raise EngineError(f"the engine cache {root} is not a directory; pass the cache folder (--cache_dir, "
                          "$NEXTN_CACHE_DIR)")
    try:
        paths = [p for p in root.iterdir() if not p.name.startswith(".") and not p.name.endswith(".lock")
                 and (p.is_dir() or p.is_symlink() or KEY_PATTERN.fullmatch(p.name))]
    except OSError as e:
        raise EngineError(f"cannot read the engine cache {root}: {e.strerror or e}") from None
    return sorted((read_entry(p) for p in paths), key=lambda e: (e.last_used, e.key))


def remove_entry(entry: CacheEntry) -> bool:
    """Remove a validated entry and its lock file; False (nothing removed) when another process holds its lock.

    Raises:
        EngineError: the entry does not validate (it is never removed).
    """
    if not entry.removable:
        raise EngineError(f"{entry.path} is not an engine of this cache ({entry.problem}); it was left alone")
    root = entry.path.parent
    with entry_lock(root, entry.key, wait=False) as held:
        if not held:
            return False
        again = read_entry(entry.path)  # as it is now, under the lock
        if not again.removable:
            raise EngineError(f"{entry.path} is not an engine of this cache ({again.problem}); it was left alone")
        shutil.rmtree(entry.path)
        lock_path(root, entry.key).unlink(missing_ok=True)  # while held: a waiter re-checks the file
    return True


def format_bytes(n: float) -> str:
    for unit in ("B", "KB", "MB", "GB"):
        if n < 1000 or unit == "GB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1000
    return f"{n:.1f} GB"


def evict_lru(root: Path, max_bytes: int, keep: str) -> list[CacheEntry]:
    """Remove least-recently-used valid entries of `root` until the cache's entries total at most `max_bytes`;
    never `keep` (the entry just built or used), an entry locked by another process, or one that does not
    validate. Logs one line naming what was evicted. Returns the evicted entries."""
    entries = list_entries(root)
    total = sum(e.num_bytes for e in entries)
    evicted = []
    for entry in entries:
        if total <= max_bytes:
            break
        if entry.key == keep or not entry.removable:
            continue
        try:
            if remove_entry(entry):
                evicted.append(entry)
                total -= entry.num_bytes
        except (EngineError, OSError) as e:
            logger.warning("engine cache: could not evict %s: %s", entry.path, e)
    if evicted:
        names = "; ".join(f"{e.key} ({format_bytes(e.num_bytes)}, {e.manifest.source.path}, last used "
                          f"{time.strftime('%Y-%m-%d %H:%M', time.localtime(e.last_used))})" for e in evicted)
        logger.warning("engine cache %s over its %s cap: evicted %d least-recently-used engine(s): %s (now %s; set "
                       "$%s to change the cap)", root, format_bytes(max_bytes), len(evicted), names,
                       format_bytes(total), CACHE_MAX_GB_ENV)
    return evicted
