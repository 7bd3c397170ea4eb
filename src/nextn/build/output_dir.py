"""Where `build-engine` may write: the output directory check and the staging directory swapped into place.

The rule (a user's files are never removed):
- a missing `output_dir` is created, an empty one is used;
- a non-empty one is replaced only when it is provably an nextn engine — its manifest.json validates as an
  `EngineManifest` — and then only the files that manifest lists (manifest.json, weights, tokenizer and aux files,
  compiled artifacts) are removed; any other file there is refused by name unless `force`;
- anything else (a project directory with its own manifest.json, a file, a symbolic link, the checkpoint itself or a
  directory holding it) is refused, `force` or not.
The engine is written into `.NAME.building-XXXX` beside `output_dir` and renamed into place when complete; the old
engine is renamed aside first and then removed file by file (the files found at the check, nothing else). A failed
build removes its staging directory and the parent directories it created, and leaves `output_dir` as it was.
`build-engine` also holds `output_lock` (a second build into the same directory is refused) and turns SIGTERM and
SIGHUP into an exception like Ctrl-C (`signals_interrupt_build`), so those clean up the same way.
"""

from __future__ import annotations

import logging
import os
import shutil
import signal
import tempfile
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

from nextn.build.file_lock import lock_file
from nextn.build.manifest import MANIFEST_NAME, EngineError, EngineManifest

logger = logging.getLogger(__name__)

#: How many unlisted files an error message names before "and N more".
SHOWN_FILES = 10


@dataclass
class Replacement:
    """What replacing `output_dir` removes: its files and directories, relative, found at the check."""

    files: list[str] = field(default_factory=list)  # regular files and symbolic links (never followed)
    dirs: list[str] = field(default_factory=list)  # sub-directories, deepest first


def _walk(root: Path) -> Replacement:
    found = Replacement()
    for dirpath, dirnames, filenames in os.walk(root, followlinks=False):
        rel = Path(dirpath).relative_to(root)
        for d in list(dirnames):
            if (Path(dirpath) / d).is_symlink():
                found.files.append((rel / d).as_posix())  # a link to a directory is removed as a link
                dirnames.remove(d)
            else:
                found.dirs.append((rel / d).as_posix())
        found.files += [(rel / f).as_posix() for f in filenames]
    found.dirs.sort(key=lambda d: d.count("/"), reverse=True)
    return found


def _names(paths: list[str]) -> str:
    more = f" and {len(paths) - SHOWN_FILES} more" if len(paths) > SHOWN_FILES else ""
    return ", ".join(paths[:SHOWN_FILES]) + more


def plan_output_dir(output_dir: Path, model_dir: Path, force: bool = False) -> Replacement | None:
    """Check that `output_dir` may receive an engine; return what replacing it removes (None: it does not exist).

    Raises:
        EngineError: `output_dir` is or contains the checkpoint, is a symbolic link or not a directory, is not empty
            and not an nextn engine, or is an engine that also holds files its manifest does not list (without
            `force`); the message names the files and the way out.
    """
    out, src = output_dir.resolve(), model_dir.resolve()
    if out == src or out in src.parents:
        raise EngineError(f"--output_dir {output_dir} contains the checkpoint {model_dir}; choose another --output_dir")
    if output_dir.is_symlink():
        raise EngineError(f"--output_dir {output_dir} is a symbolic link; pass the directory it points to")
    if not output_dir.exists():
        return None
    if not output_dir.is_dir():
        raise EngineError(f"{output_dir} exists and is not a directory (nor an nextn engine); choose another "
                          "--output_dir")
    found = _walk(output_dir)
    if not found.files and not found.dirs:
        return found
    try:
        manifest = EngineManifest.load(output_dir)
    except EngineError as e:
        raise EngineError(
            f"{output_dir} is not empty and is not an nextn engine ({e}); build-engine only replaces engines it "
            "wrote, so nothing was changed: choose another --output_dir, or move its contents away yourself"
        ) from None
    listed = {MANIFEST_NAME, *manifest.data_files()}
    parents = {p.as_posix() for f in listed for p in Path(f).parents if p != Path(".")}
    extra = [f for f in found.files if f not in listed]
    extra += [d + "/" for d in found.dirs if d not in parents and not any(f.startswith(d + "/") for f in extra)]
    if extra and not force:
        raise EngineError(
            f"{output_dir} is an nextn engine but also holds {len(extra)} file(s) its manifest does not list: "
            f"{_names(sorted(extra))}. Replacing the engine would remove them, so nothing was changed: move them "
            "away, choose another --output_dir, or pass --force to remove them"
        )
    if extra:
        logger.warning("--force: replacing %s also removes %s", output_dir, _names(sorted(extra)))
    return found


