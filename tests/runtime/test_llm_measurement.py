"""`LLM`'s measurement hooks, which the benchmarks use instead of reaching into the engine: the target's logits over
a prompt (perplexity), compiling the decode step after load, and the fused decoder stack switched off (an A/B)."""

from __future__ import annotations

import pytest
import torch

from nextn import LLM, SamplingParams
from nextn.build.engine_builder import build_engine
from nextn.plugins import cpu_kernels
from nextn.runtime.llm import EngineBusyError
from nextn.runtime.request_validation import RequestError
from nextn.testing.tiny_llama import tiny_hf_llama

PROMPTS = [[5, 6, 7, 8, 5, 6, 7], [9], list(range(20, 50))]
GREEDY = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    """A bf16 W4A16 Llama engine (nextn's fused CPU decoder layers take it where the kernels build)."""
    root = tmp_path_factory.mktemp("llama")
    tiny_hf_llama(vocab_size=320, lm_head_scale=20.0, hidden_size=128, intermediate_size=128).save_pretrained(
        root / "ckpt")
    build_engine(root / "ckpt", root / "engine", progress=False, max_seq_len=128, dtype="bfloat16",
                 quant_algo="W4A16", group_size=32)
    return root / "engine"


@pytest.fixture(scope="module")
def llm(engine):
    llm = LLM(engine, speculative_config=None, device="cpu")
    yield llm
    llm.shutdown()


def test_prompt_logits_score_every_next_token_and_give_the_blocks_back(llm):
    prompt = PROMPTS[2]
    free = llm.num_free_kv_blocks
    logits = llm.prompt_logits(prompt)
    assert logits.shape == (len(prompt), llm.vocab_size) and logits.dtype == torch.float32
    assert llm.num_free_kv_blocks == free
    first = llm.generate(prompt, SamplingParams(max_tokens=1, ignore_eos=True)).outputs[0].token_ids
    assert first == [int(logits[-1].argmax())]  # the prefill's first token
    out = llm.generate(prompt, GREEDY).outputs[0].token_ids
    rescored = llm.prompt_logits(prompt + out)[len(prompt) - 1:-1]  # the target's choice after each prefix
    assert rescored.argmax(-1).tolist() == out


def test_prompt_logits_refuse_bad_ids_and_a_busy_engine(llm):
    for ids in ([], [llm.vocab_size], [-1, 3], [1] * (llm.max_seq_len + 1)):
        with pytest.raises(RequestError, match="prompt_logits"):
            llm.prompt_logits(ids)
    rid = llm.add_request([1, 2, 3], GREEDY)
    with pytest.raises(EngineBusyError, match="unfinished"):
        llm.prompt_logits([1, 2, 3])
    assert llm.abort_request(rid) is not None
    assert llm.prompt_logits([1, 2, 3]).shape[0] == 3


def test_compile_decode_step_wraps_the_step_once(engine):
    llm = LLM(engine, speculative_config=None, device="cpu")
    try:
        eager = llm.engine.runner.decode_fn
        llm.compile_decode_step(use_artifacts=False)
        assert llm.engine.runner.decode_fn.__wrapped__ is eager  # compiled lazily, at the next decode step
        with pytest.raises(RuntimeError, match="compiled already"):
            llm.compile_decode_step()
    finally:
        llm.shutdown()
    compiled = LLM(engine, speculative_config=None, device="cpu", torch_compile_config={})
    try:
        with pytest.raises(RuntimeError, match="compiled already"):
            compiled.compile_decode_step()
    finally:
        compiled.shutdown()


@pytest.mark.skipif(not cpu_kernels.available(),
                    reason=f"nextn's CPU kernels unavailable: {cpu_kernels.unavailable_reason()}")
def test_the_decoder_layers_one_op_call_each_give_the_same_tokens(engine, llm):
    plain = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, GREEDY)]
    other = LLM(engine, speculative_config=None, device="cpu")
    try:
        assert other.engine.model.fused_stack is not None
        other.disable_fused_decoder_stack()
        assert other.engine.model.fused_stack is None
        assert [o.outputs[0].token_ids for o in other.generate(PROMPTS, GREEDY)] == plain
    finally:
        other.shutdown()
