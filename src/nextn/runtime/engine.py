"""The engine: an engine directory loaded for decoding, and its step loop (schedule → run → postprocess)."""

from __future__ import annotations

import itertools
import logging
import random
import time
from pathlib import Path

import torch
from torch import nn
from safetensors.torch import load_file

from nextn.build.manifest import EngineError, EngineManifest, verify_engine_files
from nextn.config.llm_args import LlmArgs, LlmArgsError, MTPDecodingConfig
from nextn.distributed.mirror import PlanBroadcaster
from nextn.distributed.tensor_parallel import local_kv_config, shard_model
from nextn.models.medusa import MedusaHeads
from nextn.models.registry import MODEL_CLASSES
from nextn.plugins.decoder_layer import install_fused_layers
from nextn.plugins.dense_linear import install_dense_linears
from nextn.plugins.dense_linear import unavailable_reason as dense_linear_unavailable_reason
from nextn.plugins.packed_linear import install_packed_linears
from nextn.plugins.paged_attention import install_paged_attention
from nextn.quantization.linear import install_weight_only_linears
from nextn.runtime.compiled_step import compile_decode_fn
from nextn.runtime.cuda_graph_runner import graph_decode_fn
from nextn.runtime.engine_sizes import check_sizes_against_model, plan_kv_cache
from nextn.runtime.fault_isolation import recover_from_failed_step
from nextn.runtime.kv_cache import BlockPool, allocate_kv_cache
from nextn.runtime.model_runner import ModelRunner
from nextn.runtime.overlap import InflightStep
from nextn.runtime.prefix_cache import PrefixCache
from nextn.runtime.request import Request
from nextn.runtime.request_validation import RequestError, checked_sampling_params, prompt_token_ids
from nextn.runtime.sampling_params import SamplingParams
from nextn.runtime.scheduler import NeedsSync, Scheduler
from nextn.runtime.tokenizer import EngineTokenizer, eos_token_ids
from nextn.speculative import registry
from nextn.speculative.draft_len_policy import choose_draft_len_policy
from nextn.speculative.method import LoadContext
from nextn.speculative.protocol import Drafter

logger = logging.getLogger(__name__)

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}

MEDUSA_PREFIX = "medusa_heads."


def fast_bf16(device: torch.device) -> bool:
    """Whether bf16 matmuls are fast here: CUDA, or a CPU with bf16 instructions (oneDNN's check)."""
    if device.type == "cuda":
        return True
    return device.type == "cpu" and bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())


def prefix_cache_for(args: LlmArgs, manifest: EngineManifest, spec: object, drafter: Drafter,
                     kv_dtype: torch.dtype, block_size: int) -> PrefixCache | None:
    """The prefix cache when `kv_cache_config.enable_block_reuse` is on (None otherwise): keys salted with what
    changes KV content besides the tokens (checkpoint, KV dtype, drafter and K), and the drafter's look-ahead."""
    if not args.kv_cache_config.enable_block_reuse:
        return None
    salt = "|".join([manifest.source.fingerprint, manifest.dtype, str(kv_dtype), drafter.name,
                     str(drafter.num_draft_tokens), repr(spec)])
    return PrefixCache(block_size, salt, drafter.kv_lookahead)



def batch_dependent_attention(model: nn.Module) -> str | None:
    """The first of the target's attention modules that offers nextn's paged CPU kernel but does not run on it
    (PyTorch's attention instead: head_dim % 16 != 0, or off the CPU), whose reductions span the batch's widest
    context; None when every one that offers it does (the kernel computes each query row alone)."""
    layers = tuple(f"model.layers.{i}." for i in range(model.cfg.num_hidden_layers))
    for name, module in model.named_modules():
        if name.startswith(layers) and getattr(module, "paged_attention_kernel", None) is False:
            return name
    return None


def batch_dependent_linear(model: nn.Module) -> str | None:
    """The first of the target's linears (decoder layers and lm_head) whose rows are not computed alone — PyTorch's
    dense or weight-only kernels, oneDNN's packed one — or None when all run on nextn's per-row CPU kernels (then a
    request's greedy tokens do not depend on the batch: docs/RELIABILITY.md, README "Batch invariance")."""
    from nextn.plugins.packed_linear import PackedLinear
    from nextn.quantization.linear import WeightOnlyLinear

    layers = [f"model.layers.{i}." for i in range(model.cfg.num_hidden_layers)]
    for name, module in model.named_modules():
        if not name.startswith(tuple(layers)):
            continue
        if isinstance(module, WeightOnlyLinear) and module.kernel != "nextn":
            return name
        if isinstance(module, (nn.Linear, PackedLinear)):
            return name
    head = getattr(model, "lm_head", None)
    if getattr(model, "lm_head_quantized", False):
        return None if getattr(head, "kernel", None) == "nextn" else "lm_head"
    return None if getattr(model, "dense_lm_head", None) is not None else "lm_head"

