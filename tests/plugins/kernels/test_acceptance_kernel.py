"""Acceptance kernels (strict, relaxed, rejection sampling) against the references in `nextn.speculative.acceptance_reference`:
identical integers over a grid of shapes, and hand-worked cases."""

from __future__ import annotations

import pytest
import torch

from nextn.plugins.sampling import STREAM_ACCEPT, STREAM_SAMPLE, counter_uniform

# Batch 1 and odd sizes, K 1..3; V = 1100 spans two 1024-wide vocabulary chunks.
SHAPES = [(1, 1, 37), (1, 3, 1100), (3, 2, 37), (3, 3, 37), (5, 1, 1100), (5, 2, 37)]


def _drafts(target: torch.Tensor, k: int, gen: torch.Generator, vocab: int, p_match: float = 0.7) -> torch.Tensor:
    b = target.shape[0]
    wrong = torch.randint(0, vocab, (b, k), generator=gen)
    return torch.where(torch.rand(b, k, generator=gen) < p_match, target[:, :k], wrong)


def test_strict_hand_worked_all_some_none_accepted(kernels):
    from nextn.speculative.acceptance_rules import strict_acceptance

    logits = torch.nn.functional.one_hot(torch.tensor([[1, 3, 2, 4]] * 3), 8).float()
    drafts = torch.tensor([[1, 3, 4], [1, 3, 2], [0, 3, 2]])
    tokens, n = strict_acceptance(logits, drafts)
    assert n.tolist() == [3, 4, 1]  # two accepted, all accepted (+ bonus), none accepted
    assert tokens.tolist() == [[1, 3, 2, 4]] * 3


def test_strict_ties_take_the_first_index(kernels):
    from nextn.speculative.acceptance_rules import strict_acceptance

    logits = torch.zeros(1, 2, 1100)
    logits[0, 0, [5, 1030]] = 2.0  # tie across the chunk boundary: the first index wins
    logits[0, 1, [1030, 1031]] = 1.0
    tokens, n = strict_acceptance(logits, torch.tensor([[1030]]))
    assert tokens.tolist() == [[5, 1030]] and n.tolist() == [1]


@pytest.mark.parametrize("b,k,v", SHAPES)
def test_strict_matches_reference(kernels, b, k, v):
    from nextn.speculative.acceptance_rules import strict_acceptance
    from nextn.speculative.acceptance_reference import strict_acceptance as strict_acceptance_reference

    gen = torch.Generator().manual_seed(b * 1000 + k * 10 + v)
    logits = torch.randn(b, k + 1, v, generator=gen)
    drafts = _drafts(logits.argmax(-1), k, gen, v)
    got, want = strict_acceptance(logits, drafts), strict_acceptance_reference(logits, drafts)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])


def test_plain_decoding_k0(kernels):
    from nextn.speculative.acceptance_rules import relaxed_acceptance, rejection_sampling, strict_acceptance

    logits = torch.randn(3, 1, 40, generator=torch.Generator().manual_seed(0))
    none = torch.zeros(3, 0, dtype=torch.int64)
    tokens, n = strict_acceptance(logits, none)
    assert tokens[:, 0].tolist() == logits[:, 0].argmax(-1).tolist() and n.tolist() == [1, 1, 1]
    tokens, n = relaxed_acceptance(logits, none, torch.full((3,), 0.5), 3)
    assert tokens[:, 0].tolist() == logits[:, 0].argmax(-1).tolist() and n.tolist() == [1, 1, 1]
    probs = torch.softmax(logits, -1)
    u = torch.tensor([[0.0], [0.5], [0.999]])
    tokens, n = rejection_sampling(probs, none, torch.zeros(3, 0), u)
    cdf = probs[:, 0].cumsum(-1)
    assert tokens[:, 0].tolist() == [int((cdf[i] <= u[i] * cdf[i, -1]).sum()) for i in range(3)]


def test_relaxed_hand_worked(kernels):
    from nextn.speculative.acceptance_rules import relaxed_acceptance

    # Position 0: p ≈ [0.5, 0.3, 0.2]; the draft is token 1 (second best, 0.2 below the top).
    logits = torch.log(torch.tensor([[[0.5, 0.3, 0.2], [0.1, 0.1, 0.8]]]))
    drafts = torch.tensor([[1]])
    for delta, topk, n in [(0.25, 2, 2), (0.15, 2, 1), (0.25, 1, 1), (0.0, 3, 1)]:
        tokens, got = relaxed_acceptance(logits, drafts, torch.tensor([delta]), topk)
        assert got.tolist() == [n], (delta, topk)
        assert tokens[0, :n].tolist() == ([1, 2] if n == 2 else [0])


