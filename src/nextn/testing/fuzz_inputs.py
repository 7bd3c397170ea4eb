"""A seeded, time-bounded fuzzer of issue 32's input classes: random variants (not a fixed list) of

1. `templates`: hostile chat templates (nested loops of random sizes, string/list multiplication by huge ints,
   doubling loops, `**`, join/replace/center growth, self-calling macros, huge outputs) rendered by the bounded
   renderer (runtime/template_render.py) under a short budget: each finishes or raises ChatTemplateError within the
   budget plus slack, and a good template still renders right afterwards;
2. `counts`: hostile values and types of every count in the LLM arguments (parsed, and through a YAML file) and in
   a tiny GGUF's metadata and token list, built by `build-engine`: a named error or an engine, within a bound,
   nothing left beside the output;
3. `user_files`: every reader of a user-named path given /dev/zero, a FIFO, a directory, links to those, a sparse
   file past its cap, a gzip bomb, bad UTF-8, deep JSON: a named error within seconds, never a hang;
4. `trees`: random eagle_choices / medusa_choices (to 20,000 nodes, 100 deep, ranks to 2**31, duplicates, missing
   parents, wrong types): LlmArgsError or a tree within the caps, then the load-time rank check on a tiny engine;
5. `outputs`: user files, links out of the folder and the inputs placed where every writing command writes
   (build-engine, train-draft, token-map, triton-repo, make-checkpoint, nextn-bench, bench modules): refused, every
   file there byte-identical afterwards, nothing created, nothing followed out of the folder.

Every input runs under a watchdog (SIGALRM) so that a regression fails instead of hanging.

    python -m nextn.testing.fuzz_inputs --seconds 60 [--seed 0]
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import random
import signal
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

CLASSES = ("templates", "counts", "user_files", "trees", "outputs")


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


def fuzz_inputs(seconds: float = 25.0, seed: int = 0, workdir: str | Path | None = None,
                classes: tuple[str, ...] = CLASSES) -> InputsFuzzReport:
    """Fuzz issue 32's classes for about `seconds` (plus one-off setup: a tiny engine, a render worker), seeded.

    Each turn runs one input of the class that has had the least time so far, so cheap classes get many inputs
    and slow ones (templates) their share. Files are made under `workdir` (default: a temporary directory).
    Returns the figures and failures; raises nothing for a failing input.
    """
    from nextn.testing.fuzz_inputs_cases import make_cases

    report = InputsFuzzReport(seed=seed)
    harness = Harness(report)
    rng = random.Random(seed)
    with contextlib.ExitStack() as stack:
        root = Path(workdir) if workdir is not None else Path(stack.enter_context(tempfile.TemporaryDirectory()))
        cases = make_cases(harness, root, classes)
        stack.callback(lambda: [c.close() for c in cases.values()])
        start = time.monotonic()
        turn = 0
        while time.monotonic() - start < seconds or any(report.classes[c].tried == 0 for c in cases):
            name = min(cases, key=lambda c: (report.classes[c].seconds, report.classes[c].tried))
            turn += 1
            began = time.monotonic()
            cases[name].one(random.Random(rng.getrandbits(64)), f"#{turn}")
            report.classes[name].seconds += time.monotonic() - began
        report.seconds = time.monotonic() - start
    return report


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--seconds", type=float, default=60.0)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--classes", nargs="+", choices=CLASSES, default=list(CLASSES))
    args = ap.parse_args(argv)
    logging.getLogger("nextn").setLevel(logging.CRITICAL)  # refusals and notes log by design
    report = fuzz_inputs(args.seconds, args.seed, classes=tuple(args.classes))
    print(report.summary())
    for failure in report.failures[:30]:
        print("  FAIL", failure)
    return 1 if report.failures else 0


if __name__ == "__main__":
    raise SystemExit(main())