class Engine:
    """Loads an engine directory and runs requests to completion with in-flight batching."""

    def __init__(self, engine_dir: str | Path, args: LlmArgs, spec: MTPDecodingConfig | None,
                 device: str | torch.device = "cpu", comm=None) -> None:
        """`comm`: a `distributed.comm.Communicator` when this process is one rank of a tensor-parallel engine
        (its share of the model and KV heads; rank 0 broadcasts each step to the others: distributed/mirror.py)."""
        t0 = time.perf_counter()
        self.comm = comm
        self.engine_dir = Path(engine_dir)
        self.manifest = manifest = EngineManifest.load(engine_dir)
        self.cfg = cfg = manifest.model
        self.device = torch.device(device)
        self.spec = spec
        self.max_batch_size = args.max_batch_size or manifest.build_options.max_batch_size
        self.max_seq_len = args.max_seq_len or manifest.build_options.max_seq_len
        self.block_size = args.kv_cache_config.tokens_per_block
        check_sizes_against_model(args, cfg, manifest.build_options.max_seq_len, self.max_batch_size, self.max_seq_len)
        weights = self._read_weights(args.verify_weights)
        ctx = LoadContext(manifest, self.engine_dir, self.device, self.max_seq_len, self._medusa_heads(weights))
        self.drafter, self.acceptance = registry.build(spec, ctx)  # the method's strategies, chosen once
        k = self.drafter.num_draft_tokens
        # KV positions past max_seq_len a step may touch: K+1 in flight (overlap) + the decode look-ahead 2K+1.
        lookahead = (k + 1) + (2 * k + 1)
        kv_dtype = DTYPES.get(args.kv_cache_config.dtype, DTYPES[manifest.dtype])
        # Checked against the memory there is before the rope table, drafter state and KV cache are allocated.
        kv_cfg = cfg if comm is None else local_kv_config(cfg, comm.mapping)  # a rank caches its KV heads only
        plan = plan_kv_cache(args, kv_cfg, self.device, self.max_batch_size, self.max_seq_len, lookahead, kv_dtype,
                             DTYPES[manifest.dtype], self.drafter)
        self.model = self._load_model(weights, self.max_seq_len + lookahead + self.block_size)
        if self.drafter.uses_draft_head and fast_bf16(self.device):
            self.model.use_bf16_draft_head()  # drafts only propose: a cheaper head cannot change the output
        cut = (getattr(spec, "draft_vocab_size", None), getattr(spec, "draft_token_map", None))
        if self.drafter.uses_draft_head and cut != (None, None):  # MTP's head (a Draft_Target drafter cuts its own)
            self._cut_draft_head(*cut, cfg.vocab_size, comm is not None)
        per_seq, num_blocks = plan.per_seq, plan.num_blocks  # num_blocks counts the null block
        kv = allocate_kv_cache(self.model.num_cache_layers, num_blocks, self.block_size, kv_cfg.kv_cache_dim,
                               kv_dtype, self.device)
        self.pool = BlockPool(num_blocks, self.block_size,
                              prefix_cache_for(args, manifest, spec, self.drafter, kv_dtype, self.block_size))
        self.draft_len_policy = choose_draft_len_policy(spec, k, self.drafter.expected_tokens)
        try:
            self.scheduler = Scheduler(self.pool, self.max_batch_size, args.max_num_tokens, k,
                                       enable_chunked_prefill=args.enable_chunked_prefill,
                                       prefill_overlap=self.drafter.prefill_overlap,
                                       draft_len_policy=self.draft_len_policy,
                                       drafter_kv=self.drafter.kv_in_cache)
        except ValueError as e:
            raise LlmArgsError(str(e)) from e
        self.overlap = not args.disable_overlap_scheduler
        self._inflight: InflightStep | None = None  # launched, not yet processed (overlap scheduler)
        decode_fn = self.drafter.decode_fn  # verify_and_draft_step, or Medusa's tree step
        if args.torch_compile_config is not None:
            decode_fn = compile_decode_fn(decode_fn, self.engine_dir, self.device, args.torch_compile_config, manifest)
        elif manifest.compiled_step is not None:
            logger.info("%s stores torch.compile artifacts; torch_compile_config: {} uses them", engine_dir)
        decode_fn = graph_decode_fn(decode_fn, args.cuda_graph_config, self.device, self.max_batch_size, per_seq)
        self.runner = ModelRunner(self.model, self.drafter, self.acceptance, kv, self.block_size, self.max_batch_size,
                                  decode_fn=decode_fn)
        if comm is not None and comm.mapping.is_driver:
            self.runner.on_launch = PlanBroadcaster(comm)
        try:
            self.tokenizer = EngineTokenizer.load(self.engine_dir, manifest.tokenizer_files)
        except Exception as e:  # transformers raises many kinds for a corrupt tokenizer file
            raise EngineError(f"the tokenizer files {manifest.tokenizer_files} of {engine_dir} cannot be loaded "
                              f"({type(e).__name__}: {e}); rebuild the engine") from e
        self.eos_ids = eos_token_ids(self.engine_dir, cfg.eos_token_id)  # config's + generation_config.json's
        self._ids = itertools.count()
        self._seed_rng = random.Random()  # seeds for requests that give none
        self.print_iter_log = args.print_iter_log
        self.iteration_log: list[dict] | None = None  # set to [] to record one dict per iteration
        logger.info("loaded %s in %.2fs: %s, drafter %s (K=%d), %d KV blocks of %d tokens", engine_dir,
                    time.perf_counter() - t0, manifest.dtype, self.drafter.name, k, num_blocks, self.block_size)

    def _read_weights(self, verify: str) -> dict[str, torch.Tensor]:
        # Presence, sizes, headers and SHA-256 of every listed file, as `verify` (LlmArgs.verify_weights) says.
        verify_engine_files(self.engine_dir, self.manifest, verify)
        weights: dict[str, torch.Tensor] = {}
        for f in self.manifest.weight_files:
            try:
                weights.update(load_file(str(self.engine_dir / f), device=str(self.device)))
            except Exception as e:  # safetensors' own SafetensorError for a corrupt file
                raise EngineError(f"cannot read engine weights {self.engine_dir / f}: {e}; rebuild the engine") from e
        return weights

    def _cut_draft_head(self, size: int | None, token_map: str | None, vocab: int, tensor_parallel: bool) -> None:
        """The drafters' lm_head cut to its hot tokens (`draft_vocab_size`, `draft_token_map`: speculative/draft_vocab.py).

        Raises:
            LlmArgsError: an unreadable token map, or tensor parallelism (the head is split by vocabulary there).
        """
        from nextn.speculative.draft_vocab import resolve_hot_tokens

        if tensor_parallel:
            raise LlmArgsError("draft_vocab_size / draft_token_map are not supported with tensor parallelism (the "
                               "lm_head is split by vocabulary there): drop them")
        try:
            hot = resolve_hot_tokens(self.engine_dir, vocab, size, token_map)
        except ValueError as e:
            raise LlmArgsError(f"draft head: {e}") from e
        if hot is not None:
            self.model.cut_draft_head(hot.to(self.device))
            logger.info("draft head: %d of %d token ids", hot.numel(), vocab)

    def _medusa_heads(self, weights: dict[str, torch.Tensor]) -> MedusaHeads | None:
        """Pop the Medusa heads out of the engine weights (None when the engine has none)."""
        s = self.manifest.speculative
        if s.num_medusa_heads == 0:
            return None
        state = {k.removeprefix(MEDUSA_PREFIX): weights.pop(k) for k in list(weights) if k.startswith(MEDUSA_PREFIX)}
        with torch.device("meta"):
            heads = MedusaHeads(s.num_medusa_heads, s.medusa_num_layers, self.cfg.hidden_size, self.cfg.vocab_size)
        try:
            heads.load_state_dict(state, strict=True, assign=True)
        except RuntimeError as e:
            raise EngineError(f"engine Medusa heads do not match its manifest: {e}") from e
        return heads.eval().requires_grad_(False)

    def _load_model(self, weights: dict[str, torch.Tensor], max_positions: int):
        """The target model (its family from the manifest) with the engine weights, rope table for max_positions."""
        with torch.device("meta"):
            model = MODEL_CLASSES[self.manifest.architecture](self.cfg, max_positions=1)
        if self.manifest.quant_config is not None:
            replaced = install_weight_only_linears(model, weights, self.manifest.quant_config)
            model.lm_head_quantized = "lm_head" in replaced
        if self.comm is not None:
            weights = shard_model(model, weights, self.comm)  # this rank's heads, columns, experts, vocabulary
        try:
            model.load_state_dict(weights, strict=True, assign=True)
        except RuntimeError as e:
            raise EngineError(f"engine weights do not match its manifest: {e}") from e
        model.rope_table = model.rope_table_for(max_positions).to(self.device)
        # the target's dense linears and lm_head on nextn's batch-invariant CPU kernel; the bf16 linears left (MTP
        # layers, which only draft, or every layer where that kernel cannot load) on oneDNN's pre-packed kernel
        install_dense_linears(model)
        install_packed_linears(model)
        install_paged_attention(model)  # nextn's CPU attention kernel where it applies
        install_fused_layers(model)  # W4A16 on the CPU: one op per decoder layer
        varying = batch_dependent_linear(model) or batch_dependent_attention(model)
        self.batch_invariant = varying is None
        if varying is not None:
            why = (f"{self.device.type} kernels pick their reduction order by the batch" if self.device.type != "cpu"
                   else "PyTorch's attention over the batch's widest context (head_dim % 16 != 0)"
                   if varying.endswith("self_attn") else f"nextn's dense CPU kernel: {dense_linear_unavailable_reason()}")
            logger.warning("this %s engine is not batch-invariant here (%s runs outside nextn's per-row kernels: %s): "
                           "a request's greedy tokens may depend on what shares its batch", self.manifest.dtype,
                           varying, why)
        return model.eval().requires_grad_(False)

    # Requests ----------------------------------------------------------------------------------------
    def make_request(self, prompt: str | list[int], params: SamplingParams) -> Request:
        """Validate and tokenize one prompt, and check its SamplingParams against this engine
        (runtime/request_validation.py).

        Raises:
            RequestError: empty prompt or of the wrong type, a text prompt without a tokenizer or not valid Unicode,
                ids outside the vocabulary, a prompt that leaves no room in max_seq_len or the KV cache, or
                SamplingParams out of range for this engine (a `RequestSamplingParamsError`).
        """
        text, ids = prompt_token_ids(prompt, self.tokenizer, self.cfg.vocab_size, self.max_seq_len)
        params = checked_sampling_params(params, self.cfg.vocab_size, self.max_seq_len)
        need = len(ids) + self.scheduler.lookahead
        if need > self.pool.capacity_tokens:
            raise RequestError(f"prompt needs {need} KV slots but the cache holds {self.pool.capacity_tokens}: "
                               "raise kv_cache_config.max_tokens")
        eos = self.eos_ids if params.end_id is None else frozenset([params.end_id])
        seed = params.seed if params.seed is not None else self._seed_rng.getrandbits(63)
        return Request(next(self._ids), text, ids, params, eos, seed=seed)

    def add_request(self, request: Request) -> None:
        self.scheduler.add(request)

    def abort_request(self, request_id: int) -> Request | None:
        """Cancel a waiting or running request between steps: its KV blocks and batch slot are freed at once.

        Returns:
            The request, finished with reason "cancelled" (its tokens so far kept), or None when no unfinished
            request has this id.
        """
        req = self.scheduler.cancel(request_id)
        if req is not None and self.tokenizer is not None and req.params.detokenize:
            req.text = self.tokenizer.decode(req.output_token_ids)
        return req

    @property
    def has_work(self) -> bool:
        return self.scheduler.has_work or self._inflight is not None

    def step(self) -> list[Request]:
        """One engine iteration: schedule → launch → postprocess.

        Synchronous (`disable_overlap_scheduler: true`): the step launched here is read back and processed here.
        Overlap scheduler: this call launches step n from step n−1's device outputs, then processes step n−1
        (read-back, stop checks, detokenization, freeing blocks) and leaves step n in flight (overlap.py).

        Returns:
            The requests this call updated: those that emitted tokens (finished or not) and those the scheduler
            finished with an error; `Request.finished` tells which are done (their blocks are already freed).
            A step that raises fails only the request at fault (runtime/fault_isolation.py): it is returned
            finished with reason "error", the others continue; the engine stays usable.
        """
        running_before = list(self.scheduler.running)
        try:
            return self._step()
        except Exception as e:  # noqa: BLE001 - isolate the request at fault, whatever the cause
            return recover_from_failed_step(self, e, running_before)

    def _step(self) -> list[Request]:
        """`step` without failure isolation."""
        prev, self._inflight = self._inflight, None
        updated: list[Request] = []
        try:
            batch = self.scheduler.schedule(in_flight=prev is not None)
        except NeedsSync:  # preemption needs exact host state: process the step in flight first
            updated += self._process(prev)
            prev = None
            batch = self.scheduler.schedule()
        aborted, self.scheduler.aborted = self.scheduler.aborted, []
        if batch is not None and batch.kind == "prefill":
            for req, n in zip(batch.requests, batch.num_reused):
                if n:  # a prefix-cache hit: the drafter's per-request state for the reused tokens (n-gram history)
                    self.drafter.load_prefix(self.runner.state, req.batch_slot, req.all_token_ids[:n])
        launched = self.runner.launch(batch, prev) if batch is not None else None
        if prev is not None:
            updated += self._process(prev)
        if launched is not None:
            if self.overlap:
                width = launched.out.tokens.shape[1]  # host-known shape: the most tokens a row can emit
                for i, req in enumerate(batch.requests):
                    last = batch.kind == "decode" or batch.is_last_chunk(i)
                    req.num_inflight_tokens = width if last else 0
                self._inflight = launched
            else:
                updated += self._process(launched)
        return aborted + updated

    def _process(self, step: InflightStep) -> list[Request]:
        """Read a launched step back and apply it: append tokens, stop checks, free finished requests' blocks.

        Rows of requests that finished or were cancelled since the step was launched are discarded.
        """
        batch = step.batch
        read_start = time.perf_counter()
        result = self.runner.read_back(step)
        # the step's own time: its launch (all of it on a CPU) plus waiting for its results (a GPU's compute). Not
        # launch → now: with the overlap scheduler that would also hold the next step's launch.
        step_seconds = step.launch_seconds + time.perf_counter() - read_start
        stat_k = self.drafter.stat_draft_len(batch.draft_len)
        updated = []
        num_draft = num_accepted = 0
        per_request: dict[int, int] = {}
        for i, (req, emitted, drafts, accepted) in enumerate(zip(batch.requests, result.emitted, result.drafts,
                                                                 result.num_accepted)):
            req.num_inflight_tokens = 0
            if req.finished:  # finished (or cancelled) before this step ran
                continue
            if not emitted:  # an earlier prefill chunk
                req.num_computed_tokens = batch.chunk_ends[i]
                self.scheduler.cache_blocks(req)
                continue
            if batch.kind == "decode":
                req.record_step(stat_k, accepted)
                num_draft, num_accepted = num_draft + stat_k, num_accepted + accepted
                per_request[req.request_id] = accepted
            req.append(emitted, self.max_seq_len)
            req.draft_tokens = drafts
            req.num_computed_tokens = req.kv_len
            self.scheduler.cache_blocks(req)
            updated.append(req)
        if batch.kind == "decode":  # timed only when the step is plain or fully speculating (not re-priming drafts)
            seconds = step_seconds if batch.drafting == (batch.draft_len > 0) else 0.0
            self.draft_len_policy.observe(num_draft, num_accepted, batch.draft_len, len(batch.requests), seconds,
                                         per_request)
        done = self.scheduler.finish_done()
        for req in done:
            if self.tokenizer is not None and req.params.detokenize:
                req.text = self.tokenizer.decode(req.output_token_ids)
        if self.print_iter_log or self.iteration_log is not None:
            entry = {"kind": batch.kind, "num_requests": len(batch.requests), "num_finished": len(done),
                     "num_emitted": sum(len(e) for e in result.emitted), "free_blocks": self.pool.num_free,
                     "num_waiting": len(self.scheduler.waiting),
                     "latency_ms": (time.perf_counter() - step.launch_time) * 1e3}
            if batch.kind == "decode":
                entry["draft_len"], entry["drafting"] = stat_k, batch.drafting
            else:
                entry["num_prefill_tokens"] = sum(e - s for s, e in zip(batch.chunk_starts, batch.chunk_ends))
                entry["num_reused_tokens"] = sum(batch.num_reused)
                entry["drafting"] = batch.drafting
            if self.pool.cache is not None:  # cumulative, over every admission so far (vLLM's hit rate)
                entry["prefix_cache_hit_rate"] = round(self.pool.cache.stats.hit_rate, 4)
            if self.iteration_log is not None:
                self.iteration_log.append(entry)
            if self.print_iter_log:
                logger.info("iter %s", entry)
        return updated
