"""A tensor-parallel LLM's whole life in one process (issue 32, class 9): `shutdown()` releases its worker ranks,
process group and rendezvous, and the next tensor-parallel LLM of the same process starts and generates."""

from __future__ import annotations

import os
import time

import pytest
import torch.distributed as dist

from nextn import LLM, SamplingParams
from nextn.distributed import disaggregated
from nextn.distributed.mapping import MappingError

SP = SamplingParams(max_tokens=8, ignore_eos=True)
PROMPTS = [[5, 6, 7, 8], list(range(20, 40))]


def tokens(outputs) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in outputs]


def test_shutdown_releases_the_group_and_a_second_tp_llm_starts(llama_engine, qwen2_engine, monkeypatch):
    refs = {e: tokens(LLM(e, speculative_config=None, device="cpu").generate(PROMPTS, SP))
            for e in (llama_engine, qwen2_engine)}
    first = LLM(llama_engine, speculative_config=None, tensor_parallel_size=2, device="cpu")
    try:
        t0 = time.monotonic()
        with pytest.raises(MappingError, match="shutdown"):  # one group a process: refused before starting any
            LLM(qwen2_engine, speculative_config=None, tensor_parallel_size=2, device="cpu")
        assert time.monotonic() - t0 < 5
        monkeypatch.setattr(disaggregated.subprocess, "Popen", None)  # a started process would fail the test
        with pytest.raises(MappingError, match="DisaggregatedLLM: another tensor-parallel"):
            disaggregated.DisaggregatedLLM(llama_engine)
        monkeypatch.undo()
        assert tokens(first.generate(PROMPTS, SP)) == refs[llama_engine]  # the first one was not disturbed
        workers, rendezvous = first._workers.processes, first._workers.rendezvous_dir
    finally:
        first.shutdown()
    assert all(p.poll() is not None for p in workers) and not os.path.exists(rendezvous)
    assert not dist.is_initialized()
    after = first.generate(PROMPTS[0], SP).outputs[0]
    assert after.finish_reason == "error" and "shut down" in after.error

    second = LLM(qwen2_engine, speculative_config=None, tensor_parallel_size=2, device="cpu")
    try:
        assert tokens(second.generate(PROMPTS, SP)) == refs[qwen2_engine]
    finally:
        second.shutdown()
    assert not dist.is_initialized()
