"""What `fuzz_inputs.py`'s classes share: the per-class figures and report, the watchdog, the harness that runs one
input and files its outcome, and the base of a class (`Case`: `one(rng, tag)`, `close()`)."""

from __future__ import annotations

import contextlib
import io
import random
import signal
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

CLASSES = ("templates", "counts", "user_files", "trees", "outputs", "grammars")
BUILD_BOUND_S = 20.0  # a tiny build (about 0.02 s once imported) or its refusal


@dataclass
class ClassFigures:
    """One class's figures: inputs tried = clean_errors + accepted + failed."""

    tried: int = 0
    clean_errors: int = 0  # refused with a named error (or a usage error, exit status 2) with a message
    accepted: int = 0  # valid after all, and within every bound
    failed: int = 0
    seconds: float = 0.0  # wall time of its inputs, setup and checks included


@dataclass
class InputsFuzzReport:
    """Figures of one run (what docs/RELIABILITY.md quotes) and every failure, each with its input."""

    seed: int = 0
    seconds: float = 0.0
    classes: dict[str, ClassFigures] = field(default_factory=lambda: {c: ClassFigures() for c in CLASSES})
    failures: list[str] = field(default_factory=list)

    def summary(self) -> str:
        lines = [f"fuzz_inputs (seed {self.seed}): {self.seconds:.1f} s, {len(self.failures)} failures"]
        for name, c in self.classes.items():
            lines.append(f"  {name:<11} {c.tried:>5} tried, {c.clean_errors:>5} clean errors, {c.accepted:>5} "
                         f"accepted, {c.failed} failures ({c.seconds:.1f} s)")
        return "\n".join(lines)


class Hang(BaseException):
    """The watchdog fired: a call ran past its bound (a BaseException, so no `except Exception` swallows it)."""


@contextlib.contextmanager
def watchdog(seconds: float) -> Iterator[None]:
    """Raise `Hang` in the main thread after `seconds` (a blocked read or open is interrupted too); elsewhere a
    no-op (signals reach the main thread only)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def fire(signum, frame):
        raise Hang(f"still running after {seconds:g} s")

    previous = signal.signal(signal.SIGALRM, fire)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


class Harness:
    """Runs one input of a class and files the outcome in the report."""

    def __init__(self, report: InputsFuzzReport) -> None:
        self.report = report

    def fail(self, cls: str, label: str, why: str) -> None:
        self.report.failures.append(f"{cls}: {label[:300]}: {why[:400]}")

    def attempt(self, cls: str, label: str, fn: Callable[[], Any], named: tuple[type[BaseException], ...],
                bound_s: float, exit_2_is_named: bool = False, check: Callable[[Any], str | None] | None = None
                ) -> tuple[str, Any]:
        """Run `fn()` once as an input of `cls`; returns ("error" | "accepted" | "failed", its result).

        A clean error: an exception of `named` with a message (or SystemExit(2) with `exit_2_is_named`), within
        `bound_s` seconds. Accepted: `fn` returned within the bound and `check(result)` found nothing wrong (it
        returns a reason, or None). Anything else — another exception type, an empty message, a hang (the watchdog
        fires at 3 × `bound_s` + 5 s), a late answer — is a failure naming `label`.
        """
        figures = self.report.classes[cls]
        figures.tried += 1
        start = time.monotonic()
        outcome, result, why = "failed", None, ""
        try:
            with watchdog(3 * bound_s + 5):
                result = fn()
            why = (check(result) if check else None) or ""
            outcome = "failed" if why else "accepted"
        except Hang as e:
            why = f"hang: {e}"
        except SystemExit as e:
            if exit_2_is_named and e.code == 2:
                outcome = "error"
            else:
                why = f"SystemExit({e.code!r})"
        except named as e:
            if str(e).strip():
                outcome = "error"
            else:
                why = f"{type(e).__name__} without a message"
        except BaseException as e:  # noqa: BLE001 - anything else is a finding
            if isinstance(e, KeyboardInterrupt):
                raise
            why = f"unclean {type(e).__name__}: {e}"
        elapsed = time.monotonic() - start
        if outcome != "failed" and elapsed > bound_s:
            outcome, why = "failed", f"took {elapsed:.2f} s (bound {bound_s:g} s) and ended {outcome}"
        if outcome == "error":
            figures.clean_errors += 1
        elif outcome == "accepted":
            figures.accepted += 1
        else:
            figures.failed += 1
            self.fail(cls, label, why)
        return outcome, result

    def guard(self, cls: str, label: str, fn: Callable[[], Any], bound_s: float) -> Any:
        """Run a step that must simply work (setup, a follow-up check): a failure is recorded, not raised."""
        try:
            with watchdog(bound_s):
                return fn()
        except BaseException as e:  # noqa: BLE001
            if isinstance(e, KeyboardInterrupt):
                raise
            self.fail(cls, label, f"{type(e).__name__}: {e}")
            return None


def fresh_dir(root: Path) -> Path:
    """A new empty folder under `root` (a random 12-hex-digit name)."""
    d = root / uuid.uuid4().hex[:12]
    d.mkdir(parents=True)
    return d


def quiet(fn: Callable[..., Any], *args: Any) -> Any:
    """`fn(*args)` with its stdout and stderr swallowed (a CLI's usage message, a progress bar)."""
    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
        return fn(*args)


class Case:
    """One input class: `one(rng, tag)` makes a random input, runs it and checks its rule; `close()` releases what
    the class holds (a render worker, a tiny engine)."""

    name = ""

    def __init__(self, harness: Harness, root: Path) -> None:
        self.h, self.root = harness, root
        root.mkdir(parents=True, exist_ok=True)

    def one(self, rng: random.Random, tag: str) -> None:
        raise NotImplementedError

    def close(self) -> None:
        pass
