"""The benchmark report: statistics of a `BenchRun`, the text report and `--report_json` of TensorRT-LLM's
`trtllm-bench` (its sections and keys), plus the spread of the timed passes (bench/passes.py).

Decoding statistics per request, with k = max draft length and it = decode iterations + 1 (prefill counted as one):
DT = k·it draft tokens, ADT = output − it accepted draft tokens, DAR = ADT / DT, AL = output / it; the global
AL = Σ output / Σ it. Percentiles are nearest-rank on the sorted values (`sorted[int(n·q)]`, as trtllm-bench's
`PercentileStats`).
"""

from __future__ import annotations

import os
import platform
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from nextn.bench.passes import PassSpread
from nextn.bench.runner import BenchRun
from nextn.runtime.outputs import CompletionOutput

RULE = "=" * 59
PERCENTILE_ROWS = (("MINIMUM", "minimum"), ("MAXIMUM", "maximum"), ("AVERAGE", "average"), ("P50", "p50"),
                   ("P90", "p90"), ("P95", "p95"), ("P99", "p99"))


@dataclass(frozen=True)
class PercentileStats:
    """p50/p90/p95/p99 (nearest rank), minimum, maximum and mean of a list of values (all 0 for an empty list)."""

    p50: float
    p90: float
    p95: float
    p99: float
    minimum: float
    maximum: float
    average: float

    @classmethod
    def from_values(cls, values: list[float]) -> "PercentileStats":
        if not values:
            return cls(0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0)
        s = sorted(float(v) for v in values)
        n = len(s)
        return cls(p50=s[int(n * 0.50)], p90=s[int(n * 0.90)], p95=s[int(n * 0.95)], p99=s[int(n * 0.99)],
                   minimum=s[0], maximum=s[-1], average=sum(s) / n)

    def to_dict(self) -> dict[str, float]:
        return asdict(self)


@dataclass(frozen=True)
class DecodingCounts:
    """One request's decoding statistics (trtllm-bench's definitions; see the module docstring)."""

    num_draft_tokens: int  # DT = k · it
    num_accepted_draft_tokens: int  # ADT = output − it
    draft_acceptance_rate: float  # DAR = ADT / DT (0 when k = 0)
    acceptance_length: float  # AL = output / it


def decoding_counts(output: CompletionOutput, max_draft_len: int) -> DecodingCounts:
    """DT, ADT, DAR and AL of one request, with it = num_decode_steps + 1."""
    it = output.num_decode_steps + 1
    n = len(output.token_ids)
    dt = max_draft_len * it
    adt = n - it
    return DecodingCounts(dt, adt, adt / dt if dt else 0.0, n / it)


@dataclass(frozen=True)
class BenchStatistics:
    """Everything the report prints, in its units (ms, tokens/s, requests/s)."""

    num_requests: int
    total_latency_ms: float
    avg_request_latency_ms: float
    request_throughput_req_s: float
    output_throughput_tok_s: float
    total_throughput_tok_s: float
    output_throughput_per_user_tok_s: float  # mean over requests of output / request latency
    avg_concurrency: float  # Σ request latency / total latency
    request_latency_ms: PercentileStats
    ttft_ms: PercentileStats
    tpot_ms: PercentileStats
    output_speed_tok_s: PercentileStats  # per request 1000 / TPOT
    num_draft_tokens: PercentileStats
    num_accepted_draft_tokens: PercentileStats
    draft_acceptance_rate: PercentileStats
    acceptance_length: PercentileStats
    global_acceptance_length: float  # Σ output / Σ it
    acceptance_rate_per_position: list[float]  # draft position j: Σ steps accepting j / Σ decode steps
    input_len: PercentileStats
    output_len: PercentileStats
    seq_len: PercentileStats


