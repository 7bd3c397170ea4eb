"""`nextn-bench throughput / latency`: the report, --report_json, --iteration_log, --plot, --baseline, errors."""

from __future__ import annotations

import dataclasses
import json
import os
import re
import subprocess
import sys

import pytest

from nextn.cli.nextn_bench import main
from nextn.testing import SMALL_VOCAB

SECTIONS = ["= PYTORCH BACKEND", "= MACHINE DETAILS", "= REQUEST DETAILS", "= WORLD + RUNTIME INFORMATION",
            "= PERFORMANCE OVERVIEW", "= DECODING STATISTICS", "= DATASET DETAILS"]
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


@pytest.fixture()
def small_engine(checkpoints):
    return checkpoints.engine(num_mtp_modules=1, **SMALL_VOCAB)


@pytest.fixture()
def dataset(tmp_path):
    path = tmp_path / "d.jsonl"
    rows = [{"task_id": i, "input_ids": [i + 3, 7, 11, 2 * i + 1], "output_tokens": 6 + i} for i in range(4)]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def _in_order(text: str, names: list[str]) -> bool:
    positions = [text.find(n) for n in names]
    return -1 not in positions and positions == sorted(positions)


def test_throughput_report_json_iteration_log_plot_baseline(small_engine, dataset, tmp_path, capsys):
    cfg = tmp_path / "mtp.yaml"
    cfg.write_text("speculative_config: {decoding_type: MTP, num_nextn_predict_layers: 2}\n")
    report, log, plots = tmp_path / "r.json", tmp_path / "it.jsonl", tmp_path / "plots"
    rc = main(["--engine_dir", str(small_engine), "throughput", "--dataset", str(dataset), "--streaming",
               "--config", str(cfg), "--report_json", str(report), "--iteration_log", str(log), "--plot", str(plots),
               "--baseline", "--warmup", "1", "--concurrency", "3", "--no_progress", "--passes", "2",
               "--max_spread", "100"])
    out = capsys.readouterr().out
    assert rc == 0
    assert out.count("= PYTORCH BACKEND") == 2  # the baseline's report, then the speculative run's
    baseline, spec = out[:out.rindex("= PYTORCH BACKEND")], out[out.rindex("= PYTORCH BACKEND"):]
    assert _in_order(baseline, SECTIONS) and "= DECODING STATISTICS (none)" in baseline
    assert _in_order(spec, SECTIONS) and "= DECODING STATISTICS (MTP)" in spec
    assert "[TTFT] P99" in out and "Speculative Decoding: MTP (MtpEagle, K=2)" in out and "[Draft 2]" in out
    assert "Speed-up over no speculation (MTP K=2): " in out and "x (" in out
    assert out.count("Timed Passes (figures above: the fastest):") == 2
    d = json.loads(report.read_text())
    assert d["decoding_stats"]["mode"] == "MTP" and d["dataset"]["num_requests"] == 4
    assert d["request_info"]["avg_output_length"] == pytest.approx(7.5)
    assert d["world_info"]["concurrency"] == 3
    assert json.loads((tmp_path / "r.baseline.json").read_text())["decoding_stats"]["mode"] == "none"
    passes = d["performance"]["passes"]
    assert passes["num_passes"] == 2 and len(passes["output_throughput_tok_s"]) == 2
    assert {"speed_up", "measured_ratio", "reliable", "acceptance_length"} <= set(d["speed_up_over_baseline"])
    rows = [json.loads(line) for line in log.read_text().splitlines()]
    assert {r["max_draft_len"] for r in rows} == {0, 2} and max(r["num_requests"] for r in rows) <= 3
    assert sum(r["num_emitted"] for r in rows if r["max_draft_len"] == 2) == 6 + 7 + 8 + 9  # the reported pass
    for name in ("acceptance_per_position_k2.png", "throughput_vs_k.png"):
        assert (plots / name).read_bytes()[:8] == PNG_MAGIC


