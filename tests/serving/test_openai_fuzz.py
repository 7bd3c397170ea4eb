"""Fuzz `nextn serve` (issue 12, "Done when"): random and mutated HTTP requests while good requests run.

Seeded (NEXTN_FUZZ_SEED, default 12) and time-bounded (NEXTN_FUZZ_SECONDS, default 12 s of fuzzing), on the real
stories260K model served by uvicorn on 127.0.0.1 only. Bad inputs: mutated fields (huge, negative, wrong-typed,
non-finite numbers, surrogates, long strings), byte-level mutations of good bodies, invalid UTF-8, deeply nested
JSON, non-object bodies, oversized bodies (by Content-Length and chunked), wrong endpoints and methods, missing or
wrong API keys, bodies cut off by a disconnect. Checks: no 5xx, every 4xx in OpenAI's error format, each good
request (greedy and seeded sampling, streaming and not, completions and chat) returns exactly its solo output, the
server stays healthy, the KV cache returns to full, and the engine directory is unchanged. Prints the figures.
"""

from __future__ import annotations

import copy
import hashlib
import json
import os
import random
import re
import socket
import threading
import time
from pathlib import Path

import pytest

from nextn.serving.openai_server import create_app

SEED = int(os.environ.get("NEXTN_FUZZ_SEED", "12"))
FUZZ_SECONDS = float(os.environ.get("NEXTN_FUZZ_SECONDS", "12"))
LIMIT = 64 * 1024  # --max_request_bytes of the fuzzed server: oversized bodies stay cheap to send
KEY = "sk-fuzz"
AUTH = {"Authorization": f"Bearer {KEY}", "Content-Type": "application/json"}
GOOD = [  # (path, body): greedy and seeded sampling, streaming and not, text and token ids, completions and chat
    ("/v1/completions", {"prompt": "Once upon a time", "max_tokens": 24, "ignore_eos": True}),
    ("/v1/completions", {"prompt": "Lily and Ben", "max_tokens": 24, "temperature": 0.9, "seed": 3, "top_k": 40,
                         "top_p": 0.9, "ignore_eos": True}),
    ("/v1/completions", {"prompt": [1, 400, 300, 250], "max_tokens": 16, "temperature": 1.0, "seed": 11,
                         "stream": True, "ignore_eos": True}),
    ("/v1/completions", {"prompt": ["The dog", "A red ball"], "max_tokens": 12, "stop": ["."]}),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "Tell me a story."}], "max_tokens": 20,
                              "ignore_eos": True}),
    ("/v1/chat/completions", {"messages": [{"role": "system", "content": "Be kind."},
                                           {"role": "user", "content": "Hi"}], "max_tokens": 20, "stream": True,
                              "temperature": 0.7, "seed": 5, "ignore_eos": True}),
]
FIELDS = ["prompt", "max_tokens", "temperature", "top_p", "top_k", "seed", "stop", "stop_token_ids", "n", "stream",
          "stream_options", "ignore_eos", "logprobs", "echo", "user", "model", "presence_penalty", "logit_bias",
          "messages", "max_completion_tokens", "best_of", "suffix", "\ud800", "x" * 300]
NASTY = [2**70, -2**70, 2**63, 2**64, 2**31, -1, 0, 1.5, -0.0, 1e308, 5e-324, True, False, None, "", "5", "\ud800",
         "a\udfffb", "x" * 5000, [], [None], {}, {"a": {"b": [[]]}}, [2**70], [1.0], [True], ["\udc00"], [[1, 2.5]],
         513, 512, 10**6, [-1], [[]], ["a"] * 200, [{"role": "user"}], [{"role": "user", "content": 5}],
         [{"role": "hacker", "content": "x"}], [{"role": "user", "content": [{"type": "image_url"}]}]]
LITERALS = [b"NaN", b"Infinity", b"-Infinity", b"1e400", b"-1e400", b"1" + b"0" * 5000, b"0x10", b"01", b"+1",
            b"tru", b"nul", b"'x'", b'"\\ud800"', b'"\\udc00\\ud800"', b'"\\ud83d\\ude00"', b'"\\u0000"']
BAD_UTF8 = [b"\xff", b"\xc3", b"\xed\xa0\x80", b"\xf4\x90\x80\x80", b"\xc0\xaf", b"\xe2\x82", b"\x80"]
PATHS = ["/", "/v1", "/v1/completion", "/v1/completions/", "/v1/chat", "/v2/completions", "/v1/models/x",
         "/v1/embeddings", "/docs", "/openapi.json", "/metrics/", "/health/x", "/%ff%fe", "/v1/%2e%2e/models",
         "/" + "a" * 4000, "/v1/completions?x=1", "/v1/chat/completions%00"]
METHODS = ["GET", "POST", "PUT", "DELETE", "PATCH", "OPTIONS"]


@pytest.fixture(scope="module")
def server(stories_llm, local_server_cls):
    srv = local_server_cls(create_app(stories_llm, "stories", api_key=KEY, max_request_bytes=LIMIT))
    yield srv
    srv.stop()


