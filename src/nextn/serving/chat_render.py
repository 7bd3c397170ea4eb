"""Chat messages to prompt text for `nextn serve`: the bounded template render, stopped when its client leaves.

The render itself is `EngineTokenizer.render_chat` (a worker process with a time, size and memory budget,
`nextn.runtime.template_render`). Here it runs in at most `num_workers` threads of its own (a `CapacityLimiter`, so
renders waiting for a worker hold no thread and never starve the server's other thread work), and the request
handler polls its client every DISCONNECT_POLL_S: a client that left cancels its render, which kills the worker (or
drops the render from the queue) at once. A template that passes its budget is a 400 naming the limit.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import threading

import anyio
from starlette.requests import Request

from nextn.runtime.template_render import (ChatTemplateError, ChatTemplateLimitError, RenderCancelled,
                                           RendererClosed, RenderLimits, shared_renderer)
from nextn.runtime.tokenizer import EngineTokenizer
from nextn.serving.openai_protocol import APIError

DISCONNECT_POLL_S = 0.25
logger = logging.getLogger(__name__)


class ServerChatRenderer:
    """Renders a request's messages with the engine's chat template (or `chat_template`), within `limits`.

    Args:
        tokenizer: the engine's tokenizer.
        chat_template: Jinja source used instead of the tokenizer's (the server's fallback), or None.
        limits: each render's time and output-size budget.
    """

    def __init__(self, tokenizer: EngineTokenizer, chat_template: str | None, limits: RenderLimits) -> None:
        self.tokenizer, self.chat_template, self.limits = tokenizer, chat_template, limits
        self.renderer = shared_renderer()
        self.renderer.start()  # the workers' imports run while the server starts, not in the first request
        self._limiter: anyio.CapacityLimiter | None = None

    async def render(self, messages: list[dict], raw: Request, tools: list[dict] | None = None,
                     template_kwargs: dict | None = None) -> str:
        """The prompt text of `messages` (and `tools`, OpenAI's function definitions, for templates that list them;
        `template_kwargs`, the request's `chat_template_kwargs`).

        Raises:
            APIError: 400 when the template rejects the messages or passes its budget (code "chat_template_limit"),
                499 when the client disconnected first (its render is stopped), 503 when the server is shutting down.
        """
        if self._limiter is None:  # created in the event loop that uses it
            self._limiter = anyio.CapacityLimiter(self.renderer.num_workers)
        cancel = threading.Event()
        fn = functools.partial(self.tokenizer.render_chat, messages, self.chat_template, limits=self.limits,
                               cancel=cancel, tools=tools, template_kwargs=template_kwargs)
        task = asyncio.ensure_future(anyio.to_thread.run_sync(fn, limiter=self._limiter))
        try:
            while not (await asyncio.wait({task}, timeout=DISCONNECT_POLL_S))[0]:
                if await raw.is_disconnected():
                    raise APIError(499, "client disconnected")
            return task.result()
        except ChatTemplateLimitError as e:
            raise APIError(400, str(e), "messages", "chat_template_limit") from None
        except RendererClosed as e:
            raise APIError(503, str(e), type_="server_error") from None
        except ChatTemplateError as e:
            raise APIError(400, str(e), "messages") from None
        finally:
            if not task.done():  # the client left, or this handler was cancelled (server shutdown)
                cancel.set()
                task.cancel()
                task.add_done_callback(_consume)


def _consume(task: asyncio.Future) -> None:
    """Retrieve an abandoned render's outcome (RenderCancelled, as a rule) so asyncio does not log it as lost."""
    exc = None if task.cancelled() else task.exception()
    if exc is not None and not isinstance(exc, (RenderCancelled, ChatTemplateError)):
        logger.warning("an abandoned chat-template render failed: %s: %s", type(exc).__name__, exc)