def compute_statistics(run: BenchRun) -> BenchStatistics:
    """Statistics of the completed requests of a run.

    Raises:
        ValueError: no request completed.
    """
    outs = run.outputs
    if not outs:
        raise ValueError("no request completed: " + ("; ".join(run.errors[:3]) or "empty dataset"))
    n = len(outs)
    total_s = run.total_latency_s
    out_lens = [len(o.token_ids) for o in outs]
    latency_ms = [(o.finished_time - o.arrival_time) * 1e3 for o in outs]
    tpot = [o.tpot_ms for o in outs if o.tpot_ms is not None]
    counts = [decoding_counts(o, run.max_draft_len) for o in outs]
    steps = sum(o.num_decode_steps for o in outs)
    k = run.max_draft_len if run.max_draft_depth < 0 else run.max_draft_depth
    per_pos = [sum(o.accepted_per_position[j] for o in outs if j < len(o.accepted_per_position)) / steps if steps else 0.0
               for j in range(k)]
    return BenchStatistics(
        num_requests=n, total_latency_ms=total_s * 1e3, avg_request_latency_ms=sum(latency_ms) / n,
        request_throughput_req_s=n / total_s, output_throughput_tok_s=sum(out_lens) / total_s,
        total_throughput_tok_s=(sum(out_lens) + sum(run.input_lens)) / total_s,
        output_throughput_per_user_tok_s=sum(m / (ms / 1e3) for m, ms in zip(out_lens, latency_ms) if ms > 0) / n,
        avg_concurrency=sum(latency_ms) / 1e3 / total_s,
        request_latency_ms=PercentileStats.from_values(latency_ms),
        ttft_ms=PercentileStats.from_values([o.ttft_ms for o in outs if o.ttft_ms is not None]),
        tpot_ms=PercentileStats.from_values(tpot),
        output_speed_tok_s=PercentileStats.from_values([1e3 / t for t in tpot if t > 0]),
        num_draft_tokens=PercentileStats.from_values([c.num_draft_tokens for c in counts]),
        num_accepted_draft_tokens=PercentileStats.from_values([c.num_accepted_draft_tokens for c in counts]),
        draft_acceptance_rate=PercentileStats.from_values([c.draft_acceptance_rate for c in counts]),
        acceptance_length=PercentileStats.from_values([c.acceptance_length for c in counts]),
        global_acceptance_length=sum(out_lens) / sum(o.num_decode_steps + 1 for o in outs),
        acceptance_rate_per_position=per_pos,
        input_len=PercentileStats.from_values(run.input_lens), output_len=PercentileStats.from_values(out_lens),
        seq_len=PercentileStats.from_values([a + b for a, b in zip(run.input_lens, out_lens)]))


def machine_info(device: str = "cpu") -> dict:
    """The machine the run happened on: CPU model, cores, memory, and the GPU when the device is CUDA."""
    info: dict = {"platform": platform.platform(), "cpu": platform.processor() or platform.machine(),
                  "cpu_cores": os.cpu_count(), "torch_threads": torch.get_num_threads(), "torch": torch.__version__}
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                info["cpu"] = line.split(":", 1)[1].strip()
                break
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemTotal"):
                info["memory_gib"] = round(int(line.split()[1]) / 2**20, 2)
    except OSError:
        pass
    if device.startswith("cuda") and torch.cuda.is_available():
        p = torch.cuda.get_device_properties(torch.device(device))
        info["gpu"] = p.name
        info["gpu_memory_gib"] = round(p.total_memory / 2**30, 2)
    return info


def _section(title: str) -> list[str]:
    return [RULE, f"= {title}", RULE]


def _fields(rows: list[tuple[str, object]]) -> list[str]:
    width = max(len(name) for name, _ in rows) + 2
    return [f"{name + ':':<{width}}{_fmt(value)}" for name, value in rows]


def _fmt(value: object) -> str:
    return f"{value:.4f}" if isinstance(value, float) else str(value)


def _rule_title(title: str) -> str:
    return f"-- {title} " + "-" * max(3, len(RULE) - len(title) - 4)


def _percentiles(tag: str, title: str, stats: PercentileStats) -> list[str]:
    return ["", _rule_title(title), ""] + [
        f"[{tag}] {name:<7}: {getattr(stats, attr):.4f}" for name, attr in PERCENTILE_ROWS]


