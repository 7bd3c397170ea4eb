"""`EngineLoop`: a background thread that owns the engine and runs its steps while requests come and go.

Servers (the OpenAI server, the Triton backend) share one engine across concurrent requests through it: callers
on any thread submit and cancel; the loop applies those commands between steps (the engine itself is touched by
the loop thread only), runs `Engine.step()` while there is work (in-flight batching) and hands each request's
outputs to its `RequestHandle`. A streaming handle gets one output per step that emitted tokens, carrying the
step's tokens in `token_ids_diff` and the newly complete text in `text_diff`.
"""

from __future__ import annotations

import logging
import queue
import threading
from dataclasses import replace
from typing import TYPE_CHECKING

from nextn.runtime.fault_isolation import describe, fail_all
from nextn.runtime.openmp_pool import release_thread_pool
from nextn.runtime.outputs import CompletionOutput, RequestOutput
from nextn.runtime.request import Request
from nextn.runtime.request_handle import RequestHandle
from nextn.runtime.sampling_params import SamplingParams

if TYPE_CHECKING:
    from nextn.runtime.engine import Engine

logger = logging.getLogger(__name__)


class LoopStopped(RuntimeError):
    """The loop was shut down before this request could be submitted (nothing was queued)."""


class _Stream:
    """What a handle has been sent so far (for the diffs)."""

    def __init__(self, handle: RequestHandle) -> None:
        self.handle = handle
        self.num_tokens = 0
        self.text = ""


class EngineLoop:
    """Runs `engine.step()` on a daemon thread; thread-safe `submit` / `abort` / `shutdown`.

    Args:
        engine: the loaded engine; from now on only the loop thread may call its methods. The creating thread's
            OpenMP workers are freed first (`release_thread_pool`), so the loop steps as fast as that thread did.
    """

    def __init__(self, engine: Engine) -> None:
        self.engine = engine
        self._commands: queue.Queue = queue.Queue()
        self._streams: dict[int, _Stream] = {}
        self._stopped = False
        self._submit_lock = threading.Lock()  # no command is queued after "stop": every handle gets a final output
        release_thread_pool()  # the loop thread's OpenMP pool is then the only one (runtime/openmp_pool.py)
        self._thread = threading.Thread(target=self._run, name="nextn-engine-loop", daemon=True)
        self._thread.start()

    @property
    def num_active(self) -> int:
        """Requests submitted and not yet finished."""
        return len(self._streams)

    def submit(self, prompt: str | list[int], params: SamplingParams, streaming: bool = False) -> RequestHandle:
        """Validate and queue a request (on the caller's thread); it joins the running batch at the next step.

        Raises:
            RequestError: empty prompt, too long for max_seq_len or the KV cache, ids outside the vocabulary
                (nothing is queued; other requests keep running).
            LoopStopped: the loop was shut down (also a RuntimeError).
        """
        if self._stopped:
            raise LoopStopped("the engine loop is shut down")
        req = self.engine.make_request(prompt, params)  # reads only immutable engine state: safe off-loop
        handle = RequestHandle(streaming, self.abort)
        handle.request_id = req.request_id
        with self._submit_lock:
            if self._stopped:
                raise LoopStopped("the engine loop is shut down")
            self._commands.put(("submit", (req, handle)))
        return handle

    def abort(self, request_id: int) -> None:
        """Cancel a request (thread-safe); its handle gets a final output with finish_reason "cancelled"."""
        self._commands.put(("abort", request_id))

    def shutdown(self, timeout: float | None = None) -> None:
        """Stop the loop after cancelling every unfinished request (each handle gets a "cancelled" output).

        Args:
            timeout: seconds to wait for the step in progress; None (default): until the loop thread has exited,
                so the engine is free for its caller afterwards.
        """
        with self._submit_lock:
            if self._stopped:
                return
            self._stopped = True
            self._commands.put(("stop", None))
        self._thread.join(timeout)

    # The loop thread ----------------------------------------------------------------------------------------
    def _run(self) -> None:
        while True:
            try:
                if self._iteration():
                    return
            except Exception as e:  # noqa: BLE001 - the loop thread must not die: fail what is running, go on
                logger.exception("engine loop iteration failed")
                for req in fail_all(self.engine, e):
                    self._publish_safely(req)
                for rid in list(self._streams):  # submitted, never reached the engine
                    self._streams.pop(rid).handle._deliver(_error_output(rid, e))

    def _iteration(self) -> bool:
        """Apply the queued commands, then run one step when there is work; True when told to stop."""
        block = not self.engine.has_work
        try:
            while True:
                kind, arg = self._commands.get(block=block)
                block = False
                if kind == "stop":
                    for rid in list(self._streams):
                        self._cancel(rid)
                    return True
                self._apply(kind, arg)
        except queue.Empty:
            pass
        if self.engine.has_work:
            self._step()
        return False

    def _apply(self, kind: str, arg) -> None:
        if kind == "abort":
            self._cancel(arg)
            return
        req, handle = arg
        self._streams[req.request_id] = _Stream(handle)
        self.engine.add_request(req)

    def _cancel(self, request_id: int) -> None:
        req = self.engine.abort_request(request_id)
        if req is not None:
            self._publish(req)

    def _step(self) -> None:
        try:
            updated = self.engine.step()  # isolates a failing request itself (runtime/fault_isolation.py)
        except Exception as e:  # noqa: BLE001 - the isolation itself failed: fail everything, keep serving
            updated = fail_all(self.engine, e)
        for req in updated:
            self._publish_safely(req)

    def _publish_safely(self, req: Request) -> None:
        try:
            self._publish(req)
        except Exception as e:  # noqa: BLE001 - its consumer still gets a final output
            stream = self._streams.pop(req.request_id, None)
            if stream is not None:
                stream.handle._deliver(_error_output(req.request_id, e))

    def _publish(self, req: Request) -> None:
        stream = self._streams.get(req.request_id)
        if stream is None:
            return
        out = req.to_output()
        c = out.outputs[0]
        if stream.handle.streaming:
            text = c.text if req.finished else self._partial_text(req)
            diff_ids = c.token_ids[stream.num_tokens:]
            text_diff = text[len(stream.text):] if text.startswith(stream.text) else text
            if not diff_ids and not req.finished:
                return
            out.outputs[0] = replace(c, text=text, token_ids_diff=diff_ids, text_diff=text_diff)
            stream.num_tokens, stream.text = len(c.token_ids), text
        if req.finished:
            del self._streams[req.request_id]
        stream.handle._deliver(out)

    def _partial_text(self, req: Request) -> str:
        """The text of the tokens so far, holding back a trailing incomplete character (U+FFFD)."""
        tok = self.engine.tokenizer
        if tok is None or not req.params.detokenize:
            return ""
        return tok.decode(req.output_token_ids).rstrip("\ufffd")


def _error_output(request_id: int, error: BaseException) -> RequestOutput:
    """A final output with finish_reason "error" for a request the loop could not report otherwise."""
    return RequestOutput(request_id, None, [], [CompletionOutput(finish_reason="error", error=describe(error))],
                         finished=True)
