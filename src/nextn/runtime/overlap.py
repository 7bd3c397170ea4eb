"""The overlap scheduler's data flow: step n is launched from step n−1's device-side outputs, before the host has
read step n−1 back (TensorRT-LLM `PyExecutor._executor_loop_overlap`; REFERENCE.md §7b).

    Engine.step() n:  schedule n (host state lags one step) → launch n → read back and process n−1 → keep n
                      in flight

What lags, and how it is made safe:
- Inputs. A request that ran in step n−1 takes its step-n inputs from `InflightStep`: the last emitted token
  (tokens[b, num_emitted[b] − 1]), the drafts, and kv_len + num_emitted — all gathered on the device, no
  read-back. Requests that did not run in n−1 (joined, or last ran before a prefill step) use host values, which
  are exact. A batch whose composition changed is therefore rebuilt row by row, never synchronised.
- KV blocks. The host's kv_len of a request in flight is short by up to the tokens step n−1 emits (K+1, kept in
  `Request.num_inflight_tokens`), so the scheduler grows block tables by that much more.
- Finishes. A request that stops at step n−1 has already been launched in step n: step n's tokens for it are
  discarded (it is finished when step n is processed) and its blocks, freed while step n may still write them,
  are only reused by a later step, which runs after step n on the same stream.
- Preemption and aborts by the scheduler need exact host state: the scheduler raises `NeedsSync`, the engine
  processes step n−1 first and schedules again. Cancellation needs none: the in-flight results are dropped.
"""

from __future__ import annotations

import time

from dataclasses import dataclass

import torch

from nextn.runtime.step_plan import StepPlan
from nextn.speculative.protocol import StepOutput


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
                         out.accept_state)
        last = out.tokens.gather(1, (out.num_emitted - 1)[:, None])[:, 0]
        rows = {rid: i for i, rid in enumerate(plan.request_ids)}
        return cls(plan, out, last, kv_lens + out.num_emitted, rows, launch_time,
                   time.perf_counter() - launch_time)

    @property
    def max_emitted(self) -> int:
        """The most tokens a row of this step can emit (host-known: the width of its token output)."""
        return self.out.tokens.shape[1]


def decode_inputs(plan: StepPlan, prev: InflightStep | None,
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
