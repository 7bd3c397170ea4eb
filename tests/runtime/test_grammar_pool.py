"""Guided-decoding grammars convert and compile in worker processes under a budget (`runtime/grammar_pool.py`): a
slow schema is stopped at its time budget by name and its worker replaced; compiled grammars are bounded in bytes;
busy workers refuse by name rather than queue without end; a grammar that matches no output is refused by name."""

from __future__ import annotations

import threading
import time

import pytest

from nextn.runtime.grammar_pool import GrammarBusyError, GrammarLimitError, GrammarLimits, GrammarWorkers
from nextn.runtime.sampling_params import GuidedDecodingParams, SamplingParamsError

BUDGET_S = 1.5
# xgrammar expands the repetition: 5 s to convert on a quiet 2-core Zen 4, over a minute for {3000,20000}
SLOW = {"type": "object", "properties": {"code": {"type": "string", "pattern": "[a-z]{2000,10000}"}},
        "required": ["code"]}
# a loaded CI machine starts a replacement worker (torch's imports) in a few seconds
SLACK_S = 10.0
# what the steps around the budgeted one get: a worker's first grammar over the 129k-token vocabulary (its tokenizer
# info) took over BUDGET_S on a loaded 2-core AVX2 machine
WARM_S = 60.0


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    """The DeepSeek-V3 tokenizer (the tiny checkpoints' own, 129,280-row vocabulary)."""
    from transformers import AutoTokenizer

    from nextn.train.tiny_checkpoint import TinyDeepseekSpec, write_tokenizer

    d = tmp_path_factory.mktemp("tok")
    write_tokenizer(d, TinyDeepseekSpec())
    return AutoTokenizer.from_pretrained(str(d))


@pytest.fixture(scope="module")
def workers():
    pool = GrammarWorkers(num_workers=1, max_waiting=1)
    yield pool
    pool.close()


def _compiler(tokenizer, workers, **limits):
    from nextn.runtime.guided_decoding import GrammarCompiler

    return GrammarCompiler(tokenizer, 129280, [1], GrammarLimits(**limits), workers)


def _schema(i: int) -> GuidedDecodingParams:
    return GuidedDecodingParams(json={"type": "object", "properties": {f"field_{i}": {"type": "integer"},
                                                                       "name": {"type": "string", "maxLength": 40}},
                                      "required": [f"field_{i}", "name"]})


def _worker_pids(workers: GrammarWorkers) -> set[int]:
    return {w.proc.pid for w in workers._idle} | {w.proc.pid for w in workers._busy}


def _rss_mib(pid: int) -> float:
    with open(f"/proc/{pid}/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmRSS")) / 1024


def test_a_slow_schema_is_stopped_at_its_budget_and_its_worker_replaced(tokenizer, workers):
    compiler = _compiler(tokenizer, workers, timeout_s=BUDGET_S)
    warm = _compiler(tokenizer, workers, timeout_s=WARM_S)
    warm.compile(_schema(0))  # the worker is up, with the tokenizer's info
    before = _worker_pids(workers)
    t0 = time.monotonic()
    with pytest.raises(GrammarLimitError, match=r"did not compile within its budget.*--grammar_timeout"):
        compiler.compile(GuidedDecodingParams(json=SLOW))
    assert time.monotonic() - t0 < BUDGET_S + SLACK_S
    assert not before & _worker_pids(workers)  # the slow one was killed, a fresh one started
    assert warm.compile(_schema(1)) is not None  # and the next grammar compiles
    with pytest.raises(GrammarLimitError, match="did not convert within its budget"):  # tool calls' conversion too
        compiler.tool_call_ebnf({"type": "object", "properties": {"args": SLOW}}, "<tool_call>\n", "\n</tool_call>")


