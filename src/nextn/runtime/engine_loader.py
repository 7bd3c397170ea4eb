"""Loading an engine directory for decoding: sizes checked, the speculative method's strategies chosen, the target
model loaded (runtime/model_loader.py), the KV cache sized and allocated, the decode step layered (torch.compile,
CUDA graphs), and the scheduler and model runner built over them — the draft-length policy starting, with
`step_profile: auto`, from the engine's measured step times (runtime/step_profiler.py). `Engine`
(runtime/engine.py) runs what this returns.

Tensor parallelism reaches the load only through a `Sharding` (distributed/tensor_parallel.py implements it), so
the engine does not depend on the distributed package.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from pathlib import Path
from collections.abc import Callable
from typing import Any, Protocol

import torch
from torch import nn

from nextn.build.manifest import EngineError, EngineManifest
from pydantic import BaseModel

from nextn.config.llm_args import LlmArgs, LlmArgsError
from nextn.plugins import cpu_kernels
from nextn.plugins.cpu_features import fast_bf16
from nextn.runtime.compiled_step import compile_decode_fn
from nextn.runtime.cuda_graph_runner import captures_graphs, graph_decode_fn
from nextn.runtime.engine_sizes import check_sizes_against_model, check_weights_fit, plan_kv_cache
from nextn.models.kv_cache import allocate_kv_cache
from nextn.runtime.kv_cache import BlockPool
from nextn.runtime.model_loader import load_model, pop_medusa_heads, read_weights
from nextn.runtime.model_runner import ModelRunner
from nextn.runtime.prefix_cache import PrefixCache
from nextn.runtime.scheduler import Scheduler, SchedulerLimits
from nextn.runtime.sliding_blocks import sliding_plan
from nextn.runtime.tokenizer import EngineTokenizer, eos_token_ids
from nextn.speculative import registry
from nextn.runtime.step_profiler import ProfileTarget, step_profile_for
from nextn.speculative.draft_len_policy import DraftLenPolicy, StaticDraftLen
from nextn.speculative.method import LoadContext
from nextn.speculative.protocol import AcceptanceRule, Drafter
from nextn.speculative.traits import DraftKV
from nextn.speculative.setup import SpeculativeSetup, resolve

logger = logging.getLogger(__name__)

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


class Sharding(Protocol):
    """This process's share of a tensor-parallel engine (`distributed.tensor_parallel.TensorParallelSharding`)."""

    def kv_config(self, cfg: Any) -> Any:
        """The model config as this rank's KV cache sees it (its KV heads only)."""

    def shard(self, model: nn.Module, weights: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """This rank's share of `model` (modules replaced on the meta device) and of the engine weights."""


@dataclass
class LoadedEngine:
    """What `load_engine` builds; `Engine` exposes each part under the same name."""

    manifest: EngineManifest
    max_batch_size: int
    max_seq_len: int
    block_size: int
    model: nn.Module
    batch_invariant: bool  # every linear and attention of the target computes each row alone (model_loader.py)
    drafter: Drafter
    acceptance: AcceptanceRule
    setup: SpeculativeSetup  # the drafter's traits and the engine's choices from them, resolved at load
    pool: BlockPool
    scheduler: Scheduler
    runner: ModelRunner
    tokenizer: EngineTokenizer | None
    eos_ids: frozenset[int]  # the model config's EOS and generation_config.json's


def prefix_cache_for(args: LlmArgs, manifest: EngineManifest, spec: object, drafter: Drafter,
                     kv_dtype: torch.dtype, block_size: int, recurrent: bool = False) -> PrefixCache | None:
    """The prefix cache when `kv_cache_config.enable_block_reuse` is on (None otherwise, and for a model with
    recurrent state: `check_recurrent`): keys salted with what changes KV content besides the tokens (checkpoint, KV
    dtype, drafter and K), and the drafter's look-ahead."""
    if not args.kv_cache_config.enable_block_reuse or recurrent:
        return None
    salt = "|".join([manifest.source.fingerprint, manifest.dtype, str(kv_dtype), drafter.name,
                     str(drafter.num_draft_tokens), repr(spec)])
    return PrefixCache(block_size, salt, drafter.traits.key_lookahead)


def check_recurrent(model: nn.Module, args: LlmArgs, drafter: Drafter, sharded: bool) -> None:
    """Refuse, by name, what a model with linear-attention layers (per-request recurrent state: Qwen3.5's Gated
    DeltaNet) cannot run yet: the prefix cache asked for explicitly (by default it is off for such a model: a
    reused prefix would need the state at the block boundary), tree drafters, tensor parallelism, torch.compile.

    Raises:
        LlmArgsError: the setting and what to use instead."""
    if not model.has_recurrent_state:
        return
    what = "this model's linear-attention layers keep a recurrent state per request (Qwen3.5's Gated DeltaNet)"
    kvc = args.kv_cache_config
    if kvc.enable_block_reuse and "enable_block_reuse" in kvc.model_fields_set:
        raise LlmArgsError(f"kv_cache_config.enable_block_reuse: {what}, which the prefix cache does not keep; "
                           "leave it unset or false")
    if drafter.traits.tree:
        raise LlmArgsError(f"{drafter.name} verifies a tree of drafts; {what}, which runs one sequence: use a chain "
                           "method (MTP Eagle, NGram, Suffix, Draft_Target)")
    if sharded:
        raise LlmArgsError(f"tensor parallelism: {what}, which is not split over ranks yet: run one rank")
    if args.torch_compile_config is not None:
        raise LlmArgsError(f"torch_compile_config: {what}, whose step is eager only for now: leave it unset")


def load_engine(engine_dir: str | Path, args: LlmArgs, spec: BaseModel | None, device: torch.device,
                sharding: Sharding | None = None, open_checkpoint: Callable[[Path], Any] | None = None
                ) -> LoadedEngine:
    """Load `engine_dir` for decoding on `device`.

    Args:
        sharding: this rank's share when the process is one rank of a tensor-parallel engine.
        open_checkpoint: a checkpoint reader for the speculative method (`LoadContext.open_checkpoint`).
    Raises:
        EngineError: a missing or corrupt engine file, weights that do not match the manifest, unreadable
            tokenizer files; EngineSizeError: sizes that do not fit the model or the memory; LlmArgsError: settings
            that do not fit this engine or each other.
    """
    t0 = time.perf_counter()
    engine_dir = Path(engine_dir)
    manifest = EngineManifest.load(engine_dir)
    cfg = manifest.model
    max_batch_size = args.max_batch_size or manifest.build_options.max_batch_size
    max_seq_len = args.max_seq_len or manifest.build_options.max_seq_len
    block_size = args.kv_cache_config.tokens_per_block
    check_sizes_against_model(args, cfg, manifest.build_options.max_seq_len, max_batch_size, max_seq_len)
    weight_bytes = sum((engine_dir / f).stat().st_size for f in manifest.weight_files if (engine_dir / f).is_file())
    check_weights_fit(weight_bytes, device)  # the resident size, before any weight is read
    logger.info("reading %.2f GiB of weights from %s", weight_bytes / (1 << 30), engine_dir)
    weights = read_weights(engine_dir, manifest, args.verify_weights, device)
    ctx = LoadContext(manifest, engine_dir, device, max_seq_len, pop_medusa_heads(weights, manifest),
                      tensor_parallel=sharding is not None, open_checkpoint=open_checkpoint)
    drafter, acceptance = registry.build(spec, ctx)  # the method's strategies, chosen once
    k = drafter.num_draft_tokens
    # KV positions past max_seq_len a step may touch: K+1 in flight (overlap) + the decode look-ahead 2K+1.
    lookahead = (k + 1) + (2 * k + 1)
    kv_dtype = DTYPES.get(args.kv_cache_config.dtype, DTYPES[manifest.dtype])
    # Checked against the memory there is before the rope table, drafter state and KV cache are allocated.
    kv_cfg = cfg if sharding is None else sharding.kv_config(cfg)  # a rank caches its KV heads only
    layered = args.torch_compile_config is not None or captures_graphs(args.cuda_graph_config, device)
    sliding = None if sharding is not None else sliding_plan(
        cfg, device, layered, drafter.traits.kv is not DraftKV.NONE, max_batch_size, lookahead, block_size,
        min(max_batch_size * max_seq_len,  # a prefill step's tokens: the budget (a whole prompt unchunked)
            args.max_num_tokens if args.enable_chunked_prefill else max(args.max_num_tokens, max_seq_len)))
    plan = plan_kv_cache(args, kv_cfg, device, max_batch_size, max_seq_len, lookahead, kv_dtype,
                         DTYPES[manifest.dtype], drafter, sliding)
    model, batch_invariant = load_model(manifest, weights, device, max_seq_len + lookahead + block_size,
                                        None if sharding is None else sharding.shard)
    if drafter.traits.draft_head and fast_bf16(device):
        model.use_bf16_draft_head()  # drafts only propose: a cheaper head cannot change the output
    registry.prepare_model(model, spec, ctx)  # what the method changes in the target (MTP: its draft head cut)
    check_recurrent(model, args, drafter, sharding is not None)
    model.allocate_recurrent_state(max_batch_size, k + 1, device)  # no-op without linear-attention layers
    kv = allocate_kv_cache(model.num_cache_layers, plan.num_blocks, block_size, kv_cfg.kv_cache_dim, kv_dtype,
                           device)  # num_blocks counts the null block
    pool = BlockPool(plan.num_blocks, block_size, prefix_cache_for(args, manifest, spec, drafter, kv_dtype,
                                                                   block_size, model.has_recurrent_state))
    if plan.num_sliding_blocks:  # the sliding layers' rows: blocks of their own, bounded by the window
        own = pool.attach_sliding(plan.num_sliding_blocks, cfg.sliding_window or 0)
        own.rows, model.sliding_block_map = cfg.sliding_cache_rows, own.block_map
        logger.info("the %d KV-cache rows of sliding-window layers (window %d) hold %d blocks, not %d",
                    len(cfg.sliding_cache_rows), cfg.sliding_window, plan.num_sliding_blocks, plan.num_blocks)

    decode_fn = drafter.decode_fn  # verify_and_draft_step, or Medusa's tree step
    if args.torch_compile_config is not None:
        decode_fn = compile_decode_fn(decode_fn, engine_dir, device, args.torch_compile_config, manifest)
    elif manifest.compiled_step is not None:
        logger.info("%s stores torch.compile artifacts; torch_compile_config: {} uses them", engine_dir)
    decode_fn = graph_decode_fn(decode_fn, args.cuda_graph_config, device, max_batch_size, plan.per_seq)
    # the engine's speculative choices, made once
    setup = resolve(drafter, acceptance, decode_fn, layered, model.has_recurrent_state)
    types = getattr(cfg, "layer_types", None)
    window = (cfg.sliding_window if types and set(types) == {"sliding_attention"} and not cfg.num_nextn_predict_layers
              else None)  # every KV-cache layer slides: blocks behind the window are released while decoding
    limits = SchedulerLimits(max_batch_size, args.max_num_tokens, args.enable_chunked_prefill, max_seq_len, window)

    def new_scheduler(pool: BlockPool, policy: DraftLenPolicy, proposals: bool = True) -> Scheduler:
        try:
            return Scheduler(pool, limits, setup.schedule if proposals else setup.schedule.without_proposals(),
                             policy)
        except ValueError as e:
            raise LlmArgsError(str(e)) from e

    new_scheduler(pool, StaticDraftLen(k))  # the settings checked before anything runs
    runner = ModelRunner(model, drafter, acceptance, kv, block_size, max_batch_size, decode_fn=setup.decode_fn)
    profile = step_profile_for(spec, args, manifest, engine_dir, device, ProfileTarget(
        runner, new_scheduler, plan.num_blocks, block_size, max_batch_size, max_seq_len, k, cfg.vocab_size,
        setup.schedule.on_demand),
        sharded=sharding is not None)  # the measured step times, when the config asks for them
    scheduler = new_scheduler(pool, setup.draft_len_policy(spec, profile))
    try:
        tokenizer = EngineTokenizer.load(engine_dir, manifest.tokenizer_files)
    except Exception as e:  # transformers raises many kinds for a corrupt tokenizer file
        raise EngineError(f"the tokenizer files {manifest.tokenizer_files} of {engine_dir} cannot be loaded "
                          f"({type(e).__name__}: {e}); rebuild the engine") from e
    eos_ids = eos_token_ids(engine_dir, cfg.eos_token_id)
    logger.info("loaded %s in %.2fs: %s, drafter %s (K=%d), %d KV blocks of %d tokens, CPU kernels %s", engine_dir,
                time.perf_counter() - t0, manifest.dtype, drafter.name, k, plan.num_blocks, block_size,
                _kernels_line() if device.type == "cpu" else "unused")
    return LoadedEngine(manifest, max_batch_size, max_seq_len, block_size, model, batch_invariant, drafter,
                        acceptance, setup, pool, scheduler, runner, tokenizer, eos_ids)


def _kernels_line() -> str:
    """The load log's words on the CPU kernels: the variant and what its int8 linears (W8A16, quantized lm_heads)
    multiply x as — bf16 or int16 — or None when they are off."""
    v = cpu_kernels.variant()
    return f"{v} (int8 linears on {cpu_kernels.ops().int8_linear_activations()} activations)" if v else "None"
