"""How far to believe a suffix tree's path probabilities: the expected accepted drafts of a proposal, calibrated by
what verification accepted, pooled over every request of the engine.

A suffix tree's path probability is a ratio of counts (suffix_tree.py): a continuation seen once has probability 1,
and a chain along a path seen once stays at 1 however deep. Measured against what greedy verification accepts, the
first draft's probability is too high after a short context match and too low after a long one, and deep drafts
are accepted far less often than their path probability says (Qwen2.5-Coder-1.5B's greedy outputs replayed through
the drafter, `benchmarks/suffix_replay.py` streams; first-draft acceptance over path probability, MT-bench / HumanEval /
code_edit: match 1 → 0.41 / 0.46 / 0.43, match 2 → 0.62 / 0.76 / 0.71, 3–4 → 0.79 / 0.80 / 0.95, 5–8 → 1.0 / 0.94 /
1.2, 9–16 → 1.4 / 1.5 / 1.9). A draft length chosen from such estimates verifies drafts that miss, which on a CPU
whose verified rows cost nearly a plain token each (batch ≥ 4) makes speculation slower than plain decoding.

    cells        (match-length bucket, draft-index bucket): match 1, 2, 3–4, 5–8, 9–16, 17+; draft 1, 2, 3–4, 5–8, 9+
    ratio        per cell, (A + s · prior) / (P + s): A the drafts accepted, P the sum of their path probabilities,
                 both decayed by `decay` per observation (an estimate over roughly the last 1 / (1 − decay)
                 verified drafts of the cell), s the prior's weight in drafts; the prior by match length is the
                 table above, rounded down
    calibrated   q_j = min(q_(j−1), max_prob, factor · ratio(cell of j) · p_j): a draft is never likelier than the
                 one before it (it is accepted only if that one is) nor certain; gains are the running sums
    unverified   a proposal the step does not verify decays its first cell's evidence once, so a cell whose drafts
                 stopped paying (and so stopped being verified) drifts back to the prior and is tried again: stale
                 evidence never locks speculation out

Pooled per engine, not per request: a request's own evidence is a handful of steps, the workload's is thousands.
The request's own deviation is the drafter's per-request factor (suffix.py).
"""

from __future__ import annotations

from bisect import bisect_left
from collections.abc import Sequence

from nextn.speculative.suffix_tree import MAX_DEPTH

MATCH_BOUNDS = (1, 2, 4, 8, 16)  # upper bounds of the match-length buckets (the last bucket: longer)
DEPTH_BOUNDS = (0, 1, 3, 7)  # upper bounds of the draft-index buckets (0-based; the last: deeper)
PRIOR = (0.4, 0.6, 0.8, 1.0, 1.3, 1.5)  # first-draft acceptance over path probability, per match bucket
_DEPTH_OF = [bisect_left(DEPTH_BOUNDS, j) for j in range(MAX_DEPTH)]  # draft index → its bucket (K ≤ MAX_DEPTH)


class AcceptanceCalibration:
    """Pooled calibration of suffix-tree proposals (module docstring).

    Args:
        prior: the ratio per match-length bucket before evidence (len(MATCH_BOUNDS) + 1 values > 0).
        strength: the prior's weight, in drafts (> 0).
        decay: per observation of a cell, in (0, 1].
        max_prob: the highest calibrated probability of a draft, in (0, 1].
    Raises:
        ValueError: an argument out of range.
    """

    def __init__(self, prior: Sequence[float] = PRIOR, strength: float = 8.0, decay: float = 0.995,
                 max_prob: float = 0.99) -> None:
        if len(prior) != len(MATCH_BOUNDS) + 1 or min(prior) <= 0:
            raise ValueError(f"prior must hold {len(MATCH_BOUNDS) + 1} positive ratios, got {list(prior)}")
        if strength <= 0 or not 0 < decay <= 1 or not 0 < max_prob <= 1:
            raise ValueError(f"strength must be > 0, decay and max_prob in (0, 1]; got {strength}, {decay}, {max_prob}")
        self.prior, self.strength, self.decay, self.max_prob = tuple(prior), strength, decay, max_prob
        cells = (len(MATCH_BOUNDS) + 1, len(DEPTH_BOUNDS) + 1)
        self.accepted = [[0.0] * cells[1] for _ in range(cells[0])]  # A per (match bucket, draft bucket)
        self.predicted = [[0.0] * cells[1] for _ in range(cells[0])]  # P

    @staticmethod
    def _bucket(match_len: int) -> int:
        return bisect_left(MATCH_BOUNDS, match_len)

    def ratio(self, match_len: int, j: int) -> float:
        """Accepted over predicted for draft j (0-based) of a proposal continuing a match of `match_len` tokens."""
        m, d = self._bucket(match_len), bisect_left(DEPTH_BOUNDS, j)
        return (self.accepted[m][d] + self.strength * self.prior[m]) / (self.predicted[m][d] + self.strength)

    def _ratios(self, match_len: int, n: int) -> list[float]:
        m = self._bucket(match_len)
        a, p, prior, s = self.accepted[m], self.predicted[m], self.prior[m], self.strength
        cell = [(x + s * prior) / (y + s) for x, y in zip(a, p)]
        return [cell[d] for d in _DEPTH_OF[:n]]

    def gains(self, probs: Sequence[float], match_len: int, factor: float = 1.0) -> list[float]:
        """Calibrated expected accepted drafts of verifying the first j + 1 drafts, for each j.

        Args:
            probs: each draft's path probability (the tree's, suffix_tree.Proposal: gains[j] − gains[j − 1]).
            match_len: the length of the context match the proposal continues (≥ 1).
            factor: the request's own correction (> 0).
        Returns:
            len(probs) non-decreasing floats, each step ≤ max_prob and ≤ the step before.
        """
        out, q, prev = [], 0.0, self.max_prob
        for r, p in zip(self._ratios(match_len, len(probs)), probs):
            prev = min(prev, factor * r * p)
            q += prev
            out.append(q)
        return out

    def expected(self, probs: Sequence[float], match_len: int, k: int) -> float:
        """The pooled estimate of accepted drafts among the first k, before any request's factor or cap."""
        return sum(r * p for r, p in zip(self._ratios(match_len, k), probs[:k]))

    def observe(self, probs: Sequence[float], match_len: int, k: int, accepted: int) -> None:
        """A step verified the first k drafts of the proposal (path probabilities `probs`) and accepted `accepted`;
        k = 0: it did not verify it (the first cell's evidence decays once)."""
        m = self._bucket(match_len)
        a, p, decay = self.accepted[m], self.predicted[m], self.decay
        if k == 0:
            if probs:
                a[0] *= decay
                p[0] *= decay
            return
        for j, d in enumerate(_DEPTH_OF[:min(k, len(probs))]):
            a[d] = a[d] * decay + (j < accepted)
            p[d] = p[d] * decay + probs[j]
