"""Guided-decoding grammars converted and compiled in worker processes, under a time budget and a memory cap.

xgrammar's conversion of a JSON schema and its compile run in native code that a thread cannot stop: a 279-byte
schema with `"pattern": "[a-z]{2000,10000}"` takes 5–16 s, `{3000,20000}` over a minute. Here each runs in a
grammar worker (`runtime/grammar_worker.py`, `runtime/worker_pool.py`) that is killed and replaced when it passes
`GrammarLimits.timeout_s`; at most `num_workers` compile at once, at most `max_waiting` more wait for one (each up
to its budget), and a caller beyond is refused at once (`GrammarBusyError`; the server answers 503). The compiled
grammar comes back as xgrammar's own JSON serialization (`CompiledGrammar.serialize_json`; never pickle).
"""

from __future__ import annotations

import atexit
import threading
import time
from dataclasses import dataclass
from pathlib import Path

from nextn.runtime.sampling_params import SamplingParamsError
from nextn.runtime.worker_pool import PoolBusy, PoolClosed, WorkerGone, WorkerPool, check_timeout_s, interpreter

WORKER_PATH = Path(__file__).with_name("grammar_worker.py")
DEFAULT_TIMEOUT_S = 10.0  # a 5-property schema compiles in 0.1–0.6 s on a 2-core machine; generous under load
DEFAULT_CACHE_BYTES = 256 << 20  # compiled grammars kept per engine (a schema compiles to ~0.6–8 MB)
DEFAULT_MEMORY_BYTES = 2 << 30  # address space a worker may add beyond its imports
DEFAULT_NUM_WORKERS = 1
DEFAULT_MAX_WAITING = 8


class GrammarLimitError(SamplingParamsError):
    """A grammar passed its budget (time, compiled size, memory) and was stopped; the message names which."""


class GrammarBusyError(SamplingParamsError):
    """Every grammar worker is busy and the waiting line is full: try again shortly (the server answers 503)."""


@dataclass(frozen=True)
class GrammarLimits:
    """Per-grammar budget.

    Attributes:
        timeout_s: wall-clock seconds for one conversion or compile in its worker (> 0, finite); beyond, the worker
            is killed and the request refused (`GrammarLimitError`).
        cache_bytes: the most bytes of compiled grammars an engine keeps (least recently used evicted); a grammar
            that alone compiles to more is refused (≥ 1 MiB).
    """

    timeout_s: float = DEFAULT_TIMEOUT_S
    cache_bytes: int = DEFAULT_CACHE_BYTES

    def __post_init__(self) -> None:
        check_timeout_s(self.timeout_s)
        if isinstance(self.cache_bytes, bool) or not isinstance(self.cache_bytes, int) or self.cache_bytes < 1 << 20:
            raise ValueError(f"cache_bytes must be an int ≥ 1 MiB, got {self.cache_bytes!r}")


