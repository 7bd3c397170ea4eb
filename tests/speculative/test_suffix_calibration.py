"""The pooled calibration of suffix-tree proposals (speculative/suffix_calibration.py) and what the drafter does
with it: a request starts from what earlier requests taught about proposals like its own."""

from __future__ import annotations

import pytest

from nextn.speculative.suffix import SuffixDrafter
from nextn.speculative.suffix_calibration import PRIOR, AcceptanceCalibration

from test_suffix import prefill, verify


def test_gains_follow_the_prior_by_match_length_and_never_rise_along_the_chain():
    cal = AcceptanceCalibration()
    probs = [1.0, 1.0, 1.0, 0.5]
    short, long = cal.gains(probs, 1), cal.gains(probs, 12)
    assert short[0] == pytest.approx(PRIOR[0]) and long[0] == pytest.approx(0.99)  # capped below certainty
    steps = [b - a for a, b in zip([0.0] + long, long)]
    assert steps == sorted(steps, reverse=True) and max(steps) <= 0.99  # a draft never likelier than the one before
    assert cal.gains(probs, 1, factor=0.5)[0] == pytest.approx(PRIOR[0] * 0.5)
    assert cal.expected(probs, 1, 2) == pytest.approx(2 * PRIOR[0])  # uncapped, no factor


def test_evidence_moves_its_own_cell_and_fades_back_to_the_prior_when_unverified():
    cal = AcceptanceCalibration()
    for _ in range(50):
        cal.observe([1.0, 1.0], 1, 2, 0)  # match 1: both drafts verified, none accepted
    assert cal.ratio(1, 0) < 0.1 and cal.ratio(1, 1) < 0.1
    assert cal.ratio(2, 0) == pytest.approx(PRIOR[1]) and cal.ratio(1, 5) == pytest.approx(PRIOR[0])  # other cells
    for _ in range(50):
        cal.observe([0.5], 12, 1, 1)  # a long match's first draft accepted at path probability 0.5
    assert cal.ratio(12, 0) > 1.8
    low = cal.ratio(1, 0)
    for _ in range(2000):
        cal.observe([1.0], 1, 0, 0)  # proposals left unverified: the evidence fades
    assert low < cal.ratio(1, 0) and cal.ratio(1, 0) == pytest.approx(PRIOR[0], rel=0.05)
    with pytest.raises(ValueError, match="prior"):
        AcceptanceCalibration(prior=[1.0])
    with pytest.raises(ValueError, match="decay"):
        AcceptanceCalibration(decay=0.0)


def test_a_new_request_starts_from_what_earlier_requests_taught():
    """Requests whose short-match proposals all missed teach the drafter: a new request with a proposal of the same
    kind verifies nothing where rows are dear (its own factor is still 1), while a request copying a long stretch
    of its prompt still verifies its proposal (control: a drafter without that history verifies both)."""
    seq = list(range(10, 30))
    copying = seq + seq[:12]  # the prompt repeats: a 12-token match
    short = [3, 5, 6, 7, 8]  # then 3: after "3" came 5 (a 1-token match: path probability 0.5)
    cost = lambda b, k: 1 + 0.1 * k  # noqa: E731  a verified row costs a tenth of a plain step

    def fresh() -> SuffixDrafter:
        d = SuffixDrafter(16, max_tree_depth=24, max_cached_requests=0)  # each request's own tree only
        d.set_step_times(cost)
        return d

    taught = fresh()
    for _ in range(40):  # earlier requests: their 1-token-match drafts were verified and rejected
        prefill(taught, [0], [0], [short], [3])
        assert taught.slots[0].match_len == 1
        verify(taught, [0], [len(short)], [[999, 0]], [1])
    naive = fresh()
    for d in (taught, naive):
        prefill(d, [1, 2], [0, 0], [short, copying], [3, seq[12]])
        assert d.slots[1].calibration == 1.0 and d.slots[2].match_len >= 9
    assert naive.proposal_lens([1], 16) == [1]  # the prior alone still tries the short match
    assert taught.proposal_lens([1], 16) == [0]
    assert taught.proposal_lens([2], 16)[0] >= 8 and taught.proposal_lens([1, 2], 16)[0] == 0
