"""The engine: an engine directory loaded for decoding (runtime/engine_loader.py), and its step loop.

One step is schedule → launch → update: the scheduler turns its requests into a data-only `StepPlan`, the model
runner launches it on the device, and the scheduler applies the read-back results to its requests. With the
overlap scheduler (model_runner.py's `InflightStep`) a step launches step n before reading back step n−1.
"""

from __future__ import annotations

import itertools
import logging
import random
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from pydantic import BaseModel

from nextn.config.llm_args import LlmArgs
from nextn.runtime.engine_loader import Sharding, load_engine
from nextn.runtime.fault_isolation import recover_from_failed_step
from nextn.runtime.iteration_log import iteration_entry
from nextn.runtime.model_runner import InflightStep
from nextn.runtime.grammar_pool import GrammarLimits
from nextn.runtime.guided_decoding import GrammarCompiler
from nextn.runtime.logits_processors import RequestProcessor
from nextn.runtime.request import Request
from nextn.runtime.request_validation import (RequestError, RequestSamplingParamsError, checked_sampling_params,
                                              prompt_token_ids)
from nextn.runtime.sampling_params import SamplingParams, SamplingParamsError
from nextn.runtime.scheduler import NeedsSync

__all__ = ["Engine", "RequestError"]

logger = logging.getLogger(__name__)


