"""Benchmark runs on an `LLM`: throughput (every request submitted, at most `concurrency` in flight) and latency
(batch 1, one request at a time), as TensorRT-LLM's `trtllm-bench` runs them.

The loop uses the public request-level API (`LLM.add_request` → `LLM.step` until no work) with one addition: a request is only
submitted while fewer than `concurrency` are in flight, and the next one is submitted as soon as one finishes, so
concurrency caps the in-flight requests the way trtllm-bench's `--concurrency` does (not in waves).

After the warm-up the dataset runs `passes` times; the run reports the fastest pass (noise only ever slows a pass,
as `timeit` and `nextn demo` reason) with every pass's tokens/s and the machine's load (bench/passes.py), so a
reader sees how far the passes agree.
"""

from __future__ import annotations

import os
import time
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path

import torch
from tqdm import tqdm

from nextn.bench.dataset import DatasetEntry, DatasetError
from nextn.bench.passes import PassSpread, load_average
from nextn.plugins import cpu_kernels
from nextn.progress import progress_bar
from nextn.runtime.engine import RequestError
from nextn.runtime.outputs import CompletionOutput
from nextn.runtime.sampling_params import SamplingParams


@dataclass
class BenchRun:
    """What one benchmark run measured, plus what the report says about the engine and the run.

    Attributes:
        mode: "throughput" or "latency".
        decoding_mode: speculative_config's decoding_type ("MTP") or "none".
        max_draft_len: K, draft tokens per verify-and-draft step (0 without speculation; a Medusa tree's size − 1).
        max_draft_depth: draft positions a step can accept in sequence (K; a Medusa tree's depth).
        input_lens: prompt tokens of each completed request, aligned with `outputs`.
        outputs: the completed requests (failed ones are in `errors`).
        start_time, end_time: perf_counter seconds at the first submission and at the last completion.
        engine: name → value for `= PYTORCH BACKEND` / JSON `engine`.
        world: name → value for `= WORLD + RUNTIME INFORMATION` / JSON `world_info`.
        iteration_log: one dict per engine iteration of the timed run (empty unless asked for).
        prefix_cache: (queried, reused) prompt tokens of the timed run's admissions (None: block reuse off). The
            cache is emptied after the warm-up, so reuse comes from prefixes the measured requests share.
        spread: output tokens/s of every timed pass and the machine's load around them (None: not recorded).
    """

    mode: str
    decoding_mode: str
    max_draft_len: int
    input_lens: list[int]
    outputs: list[CompletionOutput]
    start_time: float
    end_time: float
    concurrency: int
    streaming: bool
    max_draft_depth: int = -1  # -1: max_draft_len
    dataset_path: str | None = None
    engine: dict = field(default_factory=dict)
    world: dict = field(default_factory=dict)
    errors: list[str] = field(default_factory=list)
    iteration_log: list[dict] = field(default_factory=list)
    prefix_cache: tuple[int, int] | None = None
    spread: PassSpread | None = None

    @property
    def total_latency_s(self) -> float:
        return max(self.end_time - self.start_time, 1e-9)

    @property
    def output_throughput(self) -> float:
        """Total output tokens/s."""
        return sum(len(o.token_ids) for o in self.outputs) / self.total_latency_s


def _prompt_ids(llm, entries: list[DatasetEntry]) -> list[list[int]]:
    """Token ids of every entry; text prompts are tokenized with the engine's tokenizer.

    Raises:
        DatasetError: text prompts for an engine without a tokenizer.
    """
    ids = []
    for e in entries:
        if e.input_ids is not None:
            ids.append(list(e.input_ids))
        elif llm.tokenizer is None:
            raise DatasetError(f"request {e.task_id} has a text prompt but this engine has no tokenizer: prepare the "
                               "dataset with token ids (prepare-dataset with a tokenizer, or token-norm-dist)")
        else:
            ids.append(llm.tokenizer.encode(e.prompt))
    return ids


def _drive(llm, prompts: list[list[int]], params: list[SamplingParams], concurrency: int,
           bar: tqdm | None) -> list[CompletionOutput]:
    """Run every prompt to completion with at most `concurrency` in flight (≤ 0: all at once); outputs in order."""
    queue = deque(range(len(prompts)))
    limit = len(prompts) if concurrency <= 0 else concurrency
    results: list[CompletionOutput | None] = [None] * len(prompts)
    in_flight: dict[int, int] = {}

    def submit() -> None:
        while queue and len(in_flight) < limit:
            i = queue.popleft()
            try:
                in_flight[llm.add_request(prompts[i], params[i])] = i
            except RequestError as e:
                results[i] = CompletionOutput(finish_reason="error", error=str(e))
                if bar is not None:
                    bar.update(1)

    submit()
    while llm.has_unfinished_requests:
        for request_output in llm.step():
            out = request_output.outputs[0]
            results[in_flight.pop(request_output.request_id)] = out
            if bar is not None:
                bar.update(1)
                bar.set_postfix_str(f"{len(out.token_ids)} tok", refresh=False)
        submit()
    return results  # type: ignore[return-value]


