"""Chat on a real model end to end: SmolLM2-135M-Instruct (a Q4_1 GGUF from ../shared) built into a float32 engine,
its GGUF chat template used by `nextn generate --chat`, `/v1/chat/completions` and the Triton `apply_chat_template`
input; a chat reply ends at `<|im_end|>` (the GGUF's EOS, id 2)."""

from __future__ import annotations

import json
import socket
import threading
import time
import urllib.request
from pathlib import Path

import numpy as np
import pytest

from nextn.build.checkpoint import CheckpointError
from nextn.cli.main import main

SMOLLM2 = Path(__file__).resolve().parents[2].parent / "shared" / "data" / "models" / "smollm2-135m-instruct" / \
    "SmolLM2-135M-Instruct.Q4_1.gguf"
QUESTION = "What is 2+2?"
IM_END = 2

pytestmark = pytest.mark.slow  # a 135M-parameter engine: about a minute to build on the 2-core CI machine


@pytest.fixture(scope="module")
def engine(tmp_path_factory) -> Path:
    from nextn.build.engine_builder import build_engine

    if not SMOLLM2.is_file():
        pytest.skip(f"SmolLM2 GGUF is absent ({SMOLLM2}): ../shared/data is not checked out")
    out = tmp_path_factory.mktemp("smollm2") / "engine"
    try:
        build_engine(SMOLLM2, out, dtype="float32", max_seq_len=256, progress=False)
    except CheckpointError as e:  # until quantized GGUF tensors load
        pytest.skip(f"SmolLM2's GGUF does not build yet: {e}")
    return out


@pytest.fixture(scope="module")
def reference_tokenizer():
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(SMOLLM2.parent, gguf_file=SMOLLM2.name)


@pytest.fixture(scope="module")
def llm(engine):
    from nextn import LLM

    llm = LLM(engine, device="cpu")
    yield llm
    llm.shutdown()


def test_engine_stores_the_template_and_the_end_of_turn_ids(engine: Path, reference_tokenizer) -> None:
    assert (engine / "chat_template.jinja").read_text() == reference_tokenizer.chat_template
    assert json.loads((engine / "generation_config.json").read_text())["eos_token_id"] == [IM_END, 0]
    manifest = json.loads((engine / "manifest.json").read_text())
    assert "chat_template.jinja" in manifest["tokenizer_files"]
    assert manifest["aux_files"] == ["generation_config.json"]  # checksummed, replaced on a rebuild


def test_generate_chat_answers_and_stops_at_im_end(engine: Path, capsys) -> None:
    assert main(["generate", "--engine_dir", str(engine), "--chat", "--prompt", QUESTION, "--max_tokens", "64",
                 "--json"]) == 0
    row = json.loads(capsys.readouterr().out)
    assert row["prompt"] == QUESTION
    assert row["finish_reason"] == "stop" and row["token_ids"][-1] == IM_END, row
    assert "4" in row["text"] and "<|im_end|>" not in row["text"], row["text"]
    assert main(["generate", "--engine_dir", str(engine), "--chat", "--token_ids", "--prompt", "1,2"]) == 2
    assert "--chat" in capsys.readouterr().err


def test_chat_completions_uses_the_model_template(llm, reference_tokenizer) -> None:
    import uvicorn

    from nextn import SamplingParams
    from nextn.serving.openai_server import create_app

    app = create_app(llm, "smollm2")
    assert app.state.server.chat_template is None  # the model's own template, not nextn's fallback
    messages = [{"role": "system", "content": "You are a calculator."}, {"role": "user", "content": QUESTION}]
    ref_ids = reference_tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_dict=False)
    assert llm.tokenizer.apply_chat_template(messages) == ref_ids
    expected = llm.generate(ref_ids, SamplingParams(max_tokens=48)).outputs[0]
    assert expected.finish_reason == "stop" and expected.token_ids[-1] == IM_END

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    try:
        deadline = time.monotonic() + 60
        while not server.started:
            assert thread.is_alive() and time.monotonic() < deadline, "uvicorn did not start"
            time.sleep(0.1)
        body = json.dumps({"model": "smollm2", "messages": messages, "max_tokens": 48}).encode()
        req = urllib.request.Request(f"http://127.0.0.1:{port}/v1/chat/completions", body,
                                     {"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=300) as r:
            out = json.loads(r.read())
    finally:
        server.should_exit = True
        thread.join(30)
    choice = out["choices"][0]
    assert out["usage"]["prompt_tokens"] == len(ref_ids)
    assert choice["finish_reason"] == "stop" and choice["message"]["content"] == expected.text
    assert out["usage"]["completion_tokens"] == len(expected.token_ids)


def test_triton_text_input_with_apply_chat_template(llm, reference_tokenizer) -> None:
    from nextn.serving import triton_io

    inputs = {"text_input": np.array([[QUESTION.encode()]], dtype=np.object_),
              "max_tokens": np.array([[8]], np.int32), "apply_chat_template": np.array([[True]])}
    parsed = triton_io.parse_request(inputs, decoupled=False)
    assert parsed.apply_chat_template and parsed.prompt == QUESTION
    ref = reference_tokenizer.apply_chat_template([{"role": "user", "content": QUESTION}],
                                                  add_generation_prompt=True, return_dict=False)
    assert triton_io.render_prompt(parsed, llm.tokenizer) == ref
    plain = triton_io.parse_request({k: v for k, v in inputs.items() if k != "apply_chat_template"}, decoupled=False)
    assert triton_io.render_prompt(plain, llm.tokenizer) == QUESTION  # not asked: the text as it is
    with pytest.raises(triton_io.TritonRequestError, match="apply_chat_template renders text_input"):
        triton_io.parse_request({"input_ids": np.array([[1, 2]], np.int32), "max_tokens": np.array([[8]], np.int32),
                                 "apply_chat_template": np.array([[True]])}, decoupled=False)
    with pytest.raises(triton_io.TritonRequestError, match="has none"):
        triton_io.render_prompt(parsed, None)