def test_draft_len_sweep_and_latency(small_engine, dataset, tmp_path, capsys):
    report, plots = tmp_path / "r.json", tmp_path / "plots"
    assert main(["--engine_dir", str(small_engine), "throughput", "--dataset", str(dataset), "--draft_lens", "1,2",
                 "--num_requests", "2", "--warmup", "0", "--report_json", str(report), "--plot", str(plots),
                 "--no_progress"]) == 0
    out = capsys.readouterr().out
    assert out.count("= DECODING STATISTICS (MTP)") == 2 and "Speed-up" not in out
    assert {p.name for p in plots.iterdir()} == {"acceptance_per_position_k1.png", "acceptance_per_position_k2.png",
                                                "throughput_vs_k.png"}
    assert json.loads((tmp_path / "r.k2.json").read_text())["dataset"]["num_requests"] == 2
    assert main(["latency", "--engine_dir", str(small_engine), "--dataset", str(dataset), "--warmup", "1",
                 "--num_threads", "1", "--no_progress"]) == 0
    out = capsys.readouterr().out
    assert "Benchmark Mode:         latency" in out and "Max Runtime Batch Size: 1" in out and "[TPOT] P50" in out


def test_model_dir_builds_a_temporary_engine(checkpoints, dataset, capsys):
    ckpt = checkpoints.checkpoint(num_mtp_modules=1, **SMALL_VOCAB)
    assert main(["--model_dir", str(ckpt), "throughput", "--dataset", str(dataset), "--warmup", "0",
                 "--num_requests", "1", "--no_progress"]) == 0
    assert "= DATASET DETAILS" in capsys.readouterr().out


@pytest.mark.parametrize("content, message", [
    (None, "does not exist"),
    ('{"input_ids": [1], "output_tokens": 3}\n{oops\n', "d.jsonl:2: not valid JSON"),
    ('{"input_ids": [1], "output_tokens": 3, "max_tokens": 4}\n', "unknown field(s) ['max_tokens']"),
    ('{"prompt": "hello", "output_tokens": 3}\n', "no tokenizer"),
])
def test_clear_errors(small_engine, tmp_path, capsys, content, message):
    path = tmp_path / "d.jsonl"
    if content is not None:
        path.write_text(content)
    rc = main(["--engine_dir", str(small_engine), "throughput", "--dataset", str(path), "--no_progress"])
    err = capsys.readouterr().err
    assert rc == 2 and err.startswith("nextn-bench: error: ") and message in err


def test_usage_errors(small_engine, dataset, tmp_path, capsys):
    assert main(["throughput", "--dataset", str(dataset)]) == 2
    assert "exactly one of --engine_dir" in capsys.readouterr().err
    assert main(["--engine_dir", str(tmp_path), "throughput", "--dataset", str(dataset)]) == 2
    assert "not an nextn engine directory" in capsys.readouterr().err
    assert main(["--engine_dir", str(small_engine), "throughput"]) == 2  # argparse: --dataset is required
    assert "nextn-bench: error:" in capsys.readouterr().err
    cfg = tmp_path / "bad.yaml"
    cfg.write_text("max_batch_sise: 4\n")
    assert main(["--engine_dir", str(small_engine), "throughput", "--dataset", str(dataset), "--config", str(cfg)]) == 2
    assert "max_batch_sise" in capsys.readouterr().err


def test_python_dash_m_entry_point(small_engine):
    cmd = [sys.executable, "-m", "nextn.cli.nextn_bench", "--engine_dir", str(small_engine), "prepare-dataset",
           "token-norm-dist", "--num-requests", "3", "--input-mean", "4", "--output-mean", "2"]
    env = dict(os.environ, OMP_NUM_THREADS="1")
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=120, env=env)
    assert done.returncode == 0, done.stderr
    rows = [json.loads(line) for line in done.stdout.splitlines()]
    assert [len(r["input_ids"]) for r in rows] == [4, 4, 4] and all(r["output_tokens"] == 2 for r in rows)


