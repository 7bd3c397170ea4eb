"""The background engine loop: streaming deltas, cancellation, concurrency — against the synchronous API."""

from __future__ import annotations

import asyncio
import threading

import pytest

from nextn import LLM, SamplingParams
from nextn.runtime.engine import RequestError

PROMPTS = [[5, 9, 13], [7, 1, 2, 8, 30, 4], [11] * 9, [3, 22]]


@pytest.fixture(scope="module")
def engine_dir(checkpoints):
    return checkpoints.engine(distill_steps=0)


@pytest.fixture(scope="module")
def reference(engine_dir):
    llm = LLM(engine_dir, device="cpu")
    params = SamplingParams(max_tokens=24, ignore_eos=True)
    return [o.outputs[0].token_ids for o in llm.generate(PROMPTS, params)]


def test_streaming_concatenates_to_generate(engine_dir, reference):
    llm = LLM(engine_dir, device="cpu")
    try:
        params = SamplingParams(max_tokens=24, ignore_eos=True)
        handles = [llm.generate_async(p, params, streaming=True) for p in PROMPTS]
        for handle, expected in zip(handles, reference):
            chunks = [out.outputs[0].token_ids_diff for out in handle]
            assert [t for c in chunks for t in c] == expected
            assert len(chunks) > 1  # one output per step, not one at the end
            assert all(chunks[:-1])  # no empty intermediate deltas
            assert handle.result().outputs[0].token_ids == expected
    finally:
        llm.shutdown()


def test_generate_through_the_loop_and_after_shutdown(engine_dir, reference):
    llm = LLM(engine_dir, device="cpu")
    params = SamplingParams(max_tokens=24, ignore_eos=True)
    llm.generate_async(PROMPTS[0], params).result()
    with pytest.raises(RuntimeError, match="engine loop"):
        llm.step()
    assert [o.outputs[0].token_ids for o in llm.generate(PROMPTS, params)] == reference
    llm.shutdown()
    assert [o.outputs[0].token_ids for o in llm.generate(PROMPTS, params)] == reference


def test_cancel_frees_blocks_and_others_complete(engine_dir, reference):
    llm = LLM(engine_dir, device="cpu")
    try:
        free_before = llm.engine.pool.num_free
        long = llm.generate_async(PROMPTS[1], SamplingParams(max_tokens=2_000, ignore_eos=True), streaming=True)
        others = [llm.generate_async(p, SamplingParams(max_tokens=24, ignore_eos=True)) for p in PROMPTS]
        first = next(iter(long))
        assert first.outputs[0].token_ids_diff and not first.finished
        long.abort()
        final = long.result(timeout=60)
        assert final.finished and final.outputs[0].finish_reason == "cancelled"
        assert [h.result(timeout=60).outputs[0].token_ids for h in others] == reference
        assert llm.engine.pool.num_free == free_before
    finally:
        llm.shutdown()


def test_bad_request_raises_and_others_run(engine_dir, reference):
    llm = LLM(engine_dir, device="cpu")
    try:
        good = llm.generate_async(PROMPTS[0], SamplingParams(max_tokens=24, ignore_eos=True))
        with pytest.raises(RequestError, match="max_seq_len"):
            llm.generate_async([1] * 100_000, SamplingParams())
        with pytest.raises(RequestError, match="empty"):
            llm.generate_async([], SamplingParams())
        assert good.result(timeout=60).outputs[0].token_ids == reference[0]
    finally:
        llm.shutdown()


def test_asyncio_consumers_and_threads(engine_dir, reference):
    llm = LLM(engine_dir, device="cpu")
    params = SamplingParams(max_tokens=24, ignore_eos=True)

    async def one(prompt):
        handle = llm.generate_async(prompt, params, streaming=True)
        return [t async for out in handle for t in out.outputs[0].token_ids_diff]

    async def main():
        return await asyncio.gather(*(one(p) for p in PROMPTS))

    thread_results: dict[int, list[int]] = {}

    def worker(i):
        thread_results[i] = llm.generate_async(PROMPTS[i], params).result(timeout=120).outputs[0].token_ids

    try:
        threads = [threading.Thread(target=worker, args=(i,)) for i in range(len(PROMPTS))]
        for t in threads:
            t.start()
        assert asyncio.run(main()) == reference
        for t in threads:
            t.join()
        assert [thread_results[i] for i in range(len(PROMPTS))] == reference
    finally:
        llm.shutdown()
