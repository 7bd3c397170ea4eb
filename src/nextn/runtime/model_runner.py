"""The model runner: turns a `ScheduledBatch` into fixed-shape device tensors, launches a step, reads back the results.

It owns the device side: the model, the KV cache tensor, the drafter and its per-request state buffers
(indexed by each request's batch slot). `launch` builds inputs (from the host, or from the previous step's
device outputs: overlap.py) and runs the step without reading anything back; `read_back` is the one host
synchronisation of a step, done by the engine after launching the next one when the overlap scheduler is on.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from nextn.models.causal_lm import SelfDraftingCausalLM
from nextn.speculative.protocol import AcceptanceRule, SamplingTensors
from nextn.speculative.protocol import Drafter
from nextn.speculative.chain_step import NoDrafter
from nextn.runtime.overlap import InflightStep, decode_inputs
from nextn.runtime.request import Request
from nextn.runtime.scheduler import ScheduledBatch
from nextn.speculative.protocol import StepOutput
from nextn.speculative.chain_step import prefill_step, verify_and_draft_step


@dataclass(frozen=True)
class StepResult:
    """Host-side results, one entry per scheduled request (in batch order)."""

    emitted: list[list[int]]  # tokens each request emits this step (before stop checks)
    drafts: list[list[int]]  # its drafts for the next step
    num_accepted: list[int]  # drafts the target accepted (decode), 0 for prefill


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
        #: Called with (batch, whether it continues from `prev`) before each launch: tensor parallelism's rank 0
        #: broadcasts the step plan to the other ranks (distributed/mirror.py).
        self.on_launch: Callable[[ScheduledBatch, bool], None] | None = None

    def _sampling(self, reqs: tuple[Request, ...]) -> SamplingTensors:
        ps = [r.params for r in reqs]
        sampled = [p.temperature > 0 for p in ps]
        return SamplingTensors(
            temperature=torch.tensor([p.temperature for p in ps], dtype=torch.float32, device=self.device),
            top_k=torch.tensor([p.top_k for p in ps], dtype=torch.int64, device=self.device),
            top_p=torch.tensor([p.top_p for p in ps], dtype=torch.float32, device=self.device),
            seed=torch.tensor([r.seed for r in reqs], dtype=torch.int64, device=self.device),
            any_sampled=any(sampled),
            use_filters=any(s and (p.top_k > 0 or p.top_p < 1.0) for s, p in zip(sampled, ps)),
        )

    def _block_tables(self, batch: ScheduledBatch) -> torch.Tensor:
        width = max(len(r.block_table) for r in batch.requests)
        rows = [r.block_table + [0] * (width - len(r.block_table)) for r in batch.requests]
        return torch.tensor(rows, dtype=torch.int64, device=self.device)

    @torch.inference_mode()
    def run(self, batch: ScheduledBatch) -> StepResult:
        """Launch one step from host state and read its results back (the synchronous path)."""
        return self.read_back(self.launch(batch))

    @torch.inference_mode()
    def launch(self, batch: ScheduledBatch, prev: InflightStep | None = None) -> InflightStep:
        """Build the step's device inputs and launch it; nothing is read back.

        Args:
            prev: the previous step when it has not been read back (overlap scheduler): the rows of requests that
                ran in it take their inputs from its device outputs.
        """
        t0 = time.perf_counter()
        if self.on_launch is not None:
            self.on_launch(batch, prev is not None)
        reqs = batch.requests
        slots = torch.tensor([r.batch_slot for r in reqs], dtype=torch.int64, device=self.device)
        block_tables = self._block_tables(batch)
        sampling = self._sampling(reqs)
        if batch.kind == "prefill":
            seqs = [r.all_token_ids[s:e] for r, s, e in zip(reqs, batch.chunk_starts, batch.chunk_ends)]
            width = max(len(s) for s in seqs)
            ids = torch.tensor([s + [0] * (width - len(s)) for s in seqs], dtype=torch.int64, device=self.device)
            lens = torch.tensor([len(s) for s in seqs], dtype=torch.int64, device=self.device)
            starts = torch.tensor(batch.chunk_starts, dtype=torch.int64, device=self.device)
            nexts = [-1 if batch.is_last_chunk(i) else r.all_token_ids[e]
                     for i, (r, e) in enumerate(zip(reqs, batch.chunk_ends))]
            # e.g. inside <think> after the prompt (only the last chunk's state is kept)
            initial = [self.acceptance.prompt_state(r.all_token_ids[:e]) for r, e in zip(reqs, batch.chunk_ends)]
            accept_state = tuple(torch.tensor(col, dtype=buf.dtype, device=self.device)
                                 for col, buf in zip(zip(*initial), self.accept_state))
            out = prefill_step(self.model, self.drafter, self.acceptance, self.kv_cache, ids, lens, block_tables,
                               sampling, accept_state, self.block_size, starts,
                               torch.tensor(nexts, dtype=torch.int64, device=self.device),
                               drafter_state=tuple(s[slots] for s in self.state),  # e.g. n-gram token history
                               draft=batch.drafting)
            kv_lens = starts + lens - 1  # so that kv_lens + num_emitted is the chunk's end
        else:
            ids, kv_lens = decode_inputs(reqs, batch.draft_len, prev, self.device)
            state = tuple(s[slots] for s in self.state)
            accept_state = tuple(s[slots] for s in self.accept_state)
            drafter = self.drafter if batch.drafting else self.no_drafter  # speculation off: plain decoding
            out = self.decode_fn(self.model, drafter, self.acceptance, self.kv_cache, ids, kv_lens, block_tables,
                                 sampling, state if batch.drafting else (), accept_state, self.block_size)
        for buf, new in zip(self.state, out.drafter_state):
            buf[slots] = new
        for buf, new in zip(self.accept_state, out.accept_state):
            buf[slots] = new
        return InflightStep.create(batch, out, kv_lens, t0)

    def read_back(self, step: InflightStep) -> StepResult:
        """The one host synchronisation of a step: its tokens, counts and drafts as lists."""
        out, batch = step.out, step.batch
        tokens, counts, drafts = out.tokens.tolist(), out.num_emitted.tolist(), out.draft_tokens.tolist()
        if batch.kind == "prefill":
            emitted = [row[:1] if batch.is_last_chunk(i) else [] for i, row in enumerate(tokens)]
        else:
            emitted = [row[:n] for row, n in zip(tokens, counts)]
        return StepResult(
            emitted=emitted,
            drafts=drafts,
            num_accepted=[n - 1 for n in counts] if batch.kind == "decode" else [0] * len(tokens),
        )
