"""The server under grammars that are slow or useless to compile (the real stories260K model, uvicorn in a thread):
a tools request or response_format whose schema expands for seconds is stopped at --grammar_timeout (400
`grammar_limit`) while /health answers in well under a second and plain requests keep their tokens; a flood of
them is refused by name (503 `grammar_busy`) rather than queued without end; a grammar that matches no output and a
request that fans out to more sequences than allowed are 400s naming why."""

from __future__ import annotations

import json
import threading
import time

import pytest

from nextn.runtime.grammar_pool import GrammarLimits
from nextn.serving.openai_server import create_app

BUDGET_S = 1.5
# xgrammar expands the repetition: ~5 s to convert on a quiet 2-core Zen 4, 16 s on a loaded one
SLOW = {"type": "object", "properties": {"code": {"type": "string", "pattern": "[a-z]{2000,10000}"}},
        "required": ["code"]}
USER = [{"role": "user", "content": "Once upon a time"}]
TOOLS = {"messages": USER, "max_tokens": 8, "tool_choice": "required",
         "tools": [{"type": "function", "function": {"name": "run", "parameters": SLOW}}]}
SCHEMA = {"messages": USER, "max_tokens": 8,
          "response_format": {"type": "json_schema", "json_schema": {"name": "slow", "schema": SLOW}}}
PLAIN = {"prompt": "Once upon a time", "max_tokens": 12, "ignore_eos": True}
MAX_SEQUENCES = 32


@pytest.fixture(scope="module")
def server(stories_llm, local_server_cls):
    srv = local_server_cls(create_app(stories_llm, "stories", grammar_limits=GrammarLimits(timeout_s=BUDGET_S),
                                      max_sequences=MAX_SEQUENCES))
    yield srv
    srv.stop()
    stories_llm.engine.grammar_limits = GrammarLimits()


def _post(server, path: str, body: dict) -> tuple[int, dict]:
    status, data = server.request("POST", path, json.dumps(body).encode(), {"Content-Type": "application/json"})
    return status, json.loads(data)


def _all_at_once(server, bodies: list[dict]) -> tuple[list[tuple[int, dict]], list[float]]:
    """Send `bodies` to /v1/chat/completions together; while they run, time /health every 50 ms."""
    results: list = [None] * len(bodies)

    def send(i: int) -> None:
        results[i] = _post(server, "/v1/chat/completions", bodies[i])

    threads = [threading.Thread(target=send, args=(i,)) for i in range(len(bodies))]
    for t in threads:
        t.start()
    health = []
    while any(t.is_alive() for t in threads):
        t0 = time.monotonic()
        assert server.request("GET", "/health", timeout=10)[0] == 200
        health.append(time.monotonic() - t0)
        time.sleep(0.05)
    return results, health


def test_slow_grammars_are_stopped_at_their_budget_while_the_server_goes_on(server):
    status, before = _post(server, "/v1/completions", PLAIN)
    assert status == 200
    results, health = _all_at_once(server, [TOOLS])
    more, health2 = _all_at_once(server, [SCHEMA])  # (together, the second would wait for the one worker: 503)
    for status, body in results + more:
        assert status == 400 and body["error"]["code"] == "grammar_limit", body
        assert "within its budget" in body["error"]["message"] and "--grammar_timeout" in body["error"]["message"]
    health += health2
    assert len(health) > 10 and max(health) < 1.0, health
    status, after = _post(server, "/v1/completions", PLAIN)
    assert status == 200 and after["choices"][0]["text"] == before["choices"][0]["text"]
    # a good grammar compiles in the fresh worker
    status, body = _post(server, "/v1/chat/completions", {**SCHEMA, "response_format": {
        "type": "json_schema", "json_schema": {"name": "ok", "schema": {"type": "object"}}}})
    assert status == 200, body


def test_a_flood_of_slow_grammars_is_refused_by_name_not_queued(server):
    """One worker compiles, eight wait for it (each up to its budget, then 503): the rest of twelve get a 503 at
    once."""
    t0 = time.monotonic()
    results, health = _all_at_once(server, [SCHEMA] * 12)
    codes = sorted(body["error"]["code"] for _, body in results)
    assert {s for s, _ in results} <= {400, 503} and set(codes) == {"grammar_limit", "grammar_busy"}, results
    assert codes.count("grammar_busy") >= 3
    assert max(health) < 1.0 and time.monotonic() - t0 < 30
    busy = next(body for status, body in results if status == 503)
    assert "retry shortly" in busy["error"]["message"]


def test_a_grammar_that_matches_no_output_is_a_named_400(server):
    status, body = _post(server, "/v1/completions", {"prompt": "Once", "max_tokens": 4,
                                                     "guided_grammar": 'root ::= root "a"'})
    assert status == 400 and "matches no output" in body["error"]["message"], body


def test_prompts_times_n_is_bounded_per_request(server):
    status, body = _post(server, "/v1/completions", {"prompt": [[1, 2, 3]] * 9, "n": 4, "max_tokens": 2})
    assert status == 400 and body["error"]["code"] == "too_many_sequences", body
    assert "9 prompt(s) × n=4 = 36 sequences; at most 32" in body["error"]["message"]
    status, body = _post(server, "/v1/completions", {"prompt": [[1, 2, 3]] * 8, "n": 4, "max_tokens": 2})
    assert status == 200 and len(body["choices"]) == 32
