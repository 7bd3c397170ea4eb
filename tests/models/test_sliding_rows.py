"""The sliding-window layers' own KV blocks (issue 60): in a model mixing sliding and full layers (a tiny random
Gemma 3, 5 sliding layers of window 16 and 2 full ones, made by `transformers` at test time) the cache rows only
sliding layers read hold a sliding block for each pool block within the window (`runtime/sliding_blocks.py`) —
a request's resident sliding blocks stay bounded by its window however long it runs — and the output is
`transformers` float32's token for token, and each token's top log-probabilities within 1e-4 of `transformers`'
(the tiny model repeats one token: the log-probabilities read every sliding layer's window): plain, NGram, batch 12
staggered, chunked prefill, prefix-cache hits, preemption, nextn's W4A8 kernels. A map that lets one block go too
early (the control) is no longer exact."""

from __future__ import annotations

import pytest
import torch

from nextn import LLM, SamplingParams
from nextn.build.engine_builder import build_engine
from nextn.runtime.sliding_blocks import SlidingBlocks
from nextn.testing.tiny_families import save_tiny

PROMPT = [1] + [100 + (7 * i) % 23 for i in range(39)]  # 40 tokens
NEW = 80
CACHE = {"tokens_per_block": 4, "enable_block_reuse": False}
NGRAM = {"decoding_type": "NGram", "max_draft_len": 3}


def _prompts(n: int) -> list[list[int]]:
    return [[1] + [100 + (5 * i + 3 * r) % (17 + r) for i in range(12 + 7 * r)] for r in range(n)]


@pytest.fixture(scope="module")
def gemma3(tmp_path_factory, tokenizer_dir):
    out = tmp_path_factory.mktemp("gemma3_rows")
    hf = save_tiny("gemma3_text", out / "hf", tokenizer_dir)
    types = hf.config.layer_types
    assert hf.config.sliding_window == 16 and "full_attention" in types and "sliding_attention" in types
    build_engine(out / "hf", out / "engine", dtype="float32", quant_algo=None, max_seq_len=256, progress=False)

    def want(prompt):
        """transformers' greedy tokens and, per token, its top-5 (token, log-probability)."""
        with torch.no_grad():
            ids = hf.generate(torch.tensor([prompt]), max_new_tokens=NEW, do_sample=False, pad_token_id=0,
                              eos_token_id=None)
            logp = torch.log_softmax(hf(ids).logits[0, len(prompt) - 1:-1].float(), -1).topk(5)
        return ids[0, len(prompt):].tolist(), [list(zip(i.tolist(), v.tolist())) for v, i in zip(*logp)]

    return out / "engine", want


def _close(got, want) -> bool:
    """Same tokens, and the same top-5 log-probabilities within 1e-4 at every position."""
    tokens, top = got
    return tokens == want[0] and all(
        [t for t, _ in a[:5]] == [t for t, _ in b] and max(abs(x - y) for (_, x), (_, y) in zip(a, b)) < 1e-4
        for a, b in zip(top, want[1]))


def _outputs(outs) -> list[tuple[list[int], list]]:
    return [(o.outputs[0].token_ids, [lp.top for lp in o.outputs[0].logprobs]) for o in outs]


PARAMS = SamplingParams(max_tokens=NEW, ignore_eos=True, logprobs=5)


def _bounded(llm) -> bool:
    """The sliding layers' cache rows were written in their sliding blocks' slots only (the rest of each row never
    touched: never resident in the memory map)."""
    kv, sliding = llm.engine.runner.kv_cache, llm.engine.pool.sliding
    past = sliding.num_blocks * llm.engine.block_size
    rows = list(sliding.rows)
    return bool(kv[rows, :past].any()) and not kv[rows, past:].any() and past < kv.shape[1]


def _generate(engine, prompts, spec=None, cache=CACHE, **llm_args):
    llm = LLM(engine, device="cpu", speculative_config=spec, kv_cache_config=cache, **llm_args)
    sliding = llm.engine.pool.sliding
    assert sliding is not None and sliding.rows and sliding.num_blocks <= llm.engine.pool.num_blocks
    outs = llm.generate(prompts, PARAMS)
    bounded = _bounded(llm) if sliding.num_blocks < llm.engine.pool.num_blocks else None
    llm.shutdown()
    assert bounded is not False
    return _outputs(outs), sliding


@pytest.mark.parametrize("spec", [None, NGRAM], ids=["plain", "ngram"])
def test_one_request_holds_only_its_window(gemma3, spec):
    """120 positions = 30 pool blocks; the sliding rows never hold more than the window's blocks plus a step's (a
    prefill chunk of 8 tokens and the one still in flight, or a decode step's look-ahead: K + 1 in flight and
    2K + 1)."""
    engine, want = gemma3
    (out,), sliding = _generate(engine, [PROMPT], spec, max_num_tokens=8, enable_chunked_prefill=True)
    assert _close(out, want(PROMPT))
    step = max(2 * 8, 4 + 7 if spec else 2)
    assert 16 // 4 <= sliding.peak_in_use <= -(-(16 - 1 + step) // 4) + 1 < (len(PROMPT) + NEW) // 4
    assert sliding.num_in_use == 0  # all back when it finished


@pytest.mark.parametrize("spec", [None, NGRAM], ids=["plain", "ngram"])
def test_batch_12_staggered_and_chunked_is_transformers(gemma3, spec):
    engine, want = gemma3
    prompts = _prompts(12)
    outs, sliding = _generate(engine, prompts, spec, max_batch_size=5, max_num_tokens=24,
                              enable_chunked_prefill=True)
    assert all(_close(o, want(p)) for o, p in zip(outs, prompts))
    assert sliding.num_in_use == 0


