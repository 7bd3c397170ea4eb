"""The scheduler: which requests run in the next step, and their KV blocks.

Policy (nano-vllm's, extended for drafts): prefill first — admit waiting requests while batch slots, KV blocks
and the token budget allow; otherwise decode every running request. Each decode step needs KV room for the
K+1 verified tokens and the drafter's K−1 look-ahead tokens; when blocks run out the most recently admitted
request is preempted (blocks freed, re-prefilled later over prompt + output: nothing is lost).
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass
from typing import Literal

from nextn.runtime.kv_cache import BlockPool
from nextn.runtime.request import Request, RequestStatus


@dataclass(frozen=True)
class ScheduledBatch:
    """The scheduler → runner contract for one step."""

    kind: Literal["prefill", "decode"]
    requests: tuple[Request, ...]


class Scheduler:
    def __init__(self, pool: BlockPool, max_batch_size: int, max_num_tokens: int, num_draft_tokens: int) -> None:
        self.pool = pool
        self.max_batch_size = max_batch_size
        self.max_num_tokens = max_num_tokens
        self.lookahead = 2 * num_draft_tokens + 1  # KV positions past kv_len a decode step may touch
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self._free_slots = list(range(max_batch_size - 1, -1, -1))
        self.num_preemptions = 0
        self.aborted: list[Request] = []  # finished with an error by the scheduler, for the engine to report

    def add(self, request: Request) -> None:
        self.waiting.append(request)

    @property
    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self) -> ScheduledBatch | None:
        admitted: list[Request] = []
        budget = self.max_num_tokens
        while self.waiting and len(self.running) + len(admitted) < self.max_batch_size:
            req = self.waiting[0]
            if admitted and req.num_tokens > budget:
                break
            if not self.pool.grow(req.block_table, req.num_tokens + self.lookahead):
                if not self.running and not admitted:  # alone and still too big: it can never run
                    self._abort(self.waiting.popleft())
                    continue
                break
            self.waiting.popleft()
            req.status = RequestStatus.RUNNING
            req.batch_slot = self._free_slots.pop()
            budget -= req.num_tokens
            admitted.append(req)
        if admitted:
            self.running.extend(admitted)
            return ScheduledBatch("prefill", tuple(admitted))
        if not self.running:
            return None
        for req in list(self.running):
            while req in self.running and not self.pool.grow(req.block_table, req.kv_len + self.lookahead):
                if len(self.running) == 1:  # nothing left to preempt: the cache cannot hold this sequence
                    self._release(req)
                    self._abort(req)
                else:
                    self._preempt(self.running[-1])
        return ScheduledBatch("decode", tuple(self.running)) if self.running else None

    def cancel(self, request_id: int) -> Request | None:
        """Remove a waiting or running request, free its KV blocks and batch slot, finish it "cancelled".

        Returns:
            The request, or None when no unfinished request has this id (already finished or unknown).
        """
        for req in self.waiting:
            if req.request_id == request_id:
                self.waiting.remove(req)
                self.pool.free(req.block_table)
                break
        else:
            req = next((r for r in self.running if r.request_id == request_id), None)
            if req is None:
                return None
            self._release(req)
        req.finish("cancelled")
        return req

    def _abort(self, req: Request) -> None:
        self.pool.free(req.block_table)
        req.finish("error", f"the KV cache ({self.pool.capacity_tokens} tokens) cannot hold this sequence at "
                            f"{req.num_tokens} tokens plus {self.lookahead} of look-ahead; raise "
                            "kv_cache_config.max_tokens or lower max_tokens / max_seq_len")
        self.aborted.append(req)

    def _preempt(self, req: Request) -> None:
        self._release(req)
        req.status = RequestStatus.WAITING
        req.draft_tokens = []
        self.waiting.appendleft(req)
        self.num_preemptions += 1

    def _release(self, req: Request) -> None:
        self.pool.free(req.block_table)
        self.running.remove(req)
        self._free_slots.append(req.batch_slot)
        req.batch_slot = -1

    def finish_done(self) -> list[Request]:
        """Release the finished requests' blocks and slots; return them."""
        done = [r for r in self.running if r.finished]
        for req in done:
            self._release(req)
        return done
