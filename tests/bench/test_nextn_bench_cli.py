"""`nextn-bench throughput / latency`: the report, --report_json, --iteration_log, --plot, --baseline, errors."""

from __future__ import annotations

import json
import os
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
               "--baseline", "--warmup", "1", "--concurrency", "3", "--no_progress"])
    out = capsys.readouterr().out
    assert rc == 0
    assert out.count("= PYTORCH BACKEND") == 2  # the baseline's report, then the speculative run's
    baseline, spec = out[:out.rindex("= PYTORCH BACKEND")], out[out.rindex("= PYTORCH BACKEND"):]
    assert _in_order(baseline, SECTIONS) and "= DECODING STATISTICS (none)" in baseline
    assert _in_order(spec, SECTIONS) and "= DECODING STATISTICS (MTP)" in spec
    assert "[TTFT] P99" in out and "Speculative Decoding: MTP (MtpEagle, K=2)" in out and "[Draft 2]" in out
    assert "Speed-up over no speculation (MTP K=2): " in out and "x (" in out
    d = json.loads(report.read_text())
    assert d["decoding_stats"]["mode"] == "MTP" and d["dataset"]["num_requests"] == 4
    assert d["request_info"]["avg_output_length"] == pytest.approx(7.5)
    assert d["world_info"]["concurrency"] == 3
    assert json.loads((tmp_path / "r.baseline.json").read_text())["decoding_stats"]["mode"] == "none"
    rows = [json.loads(line) for line in log.read_text().splitlines()]
    assert {r["max_draft_len"] for r in rows} == {0, 2} and max(r["num_requests"] for r in rows) <= 3
    assert sum(r["num_emitted"] for r in rows if r["max_draft_len"] == 2) == 6 + 7 + 8 + 9
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
