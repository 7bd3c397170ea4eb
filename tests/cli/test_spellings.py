"""Every nextn command line takes both spellings of each long option and vLLM's names where ours differ, prints its
version, and turns Ctrl-C into one line with exit status 130 (`cli/spellings.py`)."""

from __future__ import annotations

import subprocess
import sys

import pytest

from nextn import __version__
from nextn.cli import main as nextn_main
from nextn.cli.build_engine import _parser as build_engine_parser
from nextn.cli.nextn_bench import build_parser as bench_parser


def test_both_spellings_and_vllm_names_parse_to_the_same_options():
    parse = lambda *a: nextn_main.build_parser(a[0]).parse_args(list(a))  # noqa: E731
    want = parse("serve", "--engine_dir", "e", "--max_seq_len", "512", "--tp_size", "2", "--grammar_timeout", "3")
    for argv in (["serve", "--engine-dir", "e", "--max-seq-len", "512", "--tp-size", "2", "--grammar-timeout", "3"],
                 ["serve", "--engine", "e", "--max-model-len", "512", "--tensor-parallel-size", "2",
                  "--grammar_timeout", "3"]):
        got = parse(*argv)
        assert (got.engine_dir, got.max_seq_len, got.tensor_parallel_size, got.grammar_timeout) == (
            want.engine_dir, want.max_seq_len, want.tensor_parallel_size, want.grammar_timeout), argv
    assert parse("generate", "--model", "m", "--max-tokens", "7", "--prompt", "x").max_tokens == 7
    bench = bench_parser()
    a = bench.parse_args(["--engine_dir", "e", "throughput", "--dataset", "d.jsonl", "--num-requests", "3"])
    b = bench.parse_args(["--engine-dir", "e", "throughput", "--dataset", "d.jsonl", "--num_requests", "3"])
    assert a.num_requests == b.num_requests == 3 and a.engine_dir == b.engine_dir == "e"
    be = build_engine_parser().parse_args(["--model-dir", "m", "--output-dir", "o", "--max-batch-size", "4"])
    assert (str(be.model_dir), str(be.output_dir), be.max_batch_size) == ("m", "o", 4)


def test_help_lists_each_option_once(capsys):
    with pytest.raises(SystemExit):
        nextn_main.build_parser("serve").parse_args(["serve", "--help"])
    out = capsys.readouterr().out
    assert "--max_seq_len" in out and "--max-model-len" not in out and "--max-seq-len" not in out


@pytest.mark.parametrize("argv", [["-m", "nextn.cli.main", "--version"], ["-m", "nextn.cli.build_engine", "--version"],
                                  ["-m", "nextn.cli.nextn_bench", "--version"]])
def test_version(argv):
    out = subprocess.run([sys.executable, *argv], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0 and out.stdout.strip().endswith(__version__), out


def test_ctrl_c_is_one_line_and_exit_130(monkeypatch, capsys):
    def run(args):
        raise KeyboardInterrupt
    monkeypatch.setitem(nextn_main.COMMANDS, "cache", ("", lambda p: p.set_defaults(func=run)))
    assert nextn_main.main(["cache"]) == 130
    err = capsys.readouterr().err
    assert err.strip() == "nextn cache: interrupted" and "Traceback" not in err


def test_ctrl_c_during_build_engine_is_one_line(monkeypatch, tmp_path, capsys):
    from nextn.cli import build_engine

    def interrupted_build(args):
        raise KeyboardInterrupt
    monkeypatch.setattr(build_engine, "_build", interrupted_build)
    with pytest.raises(SystemExit) as e:
        build_engine.main(["--model_dir", str(tmp_path), "--output_dir", str(tmp_path / "engine")])
    assert e.value.code == 130
    err = capsys.readouterr().err.strip()
    assert err == f"build-engine: interrupted; nothing was written to {tmp_path / 'engine'}", err
    assert not (tmp_path / "engine").exists()