class Engine:
    """Loads an engine directory and runs requests to completion with in-flight batching.

    Args:
        sharding: this process's share when it is one rank of a tensor-parallel engine (its part of the model and
            KV heads: distributed/tensor_parallel.py); rank 0's steps reach the other ranks through
            `runner.on_launch` (distributed/mirror.py).
        open_checkpoint: the build layer's checkpoint reader (`engine_settings.open_checkpoint`), handed to a
            speculative method that reads weights of its own as they are (`LoadContext.open_checkpoint`).
    Raises:
        EngineError, EngineSizeError, LlmArgsError: as `load_engine`.
    """

    def __init__(self, engine_dir: str | Path, args: LlmArgs, spec: BaseModel | None,
                 device: str | torch.device = "cpu", sharding: Sharding | None = None,
                 open_checkpoint: Callable[[Path], Any] | None = None) -> None:
        self.engine_dir, self.spec, self.device = Path(engine_dir), spec, torch.device(device)
        parts = load_engine(engine_dir, args, spec, self.device, sharding, open_checkpoint)
        self.manifest, self.cfg = parts.manifest, parts.manifest.model
        self.max_batch_size, self.max_seq_len, self.block_size = parts.max_batch_size, parts.max_seq_len, parts.block_size
        self.model, self.batch_invariant = parts.model, parts.batch_invariant
        self.drafter, self.acceptance = parts.drafter, parts.acceptance
        self.pool, self.scheduler, self.runner = parts.pool, parts.scheduler, parts.runner
        self.draft_len_policy = self.scheduler.draft_len_policy  # chooses each step's k, observes its outcome
        self.tokenizer, self.eos_ids = parts.tokenizer, parts.eos_ids
        self.overlap = not args.disable_overlap_scheduler
        self._inflight: InflightStep | None = None  # launched, not yet read back (overlap scheduler)
        self._ids = itertools.count()
        self._seed_rng = random.Random()  # seeds for requests that give none
        self.print_iter_log = args.print_iter_log
        self.iteration_log: list[dict] | None = None  # set to [] to record one dict per iteration
        self._grammars: GrammarCompiler | None = None  # built with the first guided-decoding request
        self._grammar_limits = GrammarLimits()  # each grammar's budget (a server sets its own: `grammar_limits`)
        self._grammars_lock = threading.Lock()

    # Requests ----------------------------------------------------------------------------------------
    def make_request(self, prompt: str | list[int], params: SamplingParams) -> Request:
        """Validate and tokenize one prompt, and check its SamplingParams against this engine
        (runtime/request_validation.py).

        Raises:
            RequestError: empty prompt or of the wrong type, a text prompt without a tokenizer or not valid Unicode,
                ids outside the vocabulary, a prompt that leaves no room in max_seq_len or the KV cache, or
                SamplingParams out of range for this engine (a `RequestSamplingParamsError`).
        """
        text, ids = prompt_token_ids(prompt, self.tokenizer, self.cfg.vocab_size, self.max_seq_len)
        params = checked_sampling_params(params, self.cfg.vocab_size, self.max_seq_len)
        if params.n != 1:
            raise RequestSamplingParamsError(f"n={params.n}: one request is one sequence; LLM.generate expands n into "
                                             "n requests (add_request / generate_async: submit n requests with "
                                             "seeds seed + i)")
        need = len(ids) + self.scheduler.lookahead
        if need > self.pool.capacity_tokens:
            raise RequestError(f"prompt needs {need} KV slots but the cache holds {self.pool.capacity_tokens}: "
                               "raise kv_cache_config.max_tokens")
        eos = self.eos_ids if params.end_id is None else frozenset([params.end_id])
        seed = params.seed if params.seed is not None else self._seed_rng.getrandbits(63)
        return Request(next(self._ids), text, ids, params, eos, seed=seed, processor=self._processor(ids, params, eos),
                       logprobs=None if params.logprobs is None else [])

    def _processor(self, ids: list[int], params: SamplingParams, eos: frozenset[int]) -> RequestProcessor | None:
        """The request's logit-processing state (penalties, bias, min_tokens, its grammar's matcher), or None."""
        if not params.needs_processing:
            return None
        stops = sorted(set(params.stop_token_ids) | (set() if params.ignore_eos else set(eos)))
        matcher = None
        if params.guided_decoding is not None:
            try:
                matcher = self._grammar_compiler().matcher(params.guided_decoding, stops or sorted(self.eos_ids))
            except SamplingParamsError as e:
                raise RequestSamplingParamsError(str(e)) from None
        return RequestProcessor(params, ids, stops, self.cfg.vocab_size, matcher)

    def _grammar_compiler(self) -> GrammarCompiler:
        """The engine's grammar compiler, built with the first guided-decoding request (once, whatever thread)."""
        if self.tokenizer is None:
            raise RequestSamplingParamsError("guided decoding needs the engine's tokenizer and this engine has none "
                                             "(its checkpoint had none)")
        with self._grammars_lock:
            if self._grammars is None:
                self._grammars = GrammarCompiler(self.tokenizer.tok, self.cfg.vocab_size, sorted(self.eos_ids),
                                                 self._grammar_limits)
            return self._grammars

    @property
    def grammar_limits(self) -> GrammarLimits:
        """Each guided-decoding grammar's budget (time, compiled bytes kept; `grammar_pool.GrammarLimits`)."""
        return self._grammar_limits

    @grammar_limits.setter
    def grammar_limits(self, limits: GrammarLimits) -> None:
        with self._grammars_lock:
            self._grammar_limits = limits
            if self._grammars is not None:
                self._grammars.limits = limits  # the next compile runs under it; the cache shrinks at its next insert

    def compile_grammar(self, params: SamplingParams) -> None:
        """Compile `params`' guided-decoding grammar into the compiler's cache now, on the calling thread (a server
        calls it from a worker thread, so that the wait for a grammar worker does not stall its event loop); a
        no-op without one.

        Raises:
            RequestSamplingParamsError: the grammar cannot be compiled, passed its budget, or the grammar workers are
                busy (`grammar_pool.GrammarBusyError` chained as the cause).
        """
        if params.guided_decoding is None:
            return
        try:
            self._grammar_compiler().compile(params.guided_decoding)
        except SamplingParamsError as e:
            raise RequestSamplingParamsError(str(e)) from e

    def tool_call_ebnf(self, schema: dict, open_tag: str, close_tag: str) -> str:
        """`GrammarCompiler.tool_call_ebnf` with the engine's compiler (in a grammar worker, under its budget).
        Raises RequestSamplingParamsError as `compile_grammar`."""
        try:
            return self._grammar_compiler().tool_call_ebnf(schema, open_tag, close_tag)
        except SamplingParamsError as e:
            raise RequestSamplingParamsError(str(e)) from e

    def add_request(self, request: Request) -> None:
        self.scheduler.add(request)

    def abort_request(self, request_id: int) -> Request | None:
        """Cancel a waiting or running request between steps: its KV blocks and batch slot are freed at once.

        Returns:
            The request, finished with reason "cancelled" (its tokens so far kept), or None when no unfinished
            request has this id.
        """
        req = self.scheduler.cancel(request_id)
        if req is not None:
            self.detokenize(req)
        return req

    def detokenize(self, req: Request) -> None:
        """Set a request's text from its output tokens (when it asks for text and the engine has a tokenizer)."""
        if self.tokenizer is not None and req.params.detokenize:
            req.text = self.tokenizer.decode(req.output_token_ids)

    @property
    def has_work(self) -> bool:
        return self.scheduler.has_work or self._inflight is not None

    # The step ----------------------------------------------------------------------------------------
    def step(self) -> list[Request]:
        """One engine iteration: schedule → launch → update.

        Synchronous (`disable_overlap_scheduler: true`): the step launched here is read back and applied here.
        Overlap scheduler: this call launches step n from step n−1's device outputs, then reads back and applies
        step n−1 (stop checks, detokenization, freeing blocks) and leaves step n in flight (model_runner.py).

        Returns:
            The requests this call updated: those that emitted tokens (finished or not) and those the scheduler
            finished with an error; `Request.finished` tells which are done (their blocks are already freed).
            A step that raises fails only the request at fault (runtime/fault_isolation.py): it is returned
            finished with reason "error", the others continue; the engine stays usable.
        """
        running_before = list(self.scheduler.running)
        try:
            return self.step_unisolated()
        except Exception as e:  # noqa: BLE001 - isolate the request at fault, whatever the cause
            return recover_from_failed_step(self, e, running_before)

    def step_unisolated(self) -> list[Request]:
        """`step` without failure isolation: an exception inside the step propagates (the step in flight is lost:
        call `drop_step_in_flight`)."""
        prev, self._inflight = self._inflight, None
        updated: list[Request] = []
        if prev is not None and any(r.processor is not None for r in self.scheduler.running):
            # logit processing reads each request's exact tokens and drafts on the host: no step in flight
            updated, prev = self._update(prev), None
        try:
            plan = self.scheduler.schedule(in_flight=prev is not None)
        except NeedsSync:  # a preemption needs exact host state: apply the step in flight first
            assert prev is not None  # raised only with a step in flight
            updated, prev = self._update(prev), None
            plan = self.scheduler.schedule()
        aborted = self.scheduler.take_aborted()
        launched = self.runner.launch(plan, prev) if plan is not None else None
        if prev is not None:
            updated += self._update(prev)
        if plan is not None and launched is not None and self.overlap:  # read back at the next step, while that
            self.scheduler.mark_in_flight(plan, launched.max_emitted)  # one runs
            self._inflight = launched
        elif launched is not None:
            updated += self._update(launched)
        return aborted + updated

    def drop_step_in_flight(self) -> None:
        """Forget the launched step not yet read back and the plans not yet applied (after a failed step: the
        requests' host state is what counts)."""
        self._inflight = None
        self.scheduler.forget_scheduled()

    def _update(self, step: InflightStep) -> list[Request]:
        """Read a launched step back and apply it to its requests (scheduler.update_from_output); detokenize the
        finished ones."""
        result = self.runner.read_back(step)
        updated, done = self.scheduler.update_from_output(step.plan, result)
        for req in done:
            self.detokenize(req)
        if self.print_iter_log or self.iteration_log is not None:
            entry = iteration_entry(step, result, len(done), self.scheduler)
            if self.iteration_log is not None:
                self.iteration_log.append(entry)
            if self.print_iter_log:
                logger.info("iter %s", entry)
        return updated
