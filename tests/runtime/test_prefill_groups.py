"""A prefill of prompts of different lengths runs its forward per group of similar lengths (`prefill_groups`), so
the pads of a right-padded batch are not computed; every value equals the one padded forward's, bit for bit."""

from __future__ import annotations

import random

import torch

from nextn import LLM, SamplingParams
from nextn.models.kv_cache import allocate_kv_cache
from nextn.speculative.acceptance_rules import StandardAcceptance, greedy_sampling
from nextn.speculative.chain_step import PREFILL_PADDING_SLACK, prefill_groups, prefill_step

MTP3 = {"decoding_type": "MTP", "num_nextn_predict_layers": 3}
BLOCK = 8


def test_groups_cover_every_row_once_and_bound_their_padding():
    rng = random.Random(0)
    for _ in range(300):
        lens = [rng.choice([rng.randint(1, 20), rng.randint(1, 600)]) for _ in range(rng.randint(1, 24))]
        groups = prefill_groups(lens)
        assert sorted(r for rows, _ in groups for r in rows) == list(range(len(lens)))
        for rows, width in groups:
            assert rows == sorted(rows) and width == max(lens[r] for r in rows)
            true = sum(lens[r] for r in rows)
            assert len(rows) == 1 or len(rows) * width <= (1 + PREFILL_PADDING_SLACK) * true
    assert prefill_groups([64] * 8) == [(list(range(8)), 64)]  # nothing to save: one forward, as before
    assert prefill_groups([200, 10, 12, 11]) == [([0], 200), ([1, 2, 3], 12)]
    assert prefill_groups([]) == []


def _prefill(engine, prompts: list[list[int]], groups):
    """prefill_step over the right-padded prompts on a fresh cache (rows on interleaved blocks) → (output, kv),
    counting the target forwards and their shapes."""
    model = engine.model
    b, t = len(prompts), max(map(len, prompts))
    per_row = -(-(t + 8) // BLOCK)
    tables = torch.tensor([[1 + r + b * j for j in range(per_row)] for r in range(b)])
    kv = allocate_kv_cache(model.num_cache_layers, 1 + b * per_row, BLOCK, engine.cfg.kv_cache_dim, torch.float32)
    ids = torch.tensor([p + [0] * (t - len(p)) for p in prompts])
    shapes = []
    hook = model.register_forward_hook(lambda m, args, out: shapes.append(tuple(args[0].shape)))
    try:
        with torch.inference_mode():
            out = prefill_step(model, engine.drafter, StandardAcceptance(), kv, ids, torch.tensor(list(map(len, prompts))),
                               tables, greedy_sampling(b), (), BLOCK, row_groups=groups)
    finally:
        hook.remove()
    return out, kv, shapes


def test_a_grouped_prefill_equals_the_padded_forward_bit_for_bit(eagle):
    engine = LLM(eagle, speculative_config=MTP3, disable_overlap_scheduler=True).engine
    prompts = [[(5 * i + j) % 300 + 3 for j in range(n)] for i, n in enumerate([61, 7, 9, 33, 8, 30])]
    groups = prefill_groups(list(map(len, prompts)))
    assert len(groups) == 3
    padded, kv_padded, shapes_padded = _prefill(engine, prompts, None)
    grouped, kv_grouped, shapes_grouped = _prefill(engine, prompts, groups)
    assert shapes_padded == [(6, 61)]
    assert sorted(shapes_grouped) == sorted((len(rows), width) for rows, width in groups)  # the pads not computed
    assert torch.equal(grouped.tokens, padded.tokens)
    assert torch.equal(grouped.draft_tokens, padded.draft_tokens)  # MTP drafts from the grouped hidden states
    for a, b in zip(grouped.drafter_state, padded.drafter_state):
        assert torch.equal(a, b)
    assert torch.equal(kv_grouped[:, BLOCK:], kv_padded[:, BLOCK:])  # every request's KV (block 0: the pads' sink)


def test_an_engine_batch_of_mixed_lengths_gives_each_prompt_its_alone_output(eagle):
    prompts = [[(11 * i + j) % 300 + 3 for j in range(n)] for i, n in enumerate([90, 6, 41, 9, 12, 70])]
    sp = SamplingParams(max_tokens=10, ignore_eos=True)
    llm = LLM(eagle, speculative_config=MTP3)
    llm.engine.iteration_log = []
    batch = [o.outputs[0].token_ids for o in llm.generate(prompts, sp)]
    assert [e["num_requests"] for e in llm.engine.iteration_log if e["kind"] == "prefill"] == [6]
    assert batch == [llm.generate(p, sp).outputs[0].token_ids for p in prompts]
