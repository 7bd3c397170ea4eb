"""`nextn serve`'s edge (issue 12, items 2, 3, 8, 9): every bad field, body and header is a 4xx in OpenAI's error
format before it reaches the engine; large bodies are refused (413) or bounded before tokenizing, off the event
loop; the API key guards every endpoint but /health. Served for real (uvicorn on loopback) over stories260K."""

from __future__ import annotations

import argparse
import json
import threading
import time

import pytest

from nextn.cli import serve as serve_cli
from nextn.serving.http_edge import DEFAULT_MAX_REQUEST_BYTES, MAX_JSON_DEPTH
from nextn.serving.openai_server import create_app

KEY = "sk-nextn-edge-test"
AUTH = {"Authorization": f"Bearer {KEY}", "Content-Type": "application/json"}


@pytest.fixture(scope="module")
def server(stories_llm, local_server_cls):
    srv = local_server_cls(create_app(stories_llm, "stories", api_key=KEY))
    yield srv
    srv.stop()


def post(server, body: dict | bytes, path: str = "/v1/completions", headers: dict = AUTH, **kw) -> tuple[int, dict]:
    raw = body if isinstance(body, bytes) else json.dumps(body).encode()
    status, data = server.request("POST", path, raw, headers, **kw)
    return status, json.loads(data)


def assert_error(status: int, body: dict, expected: int, fragment: str) -> None:
    assert status == expected, body
    assert set(body) == {"error"} and set(body["error"]) == {"message", "type", "param", "code"}, body
    assert fragment in body["error"]["message"], body


BAD_FIELDS = [  # (body, what the message says); each is HTTP 400
    ({"prompt": "Once", "top_k": 2**70, "temperature": 1.0}, "top_k: Input should be less than or equal to 2147483647"),
    ({"prompt": "Once", "top_k": 513}, "top_k=513 exceeds the vocabulary size 512"),
    ({"prompt": "Once", "max_tokens": 2**70}, "max_tokens: Input should be less than or equal to"),
    ({"prompt": "Once", "max_tokens": 300}, "lower max_tokens to at most"),
    ({"prompt": "Once", "seed": 2**64}, "seed: Input should be less than 9223372036854775808"),
    ({"prompt": "Once", "seed": -1}, "seed: Input should be greater than or equal to 0"),
    ({"prompt": "Once", "n": 2**70}, "n: Input should be less than or equal to 16"),
    ({"prompt": "Once", "n": 0}, "n: Input should be greater than or equal to 1"),
    ({"prompt": "Once", "presence_penalty": 2.5}, "presence_penalty: Input should be less than or equal to 2"),
    ({"prompt": "Once", "logit_bias": {"abc": 1.0}}, "logit_bias keys are token ids as strings"),
    ({"prompt": "Once", "logit_bias": {"600": 1.0}}, "logit_bias token ids [600] are outside the vocabulary"),
    ({"prompt": "Once", "logprobs": 6}, "logprobs: Input should be less than or equal to 5"),
    ({"prompt": "Once", "min_tokens": 20, "max_tokens": 4}, "min_tokens=20 exceeds max_tokens=4"),
    ({"prompt": "Once", "guided_regex": "a", "guided_choice": ["b"]}, "one output constraint at a time"),
    ({"prompt": "Once", "guided_grammar": "root ::= ("}, "cannot be compiled"),
    ({"prompt": "Once", "stop_token_ids": [2**70]}, "stop_token_ids.0: Input should be less than or equal to"),
    ({"prompt": "Once", "stop_token_ids": [512]}, "stop_token_ids [512] are outside the vocabulary [0, 512)"),
    ({"prompt": "Once", "stop_token_ids": [1] * 300}, "stop_token_ids: List should have at most 256 items"),
    ({"prompt": "Once", "stop": ["x" * 300]}, "stop.0: String should have at most 256 characters"),
    ({"prompt": "Once", "user": "u" * 300}, "user: String should have at most 256 characters"),
    ({"prompt": "Once", "temperature": True}, "temperature: Input should be a valid number"),
    ({"prompt": "Once", "logit_bias": {"1": 1e300}}, "logit_bias.1: Input should be less than or equal to 100"),
    ({"prompt": [1.0, 2]}, "prompt[0] is a float, not a token id"),
    ({"prompt": [True, 2]}, "prompt[0] is a bool, not a token id"),
    ({"prompt": [[1], [2.5]]}, "prompt[1][0] is a float, not a token id"),
    ({"prompt": [-1]}, "prompt[0] is -1, not a token id"),
    ({"prompt": [2**70]}, "prompt[0] is 1180591620717411303424, not a token id"),
    ({"prompt": [600]}, "outside the vocabulary"),
    ({"prompt": ["a", [1]]}, "prompt[1] is a list but prompt[0] is a string"),
    ({"prompt": ["a"] * 129}, "129 prompts in one request; at most 128"),
    ({"prompt": {"a": 1}}, "prompt must be a string, a list of token ids"),
    ({"prompt": []}, "got an empty list"),
    ({"prompt": "a" * 9000}, "the prompt has 9000 characters; at most 8192 (32 per token of max_seq_len 256)"),
    ({"prompt": "Once \ud800 upon"}, "prompt holds a lone UTF-16 surrogate"),
    ({"prompt": ["ok", "\udfff"]}, "prompt[1] holds a lone UTF-16 surrogate"),
    ({"prompt": "Once", "\ud800": 1}, "the key \\ud800 holds a lone UTF-16 surrogate"),
    (b'{"prompt": "Once", "temperature": NaN}', "NaN is not JSON: numbers must be finite"),
    (b'{"prompt": "Once", "temperature": -Infinity}', "-Infinity is not JSON"),
    (b'{"prompt": "Once", "temperature": 1e400}', "temperature: Input should be a finite number"),
    (b'{"prompt": "Once", "max_tokens": 1' + b"0" * 5000 + b"}", "Exceeds the limit (4300 digits)"),
    (b'{"prompt": "\xff\xfe"}', "the request body is not valid UTF-8 (byte 12"),
    (b'{"prompt": "\xed\xa0\x80"}', "the request body is not valid UTF-8"),  # a surrogate written as UTF-8 bytes
    (b"[" * 100000 + b"]" * 100000, f"nested deeper than {MAX_JSON_DEPTH} levels"),
    (b'{"prompt": ' + b"[" * 40 + b"1" + b"]" * 40 + b"}", f"nested deeper than {MAX_JSON_DEPTH} levels"),
    (b'{"prompt": "Once",}', "malformed JSON body (Expecting property name enclosed in double quotes at line 1"),
    (b"", "the request body is empty"),
    (b'"Once upon a time"', "the body is Once upon a time, not a JSON object"),
]


