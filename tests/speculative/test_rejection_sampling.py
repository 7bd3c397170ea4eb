"""Rejection sampling is lossless: vLLM's statistical test (REFERENCE.md §4), plus its exact special cases.

Every row below is an independent speculative step with the same target distributions p_0..p_K and draft
distribution q: drafts d_j ~ q_j (draft_probs = q) or d_j = argmax q_j (draft_probs = None, one-hot q), uniforms
from `counter_uniform` keyed by a per-row seed. Since p_j does not depend on the prefix, the token emitted at
position j, conditioned on the step reaching j, must be distributed as p_j (Leviathan et al. 2023, Thm. 1). vLLM's
criterion: the empirical distribution's distance to p shrinks like 1/sqrt(N) and ends far below the distance to q
and to every one of 100 random reference distributions.
"""

from __future__ import annotations

import math

import pytest
import torch

from nextn.speculative.acceptance_reference import rejection_sampling, strict_acceptance
from nextn.plugins.sampling import STREAM_ACCEPT, STREAM_SAMPLE, counter_uniform, filtered_probs, sample_from_probs
from nextn.speculative.protocol import SamplingTensors
from nextn.speculative.acceptance_rules import StandardAcceptance

V = 10
SIZES = (100, 1_000, 10_000, 100_000)


