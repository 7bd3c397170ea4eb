"""The scheduler: which requests run in the next step, and their KV blocks.

Policy (nano-vllm's, extended for drafts, chunked prefill and the overlap scheduler): requests join and leave
between steps (in-flight batching). A step is either a prefill step — prompt chunks under the token budget
`max_num_tokens`: first the next chunks of requests already being prefilled, then newly admitted requests while
batch slots and KV blocks allow — or a decode step over every request whose prefill is scheduled. The two
alternate while both have work, so a long (chunked) prompt delays the running requests by one chunk at a time.

Why alternate instead of mixing prefill chunks into the decode step (TensorRT-LLM's mixed batches): the decode
step is one fixed-shape function of [B, K+1] tokens, captured in a CUDA graph and compiled whole; ragged prefill
rows would give every step a new shape. Alternating keeps both steps pure, and the token budget still bounds
each prefill step, so a decode step never waits behind more than one chunk.

KV blocks: admission reserves the whole prompt plus the look-ahead (a request that does not fit waits). A decode
step needs room for the K+1 verified tokens and the drafter's K−1 look-ahead past kv_len, plus — with the overlap
scheduler — the tokens the step still in flight may emit (`Progress.num_inflight_tokens`). When blocks run out the
most recently admitted request is preempted (blocks freed, re-prefilled later over prompt + output: nothing is
lost); with a step in flight the scheduler first asks for a sync (`NeedsSync`) so that it decides on exact state.
Where the pool has sliding blocks (runtime/sliding_blocks.py) each step's window gets them at planning, like blocks,
and gives them back as the window moves past (after each processed step).

Prefix caching (runtime/prefix_cache.py, when the pool has a cache): admission looks the request's full blocks up
by their keys and shares the longest cached run; its first chunk starts after it, so only the rest is computed
(and counted against the token budget). The reuse stops short of the prompt's end: at least the last
`1 + rerun_rows` positions are computed (the first token's logits; MTP Vanilla's window of K+1 target hidden
states). After each processed step `cache_blocks` registers the request's blocks that have become final; a shared
block is never written again: every later write of a request lands at or past its computed length minus the
drafter's rewrite lag, and reuse starts no lower than that.
"""

from __future__ import annotations

import sys
from collections import deque
from dataclasses import dataclass
from typing import TYPE_CHECKING

from nextn.runtime.kv_cache import BlockPool
from nextn.runtime.request import Request, RequestStatus
from nextn.runtime.step_plan import DecodePlan, PrefillPlan, StepPlan
from nextn.speculative.draft_len_policy import DraftLenPolicy, StaticDraftLen
from nextn.speculative.setup import DraftSchedule
from nextn.speculative.traits import DraftKV

if TYPE_CHECKING:  # the runner's host results: only their type is read here
    from nextn.runtime.model_runner import StepResult


class NeedsSync(Exception):
    """The next decision (preemption, or an abort for lack of KV) needs the in-flight step's results first."""


@dataclass(frozen=True)
class SchedulerLimits:
    """The engine's sizes the scheduler plans within.

    Attributes:
        max_batch_size: most running requests (batch slots).
        max_num_tokens: token budget of a prefill step.
        enable_chunked_prefill: split prompts over several prefill steps under the budget.
        max_seq_len: a request ends ("length") at this many tokens (None: only its max_tokens ends it).
        kv_window: keys any query attends to at most — the sliding window of a model whose every KV-cache layer
            slides (Mistral 7B v0.1, Phi-3-mini-4k) — or None. With it, a decoding request's blocks wholly behind the
            window go back to the pool (its table holds the null block there), so its memory stays bounded by the
            window; not while the drafter keeps KV of its own (it may attend further back).
    """

    max_batch_size: int
    max_num_tokens: int
    enable_chunked_prefill: bool = False
    max_seq_len: int | None = None
    kv_window: int | None = None


