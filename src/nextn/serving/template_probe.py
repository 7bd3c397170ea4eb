"""How a chat template wants an assistant's earlier tool calls: their arguments as an object or as JSON text.

OpenAI clients send a call's `arguments` as JSON text. Templates disagree on what they take: transformers'
convention, which Qwen2.5's and Hermes' templates follow, is an object (`{{ tool_call.arguments | tojson }}`);
DeepSeek-V3's template concatenates the arguments as text (`'\\n' + tool['function']['arguments']`) and raises on an
object. `probe_tool_call_form` renders one sample conversation (a user turn, an assistant tool call, the tool's
result) both ways and records which renders and which shows the arguments as JSON in the text; the server renders
every request in the recorded form (`ToolCallForm.arguments_as_text`). `TemplateProbe` runs the probe once, on first
use, and keeps the result.
"""

from __future__ import annotations

import logging
import re
import threading
from collections.abc import Callable
from dataclasses import dataclass

from nextn.runtime.template_render import ChatTemplateError, RendererClosed
from nextn.serving.openai_tools import FunctionCall, ToolCall, message_for_template

__all__ = ["ToolCallForm", "TemplateProbe", "probe_tool_call_form", "SAMPLE_TOOL"]

logger = logging.getLogger(__name__)

_KEY, _VALUE = "nextn_probe_key", "nextn_probe_value"
#: The sample call's arguments, as the JSON text an OpenAI client sends.
SAMPLE_ARGUMENTS = f'{{"{_KEY}": "{_VALUE}"}}'
#: The function the sample conversation calls (passed to the template as `tools`).
SAMPLE_TOOL = {"type": "function", "function": {
    "name": "nextn_probe", "description": "A sample function",
    "parameters": {"type": "object", "properties": {_KEY: {"type": "string"}}, "required": [_KEY]}}}
_SHOWN = re.compile(r"\{\s*\"" + _KEY + r"\"\s*:\s*\"" + _VALUE + r"\"\s*\}")  # JSON, not a quoted JSON string

#: render(messages, tools) → the prompt text; raises ChatTemplateError when the template rejects the messages.
Render = Callable[[list[dict], list[dict]], str]


@dataclass(frozen=True)
class ToolCallForm:
    """What a chat template did with the sample tool call, in each form of its arguments.

    `*_renders`: the template rendered the conversation; `*_shows`: the text holds the arguments as a JSON object
    (`{"key": "value"}`, any whitespace; a Python dict's repr or a JSON-quoted string does not count).
    """

    object_renders: bool
    object_shows: bool
    text_renders: bool
    text_shows: bool

    @property
    def arguments_as_text(self) -> bool:
        """Whether requests pass arguments as JSON text: only where the object form fails or hides them and the
        text form renders and shows them (or renders where the object form does not). Otherwise objects,
        transformers' convention; a template that takes neither then rejects the request itself."""
        return not self.object_shows and self.text_renders and (self.text_shows or not self.object_renders)

    def describe(self) -> str:
        """One line for the server's log."""
        form = "JSON text" if self.arguments_as_text else "objects"
        shown = self.text_shows if self.arguments_as_text else self.object_shows
        if not (self.object_renders or self.text_renders):
            return ("the chat template rejects an assistant's tool calls in either form: requests that carry them "
                    "get the template's error")
        return (f"the chat template gets tool-call arguments as {form}"
                f"{'' if shown else ' (it does not show them in the prompt)'}")


def sample_messages(arguments_as_text: bool) -> list[dict]:
    """The probe's conversation as the template gets it: a user turn, an assistant's call (content None, as
    clients send it), the tool's result."""
    call = ToolCall(id="call00000", function=FunctionCall(name=SAMPLE_TOOL["function"]["name"],
                                                          arguments=SAMPLE_ARGUMENTS))
    return [message_for_template("user", "What does the sample function say?", None, None, None),
            message_for_template("assistant", None, [call], None, None, arguments_as_text),
            message_for_template("tool", '{"result": "ok"}', None, call.id, None)]


def probe_tool_call_form(render: Render) -> ToolCallForm:
    """Render the sample conversation with the arguments as an object, then as JSON text (two renders).

    Args:
        render: renders (messages, tools) with the server's template and budget.
    Returns:
        which form renders and which shows the arguments.
    Raises:
        RendererClosed: the renderer closed during the probe (nothing is learned about the template).
    """
    def attempt(as_text: bool) -> tuple[bool, bool]:
        try:
            text = render(sample_messages(as_text), [SAMPLE_TOOL])
        except RendererClosed:
            raise
        except ChatTemplateError:  # the template raised, or passed its budget: this form does not render
            return False, False
        return True, _SHOWN.search(text) is not None

    (obj_ok, obj_shows), (text_ok, text_shows) = attempt(False), attempt(True)
    return ToolCallForm(obj_ok, obj_shows, text_ok, text_shows)


class TemplateProbe:
    """`probe_tool_call_form` run once, by its first caller (callers that come meanwhile wait for its result).

    Args:
        render: as `probe_tool_call_form`'s (it may block: call `tool_call_form` off the event loop).
    """

    def __init__(self, render: Render) -> None:
        self._render, self._lock = render, threading.Lock()
        self._form: ToolCallForm | None = None

    def tool_call_form(self) -> ToolCallForm:
        """The template's `ToolCallForm`, probed on the first call. Raises RendererClosed as the probe."""
        with self._lock:
            if self._form is None:
                self._form = probe_tool_call_form(self._render)
                logger.info(self._form.describe())
            return self._form
