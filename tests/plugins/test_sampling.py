"""Sampling primitives: the counter-based RNG, the filtered sampling distribution, the inverse-CDF draw.

Statistical checks use chi-square statistics compared with generous fixed thresholds (about the 0.9999 quantile of
the chi-square distribution, Wilson–Hilferty approximation), so no scipy is needed; every seed is fixed, so the
tests are deterministic.
"""

from __future__ import annotations

import pytest
import torch

from nextn.plugins.sampling import STREAM_ACCEPT, STREAM_SAMPLE, counter_uniform, filtered_probs, sample_from_probs

# ~0.9999 quantiles of chi2(df) (Wilson–Hilferty): df 7 → 30.4, df 19 → 51.1, df 99 → 160.2.
CHI2_9999 = {7: 30.4, 19: 51.1, 99: 160.2}


def _chi2_uniform(u: torch.Tensor, bins: int) -> float:
    """Pearson's statistic of values in [0, 1) against `bins` equal bins."""
    counts = torch.bincount((u.flatten().double() * bins).long(), minlength=bins).double()
    expected = u.numel() / bins
    return float(((counts - expected) ** 2 / expected).sum())


def _grid(seeds: torch.Tensor, n: int, stream: int, start: int = 0) -> torch.Tensor:
    """counter_uniform for every seed at counters start..start+n-1 → [len(seeds), n]."""
    counter = torch.arange(start, start + n, dtype=torch.int64).expand(len(seeds), n)
    return counter_uniform(seeds, counter, stream)


# ---------------------------------------------------------------------------------------------------------------
# counter_uniform
# ---------------------------------------------------------------------------------------------------------------


def test_counter_uniform_range_dtype_shape():
    seeds = torch.tensor([0, 1, -1, 2**62 + 12345, -(2**63), 2**63 - 1, 987654321], dtype=torch.int64)
    counters = torch.tensor([0, 1, 2**31 - 1, 2**32, 2**32 + 1, 2**40 + 7, 2**62], dtype=torch.int64)
    for stream in (STREAM_SAMPLE, STREAM_ACCEPT, 0, 7):
        u = counter_uniform(seeds, counters.expand(len(seeds), -1), stream)
        assert u.shape == (len(seeds), len(counters)) and u.dtype == torch.float32
        assert (u >= 0).all() and (u < 1).all()
    big = _grid(torch.arange(50), 2000, STREAM_SAMPLE)
    assert big.min() >= 0 and big.max() < 1
    assert big.min() < 1e-3 and big.max() > 1 - 1e-3  # spans the whole interval


@pytest.mark.parametrize("stream", [STREAM_SAMPLE, STREAM_ACCEPT])
def test_counter_uniform_is_uniform(stream):
    # Many counters of a few seeds (the per-request sequence) ...
    assert _chi2_uniform(_grid(torch.arange(100), 1000, stream), 20) < CHI2_9999[19]
    # ... one counter across many seeds (consecutive seeds are the worst case for a weak seed mix) ...
    assert _chi2_uniform(_grid(torch.arange(100_000), 1, stream, start=17), 20) < CHI2_9999[19]
    # ... and counters beyond 2^32 (the high word takes a separate path).
    assert _chi2_uniform(_grid(torch.arange(100), 1000, stream, start=2**32 - 500), 20) < CHI2_9999[19]


def test_counter_uniform_consecutive_pairs_are_independent():
    # 2-D uniformity of (u_c, u_{c+1}) on a 10 × 10 grid: catches correlation between neighbouring counters.
    u = _grid(torch.arange(50), 4001, STREAM_SAMPLE)
    a, b = u[:, :-1].flatten(), u[:, 1:].flatten()
    cell = (a.double() * 10).long() * 10 + (b.double() * 10).long()
    counts = torch.bincount(cell, minlength=100).double()
    expected = a.numel() / 100
    assert float(((counts - expected) ** 2 / expected).sum()) < CHI2_9999[99]


def test_counter_uniform_is_deterministic():
    seeds = torch.tensor([3, 1 << 40, -5], dtype=torch.int64)
    counter = torch.tensor([[0, 1, 2], [10, 11, 12], [2**33, 5, 0]], dtype=torch.int64)
    first = counter_uniform(seeds, counter, STREAM_SAMPLE)
    assert torch.equal(first, counter_uniform(seeds.clone(), counter.clone(), STREAM_SAMPLE))
    # Element by element: each value depends only on its own (seed, counter, stream).
    for b in range(3):
        for j in range(3):
            one = counter_uniform(seeds[b:b + 1], counter[b:b + 1, j:j + 1], STREAM_SAMPLE)
            assert one.item() == first[b, j].item()


