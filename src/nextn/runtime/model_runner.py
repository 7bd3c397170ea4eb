"""The model runner: turns a `StepPlan` into fixed-shape device tensors, launches a step, reads back the results.

It owns the device side: the model, the KV cache tensor, the drafter and its per-request state buffers
(indexed by each request's batch slot: rebuilt for a prefix-cache hit, `Drafter.load_prefix`), and the step in
flight (`InflightStep`). `launch` builds inputs (from the plan, or from the previous step's device outputs:
`decode_inputs`) and runs the step without reading anything back; `read_back` is the one host synchronisation of a
step, done by the engine after launching the next one when the overlap scheduler is on. It reads plans only (no
`Request`), so a tensor-parallel worker rank runs the same runner on the plans rank 0 broadcasts
(distributed/mirror.py).

The overlap scheduler's data flow: step n is launched from step n−1's device-side outputs, before the host has
read step n−1 back (TensorRT-LLM `PyExecutor._executor_loop_overlap`; TensorRT-LLM py_executor.py).

    Engine.step() n:  schedule n (host state lags one step) → launch n → read back and process n−1 → keep n
                      in flight

What lags, and how it is made safe:
- Inputs. A request that ran in step n−1 takes its step-n inputs from `InflightStep`: the last emitted token
  (tokens[b, num_emitted[b] − 1]), the drafts, and kv_len + num_emitted — all gathered on the device, no
  read-back. Requests that did not run in n−1 (joined, or last ran before a prefill step) use host values, which
  are exact. A batch whose composition changed is therefore rebuilt row by row, never synchronised.
- KV blocks. The host's kv_len of a request in flight is short by up to the tokens step n−1 emits (K+1, kept in
  `Progress.num_inflight_tokens`), so the scheduler grows block tables by that much more.
- Finishes. A request that stops at step n−1 has already been launched in step n: step n's tokens for it are
  discarded (it is finished when step n is processed) and its blocks, freed while step n may still write them,
  are only reused by a later step, which runs after step n on the same stream.
- Preemption and aborts by the scheduler need exact host state: the scheduler raises `NeedsSync`, the engine
  processes step n−1 first and schedules again. Cancellation needs none: the in-flight results are dropped.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from nextn.models.attention_metadata import AttentionMetadata, slots_for_positions
from nextn.models.causal_lm import SelfDraftingCausalLM
from nextn.runtime.outputs import TokenLogprob
from nextn.runtime.step_plan import DecodePlan, PrefillPlan, StepPlan
from nextn.speculative.chain_step import NoDrafter, prefill_groups, prefill_step, verify_and_draft_step
from nextn.speculative.protocol import AcceptanceRule, Drafter, SamplingTensors, StepOutput


@dataclass(frozen=True)
class InflightStep:
    """A launched step whose results are still on the device.

    Attributes:
        plan: what was scheduled.
        out: the step's outputs (owned copies: a CUDA-graph replay reuses its static output buffers).
        next_last: [B] int64 each row's last emitted token (prefill: the first token; an earlier chunk: garbage).
        next_kv_lens: [B] int64 each row's KV length after the step (the next decode step's kv_lens).
        rows: request id → row in this batch.
        launch_time: perf_counter seconds when the step was scheduled.
        launch_seconds: seconds its launch took (on a CPU: the step's whole computation; on a GPU: the enqueueing).
    """

    plan: StepPlan
    out: StepOutput
    next_last: torch.Tensor
    next_kv_lens: torch.Tensor
    rows: dict[int, int]
    launch_time: float
    launch_seconds: float = 0.0

    @classmethod
    def create(cls, plan: StepPlan, out: StepOutput, kv_lens: torch.Tensor,
               launch_time: float) -> "InflightStep":
        """From a step's outputs and its input kv_lens [B] (prefill: each chunk's end − 1), on the device."""
        out = StepOutput(out.tokens.clone(), out.num_emitted.clone(), out.draft_tokens.clone(), out.drafter_state,
                         out.accept_state, out.logprobs)
        last = out.tokens.gather(1, (out.num_emitted - 1)[:, None])[:, 0]
        rows = {rid: i for i, rid in enumerate(plan.request_ids)}
        return cls(plan, out, last, kv_lens + out.num_emitted, rows, launch_time,
                   time.perf_counter() - launch_time)

    @property
    def max_emitted(self) -> int:
        """The most tokens a row of this step can emit (host-known: the width of its token output)."""
        return self.out.tokens.shape[1]


def decode_inputs(plan: DecodePlan, prev: InflightStep | None,
                  device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """The decode step's inputs: ids [B, draft_len + 1] = [last emitted, d1..d_draft_len] and kv_lens [B].

    Rows whose request ran in `prev` (not yet read back) are gathered from its device outputs; the others come
    from the host (the plan). Drafts beyond `draft_len` are dropped (draft-length policy).
    """
    draft_len = plan.draft_len
    ids = torch.tensor(plan.input_ids, dtype=torch.int64, device=device).view(plan.num_requests, draft_len + 1)
    kv_lens = torch.tensor(plan.kv_lens, dtype=torch.int64, device=device)
    if prev is None:
        return ids, kv_lens
    rows = prev.rows
    pairs = [(i, rows[rid]) for i, rid in enumerate(plan.request_ids) if rid in rows]
    if not pairs:
        return ids, kv_lens
    dst = torch.tensor([i for i, _ in pairs], dtype=torch.int64, device=device)
    src = torch.tensor([j for _, j in pairs], dtype=torch.int64, device=device)
    dev_ids = torch.cat([prev.next_last[src, None], prev.out.draft_tokens[src, :draft_len]], dim=1)
    return ids.index_copy(0, dst, dev_ids), kv_lens.index_copy(0, dst, prev.next_kv_lens[src])


@dataclass(frozen=True)
class StepResult:
    """Host-side results, one entry per scheduled request (in batch order): what `Scheduler.update_from_output`
    applies to the requests."""

    emitted: list[list[int]]  # tokens each request emits this step (before stop checks); [] for an earlier chunk
    drafts: list[list[int]]  # its drafts for the next step
    num_accepted: list[int]  # drafts the target accepted (decode), 0 for prefill
    draft_len: int = 0  # drafts counted per request (decode statistics: `Drafter.stat_draft_len(draft_len)`)
    logprobs: list[list[TokenLogprob]] | None = None  # per request, one per emitted token (when a request asks)
    seconds: float = 0.0  # the step's own time: its launch (on a CPU all of it) plus waiting for its results


#: The most tokens one pass of a drafter's catch-up runs (`ModelRunner._catch_up`): a prefill chunk's worth.
CATCH_UP_CHUNK = 512


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
            processing=None if plan.processing is None else plan.processing.to(dev),
            num_logprobs=plan.num_logprobs,
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
        self.model.bind_batch_slots(slots)  # a model with recurrent state keeps each row's state by its batch slot
        block_tables = self._block_tables(plan)
        sampling = self._sampling(plan)
        if isinstance(plan, PrefillPlan):
            out, kv_lens = self._prefill(plan, slots, block_tables, sampling)
        else:
            ids, kv_lens = decode_inputs(plan, prev, self.device)
            if plan.catch_up_starts:
                self._catch_up(plan, ids[:, 0], block_tables)
            state = tuple(s[slots] for s in self.state)
            accept_state = tuple(s[slots] for s in self.accept_state)
            drafter = self.drafter if plan.drafting else self.no_drafter  # speculation off: plain decoding
            # each row its own draft length (chain_step.verify_ragged); None: one length
            draft_lens = torch.tensor(plan.draft_lens, dtype=torch.int64, device=self.device) if plan.draft_lens \
                else None
            out = self.decode_fn(self.model, drafter, self.acceptance, self.kv_cache, ids, kv_lens, block_tables,
                                 sampling, state if plan.drafting else (), accept_state, self.block_size,
                                 draft_lens=draft_lens, num_drafts=plan.num_drafts)
        for buf, new in zip(self.state, out.drafter_state):
            buf[slots] = new
        for buf, new in zip(self.accept_state, out.accept_state):
            buf[slots] = new
        return InflightStep.create(plan, out, kv_lens, t0)

    def _catch_up(self, plan: DecodePlan, last_ids: torch.Tensor, block_tables: torch.Tensor) -> None:
        """The drafter's KV for the positions rows missed while speculation was off (`DecodePlan.catch_up_starts`):
        each such row's host tokens then its input token last_ids [B] (device: maybe from the step in flight),
        one row at a time in chunks of at most `CATCH_UP_CHUNK` tokens, so the work is bounded whatever the gap."""
        dev = self.device
        for row, (start, host_ids) in enumerate(zip(plan.catch_up_starts, plan.catch_up_ids)):
            if start < 0:
                continue
            tokens = torch.cat([torch.tensor(host_ids, dtype=torch.int64, device=dev), last_ids[row:row + 1]])
            table = block_tables[row:row + 1]
            for lo in range(0, tokens.numel(), CATCH_UP_CHUNK):
                chunk = tokens[lo:lo + CATCH_UP_CHUNK][None]  # [1, T]
                positions = start + lo + torch.arange(chunk.shape[1], dtype=torch.int64, device=dev)[None]
                meta = AttentionMetadata.create(positions, slots_for_positions(table, positions, self.block_size),
                                                table, self.block_size)
                self.drafter.catch_up(self.kv_cache, meta, chunk)

    def _prefill(self, plan: PrefillPlan, slots: torch.Tensor, block_tables: torch.Tensor,
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
                           draft=plan.drafting,
                           # a model with recurrent state runs every row in one forward (its rows bound to slots)
                           row_groups=None if self.model.has_recurrent_state
                           else prefill_groups([len(s) for s in seqs]))
        return out, starts + lens - 1  # so that kv_lens + num_emitted is the chunk's end

    @torch.inference_mode()
    def prompt_logits(self, token_ids: list[int], block_table: list[int]) -> torch.Tensor:
        """The target's logits [T, vocab] fp32 after each of the T `token_ids`, computed alone from position 0, its
        KV written to the blocks of `block_table` (enough for T tokens, reserved by the caller); no step in flight."""
        dev = self.device
        positions = torch.arange(len(token_ids), dtype=torch.int64, device=dev)[None]  # [1, T]
        tables = torch.tensor([block_table], dtype=torch.int64, device=dev)  # [1, W]
        meta = AttentionMetadata.create(positions, slots_for_positions(tables, positions, self.block_size), tables,
                                        self.block_size)
        self.model.bind_batch_slots(torch.zeros(1, dtype=torch.int64, device=dev))  # idle: slot 0 is free
        hidden = self.model(torch.tensor([token_ids], dtype=torch.int64, device=dev), self.kv_cache, meta)
        return self.model.logits(hidden)[0]  # [T, vocab]

    def read_back(self, step: InflightStep) -> StepResult:
        """The one host synchronisation of a step: its tokens, counts and drafts as lists, and its time."""
        read_start = time.perf_counter()
        out, plan = step.out, step.plan
        tokens, counts, drafts = out.tokens.tolist(), out.num_emitted.tolist(), out.draft_tokens.tolist()
        if isinstance(plan, PrefillPlan):
            emitted = [row[:1] if plan.is_last_chunk(i) else [] for i, row in enumerate(tokens)]
        else:
            emitted = [row[:n] for row, n in zip(tokens, counts)]
        decode = isinstance(plan, DecodePlan)
        return StepResult(
            emitted=emitted,
            logprobs=None if out.logprobs is None else _logprobs(out.logprobs, emitted),
            drafts=drafts,
            num_accepted=[n - 1 for n in counts] if decode else [0] * len(tokens),
            draft_len=self.drafter.stat_draft_len(plan.draft_len if isinstance(plan, DecodePlan) else 0),
            # not launch → now: with the overlap scheduler that would also hold the next step's launch
            seconds=step.launch_seconds + time.perf_counter() - read_start,
        )


def _logprobs(logprobs: tuple[torch.Tensor, ...], emitted: list[list[int]]) -> list[list[TokenLogprob]]:
    """The step's (logprob [B, T], top_logprobs [B, T, k], top_ids [B, T, k]) as `TokenLogprob`s per emitted token."""
    chosen, top_lp, top_ids = (x.tolist() for x in logprobs)
    return [[TokenLogprob(tok, chosen[b][j], list(zip(top_ids[b][j], top_lp[b][j]))) for j, tok in enumerate(row)]
            for b, row in enumerate(emitted)]