def test_outputs_never_overwrite_a_users_file(small_engine, dataset, tmp_path, capsys):
    # issue 32: --report_json / --iteration_log / --output replaced any file; a directory was a traceback
    mine = tmp_path / "config.json"
    mine.write_text('{"mine": true}')
    base = ["--engine_dir", str(small_engine), "throughput", "--dataset", str(dataset), "--no_progress"]
    for flag, path in (("--report_json", mine), ("--iteration_log", mine), ("--report_json", tmp_path)):
        assert main([*base, flag, str(path)]) == 2
        err = capsys.readouterr().err
        assert ("not written by this command" in err or "is a directory" in err) and "Traceback" not in err
    assert main(["--engine_dir", str(small_engine), "prepare-dataset", "--output", str(mine), "token-norm-dist",
                 "--num-requests", "2", "--input-mean", "4", "--output-mean", "2"]) == 2
    assert mine.read_text() == '{"mine": true}'
    out = tmp_path / "d.jsonl"
    for _ in range(2):  # its own dataset is replaced
        assert main(["--engine_dir", str(small_engine), "prepare-dataset", "--output", str(out), "token-norm-dist",
                     "--num-requests", "2", "--input-mean", "4", "--output-mean", "2"]) == 0
    assert len(out.read_text().splitlines()) == 2


def test_sibling_reports_and_charts_are_checked_before_the_run(small_engine, dataset, tmp_path, capsys,
                                                               monkeypatch):
    # issue 32: FILE.k{K}.json / FILE.baseline.json and the charts were checked only after the whole run
    import nextn.runtime.llm

    monkeypatch.setattr(nextn.runtime.llm, "LLM", None)  # any load would fail: the refusal must come first
    mine = tmp_path / "r.k2.json"
    mine.write_text('{"mine": true}')
    plots = tmp_path / "plots"
    plots.mkdir()
    (plots / "throughput_vs_k.png").write_text("my notes")
    base = ["--engine_dir", str(small_engine), "throughput", "--dataset", str(dataset), "--no_progress",
            "--draft_lens", "1,2"]
    for extra, name in ((["--report_json", str(tmp_path / "r.json")], "r.k2.json"),
                        (["--plot", str(plots)], "throughput_vs_k.png")):
        assert main([*base, *extra]) == 2
        err = capsys.readouterr().err
        assert name in err and "not written by this command" in err and "Traceback" not in err, err
    assert mine.read_text() == '{"mine": true}' and (plots / "throughput_vs_k.png").read_text() == "my notes"


def _slowed_baseline(monkeypatch, factor: float, spread: tuple[float, ...] | None = None):
    """Make run_benchmark report the baseline `factor` times slower (a machine busy only while it ran), and every
    run's passes `spread` (× its tokens/s) when given."""
    import nextn.bench.runner as runner

    real = runner.run_benchmark

    def fake(*args, **kwargs):
        run = real(*args, **kwargs)
        if run.decoding_mode == "none":
            run = dataclasses.replace(run, end_time=run.start_time + run.total_latency_s * factor)
        tok_s = run.output_throughput
        rel = spread or (1.0,) * len(run.spread.tok_s)
        return dataclasses.replace(run, spread=dataclasses.replace(
            run.spread, tok_s=tuple(tok_s * r for r in rel), load_before=6.5, load_after=7.25, cpu_cores=2))

    monkeypatch.setattr(runner, "run_benchmark", fake)


