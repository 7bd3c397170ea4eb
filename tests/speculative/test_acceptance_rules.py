"""Acceptance rules as strategies: the thinking-phase state of `RelaxedAcceptance`, and which algorithm each row of
a mixed greedy / sampling batch goes through (strict or relaxed for greedy rows, rejection sampling with the
runtime's counter-based uniforms for sampling rows)."""

from __future__ import annotations

import pytest
import torch

from nextn.speculative.acceptance_reference import coupled_acceptance, relaxed_acceptance, strict_acceptance
from nextn.plugins.sampling import STREAM_ACCEPT, STREAM_SAMPLE, counter_uniform, filtered_probs
from nextn.speculative.acceptance_rules import RelaxedAcceptance, StandardAcceptance, greedy_sampling
from nextn.speculative.protocol import SamplingTensors

V, BEGIN, END = 8, 6, 7  # tiny vocab; <think> = 6, </think> = 7
DELTA = 0.4


def _rule(delta: float = DELTA) -> RelaxedAcceptance:
    return RelaxedAcceptance(topk=3, delta=delta, begin_token=BEGIN, end_token=END)


# ---------------------------------------------------------------------------------------------------------------
# RelaxedAcceptance: thinking state
# ---------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(("prompt", "expected"), [
    ([1, 2, BEGIN, 3], DELTA),  # inside <think> after the prompt
    ([BEGIN], DELTA),
    ([1, BEGIN, 3, END], 0.0),  # the prompt ends after </think>
    ([1, BEGIN, 3, END, 4, 5], 0.0),
    ([BEGIN, END, 2, BEGIN, 3], DELTA),  # a later <think> reopens the phase
    ([END, 1, BEGIN], DELTA),
    ([1, 2, 3], 0.0),  # neither token
    ([], 0.0),
    ([END, 2], 0.0),
])
def test_prompt_state(prompt, expected):
    assert _rule().prompt_state(prompt) == (expected,)


def test_initial_state_is_off():
    (delta,) = _rule().initial_state(5, torch.device("cpu"))
    assert delta.shape == (5,) and delta.dtype == torch.float32 and (delta == 0).all()


# (emitted row [K+1 = 4], num_emitted, delta before, delta after)
TRANSITIONS = [
    ([1, BEGIN, 2, 3], 4, 0.0, DELTA),  # <think> emitted: on
    ([END, 1, 2, 3], 2, DELTA, 0.0),  # </think> emitted: off
    ([BEGIN, 2, END, 3], 4, 0.0, 0.0),  # both: the last one wins
    ([END, 2, BEGIN, 3], 3, 0.0, DELTA),
    ([BEGIN, 2, END, 3], 4, DELTA, 0.0),
    ([1, END, BEGIN, END], 3, 0.0, DELTA),  # the </think> beyond num_emitted does not count
    ([1, 2, BEGIN, 3], 2, 0.0, 0.0),  # <think> beyond num_emitted: ignored
    ([1, 2, END, 3], 2, DELTA, DELTA),  # </think> beyond num_emitted: ignored
    ([1, 2, 3, 4], 4, 0.123, 0.123),  # neither: unchanged (not reset to 0 or to delta)
    ([1, 2, 3, 4], 4, 0.0, 0.0),
    ([BEGIN, 2, 3, BEGIN], 4, DELTA, DELTA),  # <think> while thinking: stays on
    ([END, 2, 3, 4], 1, 0.0, 0.0),  # </think> while not thinking: stays off
]


def test_update_delta_transitions():
    tokens = torch.tensor([t[0] for t in TRANSITIONS])
    num_emitted = torch.tensor([t[1] for t in TRANSITIONS])
    before = torch.tensor([t[2] for t in TRANSITIONS])
    after = _rule().update_delta(tokens, num_emitted, before)
    assert after.dtype == torch.float32
    torch.testing.assert_close(after, torch.tensor([t[3] for t in TRANSITIONS]), rtol=0, atol=0)
    (observed,) = _rule().observe(tokens, num_emitted, (before,))
    assert torch.equal(observed, after)


def test_observe_prefill_token():
    # After prefill one token is emitted per request ([B, 1]).
    (delta,) = _rule().observe(torch.tensor([[BEGIN], [END], [3]]), torch.ones(3, dtype=torch.int64),
                               (torch.tensor([0.0, DELTA, 0.2]),))
    assert delta.tolist() == pytest.approx([DELTA, 0.0, 0.2])


# ---------------------------------------------------------------------------------------------------------------
# accept: which algorithm each row uses
# ---------------------------------------------------------------------------------------------------------------


def _batch(seed: int, b: int, k: int):
    gen = torch.Generator().manual_seed(seed)
    logits = torch.randn(b, k + 1, V, generator=gen) * 1.5
    ranked = logits.argsort(-1, descending=True)[:, :k]  # drafts among each position's top-3
    drafts = ranked.gather(-1, torch.randint(0, 3, (b, k, 1), generator=gen)).squeeze(-1)
    first_position = torch.randint(0, 1000, (b,), generator=gen)
    return logits, drafts, first_position


