"""`LLM`: the public API, in the shape of TensorRT-LLM's LLM API (`LLM(...).generate(prompts, SamplingParams)`)."""

from __future__ import annotations

import logging
import threading
import weakref
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from nextn.progress import progress_bar
from nextn.config.llm_args import LlmArgs, load_llm_args_yaml, parse_llm_args
from nextn.distributed.launcher import start_engine
from nextn.runtime.engine import RequestError
from nextn.speculative.registry import default_config as default_speculative_config
from nextn.runtime.engine_loop import EngineLoop, LoopStopped
from nextn.runtime.fault_isolation import fail_all
from nextn.runtime.outputs import CompletionOutput, RequestOutput
from nextn.runtime.parallel_sampling import expand_n, merge_n
from nextn.runtime.request_handle import RequestHandle
from nextn.runtime.sampling_params import SamplingParams

logger = logging.getLogger(__name__)
_UNSET: Any = object()

Prompt = str | list[int]


class EngineBusyError(RuntimeError):
    """The engine is owned by another way of driving it: the synchronous API (`add_request` / `step`) was called
    while the background loop of `generate_async` runs, or the loop was asked to start while requests added with
    `add_request` are unfinished. Nothing was queued."""


class LLM:
    """An engine ready to generate. Thread-safe: any number of threads may call `generate` and `generate_async` on
    one LLM and each gets its solo output (the synchronous API is serialised by an engine lock; once the background
    loop of `generate_async` runs, `generate` goes through it, batched with the other requests).

    Args:
        engine_dir: a directory written by `build-engine`, or a checkpoint (HF directory, `.gguf` file): built on
            first use into `engine_cache_dir` (default `~/.cache/nextn/engines`), keyed by its content fingerprint
            and the build options, and reused after (`build/engine_cache.py`); a cached engine found damaged when
            it loads (truncated, a flipped bit) is rebuilt with a warning naming its key.
        dtype: engine dtype when building from a checkpoint ("auto", "float32", "bfloat16", "float16").
        quant_config: quantization when building from a checkpoint, TensorRT-LLM's
            `QuantConfig(quant_algo="W8A16" | "W4A16" | "W4A8", group_size=..., exclude_modules=["lm_head"],
            lm_head_quant_algo=..., super_block_size=...)` or the same as a dict (the lm_head is quantized, W8A16 by
            default, unless excluded); None: none; omitted: `{"quant_algo": "auto"}` (W4A16 for a mostly 4-bit GGUF
            on a CPU with nextn's int4 kernels unless `dtype` is float32/float16, else none: `build_engine`).
        speculative_config: a dict or `MTPDecodingConfig` (TensorRT-LLM names, e.g.
            `{"decoding_type": "MTP", "num_nextn_predict_layers": 3}`); None = plain decoding; omitted = what the
            engine was built for.
        extra_llm_api_options: a YAML file of LLM arguments (keyword overrides win).
        device: "cpu" or "cuda"; default: CUDA when available.
        **overrides: other LLM arguments (`max_batch_size`, `max_seq_len`, `kv_cache_config`, ...);
            `tensor_parallel_size=N` starts N − 1 worker processes (or takes the ranks of `torchrun`) and splits the
            model over them, `moe_expert_parallel_size` splits DeepSeek-V3's routed experts (distributed/).
    Raises:
        EngineError: not an engine directory; LlmArgsError: unknown/invalid argument (named); MappingError (an
            LlmArgsError): parallel sizes that do not divide the model's or exceed the machine's CPU cores / GPUs, or
            a second tensor-parallel LLM while one is active in this process — checked before any process starts;
            RankFailure: a worker rank failed to start or load.
    """

    def __init__(self, engine_dir: str | Path, speculative_config: Any = _UNSET,
                 extra_llm_api_options: str | Path | None = None, device: str | None = None,
                 dtype: str = "auto", quant_config: Any = _UNSET, engine_cache_dir: str | Path | None = None,
                 **overrides: Any) -> None:
        from nextn.build.engine_cache import draft_engine_spec, load_through_cache
        from nextn.build.engine_settings import open_checkpoint
        from nextn.build.manifest import EngineManifest

        if quant_config is _UNSET:  # omitted: build_engine's "auto" (W4A16 for a 4-bit GGUF where nextn's kernels run)
            quant_config = {"quant_algo": "auto"}
        quant = quant_config.model_dump() if hasattr(quant_config, "model_dump") else dict(quant_config or {})
        data = load_llm_args_yaml(extra_llm_api_options) if extra_llm_api_options else {}
        if speculative_config is not _UNSET:
            sc = speculative_config.model_dump() if hasattr(speculative_config, "model_dump") else speculative_config
            overrides["speculative_config"] = sc
            data.pop("speculative_config", None)
        self.args: LlmArgs = parse_llm_args(data, **overrides)
        spec_given = "speculative_config" in overrides or "speculative_config" in data
        device = device or ("cuda" if torch.cuda.is_available() else "cpu")

        def load(resolve):  # a checkpoint's engine (and a draft's) from the cache, rebuilt there if found damaged
            engine = resolve(engine_dir, cache_dir=engine_cache_dir, dtype=dtype, quant_algo=quant.get("quant_algo"),
                             group_size=quant.get("group_size"), exclude_modules=quant.get("exclude_modules") or None,
                             lm_head_quant_algo=quant.get("lm_head_quant_algo"),
                             super_block_size=quant.get("super_block_size"))
            manifest = EngineManifest.load(engine)
            spec = self.args.speculative_config if spec_given else default_speculative_config(manifest)
            spec = draft_engine_spec(spec, manifest, resolve)
            # tensor_parallel_size > 1: worker ranks spawned here (or given by torchrun), rank 0's engine drives them
            return start_engine(engine, self.args, spec, device, open_checkpoint)

        self.engine, self._workers = load_through_cache(load)
        if self._workers is not None:
            weakref.finalize(self, self._workers.close)
        self._loop: EngineLoop | None = None
        # The engine lock: held by the synchronous API (a whole synchronous `generate`, each add_request / step /
        # abort_request) and while the background loop starts or stops, so only one caller drives the engine.
        self._lock = threading.RLock()
        self._unclaimed: list[RequestOutput] = []  # add_request outputs finished by a generate: the next step's

    @property
    def tokenizer(self):
        return self.engine.tokenizer

    # What the engine is (read-only views for servers and benchmarks) ------------------------------------
    @property
    def engine_dir(self) -> Path:
        """The engine directory loaded (a checkpoint's engine-cache entry when a checkpoint was given)."""
        return Path(self.engine.engine_dir)

    @property
    def manifest(self):
        """The engine's `EngineManifest` (build/manifest.py): architecture, dtype, source, quantization."""
        return self.engine.manifest

    @property
    def max_seq_len(self) -> int:
        """The most tokens (prompt + generated) one request may hold."""
        return self.engine.max_seq_len

    @property
    def vocab_size(self) -> int:
        """The model's vocabulary size: token ids lie in [0, vocab_size)."""
        return self.engine.cfg.vocab_size

    @property
    def speculative_config(self):
        """The speculative config in force (a `*DecodingConfig`), or None for plain decoding."""
        return self.engine.spec

    @property
    def drafter_name(self) -> str:
        """The drafter's name (e.g. "mtp_eagle", "medusa", "draft_target", "none")."""
        return self.engine.drafter.name

    @property
    def num_draft_tokens(self) -> int:
        """K: the draft tokens proposed per request and step (0 for plain decoding)."""
        return self.engine.drafter.num_draft_tokens

    @property
    def max_draft_depth(self) -> int:
        """The most draft tokens one step can accept: a tree drafter's depth, else K (0 for plain decoding)."""
        return self.engine.drafter.max_draft_depth

    @property
    def eos_ids(self) -> frozenset[int]:
        """The token ids that end a request (the tokenizer's EOS and the model's end-of-turn ids)."""
        return frozenset(self.engine.eos_ids)

    @property
    def device(self) -> torch.device:
        """The device the model runs on."""
        return self.engine.device

    @property
    def max_batch_size(self) -> int:
        """The most requests one step runs (as resolved when the engine loaded)."""
        return self.engine.max_batch_size

    @property
    def tokens_per_block(self) -> int:
        """Tokens per KV block (the KV cache holds `num_kv_blocks` × `tokens_per_block` tokens)."""
        return self.engine.block_size

    @property
    def num_kv_blocks(self) -> int:
        """The KV blocks requests can hold (the null block excluded)."""
        return self.engine.pool.num_blocks - 1

    @property
    def num_free_kv_blocks(self) -> int:
        """The KV blocks free now (a snapshot; cached prefix blocks are counted as free)."""
        return self.engine.pool.num_free

    @property
    def prefix_cache_stats(self):
        """The prefix cache's counters (queries, hits in tokens), or None without block reuse."""
        cache = self.engine.pool.cache
        return cache.stats if cache is not None else None

    @property
    def iteration_log(self) -> list[dict] | None:
        """Per-step records (`kind` "prefill" / "decode", `latency_ms`, ...) while recording, else None; assign
        [] to start recording and None to stop."""
        return self.engine.iteration_log

    @iteration_log.setter
    def iteration_log(self, log: list[dict] | None) -> None:
        self.engine.iteration_log = log

    # Request-level API (in-flight batching driven by the caller: benchmarks, servers) ---------------------
    def add_request(self, prompt: Prompt, sampling_params: SamplingParams | None = None) -> int:
        """Validate and queue one request; it joins the running batch at the next `step()`.

        Returns:
            The request id (the `request_id` of its `RequestOutput`).
        Raises:
            RequestError: a prompt that is empty, of the wrong type (ids must be Python ints), not valid Unicode, too
                long for max_seq_len or the KV cache, or with ids outside the vocabulary; SamplingParams out of range
                for this engine (`RequestSamplingParamsError`, also a `SamplingParamsError`).
            EngineBusyError: the background loop of `generate_async` owns the engine.
        """
        with self._lock:
            self._no_loop("add_request")
            req = self.engine.make_request(prompt, SamplingParams() if sampling_params is None else sampling_params)
            self.engine.add_request(req)
            return req.request_id

    def step(self) -> list[RequestOutput]:
        """Run one engine iteration (schedule → launch → update); the requests it finished.

        A request that makes the step fail finishes with finish_reason "error" (runtime/fault_isolation.py); the
        others continue. Requests added here that a `generate` call (on any thread) finished are returned by the
        next `step()`.

        Raises:
            EngineBusyError: the background loop of `generate_async` owns the engine.
        """
        with self._lock:
            self._no_loop("step")
            finished, self._unclaimed = self._unclaimed, []
            return finished + self._step_finished()

    def _step_finished(self) -> list[RequestOutput]:
        """One engine step (the caller holds the engine lock); the outputs of the requests it finished."""
        try:
            updated = self.engine.step()
        except Exception as e:  # noqa: BLE001 - even the isolation failed: fail everything, stay usable
            updated = fail_all(self.engine, e)
        return [req.to_output() for req in updated if req.finished]

    def abort_request(self, request_id: int) -> RequestOutput | None:
        """Cancel a queued or running request (added with `add_request`); its KV blocks are freed at once.

        Returns:
            Its final output (finish_reason "cancelled", the tokens generated so far), or None when no unfinished
            request has this id.
        Raises:
            EngineBusyError: the background loop of `generate_async` owns the engine.
        """
        with self._lock:
            self._no_loop("abort_request")
            req = self.engine.abort_request(request_id)
            return None if req is None else req.to_output()

    def reset_prefix_cache(self) -> None:
        """Forget every cached KV prefix (vLLM's name): later requests start cold. Blocks in use are unaffected.

        Raises:
            EngineBusyError: the background engine loop owns the engine (call shutdown() first).
        """
        with self._lock:
            self._no_loop("reset_prefix_cache")
            self.engine.pool.reset_prefix_cache()

    # Measurement hooks (perplexity and A/B benchmarks; generated tokens are unchanged) ---------------------
    def prompt_logits(self, token_ids: list[int]) -> torch.Tensor:
        """The target model's logits after each token of `token_ids`, computed alone from position 0 (no drafts,
        no sampling): [len(token_ids), vocab_size] fp32 on `device`, row i scoring the token that follows
        token_ids[:i + 1] (perplexity: the cross-entropy of rows [:-1] against token_ids[1:]). Its KV blocks are
        taken from the pool and returned to it.

        Raises:
            RequestError: empty, longer than max_seq_len or than the free KV cache, or ids outside the vocabulary.
            EngineBusyError: requests are unfinished, or the background loop owns the engine.
            RuntimeError: a tensor-parallel LLM (its model is split over processes).
        """
        with self._lock:
            self._no_loop("prompt_logits")
            self._single_process_and_idle("prompt_logits")
            if not 0 < len(token_ids) <= self.max_seq_len or not all(0 <= t < self.vocab_size for t in token_ids):
                raise RequestError(f"prompt_logits needs 1 to max_seq_len={self.max_seq_len} token ids in "
                                   f"[0, {self.vocab_size}); got {len(token_ids)} ids")
            table: list[int] = []
            if not self.engine.pool.grow(table, len(token_ids)):
                raise RequestError(f"prompt_logits: {len(token_ids)} tokens do not fit the free KV cache")
            try:
                return self.engine.runner.prompt_logits(list(token_ids), table)
            finally:
                self.engine.pool.free(table)

    def compile_decode_step(self, use_artifacts: bool = True) -> None:
        """Compile the decode step with `torch.compile` now, as `torch_compile_config={}` does at load, loading the
        engine's stored compile artifacts (`build-engine --compile_step`) only when `use_artifacts` (False: a
        compile from scratch, what a benchmark of compile time measures). Compilation happens at the next steps.

        Raises:
            RuntimeError: the step is compiled already (`torch_compile_config`, or a previous call), is captured in
                CUDA graphs (set `torch_compile_config` at load instead), or the LLM is tensor-parallel.
            EngineBusyError: requests are unfinished, or the background loop owns the engine.
        """
        from nextn.runtime.compiled_step import compile_decode_fn

        with self._lock:
            self._no_loop("compile_decode_step")
            self._single_process_and_idle("compile_decode_step")
            runner = self.engine.runner
            if getattr(runner.decode_fn, "compiled", None) is not None:
                raise RuntimeError("LLM.compile_decode_step: the decode step is compiled already")
            if self.args.cuda_graph_config is not None and self.device.type == "cuda":
                raise RuntimeError("LLM.compile_decode_step: the decode step is captured in CUDA graphs; set "
                                   "torch_compile_config when creating the LLM instead")
            runner.decode_fn = compile_decode_fn(runner.decode_fn, self.engine_dir if use_artifacts else None,
                                                 self.device)

    def disable_fused_decoder_stack(self) -> None:
        """Run the target's fused decoder layers one op call each instead of all in one `llama_decoder_stack` call
        (bf16 Llama-family engines on a CPU; the A/B of that op, bit for bit the same outputs). No-op elsewhere."""
        with self._lock:
            self.engine.model.fused_stack = None

    def _single_process_and_idle(self, what: str) -> None:
        if self._workers is not None:
            raise RuntimeError(f"LLM.{what}: not available for a tensor-parallel LLM (its model is split over "
                               "processes)")
        if self.has_unfinished_requests:
            raise EngineBusyError(f"LLM.{what}: requests are unfinished; step them to completion or abort them first")

    def _no_loop(self, what: str) -> None:
        if self._loop is not None:
            raise EngineBusyError(f"LLM.{what}: the background engine loop started by generate_async owns the "
                                  "engine; use generate / generate_async / RequestHandle.abort, or call shutdown() "
                                  "first")

    # Asynchronous API (a background engine loop; servers share one engine this way) ----------------------
    def generate_async(self, prompt: Prompt, sampling_params: SamplingParams | None = None,
                       streaming: bool = False) -> RequestHandle:
        """Submit one request to the background engine loop (started on first use) and return at once.

        The returned handle is a future (`result()`, `await aresult()`) and, with `streaming=True`, an iterator of
        per-step outputs (`for out in handle`, `async for out in handle`) whose `outputs[0].token_ids_diff` holds
        the tokens that step accepted; `handle.abort()` cancels the request and frees its KV blocks.

        The first call waits for a synchronous `generate` running on another thread to finish, then starts the loop.

        Raises:
            RequestError: as `add_request` (nothing is queued; other requests keep running).
            EngineBusyError: the loop would start while requests added with `add_request` are unfinished (step
                them to completion or abort them first).
        """
        params = SamplingParams() if sampling_params is None else sampling_params
        while True:
            loop = self._loop
            if loop is None:
                with self._lock:  # one loop, started only while no synchronous caller drives the engine
                    if self._loop is None:
                        if self.engine.scheduler.has_work:
                            raise EngineBusyError("LLM.generate_async: requests added with add_request are "
                                                  "unfinished; step them to completion or abort them first")
                        self._loop = EngineLoop(self.engine)
                    loop = self._loop
            try:
                return loop.submit(prompt, params, streaming)
            except LoopStopped:  # a concurrent shutdown() stopped it: start a fresh loop
                with self._lock:
                    if self._loop is loop:
                        self._loop = None

    def shutdown(self) -> None:
        """Stop the background engine loop (unfinished requests are cancelled) and, for a tensor-parallel LLM,
        release its worker processes and process group (another tensor-parallel LLM can then start in this
        process; this one can no longer step). A single-process LLM's synchronous API works again."""
        with self._lock:
            loop, self._loop = self._loop, None
            if loop is not None:
                loop.shutdown()
            if self._workers is not None:
                self._workers.close()

    @property
    def has_unfinished_requests(self) -> bool:
        """Whether the engine has work, or a finished request's output awaits the next `step()`."""
        return self.engine.has_work or bool(self._unclaimed)

    def generate(self, prompts: Prompt | Sequence[Prompt], sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
                 use_tqdm: bool = False) -> RequestOutput | list[RequestOutput]:
        """Decode every prompt to completion with in-flight batching.

        Args:
            prompts: a string, a token-id list, or a list / tuple of either.
            sampling_params: one for all prompts, or a list / tuple of one per prompt.
        Returns:
            One `RequestOutput` per prompt, in order (a single one for a single prompt), with `SamplingParams.n`
            sequences in `.outputs` (sequence j seeded seed + j; each runs as its own request). A prompt that cannot run
            (empty, of the wrong type, too long, ids outside the vocabulary, SamplingParams out of range) or that
            makes an engine step fail gets finish_reason "error" with the reason in `.outputs[0].error`, and the
            others still run.
        Raises:
            ValueError: a list of SamplingParams whose length differs from the number of prompts.
            EngineBusyError: as `generate_async`, when the loop of another thread's `generate_async` cannot start.
        """
        single = _is_single_prompt(prompts)
        plist: list[Prompt] = [prompts] if single else list(prompts)  # type: ignore[list-item, arg-type]
        params = sampling_params if sampling_params is not None else SamplingParams()
        plist_params: list[SamplingParams] = list(params) if isinstance(params, (list, tuple)) \
            else [params] * len(plist)  # type: ignore[list-item]  # (a lone SamplingParams)
        if len(plist_params) != len(plist):
            raise ValueError(f"got {len(plist_params)} SamplingParams for {len(plist)} prompts")
        owners, expanded = expand_n(plist, plist_params)  # n > 1: one request per sequence
        prompts_n, params_n = [p for p, _ in expanded], [sp for _, sp in expanded]
        outputs = None
        with self._lock:
            if self._loop is None:  # this thread drives the engine; other callers wait for the lock
                outputs = self._generate_here(prompts_n, params_n, use_tqdm)
        if outputs is None:
            outputs = self._generate_through_loop(prompts_n, params_n)  # the loop owns the engine
        outputs = merge_n(owners, outputs, len(plist))
        return outputs[0] if single else outputs

    def _generate_through_loop(self, plist: list[Prompt], plist_params: list[SamplingParams]) -> list[RequestOutput]:
        outputs: list[RequestOutput | None] = [None] * len(plist)
        handles = {}
        try:
            for i, (prompt, sp) in enumerate(zip(plist, plist_params)):
                try:
                    handles[i] = self.generate_async(prompt, sp)
                except RequestError as e:
                    outputs[i] = _rejected(prompt, e)
            for i, handle in handles.items():
                outputs[i] = handle.result()
        finally:  # interrupted: cancel what this call submitted
            for handle in handles.values():
                handle.abort()
        return outputs  # type: ignore[return-value]

    def _generate_here(self, plist: list[Prompt], plist_params: list[SamplingParams],
                       use_tqdm: bool) -> list[RequestOutput]:
        """`generate` on this thread (the caller holds the engine lock): add, step until ours finish."""
        outputs: list[RequestOutput | None] = [None] * len(plist)
        pending = {}
        for i, (prompt, sp) in enumerate(zip(plist, plist_params)):
            try:
                pending[self.add_request(prompt, sp)] = i
            except RequestError as e:
                logger.warning("prompt %d rejected: %s", i, e)
                outputs[i] = _rejected(prompt, e)
        bar = progress_bar(enabled=use_tqdm, total=len(pending), desc="generate")
        try:
            while pending and self.engine.has_work:
                for out in self._step_finished():
                    i = pending.pop(out.request_id, -1)
                    if i < 0:  # queued with add_request: the next step() returns it
                        self._unclaimed.append(out)
                    else:
                        outputs[i] = out
                        bar.update(1)
        finally:  # an exception or KeyboardInterrupt: cancel what this call queued, free its blocks
            for rid, i in pending.items():
                aborted = self.abort_request(rid)
                outputs[i] = aborted or _rejected(plist[i], RuntimeError("the request was lost by the engine"))
            bar.close()
        return outputs  # type: ignore[return-value]


def _is_single_prompt(prompts: Any) -> bool:
    """A str, bytes, or a list / tuple whose first item is a scalar (a token id, valid or not) is one prompt; any
    other list / tuple is a batch; anything else is one (bad) prompt, refused by name by the engine."""
    if isinstance(prompts, (list, tuple)):
        return bool(prompts) and not isinstance(prompts[0], str) and not hasattr(prompts[0], "__len__")
    return True


def _rejected(prompt: Any, error: Exception) -> RequestOutput:
    """The output of a prompt the engine would not take: finish_reason "error" and the reason."""
    ids = list(prompt) if isinstance(prompt, (list, tuple)) else []
    return RequestOutput(-1, prompt if isinstance(prompt, str) else None, ids,
                         [CompletionOutput(finish_reason="error", error=str(error))], finished=True)