def test_a_speed_up_above_the_al_is_not_printed_as_a_result(small_engine, dataset, tmp_path, capsys, monkeypatch):
    # issue 33: `Speed-up over no speculation (NGram K=4): 15.010x (AL 1.006)` was printed as a result
    _slowed_baseline(monkeypatch, 40.0)  # far beyond any AL here, even if MTP's steps cost 4x plain ones
    cfg = tmp_path / "mtp.yaml"
    cfg.write_text("speculative_config: {decoding_type: MTP, num_nextn_predict_layers: 2}\n")
    report = tmp_path / "r.json"
    assert main(["--engine_dir", str(small_engine), "throughput", "--dataset", str(dataset), "--config", str(cfg),
                 "--baseline", "--warmup", "0", "--passes", "2", "--report_json", str(report), "--no_progress"]) == 0
    out = capsys.readouterr().out
    table = out[out.rindex("speed-up/AL"):]
    al = json.loads(report.read_text())["decoding_stats"]["acceptance_length_percentiles"]["maximum"]
    assert al < 40 / 1.05  # the fake speed-up is impossible for this engine
    line = next(x for x in table.splitlines() if x.startswith("Speed-up over no speculation (MTP K=2)"))
    assert "not measured reliably" in line and "exceeds the AL" in line and "which speculation cannot do" in line
    assert "n/a" in table.splitlines()[2] and not re.search(r"K=2\): [0-9.]+x", line)  # no ratio as the result
    assert "baseline passes (output tokens/s): " in table and "K=2 passes (output tokens/s): " in table
    assert "load average 6.50 before, 7.25 after, on 2 cores" in table
    verdict = json.loads(report.read_text())["speed_up_over_baseline"]
    assert verdict["speed_up"] is None and not verdict["reliable"] and verdict["measured_ratio"] > 5
    assert "exceeds the AL" in verdict["unreliable_reason"]


def test_passes_that_disagree_are_warned_about(small_engine, dataset, tmp_path, capsys, monkeypatch):
    _slowed_baseline(monkeypatch, 1.0, spread=(1.0, 0.5, 0.95))
    assert main(["--engine_dir", str(small_engine), "throughput", "--dataset", str(dataset), "--warmup", "0",
                 "--passes", "3", "--max_spread", "0.2", "--no_progress"]) == 0
    captured = capsys.readouterr()
    assert "Pass Spread ((max - min) / median):" in captured.out and "52.6%" in captured.out
    assert "warning: the 3 timed passes of MTP K=1 disagree by 53%" in captured.err
    assert "more than --max_spread 20%" in captured.err and "load average 6.50 before, 7.25 after" in captured.err
    assert main(["--engine_dir", str(small_engine), "throughput", "--dataset", str(dataset), "--warmup", "0",
                 "--passes", "3", "--max_spread", "0.6", "--no_progress"]) == 0
    assert "warning" not in capsys.readouterr().err


def test_sampler_options_make_every_request_sample(small_engine, dataset, tmp_path, capsys):
    """--sampler_options (trtllm-bench's): every request takes the YAML's fields; the outputs are sampled ones (the
    same seed twice: the same tokens; greedy: others)."""
    from nextn.bench.runner import run_benchmark
    from nextn.bench.dataset import load_dataset
    from nextn.runtime.llm import LLM

    opts = tmp_path / "sampler.yaml"
    opts.write_text("temperature: 1.0\ntop_k: 50\ntop_p: 0.95\nseed: 7\n")
    assert main(["--engine_dir", str(small_engine), "throughput", "--dataset", str(dataset), "--no_progress",
                 "--passes", "1", "--sampler_options", str(opts)]) == 0
    assert "= PERFORMANCE OVERVIEW" in capsys.readouterr().out
    llm, entries = LLM(small_engine), load_dataset(dataset)

    def tokens(**kw):
        run = run_benchmark(llm, entries, warmup=0, progress=False, **kw)
        return sorted(tuple(o.token_ids) for o in run.outputs)

    sampled = {"temperature": 1.0, "top_k": 50, "seed": 7}
    assert tokens(sampler_options=sampled) == tokens(sampler_options=sampled) != tokens()


