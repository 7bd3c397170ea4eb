"""The verify-and-draft step is one graph: it runs under `torch.compile(fullgraph=True)` (no host sync, no
data-dependent Python branching, no boolean-mask indexing, MoE dispatch included) and matches eager exactly."""

from __future__ import annotations

import pytest
import torch

from nextn.testing import SMALL_VOCAB as SMALL
from nextn import LLM
from nextn.speculative.protocol import SamplingTensors
from nextn.speculative.chain_step import verify_and_draft_step


@pytest.mark.parametrize("modules,k,backend,sampled,relaxed", [
    (1, 2, "inductor", False, False),
    (3, 3, "aot_eager", True, False),
    (1, 0, "aot_eager", True, False),
    (1, 3, "aot_eager", True, True),
])
def test_decode_step_compiles_fullgraph(checkpoints, modules, k, backend, sampled, relaxed):
    engine = checkpoints.engine(num_mtp_modules=modules, **SMALL)
    spec = {"decoding_type": "MTP", "num_nextn_predict_layers": k, "use_relaxed_acceptance_for_thinking": relaxed,
            "relaxed_topk": 3, "relaxed_delta": 0.5} if k else None
    eng = LLM(engine, speculative_config=spec).engine
    torch._dynamo.reset()
    gen = torch.Generator().manual_seed(0)
    b = 3
    ids = torch.randint(0, 512, (b, k + 1), generator=gen)
    kv_lens = torch.tensor([5, 9, 17])
    tables = torch.tensor([[1, 2], [3, 4], [5, 6]])
    state = eng.drafter.initial_state(b, eng.cfg.hidden_size, torch.device("cpu"), torch.float32)
    accept_state = eng.acceptance.initial_state(b, torch.device("cpu"))
    # Mixed batch: a greedy request beside sampling ones with top-k / top-p filters.
    sampling = SamplingTensors(torch.tensor([0.0, 0.7, 1.0]) * sampled, torch.tensor([0, 5, 0]), torch.tensor([1.0, 1.0, 0.9]),
                               torch.tensor([1, 2, 3]), any_sampled=sampled, use_filters=sampled)
    kv = eng.runner.kv_cache
    kv.normal_(generator=gen)
    args = (eng.model, eng.drafter, eng.acceptance)
    with torch.inference_mode():
        ref = verify_and_draft_step(*args, kv.clone(), ids, kv_lens, tables, sampling, state, accept_state, eng.block_size)
        step = torch.compile(verify_and_draft_step, fullgraph=True, dynamic=False, backend=backend)
        out = step(*args, kv.clone(), ids, kv_lens, tables, sampling, state, accept_state, eng.block_size)
    assert torch.equal(out.tokens, ref.tokens)
    assert torch.equal(out.num_emitted, ref.num_emitted)
    assert torch.equal(out.draft_tokens, ref.draft_tokens)
