"""The chat-template probe: which form of an assistant's tool-call arguments (object or JSON text) real templates take
— DeepSeek-V3's (the tiny test checkpoints' tokenizer), Qwen2.5's (Hermes-style), SmolLM2's (no tools), nextn's
fallback — and the server rendering every request in the probed form, the probe run once."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import pytest

from nextn.runtime.template_render import RendererClosed
from nextn.runtime.tokenizer import EngineTokenizer
from nextn.serving import openai_protocol as p
from nextn.serving.openai_server import FALLBACK_CHAT_TEMPLATE, OpenAIServer
from nextn.serving.template_probe import TemplateProbe, ToolCallForm, probe_tool_call_form

ROOT = Path(__file__).resolve().parents[2]
QWEN = ROOT / "runs" / "models" / "qwen2.5-coder-0.5b" / "qwen2.5-coder-0.5b-instruct-q4_k_m.gguf"
SMOLLM2 = ROOT.parent / "shared" / "data" / "models" / "smollm2-135m-instruct" / "SmolLM2-135M-Instruct.Q4_1.gguf"
CALL = {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}
CONVERSATION = [{"role": "user", "content": "Weather in Paris?"},
                {"role": "assistant", "content": None, "tool_calls": [CALL]},
                {"role": "tool", "tool_call_id": "call_1", "content": '{"temp": 21}'}]


@pytest.fixture(scope="module")
def deepseek_tokenizer(checkpoints):
    """The tiny DeepSeek-V3 checkpoints' tokenizer (the real DeepSeek-V3 tokenizer and chat template)."""
    from transformers import AutoTokenizer

    return EngineTokenizer(AutoTokenizer.from_pretrained(str(checkpoints.checkpoint(distill_steps=0))))


_SIZES = {0: 1, 1: 1, 2: 2, 3: 2, 4: 4, 5: 4, 6: 4, 7: 1, 10: 8, 11: 8, 12: 8}  # GGUF scalar value types → bytes


def _gguf_template(path: Path, why: str) -> str:
    """`tokenizer.chat_template` of a GGUF, read from its metadata (GGUF v3 layout; `gguf.GGUFReader` would map
    every tensor and token first, seconds per file)."""
    if not path.is_file():
        pytest.skip(f"{path} is absent: {why}")
    import struct

    with path.open("rb") as fh:
        def read(fmt: str):
            return struct.unpack("<" + fmt, fh.read(struct.calcsize("<" + fmt)))[0]

        def text() -> str:
            return fh.read(read("Q")).decode("utf-8")

        def skip(kind: int) -> None:
            if kind == 8:
                fh.seek(read("Q"), 1)
            elif kind == 9:
                item, count = read("I"), read("Q")
                if item in _SIZES:
                    fh.seek(_SIZES[item] * count, 1)
                else:
                    for _ in range(count):
                        skip(item)
            else:
                fh.seek(_SIZES[kind], 1)

        assert fh.read(4) == b"GGUF" and read("I") == 3
        read("Q")  # tensors
        for _ in range(read("Q")):  # key-value pairs
            key, kind = text(), read("I")
            if key == "tokenizer.chat_template" and kind == 8:
                return text()
            skip(kind)
    raise AssertionError(f"{path} has no tokenizer.chat_template")


def _probe(tok: EngineTokenizer, template: str | None = None) -> ToolCallForm:
    """The probe over `template` rendered as the server renders (`render_chat`: the bounded worker, `tools=`).
    A foreign template is rendered with this tokenizer's special tokens, which the templates below do not use."""
    return probe_tool_call_form(lambda messages, tools: tok.render_chat(messages, template, tools=tools))


def test_deepseek_v3_template_takes_arguments_as_text(deepseek_tokenizer):
    form = _probe(deepseek_tokenizer)  # it concatenates the arguments ('\n' + arguments): an object fails
    assert form == ToolCallForm(object_renders=False, object_shows=False, text_renders=True, text_shows=True)
    assert form.arguments_as_text and "JSON text" in form.describe()


