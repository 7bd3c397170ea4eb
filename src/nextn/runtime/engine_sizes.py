"""Engine sizes checked before anything is allocated: against the model, then against the memory there is.

`check_weights_fit` runs before the weights are read: their size (an MoE engine's every expert included) against
the memory available.

`check_sizes_against_model` runs first (before the weights are read): max_seq_len within the model's
max_position_embeddings, the other sizes positive and bounded. `plan_kv_cache` runs after the weights are loaded
and before the rope table, the drafter state and the KV cache are allocated: it computes what they need and
compares it with the memory available (CUDA: `torch.cuda.mem_get_info`; CPU: /proc/meminfo MemAvailable, capped
by a cgroup memory limit) times `kv_cache_config.free_gpu_memory_fraction`. An engine that does not fit is a
named error with both figures and the fix, instead of an allocation the kernel's OOM killer ends.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass
from pathlib import Path

import torch

from nextn.config.llm_args import LlmArgs, LlmArgsError

_GIB = 1 << 30


class EngineSizeError(LlmArgsError):
    """An engine size (max_seq_len, max_batch_size, KV cache) that the model or the machine cannot hold."""


def check_sizes_against_model(args: LlmArgs, model_cfg, build_max_seq_len: int, max_batch_size: int,
                              max_seq_len: int) -> None:
    """max_seq_len ≤ the model's max_position_embeddings (and ≥ 2), every size ≥ 1.

    Raises:
        EngineSizeError: the size named, where it came from (LLM argument or engine build option), and the fix.
    """
    where = "max_seq_len" if args.max_seq_len else "the engine's build option max_seq_len"
    limit = model_cfg.max_position_embeddings
    if max_seq_len > limit:
        built = f" (the engine was built for {build_max_seq_len})" if args.max_seq_len else ""
        raise EngineSizeError(f"{where} = {max_seq_len}{built} exceeds the model's max_position_embeddings {limit} "
                              f"(the positions it was trained for): set max_seq_len to at most {limit} "
                              "(LLM(max_seq_len=...), extra_llm_api_options or --max_seq_len)")
    if max_seq_len < 2:
        raise EngineSizeError(f"{where} = {max_seq_len}: a request needs at least one prompt and one output token")
    if max_batch_size < 1:
        raise EngineSizeError(f"max_batch_size = {max_batch_size} must be ≥ 1")
    spec = args.speculative_config
    topk = getattr(spec, "relaxed_topk", 1)
    if getattr(spec, "use_relaxed_acceptance_for_thinking", False) and topk > model_cfg.vocab_size:
        raise EngineSizeError(f"speculative_config.relaxed_topk = {topk} exceeds the vocabulary size "
                              f"{model_cfg.vocab_size}")


def available_memory(device: torch.device) -> tuple[int, str]:
    """Bytes that can still be allocated on `device`, and where the figure comes from."""
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        return int(free), f"free memory on {device}"
    avail, what = _meminfo_available()
    limit = _cgroup_room()
    if limit is not None and limit < avail:
        return limit, "room under the cgroup memory limit"
    return avail, what


def check_weights_fit(weight_bytes: int, device: torch.device) -> None:
    """The engine's weights (read whole into memory: `weight_bytes`, its weight files' size) against the memory
    available on `device`, before any is read.

    Raises:
        EngineSizeError: they do not fit: both figures, where the second comes from, and the fixes.
    """
    avail, what = available_memory(device)
    if weight_bytes > avail:
        raise EngineSizeError(f"the engine's weights need {weight_bytes / _GIB:.2f} GiB of memory and {what} is "
                              f"{avail / _GIB:.2f} GiB: free memory, or build a smaller format (--quant_algo W4A16 "
                              "or W4A8: about a quarter of bf16)")


def _meminfo_available() -> tuple[int, str]:
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024, "MemAvailable (/proc/meminfo)"
    except (OSError, ValueError, IndexError):
        pass
    try:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE"), "available physical memory"
    except (OSError, ValueError, AttributeError):
        return 1 << 62, "unknown available memory"


def _cgroup_room() -> int | None:
    """limit − usage of this process's cgroup (v2, else v1), or None without a limit."""
    pairs = [("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory.current"),
             ("/sys/fs/cgroup/memory/memory.limit_in_bytes", "/sys/fs/cgroup/memory/memory.usage_in_bytes")]
    for limit_file, usage_file in pairs:
        try:
            limit = Path(limit_file).read_text().strip()
            usage = int(Path(usage_file).read_text().strip())
        except (OSError, ValueError):
            continue
        if limit == "max" or not limit.isdigit() or int(limit) >= 1 << 60:
            return None
        return max(0, int(limit) - usage)
    return None


@dataclass(frozen=True)
class KvCachePlan:
    """What the engine will allocate.

    Attributes:
        per_seq: KV blocks one sequence of max_seq_len (plus look-ahead) needs.
        num_blocks: KV blocks in the cache, the null block included.
        kv_bytes: the KV cache tensor's resident bytes when full (the sliding layers' rows: their blocks only).
        other_bytes: the rope table, the drafter's per-request state buffers and the block pool.
    """

    per_seq: int
    num_blocks: int
    kv_bytes: int
    other_bytes: int
    num_sliding_blocks: int = 0  # blocks of the rows only sliding-window layers read (0: they use the pool's)


