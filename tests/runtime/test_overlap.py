"""The overlap scheduler (step n launched from step n−1's device outputs) gives exactly the outputs of synchronous
stepping — greedy and seeded sampling, MTP Eagle K=1/K=3, MTP Vanilla, Medusa and plain decoding, with requests
arriving between steps, a KV cache small enough to preempt, and cancellation."""

from __future__ import annotations


import pytest
import torch

from nextn import LLM, SamplingParams

PROMPTS = [[11, 12, 13, 14, 15], [30, 31, 32], [7, 8, 9, 10, 11, 12, 13, 14, 15, 16], [40], [50, 51, 52, 53]]
MTP = lambda k, vanilla=False: {"decoding_type": "MTP", "num_nextn_predict_layers": k, "use_mtp_vanilla": vanilla}  # noqa: E731
TREE = [[0], [1], [0, 0], [0, 1], [1, 0], [0, 0, 0]]


def _params() -> list[SamplingParams]:
    """Greedy and seeded sampling requests mixed in one batch."""
    greedy = SamplingParams(max_tokens=14, ignore_eos=True)
    sampled = lambda seed: SamplingParams(max_tokens=14, ignore_eos=True, temperature=0.8, top_k=5, seed=seed)  # noqa: E731
    return [greedy, sampled(1), greedy, sampled(2), greedy]


def staggered(llm: LLM, prompts, params, every: int = 2, abort: int | None = None) -> list[list[int]]:
    """Add one request every `every` steps (in-flight batching); optionally cancel request `abort` after 3 steps."""
    pending, ids, outs, n = list(zip(prompts, params)), [], {}, 0
    while pending or llm.has_unfinished_requests:
        if pending and n % every == 0:
            ids.append(llm.add_request(*pending.pop(0)))
        if abort is not None and n == 3:
            outs[ids[abort]] = llm.abort_request(ids[abort])
        for out in llm.step():
            outs[out.request_id] = out
        n += 1
    return [outs[i].outputs[0].token_ids for i in ids]


@pytest.fixture(scope="module")
def medusa(medusa_engine):
    return medusa_engine


@pytest.mark.parametrize("which,spec", [("eagle", None), ("eagle", MTP(1)), ("eagle", MTP(3)),
                                        ("vanilla", MTP(2)), ("medusa", {"decoding_type": "Medusa", "medusa_choices": TREE})])
def test_overlap_on_and_off_give_identical_outputs(request, which, spec):
    engine = request.getfixturevalue(which)
    outs = {}
    for disable in (True, False):
        llm = LLM(engine, speculative_config=spec, disable_overlap_scheduler=disable)
        assert llm.engine.overlap is not disable
        outs[disable] = staggered(llm, PROMPTS, _params())
        assert llm.engine.pool.num_free == llm.engine.pool.num_blocks - 1  # every block returned
    assert outs[False] == outs[True]
    assert all(len(t) == 14 for t in outs[False])
    if spec is not None:  # greedy requests: the same tokens as plain decoding
        plain = LLM(engine, speculative_config=None, disable_overlap_scheduler=True)
        ref = plain.generate([PROMPTS[i] for i in (0, 2, 4)], SamplingParams(max_tokens=14, ignore_eos=True))
        assert [outs[False][i] for i in (0, 2, 4)] == [o.outputs[0].token_ids for o in ref]


def test_overlap_keeps_the_previous_step_on_the_device(eagle, monkeypatch):
    """Step n is launched before step n−1 is read back: the engine holds one step in flight between calls."""
    llm = LLM(eagle, speculative_config=MTP(3))
    eng = llm.engine
    eng.add_request(eng.make_request(PROMPTS[0], SamplingParams(max_tokens=10, ignore_eos=True)))
    assert eng.step() == [] and eng._inflight is not None  # the prefill is launched, nothing read back yet
    req = eng.scheduler.running[0]
    assert req.output_token_ids == [] and req.progress.num_inflight_tokens == 1
    updated = eng.step()  # launches decode step 1 from the prefill's device outputs, then processes the prefill
    assert updated == [req] and len(req.output_token_ids) == 1 and req.progress.num_inflight_tokens == 4
    events, launch, read_back = [], eng.runner.launch, eng.runner.read_back

    def no_sync(*args, **kwargs):
        raise AssertionError("a host read-back while launching a step")

    def launch_without_sync(batch, prev=None):
        events.append(("launch", batch.kind, prev is not None))
        with monkeypatch.context() as m:  # building the inputs from the previous step must not read it back
            m.setattr(torch.Tensor, "tolist", no_sync)
            m.setattr(torch.Tensor, "item", no_sync)
            return launch(batch, prev)

    monkeypatch.setattr(eng.runner, "launch", launch_without_sync)
    monkeypatch.setattr(eng.runner, "read_back", lambda step: events.append(("read_back",)) or read_back(step))
    while eng.has_work:
        eng.step()
    assert len(req.output_token_ids) == 10 and req.finished
    assert events[0] == ("launch", "decode", True) and events[1] == ("read_back",)  # launch n, then read n − 1


def test_overlap_with_preemption_and_cancellation(eagle):
    """A KV cache too small for all requests (preemption forces a sync) and a cancelled request: the others get
    exactly their synchronous outputs, and every block comes back."""
    params = [SamplingParams(max_tokens=24, ignore_eos=True)] * 5
    ref = staggered(LLM(eagle, speculative_config=MTP(3), disable_overlap_scheduler=True), PROMPTS, params, every=1)
    tight = LLM(eagle, speculative_config=MTP(3), kv_cache_config={"max_tokens": 96, "tokens_per_block": 8})
    outs = staggered(tight, PROMPTS, params, every=1, abort=1)
    assert tight.engine.scheduler.num_preemptions > 0
    assert [o for i, o in enumerate(outs) if i != 1] == [o for i, o in enumerate(ref) if i != 1]
    assert outs[1] == ref[1][: len(outs[1])] and len(outs[1]) < 24  # cancelled: what it had so far
    assert tight.engine.pool.num_free == tight.engine.pool.num_blocks - 1