def _sampling(temperature: list[float], top_k: list[int], top_p: list[float], seed: list[int]) -> SamplingTensors:
    t = torch.tensor(temperature)
    k, p = torch.tensor(top_k), torch.tensor(top_p)
    return SamplingTensors(t, k, p, torch.tensor(seed), any_sampled=bool((t > 0).any()),
                           use_filters=bool(((k > 0) | (p < 1)).any()))


def _expected_rejection(logits, drafts, first_position, sampling: SamplingTensors, rows: list[int]):
    """What speculative sampling of deterministic drafts gives on `rows` (`coupled_acceptance`), with the uniforms
    keyed as the runtime keys them: per request seed, the position each token would land at (first_position + j),
    STREAM_SAMPLE."""
    r = torch.tensor(rows)
    k = drafts.shape[1]
    positions = first_position[r, None] + torch.arange(k + 1)  # [R, K+1]
    accept_u = counter_uniform(sampling.seed[r], positions[:, :k], STREAM_ACCEPT)
    sample_u = counter_uniform(sampling.seed[r], positions, STREAM_SAMPLE)
    rep = lambda x: x[r].repeat_interleave(k + 1)  # noqa: E731
    probs = filtered_probs(logits[r].reshape(-1, V), rep(sampling.temperature), rep(sampling.top_k),
                           rep(sampling.top_p), sampling.use_filters).view(len(rows), k + 1, V)
    assert accept_u.shape == (len(rows), k)  # keyed as the runtime keys them (unused by deterministic drafts)
    return coupled_acceptance(probs, drafts[r], sample_u)  # deterministic drafts: the coupled rule


def test_relaxed_rule_mixed_batch():
    k = 3
    logits, drafts, first_position = _batch(1, 8, k)
    sampling = _sampling([0.0, 0.8, 0.0, 1.0, 0.0, 0.6, 0.0, 1.3], [0, 0, 0, 4, 0, 0, 0, 2],
                         [1.0, 1.0, 1.0, 1.0, 1.0, 0.8, 1.0, 1.0], [11, 12, 13, 14, 15, 16, 17, 18])
    greedy, sampled = [0, 2, 4, 6], [1, 3, 5, 7]
    delta = torch.tensor([DELTA, DELTA, 0.0, DELTA, DELTA, 0.0, 0.0, DELTA])
    tokens, n, (new_delta,) = _rule().accept(logits, drafts, first_position, sampling, (delta,))
    assert tokens.shape == (8, k + 1) and n.shape == (8,)
    # Greedy rows: relaxed acceptance with their own delta (0 = strict).
    g = torch.tensor(greedy)
    r_tokens, r_n = relaxed_acceptance(logits[g], drafts[g], delta[g], 3)
    assert torch.equal(n[g], r_n) and torch.equal(tokens[g], r_tokens)
    assert (r_n > strict_acceptance(logits[g], drafts[g])[1]).any()  # the case does exercise the relaxation
    # Sampling rows: exactly rejection sampling with the runtime's uniforms (not relaxed, even with delta > 0).
    s_tokens, s_n = _expected_rejection(logits, drafts, first_position, sampling, sampled)
    s = torch.tensor(sampled)
    assert torch.equal(n[s], s_n) and torch.equal(tokens[s], s_tokens)
    # The new state follows the emitted tokens.
    assert torch.equal(new_delta, _rule().update_delta(tokens, n, delta))


def test_relaxed_rule_all_greedy_and_delta_zero():
    logits, drafts, first_position = _batch(2, 64, 4)
    delta = torch.where(torch.arange(64) % 2 == 0, DELTA, 0.0)
    tokens, n, _ = _rule().accept(logits, drafts, first_position, greedy_sampling(64), (delta,))
    r_tokens, r_n = relaxed_acceptance(logits, drafts, delta, 3)
    assert torch.equal(tokens, r_tokens) and torch.equal(n, r_n)
    # Outside the thinking phase (delta 0) the rule is strict acceptance.
    tokens, n, _ = _rule().accept(logits, drafts, first_position, greedy_sampling(64), (torch.zeros(64),))
    s_tokens, s_n = strict_acceptance(logits, drafts)
    assert torch.equal(tokens, s_tokens) and torch.equal(n, s_n)


def test_relaxed_rule_thinking_ends_and_starts_inside_a_step():
    # Greedy rows whose emitted tokens contain </think> (row 0) or <think> (row 1): the state flips in `accept`.
    probs = torch.full((2, 3, V), 0.02)
    probs[0, 0, 1], probs[0, 1, END], probs[0, 2, 3] = 0.86, 0.86, 0.86
    probs[1, 0, BEGIN], probs[1, 1, 2], probs[1, 2, 4] = 0.86, 0.86, 0.86
    drafts = torch.tensor([[1, END], [BEGIN, 5]])  # row 0: all accepted (bonus 3); row 1: 5 rejected → emits 2
    tokens, n, (delta,) = _rule().accept(probs.log(), drafts, torch.zeros(2, dtype=torch.int64), greedy_sampling(2),
                                         (torch.tensor([DELTA, 0.0]),))
    assert n.tolist() == [3, 2]
    assert tokens[0].tolist() == [1, END, 3] and tokens[1, :2].tolist() == [BEGIN, 2]
    assert delta.tolist() == pytest.approx([0.0, DELTA])


