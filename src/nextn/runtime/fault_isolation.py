"""Failure isolation: an engine step that raises fails only the request at fault; the others continue unchanged.

Without it, any exception inside a step (a value that only breaks deep in a kernel, a bug reached by one request,
an out-of-memory on one long prompt) failed every request of the batch and left the request at fault queued, so
that every later step failed too. `Engine.step` calls `recover_from_failed_step` on any exception:

1. The step in flight is dropped. Each request's committed state is its host state (prompt + the tokens appended
   before the failure); requests that finished before the failure are reported (blocks freed, text decoded).
2. Every running request is a suspect, and goes back to its committed state. A decoding request resumes from it
   directly when the drafter and the acceptance rule keep no per-request device state (MTP Eagle, Medusa, plain
   decoding, n-gram): the KV below its host kv_len is intact (a step only writes at and past kv_len) and its next
   inputs (last token, drafts, kv_len) are on the host, so it continues exactly as it would have. Otherwise (MTP
   Vanilla's hidden-state pools, relaxed acceptance's thinking flag, a prefill not yet processed) it is taken back
   like a preemption — blocks and slot freed, re-prefilled over prompt + output (recompute; a sampled request may
   then differ from its uninterrupted run: ARCHITECTURE.md's known limitation).
3. Probe: the suspects run one at a time, alone and synchronously, until each has done one decode step (after its
   prefill when it was taken back) or finished. A suspect whose solo step raises is the request at fault: it
   finishes with finish_reason "error" and the error. A suspect that passes keeps its blocks and slot (parked) and rejoins the batch after the
   probe; waiting requests wait meanwhile.
4. No suspect fails alone (a transient fault, or one that needs the whole batch): everybody continues. A request
   that has been in `MAX_UNEXPLAINED_FAILURES` such steps finishes with "error", so a persistent fault cannot loop.

`fail_all` is the last resort of the callers (LLM, EngineLoop) should the recovery itself raise: every request ends
with "error" and the engine is empty and usable again.
"""

from __future__ import annotations

import logging
from collections import deque
from typing import Any, Protocol

from nextn.runtime.model_runner import ModelRunner
from nextn.runtime.request import Request
from nextn.runtime.scheduler import Scheduler

logger = logging.getLogger(__name__)

MAX_UNEXPLAINED_FAILURES = 3


class Engine(Protocol):
    """What failure isolation drives: the engine's public step and parts (runtime/engine.py `Engine`)."""

    scheduler: Scheduler
    runner: ModelRunner
    tokenizer: Any  # EngineTokenizer | None
    overlap: bool  # the overlap scheduler is on (turned off while suspects are probed alone)

    def step_unisolated(self) -> list[Request]:
        """One step; an exception inside it propagates."""

    def drop_step_in_flight(self) -> None:
        """Forget the step in flight and the plans not yet applied."""


def describe(error: BaseException) -> str:
    """`Type: message`, at most 300 characters."""
    text = f"{type(error).__name__}: {error}"
    return text if len(text) <= 300 else text[:297] + "..."


def recover_from_failed_step(engine: Engine, error: Exception, running_before: list[Request]) -> list[Request]:
    """Isolate the request at fault after `engine.step_unisolated()` raised `error` (see the module docstring).

    Args:
        running_before: the scheduler's running requests when the failed step began (those it may have finished).
    Returns:
        The requests this recovery finished (the request at fault, those that finished before the failure, those
        that finished during the probe), for the caller to report like `Engine.step`'s result.
    """
    logger.error("engine step failed (%s); isolating the request at fault", describe(error), exc_info=error)
    sched = engine.scheduler
    engine.drop_step_in_flight()
    reported = _collect_finished(engine, running_before)
    suspects = [r for r in sched.running if not r.finished]
    if not suspects and sched.waiting:  # it failed while admitting: the head of the queue
        suspects = [sched.waiting[0]]
    stateless = not engine.runner.state and not engine.runner.accept_state
    for req in suspects:
        if stateless and req.progress.prefill_done and req.is_decoding:
            req.progress.num_inflight_tokens = 0  # resume from the host state: keep blocks and slot
        else:
            sched.requeue(req)
    for req in sched.waiting:  # an admission that failed midway may have grown a block table
        if req.block_table:
            sched.pool.free(req.block_table)
    found, probed = _probe(engine, suspects, error)
    reported += probed
    if not found:
        for req in suspects:
            if req.finished:
                continue
            req.num_failed_steps += 1
            if req.num_failed_steps >= MAX_UNEXPLAINED_FAILURES:
                sched.fail(req, f"engine steps with this request in the batch failed {req.num_failed_steps} times "
                                f"(last: {describe(error)}) and no request was at fault when run alone; giving up")
                reported.append(req)
    return _unique(reported)


