"""`nextn generate`: completions with acceptance length, JSON output, and clear errors."""

from __future__ import annotations

import json

from nextn.testing import SMALL_VOCAB as SMALL
from nextn.cli.main import main


def test_generate_json_token_ids(checkpoints, capsys, tmp_path):
    engine = checkpoints.engine(num_mtp_modules=1, **SMALL)
    cfg = tmp_path / "mtp.yaml"
    cfg.write_text("speculative_config: {decoding_type: MTP, num_nextn_predict_layers: 2}\n")
    argv = ["generate", "--engine_dir", str(engine), "--token_ids", "--prompt", "5,6,7", "--prompt", "9",
            "--max_tokens", "7", "--ignore_eos", "--json", "--extra_llm_api_options", str(cfg)]
    assert main(argv + ["--temperature", "0.1", "--top_p", "0.9", "--seed", "3"]) == 0
    sampled = [_untimed(json.loads(line)) for line in capsys.readouterr().out.splitlines()]
    assert main(argv + ["--temperature", "0.1", "--top_p", "0.9", "--seed", "3"]) == 0
    again = [_untimed(json.loads(line)) for line in capsys.readouterr().out.splitlines()]
    assert again == sampled  # seeded: reproducible
    rc = main(argv)
    assert rc == 0
    rows = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert [len(r["token_ids"]) for r in rows] == [7, 7]
    assert all(len(r["accepted_per_position"]) == 2 for r in rows)
    assert all(r["acceptance_length"] >= 1.0 and r["num_draft_tokens"] % 2 == 0 for r in rows)


def test_generate_reports_speed_per_prompt_and_overall(checkpoints, capsys):
    """Each prompt's decode tokens/s, TTFT, TPOT and AL (JSON and text), and an overall summary line."""
    engine = checkpoints.engine(num_mtp_modules=1, **SMALL)
    argv = ["generate", "--engine_dir", str(engine), "--token_ids", "--prompt", "5,6,7", "--prompt", "9",
            "--max_tokens", "6", "--ignore_eos"]
    assert main(argv + ["--json"]) == 0
    captured = capsys.readouterr()
    rows = [json.loads(line) for line in captured.out.splitlines()]
    for r in rows:
        assert r["tokens_per_s"] > 0 and r["ttft_ms"] > 0 and r["tpot_ms"] > 0
        assert abs(r["tokens_per_s"] - 1e3 / r["tpot_ms"]) < 0.01 * r["tokens_per_s"]
    summary = json.loads(captured.err.strip().splitlines()[-1])["summary"]
    assert summary["num_prompts"] == 2 and summary["num_tokens"] == 12 and summary["tokens_per_s"] > 0
    assert summary["ttft_ms"] > 0 and summary["acceptance_length"] >= 1.0
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert out.count("tokens/s, TTFT") == 2
    assert "overall: 2 prompt(s), 12 tokens: decode " in out and "mean TTFT" in out


def test_run_stats_sum_up_batched_prompts():
    """Overall decode tokens/s: tokens after each first over the span first token .. last finish; AL over all steps."""
    from nextn.cli.generate import RunStats
    from nextn.runtime.outputs import CompletionOutput

    a = CompletionOutput(token_ids=[1] * 5, num_decode_steps=1, arrival_time=0.0, first_token_time=0.1,
                         finished_time=1.1)
    b = CompletionOutput(token_ids=[1] * 3, num_decode_steps=2, arrival_time=0.0, first_token_time=0.3,
                         finished_time=0.6)
    stats = RunStats.of([a, b])
    assert stats.num_tokens == 8 and abs(stats.decode_tokens_per_s - 6 / 1.0) < 1e-9
    assert abs(stats.mean_ttft_ms - 200.0) < 1e-6 and stats.acceptance_length == 8 / 5
    assert RunStats.of([CompletionOutput(token_ids=[1])]).decode_tokens_per_s is None


def test_generate_text_with_real_tokenizer(checkpoints, capsys):
    engine = checkpoints.engine(distill_steps=150, num_mtp_modules=1)
    assert main(["generate", "--engine_dir", str(engine), "--prompt", "Hello there", "--max_tokens", "6",
                 "--ignore_eos"]) == 0
    out = capsys.readouterr().out
    assert "acceptance length" in out and "6 tokens" in out and "tokens/s" in out


def test_generate_bad_prompt_and_bad_engine(checkpoints, capsys, tmp_path):
    engine = checkpoints.engine(num_mtp_modules=1, **SMALL)
    rc = main(["generate", "--engine_dir", str(engine), "--token_ids", "--prompt", "5,6", "--prompt", "999999",
               "--max_tokens", "3"])
    captured = capsys.readouterr()
    assert rc == 1 and "prompt 1" in captured.err and "outside the vocabulary" in captured.err
    assert "[0]" in captured.out  # the good prompt still ran
    assert main(["generate", "--engine_dir", str(tmp_path), "--prompt", "x"]) == 2
    assert "not an nextn engine directory" in capsys.readouterr().err


def test_generate_model_builds_a_gguf_once_into_the_cache(shared_data, capsys, tmp_path, monkeypatch):
    """`--model FILE.gguf`: built into $NEXTN_CACHE_DIR on first use, reused after; stories260K's model-card text."""
    gguf = shared_data / "models" / "stories260K" / "stories260K.gguf"
    monkeypatch.setenv("NEXTN_CACHE_DIR", str(tmp_path / "cache"))
    argv = ["generate", "--model", str(gguf), "--prompt", "Once upon a time", "--max_tokens", "12", "--dtype", "float32"]
    assert main(argv) == 0
    first = capsys.readouterr().out
    assert "there was a little girl named Lily" in first
    (engine,) = (tmp_path / "cache").glob("*/manifest.json")
    mtime = engine.stat().st_mtime_ns
    assert main(argv) == 0 and _completions(capsys.readouterr().out) == _completions(first)
    assert engine.stat().st_mtime_ns == mtime  # reused, not rebuilt


def _completions(out: str) -> list[str]:
    """The completion lines of `nextn generate`'s text output (the timings vary from run to run)."""
    return [line for line in out.splitlines() if line.startswith("[")]


def _untimed(row: dict) -> dict:
    """A `--json` row without its timings (they vary from run to run)."""
    return {k: v for k, v in row.items() if k not in ("tokens_per_s", "ttft_ms", "tpot_ms")}