@pytest.mark.parametrize("content, message", [
    ("temperature: -1\n", "temperature"), ("- 1\n", "expected a mapping"), ("max_tokens: 4\n", "max_tokens come from"),
    ("temperatur: 0.5\n", "temperatur"),
])
def test_bad_sampler_options_are_refused_before_the_engine_loads(small_engine, dataset, tmp_path, capsys, monkeypatch,
                                                                 content, message):
    import nextn.runtime.llm

    opts = tmp_path / "sampler.yaml"
    opts.write_text(content)
    monkeypatch.setattr(nextn.runtime.llm, "LLM", None)
    assert main(["--engine_dir", str(small_engine), "throughput", "--dataset", str(dataset), "--sampler_options",
                 str(opts)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("nextn-bench: error: --sampler_options") and message in err and "Traceback" not in err


@pytest.mark.parametrize("flag, value, message", [
    ("--passes", "0", "--passes must be in 1..100"), ("--passes", "101", "--passes must be in 1..100"),
    ("--max_spread", "0", "--max_spread must be a positive"), ("--max_spread", "nan", "--max_spread must be"),
    ("--num_threads", "-1", "--num_threads must be in 1.."),
])
def test_counts_are_bounded_before_the_engine_loads(small_engine, dataset, capsys, monkeypatch, flag, value, message):
    import nextn.runtime.llm

    monkeypatch.setattr(nextn.runtime.llm, "LLM", None)  # any load would fail: the refusal must come first
    assert main(["--engine_dir", str(small_engine), "throughput", "--dataset", str(dataset), flag, value]) == 2
    err = capsys.readouterr().err
    assert err.startswith("nextn-bench: error: ") and message in err and "Traceback" not in err


def test_counts_are_checked_before_a_model_dir_is_built(dataset, tmp_path, capsys, monkeypatch):
    import nextn.build.engine_builder

    monkeypatch.setattr(nextn.build.engine_builder, "build_engine", None)  # a build would fail: refuse first
    assert main(["--model_dir", str(tmp_path), "throughput", "--dataset", str(dataset), "--passes", "1000"]) == 2
    assert "--passes must be in 1..100" in capsys.readouterr().err


def test_help_cites_what_users_have(capsys):
    # issue 33: --help cited "REFERENCE.md §7", a file users do not have
    assert main(["--help"]) == 0
    text = capsys.readouterr().out
    assert "REFERENCE.md" not in text and "trtllm-bench" in text and "docs/PERFORMANCE.md" in text
    assert main(["throughput", "--help"]) == 0
    text = capsys.readouterr().out
    assert "--passes" in text and "--max_spread" in text and "REFERENCE.md" not in text


def test_report_names_the_weight_format(dataset, tmp_path, capsys):
    # issue 33: the report said `Quantization: None` for a W4A16 engine
    from nextn.build.engine_builder import build_engine
    from nextn.testing.tiny_llama import tiny_hf_llama

    tiny_hf_llama(vocab_size=320).save_pretrained(tmp_path / "ckpt")  # 320: a multiple of 16 (int4 packing)
    build_engine(tmp_path / "ckpt", tmp_path / "e", max_seq_len=64, progress=False, quant_algo="W4A16", group_size=32)
    report = tmp_path / "r.json"
    assert main(["--engine_dir", str(tmp_path / "e"), "throughput", "--dataset", str(dataset), "--warmup", "0",
                 "--passes", "1", "--num_requests", "1", "--report_json", str(report), "--no_progress"]) == 0
    out = capsys.readouterr().out
    assert "Quantization:         W4A16: 4-bit weights in groups of 32, " in out and "lm_head W8A16" in out
    e = json.loads(report.read_text())["engine"]
    assert e["weight_format"] == "W4A16" and e["quant_config"]["group_size"] == 32
    assert e["quantization"].startswith("W4A16: ") and e["model_name"] == "ckpt"