def _outcome(path: str, body: dict, status: int, raw: bytes) -> tuple:
    """(status, texts, finish reasons) of a response, streamed or not."""
    if not body.get("stream"):
        data = json.loads(raw)
        if status != 200:
            return status, data
        key = (lambda c: c["message"]["content"]) if "chat" in path else (lambda c: c["text"])
        return status, [key(c) for c in data["choices"]], [c["finish_reason"] for c in data["choices"]]
    events = [line[6:] for line in raw.decode().split("\n") if line.startswith("data: ")]
    assert events[-1] == "[DONE]", events[-3:]
    chunks = [json.loads(e) for e in events[:-1]]
    assert all("error" not in c for c in chunks), chunks
    text = "".join((c["choices"][0]["delta"].get("content") or "") if "chat" in path else c["choices"][0]["text"]
                   for c in chunks if c["choices"])
    return status, [text], [[c["choices"][0]["finish_reason"] for c in chunks if c["choices"]][-1]]


def _good(server, i: int) -> tuple:
    path, body = GOOD[i]
    status, raw = server.request("POST", path, json.dumps(body).encode(), AUTH)
    return _outcome(path, body, status, raw)


def _with(rng: random.Random, body: dict, field: str, value) -> bytes:
    """`body` with `field` set to `value`, as JSON (non-ASCII escaped or raw, at random; surrogates as escapes)."""
    body = copy.deepcopy(body)
    body[field] = value
    if rng.random() < 0.5:
        return json.dumps(body).encode()
    return json.dumps(body, ensure_ascii=False).encode("utf-8", "surrogatepass")


def _bad(rng: random.Random) -> tuple[str, str, str, dict, bytes | None, bool, set[int] | None]:
    """One bad input: (kind, method, path, headers, body, chunked, the statuses it may get; None = any < 500)."""
    path, good = GOOD[rng.randrange(len(GOOD))]
    raw = json.dumps(good).encode()
    kind = rng.choice(["field", "field", "field", "literal", "bytes", "bytes", "utf8", "nested", "shape",
                       "oversized", "endpoint", "auth", "disconnect"])
    if kind == "field":  # may be a valid request (then it runs): any status below 500
        return kind, "POST", path, AUTH, _with(rng, good, rng.choice(FIELDS), rng.choice(NASTY)), False, None
    if kind == "literal":  # a raw JSON token in place of a value
        field = rng.choice(FIELDS[:9])
        body = _with(rng, good, field, "@@").replace(b'"@@"', rng.choice(LITERALS))
        return kind, "POST", path, AUTH, body, False, None
    if kind == "bytes":  # byte-level mutations of a good body
        data = bytearray(raw)
        for _ in range(rng.randint(1, 4)):
            if not data:
                break
            at = rng.randrange(len(data))
            op = rng.randrange(4)
            if op == 0:
                data[at] = rng.randrange(256)
            elif op == 1:
                data[at:at] = bytes(rng.randrange(256) for _ in range(rng.randint(1, 8)))
            elif op == 2:
                del data[at:at + rng.randint(1, 8)]
            else:
                data = data[:at]
        return kind, "POST", path, AUTH, bytes(data), rng.random() < 0.3, None
    if kind == "utf8":
        at = raw.index(b'"', raw.index(b":") + 1) + 1  # inside the first string value
        return kind, "POST", path, AUTH, raw[:at] + rng.choice(BAD_UTF8) + raw[at:], False, {400}
    if kind == "nested":
        n = rng.choice([33, 100, 1000, 100_000])
        body = rng.choice([b"[" * n + b"]" * n, b'{"a":' * n + b"1" + b"}" * n,
                           b'{"prompt": ' + b"[" * n + b"1" + b"]" * n + b"}"])
        return kind, "POST", path, AUTH, body, False, {400, 413}  # 413 when over the size limit
    if kind == "shape":
        body = rng.choice([b"", b" ", b"null", b"1", b'"x"', b"[]", b"[{}]", b"true", b"{}", b'{"prompt": null}'])
        return kind, "POST", path, AUTH, body, False, {400}
    if kind == "oversized":
        body = _with(rng, good, "user", "u" * (LIMIT + rng.randrange(2 * LIMIT)))
        return kind, "POST", path, AUTH, body, rng.random() < 0.5, {413}
    if kind == "endpoint":
        method, where = rng.choice(METHODS), rng.choice(PATHS + [p for p, _ in GOOD] + ["/v1/models", "/health"])
        route = where.split("?")[0]
        ok = {200} if method == "GET" and route in ("/v1/models", "/health", "/docs", "/openapi.json") else \
            None if method == "POST" and route in {p for p, _ in GOOD} else {404, 405}
        return kind, method, where, AUTH, raw if method != "GET" else None, False, ok
    if kind == "auth":
        headers = rng.choice([{}, {"Authorization": "Bearer wrong"}, {"Authorization": f"Basic {KEY}"},
                              {"Authorization": KEY}, {"Authorization": "Bearer "}, {"X-Api-Key": KEY},
                              {"Authorization": f"Bearer {KEY[:-1]}"}, {"Authorization": f"Bearer {KEY}{KEY}"}])
        return kind, rng.choice(["POST", "GET"]), rng.choice([path, "/metrics", "/v1/models", "/x"]), \
            {"Content-Type": "application/json", **headers}, raw, False, {401}
    return kind, "POST", path, AUTH, raw[:rng.randrange(len(raw))], False, set()  # disconnect: no answer expected


