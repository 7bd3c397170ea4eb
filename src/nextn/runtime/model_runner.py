"""The model runner: turns a `ScheduledBatch` into fixed-shape device tensors, runs a step, reads back the results.

It owns the device side: the model, the KV cache tensor, the drafter and its per-request state buffers
(indexed by each request's batch slot). The one host synchronisation per step is the read-back at the end.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from nextn.models.deepseek_v3.model import DeepseekV3ForCausalLM
from nextn.runtime.acceptance_rules import AcceptanceRule, SamplingTensors
from nextn.runtime.drafters import Drafter
from nextn.runtime.request import Request
from nextn.runtime.scheduler import ScheduledBatch
from nextn.runtime.spec_step import StepOutput, prefill_step, verify_and_draft_step


@dataclass(frozen=True)
class StepResult:
    """Host-side results, one entry per scheduled request (in batch order)."""

    emitted: list[list[int]]  # tokens each request emits this step (before stop checks)
    drafts: list[list[int]]  # its drafts for the next step
    num_accepted: list[int]  # drafts the target accepted (decode), 0 for prefill


class ModelRunner:
    def __init__(self, model: DeepseekV3ForCausalLM, drafter: Drafter, acceptance: AcceptanceRule,
                 kv_cache: torch.Tensor, block_size: int, max_batch_size: int,
                 decode_fn: Callable[..., StepOutput] = verify_and_draft_step) -> None:
        self.model = model
        self.drafter = drafter
        self.acceptance = acceptance
        self.kv_cache = kv_cache
        self.block_size = block_size
        self.device = kv_cache.device
        self.decode_fn = decode_fn
        dtype = next(model.parameters()).dtype
        self.state = drafter.initial_state(max_batch_size, model.cfg.hidden_size, self.device, dtype)
        self.accept_state = acceptance.initial_state(max_batch_size, self.device)

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
        reqs = batch.requests
        slots = torch.tensor([r.batch_slot for r in reqs], dtype=torch.int64, device=self.device)
        block_tables = self._block_tables(batch)
        sampling = self._sampling(reqs)
        if batch.kind == "prefill":
            seqs = [r.all_token_ids for r in reqs]
            width = max(len(s) for s in seqs)
            ids = torch.tensor([s + [0] * (width - len(s)) for s in seqs], dtype=torch.int64, device=self.device)
            lens = torch.tensor([len(s) for s in seqs], dtype=torch.int64, device=self.device)
            initial = [self.acceptance.prompt_state(s) for s in seqs]  # e.g. inside <think> after the prompt
            accept_state = tuple(torch.tensor(col, dtype=buf.dtype, device=self.device)
                                 for col, buf in zip(zip(*initial), self.accept_state))
            out = prefill_step(self.model, self.drafter, self.acceptance, self.kv_cache, ids, lens, block_tables,
                               sampling, accept_state, self.block_size)
        else:
            ids = torch.tensor([[r.all_token_ids[-1], *r.draft_tokens] for r in reqs], dtype=torch.int64,
                               device=self.device)
            kv_lens = torch.tensor([r.kv_len for r in reqs], dtype=torch.int64, device=self.device)
            state = tuple(s[slots] for s in self.state)
            accept_state = tuple(s[slots] for s in self.accept_state)
            out = self.decode_fn(self.model, self.drafter, self.acceptance, self.kv_cache, ids, kv_lens, block_tables,
                                 sampling, state, accept_state, self.block_size)
        for buf, new in zip(self.state, out.drafter_state):
            buf[slots] = new
        for buf, new in zip(self.accept_state, out.accept_state):
            buf[slots] = new
        tokens, counts, drafts = out.tokens.tolist(), out.num_emitted.tolist(), out.draft_tokens.tolist()
        return StepResult(
            emitted=[row[:n] for row, n in zip(tokens, counts)],
            drafts=drafts,
            num_accepted=[n - 1 for n in counts] if batch.kind == "decode" else [0] * len(reqs),
        )
