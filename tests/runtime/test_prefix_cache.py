"""Prefix caching (KV block reuse) with every drafter: greedy outputs, acceptance and drafter KV are exactly those
without reuse — for turn-2 prompts that extend turn 1, prompts sharing part of a block or diverging right at a
block boundary, chunked prefill, the overlap scheduler on or off, speculation switched off and on by the
draft-length policy, a cache too small for all requests (eviction, preemption), aborts and sampling — and a block
in the prefix cache is never written while it holds its key (so a block shared by running requests never is)."""

from __future__ import annotations

import pytest
import torch

from nextn import LLM, SamplingParams
from nextn.build.engine_builder import build_engine
from nextn.runtime.outputs import RequestOutput
from nextn.testing.tiny_llama import tiny_hf_llama

BLOCK = 8
GREEDY = SamplingParams(max_tokens=14, ignore_eos=True)
MTP = lambda k, vanilla=False: {"decoding_type": "MTP", "num_nextn_predict_layers": k, "use_mtp_vanilla": vanilla}  # noqa: E731
NGRAM = {"decoding_type": "NGram", "max_draft_len": 3, "max_matching_ngram_size": 3}
SYSTEM = [(5 * j) % 200 + 3 for j in range(21)]  # a shared "system prompt": 2 full blocks and 5 tokens
TURN1 = [SYSTEM + [210, 211, 5, 6], SYSTEM + [220, 7, 221], SYSTEM[:12] + [230, 231, 232]]  # last: 1.5 blocks shared


# Engines ----------------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    """(target, draft) tiny Llama engines: the draft is the target's first layer (it agrees often, not always)."""
    tmp = tmp_path_factory.mktemp("prefix_llama")
    target = tiny_hf_llama(num_layers=3)
    target.save_pretrained(tmp / "target_ckpt")
    draft = tiny_hf_llama(num_layers=1, seed=1)
    draft.load_state_dict({k: v for k, v in target.state_dict().items()
                           if not k.startswith(("model.layers.1.", "model.layers.2."))})
    draft.save_pretrained(tmp / "draft_ckpt")
    for name in ("target", "draft"):
        build_engine(tmp / f"{name}_ckpt", tmp / name, progress=False, max_seq_len=200)
    return tmp / "target", tmp / "draft"


@pytest.fixture(scope="module")
def vanilla3(checkpoints):
    """The distilled 3-module DeepSeek engine of test_lossless.py (one build per session)."""
    return checkpoints.engine(distill_steps=150, num_mtp_modules=3)


def _draft_target(llama, **extra) -> dict:
    return {"decoding_type": "Draft_Target", "max_draft_len": 3, "speculative_model_dir": str(llama[1]), **extra}


# name → (engine fixture, speculative_config, extra LLM arguments)
DRAFTERS = {
    "none": ("eagle", None, {}),
    "mtp_eagle": ("eagle", MTP(3), {}),
    "mtp_eagle_chunked_sync": ("eagle", MTP(2), {"enable_chunked_prefill": True, "max_num_tokens": 7,
                                                 "disable_overlap_scheduler": True}),
    "mtp_vanilla_chunked": ("vanilla3", MTP(3), {"enable_chunked_prefill": True, "max_num_tokens": 9}),
    "medusa": ("medusa_engine", {"decoding_type": "Medusa", "medusa_choices": [[0], [1], [0, 0], [1, 0], [0, 0, 0]]},
               {}),
    "draft_target": ("llama", "draft_target", {}),
    "draft_target_policy_off_on": ("llama", "draft_target_policy", {}),
    "ngram": ("llama", NGRAM, {}),
}


def make_llm(request, name: str, reuse: bool, **kw) -> LLM:
    """The engine of DRAFTERS[name] with blocks of 8 tokens and reuse on or off (`kv`: more kv_cache_config)."""
    kw = dict(kw)
    fixture, spec, extra = DRAFTERS[name]
    engine = request.getfixturevalue(fixture)
    if fixture == "llama":
        if spec == "draft_target":
            spec = _draft_target(engine)
        elif spec == "draft_target_policy":  # ≥ 2 running: speculation off (steps without the draft model)
            spec = _draft_target(engine, max_concurrency=1)
        engine = engine[0]
    kv = {"tokens_per_block": BLOCK, "enable_block_reuse": reuse, **kw.pop("kv", {})}
    return LLM(engine, speculative_config=spec, max_seq_len=160, kv_cache_config=kv, **{**extra, **kw})