def test_prefix_cache_hits_read_the_kept_window(gemma3):
    """A second request over the same prompt reuses its blocks — the sliding rows' window before its first computed
    token kept as idle blocks — and decodes as the first did; with the idle blocks forgotten the hit is cut."""
    engine, want = gemma3
    llm = LLM(engine, device="cpu", speculative_config=None, kv_cache_config={**CACHE, "enable_block_reuse": True})
    first = llm.generate(PROMPT, PARAMS)
    second = llm.generate(PROMPT, PARAMS)
    llm.engine.pool.sliding.forget_idle()
    third = llm.generate(PROMPT, PARAMS)
    llm.shutdown()
    assert all(_close(o, want(PROMPT)) for o in _outputs([first, second, third]))
    assert second.num_cached_tokens >= 32 and third.num_cached_tokens < second.num_cached_tokens


def test_preemption_keeps_the_output(gemma3):
    """A pool too small for all of them at once: requests are preempted and re-prefilled, sliding blocks with
    them."""
    engine, want = gemma3
    prompts = _prompts(6)
    llm = LLM(engine, device="cpu", speculative_config=None, max_batch_size=6,
              kv_cache_config={**CACHE, "max_tokens": 240})
    outs = _outputs(llm.generate(prompts, PARAMS))
    preempted = llm.engine.scheduler.num_preemptions
    llm.shutdown()
    assert preempted > 0 and all(_close(o, want(p)) for o, p in zip(outs, prompts))


def test_a_block_released_too_early_is_not_exact(gemma3, monkeypatch):
    """The control: the map lets each block go one block before the window has passed it."""
    engine, want = gemma3
    seen = SlidingBlocks.first_block_seen
    monkeypatch.setattr(SlidingBlocks, "first_block_seen", lambda self, position: seen(self, position) + 1)
    (out,), _ = _generate(engine, [PROMPT])
    assert not _close(out, want(PROMPT))


def test_nextns_kernels_read_through_the_map(gemma3, tmp_path, monkeypatch):
    """A W4A8 engine (nextn's int4 kernels, its paged attention, the fused layer op): with the sliding rows' own
    blocks it decodes what it decodes with the pool's, plain and with NGram drafts, batched."""
    from nextn.plugins import woq_linear
    from nextn.runtime import engine_loader

    if not woq_linear.available():
        pytest.skip(f"nextn's int4 CPU kernels are unavailable here: {woq_linear.unavailable_reason()}")
    engine, _ = gemma3
    build_engine(engine.parent / "hf", tmp_path / "w4a8", quant_algo="W4A8", dtype="bfloat16", max_seq_len=256,
                 progress=False)  # bf16: every layer in one op call (`llama_decoder_stack`)
    prompts = [PROMPT] + _prompts(3)
    outs = {}
    for own in (True, False):
        if not own:
            monkeypatch.setattr(engine_loader, "sliding_plan", lambda *args: None)
        for spec in (None, NGRAM):
            llm = LLM(tmp_path / "w4a8", device="cpu", speculative_config=spec, kv_cache_config=CACHE,
                      max_batch_size=4, max_num_tokens=32, enable_chunked_prefill=True)
            assert (llm.engine.pool.sliding is not None) == own and llm.engine.model.fused_stack is not None
            outs[own, str(spec)] = _outputs(llm.generate(prompts, PARAMS))
            assert not own or _bounded(llm)  # the fused layers' op writes the sliding rows through the map too
            llm.shutdown()
    assert outs[True, "None"] == outs[False, "None"] == outs[True, str(NGRAM)] == outs[False, str(NGRAM)]


def test_the_pool_side():
    """Pins, idle blocks kept for prefix hits (evicted oldest first), forgotten blocks, cut hits."""
    cached = {3, 4}
    s = SlidingBlocks(num_blocks=4, num_pool_blocks=10, window=8, block_size=4, is_cached=lambda b: b in cached)
    a, b = [1, 2, 3, 4], [5, 6, 7, 8]
    assert s.ensure(a, 0, 16) is False  # four blocks for three sliding ones: no change
    assert s.num_in_use == 0 and s.ensure(a, 0, 12) and s.block_map[[1, 2, 3]].tolist() == [1, 2, 3]
    assert s.release(a, 12) == 1 and s.block_map[1] == 0  # position 12 sees 5..12: block 0 goes (not cached)
    assert s.ensure(a, 12, 16) and s.num_in_use == 3
    assert s.release(a, 20) == 2 and s.block_map[2] == 0 and s.block_map[3] != 0  # block 3 is cached: idle, kept
    assert s.hit_len([2, 3, 4]) == 3  # position 12 sees blocks 1..2 of the hit: both still have theirs
    assert s.hit_len([1, 2, 3]) == 0  # blocks 1 and 2 lost theirs: every cut of it misses a block of its window
    assert s.ensure(b, 0, 8) and s.block_map[3] == 0  # one free block, then the idle one is evicted
    s.drop(a)
    assert s.block_map[4] != 0 and s.num_in_use == 3  # block 4 is cached: idle
    s.forget(4)
    assert s.block_map[4] == 0 and s.num_in_use == 2
    with pytest.raises(ValueError, match="holds 4 blocks"):
        s.ensure(b, 0, 20)
