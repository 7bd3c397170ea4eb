"""`nextn-bench`: a benchmark in the shape of TensorRT-LLM's `trtllm-bench` (commands, report sections, JSON keys).

    dataset.py  prepare-dataset (synthetic token-norm-dist / token-unif-dist; MT-bench, Spec-Bench, HumanEval,
                GSM8K prompt files) and the reader of trtllm-bench's dataset JSON lines
    runner.py   throughput (all requests submitted, `concurrency` in flight) and latency (batch 1) runs on `LLM`
    report.py   per-run statistics, the text report in trtllm-bench's section order, and `--report_json`
    plot.py     `--plot DIR`: acceptance per draft position; tokens/s and AL against K
"""

from nextn.bench.dataset import DatasetEntry, DatasetError, load_dataset
from nextn.bench.report import BenchStatistics, PercentileStats, compute_statistics, format_report, report_dict
from nextn.bench.runner import BenchRun, run_benchmark

__all__ = ["BenchRun", "BenchStatistics", "DatasetEntry", "DatasetError", "PercentileStats", "compute_statistics",
           "format_report", "load_dataset", "report_dict", "run_benchmark"]