# Checks -----------------------------------------------------------------------------------------------------
class FrozenCachedBlocks:
    """After every step: a block holding a prefix-cache key still holds the content it had when it was registered
    (every KV row: target, MTP layers, and the draft model's own KV tensor). Also records the most requests that
    held one block at once."""

    def __init__(self, llm: LLM) -> None:
        self.engine = llm.engine
        self.snapshots: dict[int, tuple[bytes, list[torch.Tensor]]] = {}
        self.max_refs = 0
        self.checks = 0

    def _rows(self, block: int) -> list[torch.Tensor]:
        sl = slice(block * BLOCK, (block + 1) * BLOCK)
        tensors = [self.engine.runner.kv_cache]
        draft_kv = getattr(self.engine.drafter, "kv_cache", None)  # Draft_Target: its own tensor, same block ids
        if draft_kv is not None and not self.engine.pool.cache.lacks_drafter_kv(block):
            tensors.append(draft_kv)  # (a block registered without the draft model's KV: its hits catch it up)
        return [t[:, sl].clone() for t in tensors]

    def check(self) -> None:
        cache = self.engine.pool.cache
        cached = cache.cached_blocks
        for block, key in cached.items():
            self.max_refs = max(self.max_refs, self.engine.pool.num_refs(block))
            snap = self.snapshots.get(block)
            if snap is None or snap[0] != key:  # newly registered (or the block was evicted and re-registered)
                self.snapshots[block] = (key, self._rows(block))
                continue
            for before, now in zip(snap[1], self._rows(block)):
                assert torch.equal(before, now), f"cached block {block} was written"
            self.checks += 1
        for block in set(self.snapshots) - set(cached):
            del self.snapshots[block]


def staggered(llm: LLM, prompts, params, every: int = 2, checker: FrozenCachedBlocks | None = None
              ) -> list[RequestOutput]:
    """One request joins every `every` steps (so a later one can hit what an earlier one computed)."""
    params = params if isinstance(params, list) else [params] * len(prompts)
    pending, ids, outs, n = list(zip(prompts, params)), [], {}, 0
    while pending or llm.has_unfinished_requests:
        if pending and n % every == 0:
            ids.append(llm.add_request(*pending.pop(0)))
        outs.update({o.request_id: o for o in llm.step()})
        if checker is not None:
            checker.check()
        n += 1
    return [outs[i] for i in ids]


def conversation(llm: LLM, checker: FrozenCachedBlocks | None = None) -> list[RequestOutput]:
    """Turn 1 (a shared system prompt, one prompt sharing 1.5 blocks of it), then turn 2: each first turn plus
    its answer plus a new user message, and one prompt that follows a first turn exactly to a block boundary and
    then diverges (the look-ahead token of an MTP block key differs)."""
    first = staggered(llm, TURN1, GREEDY, checker=checker)
    turns = [p + o.outputs[0].token_ids for p, o in zip(TURN1, first)]
    second = [turns[0] + [240, 241, 9], turns[1] + [250], turns[0][:3 * BLOCK] + [251, 252, 253, 254, 255]]
    return first + staggered(llm, second, GREEDY, checker=checker)


def _key(out: RequestOutput) -> tuple:
    c = out.outputs[0]
    return c.token_ids, c.num_decode_steps, c.num_draft_tokens, c.num_accepted_draft_tokens


