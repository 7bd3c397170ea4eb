"""A seeded, time-bounded fuzzer of issue 32's and 57's input classes: random variants (not a fixed list) of

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
   file there byte-identical afterwards, nothing created, nothing followed out of the folder;
6. `grammars` (issue 57): guided requests batched with plain neighbours (greedy and sampled, log-probabilities on
   and off, MTP drafts on), schemas that expand for seconds, floods of distinct schemas, grammars that match no
   output: neighbours' tokens unchanged, grammars kept, slow ones stopped at their budget by name, compiled
   grammars within the cache's bytes (`fuzz_inputs_grammars.py`).

Every input runs under a watchdog (SIGALRM) so that a regression fails instead of hanging.

    python -m nextn.testing.fuzz_inputs --seconds 60 [--seed 0]
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import random
import tempfile
import time
from pathlib import Path

from nextn.testing.fuzz_harness import CLASSES, Case, Harness, InputsFuzzReport
from nextn.testing.fuzz_inputs_cases import CountsCase, TemplatesCase, TreesCase, UserFilesCase
from nextn.testing.fuzz_inputs_grammars import GrammarsCase
from nextn.testing.fuzz_inputs_outputs import OutputsCase

#: The case of each class, by name.
CASES: dict[str, type[Case]] = {"templates": TemplatesCase, "counts": CountsCase, "user_files": UserFilesCase,
                                "trees": TreesCase, "outputs": OutputsCase, "grammars": GrammarsCase}


def make_cases(harness: Harness, root: Path, classes: tuple[str, ...]) -> dict[str, Case]:
    """One case object per name in `classes`, each working under `root / name`."""
    return {name: CASES[name](harness, root / name) for name in classes}


def fuzz_inputs(seconds: float = 25.0, seed: int = 0, workdir: str | Path | None = None,
                classes: tuple[str, ...] = CLASSES, min_tries: dict[str, int] | None = None) -> InputsFuzzReport:
    """Fuzz issue 32's classes for about `seconds` (plus one-off setup: a tiny engine, a render worker), seeded.

    Each turn runs one input of the class that has had the least time so far, so cheap classes get many inputs
    and slow ones (templates) their share; past `seconds`, classes run on until each has had one input, or
    `min_tries[class]` (so that what a class exercises does not depend on the machine's speed). Files are made under
    `workdir` (default: a temporary directory). Returns the figures and failures; raises nothing for a failing
    input.
    """
    floor = {c: max(1, (min_tries or {}).get(c, 1)) for c in classes}
    report = InputsFuzzReport(seed=seed)
    harness = Harness(report)
    rng = random.Random(seed)
    with contextlib.ExitStack() as stack:
        root = Path(workdir) if workdir is not None else Path(stack.enter_context(tempfile.TemporaryDirectory()))
        cases = make_cases(harness, root, classes)
        stack.callback(lambda: [c.close() for c in cases.values()])
        start = time.monotonic()
        turn = 0
        while True:
            short = [c for c in cases if report.classes[c].tried < floor[c]]
            if time.monotonic() - start >= seconds and not short:
                break
            pool = list(cases) if time.monotonic() - start < seconds else short
            name = min(pool, key=lambda c: (report.classes[c].seconds, report.classes[c].tried))
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
