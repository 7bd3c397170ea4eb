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
import threading
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from nextn.runtime.worker_pool import (POLL_S, PoolClosed, WorkCancelled, WorkerGone,  # noqa: F401 (POLL_S: docs)
                                       WorkerPool, check_timeout_s, interpreter)

WORKER_PATH = Path(__file__).with_name("template_worker.py")
DEFAULT_TIMEOUT_S = 5.0  # normal templates render in milliseconds; generous for a loaded 2-core machine
DEFAULT_MAX_CHARS = 1 << 24  # 16 Mi characters of output (the server passes its prompt limit instead)
DEFAULT_MEMORY_BYTES = 1 << 30  # address space a worker may add beyond its imports
DEFAULT_NUM_WORKERS = 2


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
        check_timeout_s(self.timeout_s)
        if isinstance(self.max_chars, bool) or not isinstance(self.max_chars, int) or self.max_chars < 1:
            raise ValueError(f"max_chars must be an int ≥ 1, got {self.max_chars!r}")


class ChatTemplateRenderer(WorkerPool):
    """A pool of render workers; `render` is thread-safe and blocks until its worker answers, fails or is stopped.

    Args:
        num_workers: the most renders at once (others wait for a free worker).
        memory_bytes: address space each worker may add beyond its imports (RLIMIT_AS); MemoryError past it.
    """

    def __init__(self, num_workers: int = DEFAULT_NUM_WORKERS, memory_bytes: int = DEFAULT_MEMORY_BYTES) -> None:
        if num_workers < 1 or memory_bytes < 1 << 20:
            raise ValueError(f"num_workers must be ≥ 1 and memory_bytes ≥ 1 MiB, got {num_workers}, {memory_bytes}")
        super().__init__(lambda: [interpreter(), "-P", str(WORKER_PATH), str(memory_bytes)], num_workers,
                         "chat-template")
        self.memory_bytes = memory_bytes

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
        try:
            worker = self.acquire(cancel)
        except PoolClosed:
            raise RendererClosed("the chat-template renderer is closed (the server is shutting down)") from None
        except WorkCancelled:
            raise RenderCancelled("the render was cancelled before it started") from None
        except WorkerGone as e:
            raise ChatTemplateError(str(e)) from None
        keep = False
        try:
            worker.wait_ready(cancel)
            try:
                worker.send(request)
            except ValueError as e:
                keep = True
                raise ChatTemplateError(f"the messages are {e}: send dicts of strings") from None
            reply = worker.receive(time.monotonic() + limits.timeout_s, cancel, 6 * limits.max_chars + 4096)
            if reply is None:
                raise ChatTemplateLimitError(
                    f"the chat template did not finish rendering within {limits.timeout_s:g} s and was stopped: a "
                    "template that loops this long is broken; fix the engine's chat template (chat_template.jinja or "
                    "tokenizer_config.json), or raise the budget (nextn serve --chat_template_timeout)")
            keep = reply.get("kind") != "memory"
            return _text(reply, limits, self.memory_bytes)
        except WorkCancelled:
            raise RenderCancelled("the render was cancelled") from None
        except WorkerGone as e:
            if self.closed:
                raise RendererClosed("the chat-template renderer was closed (the server is shutting down)") from None
            raise ChatTemplateError(f"the chat-template worker failed: {e}; check that `{interpreter()} -P "
                                    f"{WORKER_PATH}` starts (it needs jinja2 and transformers)") from None
        finally:
            self.release(worker, keep)


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
        raise WorkerGone("the worker's answer is not text within the cap")
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
