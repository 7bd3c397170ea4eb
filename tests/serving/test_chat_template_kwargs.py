"""`chat_template_kwargs` (vLLM's name): more names handed to the chat template — Qwen3's `enable_thinking` switch —
through `EngineTokenizer.render_chat`, the OpenAI server's chat route and `nextn generate --chat`. The text equals
transformers' `apply_chat_template(..., enable_thinking=False)`; names nextn sets itself, non-identifiers and too
many names are refused before any render, and the server keeps serving."""

from __future__ import annotations

import json
import shutil

import openai
import pytest

from nextn import LLM, SamplingParams
from nextn.build.manifest import EngineManifest, file_checksum
from nextn.cli.main import main
from nextn.runtime.tokenizer import MAX_TEMPLATE_KWARGS, ChatTemplateError
from nextn.serving.openai_server import create_app

# ChatML with Qwen3's thinking switch (its released template ends the generation prompt this way)
QWEN3_STYLE = (
    "{%- for m in messages %}{{- '<|im_start|>' + m.role + '\\n' + m.content + '<|im_end|>\\n' }}{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}"
    "{%- if enable_thinking is defined and enable_thinking is false %}{{- '<think>\\n\\n</think>\\n\\n' }}{%- endif %}"
    "{%- endif %}")
MESSAGES = [{"role": "user", "content": "Name a colour."}]
OFF = {"enable_thinking": False}
MAX_TOKENS = 6


@pytest.fixture(scope="module")
def engine_dir(checkpoints, tmp_path_factory):
    """The tiny DeepSeek-V3 engine (its tokenizer) with QWEN3_STYLE as its chat template, as a build writes it."""
    out = tmp_path_factory.mktemp("thinking") / "engine"
    shutil.copytree(checkpoints.engine(distill_steps=0), out)
    (out / "chat_template.jinja").write_text(QWEN3_STYLE)
    manifest = EngineManifest.load(out)
    if "chat_template.jinja" not in manifest.tokenizer_files:
        manifest.tokenizer_files.append("chat_template.jinja")
    manifest.checksums["chat_template.jinja"] = file_checksum(out / "chat_template.jinja")
    manifest.save(out)
    return out


@pytest.fixture(scope="module")
def llm(engine_dir):
    llm = LLM(engine_dir, speculative_config=None, device="cpu")
    yield llm
    llm.shutdown()


def _reference_ids(llm, **kwargs) -> list[int]:
    text = llm.tokenizer.tok.apply_chat_template(MESSAGES, tokenize=False, add_generation_prompt=True, **kwargs)
    return llm.tokenizer.tok.encode(text, add_special_tokens=False)


def test_render_passes_the_kwargs_as_transformers_does(llm):
    off = llm.tokenizer.render_chat(MESSAGES, template_kwargs=OFF)
    assert off == llm.tokenizer.tok.apply_chat_template(MESSAGES, tokenize=False, add_generation_prompt=True,
                                                         enable_thinking=False)
    assert off.endswith("<think>\n\n</think>\n\n")
    assert "<think>" not in llm.tokenizer.render_chat(MESSAGES)  # the control: without them, the default
    assert llm.tokenizer.apply_chat_template(MESSAGES, template_kwargs=OFF) == _reference_ids(llm, enable_thinking=False)


@pytest.mark.parametrize("kwargs, says", [
    ({"add_generation_prompt": False}, "set by nextn"),
    ({"tools": []}, "request's `tools`"),
    ({"not a name": 1}, "not a name"),
    ({f"k{i}": i for i in range(MAX_TEMPLATE_KWARGS + 1)}, f"at most {MAX_TEMPLATE_KWARGS}"),
])
def test_refused_kwargs_say_why(llm, kwargs, says):
    with pytest.raises(ChatTemplateError, match=says):
        llm.tokenizer.render_chat(MESSAGES, template_kwargs=kwargs)


def test_server_chat_route(llm, local_server_cls):
    server = local_server_cls(create_app(llm, "tiny"))
    client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="x", max_retries=0, timeout=120)
    try:
        for kwargs, ref_kwargs in ((OFF, OFF), (None, {})):
            ids = _reference_ids(llm, **ref_kwargs)
            ref = llm.generate(ids, SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True)).outputs[0]
            out = client.chat.completions.create(
                model="tiny", messages=MESSAGES, max_tokens=MAX_TOKENS,
                extra_body={"ignore_eos": True, **({"chat_template_kwargs": kwargs} if kwargs else {})})
            assert out.usage.prompt_tokens == len(ids) and out.choices[0].message.content == ref.text
        with pytest.raises(openai.BadRequestError) as e:
            client.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=2,
                                           extra_body={"chat_template_kwargs": {"messages": []}})
        assert "chat_template_kwargs" in str(e.value) and "set by nextn" in str(e.value)
        # the server still serves
        assert client.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=2).choices
    finally:
        server.stop()


def test_generate_cli(llm, engine_dir, capsys):
    ids = _reference_ids(llm, enable_thinking=False)
    ref = llm.generate(ids, SamplingParams(max_tokens=MAX_TOKENS)).outputs[0]
    assert main(["generate", "--engine_dir", str(engine_dir), "--chat", "--prompt", MESSAGES[0]["content"],
                 "--chat_template_kwargs", json.dumps(OFF), "--max_tokens", str(MAX_TOKENS), "--json"]) == 0
    line = json.loads(capsys.readouterr().out.splitlines()[0])
    assert line["token_ids"] == ref.token_ids
    assert main(["generate", "--engine_dir", str(engine_dir), "--prompt", "x",
                 "--chat_template_kwargs", json.dumps(OFF)]) == 2
    assert "goes with --chat" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["generate", "--engine_dir", str(engine_dir), "--chat", "--prompt", "x", "--chat_template_kwargs", "[1]"])
    assert "JSON object" in capsys.readouterr().err