def _disconnect(server, path: str, partial: bytes) -> None:
    """Send headers promising more body than is sent, then hang up."""
    with socket.create_connection(("127.0.0.1", server.port), timeout=10) as s:
        s.sendall(f"POST {path} HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {KEY}\r\nContent-Type: application/json"
                  f"\r\nContent-Length: {len(partial) + 100}\r\n\r\n".encode() + partial)


def _metric(text: str, name: str) -> float:
    return float(re.search(rf"^{name} (\S+)$", text, re.M).group(1))


def _tree_digest(root: Path) -> dict[str, str]:
    return {str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(root.rglob("*")) if p.is_file()}


@pytest.mark.slow  # ~20 s: FUZZ_SECONDS of fuzzing, then the drain and the checks
def test_fuzzed_requests_get_clean_errors_while_good_requests_stay_intact(server, stories_llm):
    engine_dir = Path(stories_llm.engine.engine_dir)
    before = _tree_digest(engine_dir)
    solo = [_good(server, i) for i in range(len(GOOD))]  # each good request alone on the idle server
    assert all(s[0] == 200 for s in solo), solo

    stop, good_runs, mismatches = threading.Event(), [0], []

    def good_worker(worker_seed: int) -> None:
        rng = random.Random(worker_seed)
        while not stop.is_set():
            i = rng.randrange(len(GOOD))
            got = _good(server, i)
            good_runs[0] += 1
            if got != solo[i]:
                mismatches.append((GOOD[i], solo[i], got))
    workers = [threading.Thread(target=good_worker, args=(SEED * 100 + w,)) for w in range(2)]
    for w in workers:
        w.start()

    rng, counts, failures = random.Random(SEED), {"tried": 0, "clean_4xx": 0, "accepted_2xx": 0}, []
    by_kind: dict[str, int] = {}
    deadline = time.monotonic() + FUZZ_SECONDS
    try:
        while time.monotonic() < deadline:
            kind, method, path, headers, body, chunked, allowed = _bad(rng)
            counts["tried"] += 1
            by_kind[kind] = by_kind.get(kind, 0) + 1
            if kind == "disconnect":
                _disconnect(server, path, body)
                continue
            try:
                status, raw = server.request(method, path, body, headers, chunked=chunked, timeout=60)
            except OSError as e:
                failures.append((kind, method, path, body[:200] if body else body, f"no response: {e!r}"))
                continue
            if status >= 500 or (allowed is not None and status not in allowed):
                failures.append((kind, method, path, body[:200] if body else body, status, raw[:300]))
            elif status >= 400:
                err = json.loads(raw).get("error", {})
                if set(err) != {"message", "type", "param", "code"} or not err["message"]:
                    failures.append((kind, method, path, body[:200] if body else body, status, raw[:300]))
                else:
                    counts["clean_4xx"] += 1
            else:
                counts["accepted_2xx"] += 1
    finally:
        stop.set()
        for w in workers:
            w.join(120)

    deadline = time.monotonic() + 60  # cut-off bodies and aborted streams free their blocks
    while True:
        metrics = server.request("GET", "/metrics", headers=AUTH)[1].decode()
        free, total = _metric(metrics, "nextn_kv_cache_free_blocks"), _metric(metrics, "nextn_kv_cache_total_blocks")
        if free == total and _metric(metrics, "nextn_num_requests_running") == 0:
            break
        assert time.monotonic() < deadline, f"KV cache not back to full: {free}/{total}"
        time.sleep(0.2)
    assert server.request("GET", "/health")[0] == 200
    assert [_good(server, i) for i in range(len(GOOD))] == solo  # still the same answers afterwards
    print(f"\nserve fuzz (seed {SEED}, {FUZZ_SECONDS:g} s): {counts['tried']} inputs tried, {counts['clean_4xx']} "
          f"clean 4xx errors, {counts['accepted_2xx']} accepted as valid, {by_kind.get('disconnect', 0)} cut off; "
          f"good requests intact: {good_runs[0] - len(mismatches)}/{good_runs[0]}; failures: {len(failures)}; "
          f"by kind: {dict(sorted(by_kind.items()))}")
    assert not failures, (len(failures), sorted({f[:3] for f in failures}), failures[:5])
    assert not mismatches, mismatches[:3]
    assert good_runs[0] >= len(GOOD) and counts["tried"] >= 100
    assert _tree_digest(engine_dir) == before