# ---------------------------------------------------------------------------------------------------------------
# StandardAcceptance
# ---------------------------------------------------------------------------------------------------------------


def test_standard_all_greedy_is_strict():
    rule = StandardAcceptance()
    assert rule.initial_state(4, torch.device("cpu")) == () and rule.prompt_state([1, BEGIN]) == ()
    logits, drafts, first_position = _batch(3, 64, 3)
    tokens, n, state = rule.accept(logits, drafts, first_position, greedy_sampling(64), ())
    s_tokens, s_n = strict_acceptance(logits, drafts)
    assert state == () and torch.equal(tokens, s_tokens) and torch.equal(n, s_n)


@pytest.mark.parametrize("use_filters", [False, True])
def test_standard_one_sampling_row_keeps_greedy_rows_strict(use_filters):
    k, b = 3, 32
    logits, drafts, first_position = _batch(4, b, k)
    temperature = [0.0] * b
    temperature[5] = 0.9
    top_k = [0] * b
    if use_filters:
        top_k[5] = 4
    sampling = _sampling(temperature, top_k, [1.0] * b, list(range(100, 100 + b)))
    assert sampling.any_sampled and sampling.use_filters == use_filters
    tokens, n, _ = StandardAcceptance().accept(logits, drafts, first_position, sampling, ())
    greedy = torch.tensor([i for i in range(b) if i != 5])
    s_tokens, s_n = strict_acceptance(logits[greedy], drafts[greedy])
    # The coupled rule on a one-hot p is exactly strict acceptance: emitted tokens, counts, and even the unused tail.
    assert torch.equal(n[greedy], s_n) and torch.equal(tokens[greedy], s_tokens)
    r_tokens, r_n = _expected_rejection(logits, drafts, first_position, sampling, [5])
    assert torch.equal(n[5:6], r_n) and torch.equal(tokens[5:6], r_tokens)


def test_standard_sampling_rows_do_not_depend_on_the_batch():
    k = 3
    logits, drafts, first_position = _batch(5, 16, k)
    sampling = _sampling([1.0, 0.7] * 8, [0] * 16, [1.0] * 16, [7 * i + 1 for i in range(16)])
    tokens, n, _ = StandardAcceptance().accept(logits, drafts, first_position, sampling, ())
    for row in (0, 3, 9):
        alone = SamplingTensors(sampling.temperature[row:row + 1], sampling.top_k[row:row + 1],
                                sampling.top_p[row:row + 1], sampling.seed[row:row + 1], True, False)
        t, m, _ = StandardAcceptance().accept(logits[row:row + 1], drafts[row:row + 1],
                                              first_position[row:row + 1], alone, ())
        assert torch.equal(t, tokens[row:row + 1]) and torch.equal(m, n[row:row + 1])


def test_sampling_tensors_probs_apply_each_request_parameters_to_all_its_rows():
    gen = torch.Generator().manual_seed(6)
    logits = torch.randn(3, 4, V, generator=gen)
    sampling = _sampling([0.0, 0.5, 1.2], [0, 3, 0], [1.0, 1.0, 0.7], [1, 2, 3])
    probs = sampling.probs(logits)
    assert probs.shape == (3, 4, V)
    for b in range(3):
        expected = filtered_probs(logits[b], sampling.temperature[b].expand(4), sampling.top_k[b].expand(4),
                                  sampling.top_p[b].expand(4))
        torch.testing.assert_close(probs[b], expected)


def test_greedy_sampling():
    s = greedy_sampling(3)
    assert not s.any_sampled and not s.use_filters
    assert s.temperature.tolist() == [0.0] * 3 and s.top_k.tolist() == [0] * 3 and s.top_p.tolist() == [1.0] * 3
    assert s.top_k.dtype == torch.int64 and s.seed.dtype == torch.int64


def test_coupled_acceptance_emits_the_draws_and_keeps_the_matching_prefix():
    """Deterministic drafts: the emitted tokens are the target's draws with the positions' uniforms whatever the
    drafts (so plain decoding's tokens with the same seed); drafts count only up to the first mismatch."""
    torch.manual_seed(0)
    probs = torch.softmax(torch.randn(6, 4, V), -1)
    u = torch.rand(6, 4)
    draws = coupled_acceptance(probs, torch.zeros(6, 3, dtype=torch.int64), u)[0]
    drafts = draws[:, :3].clone()
    drafts[1, 0] += 1  # mismatch first: 0 accepted
    drafts[2, 1] += 1  # second: 1
    drafts[3, 2] += 1  # third: 2
    drafts[4, 0] += 1  # a later match after a mismatch does not count
    tokens, n = coupled_acceptance(probs, drafts % V, u)
    assert torch.equal(tokens, draws)
    assert n.tolist() == [4, 1, 2, 3, 1, 4]
