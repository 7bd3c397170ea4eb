"""CUDA graphs of the whole verify-and-draft decode step (target forward, acceptance, every draft forward), one
graph per batch-size bucket, replayed as a drop-in `decode_fn` of `ModelRunner`.

Sources: TensorRT-LLM's PyTorch backend (TensorRT-LLM py_executor.py) for the rules, not the code —
- capture sizes: `tensorrt_llm/llmapi/llm_args.py`, `CudaGraphConfig._generate_cuda_graph_batch_sizes` (when
  `batch_sizes` is null) and `tensorrt_llm/_torch/pyexecutor/model_engine.py`, `_filter_cuda_graph_batch_sizes`
  (sizes above the engine's max batch size are dropped; with padding the cap itself is kept instead);
- padding: `tensorrt_llm/_torch/pyexecutor/cuda_graph_runner.py`, `_round_up_batch_size` (the smallest captured
  size ≥ the batch; none past the largest); without `enable_padding` only an exact size replays;
and nano-vllm's `capture_cudagraph` for the shape (largest bucket first, one shared memory pool, warm-up before
capture; replay = copy into static buffers, pad, replay, slice).

Replay, for B real requests in bucket S ≥ B:
    static[:B] ← inputs; static[B:S] ← pads: ids 0, kv_len 0, block table all 0 (the null block), greedy
    graph[S, variant].replay()
    outputs[:B]   (views of the graph's static outputs, valid until the next call)
Block tables are padded to `max_blocks_per_seq` columns with the null block, so one graph serves every length.
A pad row therefore attends to, and writes, nothing but the null block.

`SamplingTensors` carries two host bools (`any_sampled`, `use_filters`) that pick code paths, so a graph is keyed
by (bucket, any_sampled, use_filters): the first batch of a variant captures every bucket of that variant
(largest first, into the shared pool). Anything a graph cannot serve runs the base step eagerly, and each distinct
reason is logged once.

The capture backend is pluggable: `CudaGraphBackend` (torch.cuda.CUDAGraph) on CUDA, and `EmulatedGraphBackend`,
a CPU stand-in for tests whose replay re-runs the step over the same static buffers and copies the results into
the captured outputs, so the copy-in / pad / slice-out path is exercised exactly as on a GPU.
"""

from __future__ import annotations

import bisect
import logging
import time
from collections.abc import Callable
from typing import Any, Protocol

import torch

from nextn.config.llm_args import CudaGraphConfig
from nextn.speculative.protocol import SamplingTensors
from nextn.speculative.protocol import StepOutput

logger = logging.getLogger(__name__)

DEFAULT_MAX_BATCH_SIZE = 128  # TensorRT-LLM: cuda_graph_config.max_batch_size 0 means 128


# Buckets ----------------------------------------------------------------------------------------------------------
def generate_batch_sizes(max_batch_size: int, enable_padding: bool) -> list[int]:
    """TensorRT-LLM's default capture sizes up to `max_batch_size` (ascending; it is always the last one).

    With padding: 1, 2, 4, the multiples of 8 up to 128, then steps of 64 (128 + 64, ...) while ≤ max_batch_size.
    Without: every size 1..32, 64, 128, then the powers of two from 256 below max_batch_size.
    """
    if max_batch_size < 1:
        raise ValueError(f"max_batch_size must be ≥ 1, got {max_batch_size}")
    if enable_padding:
        sizes = [1, 2, 4, *range(8, 129, 8)]
        while sizes[-1] + 64 <= max_batch_size:
            sizes.append(sizes[-1] + 64)
    else:
        ceil_log2 = (max_batch_size - 1).bit_length()  # ceil(log2(max_batch_size)), exact for integers
        sizes = [*range(1, 33), 64, 128, *(2**i for i in range(8, ceil_log2))]
    sizes = sorted(s for s in set(sizes) if s <= max_batch_size)
    if not sizes or sizes[-1] != max_batch_size:
        sizes.append(max_batch_size)
    return sizes


