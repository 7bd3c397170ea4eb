"""`build-engine --compile_step`: compile the decode step of an engine just written and store the artifacts in it.

The engine is loaded as the runtime loads it (its default speculative config, overlap off) and driven directly
(`Engine.add_request` / `Engine.step`, not the `LLM` API, which sits above the builder), with greedy warm-up
requests at each batch size; the step is wrapped by `runtime/compiled_step.py`'s `compile_decode_fn` inside a
private inductor cache directory, so that every kernel it needs is built there and can be packed.
"""

from __future__ import annotations

import contextlib
from pathlib import Path

from nextn.build.manifest import CompiledStepInfo, EngineManifest
from nextn.config.llm_args import TorchCompileConfig, parse_llm_args
from nextn.progress import progress_bar
from nextn.runtime import compiled_step
from nextn.runtime.compiled_step import compile_decode_fn, default_warmup_batch_sizes, save_compile_artifacts
from nextn.runtime.engine import Engine
from nextn.runtime.sampling_params import SamplingParams
from nextn.speculative.registry import default_config


def compile_engine_step(engine_dir: str | Path, batch_sizes: list[int] | None = None, device: str = "cpu",
                        config: TorchCompileConfig | None = None, progress: bool = True) -> CompiledStepInfo | None:
    """Compile the decode step of the engine in `engine_dir` and store the artifacts there (not the manifest).

    Loads the engine as the runtime would (its default speculative config), runs greedy warm-up requests at each
    batch size (a prefill and a few decode steps each), then saves the compile artifacts of this process.

    Args:
        batch_sizes: batch sizes to warm up (≤ the engine's max_batch_size); None: `default_warmup_batch_sizes`.
        progress: show a tqdm bar over the batch sizes (stderr).
    Returns:
        The manifest entry to record, or None when torch could not store artifacts (logged).
    Raises:
        ValueError: a warm-up batch size above the engine's max_batch_size.
    """
    config = config or TorchCompileConfig()
    args = parse_llm_args({}, disable_overlap_scheduler=True)
    engine = Engine(engine_dir, args, default_config(EngineManifest.load(engine_dir)), device)
    sizes = batch_sizes or default_warmup_batch_sizes(engine.max_batch_size)
    if max(sizes) > engine.max_batch_size:
        raise ValueError(f"warm-up batch size {max(sizes)} exceeds the engine's max_batch_size {engine.max_batch_size}")
    runner = engine.runner
    k = engine.drafter.num_draft_tokens
    params = SamplingParams(max_tokens=2 * (k + 1) + 2, ignore_eos=True)  # a prefill and ≥ 2 decode steps
    vocab = engine.cfg.vocab_size
    cache_dir, fresh_cache = compiled_step.inductor_cache()
    with fresh_cache() if fresh_cache is not None else contextlib.nullcontext():
        runner.decode_fn = compile_decode_fn(runner.decode_fn, None, device, config)
        for b in progress_bar(sizes, enabled=progress, desc="compile step", unit="batch size"):
            for i in range(b):
                engine.add_request(engine.make_request([(7 * i + j) % vocab for j in range(4 + i)], params))
            while engine.has_work:
                engine.step()
        kernels_dir = Path(cache_dir()) if fresh_cache is not None else None
        return save_compile_artifacts(engine_dir, device, sizes, k, config, kernels_dir)
