"""Relaxed acceptance (TensorRT-LLM, REFERENCE.md §3) on hand-worked cases and against a brute-force loop.

Logits are the logs of chosen probabilities, so softmax gives them back and the thresholds can be checked by eye.
"""

from __future__ import annotations

import pytest
import torch

from nextn.speculative.acceptance_reference import relaxed_acceptance, strict_acceptance

# Vocab 6, K = 3: one distribution per verified position (the last one is the bonus position).
# Ranked: A: id1 .45, id2 .25, id3 .15, id4 .06, id0 .05, id5 .04
A = [0.05, 0.45, 0.25, 0.15, 0.06, 0.04]
# B: id0 .60, id3 .20, id4 .10, id1 .05, id2 .03, id5 .02
B = [0.60, 0.05, 0.03, 0.20, 0.10, 0.02]
# C: id4 .35, id2 .30, id5 .25, id3 .05, id1 .03, id0 .02
C = [0.02, 0.03, 0.30, 0.05, 0.35, 0.25]
# D: id2 .50, id4 .14, id1 .12, id3 .10, id0 .08, id5 .06
D = [0.08, 0.12, 0.50, 0.10, 0.14, 0.06]
TOP1 = [1, 0, 4, 2]


def _logits(batch: int = 1) -> torch.Tensor:
    """[batch, K+1 = 4, V = 6] logits = log(A, B, C, D) on every row."""
    return torch.tensor([A, B, C, D]).log().expand(batch, -1, -1).clone()


def _run(drafts: list[list[int]], delta: list[float], topk: int = 3) -> tuple[list[list[int]], list[int]]:
    """Emitted tokens per row (the first num_emitted entries) and num_emitted."""
    tokens, n = relaxed_acceptance(_logits(len(drafts)), torch.tensor(drafts), torch.tensor(delta), topk)
    assert tokens.shape == (len(drafts), 4) and n.dtype == torch.int64
    return [row[:k] for row, k in zip(tokens.tolist(), n.tolist())], n.tolist()


def test_second_most_likely_within_delta_is_accepted():
    # Position 0: draft id2 = rank 1 of A, 0.25 ≥ 0.45 − 0.3 = 0.15 → accepted.
    # Position 1: draft id3 = rank 1 of B, 0.20 < 0.60 − 0.3 = 0.30 → rejected; B's top-1 (id0) is emitted.
    emitted, n = _run([[2, 3, 5]], [0.3])
    assert n == [2] and emitted == [[2, 0]]


def test_all_accepted_emits_the_top1_bonus():
    # id1 and id0 are the top-1s; id5 is rank 2 of C with 0.25 ≥ 0.35 − 0.3; bonus = D's top-1 (id2).
    emitted, n = _run([[1, 0, 5]], [0.3])
    assert n == [4] and emitted == [[1, 0, 5, 2]]


def test_outside_top_k_is_rejected_even_with_a_huge_delta():
    # id3 is rank 3 of C (outside the top-3): rejected although 0.05 ≥ 0.35 − 10.
    emitted, n = _run([[1, 0, 3]], [10.0])
    assert n == [3] and emitted == [[1, 0, 4]]
    # A rank-3 draft at position 0 (id4 of A) ends the step there with A's top-1.
    emitted, n = _run([[4, 0, 5]], [10.0])
    assert n == [1] and emitted == [[1]]
    # With topk = 2, id5 (rank 2 of C) is outside the candidates too.
    emitted, n = _run([[1, 0, 5]], [10.0], topk=2)
    assert n == [3] and emitted == [[1, 0, 4]]
    # With topk = 1 every delta is strict acceptance.
    emitted, n = _run([[2, 3, 5], [1, 0, 2]], [10.0, 10.0], topk=1)
    assert n == [1, 3] and emitted == [[1], [1, 0, 4]]


def test_top1_is_always_accepted_and_stop_at_first_rejection():
    # A rejection at position 0 hides later drafts that would be accepted (id0 at B, id4 at C are top-1s).
    emitted, n = _run([[0, 0, 4], [1, 0, 4], [1, 3, 4]], [0.3, 0.0, 0.3])
    assert n == [1, 4, 2]
    assert emitted == [[1], [1, 0, 4, 2], [1, 0]]