# Tests ------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("name", list(DRAFTERS))
def test_greedy_outputs_and_acceptance_equal_without_reuse(request, name):
    ref = conversation(make_llm(request, name, reuse=False))
    llm = make_llm(request, name, reuse=True)
    llm.engine.iteration_log = []
    checker = FrozenCachedBlocks(llm)
    outs = conversation(llm, checker)
    if name == "draft_target_policy_off_on":  # a hit on blocks prefilled while speculation was off: the draft
        # model catches them up in the request's first decode step, so it drafts a step later than without reuse
        assert [o.outputs[0].token_ids for o in outs] == [o.outputs[0].token_ids for o in ref]
    else:
        assert [_key(o) for o in outs] == [_key(o) for o in ref]  # tokens, steps, drafts, accepted drafts: AL equal
    assert all(o.num_cached_tokens == 0 for o in ref)
    cached = [o.num_cached_tokens for o in outs]
    assert cached[0] == 0 and all(c > 0 and c % BLOCK == 0 for c in cached[1:]), cached
    if not DRAFTERS[name][2] and "policy" not in name:  # whole prefills, speculation always on: exact counts
        # the system prompt's 2 full blocks; 1 of the 1.5 shared blocks; the turns up to their last full block
        # (turn 1 + answer = 39 and 38 tokens: 4 blocks); 3 blocks to the boundary, 2 when the MTP key looks ahead
        assert cached == [0, 2 * BLOCK, BLOCK, 4 * BLOCK, 4 * BLOCK,
                          (2 if name.startswith("mtp") else 3) * BLOCK], cached
    if name.startswith(("mtp", "draft_target")) and name != "draft_target_policy_off_on":
        assert sum(o.outputs[0].num_accepted_draft_tokens for o in outs) > 0  # the AL comparison has power
    assert checker.checks > 0 and checker.max_refs >= 2  # blocks were shared by running requests, never written
    stats = llm.engine.pool.cache.stats
    assert stats.hits == sum(cached) and stats.queries == sum(len(o.prompt_token_ids) for o in outs)
    log = llm.engine.iteration_log
    assert sum(e.get("num_reused_tokens", 0) for e in log) == stats.hits
    assert log[-1]["prefix_cache_hit_rate"] == round(stats.hit_rate, 4) > 0
    assert llm.engine.pool.num_free == llm.engine.pool.num_blocks - 1  # unreferenced cached blocks count free


