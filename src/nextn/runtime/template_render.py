"""Chat templates rendered under a time, output-size and memory budget, in a pool of worker processes.

A chat template is Jinja code that ships with a checkpoint (a GGUF's `tokenizer.chat_template`, an HF
tokenizer_config.json's): transformers renders it in Jinja's sandbox, which stops escapes but not cost — a nested
`{% for %}` over `range(100000)` runs for hours, `'x' * 2000000000` takes 35 s and 6 GB. Such work cannot be stopped
inside a Python thread, so it runs in a child process (`template_worker.py`: jinja2 and transformers' renderer only,
nice 10, `RLIMIT_AS` = its imports + `memory_bytes`) that the parent kills when the render passes its wall-clock
budget or its caller cancels it (a client that left), and replaces at once. The worker also refuses string, list
and int operators whose result would pass the caps, and stops the output at `max_chars`, before allocating.

The text equals `tokenizer.apply_chat_template(messages, tokenize=False, ...)` (the worker runs transformers'
`render_jinja_template`); the caller passes the template source and the special tokens, as that method does.
Workers start with the pool (`start()`) or at first use, ~1 s each, and are reused: a normal render costs a pipe
round trip (about a millisecond) plus the template.
"""

from __future__ import annotations

import atexit
import json
import math
import os
import select
import subprocess
import sys
import threading
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from nextn.runtime.template_worker import HEADER

WORKER_PATH = Path(__file__).with_name("template_worker.py")
DEFAULT_TIMEOUT_S = 5.0  # normal templates render in milliseconds; generous for a loaded 2-core machine
DEFAULT_MAX_CHARS = 1 << 24  # 16 Mi characters of output (the server passes its prompt limit instead)
DEFAULT_MEMORY_BYTES = 1 << 30  # address space a worker may add beyond its imports
DEFAULT_NUM_WORKERS = 2
STARTUP_TIMEOUT_S = 60.0  # a worker's imports (about 1 s; longer on a machine under load)
POLL_S = 0.05  # how often a waiting render checks its cancel event


class ChatTemplateError(ValueError):
    """Messages that cannot be rendered: no chat template in the engine, or the template rejected them."""


class ChatTemplateLimitError(ChatTemplateError):
    """The template passed a render budget (time, output size, memory) and was stopped; the message names which."""


class RendererClosed(ChatTemplateError):
    """The renderer was closed (the process is shutting down); renders in flight end with this at once."""


class RenderCancelled(Exception):
    """The caller cancelled the render (its client left); the worker was stopped."""


@dataclass(frozen=True)
class RenderLimits:
    """Per-render budget.

    Attributes:
        timeout_s: wall-clock seconds from the worker receiving the request to its answer (> 0, finite).
        max_chars: the most characters the output, or any string or list the template builds, may hold (≥ 1).
    """

    timeout_s: float = DEFAULT_TIMEOUT_S
    max_chars: int = DEFAULT_MAX_CHARS

    def __post_init__(self) -> None:
        if isinstance(self.timeout_s, bool) or not isinstance(self.timeout_s, (int, float)) \
                or not math.isfinite(self.timeout_s) or self.timeout_s <= 0:
            raise ValueError(f"timeout_s must be a finite number of seconds > 0, got {self.timeout_s!r}")
        if isinstance(self.max_chars, bool) or not isinstance(self.max_chars, int) or self.max_chars < 1:
            raise ValueError(f"max_chars must be an int ≥ 1, got {self.max_chars!r}")


def _interpreter() -> str:
    """This Python's interpreter: `sys.executable`, or where an embedding host (e.g. Triton's Python-backend stub)
    sets it to itself or nothing, the python of `sys.prefix`."""
    if sys.executable and Path(sys.executable).name.startswith("python"):
        return sys.executable
    version = f"python{sys.version_info.major}.{sys.version_info.minor}"
    for candidate in (Path(sys.prefix) / "bin" / version, Path(sys.prefix) / "bin" / "python3",
                      Path(sys.exec_prefix) / "bin" / version):
        if candidate.is_file():
            return str(candidate)
    return sys.executable or "python3"


class _WorkerGone(Exception):
    """The worker exited or sent something that is not a frame."""


