"""nextn-bench report: trtllm-bench's decoding statistics (REFERENCE.md §7), section order, JSON keys, and agreement
with the runtime's own `RequestOutput` statistics."""

from __future__ import annotations

import pytest

from nextn import LLM, SamplingParams
from nextn.bench.dataset import DatasetEntry
from nextn.bench.report import PercentileStats, compute_statistics, decoding_counts, format_report, report_dict
from nextn.bench.runner import BenchRun, run_benchmark
from nextn.runtime.outputs import CompletionOutput
from nextn.testing import SMALL_VOCAB

SECTIONS = ["= PYTORCH BACKEND", "= MACHINE DETAILS", "= REQUEST DETAILS", "= WORLD + RUNTIME INFORMATION",
            "= PERFORMANCE OVERVIEW", "= DECODING STATISTICS (MTP)", "= DATASET DETAILS"]
JSON_KEYS = {
    None: {"engine", "machine", "world_info", "request_info", "performance", "streaming_metrics", "decoding_stats",
           "dataset"},
    "performance": {"total_latency_ms", "avg_request_latency_ms", "request_throughput_req_s",
                    "system_output_throughput_tok_s", "system_total_throughput_tok_s",
                    "output_throughput_per_user_tok_s", "request_latency_percentiles_ms", "passes"},
    "streaming_metrics": {"token_output_speed_tok_s", "avg_ttft_ms", "avg_tpot_ms", "tpot_percentiles",
                          "ttft_percentiles"},
    "decoding_stats": {"mode", "num_draft_tokens_percentiles", "num_accepted_draft_tokens_percentiles",
                       "draft_acceptance_rate_percentiles", "acceptance_length_percentiles"},
}
PERCENTILE_KEYS = {"p50", "p90", "p95", "p99", "minimum", "maximum", "average"}


def _output(n_tokens: int, steps: int, accepted_per_position: list[int], t0: float = 0.0) -> CompletionOutput:
    return CompletionOutput(token_ids=list(range(n_tokens)), num_decode_steps=steps,
                            accepted_per_position=accepted_per_position, arrival_time=t0, first_token_time=t0 + 0.01,
                            finished_time=t0 + 0.01 + 0.002 * (n_tokens - 1), finish_reason="length")


def _hand_run(streaming: bool = True) -> BenchRun:
    # k = 2. Request A: 10 tokens in 4 decode steps (it 5); B: 6 tokens in 5 steps (it 6); C: 1 token, no step (it 1).
    outs = [_output(10, 4, [3, 2]), _output(6, 5, [1, 0]), _output(1, 0, [])]
    return BenchRun(mode="throughput", decoding_mode="MTP", max_draft_len=2, input_lens=[5, 7, 3], outputs=outs,
                    start_time=0.0, end_time=0.5, concurrency=-1, streaming=streaming, dataset_path="hand.jsonl",
                    engine={"model": "m", "device": "cpu"}, world={"max_batch_size": 4})


def test_percentiles_nearest_rank():
    p = PercentileStats.from_values(list(range(1, 101)))
    assert (p.p50, p.p90, p.p95, p.p99, p.minimum, p.maximum, p.average) == (51, 91, 96, 100, 1, 100, 50.5)
    assert PercentileStats.from_values([3.0]).p99 == 3.0
    assert set(p.to_dict()) == PERCENTILE_KEYS


def test_decoding_statistics_formulas_on_hand_made_outputs():
    run = _hand_run()
    counts = [decoding_counts(o, 2) for o in run.outputs]
    # DT = k·it, ADT = output − it, DAR = ADT / DT, AL = output / it, it = decode steps + 1
    assert [(c.num_draft_tokens, c.num_accepted_draft_tokens) for c in counts] == [(10, 5), (12, 0), (2, 0)]
    assert [c.draft_acceptance_rate for c in counts] == [0.5, 0.0, 0.0]
    assert [c.acceptance_length for c in counts] == [2.0, 1.0, 1.0]
    s = compute_statistics(run)
    assert s.global_acceptance_length == pytest.approx(17 / 12)  # Σ output / Σ it, not the mean of ALs
    assert s.acceptance_length.average == pytest.approx(4 / 3)
    assert (s.num_draft_tokens.minimum, s.num_draft_tokens.maximum, s.num_draft_tokens.p50) == (2, 12, 10)
    assert s.draft_acceptance_rate.maximum == 0.5 and s.num_accepted_draft_tokens.average == pytest.approx(5 / 3)
    assert s.acceptance_rate_per_position == pytest.approx([4 / 9, 2 / 9])  # Σ accepted at j / Σ decode steps
    assert s.output_throughput_tok_s == pytest.approx(17 / 0.5) and s.total_throughput_tok_s == pytest.approx(32 / 0.5)
    assert s.request_throughput_req_s == pytest.approx(6.0)
    assert s.tpot_ms.minimum == pytest.approx(2.0) and s.ttft_ms.average == pytest.approx(10.0)
    no_spec = decoding_counts(_output(8, 7, []), 0)
    assert (no_spec.num_draft_tokens, no_spec.draft_acceptance_rate, no_spec.acceptance_length) == (0, 0.0, 1.0)


