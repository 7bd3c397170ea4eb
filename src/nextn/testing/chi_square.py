"""The two-sample chi-square test that nextn's distribution tests use (sampling keeps the target distribution)."""

from __future__ import annotations

import math
from collections import Counter


def chi_square_two_sample_pvalue(a: Counter, b: Counter) -> float:
    """p-value that two samples come from one categorical distribution (pooled expected counts; categories with
    an expected count below 5 merged; Wilson–Hilferty approximation of the chi-square tail).

    Args:
        a, b: counts per category (token id) of the two samples.
    Returns:
        The p-value in [0, 1]: small when the samples' distributions differ.
    """
    na, nb = sum(a.values()), sum(b.values())
    cats = set(a) | set(b)
    big = [c for c in cats if (a[c] + b[c]) * min(na, nb) / (na + nb) >= 5]
    rest_a, rest_b = na - sum(a[c] for c in big), nb - sum(b[c] for c in big)
    rows = [(a[c], b[c]) for c in big] + ([(rest_a, rest_b)] if rest_a + rest_b else [])
    stat = 0.0
    for x, y in rows:
        tot = x + y
        ea, eb = tot * na / (na + nb), tot * nb / (na + nb)
        stat += (x - ea) ** 2 / ea + (y - eb) ** 2 / eb
    df = max(len(rows) - 1, 1)
    z = ((stat / df) ** (1 / 3) - (1 - 2 / (9 * df))) / math.sqrt(2 / (9 * df))
    return 0.5 * math.erfc(z / math.sqrt(2))