@contextmanager
def staging_dir(output_dir: Path, replaced: Replacement | None) -> Iterator[Path]:
    """Yield an empty directory beside `output_dir`; on success swap it into place, on failure delete it.

    `replaced` (from `plan_output_dir`) is what the old `output_dir` held; exactly that is removed after the swap.
    Parent directories created for `output_dir` are removed again when the build fails.
    """
    created = [p for p in output_dir.absolute().parents if not p.exists()]
    output_dir.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{output_dir.name}.building-", dir=output_dir.parent))
    ok = False
    try:
        yield staging
        if output_dir.exists():
            old = output_dir.parent / f".{output_dir.name}.old-{uuid.uuid4().hex[:8]}"
            os.replace(output_dir, old)
            try:
                os.replace(staging, output_dir)
            except BaseException:
                os.replace(old, output_dir)
                raise
            _remove(old, replaced or Replacement())
        else:
            os.replace(staging, output_dir)
        ok = True
    finally:
        if staging.exists():
            shutil.rmtree(staging, ignore_errors=True)
        if not ok:
            for p in created:  # nearest first
                try:
                    p.rmdir()
                except OSError:
                    break


def _remove(old: Path, replaced: Replacement) -> None:
    """Remove the listed files and directories of a swapped-out engine; leave (and name) anything else."""
    for f in replaced.files:
        try:
            (old / f).unlink()
        except FileNotFoundError:
            pass
    for d in replaced.dirs:
        try:
            (old / d).rmdir()
        except OSError:
            pass
    try:
        old.rmdir()
    except OSError:
        logger.warning("kept %s: it holds files that appeared while the engine was built", old)


@contextmanager
def output_lock(output_dir: Path) -> Iterator[None]:
    """Hold an exclusive lock on `output_dir` for one build: `.NAME.lock` beside it (flock), removed afterwards.

    A second build into the same directory is refused rather than queued (both would otherwise "succeed", the
    second swapping its engine over the first's).

    Raises:
        EngineError: another build holds the lock (the message names the lock file).
    """
    output_dir = Path(output_dir)
    parent = output_dir.absolute().parent
    created = [p for p in (parent, *parent.parents) if not p.exists()]  # deepest first
    parent.mkdir(parents=True, exist_ok=True)
    lock_path = parent / f".{output_dir.name}.lock"
    fd = lock_file(lock_path, wait=False)
    if fd is None:
        raise EngineError(f"another build-engine is writing {output_dir} (it holds {lock_path}); wait for it to "
                          "finish or choose another --output_dir")
    try:
        yield
    finally:
        try:
            os.unlink(lock_path)  # while still held: a waiter re-checks the inode
        except FileNotFoundError:
            pass
        os.close(fd)
        for p in created:  # the parents made for the lock, when a refused or failed build left them empty
            try:
                p.rmdir()
            except OSError:
                break


class BuildInterrupted(BaseException):
    """SIGTERM or SIGHUP during a build, raised in the main thread so that the staging directory is removed as for
    Ctrl-C (a BaseException like KeyboardInterrupt: no `except Exception` swallows it)."""

    def __init__(self, signum: int) -> None:
        super().__init__(f"interrupted by {signal.Signals(signum).name}")
        self.signum = signum


@contextmanager
def signals_interrupt_build() -> Iterator[None]:
    """Turn SIGTERM and SIGHUP into `BuildInterrupted` while the block runs (main thread only; the previous
    handlers are restored afterwards)."""
    import threading

    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def handler(signum, frame):
        raise BuildInterrupted(signum)

    previous = {sig: signal.signal(sig, handler) for sig in (signal.SIGTERM, signal.SIGHUP)}
    try:
        yield
    finally:
        for sig, old in previous.items():
            signal.signal(sig, old)