def test_per_row_deltas_in_one_batch():
    # The same drafts [id2, id3, id5] under deltas 0, 0.3, 0.5:
    #   0   : id2 (0.25 < 0.45) rejected at once;
    #   0.3 : id2 accepted, id3 (0.20 < 0.30) rejected;
    #   0.5 : id2, id3 (0.20 ≥ 0.10), id5 (0.25 ≥ −0.15) accepted, bonus id2.
    emitted, n = _run([[2, 3, 5]] * 3, [0.0, 0.3, 0.5])
    assert n == [1, 2, 4]
    assert emitted == [[1], [2, 0], [2, 3, 5, 2]]


def test_delta_is_on_probabilities_not_log_probabilities():
    # Flat distribution over 64 tokens: top-1 0.03, top-2 0.015 — log-ratio 0.69 > 0.3, but 0.015 ≥ 0.03 − 0.3.
    p = torch.full((64,), 0.955 / 62)
    p[10], p[20] = 0.03, 0.015
    logits = p.log().expand(1, 2, 64)
    tokens, n = relaxed_acceptance(logits, torch.tensor([[20]]), torch.tensor([0.3]), topk=64)
    assert n.tolist() == [2] and tokens[0, 0].item() == 20
    tokens, n = relaxed_acceptance(logits, torch.tensor([[20]]), torch.tensor([0.01]), topk=64)
    assert n.tolist() == [1] and tokens[0, 0].item() == 10


def _brute_force(logits: torch.Tensor, drafts: torch.Tensor, delta: torch.Tensor, topk: int
                 ) -> tuple[list[list[int]], list[int]]:
    emitted, counts = [], []
    for b in range(drafts.shape[0]):
        out = []
        for j in range(drafts.shape[1] + 1):
            p = torch.softmax(logits[b, j].double(), -1)
            top_v, top_i = p.topk(topk)
            if j == drafts.shape[1]:
                out.append(int(top_i[0]))
                break
            d = int(drafts[b, j])
            ok = any(int(top_i[r]) == d and (r == 0 or top_v[r] >= top_v[0] - delta[b].item()) for r in range(topk))
            if not ok:
                out.append(int(top_i[0]))
                break
            out.append(d)
        emitted.append(out)
        counts.append(len(out))
    return emitted, counts


def _random_case(seed: int, b: int, k: int, v: int):
    gen = torch.Generator().manual_seed(seed)
    logits = torch.randn(b, k + 1, v, generator=gen) * 1.5
    ranked = logits.argsort(-1, descending=True)[:, :k]  # [B, K, V]: drafts near the top
    pick = torch.randint(0, 4, (b, k, 1), generator=gen)
    drafts = ranked.gather(-1, pick).squeeze(-1)
    return logits, drafts, gen


@pytest.mark.parametrize("topk", [1, 2, 3, 6])
@pytest.mark.parametrize("k", [1, 3, 4])
def test_delta_zero_equals_strict_acceptance(k, topk):
    logits, drafts, _ = _random_case(100 + k * 10 + topk, 256, k, 6)  # continuous logits: no ties
    tokens, n = relaxed_acceptance(logits, drafts, torch.zeros(256), topk)
    s_tokens, s_n = strict_acceptance(logits, drafts)
    assert torch.equal(n, s_n)
    assert torch.equal(tokens, s_tokens)  # accepted drafts are the argmax; every other entry is the top-1


@pytest.mark.parametrize("topk", [2, 3, 5])
def test_matches_brute_force_and_grows_with_delta(topk):
    logits, drafts, gen = _random_case(200 + topk, 256, 3, 6)
    delta = torch.rand(256, generator=gen) * 0.6
    tokens, n = relaxed_acceptance(logits, drafts, delta, topk)
    emitted, counts = _brute_force(logits, drafts, delta, topk)
    assert n.tolist() == counts
    assert [row[:c] for row, c in zip(tokens.tolist(), counts)] == emitted
    # A larger delta never accepts fewer drafts; delta 0 is the floor (strict).
    previous = strict_acceptance(logits, drafts)[1]
    for scale in (0.25, 0.5, 1.0, 2.0):
        current = relaxed_acceptance(logits, drafts, delta * scale, topk)[1]
        assert (current >= previous).all()
        previous = current
    assert (previous > strict_acceptance(logits, drafts)[1]).any()


def test_no_drafts_emits_the_top1():
    logits = _logits(2)[:, :1]
    tokens, n = relaxed_acceptance(logits, torch.zeros(2, 0, dtype=torch.int64), torch.tensor([0.0, 0.3]), 3)
    assert n.tolist() == [1, 1] and tokens.tolist() == [[1], [1]]