def _prefill_rows(llm: LLM, prompt: list[int]) -> tuple[int, list[torch.Tensor]]:
    """Prefill `prompt` alone (sync), and return (tokens reused, its KV rows at positions 0..n−1 of every cache
    tensor: target + MTP layers, and the draft model's own)."""
    eng = llm.engine
    req = eng.make_request(prompt, SamplingParams(max_tokens=3, ignore_eos=True))
    eng.add_request(req)
    while not req.progress.prefill_done:
        eng.step()
    slots = torch.tensor([req.block_table[p // BLOCK] * BLOCK + p % BLOCK for p in range(len(prompt))])
    tensors = [eng.runner.kv_cache] + ([eng.drafter.kv_cache] if getattr(eng.drafter, "kv_cache", None) is not None
                                       else [])
    rows = [t[:, slots].clone() for t in tensors]
    while eng.has_work:
        eng.step()
    return req.num_cached_tokens, rows


@pytest.mark.parametrize("name", ["mtp_eagle", "mtp_vanilla_chunked", "draft_target", "none"])
def test_kv_after_a_hit_equals_a_fresh_prefill(request, name):
    """The KV rows of a turn-2 prompt — target, MTP modules, draft model — are the same whether its prefix was
    reused (computed by turn 1's prefill and decode steps) or computed by one prefill: the drafter's KV in a
    reused block is right. The second prompt follows turn 1 exactly to a block boundary, then diverges: an MTP
    block whose last row saw another next token is not reused."""
    results = {}
    for reuse in (True, False):
        llm = make_llm(request, name, reuse=reuse, disable_overlap_scheduler=True)
        seq = TURN1[0] + llm.generate(TURN1[0], GREEDY).outputs[0].token_ids
        results[reuse] = [_prefill_rows(llm, p) for p in (seq + [240, 241, 9], seq[:3 * BLOCK] + [251, 252, 253])]
    lookahead = {"mtp_eagle": 1, "mtp_vanilla_chunked": 3}.get(name, 0)
    (hit1, rows1), (hit2, rows2) = results[True]
    assert hit1 == 4 * BLOCK and hit2 == (2 if lookahead else 3) * BLOCK
    for (hit, rows), (miss, fresh) in zip(results[True], results[False]):
        assert miss == 0
        for with_reuse, without in zip(rows, fresh):
            torch.testing.assert_close(with_reuse, without, atol=2e-5, rtol=1e-4)


def _run_alone(llm: LLM, prompt: list[int]) -> tuple[RequestOutput, list[torch.Tensor]]:
    """Run `prompt` alone to the end (sync steps); also the draft model's KV rows of its prompt positions, read
    after its first decode step (where a catch-up writes them)."""
    eng = llm.engine
    req = eng.make_request(prompt, GREEDY)
    eng.add_request(req)
    rows = None
    while eng.has_work:
        eng.step()
        if rows is None and len(req.output_token_ids) >= 2:
            slots = torch.tensor([req.block_table[p // BLOCK] * BLOCK + p % BLOCK for p in range(len(prompt))])
            rows = eng.drafter.kv_cache[:, slots].clone()
    return req.to_output(), rows


@pytest.mark.parametrize("overlap", [True, False], ids=["overlap", "sync"])
def test_a_draft_model_off_under_load_still_shares_its_prefix_and_catches_it_up(request, overlap):
    """Draft_Target with speculation off while two requests run (`max_concurrency` 1): their prefill skips the
    draft model, yet their blocks are registered for the target's KV (marked as lacking the draft model's). A later
    lone request extending one of them reuses that prefix, its draft model catches the reused positions up before
    it drafts, and it decodes exactly as without reuse, with drafts accepted and the draft KV of a fresh prefill.
    The caught-up blocks then hold the draft model's KV: a third request on the same prefix reuses them without
    catching up again (a system prompt first seen under load is not re-prefilled by the draft model at every hit)."""
    results, catch_ups = {}, {}
    for reuse in (True, False):
        llm = make_llm(request, "draft_target_policy_off_on", reuse=reuse, disable_overlap_scheduler=not overlap)
        checker = FrozenCachedBlocks(llm) if reuse else None
        first = llm.generate(TURN1[:2], GREEDY)
        assert all(o.outputs[0].num_draft_tokens == 0 for o in first)  # two running: no drafts, no draft prefill
        if reuse:
            cache = llm.engine.pool.cache
            assert cache.cached_blocks and all(cache.lacks_drafter_kv(b) for b in cache.cached_blocks)
            checker.check()
        drafter = llm.engine.drafter
        calls = catch_ups[reuse] = []
        catch_up = drafter.catch_up
        drafter.catch_up = lambda kv, meta, ids: calls.append(ids.shape[1]) or catch_up(kv, meta, ids)
        prompt = TURN1[0] + first[0].outputs[0].token_ids
        results[reuse] = [_run_alone(llm, prompt + suffix) for suffix in ([240, 241, 9], [250, 7])]
        if reuse:
            checker.check()
            lacking = [b for b in cache.cached_blocks if cache.lacks_drafter_kv(b)]
            assert 0 < len(lacking) <= len(cache.cached_blocks) - 4  # the other request's blocks still lack it
    (hit, rows_hit), (again, rows_again) = results[True]
    for (out, rows), (fresh, rows_fresh) in zip(results[True], results[False]):
        assert fresh.num_cached_tokens == 0 and out.num_cached_tokens >= 4 * BLOCK
        assert out.outputs[0].token_ids == fresh.outputs[0].token_ids
        assert out.outputs[0].num_accepted_draft_tokens > 0  # it speculated (after catching up)
        torch.testing.assert_close(rows, rows_fresh, atol=2e-5, rtol=1e-4)
    # the first hit caught the reused blocks up (one pass, at least them); the second reused them as they were
    assert not catch_ups[False] and len(catch_ups[True]) == 1 and catch_ups[True][0] >= 4 * BLOCK


@pytest.mark.parametrize("overlap", [True, False], ids=["overlap", "sync"])
def test_a_cache_too_small_evicts_preempts_and_stays_exact(request, overlap):
    """A KV cache of 12 blocks for 6 staggered requests of up to 5 blocks each: cached blocks are evicted, requests
    are preempted and, re-admitted, reuse their own cached blocks (the prompts share nothing else); every output
    equals the reuse-off run, no cached block is ever written, and every block is free again at the end."""
    prompts = [[(11 * i + 3 * j) % 400 + 20 for j in range(n)] for i, n in enumerate([19, 30, 9, 26, 17, 33])]
    params = [SamplingParams(max_tokens=m, ignore_eos=True) for m in (14, 9, 16, 12, 10, 8)]
    kw = dict(kv={"max_tokens": 96}, enable_chunked_prefill=True, max_num_tokens=10,
              disable_overlap_scheduler=not overlap)
    ref = staggered(make_llm(request, "mtp_eagle", reuse=False, **kw), prompts, params, every=1)
    llm = make_llm(request, "mtp_eagle", reuse=True, **kw)
    checker = FrozenCachedBlocks(llm)
    outs = staggered(llm, prompts, params, every=1, checker=checker)
    assert [o.outputs[0].token_ids for o in outs] == [o.outputs[0].token_ids for o in ref]
    eng = llm.engine
    stats = eng.pool.cache.stats
    assert eng.scheduler.num_preemptions > 0 and stats.evicted_blocks > 0 and checker.checks > 0
    assert stats.hits > 0 and all(o.num_cached_tokens == 0 for o in outs)  # hits only at re-admissions
    assert stats.queries > sum(len(p) for p in prompts)  # re-admissions count again
    assert eng.pool.num_free == eng.pool.num_blocks - 1


def test_an_aborted_requests_blocks_stay_reusable(request):
    """Cancel a request mid-decode: its final blocks stay cached; a prompt extending what it had computed hits
    them and decodes exactly as without reuse."""
    outs = {}
    for reuse in (True, False):
        llm = make_llm(request, "mtp_eagle", reuse=reuse)
        rid = llm.add_request(TURN1[0], SamplingParams(max_tokens=40, ignore_eos=True))
        for _ in range(4):
            llm.step()
        cancelled = llm.abort_request(rid)
        assert cancelled.outputs[0].finish_reason == "cancelled" and len(cancelled.outputs[0].token_ids) > 1
        assert llm.engine.pool.num_free == llm.engine.pool.num_blocks - 1
        prompt = TURN1[0] + cancelled.outputs[0].token_ids + [7, 8]
        outs[reuse] = llm.generate(prompt, GREEDY)
    assert _key(outs[True]) == _key(outs[False])
    assert outs[True].num_cached_tokens >= 3 * BLOCK


def test_sampled_requests_equal_without_reuse(request):
    """Seeded sampling (counter-based RNG: a token depends on the seed and its position): the same tokens with
    and without reuse."""
    params = [SamplingParams(max_tokens=14, temperature=0.9, top_k=8, seed=s, ignore_eos=True) for s in (1, 2, 3)]
    runs = []
    for reuse in (True, False):
        llm = make_llm(request, "mtp_eagle", reuse=reuse)
        first = staggered(llm, TURN1, params)
        second = staggered(llm, [p + o.outputs[0].token_ids + [9] for p, o in zip(TURN1, first)], params)
        runs.append([_key(o) for o in first + second])
        if reuse:
            assert all(o.num_cached_tokens > 0 for o in second)
    assert runs[0] == runs[1]


def test_block_reuse_is_on_by_default_and_can_be_turned_off(eagle):
    assert LLM(eagle, speculative_config=None, max_seq_len=160).engine.pool.cache is not None
    llm = LLM(eagle, speculative_config=None, max_seq_len=160, kv_cache_config={"enable_block_reuse": False})
    assert llm.engine.pool.cache is None
    outs = llm.generate([SYSTEM, SYSTEM + [7]], GREEDY)
    assert [o.num_cached_tokens for o in outs] == [0, 0]


def test_nextn_bench_reports_the_hit_rate(llama):
    """run_benchmark starts the timed run cold (the warm-up's prompts do not hit) and reports the reused share of
    the prompt tokens; requests one at a time sharing a 2-block system prompt: every one after the first hits."""
    from nextn.bench.dataset import DatasetEntry
    from nextn.bench.report import format_report, report_dict
    from nextn.bench.runner import run_benchmark

    llm = LLM(llama[0], speculative_config=None, kv_cache_config={"tokens_per_block": BLOCK})
    entries = [DatasetEntry(i, 4, input_ids=SYSTEM + [200 + i]) for i in range(4)]
    run = run_benchmark(llm, entries, concurrency=1, warmup=1, progress=False)
    assert run.prefix_cache == (4 * (len(SYSTEM) + 1), 3 * 2 * BLOCK)
    assert f"Prefix Cache Hit Rate (reused / prompt tokens): {48 / 88:.4f}" in format_report(run)
    assert report_dict(run)["request_info"]["prefix_cache"]["hit_rate"] == 48 / 88
    off = LLM(llama[0], speculative_config=None, kv_cache_config={"enable_block_reuse": False})
    assert run_benchmark(off, entries, warmup=0, progress=False).prefix_cache is None
