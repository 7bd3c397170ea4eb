"""`RequestHandle`: what `LLM.generate_async` returns — a future of the final output and, when streaming, an
iterator of per-step outputs (TensorRT-LLM's `generate_async(..., streaming=True)` shape).

The engine loop thread is the only producer (`_deliver`); consumers are threads (`for out in handle`,
`handle.result()`) or an asyncio event loop (`async for out in handle`, `await handle.aresult()`): a handle made
inside a running event loop hands its outputs to that loop with `call_soon_threadsafe`.
"""

from __future__ import annotations

import asyncio
import queue
import threading
from collections.abc import AsyncIterator, Callable, Iterator

from nextn.runtime.outputs import RequestOutput

_END = object()


class RequestHandle:
    """One submitted request.

    Attributes:
        request_id: the engine's id (also `RequestOutput.request_id`); -1 when the request was rejected.
        streaming: whether iteration yields one output per engine step (else one final output).
    """

    def __init__(self, streaming: bool, abort: Callable[[int], None]) -> None:
        self.request_id = -1
        self.streaming = streaming
        self._abort = abort
        self._final: RequestOutput | None = None
        self._done = threading.Event()  # set once the final output is delivered: any number of threads may wait
        self._sync: queue.Queue = queue.Queue()
        try:
            self._loop: asyncio.AbstractEventLoop | None = asyncio.get_running_loop()
            self._async: asyncio.Queue | None = asyncio.Queue()
        except RuntimeError:
            self._loop, self._async = None, None

    @property
    def finished(self) -> bool:
        return self._final is not None

    def abort(self) -> None:
        """Cancel the request (no-op once finished); the last output says finish_reason "cancelled"."""
        if self._final is None and self.request_id >= 0:
            self._abort(self.request_id)

    # Producer side (the engine loop thread) ----------------------------------------------------------
    def _deliver(self, output: RequestOutput) -> None:
        items = [output, _END] if output.finished else [output]
        if output.finished:
            self._final = output
            self._done.set()
        for item in items:
            if self._loop is not None and self._async is not None:
                try:
                    self._loop.call_soon_threadsafe(self._async.put_nowait, item)
                except RuntimeError:  # the consumer's event loop is closed: nobody is listening
                    pass
            else:
                self._sync.put(item)

    # Consumer side ---------------------------------------------------------------------------------------
    def __iter__(self) -> Iterator[RequestOutput]:
        """Per-step outputs while streaming (each with `token_ids_diff` / `text_diff`), else the final one."""
        if self._loop is not None:
            raise RuntimeError("this handle was made inside an event loop: iterate it with `async for`")
        while (item := self._sync.get()) is not _END:
            if self.streaming or item.finished:
                yield item

    async def __aiter__(self) -> AsyncIterator[RequestOutput]:
        if self._async is None:
            raise RuntimeError("this handle was made outside an event loop: iterate it with `for`")
        while (item := await self._async.get()) is not _END:
            if self.streaming or item.finished:
                yield item

    def result(self, timeout: float | None = None) -> RequestOutput:
        """Block until the request finishes; its final output (all tokens, full text). Any number of threads may
        wait on one handle; a non-streaming handle can still be iterated afterwards (a streaming one has no outputs
        left: result() drops those not iterated yet).

        Raises:
            TimeoutError: not finished within `timeout` seconds.
        """
        if self._final is None and self._loop is not None:
            raise RuntimeError("this handle was made inside an event loop: use `await handle.aresult()`")
        if not self._done.wait(timeout):
            raise TimeoutError(f"request {self.request_id} did not finish within {timeout} s")
        if self.streaming:  # the per-step outputs nobody iterated (each holds every token so far): dropped
            try:
                while self._sync.get_nowait() is not _END:
                    pass
            except queue.Empty:
                pass
        assert self._final is not None
        return self._final

    async def aresult(self) -> RequestOutput:
        """The final output, awaited in the event loop the handle was made in."""
        async for _ in self:
            pass
        assert self._final is not None
        return self._final
