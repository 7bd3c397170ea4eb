"""Chat templates render in worker processes under a time, size and memory budget (`runtime/template_render.py`):
the text equals transformers' `apply_chat_template`; hostile templates (endless loops, huge strings, doublings,
memory blow-ups, output floods) are stopped within their budget with `ChatTemplateLimitError`, the worker is
replaced, and the next render works; a cancelled render kills its worker at once."""

from __future__ import annotations

import json
import os
import threading
import time
from pathlib import Path

import pytest

from nextn.runtime.template_render import (ChatTemplateError, ChatTemplateLimitError, ChatTemplateRenderer,
                                           RenderCancelled, RenderLimits)
from nextn.runtime.tokenizer import EngineTokenizer

FOREVER = "{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}"
MESSAGES = [{"role": "user", "content": "hi"}]
BUDGET = RenderLimits(timeout_s=1.0, max_chars=1 << 20)
# Each is stopped by a different bound; the worst case is the 1 s timeout plus killing the worker.
HOSTILE = {
    "nested loops over range(100000)": (FOREVER, "did not finish rendering within 1 s"),
    "'x' * 2e9": ("{{ 'x' * (2*10**9) }}", "cap of 1048576"),
    "31 string doublings": ("{% set ns = namespace(s='x') %}{% for i in range(31) %}{% set ns.s = ns.s + ns.s %}"
                            "{% endfor %}{{ ns.s }}", "cap of 1048576"),
    "list repetition": ("{{ ([1] * 10**9)|length }}", "cap of 1048576"),
    "huge power": ("{{ 7 ** (10**8) }}", "bits"),
    "squaring loop": ("{% set ns = namespace(n=3) %}{% for i in range(40) %}{% set ns.n = ns.n * ns.n %}{% endfor %}"
                      "{{ ns.n }}", "bits"),
    "center(2e9)": ("{{ 'x'|center(2000000000) }}", "memory cap"),
    "output flood": ("{% for i in range(100000) %}{% for j in range(100000) %}{{ 'x' * 1000 }}{% endfor %}"
                     "{% endfor %}", "output passed the cap of 1048576"),
    "31 string joins (~)": ("{% set ns = namespace(s='x') %}{% for i in range(31) %}{% set ns.s = ns.s ~ ns.s %}"
                            "{% endfor %}{{ ns.s }}", "concatenation of 2097152 characters would exceed the cap"),
}


@pytest.fixture(scope="module")
def renderer():
    r = ChatTemplateRenderer(num_workers=2, memory_bytes=512 << 20)
    r.start()
    yield r
    r.close()


@pytest.fixture(scope="module")
def tokenizer(checkpoints) -> EngineTokenizer:
    """The tiny DeepSeek-V3 checkpoint's tokenizer (DeepSeek-V3's own chat template)."""
    ckpt = checkpoints.checkpoint()
    return EngineTokenizer.load(ckpt, ["tokenizer.json", "tokenizer_config.json"])


@pytest.mark.parametrize("case", list(HOSTILE))
def test_hostile_templates_are_stopped_within_their_budget(renderer, case):
    template, fragment = HOSTILE[case]
    renderer.render("warm", MESSAGES)  # a ready worker, so the time below is the render's own
    start = time.monotonic()
    with pytest.raises(ChatTemplateLimitError, match=fragment):
        renderer.render(template, MESSAGES, limits=BUDGET)
    assert time.monotonic() - start < 3.0
    assert renderer.render("{{ messages[0].content }}", MESSAGES) == "hi"  # the pool still renders


def test_a_cancelled_render_kills_its_worker(renderer):
    renderer.render("warm", MESSAGES)
    cancel = threading.Event()
    threading.Timer(0.3, cancel.set).start()
    before = {w.proc.pid for w in renderer._idle}
    start = time.monotonic()
    with pytest.raises(RenderCancelled):
        renderer.render(FOREVER, MESSAGES, cancel=cancel)
    assert time.monotonic() - start < 1.0
    killed = before - {w.proc.pid for w in renderer._idle}
    assert len(killed) == 1 and not Path(f"/proc/{killed.pop()}").exists()


def test_template_errors_are_named_and_keep_the_worker(renderer):
    renderer.render("warm", MESSAGES)
    pids = {w.proc.pid for w in renderer._idle}
    with pytest.raises(ChatTemplateError, match="rejected the messages: TemplateError: no system role") as e:
        renderer.render("{{ raise_exception('no system role') }}", MESSAGES)
    assert not isinstance(e.value, ChatTemplateLimitError)
    assert renderer.render("{{ ().__class__ }}", MESSAGES) == ""  # the sandbox still applies
    assert {w.proc.pid for w in renderer._idle} == pids