@pytest.mark.parametrize("body, fragment", BAD_FIELDS, ids=range(len(BAD_FIELDS)))
def test_every_bad_field_is_a_400_in_openai_format(server, body, fragment):
    assert_error(*post(server, body), 400, fragment)


@pytest.mark.parametrize("body, fragment", [
    ({"messages": [{"role": "user", "content": "hi \udc00"}]}, "messages[0].content holds a lone UTF-16 surrogate"),
    ({"messages": [{"role": "user", "content": [{"type": "text", "text": "\ud800"}]}]},
     "messages[0].content[0].text holds a lone UTF-16 surrogate"),
    ({"messages": [{"role": "user", "content": "a" * 9000}]}, "the prompt has 9000 characters; at most 8192"),
    ({"messages": [{"role": "user", "content": "hi"}], "max_completion_tokens": 0}, "greater than or equal to 1"),
    ({"messages": [{"role": "user", "content": "hi", "name": "n" * 300}]}, "at most 256 characters"),
    ({"messages": [{"role": "user", "content": ""}] * 300}, "300 messages cannot fit max_seq_len 256"),
])
def test_chat_fields_are_checked_too(server, body, fragment):
    assert_error(*post(server, body, "/v1/chat/completions"), 400, fragment)


@pytest.mark.parametrize("field, value", [("temperature", 1e-300), ("temperature", 5e-324), ("top_p", 1e-300)])
def test_values_below_the_runtimes_range_name_their_field(server, field, value):
    status, body = post(server, {"prompt": "Once", "temperature": 1.0, field: value})
    assert status == 400 and body["error"]["param"] == field, body