def test_report_sections_in_order_and_streaming_tables():
    text = format_report(_hand_run(streaming=True))
    positions = [text.index(s + "\n") for s in SECTIONS]
    assert positions == sorted(positions)
    perf = text[text.index("= PERFORMANCE OVERVIEW"):text.index("= DECODING STATISTICS")]
    fields = ["Request Throughput (req/sec)", "Total Output Throughput (tokens/sec)",
              "Total Token Throughput (tokens/sec)", "Total Latency (ms)", "Average request latency (ms)",
              "Per User Output Throughput [w/ ctx] (tps/user)", "Average time-to-first-token [TTFT] (ms)",
              "Average time-per-output-token [TPOT] (ms)", "Per User Output Speed (tps/user)"]
    assert [perf.index(f) for f in fields] == sorted(perf.index(f) for f in fields)
    for tag in ("TPOT", "TTFT"):
        rows = [f"[{tag}] {name}" for name in ("MINIMUM", "MAXIMUM", "AVERAGE", "P50", "P90", "P95", "P99")]
        assert [perf.index(r) for r in rows] == sorted(perf.index(r) for r in rows)
    dec = text[text.index("= DECODING STATISTICS"):text.index("= DATASET DETAILS")]
    assert [dec.index(f"[{t}] MINIMUM") for t in ("DT", "ADT", "DAR", "AL")] == sorted(
        dec.index(f"[{t}] MINIMUM") for t in ("DT", "ADT", "DAR", "AL"))
    assert "Acceptance Length (Σ output / Σ it): 1.4167" in dec
    assert "[Draft 1] 0.4444" in dec and "[Draft 2] 0.2222" in dec
    plain = format_report(_hand_run(streaming=False))
    assert "[TPOT]" not in plain and "TTFT" not in plain and "[Latency] P99" in plain


def test_report_json_keys_are_trtllm_bench_keys():
    d = report_dict(_hand_run())
    assert set(d) == JSON_KEYS[None]
    for section in ("performance", "streaming_metrics", "decoding_stats"):
        assert set(d[section]) == JSON_KEYS[section], section
    pct = [d["performance"]["request_latency_percentiles_ms"], d["streaming_metrics"]["tpot_percentiles"],
           d["streaming_metrics"]["ttft_percentiles"]] + [v for k, v in d["decoding_stats"].items() if k != "mode"]
    assert all(set(p) == PERCENTILE_KEYS for p in pct)
    assert d["decoding_stats"]["mode"] == "MTP"
    assert d["decoding_stats"]["acceptance_length_percentiles"]["maximum"] == 2.0


def test_report_al_equals_runtime_statistics(checkpoints):
    """The report's AL is Σ emitted tokens / Σ (decode steps + 1) of the very `RequestOutput`s of llm.generate."""
    engine = checkpoints.engine(distill_steps=150, num_mtp_modules=1, **SMALL_VOCAB)
    llm = LLM(engine, speculative_config={"decoding_type": "MTP", "num_nextn_predict_layers": 2})
    prompts = [[5, 6, 7, 8, 9], [100, 200, 300], [42] * 7, [1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11]]
    lens = [24, 17, 30, 9]
    entries = [DatasetEntry(i, n, input_ids=p) for i, (p, n) in enumerate(zip(prompts, lens))]
    run = run_benchmark(llm, entries, warmup=1, progress=False)
    stats = compute_statistics(run)
    outs = [o.outputs[0] for o in llm.generate(prompts, [SamplingParams(max_tokens=n, ignore_eos=True) for n in lens])]
    assert [o.token_ids for o in run.outputs] == [o.token_ids for o in outs]  # greedy: the same run
    expected = sum(len(o.token_ids) for o in outs) / sum(o.num_decode_steps + 1 for o in outs)
    assert stats.global_acceptance_length == pytest.approx(expected) and expected > 1.2  # a trained MTP module
    assert stats.acceptance_length.maximum == pytest.approx(max(o.acceptance_length for o in outs))
    steps = sum(o.num_decode_steps for o in outs)
    assert stats.acceptance_rate_per_position == pytest.approx(
        [sum(o.accepted_per_position[j] for o in outs) / steps for j in range(2)])
    assert f"Acceptance Length (Σ output / Σ it): {expected:.4f}" in format_report(run, stats)
    assert [len(o.token_ids) for o in run.outputs] == lens and stats.num_requests == 4


def test_concurrency_caps_requests_in_flight_and_latency_runs_one_at_a_time(checkpoints):
    engine = checkpoints.engine(num_mtp_modules=1, **SMALL_VOCAB)
    llm = LLM(engine)
    entries = [DatasetEntry(i, 6, input_ids=[i + 1, i + 2, i + 3]) for i in range(5)]
    run = run_benchmark(llm, entries, concurrency=2, warmup=0, record_iterations=True, progress=False)
    assert max(e["num_requests"] for e in run.iteration_log) == 2 and len(run.outputs) == 5
    assert all(len(o.token_ids) == 6 for o in run.outputs)
    lat = run_benchmark(llm, entries, mode="latency", warmup=0, record_iterations=True, num_requests=3, progress=False)
    assert {e["num_requests"] for e in lat.iteration_log} == {1} and len(lat.outputs) == 3 and lat.streaming
    too_long = [DatasetEntry(0, 4, input_ids=[1] * 5000), entries[0]]
    bad = run_benchmark(llm, too_long, warmup=0, progress=False)
    assert len(bad.outputs) == 1 and len(bad.errors) == 1 and "request 0" in bad.errors[0]