def capture_batch_sizes(config: CudaGraphConfig, max_batch_size: int) -> list[int]:
    """The batch sizes to capture for an engine running at most `max_batch_size` requests.

    `config.batch_sizes` when given (then `config.max_batch_size`, if set, must equal their maximum), else
    `generate_batch_sizes(config.max_batch_size or 128, enable_padding)`; sizes above `max_batch_size` are
    dropped, and with padding `max_batch_size` itself takes their place (padding to a bigger size was accepted,
    so padding to a smaller one is too). TensorRT-LLM also caps by max_num_tokens // (1 + draft tokens), because
    its decode batches spend the token budget; nextn's decode batches do not (the scheduler bounds only prefill).
    Raises:
        ValueError: a size < 1, or max_batch_size inconsistent with batch_sizes.
    """
    if config.batch_sizes:
        sizes = sorted(set(config.batch_sizes))
        if sizes[0] < 1:
            raise ValueError(f"cuda_graph_config.batch_sizes must be ≥ 1, got {config.batch_sizes}")
        if config.max_batch_size and config.max_batch_size != sizes[-1]:
            raise ValueError(f"cuda_graph_config.max_batch_size={config.max_batch_size} must equal "
                             f"max(batch_sizes)={sizes[-1]} when both are given")
    else:
        sizes = generate_batch_sizes(config.max_batch_size or DEFAULT_MAX_BATCH_SIZE, config.enable_padding)
    kept = [s for s in sizes if s <= max_batch_size]
    if config.enable_padding and len(kept) < len(sizes) and (not kept or kept[-1] != max_batch_size):
        kept.append(max_batch_size)
    return kept


def graph_batch_size(batch: int, sizes: list[int], enable_padding: bool) -> int | None:
    """The captured size a batch of `batch` requests replays at (sizes ascending), or None: run eagerly."""
    if not enable_padding:
        return batch if batch in sizes else None
    i = bisect.bisect_left(sizes, batch)
    return sizes[i] if i < len(sizes) else None


# Capture backends ----------------------------------------------------------------------------------------------------
class Graph(Protocol):
    def replay(self) -> None: ...


class CaptureBackend(Protocol):
    def new_pool(self) -> Any:
        """A memory pool all of this runner's graphs share."""

    def capture(self, fn: Callable[[], StepOutput], pool: Any) -> tuple[Graph, StepOutput]:
        """Warm up and capture `fn` (a step over static buffers); (the graph, its static outputs)."""


class CudaGraphBackend:
    """torch.cuda.CUDAGraph: `num_warmups` eager runs on a side stream (lazy inits, cuBLAS workspaces), then one
    capture into the shared pool (PyTorch's "whole network capture" recipe)."""

    def __init__(self, num_warmups: int = 2) -> None:
        self.num_warmups = num_warmups

    def new_pool(self) -> Any:
        return torch.cuda.graph_pool_handle()

    def capture(self, fn: Callable[[], StepOutput], pool: Any) -> tuple[Graph, StepOutput]:
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(self.num_warmups):
                fn()
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=pool):
            out = fn()
        return graph, out


class EmulatedGraphBackend:
    """For tests on CPU: capture runs the step once over the static buffers and keeps its outputs as the static
    outputs; replay re-runs it over the same buffers and copies the results into those outputs. `captured`
    lists the batch size of every capture, in order."""

    def __init__(self) -> None:
        self.captured: list[int] = []

    def new_pool(self) -> Any:
        return None

    def capture(self, fn: Callable[[], StepOutput], pool: Any) -> tuple[Graph, StepOutput]:
        out = fn()
        self.captured.append(out.tokens.shape[0])
        return _EmulatedGraph(fn, out), out


class _EmulatedGraph:
    def __init__(self, fn: Callable[[], StepOutput], out: StepOutput) -> None:
        self.fn, self.out = fn, out

    def replay(self) -> None:
        for static, new in zip(_tensors(self.out), _tensors(self.fn())):
            if static is not new:
                static.copy_(new)