def test_a_huge_top_k_fails_alone_while_a_request_runs(server, stories_llm):
    """Item 2: `"top_k": 2**70` was HTTP 500 "engine step failed" for every running request."""
    good = {"prompt": "Once upon a time", "max_tokens": 120, "ignore_eos": True, "temperature": 0.8, "seed": 7}
    solo = post(server, good)[1]["choices"][0]["text"]
    result = {}
    worker = threading.Thread(target=lambda: result.update(post(server, good)[1]))
    worker.start()
    for top_k in (2**70, 2**31, 10**6, 513):
        status, body = post(server, {"prompt": "Lily", "max_tokens": 50, "temperature": 1.0, "top_k": top_k})
        assert_error(status, body, 400, "top_k")
    worker.join(120)
    assert result["choices"][0]["text"] == solo and result["choices"][0]["finish_reason"] == "length"
    assert server.request("GET", "/health")[0] == 200


def test_oversized_bodies_get_413_naming_the_limit(server):
    body = json.dumps({"prompt": "a" * (DEFAULT_MAX_REQUEST_BYTES + 10)}).encode()
    for chunked in (False, True):  # Content-Length checked before reading; a chunked body counted as it comes
        status, err = post(server, body, chunked=chunked)
        assert_error(status, err, 413, f"this server takes at most {DEFAULT_MAX_REQUEST_BYTES} bytes")
        assert "--max_request_bytes" in err["error"]["message"]
    status, err = post(server, json.dumps({"prompt": "Once", "max_tokens": 2}).encode(), chunked=True)
    assert status == 200 and err["usage"]["completion_tokens"] == 2  # a small chunked body is fine


def _health_latencies(server, done: threading.Event) -> list[float]:
    latencies = []
    while not done.is_set():
        t0 = time.monotonic()
        assert server.request("GET", "/health", timeout=30)[0] == 200
        latencies.append(time.monotonic() - t0)
        time.sleep(0.02)
    return latencies


def test_health_answers_while_a_16_mb_prompt_is_refused(server):
    """Item 3: a 16 MB prompt blocked /health for 40 s (tokenized on the event loop); now it is refused by length,
    parsed off the event loop, and /health answers throughout."""
    done, latencies = threading.Event(), []
    poller = threading.Thread(target=lambda: latencies.extend(_health_latencies(server, done)))
    poller.start()
    t0 = time.monotonic()
    status, err = post(server, {"prompt": "Once upon a time " * 940_000}, timeout=60)  # 16 MB
    elapsed = time.monotonic() - t0
    done.set()
    poller.join(60)
    assert_error(status, err, 400, "the prompt has 15980000 characters; at most 8192")
    assert elapsed < 10 and latencies and max(latencies) < 1.0, (elapsed, max(latencies, default=None))


def test_health_answers_while_long_prompts_are_tokenized(server):
    """Tokenization runs in a worker thread: 128 prompts just under the character limit (~1 M characters, seconds
    of tokenizing) do not stall /health."""
    done, latencies = threading.Event(), []
    poller = threading.Thread(target=lambda: latencies.extend(_health_latencies(server, done)))
    poller.start()
    t0 = time.monotonic()
    status, err = post(server, {"prompt": ["Once upon a time, " * 450] * 128}, timeout=120)
    elapsed = time.monotonic() - t0
    done.set()
    poller.join(60)
    assert_error(status, err, 400, "max_seq_len is 256")  # tokenized, then found too long in tokens
    # On the event loop, a /health sent during the ~1 s of tokenizing would wait for all of it.
    assert max(latencies) < max(elapsed / 2, 0.1), (elapsed, max(latencies))


def test_api_key_guards_every_endpoint_but_health(server, stories_llm):
    plain = {"Content-Type": "application/json"}
    good = json.dumps({"prompt": "Once", "max_tokens": 2}).encode()
    for headers in (plain, {**plain, "Authorization": "Bearer wrong"}, {**plain, "Authorization": f"Basic {KEY}"},
                    {**plain, "Authorization": KEY}, {**plain, "Authorization": f"Bearer {KEY}x"}):
        for method, path in (("GET", "/v1/models"), ("GET", "/metrics"), ("POST", "/v1/completions"),
                             ("POST", "/v1/chat/completions"), ("GET", "/no/such/path")):
            status, body = server.request(method, path, good if method == "POST" else None, headers)
            assert_error(status, json.loads(body), 401, "missing or wrong API key")
            assert json.loads(body)["error"]["code"] == "invalid_api_key"
    assert server.request("GET", "/health")[0] == 200
    assert server.request("GET", "/v1/models", headers={"Authorization": f"bearer {KEY}"})[0] == 200
    status, body = post(server, good)
    assert status == 200 and body["usage"]["completion_tokens"] == 2
    with pytest.raises(ValueError, match="API key is empty"):
        create_app(stories_llm, "stories", api_key="")


