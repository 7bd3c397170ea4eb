"""Disaggregated prefill/decode: outputs identical to one engine in every first-MTP-step mode; the MindIE-LLM
zero-hidden-state first step writes its MTP KV to the dummy block, leaving the received row intact."""

from __future__ import annotations

import pytest
import torch

from nextn import LLM, SamplingParams
from nextn.config.llm_args import parse_llm_args
from nextn.distributed.disaggregated import ContextSide, DisaggregatedLLM, GenerationSide, _slots
from nextn.runtime.engine import Engine
from nextn.testing import SMALL_VOCAB

MTP = {"decoding_type": "MTP", "num_nextn_predict_layers": 2}
SP = SamplingParams(max_tokens=10, ignore_eos=True)
PROMPTS = [[5, 6, 7, 8, 5, 6, 7], [9], list(range(20, 50)), [100, 101, 102, 103]]


@pytest.fixture(scope="module")
def engine_dir(checkpoints):
    return checkpoints.engine(distill_steps=150, num_mtp_modules=1, **SMALL_VOCAB)


@pytest.fixture(scope="module")
def reference(engine_dir):
    return [o.outputs[0].token_ids for o in LLM(engine_dir, speculative_config=MTP).generate(PROMPTS, SP)]


def sides(engine_dir, mode):
    spec = parse_llm_args({"speculative_config": MTP}).speculative_config
    ctx = ContextSide(Engine(engine_dir, parse_llm_args({}, disable_overlap_scheduler=True), spec), mode)
    return ctx, GenerationSide(Engine(engine_dir, parse_llm_args({}), spec), mode)


@pytest.mark.parametrize("mode", ["drafts", "hidden_state", "zero_hidden"])
def test_in_process_handover_is_lossless(engine_dir, reference, mode):
    ctx, gen = sides(engine_dir, mode)
    transfers = ctx.prefill(PROMPTS, [SP] * len(PROMPTS))
    assert ctx.engine.pool.num_free == ctx.engine.pool.num_blocks - 1  # the context engine kept no blocks
    results = sorted(gen.run(transfers))
    assert [out.outputs[0].token_ids for _, out, _ in results] == reference


def test_zero_hidden_first_step_keeps_the_received_mtp_kv(engine_dir):
    ctx, gen = sides(engine_dir, "zero_hidden")
    (t, rows, hidden), = ctx.prefill([list(range(20, 50))], [SP])
    assert hidden is None and t.num_rows == 30
    req = gen.admit(t, rows, hidden)
    kv = gen.engine.runner.kv_cache[:, _slots(req.block_table, t.num_rows, gen.engine.block_size)]
    torch.testing.assert_close(kv, rows, rtol=0, atol=0)  # target and MTP rows as received, row L−1 included
    _, gen_hidden = sides(engine_dir, "hidden_state")
    ctx2, _ = sides(engine_dir, "hidden_state")
    (t2, rows2, h2), = ctx2.prefill([list(range(20, 50))], [SP])
    assert h2 is not None and list(t2.drafts) == gen_hidden.admit(t2, rows2, h2).draft_tokens  # same drafts


def test_two_processes_over_torch_distributed(engine_dir, reference):
    llm = DisaggregatedLLM(engine_dir, {"context_servers": {"num_instances": 1, "max_batch_size": 4},
                                        "generation_servers": {"num_instances": 1},
                                        "first_mtp_step": "zero_hidden"}, speculative_config=MTP)
    try:
        outs, first = llm.generate(PROMPTS, SP)
    finally:
        llm.close()
    assert [o.outputs[0].token_ids for o in outs] == reference and len(first) == len(PROMPTS)