class _Worker:
    """One worker process and its frame reader (os.read on the pipe: select() sees what is buffered)."""

    def __init__(self, memory_bytes: int) -> None:
        try:
            self.proc = subprocess.Popen([_interpreter(), "-P", str(WORKER_PATH), str(memory_bytes)],
                                         stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL)
        except OSError as e:
            raise ChatTemplateError(f"cannot start a chat-template worker ({_interpreter()}): {e}") from None
        self.ready = False
        self._buf = bytearray()

    def send(self, obj: object) -> None:
        """Raises ChatTemplateError for data that is not JSON (a cycle, nesting past the recursion limit)."""
        try:
            # like transformers' _plain_template_data, an object that is not JSON data becomes a "<Type>" placeholder
            data = json.dumps(obj, ensure_ascii=False, default=lambda o: f"<{type(o).__name__}>")
        except (ValueError, RecursionError) as e:
            raise ChatTemplateError(f"the messages are not JSON data ({e}): send dicts of strings") from None
        data = data.encode("utf-8", "surrogatepass")
        try:
            self.proc.stdin.write(HEADER.pack(len(data)) + data)
            self.proc.stdin.flush()
        except (BrokenPipeError, OSError) as e:
            raise _WorkerGone(f"the worker exited ({e})") from None

    def receive(self, deadline: float, cancel: threading.Event | None, max_bytes: int) -> dict | None:
        """The next frame, or None when `deadline` (time.monotonic) passes first.

        Raises:
            RenderCancelled: `cancel` was set.
            _WorkerGone: the worker exited, or sent an oversized or malformed frame.
        """
        fd = self.proc.stdout.fileno()
        while True:
            if len(self._buf) >= HEADER.size:
                (size,) = HEADER.unpack_from(self._buf)
                if size > max_bytes:
                    raise _WorkerGone(f"the worker sent a frame of {size} bytes (at most {max_bytes})")
                if len(self._buf) >= HEADER.size + size:
                    data = bytes(self._buf[HEADER.size:HEADER.size + size])
                    del self._buf[:HEADER.size + size]
                    try:
                        frame = json.loads(data.decode("utf-8", "surrogatepass"))
                    except ValueError as e:
                        raise _WorkerGone(f"the worker sent a malformed frame ({e})") from None
                    if not isinstance(frame, dict):
                        raise _WorkerGone("the worker sent a frame that is not an object")
                    return frame
            if cancel is not None and cancel.is_set():
                raise RenderCancelled("the render was cancelled")
            left = deadline - time.monotonic()
            if left <= 0:
                return None
            if select.select([fd], [], [], min(POLL_S, left))[0]:
                chunk = os.read(fd, 1 << 20)
                if not chunk:
                    raise _WorkerGone(f"the worker exited (code {self.proc.wait()})")
                self._buf += chunk

    def kill(self) -> None:
        self.proc.kill()
        self.proc.wait()
        for pipe in (self.proc.stdin, self.proc.stdout):
            try:
                pipe.close()
            except OSError:
                pass