def test_unknown_paths_and_methods_say_so(server):
    status, body = server.request("POST", "/v1/completion", b"{}", AUTH)
    assert_error(status, json.loads(body), 404, "POST /v1/completion is not an endpoint of nextn serve")
    status, body = server.request("GET", "/v1/completions", headers=AUTH)
    assert_error(status, json.loads(body), 405, "the path exists with another method")


@pytest.mark.parametrize("host, exposed", [("127.0.0.1", False), ("127.3.2.1", False), ("::1", False),
                                           ("[::1]", False), ("localhost", False), ("0.0.0.0", True),
                                           ("::", True), ("192.168.1.7", True), ("example.org", True)])
def test_binding_beyond_loopback_without_a_key_warns(host, exposed):
    warning = serve_cli.exposure_warning(host, None)
    assert (warning is not None) == exposed
    if exposed:
        assert host in warning and "--api_key" in warning and "NEXTN_API_KEY" in warning
    assert serve_cli.exposure_warning(host, "k") is None


def test_cli_reads_the_key_from_nextn_api_key_and_warns(monkeypatch, tmp_path, capsys):
    def parse(*argv):
        parser = argparse.ArgumentParser()
        serve_cli.add_arguments(parser)
        return parser.parse_args(["--engine_dir", str(tmp_path / "none"), *argv])
    monkeypatch.delenv("NEXTN_API_KEY", raising=False)
    assert parse().api_key is None and parse().max_request_bytes == DEFAULT_MAX_REQUEST_BYTES
    monkeypatch.setenv("NEXTN_API_KEY", "from-env")
    assert parse().api_key == "from-env" and parse("--api_key", "flag").api_key == "flag"
    monkeypatch.delenv("NEXTN_API_KEY")
    with pytest.raises(Exception):  # no engine there: fails after the warning, before serving
        serve_cli.run(parse("--host", "0.0.0.0"))
    assert "nextn serve: warning: serving on 0.0.0.0 without an API key" in capsys.readouterr().err


def test_load_check_passes_with_the_api_key(server, capsys):
    from benchmarks import load_check

    assert load_check.main(["--url", server.url, "--requests", "8", "--max_tokens", "4", "--api_key", KEY]) == 0
    assert "load check: PASSED" in capsys.readouterr().out
    assert load_check.main(["--url", server.url, "--requests", "8", "--max_tokens", "4", "--api_key", "no"]) != 0


@pytest.mark.parametrize("choice, limit", [("required", 30), ("required", 8), ("auto", 30)])
def test_a_tool_call_cut_by_max_tokens_reads_the_same_streamed_and_not(server, choice, limit):
    """A call cut short is not a call: both forms give its text as content and finish_reason "length", no
    tool_calls (as vLLM's Hermes parser without a closed block). With "auto" a regex forces the call's text."""
    weather = {"type": "function", "function": {"name": "get_weather", "parameters": {
        "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}
    body = {"messages": [{"role": "user", "content": "Weather?"}], "tools": [weather], "tool_choice": choice,
            "max_tokens": limit}
    if choice == "auto":
        body["guided_regex"] = '<tool_call>\n\\{"name": "get_weather", "arguments": \\{"city": "[a-z]{40}"\\}\\}'
    status, whole = post(server, body, "/v1/chat/completions")
    assert status == 200, whole
    [c] = whole["choices"]
    assert c["finish_reason"] == "length" and not c["message"].get("tool_calls")
    assert c["message"]["content"].startswith("<tool_ca"), c
    status, raw = server.request("POST", "/v1/chat/completions", json.dumps({**body, "stream": True}).encode(), AUTH)
    chunks = [json.loads(line[6:]) for line in raw.decode().splitlines()
              if line.startswith("data: ") and line != "data: [DONE]"]
    deltas = [ch["choices"][0] for ch in chunks if ch["choices"]]
    assert "".join(d["delta"].get("content") or "" for d in deltas) == c["message"]["content"]
    assert not any(d["delta"].get("tool_calls") for d in deltas) and deltas[-1]["finish_reason"] == "length"
