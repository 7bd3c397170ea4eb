"""Rank 0 drives, the other ranks mirror: one engine's step on several processes.

Rank 0 owns everything on the host — requests, the scheduler, the prefix cache, the draft-length policy — exactly
as with one process. Each `ModelRunner.launch` on rank 0 first broadcasts a `StepPlan` (the `ScheduledBatch` cut
down to what the runner reads: per row the batch slot, block table, sampling parameters, seed, KV length, drafts
and the tokens the step needs) over the gloo control group. Every other rank (`serve_steps`) rebuilds the batch
from it and calls its own runner's `launch` with the same arguments, so each rank runs the same step function on
its share of the model, its own KV cache (its KV heads) and its own copy of the drafter's per-request state; the
model's collectives (all-reduce, logits all-gather) meet inside the step. Since the gathered logits are the same on
every rank, so are the accepted tokens and drafts: the workers' device state stays in step without ever being read
back. With the overlap scheduler a worker keeps its own previous step on its device for the rows whose inputs
come from it (overlap.py), as rank 0 does. (TensorRT-LLM's LLM API: rank 0's executor broadcasts each iteration's
requests to the MPI workers; vLLM's `broadcast_tensor_dict` of the step inputs.)

What rank 0 decides from timing (the adaptive draft length) or from randomness (seeds) reaches the workers as
values in the plan, so they never diverge.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from types import SimpleNamespace

from nextn.distributed.comm import Communicator
from nextn.runtime.scheduler import ScheduledBatch

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class RowPlan:
    """What the runner reads of one request (`Request` attributes of the same names).

    `token_ids` are the request's tokens from position `token_offset` on: the whole sequence for a prefill row
    (chunks, the next chunk's first token, the prefix-cache hit's tokens), only the last one for a decode row.
    """

    request_id: int
    batch_slot: int
    block_table: tuple[int, ...]
    temperature: float
    top_k: int
    top_p: float
    seed: int
    kv_len: int
    prefill_len: int
    draft_tokens: tuple[int, ...]
    token_ids: tuple[int, ...]


@dataclass(frozen=True)
class StepPlan:
    """One launch: the batch's shape fields, its rows, and whether it continues from the step launched before."""

    kind: str
    rows: tuple[RowPlan, ...]
    chunk_starts: tuple[int, ...]
    chunk_ends: tuple[int, ...]
    num_reused: tuple[int, ...]
    draft_len: int
    drafting: bool
    from_previous: bool


#: Sent instead of a plan when rank 0's engine shuts down.
SHUTDOWN = "shutdown"


def plan_of(batch: ScheduledBatch, from_previous: bool) -> StepPlan:
    rows = []
    for r in batch.requests:
        tokens = r.all_token_ids if batch.kind == "prefill" else r.all_token_ids[-1:]
        p = r.params
        rows.append(RowPlan(r.request_id, r.batch_slot, tuple(r.block_table), p.temperature, p.top_k, p.top_p, r.seed,
                            r.kv_len, r.prefill_len, tuple(r.draft_tokens), tuple(tokens)))
    return StepPlan(batch.kind, tuple(rows), batch.chunk_starts, batch.chunk_ends, batch.num_reused, batch.draft_len,
                    batch.drafting, from_previous)


class _Row(SimpleNamespace):
    """A worker's stand-in for a `Request`: the attributes `ModelRunner.launch` reads, from a `RowPlan`."""

    @classmethod
    def of(cls, row: RowPlan, reuse: "_Row | None") -> "_Row":
        obj = reuse if reuse is not None else cls()
        obj.request_id, obj.batch_slot, obj.block_table = row.request_id, row.batch_slot, list(row.block_table)
        obj.params = SimpleNamespace(temperature=row.temperature, top_k=row.top_k, top_p=row.top_p)
        obj.seed, obj.kv_len, obj.prefill_len = row.seed, row.kv_len, row.prefill_len
        obj.draft_tokens, obj.all_token_ids = list(row.draft_tokens), list(row.token_ids)
        obj.num_tokens = len(row.token_ids)
        return obj


class PlanBroadcaster:
    """Rank 0's `ModelRunner.on_launch`: broadcast each launch's plan; `shutdown` releases the workers."""

    def __init__(self, comm: Communicator) -> None:
        self.comm = comm
        self.closed = False

    def __call__(self, batch: ScheduledBatch, from_previous: bool) -> None:
        self.comm.broadcast_object(plan_of(batch, from_previous))

    def shutdown(self) -> None:
        if not self.closed:
            self.closed = True
            self.comm.broadcast_object(SHUTDOWN)


def serve_steps(engine, comm: Communicator) -> int:
    """A worker rank's loop: launch every step rank 0 plans, until it sends `SHUTDOWN`.

    Args:
        engine: this rank's `Engine` (its scheduler unused).
    Returns:
        The number of steps run.
    Raises:
        RankFailure: rank 0 died or stopped answering (a broadcast or a collective inside the step failed).
    """
    prev = None
    steps = 0
    while True:
        plan = comm.broadcast_object()
        if plan == SHUTDOWN:
            return steps
        before = {r.request_id: r for r in (prev.batch.requests if prev else ())}  # keep identities (overlap.py)
        rows = tuple(_Row.of(row, before.get(row.request_id)) for row in plan.rows)
        batch = ScheduledBatch(plan.kind, rows, plan.chunk_starts, plan.chunk_ends, plan.num_reused,  # type: ignore
                               plan.draft_len, plan.drafting)
        if plan.kind == "prefill":
            for row, n in zip(rows, plan.num_reused):
                if n:  # as Engine._step: the drafter's per-request state for a prefix-cache hit
                    engine.drafter.load_prefix(engine.runner.state, row.batch_slot, row.all_token_ids[:n])
        try:
            prev = engine.runner.launch(batch, prev if plan.from_previous else None)
        except Exception as e:  # noqa: BLE001 - rank 0 fails on the same inputs and isolates the request
            if type(e).__name__ == "RankFailure":
                raise
            logger.warning("rank %d: step failed (%s: %s); rank 0 handles it", comm.mapping.rank,
                           type(e).__name__, e)
            prev = None
        steps += 1