@pytest.mark.parametrize("b,k,v", SHAPES)
def test_relaxed_matches_reference(kernels, b, k, v):
    from nextn.speculative.acceptance_rules import relaxed_acceptance
    from nextn.speculative.acceptance_reference import relaxed_acceptance as relaxed_acceptance_reference

    gen = torch.Generator().manual_seed(b * 1000 + k * 10 + v)
    logits = torch.randn(b, k + 1, v, generator=gen) * 2
    order = logits.argsort(-1, descending=True)
    second = order[..., 1]  # drafts are often the runner-up, so delta and topk decide
    drafts = torch.where(torch.rand(b, k, generator=gen) < 0.5, second[:, :k], _drafts(order[..., 0], k, gen, v))
    delta = torch.tensor([0.0, 0.05, 0.3, 0.6, 1.0])[torch.arange(b) % 5]
    for topk in (1, 3):
        got = relaxed_acceptance(logits, drafts, delta, topk)
        want = relaxed_acceptance_reference(logits, drafts, delta, topk)
        assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])


def test_rejection_greedy_rows_are_strict(kernels):
    from nextn.speculative.acceptance_kernels import rejection_sampling_triton as rejection_sampling
    from nextn.speculative.acceptance_reference import strict_acceptance as strict_acceptance_reference

    gen = torch.Generator().manual_seed(1)
    logits = torch.randn(4, 4, 50, generator=gen)
    drafts = _drafts(logits.argmax(-1), 3, gen, 50)
    one_hot = torch.nn.functional.one_hot(logits.argmax(-1), 50).float()
    tokens, n = rejection_sampling(one_hot, drafts, torch.rand(4, 3, generator=gen), torch.rand(4, 4, generator=gen))
    s_tokens, s_n = strict_acceptance_reference(logits, drafts)
    assert torch.equal(n, s_n)
    for row in range(4):
        assert tokens[row, : n[row]].tolist() == s_tokens[row, : n[row]].tolist()


def test_rejection_hand_worked(kernels):
    from nextn.speculative.acceptance_kernels import rejection_sampling_triton as rejection_sampling

    p = torch.tensor([[[0.5, 0.25, 0.25], [0.0, 0.0, 1.0]]])
    drafts = torch.tensor([[0]])
    # accept_u 0.4 < p(0) = 0.5: accepted, then the bonus from p_1 (all mass on token 2).
    tokens, n = rejection_sampling(p, drafts, torch.tensor([[0.4]]), torch.tensor([[0.0, 0.3]]))
    assert n.tolist() == [2] and tokens.tolist() == [[0, 2]]
    # accept_u 0.6 ≥ 0.5: rejected; residual [0, .25, .25] normalised, u = 0.6 → token 2.
    tokens, n = rejection_sampling(p, drafts, torch.tensor([[0.6]]), torch.tensor([[0.6, 0.3]]))
    assert n.tolist() == [1] and tokens[0, 0].item() == 2
    # Explicit draft distribution q = [0.25, 0.5, 0.25]: p(0)/q(0) = 2 → accepted whatever u.
    q = torch.tensor([[[0.25, 0.5, 0.25]]])
    tokens, n = rejection_sampling(p, drafts, torch.tensor([[0.99]]), torch.tensor([[0.0, 0.3]]), q)
    assert n.tolist() == [2] and tokens.tolist() == [[0, 2]]


@pytest.mark.parametrize("b,k,v", SHAPES)
def test_rejection_matches_reference(kernels, b, k, v):
    # the launcher itself: the rules' dispatcher sends deterministic drafts (None) to the coupled rule instead
    from nextn.speculative.acceptance_kernels import rejection_sampling_triton as rejection_sampling
    from nextn.speculative.acceptance_reference import rejection_sampling as rejection_sampling_reference

    gen = torch.Generator().manual_seed(b * 1000 + k * 10 + v)
    logits = torch.randn(b, k + 1, v, generator=gen) * 3
    logits[0, :, v // 2:] = float("-inf")  # a filtered row (top-k style zeros)
    probs = torch.softmax(logits, -1)
    drafts = _drafts(logits.argmax(-1), k, gen, v)
    seed = torch.randint(0, 2**40, (b,), generator=gen)
    positions = torch.randint(0, 1000, (b, 1), generator=gen) + torch.arange(k + 1)
    accept_u = counter_uniform(seed, positions[:, :k], STREAM_ACCEPT)
    sample_u = counter_uniform(seed, positions, STREAM_SAMPLE)
    q = torch.softmax(torch.randn(b, k, v, generator=gen) * 3, -1)
    for draft_probs in (None, q):
        got = rejection_sampling(probs, drafts, accept_u, sample_u, draft_probs)
        want = rejection_sampling_reference(probs, drafts, accept_u, sample_u, draft_probs)
        assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])


def test_dispatch_uses_reference_on_cpu_without_forcing():
    from nextn.plugins.kernels import dispatch

    assert not dispatch.use_kernel(torch.zeros(1))  # CPU tensors take the reference path