class ChatTemplateRenderer:
    """A pool of render workers; `render` is thread-safe and blocks until its worker answers, fails or is stopped.

    Args:
        num_workers: the most renders at once (others wait for a free worker).
        memory_bytes: address space each worker may add beyond its imports (RLIMIT_AS); MemoryError past it.
    """

    def __init__(self, num_workers: int = DEFAULT_NUM_WORKERS, memory_bytes: int = DEFAULT_MEMORY_BYTES) -> None:
        if num_workers < 1 or memory_bytes < 1 << 20:
            raise ValueError(f"num_workers must be ≥ 1 and memory_bytes ≥ 1 MiB, got {num_workers}, {memory_bytes}")
        self.num_workers, self.memory_bytes = num_workers, memory_bytes
        self._idle: list[_Worker] = []
        self._busy: set[_Worker] = set()
        self._cond = threading.Condition()
        self._closed = False

    def start(self) -> None:
        """Start the workers now (non-blocking: their imports run in the background), so that the first render does
        not wait for them."""
        with self._cond:
            while not self._closed and len(self._idle) + len(self._busy) < self.num_workers:
                self._idle.append(_Worker(self.memory_bytes))

    def render(self, template: str, messages: Sequence[Mapping], template_kwargs: Mapping | None = None, *,
               add_generation_prompt: bool = True, limits: RenderLimits | None = None,
               cancel: threading.Event | None = None) -> str:
        """`template` rendered with `messages` (and `template_kwargs`, e.g. the special tokens), as transformers'
        `render_jinja_template`.

        Args:
            template: Jinja source. messages: JSON-able dicts (`role`, `content`, ...), in order.
            limits: the time and size budget (default `RenderLimits()`).
            cancel: set it (from any thread) to stop the render; its worker is killed within POLL_S.
        Returns:
            the rendered text (at most `limits.max_chars` characters).
        Raises:
            ChatTemplateLimitError: the render passed `limits.timeout_s`, `limits.max_chars` or the memory cap (its
                worker was killed and replaced).
            ChatTemplateError: the template raised (e.g. its own role-order check), or the worker could not start.
            RenderCancelled: `cancel` was set first.
        """
        limits = limits or RenderLimits()
        request = {"template": template, "messages": [dict(m) for m in messages],
                   "kwargs": dict(template_kwargs or {}), "add_generation_prompt": add_generation_prompt,
                   "max_chars": limits.max_chars}
        worker, keep = self._acquire(cancel), False
        try:
            if not worker.ready:
                self._wait_ready(worker, cancel)
            worker.send(request)
            reply = worker.receive(time.monotonic() + limits.timeout_s, cancel, 6 * limits.max_chars + 4096)
            if reply is None:
                raise ChatTemplateLimitError(
                    f"the chat template did not finish rendering within {limits.timeout_s:g} s and was stopped: a "
                    "template that loops this long is broken; fix the engine's chat template (chat_template.jinja or "
                    "tokenizer_config.json), or raise the budget (nextn serve --chat_template_timeout)")
            keep = reply.get("kind") != "memory"
            return _text(reply, limits, self.memory_bytes)
        except _WorkerGone as e:
            if self._closed:
                raise RendererClosed("the chat-template renderer was closed (the server is shutting down)") from None
            raise ChatTemplateError(f"the chat-template worker failed: {e}; check that `{_interpreter()} -P "
                                    f"{WORKER_PATH}` starts (it needs jinja2 and transformers)") from None
        finally:
            self._release(worker, keep)

    def close(self) -> None:
        """Stop every worker now; renders in flight or waiting raise `RendererClosed`. Safe from a signal handler
        of the thread that renders nothing (e.g. a server's event loop)."""
        with self._cond:
            self._closed = True
            idle, busy, self._idle = self._idle, list(self._busy), []
            self._cond.notify_all()
        for worker in busy:
            worker.proc.kill()  # its render sees the end of its output and ends; that thread reaps it
        for worker in idle:
            worker.kill()

    def _acquire(self, cancel: threading.Event | None) -> _Worker:
        with self._cond:
            while True:
                if self._closed:
                    raise RendererClosed("the chat-template renderer is closed (the server is shutting down)")
                if cancel is not None and cancel.is_set():
                    raise RenderCancelled("the render was cancelled before it started")
                ready = [w for w in self._idle if w.ready]
                if ready or self._idle:
                    worker = (ready or self._idle)[0]
                    self._idle.remove(worker)
                    break
                if len(self._busy) < self.num_workers:
                    worker = _Worker(self.memory_bytes)
                    break
                self._cond.wait(POLL_S)
            self._busy.add(worker)
            return worker

    def _wait_ready(self, worker: _Worker, cancel: threading.Event | None) -> None:
        frame = worker.receive(time.monotonic() + STARTUP_TIMEOUT_S, cancel, 1024)
        if frame != {"ready": True}:
            raise _WorkerGone(f"no ready signal within {STARTUP_TIMEOUT_S:g} s" if frame is None else
                              f"an unexpected first frame {str(frame)[:80]}")
        worker.ready = True

    def _release(self, worker: _Worker, keep: bool) -> None:
        with self._cond:
            self._busy.discard(worker)
            if keep and not self._closed:
                self._idle.append(worker)
                worker = None
            elif not self._closed:  # a fresh one in its place, starting now (else at the next render)
                try:
                    self._idle.append(_Worker(self.memory_bytes))
                except ChatTemplateError:
                    pass
            self._cond.notify()
        if worker is not None:
            worker.kill()


def _text(reply: dict, limits: RenderLimits, memory_bytes: int) -> str:
    kind, error = reply.get("kind"), str(reply.get("error", ""))[:2000]
    if kind == "size":
        raise ChatTemplateLimitError(f"the chat template was stopped at its cap of {limits.max_chars} characters "
                                     f"({error}): send fewer or shorter messages, or fix the template")
    if kind == "memory":
        raise ChatTemplateLimitError(f"the chat template was stopped at its memory cap of {memory_bytes >> 20} MiB: "
                                     "a template that needs this much is broken; fix the engine's chat template")
    if kind is not None:
        raise ChatTemplateError(f"the chat template rejected the messages: {error}")
    text = reply.get("text")
    if not isinstance(text, str) or len(text) > limits.max_chars:
        raise _WorkerGone("the worker's answer is not text within the cap")
    return text


_shared: ChatTemplateRenderer | None = None
_shared_lock = threading.Lock()


def shared_renderer() -> ChatTemplateRenderer:
    """This process's pool (DEFAULT_NUM_WORKERS workers, DEFAULT_MEMORY_BYTES each), created at first use and
    closed at exit."""
    global _shared
    with _shared_lock:
        if _shared is None:
            _shared = ChatTemplateRenderer()
            atexit.register(_shared.close)
        return _shared