def _tv(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Total-variation distance between distributions on the last dim."""
    return 0.5 * (a.double() - b.double()).abs().sum(-1)


def _histogram(tokens: torch.Tensor) -> torch.Tensor:
    return torch.bincount(tokens, minlength=V).double() / tokens.numel()


def _references(seed: int) -> torch.Tensor:
    """100 random reference distributions [100, V] (uniform on the simplex, as vLLM draws them)."""
    e = -torch.rand(100, V, generator=torch.Generator().manual_seed(seed)).log()
    return e / e.sum(-1, keepdim=True)


def _uniforms(seeds: torch.Tensor, first_position: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(accept_u [N, K], sample_u [N, K+1]) at positions first_position + j, as the runtime keys them."""
    positions = first_position[:, None] + torch.arange(k + 1)
    return counter_uniform(seeds, positions[:, :k], STREAM_ACCEPT), counter_uniform(seeds, positions, STREAM_SAMPLE)


def _draw_drafts(q: torch.Tensor, n: int, sampled: bool, seed: int) -> torch.Tensor:
    """[n, K] drafts: d_j ~ q_j (independent rows), or argmax q_j on every row."""
    if not sampled:
        return q.argmax(-1).expand(n, -1).clone()
    gen = torch.Generator().manual_seed(seed)
    return torch.stack([torch.multinomial(q[j], n, replacement=True, generator=gen) for j in range(q.shape[0])], 1)


def _check_follows_target(tokens: torch.Tensor, num_emitted: torch.Tensor, p: torch.Tensor, q: torch.Tensor,
                          ref_seed: int) -> None:
    """Every position j, among the rows that reach it, is distributed as p_j (vLLM's criterion)."""
    k = p.shape[0] - 1
    refs = _references(ref_seed)
    # Position 0 (always emitted): convergence over growing N. At each N, the mean TV over the disjoint chunks of
    # N rows (1000 chunks at N = 100, …, one at N = 100000) estimates E[TV_N], which shrinks like 1/sqrt(N)
    # (a factor sqrt(10) per step) for a lossless sampler and levels off at the bias for a biased one.
    first = tokens[: SIZES[-1], 0]
    dists = []
    for n in SIZES:
        chunks = torch.nn.functional.one_hot(first.view(-1, n), V).double().mean(1)  # [SIZES[-1] / n, V]
        d = _tv(chunks, p[0]).mean().item()
        # E[TV] ≤ 0.5 · sqrt(2/π) · Σ_i sqrt(p_i (1 − p_i) / n) ≤ 1.2 / sqrt(n) for V = 10.
        assert d < 3.0 / math.sqrt(n), f"N={n}: TV to p_0 = {d:.4f}"
        dists.append(d)
    assert dists[0] / dists[1] > 2 and dists[1] / dists[2] > 2, f"TV does not shrink like 1/sqrt(N): {dists}"
    assert dists[-1] < dists[0] / 5, f"TV does not shrink with N: {dists}"
    assert dists[-1] < _tv(q[0], p[0]).item() / 10
    assert dists[-1] < _tv(refs, p[0]).min().item()
    # Every later position, conditioned on being reached (j = K is the bonus token: all K drafts accepted).
    for j in range(1, k + 1):
        reached = num_emitted > j
        n = int(reached.sum())
        assert n > 2_000, f"too few rows reach position {j} for a statistical check ({n})"
        d = _tv(_histogram(tokens[reached, j]), p[j]).item()
        assert d < 3.0 / math.sqrt(n), f"position {j} ({n} rows): TV to p_{j} = {d:.4f}"
        assert d < _tv(refs, p[j]).min().item()
        if j < k:
            assert d < _tv(q[j], p[j]).item() / 5


@pytest.mark.parametrize("k", [1, 3])
@pytest.mark.parametrize("sampled_drafts", [True, False], ids=["drafts~q", "argmax-drafts"])
def test_emitted_tokens_follow_target_distribution(k, sampled_drafts):
    gen = torch.Generator().manual_seed(10 + k)
    p = torch.softmax(torch.randn(k + 1, V, generator=gen) * 2, -1)  # [K+1, V]
    # A drafter that roughly knows p (as MTP does), so that enough rows reach the bonus position.
    q = torch.softmax(p[:k].log() + torch.randn(k, V, generator=gen) * 0.7, -1)  # [K, V]
    n = SIZES[-1]
    drafts = _draw_drafts(q, n, sampled_drafts, seed=100 + k)
    accept_u, sample_u = _uniforms(torch.arange(n) * 7919 + k, torch.zeros(n, dtype=torch.int64), k)
    draft_probs = q.expand(n, -1, -1) if sampled_drafts else None
    tokens, num_emitted = rejection_sampling(p.expand(n, -1, -1), drafts, accept_u, sample_u, draft_probs)
    assert tokens.shape == (n, k + 1) and ((num_emitted >= 1) & (num_emitted <= k + 1)).all()
    # Accepted drafts are emitted as they are.
    j = torch.arange(k)
    assert torch.equal(torch.where(j < num_emitted[:, None] - 1, tokens[:, :k], drafts), drafts)
    # The first draft's acceptance rate is Σ min(p, q) (sampled drafts) or p_0(argmax q_0) (one-hot q).
    rate = (num_emitted > 1).double().mean().item()
    expected = torch.minimum(p[0], q[0]).sum().item() if sampled_drafts else p[0, q[0].argmax()].item()
    assert abs(rate - expected) < 4 * math.sqrt(expected * (1 - expected) / n) + 1e-3
    q_used = q if sampled_drafts else torch.nn.functional.one_hot(q.argmax(-1), V).float()
    _check_follows_target(tokens, num_emitted, p, q_used, ref_seed=k)


def _reference_filtered(logits: torch.Tensor, temperature: float, top_k: int, top_p: float) -> torch.Tensor:
    """[T, V] → [T, V] float64, brute force: softmax(logits / T), keep the top-k, keep the smallest prefix of
    the renormalised sorted tokens whose mass reaches top_p, renormalise."""
    out = []
    for row in logits.double():
        p = torch.softmax(row / temperature, -1)
        order = p.argsort(descending=True)[: top_k if top_k > 0 else V]
        kept, cum, mass = [], 0.0, p[order].sum().item()
        for i in order.tolist():
            kept.append(i)
            cum += p[i].item() / mass
            if cum >= top_p:
                break
        f = torch.zeros_like(p)
        f[kept] = p[kept]
        out.append(f / f.sum())
    return torch.stack(out)


@pytest.mark.parametrize(("temperature", "filters"), [
    (0.7, None), (1.0, None), (0.7, (5, 0.9)), (1.0, (5, 0.9)), (0.7, (0, 0.75)), (1.0, (3, 1.0)),
], ids=["T0.7", "T1.0", "T0.7-k5-p0.9", "T1.0-k5-p0.9", "T0.7-p0.75", "T1.0-k3"])
def test_standard_acceptance_sampling_path_follows_target(temperature, filters):
    """filtered_probs → counter uniforms at the runtime's positions → rejection sampling, all via the rule."""
    k, n = 3, SIZES[-1]
    gen = torch.Generator().manual_seed(20)
    logits = torch.randn(k + 1, V, generator=gen) * 2.5  # [K+1, V], the same on every row
    top_k, top_p = filters or (0, 1.0)
    p = _reference_filtered(logits, temperature, top_k, top_p).float()
    # A drafter close to the unfiltered target: with filters, some drafts fall outside the support (always rejected).
    q = torch.softmax(logits[:k] / temperature + torch.randn(k, V, generator=gen) * 0.7, -1)
    drafts = _draw_drafts(q, n, True, seed=21)  # random drafts, judged as one-hot q by the rule: still lossless
    sampling = SamplingTensors(temperature=torch.full((n,), temperature), top_k=torch.full((n,), top_k),
                               top_p=torch.full((n,), top_p), seed=torch.arange(n) * 104729 + 5,
                               any_sampled=True, use_filters=filters is not None)
    first_position = torch.randint(0, 5_000, (n,), generator=gen)
    tokens, num_emitted, state = StandardAcceptance().accept(logits.expand(n, -1, -1), drafts, first_position,
                                                             sampling, ())
    assert state == ()
    one = SamplingTensors(torch.tensor([temperature]), torch.tensor([top_k]), torch.tensor([top_p]),
                          torch.tensor([0]), any_sampled=True, use_filters=True)
    torch.testing.assert_close(one.probs(logits[None]), p[None], atol=1e-6, rtol=1e-5)
    # Never a token outside the filtered support, at any emitted position.
    emitted = torch.arange(k + 1) < num_emitted[:, None]
    support = p > 0
    assert support.expand(n, -1, -1).gather(-1, tokens[..., None]).squeeze(-1)[emitted].all()
    _check_follows_target(tokens, num_emitted, p, q, ref_seed=30)


@pytest.mark.parametrize("with_draft_probs", [False, True])
def test_greedy_rows_equal_strict_acceptance(with_draft_probs):
    gen = torch.Generator().manual_seed(40)
    b, k = 512, 4
    logits = torch.randn(b, k + 1, V, generator=gen)
    target = logits.argmax(-1)
    match = torch.rand(b, k, generator=gen) < 0.75
    drafts = torch.where(match, target[:, :k], torch.randint(0, V, (b, k), generator=gen))
    assert (drafts != target[:, :k]).any() and (drafts == target[:, :k]).all(-1).any()  # both kinds present
    zeros = torch.zeros(b * (k + 1))
    p = filtered_probs(logits.reshape(-1, V), zeros, zeros.long(), zeros + 1, False).view(b, k + 1, V)
    assert torch.equal(p, torch.nn.functional.one_hot(target, V).float())
    q = torch.softmax(torch.randn(b, k, V, generator=gen), -1) if with_draft_probs else None
    accept_u, sample_u = torch.rand(b, k, generator=gen), torch.rand(b, k + 1, generator=gen)
    tokens, n = rejection_sampling(p, drafts, accept_u, sample_u, q)
    s_tokens, s_n = strict_acceptance(logits, drafts)
    assert torch.equal(n, s_n)
    assert torch.equal(tokens, s_tokens)


def test_perfect_drafter_is_always_accepted():
    gen = torch.Generator().manual_seed(50)
    b, k = 4096, 3
    logits = torch.randn(b, k + 1, V, generator=gen) * 2
    ones = torch.ones(b * (k + 1))
    # Some rows with top-k / top-p (zeros in p), some without.
    top_k = torch.randint(0, 6, (b * (k + 1),), generator=gen)
    top_p = torch.where(torch.rand(b * (k + 1), generator=gen) < 0.5, 0.8, 1.0)
    p = filtered_probs(logits.reshape(-1, V), ones * 0.9, top_k, top_p).view(b, k + 1, V)
    drafts = sample_from_probs(p[:, :k], torch.rand(b, k, generator=gen))  # d ~ p
    tokens, n = rejection_sampling(p, drafts, torch.rand(b, k, generator=gen), torch.rand(b, k + 1, generator=gen),
                                   draft_probs=p[:, :k])
    assert (n == k + 1).all()
    assert torch.equal(tokens[:, :k], drafts)
    assert (p[:, k].gather(-1, tokens[:, k:]) > 0).all()  # the bonus comes from p_K
    # The largest possible uniform (1 − 2^-24) still accepts: ratio 1 means "always".
    largest = torch.full((b, k), 1 - 2.0**-24)
    _, n = rejection_sampling(p, drafts, largest, torch.rand(b, k + 1, generator=gen), p[:, :k])
    assert (n == k + 1).all()


def test_hand_worked_step():
    # p_0 = [0.5, 0.3, 0.2, 0…], argmax draft 1 (q one-hot): accept iff u < 0.3; else draw from [0.5, 0, 0.2]/0.7.
    p = torch.zeros(1, 2, V)
    p[0, 0, :3] = torch.tensor([0.5, 0.3, 0.2])
    p[0, 1, 4] = 1.0  # bonus distribution: token 4
    drafts = torch.tensor([[1]])
    tokens, n = rejection_sampling(p, drafts, torch.tensor([[0.29]]), torch.tensor([[0.0, 0.5]]))
    assert n.tolist() == [2] and tokens.tolist() == [[1, 4]]
    # Rejected: residual weights [0.5, 0, 0.2] (CDF 0.5, 0.5, 0.7); u = 0.7 → 0.49 < 0.5 → token 0;
    # u = 0.75 → 0.525 ≥ 0.5 → token 2.
    tokens, n = rejection_sampling(p, drafts, torch.tensor([[0.31]]), torch.tensor([[0.7, 0.5]]))
    assert n.tolist() == [1] and tokens[0, 0].item() == 0
    tokens, n = rejection_sampling(p, drafts, torch.tensor([[0.31]]), torch.tensor([[0.75, 0.5]]))
    assert n.tolist() == [1] and tokens[0, 0].item() == 2
    # With q = [0.2, 0.6, 0.2]: accept iff u < 0.3 / 0.6 = 0.5; residual max(p − q, 0) = [0.3, 0, 0] → token 0.
    q = torch.zeros(1, 1, V)
    q[0, 0, :3] = torch.tensor([0.2, 0.6, 0.2])
    assert rejection_sampling(p, drafts, torch.tensor([[0.49]]), torch.tensor([[0.9, 0.5]]), q)[1].tolist() == [2]
    tokens, n = rejection_sampling(p, drafts, torch.tensor([[0.51]]), torch.tensor([[0.999, 0.5]]), q)
    assert n.tolist() == [1] and tokens[0, 0].item() == 0


def test_no_drafts_samples_from_target():
    # K = 0 (plain decoding): the one emitted token is a draw from p_0 (strict_acceptance handles K = 0).
    p = torch.tensor([[[0.0, 0.25, 0.75] + [0.0] * (V - 3)]]).expand(4, 1, V)
    u = torch.tensor([[0.1], [0.3], [0.9], [0.0]])
    tokens, n = rejection_sampling(p, torch.zeros(4, 0, dtype=torch.int64), torch.zeros(4, 0), u)
    assert n.tolist() == [1, 1, 1, 1]
    assert tokens.tolist() == [[1], [2], [2], [1]]


def test_standard_acceptance_no_drafts_with_sampling():
    logits = torch.randn(2, 1, V, generator=torch.Generator().manual_seed(60))
    sampling = SamplingTensors(torch.tensor([1.0, 0.0]), torch.zeros(2, dtype=torch.int64), torch.ones(2),
                               torch.tensor([1, 2]), any_sampled=True, use_filters=False)
    tokens, n, _ = StandardAcceptance().accept(logits, torch.zeros(2, 0, dtype=torch.int64), torch.tensor([5, 9]),
                                               sampling, ())
    assert tokens.shape == (2, 1) and n.tolist() == [1, 1]
    assert tokens[1, 0].item() == logits[1, 0].argmax().item()
