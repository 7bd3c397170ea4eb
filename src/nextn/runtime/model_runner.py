"""The model runner: turns a `StepPlan` into fixed-shape device tensors, launches a step, reads back the results.

It owns the device side: the model, the KV cache tensor, the drafter and its per-request state buffers
(indexed by each request's batch slot: rebuilt for a prefix-cache hit, `Drafter.load_prefix`). `launch` builds
inputs (from the plan, or from the previous step's device outputs: overlap.py) and runs the step without reading
anything back; `read_back` is the one host synchronisation of a step, done by the engine after launching the next
one when the overlap scheduler is on. It reads plans only (no `Request`), so a tensor-parallel worker rank runs the
same runner on the plans rank 0 broadcasts (distributed/mirror.py).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from nextn.models.causal_lm import SelfDraftingCausalLM
from nextn.runtime.overlap import InflightStep, decode_inputs
from nextn.runtime.step_plan import StepPlan
from nextn.speculative.chain_step import NoDrafter, prefill_step, verify_and_draft_step
from nextn.speculative.protocol import AcceptanceRule, Drafter, SamplingTensors, StepOutput


@dataclass(frozen=True)
class StepResult:
    """Host-side results, one entry per scheduled request (in batch order)."""

    emitted: list[list[int]]  # tokens each request emits this step (before stop checks)
    drafts: list[list[int]]  # its drafts for the next step
    num_accepted: list[int]  # drafts the target accepted (decode), 0 for prefill
    num_draft: int = 0  # drafts counted per request (decode statistics: `Drafter.stat_draft_len(draft_len)`)
    seconds: float = 0.0  # the step's own time: its launch (on a CPU all of it) plus waiting for its results


class ModelRunner:
    def __init__(self, model: SelfDraftingCausalLM, drafter: Drafter, acceptance: AcceptanceRule,
                 kv_cache: torch.Tensor, block_size: int, max_batch_size: int,
                 decode_fn: Callable[..., StepOutput] = verify_and_draft_step) -> None:
        self.model = model
        self.drafter = drafter
        self.acceptance = acceptance
        self.kv_cache = kv_cache
        self.block_size = block_size
        self.device = kv_cache.device
        self.decode_fn = decode_fn
        self.no_drafter = NoDrafter()
        dtype = next(model.parameters()).dtype
        self.state = drafter.initial_state(max_batch_size, model.cfg.hidden_size, self.device, dtype)
        self.accept_state = acceptance.initial_state(max_batch_size, self.device)
        #: Called with (plan, whether it continues from `prev`) before each launch: tensor parallelism's rank 0
        #: broadcasts the plan to the other ranks (distributed/mirror.py).
        self.on_launch: Callable[[StepPlan, bool], None] | None = None

    def _sampling(self, plan: StepPlan) -> SamplingTensors:
        dev = self.device
        sampled = [t > 0 for t in plan.temperature]
        return SamplingTensors(
            temperature=torch.tensor(plan.temperature, dtype=torch.float32, device=dev),
            top_k=torch.tensor(plan.top_k, dtype=torch.int64, device=dev),
            top_p=torch.tensor(plan.top_p, dtype=torch.float32, device=dev),
            seed=torch.tensor(plan.seeds, dtype=torch.int64, device=dev),
            any_sampled=any(sampled),
            use_filters=any(s and (k > 0 or p < 1.0) for s, k, p in zip(sampled, plan.top_k, plan.top_p)),
        )

    def _block_tables(self, plan: StepPlan) -> torch.Tensor:
        width = max(len(t) for t in plan.block_tables)
        rows = [t + (0,) * (width - len(t)) for t in plan.block_tables]
        return torch.tensor(rows, dtype=torch.int64, device=self.device)

    @torch.inference_mode()
    def run(self, plan: StepPlan) -> StepResult:
        """Launch one step from host state and read its results back (the synchronous path)."""
        return self.read_back(self.launch(plan))

    @torch.inference_mode()
    def launch(self, plan: StepPlan, prev: InflightStep | None = None) -> InflightStep:
        """Build the step's device inputs and launch it; nothing is read back.

        Args:
            prev: the previous step when it has not been read back (overlap scheduler): the rows of requests that
                ran in it take their inputs from its device outputs.
        """
        t0 = time.perf_counter()
        if self.on_launch is not None:
            self.on_launch(plan, prev is not None)
        slots = torch.tensor(plan.batch_slots, dtype=torch.int64, device=self.device)
        block_tables = self._block_tables(plan)
        sampling = self._sampling(plan)
        if plan.kind == "prefill":
            out, kv_lens = self._prefill(plan, slots, block_tables, sampling)
        else:
            ids, kv_lens = decode_inputs(plan, prev, self.device)
            state = tuple(s[slots] for s in self.state)
            accept_state = tuple(s[slots] for s in self.accept_state)
            drafter = self.drafter if plan.drafting else self.no_drafter  # speculation off: plain decoding
            out = self.decode_fn(self.model, drafter, self.acceptance, self.kv_cache, ids, kv_lens, block_tables,
                                 sampling, state if plan.drafting else (), accept_state, self.block_size)
        for buf, new in zip(self.state, out.drafter_state):
            buf[slots] = new
        for buf, new in zip(self.accept_state, out.accept_state):
            buf[slots] = new
        return InflightStep.create(plan, out, kv_lens, t0)

    def _prefill(self, plan: StepPlan, slots: torch.Tensor, block_tables: torch.Tensor,
                 sampling: SamplingTensors) -> tuple[StepOutput, torch.Tensor]:
        """The prefill step's outputs and its kv_lens [B] (each chunk's end − 1)."""
        dev = self.device
        tokens = [list(t) for t in plan.token_ids]
        for slot, seq, n in zip(plan.batch_slots, tokens, plan.num_reused):
            if n:  # a prefix-cache hit: the drafter's per-request state for the reused tokens (n-gram history)
                self.drafter.load_prefix(self.state, slot, seq[:n])
        seqs = [seq[s:e] for seq, s, e in zip(tokens, plan.chunk_starts, plan.chunk_ends)]
        width = max(len(s) for s in seqs)
        ids = torch.tensor([s + [0] * (width - len(s)) for s in seqs], dtype=torch.int64, device=dev)
        lens = torch.tensor([len(s) for s in seqs], dtype=torch.int64, device=dev)
        starts = torch.tensor(plan.chunk_starts, dtype=torch.int64, device=dev)
        nexts = [-1 if plan.is_last_chunk(i) else seq[e] for i, (seq, e) in enumerate(zip(tokens, plan.chunk_ends))]
        # e.g. inside <think> after the prompt (only the last chunk's state is kept)
        initial = [self.acceptance.prompt_state(seq[:e]) for seq, e in zip(tokens, plan.chunk_ends)]
        accept_state = tuple(torch.tensor(col, dtype=buf.dtype, device=dev)
                             for col, buf in zip(zip(*initial), self.accept_state))
        out = prefill_step(self.model, self.drafter, self.acceptance, self.kv_cache, ids, lens, block_tables,
                           sampling, accept_state, self.block_size, starts,
                           torch.tensor(nexts, dtype=torch.int64, device=dev),
                           drafter_state=tuple(s[slots] for s in self.state),  # e.g. n-gram token history
                           draft=plan.drafting)
        return out, starts + lens - 1  # so that kv_lens + num_emitted is the chunk's end

    def read_back(self, step: InflightStep) -> StepResult:
        """The one host synchronisation of a step: its tokens, counts and drafts as lists, and its time."""
        read_start = time.perf_counter()
        out, plan = step.out, step.plan
        tokens, counts, drafts = out.tokens.tolist(), out.num_emitted.tolist(), out.draft_tokens.tolist()
        if plan.kind == "prefill":
            emitted = [row[:1] if plan.is_last_chunk(i) else [] for i, row in enumerate(tokens)]
        else:
            emitted = [row[:n] for row, n in zip(tokens, counts)]
        return StepResult(
            emitted=emitted,
            drafts=drafts,
            num_accepted=[n - 1 for n in counts] if plan.kind == "decode" else [0] * len(tokens),
            num_draft=self.drafter.stat_draft_len(plan.draft_len),
            # not launch → now: with the overlap scheduler that would also hold the next step's launch
            seconds=step.launch_seconds + time.perf_counter() - read_start,
        )