class Scheduler:
    """
    Args:
        pool: the KV block pool.
        limits: batch slots, prefill token budget, chunked prefill, longest request (`SchedulerLimits`).
        schedule: what the speculative setup asks of the scheduler (`speculative.setup.DraftSchedule`: K, the
            rows a prefill chunk re-runs, the drafter's KV kind, on-demand drafts, the drafter's proposals); the
            default: plain decoding.
        draft_len_policy: the per-batch draft length (default: always K).
    Raises:
        ValueError: chunked prefill with a budget that cannot make progress past the rows a chunk re-runs.
    """

    def __init__(self, pool: BlockPool, limits: SchedulerLimits, schedule: DraftSchedule = DraftSchedule(),
                 draft_len_policy: DraftLenPolicy | None = None) -> None:
        if limits.enable_chunked_prefill and limits.max_num_tokens <= schedule.rerun_rows:
            raise ValueError(f"max_num_tokens={limits.max_num_tokens} must exceed the {schedule.rerun_rows} rows a "
                             "prefill chunk re-runs for MTP Vanilla")
        self.pool = pool
        self.draft_schedule = schedule
        self.max_batch_size = limits.max_batch_size
        self.max_num_tokens = limits.max_num_tokens
        self.num_draft_tokens = k = schedule.num_draft_tokens
        self.lookahead = 2 * k + 1  # KV positions past kv_len a decode step may touch
        self.enable_chunked_prefill = limits.enable_chunked_prefill
        self.draft_len_policy = draft_len_policy or StaticDraftLen(k)
        # the drafter keeps KV that a step with speculation off leaves unwritten; and writes such a gap later
        self._drafter_keeps_kv = schedule.kv is not DraftKV.NONE
        self._drafter_writes_later = schedule.kv is DraftKV.FROM_TOKENS
        self.max_seq_len = sys.maxsize if limits.max_seq_len is None else limits.max_seq_len
        self.kv_window = None if self._drafter_keeps_kv else limits.kv_window
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self._free_slots = list(range(limits.max_batch_size - 1, -1, -1))
        self._last_kind: str | None = None
        self.num_preemptions = 0
        self.aborted: list[Request] = []  # finished with an error by the scheduler, for the engine to report
        self._num_plans = 0
        self._scheduled: dict[int, tuple[Request, ...]] = {}  # step id → its requests, until its output is applied

    def add(self, request: Request) -> None:
        self.waiting.append(request)

    @property
    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self, in_flight: bool = False) -> StepPlan | None:
        """The next step's plan, or None when nothing can run.

        Args:
            in_flight: a launched step has not been processed yet (overlap scheduler): host state lags.
        Raises:
            NeedsSync: only with `in_flight`, when the decode step would have to preempt or abort.
        """
        prefill, decode = self._schedule_prefill, lambda: self._schedule_decode(in_flight)
        for attempt in ((decode, prefill) if self._last_kind == "prefill" else (prefill, decode)):
            plan = attempt()
            if plan is not None:
                self._last_kind = plan.kind
                return plan
        self._last_kind = None
        return None

    def _new_plan(self, reqs: tuple[Request, ...], make, *args) -> StepPlan:
        """`make(step_id, reqs, *args)`, its requests kept until `update_from_output`."""
        self._num_plans += 1
        self._scheduled[self._num_plans] = reqs
        return make(self._num_plans, reqs, *args)

    def requests_of(self, plan: StepPlan) -> tuple[Request, ...]:
        """The requests of a plan not yet applied (`update_from_output`), in row order."""
        return self._scheduled[plan.step_id]

    def forget_scheduled(self) -> None:
        """Drop the plans not yet applied: their steps were lost (failure isolation, runtime/fault_isolation.py)."""
        self._scheduled.clear()

    def restart_alternation(self) -> None:
        """The next `schedule` tries a prefill first, as after an idle step."""
        self._last_kind = None

    def _schedule_prefill(self) -> StepPlan | None:
        budget = self.max_num_tokens
        chunks: list[tuple[Request, int, int, int]] = []  # (request, start, end, reused)
        for req in self.running:  # the next chunks of prompts being prefilled, oldest first
            if req.is_decoding or budget <= 0:
                continue
            start = max(0, req.progress.num_prefilled_tokens - self.draft_schedule.rerun_rows)
            end = min(req.progress.prefill_len, start + budget)
            if end <= req.progress.num_prefilled_tokens or not self._sliding_room(req, start, end):
                break
            chunks.append((req, start, end, 0))
            budget -= end - start
        while self.waiting and budget > 0 and len(self.running) < self.max_batch_size:
            req = self.waiting[0]
            n = req.num_tokens
            hits, missing = self._prefix_hits(req)
            reused = len(hits) * self.pool.block_size
            if chunks and not self.enable_chunked_prefill and n - reused > budget:
                break
            end = min(n, reused + budget) if self.enable_chunked_prefill else n
            if not self.pool.admit(req.block_table, hits, n + self.lookahead) or not self._sliding_room(req, reused,
                                                                                                     end):
                self.pool.free(req.block_table)
                if not self.running:  # alone and still too big: it can never run
                    self._abort(self.waiting.popleft())
                    continue
                break
            self.waiting.popleft()
            req.status = RequestStatus.RUNNING
            req.batch_slot = self._free_slots.pop()
            req.progress.prefill_len, req.progress.num_prefilled_tokens = n, reused
            req.progress.num_computed_tokens, req.progress.num_committed_blocks = reused, len(hits)
            if self.pool.cache is not None:
                self.pool.cache.record_query(n, reused)
            if req.num_cached_tokens < 0:
                req.num_cached_tokens = reused
            if missing is not None:  # reused blocks without the draft model's KV: it catches them up first
                gap = missing * self.pool.block_size
                known = req.progress.drafter_gap
                req.progress.drafter_gap = gap if known is None else min(known, gap)
            self.running.append(req)
            chunks.append((req, reused, end, reused))
            budget -= end - reused
        if not chunks:
            return None
        drafting = self.draft_len_policy.max_draft_len == 0 or self.draft_len_policy.would_draft(len(self.running))
        if self._drafter_writes_later and any(r.progress.drafter_gap is not None for r, *_ in chunks):
            drafting = False  # an earlier chunk skipped the drafter: its first decode step catches the whole gap up
        for req, start, end, _ in chunks:
            req.progress.num_prefilled_tokens = end
            req.progress.num_drafts = self.num_draft_tokens if drafting else 0
            if not drafting and self._drafter_writes_later and req.progress.drafter_gap is None:
                req.progress.drafter_gap = start  # the drafter skips this prefill (its KV is written later)
        reqs, starts, ends, num_reused = zip(*chunks)
        return self._new_plan(reqs, PrefillPlan.build, starts, ends, num_reused, drafting)

    def admit_prefilled(self, req: Request) -> bool:
        """Admit a request whose prompt was prefilled by another engine (disaggregated serving,
        distributed/disaggregated.py): a batch slot and blocks for its `num_tokens` plus the look-ahead, its prefill
        marked done; the caller writes its KV and appends its first token. False (no change) when no slot or blocks
        are free."""
        n = req.num_tokens
        if len(self.running) >= self.max_batch_size or not self.pool.admit(req.block_table, [], n + self.lookahead):
            return False
        if not self._sliding_room(req, n, n + self.lookahead):  # the window before its first decode query
            self.pool.free(req.block_table)
            return False
        req.status = RequestStatus.RUNNING
        req.batch_slot = self._free_slots.pop()
        req.progress.prefill_len = req.progress.num_prefilled_tokens = req.progress.num_computed_tokens = n
        req.progress.num_drafts = self.num_draft_tokens  # (the context side's prefill drafted K)
        self.running.append(req)
        return True

    def _prefix_hits(self, req: Request) -> tuple[list[int], int | None]:
        """The cached blocks of the longest prefix of `req`'s tokens (none without a prefix cache), and the index
        of the first of them lacking the drafter's KV (None: none lacks it).

        At most the blocks that leave the last `1 + rerun_rows` positions to compute: the first token needs
        the last position's logits, and MTP Vanilla's pools need the target's hidden states of the last K+1. Past a
        block lacking the drafter's KV, only blocks lacking it too: the drafter catches up everything from the
        first (`drafter_gap`), and must not rewrite a shared block whose drafter KV others read.
        """
        cache = self.pool.cache
        if cache is None:
            return [], None
        n = req.num_tokens
        most = min((n - 1 - self.draft_schedule.rerun_rows) // self.pool.block_size, cache.num_keyed_blocks(n))
        if most <= 0:
            return [], None
        hits = cache.lookup(cache.extend_hashes(req.block_hashes, req.all_token_ids, most)[:most])
        if self.pool.sliding is not None:  # and the sliding layers' KV of the window before the first computed token
            hits = hits[:self.pool.sliding.hit_len(hits)]
        missing = next((i for i, b in enumerate(hits) if cache.lacks_drafter_kv(b)), None)
        if missing is not None:
            end = missing
            while end < len(hits) and cache.lacks_drafter_kv(hits[end]):
                end += 1
            hits = hits[:end]
        return hits, missing

    def cache_blocks(self, req: Request) -> int:
        """Register `req`'s blocks whose every KV row is final in the prefix cache (after a processed step).

        Final: below its computed length minus the drafter's rewrite lag (`rerun_rows`: MTP Vanilla re-runs
        its modules over the last K positions), below the first position decoded without the drafter (its KV
        there was never written), and with the look-ahead tokens of the block's key known. A drafter that catches
        up (a draft model) is not waited for: blocks past that position are registered for their target KV, marked
        as lacking the drafter's (`PrefixCache.register`), so a request prefilled while speculation is off still
        shares its prefix.

        Returns:
            Blocks registered now.
        """
        cache = self.pool.cache
        if cache is None or not req.block_table:
            return 0
        gap, computed = req.progress.drafter_gap, req.progress.num_computed_tokens
        final = computed if gap is None or self._drafter_writes_later else min(computed, gap)
        n = min((final - self.draft_schedule.rerun_rows) // self.pool.block_size,
                cache.num_keyed_blocks(req.num_tokens), len(req.block_table))
        if n <= req.progress.num_committed_blocks:
            return 0
        hashes = cache.extend_hashes(req.block_hashes, req.all_token_ids, n)
        bs = self.pool.block_size
        done = sum(cache.register(req.block_table[i], hashes[i], drafter_kv=gap is None or (i + 1) * bs <= gap)
                   for i in range(req.progress.num_committed_blocks, n))
        req.progress.num_committed_blocks = n
        return done

    def _schedule_decode(self, in_flight: bool) -> StepPlan | None:
        for req in [r for r in self.running if r.is_decoding and not r.finishes_in_flight]:
            need = req.kv_len + req.progress.num_inflight_tokens + self.lookahead
            while req in self.running and not (self.pool.grow(req.block_table, need)
                                               and self._sliding_room(req, req.kv_len, need)):
                if in_flight:
                    raise NeedsSync
                if len(self.running) == 1:  # nothing left to preempt: the cache cannot hold this sequence
                    self._release(req)
                    self._abort(req)
                else:
                    self._preempt(self.running[-1])
        reqs = tuple(r for r in self.running if r.is_decoding and not r.finishes_in_flight)
        if not reqs:
            return None
        k = self.draft_len_policy.draft_len(len(reqs), [r.request_id for r in reqs])
        drafting = k > 0 or self.draft_len_policy.max_draft_len == 0
        # what the next step may verify
        new_drafts = k if self.draft_schedule.on_demand and k > 0 else self.num_draft_tokens
        lens = self._ragged_lens(reqs, k) or ()
        if lens:  # each row its own length, at most the policy's
            k = max(lens)
            lens = lens if k > 0 and min(lens) < k else ()
        elif k > 0 and self.draft_schedule.proposal_len is not None:  # no wider than the drafter says pays (0: it still
            # drafts)
            k = max(0, min(k, self.draft_schedule.proposal_len([r.batch_slot for r in reqs])))
        if k > (ready := min(r.progress.num_drafts for r in reqs)):  # 0: speculation back on, draft first (drafts are
            k, lens = ready, ()  # not kept while it is off); else a longer length than the last step drafted
        catch_up = drafting and self._drafter_writes_later and any(r.progress.drafter_gap is not None for r in reqs)
        plan = self._new_plan(reqs, DecodePlan.build, k, drafting, catch_up, tuple(lens),
                              new_drafts if self.draft_schedule.on_demand and drafting else None)
        for req in reqs:
            req.progress.num_drafts = new_drafts if drafting else 0
            if not drafting and self._drafter_keeps_kv and req.progress.drafter_gap is None:
                req.progress.drafter_gap = req.kv_len  # (host kv_len: with a step in flight the gap starts later)
            elif catch_up:
                self._caught_up(req)
                req.progress.drafter_gap = None  # the step writes it first
        return plan

    def _caught_up(self, req: Request) -> None:
        """A planned step catches `req`'s drafter up from its gap: the cached blocks it covers (hits registered
        without the drafter's KV, `_prefix_hits`) have it once that step ran, so later hits skip the catch-up."""
        if self.pool.cache is not None and req.progress.drafter_gap is not None:
            first = req.progress.drafter_gap // self.pool.block_size
            self.pool.cache.caught_up(req.block_table[first:req.progress.num_committed_blocks])

    def _ragged_lens(self, reqs: tuple[Request, ...], k: int) -> list[int] | None:
        """The drafter's per-row draft lengths under the policy's k, where a ragged step can verify them: k > 0 and
        no row with logits processing (`chain_step.verify_ragged`); None elsewhere (one length for the step)."""
        if k <= 0 or self.draft_schedule.proposal_lens is None:
            return None
        if any(r.processor is not None for r in reqs):
            return None
        return self.draft_schedule.proposal_lens([r.batch_slot for r in reqs], k)

    def mark_in_flight(self, plan: StepPlan, max_emitted: int) -> None:
        """The plan's step was launched and is not read back yet (overlap scheduler): its rows that emit tokens may
        each emit up to `max_emitted` (the step's token width), which block growth reserves meanwhile."""
        for i, req in enumerate(self._scheduled[plan.step_id]):
            emits = isinstance(plan, DecodePlan) or plan.is_last_chunk(i)
            req.progress.num_inflight_tokens = max_emitted if emits else 0

    def update_from_output(self, plan: StepPlan, output: StepResult) -> tuple[list[Request], list[Request]]:
        """Apply a step's host results to its requests: append tokens (stop checks), the drafts for the next step,
        computed lengths and prefix-cache blocks, decode statistics; the draft-length policy observes the step;
        finished requests release their blocks and slots. Rows of requests finished (or cancelled) since the step
        was launched are dropped.

        Returns:
            (updated, finished): the requests that emitted tokens (finished or not), and those released now.
        """
        reqs = self._scheduled.pop(plan.step_id)
        decode = plan if isinstance(plan, DecodePlan) else None
        k = output.draft_len
        updated = []
        drafted = num_accepted = 0
        per_request: dict[int, int] = {}
        for i, (req, emitted, drafts, accepted) in enumerate(zip(reqs, output.emitted, output.drafts,
                                                                 output.num_accepted)):
            req.progress.num_inflight_tokens = 0
            if req.finished:  # finished (or cancelled) before this step ran
                continue
            if not emitted and isinstance(plan, PrefillPlan):  # an earlier prefill chunk
                req.progress.num_computed_tokens = plan.chunk_ends[i]
                self.cache_blocks(req)
                self._release_sliding(req, plan.chunk_ends[i] - self.draft_schedule.rerun_rows)
                continue
            if decode is not None:
                k_row = decode.draft_lens[i] if decode.draft_lens else k
                req.record_step(k_row, accepted)
                drafted, num_accepted = drafted + k_row, num_accepted + accepted
                per_request[req.request_id] = accepted
            req.append(emitted, self.max_seq_len, None if output.logprobs is None else output.logprobs[i])
            req.draft_tokens = drafts
            req.progress.num_computed_tokens = req.kv_len
            self.cache_blocks(req)
            if decode is not None and self.kv_window is not None:  # the next query is at kv_len: it sees keys
                # from kv_len − window + 1 on; the blocks wholly before them are never read again
                behind = max(0, req.kv_len - self.kv_window + 1) // self.pool.block_size
                self.pool.release_prefix(req.block_table, behind)
            self._release_sliding(req, req.kv_len)
            updated.append(req)
        if decode is not None:  # timed only when the step is plain or fully speculating (not re-priming drafts)
            # and, drafting on demand, drafts as many as it verified (a step profile's t(k): verify k, draft k)
            seconds = output.seconds if decode.drafting == (decode.draft_len > 0) and not decode.draft_lens and (
                decode.num_drafts in (None, decode.draft_len)) else 0.0
            self.draft_len_policy.observe(drafted, num_accepted, decode.draft_len, len(reqs), seconds, per_request)
        return updated, self.finish_done()

    def _sliding_room(self, req: Request, position: int, num_tokens: int) -> bool:
        """Sliding blocks for `req`'s window at a step whose first query sits at `position` and whose writes end
        before `num_tokens` (`SlidingBlocks.ensure`; True without sliding blocks). Its block table covers them."""
        sliding = self.pool.sliding
        return sliding is None or sliding.ensure(req.block_table, position, num_tokens)

    def _release_sliding(self, req: Request, position: int) -> None:
        """`req`'s next query sits at `position`: the sliding blocks before its window go."""
        if self.pool.sliding is not None:
            self.pool.sliding.release(req.block_table, position)

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
            running = next((r for r in self.running if r.request_id == request_id), None)
            if running is None:
                return None
            req = running
            self._release(req)
        req.finish("cancelled")
        return req

    def requeue(self, req: Request) -> None:
        """Take a request out of the running batch or the waiting queue, back to its committed (host) state: blocks
        and batch slot freed, prefill reset, so that a later admission re-prefills prompt + output (failure
        isolation, runtime/fault_isolation.py; not counted as a preemption). The caller decides where it goes."""
        if req in self.running:
            self._release(req)
        else:
            self.pool.free(req.block_table)
            if req in self.waiting:
                self.waiting.remove(req)
        req.status = RequestStatus.WAITING
        req.reset_prefill()

    def fail(self, req: Request, error: str) -> None:
        """Finish a request with finish_reason "error" and `error`, freeing its blocks and batch slot."""
        self.requeue(req)
        req.finish("error", error)

    def _abort(self, req: Request) -> None:
        self.pool.free(req.block_table)
        req.finish("error", f"the KV cache ({self.pool.capacity_tokens} tokens) cannot hold this sequence at "
                            f"{req.num_tokens} tokens plus {self.lookahead} of look-ahead; raise "
                            "kv_cache_config.max_tokens or lower max_tokens / max_seq_len")
        self.aborted.append(req)

    def _preempt(self, req: Request) -> None:
        self._release(req)
        req.status = RequestStatus.WAITING
        req.reset_prefill()
        self.waiting.appendleft(req)
        self.num_preemptions += 1

    def _release(self, req: Request) -> None:
        self.pool.free(req.block_table)
        self.running.remove(req)
        self._free_slots.append(req.batch_slot)
        req.batch_slot = -1

    def take_aborted(self) -> list[Request]:
        """The requests the scheduler finished with an error since the last call (for the engine to report)."""
        aborted, self.aborted = self.aborted, []
        return aborted

    def finish_done(self) -> list[Request]:
        """Release the finished requests' blocks and slots; return them."""
        done = [r for r in self.running if r.finished]
        for req in done:
            self._release(req)
        return done