def weight_format(manifest) -> tuple[str, str]:
    """(short name, description) of an engine's weight format, from its manifest: e.g. ("W4A16", "W4A16: 4-bit
    weights in groups of 32, bfloat16 activations; lm_head W8A16") or ("bfloat16", "none: bfloat16 weights")."""
    q, dtype = manifest.quant_config, manifest.dtype
    if q is not None:
        bits = {"W8A16": "int8 weights per output channel", "W4A16": "4-bit weights", "W4A8": "4-bit weights"}
        text = f"{q.quant_algo}: {bits[q.quant_algo]}"
        text += f" in groups of {q.group_size}" if q.group_size else ""
        text += f" (8-bit scales per super-block of {q.super_block_size})" if q.super_block_size else ""
        text += ", int8 activations per group" if q.quant_algo == "W4A8" else f", {dtype} activations"
        lm_head = "kept in " + dtype if not q.applies_to("lm_head") else q.for_module("lm_head").quant_algo
        text += f"; lm_head {lm_head}" if lm_head != q.quant_algo else ""
        others = [m for m in q.exclude_modules if m != "lm_head"]
        text += f"; {', '.join(others)} in {dtype}" if others else ""
        return q.quant_algo, text
    if manifest.source.format == "safetensors-fp8":
        return "FP8", f"FP8 (block scales), dequantised to {dtype} at load"
    return dtype, f"none: {dtype} weights"


def describe_engine(llm) -> tuple[dict, dict, str, int, int]:
    """(engine info, world info, decoding mode, K, draft positions) of a loaded `LLM`, for the report."""
    import nextn

    m = llm.manifest
    k = llm.num_draft_tokens
    spec = llm.speculative_config
    mode = spec.decoding_type if spec is not None else "none"
    drafter = llm.drafter_name
    kv_dtype = llm.args.kv_cache_config.dtype
    short, described = weight_format(m)
    name = Path(m.source.path).name
    engine = {"model": m.architecture, "model_name": name.removesuffix(".gguf") if name else m.architecture,
              "model_path": m.source.path, "engine_dir": str(llm.engine_dir), "version": nextn.__version__,
              "dtype": m.dtype, "kv_cache_dtype": m.dtype if kv_dtype == "auto" else kv_dtype,
              "quantization": described, "weight_format": short,
              "quant_config": m.quant_config.model_dump() if m.quant_config is not None else None,
              "backend": "pytorch", "device": str(llm.device),
              "cpu_kernels": cpu_kernels.variant() if llm.device.type == "cpu" else None,
              "speculative_decoding": f"{mode} ({drafter}, K={k})" if spec is not None else None}
    world = {"tp_size": 1, "pp_size": 1, "ep_size": None, "max_batch_size": llm.max_batch_size,
             "max_num_tokens": llm.args.max_num_tokens, "max_seq_len": llm.max_seq_len,
             "scheduling_policy": ("fcfs, prefill steps (chunked) alternating with decode, preempt by recompute"
                                   + ("" if llm.args.disable_overlap_scheduler else ", overlap scheduler")),
             "kv_cache_tokens": llm.num_kv_blocks * llm.tokens_per_block, "tokens_per_block": llm.tokens_per_block}
    return engine, world, mode, k, llm.max_draft_depth  # a tree drafter accepts one path: its depth


def _timed_pass(llm, prompts: list[list[int]], params: list[SamplingParams], concurrency: int, record: bool,
                bar: tqdm | None) -> tuple[list[CompletionOutput], float, float, tuple[int, int] | None, list[dict]]:
    """One timed pass over every prompt from an empty prefix cache: (outputs, start, end perf_counter seconds,
    (queried, reused) prompt tokens or None without block reuse, iteration log)."""
    llm.iteration_log = [] if record else None
    llm.reset_prefix_cache()  # the warm-up's (or the previous pass's) prompts must not hit
    stats = llm.prefix_cache_stats
    before = (stats.queries, stats.hits) if stats is not None else (0, 0)
    start = time.perf_counter()
    results = _drive(llm, prompts, params, concurrency, bar)
    end = time.perf_counter()
    stats = llm.prefix_cache_stats
    reuse = None if stats is None else (stats.queries - before[0], stats.hits - before[1])
    log, llm.iteration_log = llm.iteration_log or [], None
    return results, start, end, reuse, log