def _collect_finished(engine: Engine, running_before: list[Request]) -> list[Request]:
    """Requests finished by the scheduler or by the failed step before it raised: released and detokenized."""
    sched = engine.scheduler
    aborted = sched.take_aborted()
    done = sched.finish_done()
    for req in done + [r for r in running_before if r.finished and r not in done]:
        detokenize(engine, req)
    return aborted + done + [r for r in running_before if r.finished]


def detokenize(engine: Engine, req: Request) -> None:
    """Fill a finished request's text (when asked for and still empty); a failure ends it with "error"."""
    if engine.tokenizer is None or not req.params.detokenize or req.text or not req.output_token_ids:
        return
    try:
        req.text = engine.tokenizer.decode(req.output_token_ids)
    except Exception as e:  # noqa: BLE001 - reported on the request
        req.finish("error", f"its tokens could not be decoded: {describe(e)}")


def _probe(engine: Engine, suspects: list[Request], error: Exception) -> tuple[bool, list[Request]]:
    """Run each suspect alone until it has done its prefill and a decode step; fail the one whose step raises.

    Returns:
        Whether a request at fault was found, and the requests finished meanwhile.
    """
    sched = engine.scheduler
    others, sched.waiting = sched.waiting, deque()
    overlap, engine.overlap = engine.overlap, False
    resuming, sched.running = list(sched.running), []  # decoding suspects that kept their blocks and slot
    parked: list[Request] = []  # passed: keep blocks and slot, out of the scheduler's sight meanwhile
    back: list[Request] = []  # not admitted (or preempted for room): back to the head of the queue
    finished: list[Request] = []
    found = False
    try:
        for req in suspects:
            if req.finished:
                continue
            if req in resuming:
                resuming.remove(req)
                sched.running.append(req)
            else:
                if req in back:  # taken back for room earlier
                    back.remove(req)
                _make_room(engine, req, (resuming, parked), back)
                sched.waiting.append(req)
            sched.restart_alternation()
            decode_steps = req.num_decode_steps
            for _ in range(3 + -(-req.num_tokens // max(1, sched.max_num_tokens))):
                try:
                    finished += [r for r in engine.step_unisolated() if r.finished]
                except Exception as e:  # noqa: BLE001 - alone in the step: this request is at fault
                    engine.drop_step_in_flight()
                    logger.error("request %d fails alone: %s", req.request_id, describe(e))
                    sched.fail(req, f"the engine step failed on this request ({describe(e)}); run alone it fails "
                                    "again, and the other requests of its batch continue. If its prompt and "
                                    "SamplingParams are valid, this is a bug in nextn: please report them")
                    finished.append(req)
                    found = True
                    break
                if req.finished or req.num_decode_steps > decode_steps or not sched.has_work:
                    break
            if req.finished:
                continue
            if req in sched.running:
                sched.running.remove(req)
                parked.append(req)
            elif req in sched.waiting:
                sched.waiting.remove(req)
                back.append(req)
    finally:
        engine.overlap = overlap
        sched.running = parked + resuming + [r for r in sched.running if r not in parked]
        sched.waiting = deque(back + list(sched.waiting) + list(others))
        sched.restart_alternation()
    return found, finished


def _make_room(engine: Engine, req: Request, holder_lists: tuple[list[Request], ...], back: list[Request]) -> None:
    """Take requests that hold blocks meanwhile back to waiting (re-prefilled later), the latest first, until `req`
    has room for its prefill and a decode step, so that running alone it is never aborted for want of blocks."""
    sched = engine.scheduler
    need = sched.pool.blocks_for(req.num_tokens + 1 + sched.lookahead) + 1
    for holders in holder_lists:
        while holders and sched.pool.num_free < need:
            victim = holders.pop()
            sched.running.append(victim)
            sched.requeue(victim)
            back.insert(0, victim)


def fail_all(engine: Engine, error: BaseException) -> list[Request]:
    """The last resort when even the recovery failed: every unfinished request ends with "error", all blocks are
    freed and nothing is in flight, so that the engine takes new requests again.

    Returns:
        The requests it finished.
    """
    logger.error("engine recovery failed (%s); failing every request", describe(error), exc_info=error)
    sched = engine.scheduler
    engine.drop_step_in_flight()
    sched.take_aborted()
    failed = []
    for req in list(sched.running) + list(sched.waiting):
        sched.fail(req, f"the engine step failed ({describe(error)}) and the request at fault could not be isolated")
        failed.append(req)
    sched.running, sched.waiting = [], deque()
    return failed


def _unique(reqs: list[Request]) -> list[Request]:
    return list({id(r): r for r in reqs}.values())  # first occurrence, in order
