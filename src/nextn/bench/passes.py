"""Whether a benchmark's figures can be trusted: the spread of its repeated timed passes, and the speed-up verdict.

A speculative step emits on average AL tokens (acceptance length) for at least the cost of a plain step (it
verifies K + 1 tokens where a plain step computes one), so the speed-up over no speculation can never exceed the
AL. A measured speed-up above the AL says the passes ran on a different machine state (a busy CPU, OpenMP
threads spinning against other processes, a cold first pass), never that speculation did better than possible:
such a figure is refused, as `nextn demo` refuses it (src/nextn/cli/demo.py).
"""

from __future__ import annotations

import os
import statistics
from dataclasses import dataclass

#: Default of `--max_spread`: passes whose output tokens/s differ by more than this fraction of their median are
#: reported as disagreeing (the machine was noisy).
DEFAULT_MAX_SPREAD = 0.10
#: A speed-up up to AL · (1 + SPEEDUP_TOLERANCE) is accepted (timer and scheduling noise); above it, refused.
SPEEDUP_TOLERANCE = 0.05


def load_average() -> float | None:
    """The 1-minute load average of the machine (runnable processes), or None where the OS has none."""
    try:
        return os.getloadavg()[0]
    except (OSError, AttributeError):
        return None


@dataclass(frozen=True)
class PassSpread:
    """The output tokens/s of a run's timed passes and how far they disagree.

    Attributes:
        tok_s: output tokens/s of every timed pass, in the order run.
        load_before, load_after: 1-minute load average before the first timed pass and after the last (None: unknown).
        cpu_cores: `os.cpu_count()`, to read the load against.
        torch_threads: torch's intra-op threads during the run.
    """

    tok_s: tuple[float, ...]
    load_before: float | None = None
    load_after: float | None = None
    cpu_cores: int | None = None
    torch_threads: int | None = None

    @property
    def minimum(self) -> float:
        return min(self.tok_s)

    @property
    def median(self) -> float:
        return statistics.median(self.tok_s)

    @property
    def maximum(self) -> float:
        return max(self.tok_s)

    @property
    def relative_spread(self) -> float | None:
        """(max − min) / median of the passes' tokens/s; None with a single pass (no spread can be measured)."""
        if len(self.tok_s) < 2:
            return None
        return (self.maximum - self.minimum) / self.median if self.median > 0 else float("inf")

    def disagrees(self, max_spread: float) -> bool:
        """Whether the passes differ by more than `max_spread` (a fraction of their median)."""
        spread = self.relative_spread
        return spread is not None and spread > max_spread

    def passes_text(self) -> str:
        """e.g. '11.61 / 20.30 / 33.96' (output tokens/s of each pass, in order)."""
        return " / ".join(f"{t:.2f}" for t in self.tok_s)

    def noise_text(self) -> str:
        """The machine's load while the passes ran, e.g. 'load average 4.27 before, 7.18 after, on 2 cores with 2
        torch threads'."""
        def fmt(x: float | None) -> str:
            return "unknown" if x is None else f"{x:.2f}"

        text = f"load average {fmt(self.load_before)} before, {fmt(self.load_after)} after"
        if self.cpu_cores:
            text += f", on {self.cpu_cores} cores"
            n = self.torch_threads
            text += f" with {n} torch thread{'s' if n != 1 else ''}" if n else ""
        return text

    def busy(self) -> bool:
        """Whether other processes competed for the cores: load + torch threads above the core count (before or
        after; the run's own threads count once in the load)."""
        if not self.cpu_cores:
            return False
        loads = [x for x in (self.load_before, self.load_after) if x is not None]
        return any(x + (self.torch_threads or 1) > self.cpu_cores + 0.5 for x in loads)

    def to_dict(self) -> dict:
        return {"num_passes": len(self.tok_s), "output_throughput_tok_s": list(self.tok_s),
                "minimum": self.minimum, "median": self.median, "maximum": self.maximum,
                "relative_spread": self.relative_spread, "load_average_before": self.load_before,
                "load_average_after": self.load_after, "cpu_cores": self.cpu_cores,
                "torch_threads": self.torch_threads}


def spread_warning(label: str, spread: PassSpread, max_spread: float) -> str | None:
    """The warning for passes that disagree by more than `max_spread`, or None when they agree."""
    if not spread.disagrees(max_spread):
        return None
    if spread.busy():
        advice = "other processes competed for the cores: rerun on an idle machine" + (
            ", or with --num_threads 1" if (spread.torch_threads or 1) > 1 else "")
    else:
        advice = "rerun with more --passes, or on an idle machine"
    return (f"warning: the {len(spread.tok_s)} timed passes of {label} disagree by {spread.relative_spread:.0%} "
            f"(output tokens/s {spread.passes_text()}; more than --max_spread {max_spread:.0%}); machine noise: "
            f"{spread.noise_text()}; {advice}")


@dataclass(frozen=True)
class SpeedUp:
    """A speculative run against the baseline (no speculation), from their fastest passes.

    Attributes:
        ratio: measured speculative / baseline output tokens/s.
        acceptance_length: the speculative run's global AL (Σ output / Σ iterations).
        reliable: False when `ratio` exceeds the AL beyond SPEEDUP_TOLERANCE (impossible: the figure is refused) or
            either side's passes disagree by more than the allowed spread.
        reason: why it is unreliable (None when reliable).
    """

    ratio: float
    acceptance_length: float
    reliable: bool
    reason: str | None
    impossible: bool

    @property
    def shown(self) -> float | None:
        """The speed-up to print as a result: None when it is impossible (above the AL)."""
        return None if self.impossible else self.ratio

    def to_dict(self, baseline_tok_s: float) -> dict:
        return {"baseline_output_throughput_tok_s": baseline_tok_s, "speed_up": self.shown,
                "measured_ratio": self.ratio, "acceptance_length": self.acceptance_length,
                "reliable": self.reliable, "unreliable_reason": self.reason}


def speed_up(spec_tok_s: float, base_tok_s: float, acceptance_length: float, spec: PassSpread | None = None,
             base: PassSpread | None = None, max_spread: float = DEFAULT_MAX_SPREAD) -> SpeedUp:
    """Judge the speed-up `spec_tok_s / base_tok_s` (output tokens/s) of a run with acceptance length
    `acceptance_length` (≥ 1) against its bound and the spread of both runs' passes."""
    ratio = spec_tok_s / base_tok_s if base_tok_s > 0 else float("inf")
    impossible = ratio > acceptance_length * (1 + SPEEDUP_TOLERANCE)
    reasons = []
    if impossible:
        reasons.append(f"the measured {ratio:.3f}x exceeds the AL {acceptance_length:.3f}, which speculation cannot "
                       "do (a step emits AL tokens on average for at least a plain step's cost)")
    for name, s in (("baseline", base), ("speculative", spec)):
        if s is not None and s.disagrees(max_spread):
            reasons.append(f"the {name} passes disagree by {s.relative_spread:.0%}")
    return SpeedUp(ratio, acceptance_length, not reasons, "; ".join(reasons) or None, impossible)