def run_benchmark(llm, entries: list[DatasetEntry], *, mode: str = "throughput", concurrency: int = -1,
                  warmup: int = 2, eos_id: int = -1, streaming: bool = False, num_requests: int = 0,
                  record_iterations: bool = False, progress: bool = True, dataset_path: str | None = None,
                  desc: str | None = None, passes: int = 1, sampler_options: dict | None = None) -> BenchRun:
    """Run a benchmark over `entries` (greedy decoding, or `sampler_options`): a warm-up, then `passes` timed passes
    of the dataset.

    Args:
        mode: "throughput" (all submitted, `concurrency` in flight, −1 = unlimited) or "latency" (one at a time,
            streaming statistics).
        warmup: requests run first and not measured (the first entries, cycled).
        eos_id: −1 = ignore EOS, so each request emits exactly `output_tokens`; else stop at this token.
        num_requests: measure the first N entries (0 = all).
        record_iterations: keep the engine's per-iteration log of the reported pass.
        passes: timed passes of the dataset (≥ 1); the returned run is the fastest (most output tokens/s), its
            `spread` holds every pass's output tokens/s and the 1-minute load average before and after.
        sampler_options: `SamplingParams` fields every request takes (trtllm-bench's `--sampler_options`: e.g.
            temperature, top_p, top_k, seed); the dataset's own (max_tokens, EOS) are not among them.
    Raises:
        ValueError: an unknown mode or passes < 1.
        DatasetError: text prompts without a tokenizer. A request the engine rejects (e.g. too long) is counted in
            `errors`, not raised.
    """
    if mode not in ("throughput", "latency"):
        raise ValueError(f"mode must be 'throughput' or 'latency', got {mode!r}")
    if passes < 1:
        raise ValueError(f"passes must be ≥ 1, got {passes}")
    entries = entries[:num_requests] if num_requests > 0 else entries
    prompts = _prompt_ids(llm, entries)

    extra = sampler_options or {}

    def params(e: DatasetEntry) -> SamplingParams:
        if eos_id < 0:
            return SamplingParams(max_tokens=e.output_tokens, ignore_eos=True, detokenize=False, **extra)
        return SamplingParams(max_tokens=e.output_tokens, end_id=eos_id, detokenize=False, **extra)

    concurrency = 1 if mode == "latency" else concurrency
    if warmup > 0:
        idx = [i % len(entries) for i in range(warmup)]
        _drive(llm, [prompts[i] for i in idx], [params(entries[i]) for i in idx], concurrency, None)
    load_before = load_average()
    bar = progress_bar(enabled=progress, total=len(entries) * passes, desc=desc or mode, unit="req")
    timed = [_timed_pass(llm, prompts, [params(e) for e in entries], concurrency, record_iterations, bar)
             for _ in range(passes)]
    bar.close()
    load_after = load_average()

    def tok_s(p) -> float:
        return sum(len(r.token_ids) for r in p[0] if r.finish_reason != "error") / max(p[2] - p[1], 1e-9)

    rates = [tok_s(p) for p in timed]
    results, start, end, reuse, log = timed[max(range(passes), key=rates.__getitem__)]
    ok = [(len(p), r) for p, r in zip(prompts, results) if r.finish_reason != "error"]
    errors = [f"request {e.task_id}: {r.error}" for e, r in zip(entries, results) if r.finish_reason == "error"]
    info, world, decoding_mode, k, depth = describe_engine(llm)
    world["Sampling"] = ", ".join(f"{k_}={v}" for k_, v in extra.items()) if extra else "greedy"
    spread = PassSpread(tuple(rates), load_before, load_after, os.cpu_count(), torch.get_num_threads())
    return BenchRun(mode=mode, decoding_mode=decoding_mode, max_draft_len=k, input_lens=[n for n, _ in ok],
                    outputs=[r for _, r in ok], start_time=start, end_time=end, concurrency=concurrency,
                    streaming=streaming or mode == "latency", max_draft_depth=depth, dataset_path=dataset_path,
                    engine=info, world=world, errors=errors, iteration_log=log, prefix_cache=reuse, spread=spread)