@pytest.mark.parametrize("params", [
    GuidedDecodingParams(grammar='root ::= root "a"'),
    GuidedDecodingParams(json={"$ref": "#/$defs/loop", "$defs": {"loop": {"$ref": "#/$defs/loop"}}}),
], ids=["left-recursive-ebnf", "recursive-ref-schema"])
def test_a_grammar_that_matches_no_output_is_refused_by_name(tokenizer, workers, params):
    compiler = _compiler(tokenizer, workers)
    with pytest.raises(SamplingParamsError, match="matches no output"):
        compiler.compile(params)


def test_a_recursive_grammar_that_can_end_compiles(tokenizer, workers):
    """The control: recursion that reaches a terminal first is a fine grammar."""
    compiler = _compiler(tokenizer, workers)
    assert compiler.compile(GuidedDecodingParams(grammar='root ::= "a" root | "a"')) is not None


def test_compiled_grammars_are_bounded_in_bytes_and_the_worker_keeps_none(tokenizer, workers):
    """A 2-property schema over a 129k-token vocabulary compiles to ~2.4 MiB (xgrammar's measure): a cache
    keeps the last few (an 8 MiB one here); the worker, which keeps nothing, stays flat however many schemas pass through it."""
    limit = 8 << 20
    compiler = _compiler(tokenizer, workers, cache_bytes=limit)
    compiler.compile(_schema(0))
    one = compiler.cache_bytes
    assert 1 << 20 < one <= limit
    [pid] = _worker_pids(workers)
    for i in range(1, 4):
        compiler.compile(_schema(i))
    rss = _rss_mib(pid)
    kept = []
    for i in range(4, 16):
        compiler.compile(_schema(i))
        kept.append(len(compiler._cache))
        assert compiler.cache_bytes <= limit
    assert max(kept) <= limit // one + 1 < 12  # evicted by bytes, least recently used first
    assert _worker_pids(workers) == {pid}
    assert _rss_mib(pid) - rss < 48, "the grammar worker's memory grew with the number of schemas"
    with pytest.raises(GrammarLimitError, match=r"takes 2\.\d MiB; at most 1 MiB.*--grammar_cache_mb"):
        _compiler(tokenizer, workers, cache_bytes=1 << 20).compile(_schema(99))


def test_busy_workers_refuse_by_name_instead_of_queueing_without_end(tokenizer):
    pool = GrammarWorkers(num_workers=1, max_waiting=0)
    try:
        compiler = _compiler(tokenizer, pool, timeout_s=BUDGET_S)
        warm = _compiler(tokenizer, pool, timeout_s=WARM_S)
        warm.compile(_schema(0))  # the worker is up, with the tokenizer's info
        slow = threading.Thread(target=lambda: pytest.raises(GrammarLimitError, compiler.compile,
                                                              GuidedDecodingParams(json=SLOW)))
        slow.start()
        while not pool._busy:
            time.sleep(0.01)
        t0 = time.monotonic()
        with pytest.raises(GrammarBusyError, match="retry shortly"):
            compiler.compile(_schema(1))
        assert time.monotonic() - t0 < 0.5  # refused at once, not after the slow one
        slow.join()
        assert warm.compile(_schema(1)) is not None
    finally:
        pool.close()


def test_limits_are_checked():
    for bad in ({"timeout_s": 0}, {"timeout_s": float("inf")}, {"timeout_s": True}, {"cache_bytes": 1024},
                {"cache_bytes": 2.0 * 2**20}):
        with pytest.raises(ValueError):
            GrammarLimits(**bad)


def test_more_tokenizers_than_a_worker_keeps_are_sent_again(tokenizer, workers, monkeypatch):
    """A worker keeps the last 4 tokenizers; a compile for one it dropped sends it again instead of failing."""
    from nextn.runtime import grammar_worker

    compilers = [_compiler(tokenizer, workers) for _ in range(grammar_worker.MAX_TOKENIZERS + 2)]
    for i, c in enumerate(compilers):  # same tokenizer, distinct keys: each is a new tokenizer to the worker
        c._info_key = f"tokenizer-{i}"
    for round_ in range(2):
        for i, c in enumerate(compilers):
            assert c.compile(_schema(100 + 10 * round_ + i)) is not None