def plan_kv_cache(args: LlmArgs, model_cfg, device: torch.device, max_batch_size: int, max_seq_len: int,
                  lookahead: int, kv_dtype: torch.dtype, state_dtype: torch.dtype, drafter,
                  sliding: tuple[int, int] | None = None) -> KvCachePlan:
    """Size the KV cache and check that it, the rope table and the per-request state fit in memory.

    Args:
        sliding: (cache rows only sliding-window layers read, the sliding blocks they need at most) where those rows
            get blocks of their own (`runtime/sliding_blocks.py`), else None.

    Returns:
        The plan (`num_blocks`, `per_seq` for the engine).
    Raises:
        EngineSizeError: it does not fit: what the KV cache would need (and from which sizes), what is available,
            and the settings that fix it (with a `kv_cache_config.max_tokens` that would fit, when one does).
    """
    kvc = args.kv_cache_config
    block = kvc.tokens_per_block
    per_seq = -(-(max_seq_len + lookahead) // block)
    max_tokens = kvc.max_tokens or max_batch_size * per_seq * block
    num_blocks = -(-max_tokens // block) + 1  # + the null block
    num_layers = getattr(model_cfg, "num_cache_layers", None) or (
        model_cfg.num_hidden_layers + getattr(model_cfg, "num_nextn_predict_layers", 0))  # no KV: linear layers
    itemsize = torch.empty((), dtype=kv_dtype).element_size()
    sliding_rows, num_sliding = (0, 0) if sliding is None else (sliding[0], min(sliding[1], num_blocks))
    per_token = (num_layers - sliding_rows) * model_cfg.kv_cache_dim * itemsize  # the rows every position keeps
    sliding_bytes = num_sliding * block * sliding_rows * model_cfg.kv_cache_dim * itemsize
    kv_bytes = num_blocks * block * per_token + sliding_bytes
    rope_dim = getattr(model_cfg, "qk_rope_head_dim", None) or model_cfg.hidden_size // model_cfg.num_attention_heads
    other = (max_seq_len + lookahead + block) * rope_dim * 4 + num_blocks * 64
    other += _state_bytes(drafter, max_batch_size, model_cfg.hidden_size, state_dtype)
    other += recurrent_state_bytes(model_cfg, max_batch_size, drafter.num_draft_tokens + 1)
    avail, what = available_memory(device)
    budget = int(avail * kvc.free_gpu_memory_fraction)
    if kv_bytes + other > budget:
        sized_by = ("kv_cache_config.max_tokens" if kvc.max_tokens else
                    f"max_batch_size {max_batch_size} × max_seq_len {max_seq_len} (+{lookahead} look-ahead)")
        room = budget - other - sliding_bytes
        fit = room // per_token // block * block if room > 0 else 0
        if kvc.max_tokens:
            fix = f"lower kv_cache_config.max_tokens (to at most {fit})" if fit else "lower kv_cache_config.max_tokens"
        else:
            fix = "lower max_seq_len or max_batch_size"
            if fit >= per_seq * block:
                fix += f", or set kv_cache_config.max_tokens to at most {fit} (requests then share it)"
        fix += f", or raise kv_cache_config.free_gpu_memory_fraction (now {kvc.free_gpu_memory_fraction:g})"
        raise EngineSizeError(
            f"the KV cache would need {kv_bytes / _GIB:.2f} GiB ({max_tokens} tokens from {sized_by}; "
            f"{num_layers - sliding_rows} layers × {model_cfg.kv_cache_dim} values × {itemsize} B per token"
            f"{f' + {sliding_rows} sliding-window layers in {num_sliding} blocks' if sliding_rows else ''}) plus "
            f"{other / _GIB:.2f} GiB of rope table, per-request state and block bookkeeping, but {what} is "
            f"{avail / _GIB:.2f} GiB, of which kv_cache_config.free_gpu_memory_fraction allows {budget / _GIB:.2f} GiB: {fix}")
    return KvCachePlan(per_seq, num_blocks, kv_bytes, other, num_sliding)


def recurrent_state_bytes(model_cfg, batch: int, ring: int) -> int:
    """Bytes of the linear-attention layers' per-request state (`models/recurrent_state.py`: per layer and batch
    slot, `ring` float32 conv states and pending updates, one recurrent state); 0 for a model without such layers."""
    from nextn.models.recurrent_state import RecurrentState

    layers = len(getattr(model_cfg, "linear_layers", ()))
    if not layers:
        return 0
    keys = model_cfg.linear_num_key_heads * model_cfg.linear_key_head_dim
    return batch * RecurrentState.bytes_per_slot(
        layers, ring, 2 * keys + model_cfg.linear_num_value_heads * model_cfg.linear_value_head_dim,
        model_cfg.linear_conv_kernel_dim, model_cfg.linear_num_value_heads, model_cfg.linear_key_head_dim,
        model_cfg.linear_value_head_dim)


def _state_bytes(drafter, batch: int, hidden_size: int, dtype: torch.dtype) -> int:
    """Bytes of the drafter's per-request state buffers for `batch` slots (shapes taken on the meta device)."""
    try:
        state = drafter.initial_state(batch, hidden_size, torch.device("meta"), dtype)
        return sum(math.prod(t.shape) * t.element_size() for t in state)
    except Exception:  # noqa: BLE001 - a drafter that cannot build meta tensors: counted as nothing
        return 0