def _tensors(out: StepOutput) -> list[torch.Tensor]:
    return [out.tokens, out.num_emitted, out.draft_tokens, *out.drafter_state, *out.accept_state]


# Static inputs -----------------------------------------------------------------------------------------------------
class _StaticInputs:
    """Device buffers for the largest bucket; a bucket of size S uses the first S rows."""

    def __init__(self, rows: int, max_blocks: int, input_ids: torch.Tensor, sampling: SamplingTensors,
                 drafter_state: tuple[torch.Tensor, ...], accept_state: tuple[torch.Tensor, ...]) -> None:
        like = lambda t, *shape: torch.zeros(rows, *shape, dtype=t.dtype, device=t.device)  # noqa: E731
        self.input_ids = like(input_ids, input_ids.shape[1])  # [rows, K+1] (a tree: [rows, L])
        self.kv_lens = torch.zeros(rows, dtype=torch.int64, device=input_ids.device)
        self.block_tables = torch.zeros(rows, max_blocks, dtype=torch.int64, device=input_ids.device)
        self.sampling = [like(t) for t in (sampling.temperature, sampling.top_k, sampling.top_p, sampling.seed)]
        self.states = [like(s, *s.shape[1:]) for s in (*drafter_state, *accept_state)]
        self.num_drafter_state = len(drafter_state)
        self.reset()

    def reset(self) -> None:
        """Every row a pad row: ids 0, kv_len 0, null-block tables, greedy, zero states."""
        for t in (self.input_ids, self.kv_lens, self.block_tables, *self.sampling, *self.states):
            t.zero_()
        self.sampling[2].fill_(1.0)  # top_p

    def fits(self, input_ids: torch.Tensor, block_tables: torch.Tensor, states: list[torch.Tensor]) -> str | None:
        """Why these inputs cannot use the buffers (None when they can)."""
        if input_ids.shape[1] != self.input_ids.shape[1]:
            return f"{input_ids.shape[1]} tokens per request, graphs hold {self.input_ids.shape[1]}"
        if block_tables.shape[1] > self.block_tables.shape[1]:
            return f"block tables of {block_tables.shape[1]} blocks exceed max_blocks_per_seq={self.block_tables.shape[1]}"
        if [(s.shape[1:], s.dtype) for s in states] != [(s.shape[1:], s.dtype) for s in self.states]:
            return "drafter/acceptance state shapes differ from the captured ones"
        return None

    def load(self, rows: int, input_ids: torch.Tensor, kv_lens: torch.Tensor, block_tables: torch.Tensor,
             sampling: SamplingTensors, states: list[torch.Tensor]) -> None:
        """Copy B real rows into rows 0..B−1 and make rows B..rows−1 pads."""
        b, width = block_tables.shape
        self.input_ids[:b].copy_(input_ids)
        self.kv_lens[:b].copy_(kv_lens)
        self.block_tables[:rows].zero_()
        self.block_tables[:b, :width].copy_(block_tables)
        new = (sampling.temperature, sampling.top_k, sampling.top_p, sampling.seed)
        for buf, src in zip([*self.sampling, *self.states], [*new, *states]):
            buf[:b].copy_(src)
        if rows > b:
            for t in (self.input_ids, self.kv_lens, self.sampling[0], self.sampling[1], self.sampling[3], *self.states):
                t[b:rows].zero_()
            self.sampling[2][b:rows].fill_(1.0)

    def step_args(self, rows: int, any_sampled: bool, use_filters: bool) -> tuple:
        """(input_ids, kv_lens, block_tables, sampling, drafter_state, accept_state) views of the first `rows`."""
        t, k, p, s = (x[:rows] for x in self.sampling)
        states = tuple(x[:rows] for x in self.states)
        n = self.num_drafter_state
        return (self.input_ids[:rows], self.kv_lens[:rows], self.block_tables[:rows],
                SamplingTensors(t, k, p, s, any_sampled=any_sampled, use_filters=use_filters), states[:n], states[n:])


