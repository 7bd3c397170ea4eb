"""`nextn serve` for real (the CLI in a subprocess on a free loopback port), queried with the official `openai`
client: completions and chat equal `LLM.generate` greedy, streams concatenate to the non-streaming result, bad
requests get 4xx OpenAI error bodies while others run, a disconnected stream is aborted (KV blocks freed), and
/metrics carries the speculative-decoding counters."""

from __future__ import annotations

import json
import os
import re
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path

import openai
import pytest
import uvicorn

from nextn import LLM, SamplingParams
from nextn.build.engine_builder import build_engine
from benchmarks import load_check
from nextn.serving.openai_server import FALLBACK_CHAT_TEMPLATE, create_app

STORIES = Path(__file__).resolve().parents[2].parent / "shared" / "data" / "models" / "stories260K" / "stories260K.gguf"
PROMPTS = ["The capital of France", "Hello world, this is", "1 2 3 4"]
MAX_TOKENS = 12


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _get(url: str) -> tuple[int, str]:
    try:
        with urllib.request.urlopen(url, timeout=30) as r:
            return r.status, r.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode()


def _post_raw(url: str, body: bytes) -> tuple[int, dict]:
    req = urllib.request.Request(url, body, {"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=60) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def _metric(text: str, name: str, labels: str = "") -> float:
    m = re.search(rf"^{re.escape(name + (('{' + labels + '}') if labels else ''))} (\S+)$", text, re.M)
    return float(m.group(1)) if m else 0.0


@pytest.fixture(scope="module")
def engine_dir(checkpoints):
    return checkpoints.engine(distill_steps=0)  # tiny DeepSeek-V3 with MTP (K=1) and the DeepSeek tokenizer


@pytest.fixture(scope="module")
def server(engine_dir, tmp_path_factory):
    port = _free_port()
    log = tmp_path_factory.mktemp("serve") / "server.log"
    env = {**os.environ, "TOKENIZERS_PARALLELISM": "false"}
    with open(log, "w") as out:
        proc = subprocess.Popen([sys.executable, "-m", "nextn.cli.main", "serve", "--engine_dir", str(engine_dir),
                                 "--port", str(port), "--served_model_name", "tiny-dsv3"],
                                stdout=out, stderr=subprocess.STDOUT, env=env)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 180
        while True:
            if proc.poll() is not None:
                pytest.fail(f"nextn serve exited with {proc.returncode}:\n{log.read_text()}")
            try:
                if _get(url + "/health")[0] == 200:
                    break
            except OSError:
                pass
            if time.monotonic() > deadline:
                pytest.fail(f"nextn serve did not become healthy in 180 s:\n{log.read_text()}")
            time.sleep(0.5)
        yield url
    finally:
        proc.terminate()
        proc.wait(30)


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server + "/v1", api_key="unused", max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def llm(engine_dir):
    """The same engine in this process, for the references."""
    return LLM(engine_dir, device="cpu")


@pytest.fixture(scope="module")
def reference(llm):
    """`LLM.generate` greedy outputs of PROMPTS (ignore_eos, MAX_TOKENS)."""
    outs = llm.generate(PROMPTS, SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True))
    return [o.outputs[0] for o in outs]


def test_models_and_health(server, client):
    assert [m.id for m in client.models.list().data] == ["tiny-dsv3"]
    assert _get(server + "/health")[0] == 200


def test_completion_stream_and_generate_agree(client, reference):
    for prompt, ref in zip(PROMPTS, reference):
        full = client.completions.create(model="tiny-dsv3", prompt=prompt, max_tokens=MAX_TOKENS,
                                         extra_body={"ignore_eos": True})
        choice = full.choices[0]
        assert choice.text == ref.text and choice.finish_reason == "length"
        assert full.usage.completion_tokens == len(ref.token_ids) == MAX_TOKENS and full.usage.prompt_tokens > 0
        chunks = list(client.completions.create(model="tiny-dsv3", prompt=prompt, max_tokens=MAX_TOKENS, stream=True,
                                                stream_options={"include_usage": True},
                                                extra_body={"ignore_eos": True}))
        assert "".join(c.choices[0].text for c in chunks if c.choices) == ref.text
        assert len(chunks) > 3  # streamed per step, not in one piece
        assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
        assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == MAX_TOKENS


def test_token_id_prompt_and_prompt_list(client, llm):
    ids = [5, 9, 13, 7]
    llm_ref = llm.generate(ids, SamplingParams(max_tokens=6, ignore_eos=True)).outputs[0]
    out = client.completions.create(model="tiny-dsv3", prompt=[ids, ids], max_tokens=6, extra_body={"ignore_eos": True})
    assert [c.text for c in out.choices] == [llm_ref.text] * 2 and [c.index for c in out.choices] == [0, 1]
    assert out.usage.completion_tokens == 12 and out.usage.prompt_tokens == 8


def test_chat_uses_the_chat_template(client, llm):
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Name a colour."}]
    rendered = llm.tokenizer.tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    ids = llm.tokenizer.tok.encode(rendered, add_special_tokens=False)
    ref = llm.generate(ids, SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True)).outputs[0]
    out = client.chat.completions.create(model="tiny-dsv3", messages=messages, max_completion_tokens=MAX_TOKENS,
                                         extra_body={"ignore_eos": True})
    assert out.choices[0].message.role == "assistant" and out.choices[0].message.content == ref.text
    assert out.usage.prompt_tokens == len(ids) and out.usage.completion_tokens == MAX_TOKENS
    chunks = list(client.chat.completions.create(model="tiny-dsv3", messages=messages, max_tokens=MAX_TOKENS,
                                                 stream=True, extra_body={"ignore_eos": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == ref.text
    assert chunks[-1].choices[0].finish_reason == "length"


def test_stop_string_cuts_the_text(client, reference):
    ref = reference[0].text
    stop = ref[len(ref) // 2:len(ref) // 2 + 3]
    if not stop.strip():
        pytest.skip("the reference text has no usable middle for a stop string")
    for stream in (False, True):
        resp = client.completions.create(model="tiny-dsv3", prompt=PROMPTS[0], max_tokens=MAX_TOKENS, stop=[stop],
                                         stream=stream, extra_body={"ignore_eos": True})
        chunks = list(resp) if stream else [resp]
        text = "".join(c.choices[0].text for c in chunks)
        assert text == ref[:ref.index(stop)] and chunks[-1].choices[0].finish_reason == "stop"


def test_bad_requests_get_4xx_while_a_request_runs(server, client, reference):
    result: dict = {}

    def good():
        out = client.completions.create(model="tiny-dsv3", prompt=PROMPTS[1], max_tokens=MAX_TOKENS,
                                        extra_body={"ignore_eos": True})
        result["text"] = out.choices[0].text

    worker = threading.Thread(target=good)
    worker.start()
    cases = [
        (dict(model="gpt-4", prompt="x"), openai.NotFoundError, "does not exist"),
        (dict(model="tiny-dsv3", prompt="x", n=17), openai.BadRequestError, "n: Input should be less than or equal to 16"),
        (dict(model="tiny-dsv3", prompt="x", max_tokens=10**6), openai.BadRequestError, "lower max_tokens"),
        (dict(model="tiny-dsv3", prompt=[1] * 5000), openai.BadRequestError, "max_seq_len"),
        (dict(model="tiny-dsv3", prompt="x", extra_body={"max_tokens": "5"}), openai.BadRequestError,
         "max_tokens: Input should be a valid integer"),
        (dict(model="tiny-dsv3", prompt="x", extra_body={"frobnicate": 1}), openai.BadRequestError,
         "frobnicate: unknown or unsupported field"),
        (dict(model="tiny-dsv3", prompt=[10**7]), openai.BadRequestError, "outside the vocabulary"),
    ]
    for kwargs, error, message in cases:
        with pytest.raises(error) as info:
            client.completions.create(**kwargs)
        assert message in info.value.body["message"], info.value.body
        assert set(info.value.body) == {"message", "type", "param", "code"}
    status, body = _post_raw(server + "/v1/completions", b'{"prompt": "x", ')
    assert status == 400 and "malformed JSON" in body["error"]["message"]
    with pytest.raises(openai.BadRequestError, match="max_completion_tokens"):
        client.chat.completions.create(model="tiny-dsv3", messages=[{"role": "user", "content": "hi"}],
                                       max_completion_tokens=10**6)
    worker.join(120)
    assert result["text"] == reference[1].text


def test_disconnect_aborts_the_request_and_frees_its_blocks(server, client):
    stream = client.completions.create(model="tiny-dsv3", prompt=PROMPTS[2], max_tokens=1500, stream=True,
                                       extra_body={"ignore_eos": True})
    first = [next(iter(stream)) for _ in range(3)]
    assert all(c.choices[0].finish_reason is None for c in first)
    stream.close()
    deadline = time.monotonic() + 60
    while True:
        metrics = _get(server + "/metrics")[1]
        free, total = _metric(metrics, "nextn_kv_cache_free_blocks"), _metric(metrics, "nextn_kv_cache_total_blocks")
        cancelled = _metric(metrics, "nextn_request_finished_total", 'finish_reason="cancelled"')
        if free == total and cancelled >= 1 and _metric(metrics, "nextn_num_requests_running") == 0:
            break
        assert time.monotonic() < deadline, f"blocks not freed after the client left: {free}/{total}\n{metrics}"
        time.sleep(0.2)
    assert _get(server + "/health")[0] == 200


def test_metrics_carry_spec_decode_counters(server, client):
    client.completions.create(model="tiny-dsv3", prompt=PROMPTS[0], max_tokens=MAX_TOKENS,
                              extra_body={"ignore_eos": True})
    text = _get(server + "/metrics")[1]
    drafts = _metric(text, "nextn_spec_decode_num_drafts_total")
    draft_tokens = _metric(text, "nextn_spec_decode_num_draft_tokens_total")
    accepted = _metric(text, "nextn_spec_decode_num_accepted_tokens_total")
    per_pos = _metric(text, "nextn_spec_decode_num_accepted_tokens_per_pos_total", 'position="0"')
    assert drafts > 0 and draft_tokens == drafts  # K = 1 draft per verify-and-draft step
    assert 0 <= accepted <= draft_tokens and per_pos == accepted
    assert _metric(text, "nextn_request_finished_total", 'finish_reason="length"') >= 1
    assert _metric(text, "nextn_time_to_first_token_seconds_count") >= 1
    assert _metric(text, "nextn_time_per_output_token_seconds_count") >= 1
    assert _metric(text, "nextn_http_requests_total", 'endpoint="/v1/completions",status_code="400"') >= 1
    assert _metric(text, "nextn_generation_tokens_total") >= MAX_TOKENS


# stories260K (a real model whose tokenizer has no chat template), served by uvicorn in a thread ------------------
@pytest.fixture(scope="module")
def stories(tmp_path_factory):
    if not STORIES.is_file():
        pytest.skip(f"{STORIES} is absent (../shared/data): the real stories260K model is not available")
    engine = tmp_path_factory.mktemp("stories") / "engine"
    build_engine(STORIES, engine, max_seq_len=256, progress=False)
    llm = LLM(engine, device="cpu")
    app = create_app(llm, "stories")
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=_free_port(), log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 60
    while not server.started:
        assert thread.is_alive() and time.monotonic() < deadline, "uvicorn did not start"
        time.sleep(0.1)
    yield f"http://127.0.0.1:{server.config.port}", llm, app
    server.should_exit = True
    thread.join(30)
    llm.shutdown()


def test_chat_without_a_template_uses_the_documented_fallback(stories):
    url, llm, app = stories
    assert app.state.server.chat_template == FALLBACK_CHAT_TEMPLATE
    ids = llm.tokenizer.encode("system: Tell a story.\nuser: About a cat.\nassistant:")  # with the BOS
    ref = llm.generate(ids, SamplingParams(max_tokens=16)).outputs[0]
    client = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=120)
    out = client.chat.completions.create(model="stories", max_tokens=16, messages=[
        {"role": "system", "content": "Tell a story."}, {"role": "user", "content": "About a cat."}])
    assert out.choices[0].message.content == ref.text and out.usage.prompt_tokens == len(ids)


def test_load_check_passes(stories, capsys):
    url, _, _ = stories
    assert load_check.main(["--url", url, "--requests", "16", "--max_tokens", "8"]) == 0
    printed = capsys.readouterr().out
    assert "load check: PASSED" in printed and "completed streams: 12/12" in printed and "TTFT: p50" in printed