def format_report(run: BenchRun, stats: BenchStatistics | None = None) -> str:
    """The text report, trtllm-bench's sections in order: PYTORCH BACKEND, MACHINE DETAILS, REQUEST DETAILS,
    WORLD + RUNTIME INFORMATION, PERFORMANCE OVERVIEW, DECODING STATISTICS (<mode>), DATASET DETAILS."""
    s = stats or compute_statistics(run)
    e, w, m = run.engine, run.world, machine_info(run.engine.get("device", "cpu"))
    lines = _section("PYTORCH BACKEND") + _fields([
        ("Model", e.get("model_name") or e.get("model")), ("Architecture", e.get("model")), ("Model Path", e.get("model_path")), ("Engine Directory", e.get("engine_dir")),
        ("nextn Version", e.get("version")), ("Dtype", e.get("dtype")), ("KV Cache Dtype", e.get("kv_cache_dtype")),
        ("CPU Kernels", e.get("cpu_kernels")),
        ("Quantization", e.get("quantization")), ("Device", e.get("device")),
        ("Speculative Decoding", e.get("speculative_decoding"))])
    machine = f"{m['cpu']}, {m['cpu_cores']} cores ({m['torch_threads']} torch threads)"
    machine += f", memory {m['memory_gib']:.2f} GiB" if "memory_gib" in m else ""
    machine += f"; {m['gpu']}, memory {m['gpu_memory_gib']:.2f} GiB" if "gpu" in m else ""
    lines += _section("MACHINE DETAILS") + [machine, f"{m['platform']}, torch {m['torch']}", ""]
    lines += _section("REQUEST DETAILS") + _fields([
        ("Number of requests", s.num_requests), ("Number of concurrent requests", s.avg_concurrency),
        ("Average Input Length (tokens)", s.input_len.average), ("Average Output Length (tokens)", s.output_len.average)]
        + ([("Failed requests", len(run.errors))] if run.errors else [])
        + ([("Prefix Cache Hit Rate (reused / prompt tokens)", _hit_rate(run.prefix_cache))]
           if run.prefix_cache is not None else [("Prefix Cache", "off (enable_block_reuse: false)")]))
    lines += _section("WORLD + RUNTIME INFORMATION") + _fields([
        ("TP Size", w.get("tp_size")), ("PP Size", w.get("pp_size")), ("EP Size", w.get("ep_size")),
        ("Max Runtime Batch Size", w.get("max_batch_size")), ("Max Runtime Tokens", w.get("max_num_tokens")),
        ("Scheduling Policy", w.get("scheduling_policy")), ("KV Cache Tokens", w.get("kv_cache_tokens")),
        ("Concurrency", run.concurrency if run.concurrency > 0 else "unlimited"), ("Benchmark Mode", run.mode)]) + [""]
    lines += _section("PERFORMANCE OVERVIEW") + _fields([
        ("Request Throughput (req/sec)", s.request_throughput_req_s),
        ("Total Output Throughput (tokens/sec)", s.output_throughput_tok_s),
        ("Total Token Throughput (tokens/sec)", s.total_throughput_tok_s),
        ("Total Latency (ms)", s.total_latency_ms), ("Average request latency (ms)", s.avg_request_latency_ms),
        ("Per User Output Throughput [w/ ctx] (tps/user)", s.output_throughput_per_user_tok_s)]
        + _pass_rows(run.spread)
        + ([("Average time-to-first-token [TTFT] (ms)", s.ttft_ms.average),
            ("Average time-per-output-token [TPOT] (ms)", s.tpot_ms.average),
            ("Per User Output Speed (tps/user)", s.output_speed_tok_s.average)] if run.streaming else []))
    if run.streaming:
        lines += _percentiles("TPOT", "Per-Request Time-per-Output-Token [TPOT] Breakdown (ms)", s.tpot_ms)
        lines += _percentiles("TTFT", "Per-Request Time-to-First-Token [TTFT] Breakdown (ms)", s.ttft_ms)
        lines += _percentiles("GEN", "Per-Request Output Speed [1/TPOT] Breakdown (tps/user)", s.output_speed_tok_s)
    lines += _percentiles("Latency", "Request Latency Breakdown (ms)", s.request_latency_ms) + [""]
    lines += _section(f"DECODING STATISTICS ({run.decoding_mode})") + _fields([
        ("Max Draft Length (k)", run.max_draft_len), ("Acceptance Length (Σ output / Σ it)", s.global_acceptance_length)])
    lines += _percentiles("DT", "Number of Draft Tokens Details", s.num_draft_tokens)
    lines += _percentiles("ADT", "Number of Accepted Draft Tokens Details", s.num_accepted_draft_tokens)
    lines += _percentiles("DAR", "Draft Acceptance Rate Details", s.draft_acceptance_rate)
    lines += _percentiles("AL", "Acceptance Length Details", s.acceptance_length)
    if s.acceptance_rate_per_position:
        lines += ["", _rule_title("Acceptance Rate per Draft Position"), ""]
        lines += [f"[Draft {j + 1}] {r:.4f}" for j, r in enumerate(s.acceptance_rate_per_position)]
    lines += [""] + _section("DATASET DETAILS") + _fields([
        ("Dataset Path", run.dataset_path), ("Number of Sequences", s.num_requests)])
    lines += ["", _rule_title("Percentiles statistics"), "",
              f"{'':8}{'Input':>14}{'Output':>14}{'Seq. Length':>14}", "-" * len(RULE)]
    for name, attr in PERCENTILE_ROWS:
        vals = (getattr(x, attr) for x in (s.input_len, s.output_len, s.seq_len))
        short = {"MINIMUM": "MIN", "MAXIMUM": "MAX", "AVERAGE": "AVG"}.get(name, name)
        lines.append(f"{short + ':':8}" + "".join(f"{v:>14.4f}" for v in vals))
    return "\n".join(lines + [RULE])