# The runner ------------------------------------------------------------------------------------------------------
class CudaGraphStep:
    """A `decode_fn` for `ModelRunner` that replays captured graphs of `decode_fn` (the base step:
    `verify_and_draft_step` or `tree_verify_and_draft_step`) and falls back to it eagerly.

    Args:
        decode_fn: the base step.
        config: the `cuda_graph_config` (TensorRT-LLM's `batch_sizes`, `max_batch_size`, `enable_padding`).
        max_batch_size: the engine's max concurrent requests (caps the capture sizes).
        max_blocks_per_seq: columns of the static block tables (the most blocks a request can hold).
        device: where the engine runs.
        backend: the capture backend; None: `CudaGraphBackend` (a CUDA device is then required).
    Raises:
        ValueError: no backend given and `device` is not CUDA; a bad config (see `capture_batch_sizes`).
    """

    def __init__(self, decode_fn: Callable[..., StepOutput], config: CudaGraphConfig, max_batch_size: int,
                 max_blocks_per_seq: int, device: torch.device | str, backend: CaptureBackend | None = None) -> None:
        device = torch.device(device)
        if backend is None:
            if device.type != "cuda":
                raise ValueError(f"CUDA graphs need a CUDA device, not {device}; pass backend=EmulatedGraphBackend() "
                                 "to exercise the runner on CPU")
            backend = CudaGraphBackend()
        self.decode_fn = decode_fn
        self.backend = backend
        self.batch_sizes = capture_batch_sizes(config, max_batch_size)
        self.enable_padding = config.enable_padding
        self.max_blocks_per_seq = max_blocks_per_seq
        self.num_replays = 0  # steps served by a graph
        self.num_eager = 0  # steps run eagerly
        self.num_padded_rows = 0  # pad rows replayed in total
        self._graphs: dict[tuple[int, bool, bool], tuple[Graph, StepOutput]] = {}
        self._failed: set[tuple[bool, bool]] = set()
        self._bound: tuple | None = None  # (model, drafter, acceptance, kv_cache, block_size) the graphs read
        self._static: _StaticInputs | None = None
        self._pool: Any = None
        self._logged: set[str] = set()
        logger.info("CUDA graph batch sizes %s (padding %s, %s)", self.batch_sizes,
                    "on" if self.enable_padding else "off", type(backend).__name__)

    def __call__(self, model, drafter, acceptance, kv_cache: torch.Tensor, input_ids: torch.Tensor,
                 kv_lens: torch.Tensor, block_tables: torch.Tensor, sampling: SamplingTensors,
                 drafter_state: tuple[torch.Tensor, ...], accept_state: tuple[torch.Tensor, ...],
                 block_size: int, draft_lens: torch.Tensor | None = None, num_drafts: int | None = None
                 ) -> StepOutput:
        """The base step's signature and result (outputs are views of static buffers until the next call); a graph
        verifies one draft length and drafts K, so a step with per-row lengths or on-demand drafts runs eagerly."""
        b = input_ids.shape[0]
        bound = (model, drafter, acceptance, kv_cache, block_size)
        states = [*drafter_state, *accept_state]
        rows = graph_batch_size(b, self.batch_sizes, self.enable_padding)
        variant = (sampling.any_sampled, sampling.use_filters)
        reason: str | None
        if sampling.host_work:
            reason = "a request asks for logit processing or log-probabilities (such steps run eagerly)"
        elif draft_lens is not None or num_drafts is not None:
            reason = "the step verifies per-row draft lengths or drafts on demand (such steps run eagerly)"
        elif rows is None:
            reason = f"batch {b} has no captured size ({'above' if self.enable_padding else 'not in'} {self.batch_sizes})"
        elif variant in self._failed:
            reason = f"capture failed for variant any_sampled={variant[0]}, use_filters={variant[1]}"
        elif self._bound is not None and (any(x is not y for x, y in zip(bound[:4], self._bound[:4]))
                                          or block_size != self._bound[4]):
            reason = "model, drafter, acceptance rule, KV cache or block size differs from the captured ones"
        else:
            if self._static is None:
                self._bound = bound
                self._static = _StaticInputs(self.batch_sizes[-1], self.max_blocks_per_seq, input_ids, sampling,
                                             drafter_state, accept_state)
            reason = self._static.fits(input_ids, block_tables, states)
        if reason is None and (rows, *variant) not in self._graphs:
            reason = self._capture_variant(*variant)
        if reason is not None:
            if reason not in self._logged:
                self._logged.add(reason)
                logger.info("decode step runs eagerly: %s", reason)
            self.num_eager += 1
            return self.decode_fn(model, drafter, acceptance, kv_cache, input_ids, kv_lens, block_tables, sampling,
                                  drafter_state, accept_state, block_size, draft_lens=draft_lens,
                                  num_drafts=num_drafts)
        assert rows is not None and self._static is not None  # (a fitting step)
        self._static.load(rows, input_ids, kv_lens, block_tables, sampling, states)
        graph, out = self._graphs[(rows, *variant)]
        graph.replay()
        self.num_replays += 1
        self.num_padded_rows += rows - b
        return StepOutput(out.tokens[:b], out.num_emitted[:b], out.draft_tokens[:b],
                          tuple(s[:b] for s in out.drafter_state), tuple(s[:b] for s in out.accept_state))

    def _capture_variant(self, any_sampled: bool, use_filters: bool) -> str | None:
        """Capture every bucket of one sampling variant, largest first; the reason it failed, or None."""
        assert self._bound is not None and self._static is not None  # bound by the first fitting call
        model, drafter, acceptance, kv_cache, block_size = self._bound
        static = self._static
        static.reset()  # warm-ups and capture then touch only the null block
        if self._pool is None:
            self._pool = self.backend.new_pool()
        for rows in sorted(self.batch_sizes, reverse=True):
            args = static.step_args(rows, any_sampled, use_filters)
            fn = lambda args=args: self.decode_fn(model, drafter, acceptance, kv_cache, *args, block_size)  # noqa: E731
            t0 = time.perf_counter()
            try:
                self._graphs[(rows, any_sampled, use_filters)] = self.backend.capture(fn, self._pool)
            except Exception as e:  # a step the backend cannot capture: this variant stays eager
                self._failed.add((any_sampled, use_filters))
                for key in [k for k in self._graphs if k[1:] == (any_sampled, use_filters)]:
                    del self._graphs[key]
                logger.warning("CUDA graph capture failed (batch %d, any_sampled=%s, use_filters=%s): %s: %s",
                               rows, any_sampled, use_filters, type(e).__name__, e)
                return f"capture failed for variant any_sampled={any_sampled}, use_filters={use_filters}"
            logger.info("captured decode step: batch %d, any_sampled=%s, use_filters=%s, %d tokens per request, "
                        "%.1f ms", rows, any_sampled, use_filters, static.input_ids.shape[1],
                        (time.perf_counter() - t0) * 1e3)
        return None


def captures_graphs(config: CudaGraphConfig | None, device: torch.device) -> bool:
    """Whether `graph_decode_fn` captures the decode step in CUDA graphs: a set config on a CUDA device."""
    return config is not None and torch.device(device).type == "cuda"


def graph_decode_fn(decode_fn: Callable[..., StepOutput], config: CudaGraphConfig | None, device: torch.device,
                    max_batch_size: int, max_blocks_per_seq: int) -> Callable[..., StepOutput]:
    """`decode_fn` wrapped in a `CudaGraphStep` when `config` is set and `device` is CUDA; otherwise `decode_fn`
    (a set config on another device is logged)."""
    if config is None or not captures_graphs(config, device):
        if config is not None:
            logger.warning("cuda_graph_config: CUDA graphs need a CUDA device; decode steps run eagerly on %s", device)
        return decode_fn
    return CudaGraphStep(decode_fn, config, max_batch_size, max_blocks_per_seq, device)