class GrammarWorkers(WorkerPool):
    """A pool of grammar workers, shared by the engines of a process (each sends its tokenizer once per worker).

    Args:
        num_workers: the most conversions / compiles at once. max_waiting: the most callers waiting for a worker
            beyond those (others get GrammarBusyError at once). memory_bytes: address space each worker may add
            beyond its imports.
    """

    def __init__(self, num_workers: int = DEFAULT_NUM_WORKERS, max_waiting: int = DEFAULT_MAX_WAITING,
                 memory_bytes: int = DEFAULT_MEMORY_BYTES) -> None:
        super().__init__(lambda: [interpreter(), "-P", str(WORKER_PATH), str(memory_bytes)], num_workers, "grammar")
        self.max_waiting, self.memory_bytes = max_waiting, memory_bytes
        self._callers = threading.BoundedSemaphore(num_workers + max_waiting)

    def compile(self, tokenizer_key: str, tokenizer_info: str, form: str, source: str | None,
                limits: GrammarLimits) -> str:
        """`source` compiled for the tokenizer: xgrammar's `CompiledGrammar.serialize_json()` text.

        Args:
            tokenizer_key: names `tokenizer_info` (xgrammar's `TokenizerInfo.serialize_json()`), sent to a worker
                the first time it sees the key. form: "json_schema" (source: JSON text), "json_object" (source None),
                "regex", "grammar" (EBNF).
        Raises:
            GrammarLimitError: past `limits.timeout_s`, `limits.cache_bytes` or the memory cap.
            GrammarBusyError: every worker busy and the waiting line full, or still busy after the budget.
            SamplingParamsError: xgrammar refused the grammar, or it matches no output (the message says which).
        """
        request = {"op": "compile", "tokenizer": tokenizer_key, "form": form, "source": source,
                   "max_bytes": limits.cache_bytes}

        def send(worker, deadline):
            reply = self._call(worker, request, deadline, "compile") if tokenizer_key in worker.state else None
            if reply is None or reply.get("kind") == "unknown_tokenizer":  # first time here, or dropped since
                self._call(worker, {"op": "tokenizer", "key": tokenizer_key, "info": tokenizer_info},
                           time.monotonic() + limits.timeout_s + 30.0, "load the tokenizer")
                worker.state[tokenizer_key] = True
                reply = self._call(worker, request, deadline, "compile")
            return reply

        reply = self._run(send, limits)
        return reply["compiled"]

    def tool_call_ebnf(self, schema: str, open_tag: str, close_tag: str, limits: GrammarLimits) -> str:
        """The EBNF grammar of `open_tag`, one JSON value valid against `schema` (JSON text, no free whitespace),
        then `close_tag`. Raises as `compile`."""
        reply = self._run(lambda worker, deadline: self._call(
            worker, {"op": "tool_call", "schema": schema, "open": open_tag, "close": close_tag}, deadline,
            "convert"), limits)
        return reply["ebnf"]

    def _run(self, send, limits: GrammarLimits) -> dict:
        if not self._callers.acquire(blocking=False):
            raise GrammarBusyError(f"{self.num_workers + self.max_waiting} guided-decoding grammars are compiling or "
                                   "waiting to: retry shortly")
        try:
            try:
                worker = self.acquire(wait_s=limits.timeout_s)
            except PoolBusy as e:
                raise GrammarBusyError(f"{e}: retry shortly") from None
            except (PoolClosed, WorkerGone) as e:
                raise SamplingParamsError(f"guided decoding is unavailable: {e}") from None
            keep = False
            try:
                worker.wait_ready()
                reply = send(worker, time.monotonic() + limits.timeout_s)
                keep = reply.get("kind") not in ("memory", "protocol")
                return _checked(reply, limits, self.memory_bytes)
            except WorkerGone as e:
                raise SamplingParamsError(f"the grammar worker failed: {e}; check that `{interpreter()} -P "
                                          f"{WORKER_PATH}` starts (it needs xgrammar)") from None
            finally:
                self.release(worker, keep)
        finally:
            self._callers.release()

    @staticmethod
    def _call(worker, request: dict, deadline: float, what: str) -> dict:
        worker.send(request)
        reply = worker.receive(deadline, None, 1 << 31)
        if reply is None:
            raise GrammarLimitError(f"the guided-decoding grammar did not {what} within its budget and was stopped: "
                                    "simplify it (e.g. smaller repetition counts in a pattern, such as {2000,10000}), "
                                    "or raise the budget (nextn serve --grammar_timeout)")
        return reply


def _checked(reply: dict, limits: GrammarLimits, memory_bytes: int) -> dict:
    kind, error = reply.get("kind"), str(reply.get("error", ""))[:600]
    if kind == "size":
        raise GrammarLimitError(f"{error} (the grammar cache's size): simplify the grammar, or raise "
                                "nextn serve --grammar_cache_mb")
    if kind == "memory":
        raise GrammarLimitError(f"the guided-decoding grammar was stopped at its memory cap of {memory_bytes >> 20} "
                                "MiB: simplify it")
    if kind == "empty":
        raise SamplingParamsError(f"the guided-decoding grammar cannot be used: {error}")
    if kind is not None:
        raise SamplingParamsError(f"the guided-decoding grammar cannot be compiled: {error}")
    if not isinstance(reply.get("compiled", reply.get("ebnf")), str):
        raise SamplingParamsError("the grammar worker's answer is not a grammar")
    return reply


_shared: GrammarWorkers | None = None
_shared_lock = threading.Lock()


def shared_grammar_workers() -> GrammarWorkers:
    """This process's grammar workers (DEFAULT_NUM_WORKERS, DEFAULT_MAX_WAITING), created at first use and closed at
    exit."""
    global _shared
    with _shared_lock:
        if _shared is None:
            _shared = GrammarWorkers()
            atexit.register(_shared.close)
        return _shared