def _corr(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.flatten().double(), b.flatten().double()
    return float(torch.corrcoef(torch.stack([a, b]))[0, 1])


def test_counter_uniform_differs_across_seeds_counters_streams():
    seeds = torch.arange(100)
    base = _grid(seeds, 1000, STREAM_SAMPLE)  # 100k values
    other_seed = _grid(seeds + 1000, 1000, STREAM_SAMPLE)
    other_counter = _grid(seeds, 1000, STREAM_SAMPLE, start=1000)
    other_stream = _grid(seeds, 1000, STREAM_ACCEPT)
    # Std of the sample correlation of 100k independent pairs is ~0.003: 0.015 is five sigma.
    for other in (other_seed, other_counter, other_stream):
        assert (base == other).float().mean() < 1e-3  # 24-bit values: equal only by chance
        assert abs(_corr(base, other)) < 0.015
    # Neighbouring seeds at the same counter, and the same seed one counter apart, are uncorrelated too.
    assert abs(_corr(base[:-1], base[1:])) < 0.015
    assert abs(_corr(base[:, :-1], base[:, 1:])) < 0.015
    # All 100k values of one grid are (almost) distinct.
    assert base.flatten().unique().numel() > 99_000


def test_counter_uniform_ignores_batch_composition():
    counter = torch.tensor([[5, 6, 7, 2**35]], dtype=torch.int64)
    alone = counter_uniform(torch.tensor([42]), counter, STREAM_ACCEPT)
    seeds = torch.tensor([7, 8, 42, 1 << 50, 0])
    others = torch.randint(0, 1000, (5, 4), generator=torch.Generator().manual_seed(0))
    counters = torch.cat([others[:2], counter, others[2:4]])
    in_batch = counter_uniform(seeds, counters, STREAM_ACCEPT)
    assert torch.equal(in_batch[2:3], alone)
    # The batch order does not matter either.
    perm = torch.tensor([4, 2, 0, 3, 1])
    assert torch.equal(counter_uniform(seeds[perm], counters[perm], STREAM_ACCEPT), in_batch[perm])


# ---------------------------------------------------------------------------------------------------------------
# filtered_probs
# ---------------------------------------------------------------------------------------------------------------


def _random_params(r: int, v: int, gen: torch.Generator):
    logits = torch.randn(r, v, generator=gen) * 2
    temperature = torch.rand(r, generator=gen) * 1.5 + 0.2
    top_k = torch.randint(0, v + 3, (r,), generator=gen)
    top_p = torch.rand(r, generator=gen) * 0.9 + 0.1
    top_p[::4] = 1.0
    return logits, temperature, top_k, top_p


def _brute_force_filtered(logits: torch.Tensor, temperature: float, top_k: int, top_p: float) -> torch.Tensor:
    """One row, float64: softmax(logits / T) → keep the top-k (renormalise) → keep the smallest prefix of the
    sorted tokens whose mass reaches top_p (renormalise)."""
    p = torch.softmax(logits.double() / temperature, dim=-1)
    order = p.argsort(descending=True).tolist()
    kept = order[:top_k] if top_k > 0 else order
    mass = sum(p[i].item() for i in kept)
    prefix, cum = [], 0.0
    for i in kept:
        prefix.append(i)
        cum += p[i].item() / mass
        if cum >= top_p:
            break
    out = torch.zeros_like(p)
    out[prefix] = p[prefix]
    return out / out.sum()


def test_filtered_probs_rows_sum_to_one():
    gen = torch.Generator().manual_seed(1)
    logits, temperature, top_k, top_p = _random_params(256, 50, gen)
    temperature[::5] = 0.0
    for use_filters in (True, False):
        probs = filtered_probs(logits, temperature, top_k, top_p, use_filters)
        assert probs.shape == logits.shape and (probs >= 0).all()
        torch.testing.assert_close(probs.sum(-1), torch.ones(256), atol=1e-5, rtol=0)


def test_filtered_probs_temperature_zero_is_one_hot_argmax():
    gen = torch.Generator().manual_seed(2)
    logits, _, top_k, top_p = _random_params(64, 33, gen)
    zero = torch.zeros(64)
    for use_filters in (True, False):
        probs = filtered_probs(logits, zero, top_k, top_p, use_filters)
        expected = torch.nn.functional.one_hot(logits.argmax(-1), 33).float()
        assert torch.equal(probs, expected)
    # Mixed batch: only the greedy rows are one-hot.
    temperature = torch.tensor([0.0, 1.0] * 32)
    probs = filtered_probs(logits, temperature, torch.zeros(64, dtype=torch.int64), torch.ones(64), False)
    assert torch.equal(probs[::2], torch.nn.functional.one_hot(logits[::2].argmax(-1), 33).float())
    assert ((probs[1::2] > 0).sum(-1) == 33).all()


@pytest.mark.parametrize("k", [1, 2, 7, 31, 32, 40])
def test_filtered_probs_top_k_keeps_exactly_k(k):
    gen = torch.Generator().manual_seed(3)
    logits = torch.randn(64, 32, generator=gen)  # continuous: no ties
    temperature = torch.rand(64, generator=gen) + 0.3
    probs = filtered_probs(logits, temperature, torch.full((64,), k), torch.ones(64))
    kept = probs > 0
    assert (kept.sum(-1) == min(k, 32)).all()
    # The kept tokens are the k most likely, with renormalised softmax(logits / T) values.
    topk_ids = logits.topk(min(k, 32), dim=-1).indices
    assert torch.equal(kept, torch.zeros_like(kept).scatter(-1, topk_ids, True))
    expected = torch.softmax((logits / temperature[:, None]).masked_fill(~kept, float("-inf")), dim=-1)
    torch.testing.assert_close(probs, expected, atol=1e-6, rtol=1e-5)


def test_filtered_probs_matches_brute_force_top_k_top_p():
    gen = torch.Generator().manual_seed(4)
    logits, temperature, top_k, top_p = _random_params(300, 24, gen)
    probs = filtered_probs(logits, temperature, top_k, top_p)
    for r in range(300):
        expected = _brute_force_filtered(logits[r], temperature[r].item(), top_k[r].item(), top_p[r].item())
        if top_p[r] < 1:  # top_p = 1 rows: see test_filtered_probs_top_p_one_keeps_every_token
            assert torch.equal(probs[r] > 0, expected > 0), f"row {r}: support differs"
        torch.testing.assert_close(probs[r].double(), expected, atol=1e-6, rtol=1e-5)


def test_filtered_probs_top_p_keeps_smallest_prefix_reaching_mass():
    # Hand-worked: probabilities 0.5, 0.3, 0.15, 0.05 (logits = their logs, T = 1).
    logits = torch.tensor([0.15, 0.5, 0.05, 0.3]).log().expand(5, 4)
    top_p = torch.tensor([0.4, 0.49, 0.79, 0.81, 0.99])
    probs = filtered_probs(logits, torch.ones(5), torch.zeros(5, dtype=torch.int64), top_p)
    expected = torch.tensor([
        [0.0, 1.0, 0.0, 0.0],  # 0.5 ≥ 0.4
        [0.0, 1.0, 0.0, 0.0],  # 0.5 ≥ 0.49
        [0.0, 0.5 / 0.8, 0.0, 0.3 / 0.8],  # 0.5 + 0.3 ≥ 0.79
        [0.15 / 0.95, 0.5 / 0.95, 0.0, 0.3 / 0.95],  # 0.8 < 0.81 ≤ 0.95
        [0.15, 0.5, 0.05, 0.3],  # 0.95 < 0.99: all
    ])
    torch.testing.assert_close(probs, expected, atol=1e-6, rtol=1e-5)
    # top-k first, then top-p on the renormalised top-k: top-2 = {0.5, 0.3} → 0.625, 0.375; top_p 0.7 keeps both.
    probs = filtered_probs(logits[:1], torch.ones(1), torch.tensor([2]), torch.tensor([0.7]))
    torch.testing.assert_close(probs, torch.tensor([[0.0, 0.625, 0.0, 0.375]]), atol=1e-6, rtol=1e-5)


def test_filtered_probs_temperature_scaling_without_filters():
    gen = torch.Generator().manual_seed(5)
    logits = torch.randn(128, 40, generator=gen) * 3
    temperature = torch.rand(128, generator=gen) * 2 + 0.05
    expected = torch.softmax(logits / temperature[:, None], dim=-1)
    no_k, no_p = torch.zeros(128, dtype=torch.int64), torch.ones(128)
    torch.testing.assert_close(filtered_probs(logits, temperature, no_k, no_p, use_filters=False), expected)
    torch.testing.assert_close(filtered_probs(logits, temperature, no_k, no_p, use_filters=True), expected,
                               atol=1e-6, rtol=1e-5)


def test_filtered_probs_use_filters_false_equals_neutral_filters():
    gen = torch.Generator().manual_seed(6)
    logits, temperature, top_k, top_p = _random_params(128, 64, gen)
    temperature[::3] = 0.0
    neutral = filtered_probs(logits, temperature, torch.zeros_like(top_k), torch.ones_like(top_p), use_filters=True)
    # With use_filters=False the per-row top_k / top_p are ignored altogether.
    off = filtered_probs(logits, temperature, top_k, top_p, use_filters=False)
    torch.testing.assert_close(off, neutral, atol=1e-6, rtol=1e-5)


def test_filtered_probs_top_p_one_keeps_every_token():
    # top_p = 1 means "no nucleus filter" (vLLM, TensorRT-LLM): every token of positive probability stays sampleable,
    # whether or not another request of the batch turns the filters on (use_filters is a batch-wide property).
    hand = torch.tensor([[0.0, 0.0, -20.0]])  # softmax: 0.5, 0.5, 1.03e-9; the fp32 cumsum is exactly 1.0 at token 1
    rand = torch.randn(8, 64, generator=torch.Generator().manual_seed(0)) * 6
    for logits in (hand, rand):
        r = logits.shape[0]
        no_k = torch.zeros(r, dtype=torch.int64)
        probs = filtered_probs(logits, torch.ones(r), no_k, torch.ones(r), use_filters=True)
        assert torch.equal(probs > 0, torch.softmax(logits, -1) > 0)


# ---------------------------------------------------------------------------------------------------------------
# sample_from_probs
# ---------------------------------------------------------------------------------------------------------------


def test_sample_from_probs_never_returns_zero_probability_tokens():
    gen = torch.Generator().manual_seed(7)
    weights = torch.rand(512, 16, generator=gen) * (torch.rand(512, 16, generator=gen) < 0.3)
    weights[:, 0] = 0.0  # leading zeros
    weights[:, -3:] = 0.0  # trailing zeros
    weights[torch.arange(512), torch.randint(1, 13, (512,), generator=gen)] += 0.01  # positive mass per row
    weights[::2] *= 7.3  # unnormalised rows
    edge = torch.tensor([0.0, 2.0**-24, 0.5, 1 - 2.0**-23, 1 - 2.0**-24])
    hashed = counter_uniform(torch.arange(512), torch.zeros(512, 1, dtype=torch.int64), STREAM_SAMPLE)[:, 0]
    uniforms = [torch.rand(512, generator=gen), hashed]
    uniforms += [torch.full((512,), e.item()) for e in edge]
    for u in uniforms:
        ids = sample_from_probs(weights, u)
        assert ids.dtype == torch.int64 and ids.shape == (512,)
        assert (weights.gather(-1, ids[:, None]) > 0).all()
    # u = 0 picks the first positive token; the largest u the last positive one.
    first_pos = (weights > 0).int().argmax(-1)
    last_pos = 15 - (weights > 0).int().flip(-1).argmax(-1)
    assert torch.equal(sample_from_probs(weights, torch.zeros(512)), first_pos)
    assert torch.equal(sample_from_probs(weights, torch.full((512,), 1 - 2.0**-24)), last_pos)


def test_sample_from_probs_batched_shapes():
    probs = torch.softmax(torch.randn(3, 4, 9, generator=torch.Generator().manual_seed(8)), -1)
    u = torch.rand(3, 4, generator=torch.Generator().manual_seed(9))
    ids = sample_from_probs(probs, u)
    assert ids.shape == (3, 4)
    assert torch.equal(ids.flatten(), sample_from_probs(probs.reshape(12, 9), u.flatten()))


def test_sample_from_probs_histogram_matches_probs():
    probs = torch.tensor([0.02, 0.0, 0.18, 0.05, 0.30, 0.0, 0.10, 0.25, 0.07, 0.03])
    n = 200_000
    u = counter_uniform(torch.arange(n // 100), torch.arange(100).expand(n // 100, 100), STREAM_SAMPLE).flatten()
    ids = sample_from_probs(probs.expand(n, -1), u)
    counts = torch.bincount(ids, minlength=10).double()
    assert counts[probs == 0].sum() == 0
    expected = probs.double() * n
    support = probs > 0
    chi2 = float(((counts[support] - expected[support]) ** 2 / expected[support]).sum())
    assert int(support.sum()) == 8 and chi2 < CHI2_9999[7]
    # Unnormalised weights give the same draws (up to rounding at bin edges).
    assert (sample_from_probs(probs.expand(n, -1) * 3.7, u) != ids).float().mean() < 1e-3


def _flip_rates(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """For uniforms a, b (24 random bits each): how often each of the 24 output bits differs → [24]."""
    diff = (a.double() * (1 << 24)).long() ^ (b.double() * (1 << 24)).long()
    return ((diff[..., None] >> torch.arange(24)) & 1).double().flatten(0, -2).mean(0)


@pytest.mark.parametrize("what", ["counter", "seed"])
def test_counter_uniform_avalanche(what):
    # Flipping any one input bit flips every output bit with probability 1/2 (a strict-avalanche check): a hash
    # with too few mixing rounds leaves neighbouring seeds / positions correlated in some bits.
    gen = torch.Generator().manual_seed(11)
    seeds = torch.randint(0, 2**62, (4096,), generator=gen)
    counters = torch.randint(0, 2**20, (4096, 1), generator=gen)
    base = counter_uniform(seeds, counters, STREAM_SAMPLE)
    for bit in (0, 1, 2, 7, 15, 16, 23, 31, 32, 40, 55):
        if what == "counter":
            flipped = counter_uniform(seeds, counters ^ (1 << bit), STREAM_SAMPLE)
        else:
            flipped = counter_uniform(seeds ^ (1 << bit), counters, STREAM_SAMPLE)
        rates = _flip_rates(base, flipped)  # std of each rate ≈ 0.008
        assert ((rates - 0.5).abs() < 0.05).all(), f"{what} bit {bit}: flip rates {rates.tolist()}"


# ---------------------------------------------------------------------------------------------------------------
# filtered_probs on a CPU: thresholds from each row's CANDIDATES largest logits, a whole-row sort where they do not
# decide them
# ---------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("candidates", [3, 8, 20])
def test_candidate_thresholds_equal_the_brute_force(candidates, monkeypatch):
    """With few candidates most rows' nuclei are wider (sorted whole), some fit; every row matches the brute force."""
    import nextn.plugins.sampling as sampling

    monkeypatch.setattr(sampling, "CANDIDATES", candidates)
    gen = torch.Generator().manual_seed(candidates)
    logits, temperature, top_k, top_p = _random_params(300, 24, gen)
    logits[::7] *= 6  # peaked rows: their nucleus fits a few candidates
    probs = filtered_probs(logits, temperature, top_k, top_p)
    for r in range(300):
        expected = _brute_force_filtered(logits[r], temperature[r].item(), top_k[r].item(), top_p[r].item())
        if top_p[r] < 1:
            assert torch.equal(probs[r] > 0, expected > 0), f"row {r}: support differs"
        torch.testing.assert_close(probs[r].double(), expected, atol=1e-6, rtol=1e-5)


def test_candidate_thresholds_decide_a_row_alone(monkeypatch):
    """A row's distribution is the same alone and amid rows whose nuclei make the batch sort (batch invariance), on
    a vocabulary as wide as Qwen's."""
    import nextn.plugins.sampling as sampling

    gen = torch.Generator().manual_seed(9)
    v = 151936
    logits = torch.randn(12, v, generator=gen) * torch.tensor([1.0, 8.0] * 6)[:, None]
    temperature = torch.full((12,), 0.8)
    top_k = torch.tensor([0, 0, 40, 0, 300, 1, 0, 0, 5000, 0, 20, 0])
    top_p = torch.tensor([0.95, 0.9, 1.0, 0.5, 0.99, 1.0, 1.0, 0.3, 0.9, 0.999, 0.8, 0.7])
    batch = filtered_probs(logits, temperature, top_k, top_p)
    for r in range(12):
        assert torch.equal(filtered_probs(logits[r:r + 1], temperature[r:r + 1], top_k[r:r + 1], top_p[r:r + 1]),
                           batch[r:r + 1]), r
    monkeypatch.setattr(sampling, "CANDIDATES", v)  # every row sorted whole: the same supports
    assert torch.equal(filtered_probs(logits, temperature, top_k, top_p) > 0, batch > 0)


def test_top_k_keeps_the_tokens_tied_with_the_kth():
    logits = torch.tensor([[3.0, 1.0, 2.0, 2.0, 0.0, 2.0]])
    probs = filtered_probs(logits, torch.ones(1), torch.tensor([2]), torch.ones(1))
    assert (probs > 0).tolist() == [[True, False, True, True, False, True]]