def test_qwen_template_takes_objects(deepseek_tokenizer):
    template = _gguf_template(QWEN, "fetch it with `python ../shared/models/fetch_models.py qwen2.5-coder-0.5b "
                                    "--dest runs/models` (CI has no Qwen2.5 GGUF)")
    form = _probe(deepseek_tokenizer, template)  # `arguments | tojson`: text renders too, but as a quoted string
    assert form == ToolCallForm(object_renders=True, object_shows=True, text_renders=True, text_shows=False)
    assert not form.arguments_as_text and "objects" in form.describe()
    as_object = {**CALL, "function": {"name": "get_weather", "arguments": json.loads(CALL["function"]["arguments"])}}
    text = deepseek_tokenizer.render_chat(
        [CONVERSATION[0], {"role": "assistant", "content": None, "tool_calls": [as_object]}], template)
    assert '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>' in text


def test_smollm2_template_takes_neither_form(deepseek_tokenizer):
    template = _gguf_template(SMOLLM2, "../shared/data is not checked out")
    form = _probe(deepseek_tokenizer, template)  # '\n' + content with content None: no tool calls at all
    assert form == ToolCallForm(False, False, False, False)
    assert not form.arguments_as_text and "rejects" in form.describe()


def test_a_template_that_ignores_or_prints_the_arguments(deepseek_tokenizer):
    # nextn's fallback writes only the content: both forms render, neither shows them; objects (the convention)
    form = _probe(deepseek_tokenizer, FALLBACK_CHAT_TEMPLATE)
    assert form == ToolCallForm(True, False, True, False) and not form.arguments_as_text
    assert "does not show" in form.describe()
    # printing the arguments shows a Python dict's repr for an object, the JSON for text: text
    printing = ("{% for m in messages %}{{ m.content or '' }}{% for c in m.tool_calls or [] %}"
                "{{ c.function.arguments }}{% endfor %}{% endfor %}")
    form = _probe(deepseek_tokenizer, printing)
    assert form == ToolCallForm(True, False, True, True) and form.arguments_as_text


def test_the_probe_runs_once_and_a_closed_renderer_is_not_recorded():
    calls = []

    def render(messages, tools):
        calls.append(messages[1]["tool_calls"][0]["function"]["arguments"])
        if len(calls) == 1:
            raise RendererClosed("closed")
        return str(messages)

    probe = TemplateProbe(render)
    with pytest.raises(RendererClosed):
        probe.tool_call_form()
    form = probe.tool_call_form()
    assert probe.tool_call_form() is form and len(calls) == 3  # the failed try, then object and text once
    assert calls[1:] == [{"nextn_probe_key": "nextn_probe_value"}, '{"nextn_probe_key": "nextn_probe_value"}']


@pytest.fixture(scope="module")
def server(checkpoints):
    from nextn import LLM

    llm = LLM(checkpoints.engine(distill_steps=0), speculative_config=None, device="cpu")
    yield OpenAIServer(llm, "tiny")
    llm.shutdown()


class _Client:
    """A request's client that stays connected."""

    async def is_disconnected(self) -> bool:
        return False


def test_the_server_renders_in_the_probed_form_without_retrying(server, monkeypatch):
    renders = []
    original = EngineTokenizer.render_chat

    def counted(self, messages, *args, **kwargs):
        renders.append([m.get("tool_calls") for m in messages])
        return original(self, messages, *args, **kwargs)

    monkeypatch.setattr(EngineTokenizer, "render_chat", counted)
    plain = [p.ChatMessage.model_validate(CONVERSATION[0])]
    server.chat_ids(plain)
    assert len(renders) == 1  # no tool calls: no probe
    messages = [p.ChatMessage.model_validate(m) for m in CONVERSATION]
    ids = server.chat_ids(messages)
    assert len(renders) == 4  # the probe (object, then text), then the request once, its arguments as text
    assert renders[-1][1][0]["function"]["arguments"] == '{"city": "Paris"}'
    text = server.tokenizer.tok.decode(ids)
    assert 'get_weather\n```json\n{"city": "Paris"}\n```' in text

    async def both() -> list[list[int]]:
        return [await server._chat_ids(messages, _Client()) for _ in range(2)]

    assert asyncio.run(both()) == [ids, ids] and len(renders) == 6  # the probe is not run again, nor a retry
