"""The grammars an OpenAI request asks for (`response_format`, `guided_*`, `tool_choice`), made ready before it is
submitted: converted and compiled in the engine's grammar workers under their budget (`runtime/grammar_pool.py`)
while a worker thread of the server waits — never its event loop — and the engine's refusals as HTTP errors.
"""

from __future__ import annotations

from typing import Any

import anyio

from nextn.runtime.grammar_pool import GrammarBusyError, GrammarLimitError
from nextn.runtime.request_validation import RequestSamplingParamsError
from nextn.serving import openai_protocol as p
from nextn.serving.openai_tools import tool_call_grammar

__all__ = ["compile_grammars", "tool_grammar"]


async def compile_grammars(engine: Any, params: list) -> None:
    """Compile the grammars of `params` (SamplingParams) into `engine`'s cache before they are submitted.

    Raises:
        p.APIError: 400 naming why a grammar cannot be used (its budget included: code "grammar_limit"); 503 when
            the grammar workers are all busy (code "grammar_busy").
    """
    for sp in params:
        if sp.guided_decoding is not None:
            try:
                await anyio.to_thread.run_sync(engine.compile_grammar, sp)
            except RequestSamplingParamsError as e:
                raise grammar_error(e, None) from None


async def tool_grammar(engine: Any, req: p._SamplingRequest) -> str | None:
    """The EBNF grammar the request's `tool_choice` enforces (`tool_call_grammar`, converted by `engine`'s grammar
    workers under their budget), or None without one. Raises p.APIError as `compile_grammars`, and 400 for a
    tool_choice that names no tool."""
    tools = getattr(req, "tools", None)
    if not tools or req.tool_choice in (None, "auto", "none"):
        return None
    try:
        return await anyio.to_thread.run_sync(tool_call_grammar, tools, req.tool_choice, engine.tool_call_ebnf)
    except RequestSamplingParamsError as e:
        raise grammar_error(e, "tools") from None
    except ValueError as e:
        raise p.APIError(400, str(e), "tool_choice") from None


def grammar_error(e: Exception, param: str | None) -> p.APIError:
    """The HTTP error of a grammar the engine refused: 503 when its workers are busy, else 400 naming why."""
    if isinstance(e.__cause__, GrammarBusyError):
        return p.APIError(503, str(e), param, "grammar_busy", type_="server_error")
    code = "grammar_limit" if isinstance(e.__cause__, GrammarLimitError) else None
    return p.APIError(400, str(e), param, code)