def test_render_equals_transformers_apply_chat_template(tokenizer):
    chats = [
        MESSAGES,
        [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "1+1?"},
         {"role": "assistant", "content": "2"}, {"role": "user", "content": "and 2+2?", "name": None}],
        [{"role": "user", "content": "ünïcødé ✓ {{ not a template }} <｜end▁of▁sentence｜>"}],
    ]
    for chat in chats:
        expected = tokenizer.tok.apply_chat_template(chat, tokenize=False, add_generation_prompt=True)
        assert tokenizer.render_chat(chat) == expected
        assert tokenizer.apply_chat_template(chat) == tokenizer.tok.apply_chat_template(
            chat, add_generation_prompt=True, return_dict=False)


def test_engine_tokenizer_renders_under_the_budget(tokenizer):
    """`EngineTokenizer.apply_chat_template` (CLI --chat, Triton) uses the bounded renderer: a template that would
    run for hours is stopped at the default 5 s budget."""
    outcome: list[BaseException] = []

    def call() -> None:
        try:
            tokenizer.apply_chat_template(MESSAGES, chat_template=FOREVER)
        except BaseException as e:  # noqa: BLE001 (reported below)
            outcome.append(e)
    thread = threading.Thread(target=call, daemon=True)
    thread.start()
    thread.join(20)
    assert not thread.is_alive(), "the render was not stopped"
    assert isinstance(outcome[0], ChatTemplateLimitError) and "within 5 s" in str(outcome[0])


def test_bad_limits_are_refused():
    for bad in ({"timeout_s": 0}, {"timeout_s": float("nan")}, {"timeout_s": True}, {"max_chars": 0},
                {"max_chars": 1.5}):
        with pytest.raises(ValueError):
            RenderLimits(**bad)


def test_workers_exit_with_their_parent_input_closed():
    r = ChatTemplateRenderer(num_workers=1)
    assert r.render("{{ messages|length }}", MESSAGES) == "1"
    [worker] = r._idle
    r.close()
    assert worker.proc.poll() is not None and not os.path.exists(f"/proc/{worker.proc.pid}")
    with pytest.raises(ChatTemplateError, match="closed"):
        r.render("x", MESSAGES)


def test_a_worker_that_cannot_start_is_a_named_error(monkeypatch, tmp_path):
    import nextn.runtime.template_render as template_render

    monkeypatch.setattr(template_render, "WORKER_PATH", tmp_path / "missing_worker.py")
    r = ChatTemplateRenderer(num_workers=1)
    with pytest.raises(ChatTemplateError, match="worker failed: the worker exited"):
        r.render("x", MESSAGES)
    r.close()


def test_an_hf_tokenizers_template_is_checked_like_a_ggufs(checkpoints, tmp_path):
    """`check_saved_chat_template` (HF checkpoints, at build time): the shipped DeepSeek-V3 template passes; the same
    tokenizer with a template past the budget (chat_template.jinja, or one of several named ones) is refused, naming
    the file and the template."""
    import shutil

    from nextn.runtime.tokenizer import check_saved_chat_template

    files = ["tokenizer.json", "tokenizer_config.json"]
    ckpt = checkpoints.checkpoint()
    check_saved_chat_template(ckpt, files)
    for name in files:
        shutil.copyfile(ckpt / name, tmp_path / name)
    (tmp_path / "chat_template.jinja").write_text("{{ 'x' * (2*10**9) }}")
    with pytest.raises(ChatTemplateLimitError, match=rf"{tmp_path}/chat_template.jinja: .*cap of"):
        check_saved_chat_template(tmp_path, [*files, "chat_template.jinja"])
    config = json.loads((ckpt / "tokenizer_config.json").read_text())
    config["chat_template"] = [{"name": "default", "template": "ok"}, {"name": "tool_use", "template": FOREVER}]
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(config))
    with pytest.raises(ChatTemplateLimitError, match=r"tokenizer_config.json \(chat_template\): the chat template "
                                                     r"'tool_use' cannot be used.*within 5 s"):
        check_saved_chat_template(tmp_path, files)


def test_messages_that_are_not_json_data(renderer):
    class Image:
        pass
    assert renderer.render("{{ messages[0].content }}", [{"role": "user", "content": Image()}]) == "<Image>"
    cyclic: dict = {"role": "user"}
    cyclic["content"] = cyclic
    with pytest.raises(ChatTemplateError, match="not JSON data"):
        renderer.render("x", [cyclic])
    assert renderer.render("{{ messages|length }}", MESSAGES) == "1"