def _pass_rows(spread: PassSpread | None) -> list[tuple[str, object]]:
    """The report's rows on the timed passes: how many, their tokens/s, their spread, the machine's load."""
    if spread is None:
        return []
    rel = spread.relative_spread
    return [("Timed Passes (figures above: the fastest)", len(spread.tok_s)),
            ("Pass Output Throughput min / median / max (tokens/sec)",
             f"{spread.minimum:.2f} / {spread.median:.2f} / {spread.maximum:.2f}"),
            ("Pass Spread ((max - min) / median)", "n/a (one pass)" if rel is None else f"{rel:.1%}"),
            ("Machine Load (1-minute load average)", spread.noise_text().removeprefix("load average "))]


def _hit_rate(prefix_cache: tuple[int, int]) -> float:
    queries, hits = prefix_cache
    return hits / queries if queries else 0.0


def report_dict(run: BenchRun, stats: BenchStatistics | None = None) -> dict:
    """The `--report_json` object with trtllm-bench's keys, plus `performance.passes` (PassSpread.to_dict; None
    when not recorded)."""
    s = stats or compute_statistics(run)
    return {
        "engine": dict(run.engine),
        "machine": machine_info(run.engine.get("device", "cpu")),
        "world_info": dict(run.world, concurrency=run.concurrency, mode=run.mode),
        "request_info": {"num_requests": s.num_requests, "avg_num_concurrent_requests": s.avg_concurrency,
                         "avg_input_length": s.input_len.average, "avg_output_length": s.output_len.average,
                         "num_failed_requests": len(run.errors),
                         "prefix_cache": None if run.prefix_cache is None else {
                             "queried_tokens": run.prefix_cache[0], "reused_tokens": run.prefix_cache[1],
                             "hit_rate": _hit_rate(run.prefix_cache)}},
        "performance": {
            "total_latency_ms": s.total_latency_ms, "avg_request_latency_ms": s.avg_request_latency_ms,
            "request_throughput_req_s": s.request_throughput_req_s,
            "system_output_throughput_tok_s": s.output_throughput_tok_s,
            "system_total_throughput_tok_s": s.total_throughput_tok_s,
            "output_throughput_per_user_tok_s": s.output_throughput_per_user_tok_s,
            "request_latency_percentiles_ms": s.request_latency_ms.to_dict(),
            "passes": run.spread.to_dict() if run.spread is not None else None},
        "streaming_metrics": {
            "token_output_speed_tok_s": s.output_speed_tok_s.average, "avg_ttft_ms": s.ttft_ms.average,
            "avg_tpot_ms": s.tpot_ms.average, "tpot_percentiles": s.tpot_ms.to_dict(),
            "ttft_percentiles": s.ttft_ms.to_dict()},
        "decoding_stats": {
            "mode": run.decoding_mode, "num_draft_tokens_percentiles": s.num_draft_tokens.to_dict(),
            "num_accepted_draft_tokens_percentiles": s.num_accepted_draft_tokens.to_dict(),
            "draft_acceptance_rate_percentiles": s.draft_acceptance_rate.to_dict(),
            "acceptance_length_percentiles": s.acceptance_length.to_dict()},
        "dataset": {"dataset_path": run.dataset_path, "num_requests": s.num_requests,
                    "isl_stats": s.input_len.to_dict(), "osl_stats": s.output_len.to_dict(),
                    "seq_len_stats": s.seq_len.to_dict()},
    }
