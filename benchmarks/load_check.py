"""Load check of `nextn serve`: concurrent streams, cancellations and bad requests, then health and figures.

    python -m benchmarks.load_check --engine_dir DIR [--requests 64] [--max_tokens 32]
    python -m benchmarks.load_check --url http://127.0.0.1:8000 [--requests 64] [--api_key KEY]

Starts the server (or targets `--url`, loopback only), takes each prompt's non-streaming greedy completion as the
reference, then fires all requests at once: most stream (greedy, `ignore_eos`), every 8th from the 6th closes its
connection after two chunks, every 8th from the 4th is malformed (bad JSON, unknown model, n=2, a prompt or
max_tokens beyond max_seq_len, a wrong type). Checks: every completed stream equals its reference (text and token
count), every bad request got a 4xx OpenAI error body, and afterwards /health answers and the KV pool's free blocks
are back to full (the `nextn_kv_cache_free_blocks` gauge). Prints requests/s, output tokens/s, and TTFT and TPOT
p50/p90/p99 as the clients saw them. Exit status 0 when every check passed, 1 otherwise.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import re
import socket
import statistics
import subprocess
import sys
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from urllib.parse import urlparse

PROMPTS = ["Once upon a time", "Lily and Ben went to the park.", "The cat", "One day, a little boy",
           "The sun was shining", "Tom had a red ball.", "There was a big tree", "Mom said"]
MAX_REQUESTS = 256  # the check stays bounded
LOOPBACK = {"127.0.0.1", "localhost", "::1"}
_CANCELLED = 'nextn_request_finished_total\\{finish_reason="cancelled"\\}'
_SPEC = ("nextn_spec_decode_num_drafts_total", "nextn_spec_decode_num_draft_tokens_total",
         "nextn_spec_decode_num_accepted_tokens_total")


@dataclass
class Outcome:
    kind: str  # "stream", "cancel" or "bad"
    ok: bool = False
    problem: str = ""
    ttft_s: float | None = None
    tpot_s: float | None = None
    num_tokens: int = 0
    extra: dict = field(default_factory=dict)


def _http(url: str, body: bytes | None = None, timeout: float = 60, api_key: str | None = None) -> tuple[int, str]:
    headers = {"Content-Type": "application/json"} if body is not None else {}
    if api_key:
        headers["Authorization"] = f"Bearer {api_key}"
    req = urllib.request.Request(url, body, headers)
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return r.status, r.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode()


def _gauge(metrics: str, name: str) -> float | None:
    m = re.search(rf"^{name} (\S+)$", metrics, re.M)
    return float(m.group(1)) if m else None


def _bad_requests(model: str, max_seq_len: int) -> list[bytes]:
    long = {"model": model, "prompt": [1] * (max_seq_len + 8)}
    return [b'{"prompt": "x", ', json.dumps({"model": "no-such-model", "prompt": "x"}).encode(),
            json.dumps({"model": model, "prompt": "x", "n": 2}).encode(), json.dumps(long).encode(),
            json.dumps({"model": model, "prompt": "x", "max_tokens": max_seq_len * 4}).encode(),
            json.dumps({"model": model, "prompt": "x", "temperature": "hot"}).encode()]


async def _stream(client, model: str, prompt: str, max_tokens: int, reference: tuple[str, int] | None,
                  cancel: bool) -> Outcome:
    out = Outcome("cancel" if cancel else "stream")
    t0 = time.perf_counter()
    text, chunks, t_first, usage = "", 0, None, None
    try:
        stream = await client.completions.create(model=model, prompt=prompt, max_tokens=max_tokens, stream=True,
                                                 stream_options={"include_usage": True},
                                                 extra_body={"ignore_eos": True})
        async for chunk in stream:
            if chunk.usage is not None:
                usage = chunk.usage
            if chunk.choices and chunk.choices[0].text:
                t_first = t_first or time.perf_counter()
                text += chunk.choices[0].text
                chunks += 1
                if cancel and chunks == 2:
                    await stream.close()  # the client goes away mid-stream
                    out.ok = True
                    return out
    except Exception as e:  # noqa: BLE001 — a failed request is a finding, not a crash of the check
        out.problem = f"{type(e).__name__}: {e}"
        return out
    t_end = time.perf_counter()
    out.num_tokens = usage.completion_tokens if usage else 0
    if t_first is not None:
        out.ttft_s = t_first - t0
        out.tpot_s = (t_end - t_first) / (out.num_tokens - 1) if out.num_tokens > 1 else None
    if cancel:
        out.problem = "the stream ended before the client could close it"
    elif reference is None:
        out.problem = "no reference"
    elif (text, out.num_tokens) != reference:
        out.problem = f"stream differs from the non-streaming result: {text!r} ({out.num_tokens} tokens) vs {reference}"
    else:
        out.ok = True
    return out


async def _bad(url: str, body: bytes, api_key: str | None) -> Outcome:
    out = Outcome("bad")
    status, text = await asyncio.to_thread(_http, url + "/v1/completions", body, 60, api_key)
    try:
        error = json.loads(text)["error"]
        out.ok = 400 <= status < 500 and bool(error["message"]) and set(error) == {"message", "type", "param", "code"}
    except (ValueError, KeyError, TypeError):
        pass
    out.problem = "" if out.ok else f"expected a 4xx OpenAI error body, got {status}: {text[:200]}"
    return out


async def _run(url: str, num_requests: int, max_tokens: int, api_key: str | None) -> tuple[list[Outcome], float]:
    import openai

    client = openai.AsyncOpenAI(base_url=url + "/v1", api_key=api_key or "unused", max_retries=0, timeout=600)
    card = (await client.models.list()).data[0]
    model, max_seq_len = card.id, getattr(card, "max_model_len", 2048)
    refs = {}
    for prompt in PROMPTS:  # references: one at a time, non-streaming
        r = await client.completions.create(model=model, prompt=prompt, max_tokens=max_tokens,
                                            extra_body={"ignore_eos": True})
        refs[prompt] = (r.choices[0].text, r.usage.completion_tokens)
    bad = _bad_requests(model, max_seq_len)
    tasks = []
    for i in range(num_requests):
        prompt = PROMPTS[i % len(PROMPTS)]
        if i % 8 == 3:
            tasks.append(_bad(url, bad[(i // 8) % len(bad)], api_key))
        else:
            cancel = i % 8 == 5  # asks for nearly max_seq_len tokens: only an abort frees its blocks soon
            limit = max_seq_len - 32 if cancel else max_tokens
            tasks.append(_stream(client, model, prompt, limit, refs[prompt], cancel))
    t0 = time.perf_counter()
    outcomes = await asyncio.gather(*tasks)
    wall = time.perf_counter() - t0
    await client.close()
    return list(outcomes), wall


def _after(url: str, cancelled_before: float, num_cancels: int, api_key: str | None,
           timeout: float = 60) -> tuple[list[str], str]:
    """Problems with the server once the load is over (health, running requests, KV blocks not back, cancelled
    requests not aborted), and its /metrics text."""
    deadline = time.monotonic() + timeout
    while True:
        metrics = _http(url + "/metrics", api_key=api_key)[1]
        free, total = _gauge(metrics, "nextn_kv_cache_free_blocks"), _gauge(metrics, "nextn_kv_cache_total_blocks")
        running = _gauge(metrics, "nextn_num_requests_running")
        if free == total and running == 0:
            break
        if time.monotonic() > deadline:
            return [f"after {timeout:.0f} s: {running} requests still running, {free}/{total} KV blocks free"], metrics
        time.sleep(0.2)
    problems = [] if _http(url + "/health")[0] == 200 else ["/health does not answer 200"]
    aborted = (_gauge(metrics, _CANCELLED) or 0) - cancelled_before
    if aborted < num_cancels:
        problems.append(f"{num_cancels} clients left mid-stream but only {aborted:.0f} requests were aborted")
    return problems, metrics


def _percentiles(values: list[float]) -> str:
    if len(values) < 2:
        return "n/a"
    q = statistics.quantiles(values, n=100, method="inclusive")
    return f"p50 {q[49] * 1e3:.1f} ms, p90 {q[89] * 1e3:.1f} ms, p99 {q[98] * 1e3:.1f} ms"


def _start_server(engine_dir: str, options: str | None, timeout: float,
                  api_key: str | None) -> tuple[subprocess.Popen, str]:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    proc = subprocess.Popen([sys.executable, "-m", "nextn.cli.main", "serve", "--engine_dir", engine_dir,
                             "--port", str(port), "--log_level", "warning"]
                            + (["--extra_llm_api_options", options] if options else []),
                            env={k: v for k, v in os.environ.items() if k != "NEXTN_API_KEY"}
                            | ({"NEXTN_API_KEY": api_key} if api_key else {}))
    url, deadline = f"http://127.0.0.1:{port}", time.monotonic() + timeout
    while True:
        if proc.poll() is not None:
            raise SystemExit(f"load_check: nextn serve exited with status {proc.returncode}")
        try:
            if _http(url + "/health", timeout=5)[0] == 200:
                return proc, url
        except OSError:
            pass
        if time.monotonic() > deadline:
            proc.terminate()
            raise SystemExit(f"load_check: nextn serve was not healthy within {timeout:.0f} s")
        time.sleep(0.5)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.load_check", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    target = ap.add_mutually_exclusive_group(required=True)
    target.add_argument("--engine_dir", help="start `nextn serve` on this engine (a free loopback port)")
    target.add_argument("--url", help="a running server on this machine, e.g. http://127.0.0.1:8000")
    ap.add_argument("--extra_llm_api_options", help="with --engine_dir: LLM-args YAML for the server it starts")
    ap.add_argument("--requests", type=int, default=64, help=f"requests fired at once (1..{MAX_REQUESTS}, default 64)")
    ap.add_argument("--max_tokens", type=int, default=32, help="tokens per streamed completion (default 32)")
    ap.add_argument("--api_key", default=os.environ.get("NEXTN_API_KEY") or None,
                    help="the server's API key (default: the NEXTN_API_KEY environment variable); with "
                         "--engine_dir, the server started here requires it")
    ap.add_argument("--startup_timeout", type=float, default=300, help="seconds to wait for the server (default 300)")
    args = ap.parse_args(argv)
    if not 1 <= args.requests <= MAX_REQUESTS:
        ap.error(f"--requests must be in 1..{MAX_REQUESTS}")
    if args.url and urlparse(args.url).hostname not in LOOPBACK:
        ap.error("--url must be a loopback address (127.0.0.1, localhost, ::1): the check stays on this machine")
    proc, url = None, (args.url or "").rstrip("/")
    if args.engine_dir:
        proc, url = _start_server(args.engine_dir, args.extra_llm_api_options, args.startup_timeout, args.api_key)
    try:
        key = args.api_key
        status, text = _http(url + "/v1/models", api_key=key)
        if status != 200:
            print(f"load check: FAILED (GET /v1/models answered {status}: {text[:300]})")
            return 1
        cancelled_before = _gauge(_http(url + "/metrics", api_key=key)[1], _CANCELLED) or 0
        outcomes, wall = asyncio.run(_run(url, args.requests, args.max_tokens, key))
        after, metrics = _after(url, cancelled_before, sum(o.kind == "cancel" for o in outcomes), key)
        problems = [f"{o.kind}: {o.problem}" for o in outcomes if not o.ok] + after
    finally:
        if proc is not None:
            proc.terminate()
            proc.wait(30)
    done = [o for o in outcomes if o.kind == "stream" and o.ok]
    counts = {k: sum(o.kind == k for o in outcomes) for k in ("stream", "cancel", "bad")}
    print(f"requests: {len(outcomes)} ({counts['stream']} streams, {counts['cancel']} cancelled mid-stream, "
          f"{counts['bad']} bad), max_tokens {args.max_tokens}, wall {wall:.2f} s")
    print(f"completed streams: {len(done)}/{counts['stream']}, {len(done) / wall:.2f} requests/s, "
          f"{sum(o.num_tokens for o in done) / wall:.1f} output tokens/s ({len(outcomes) / wall:.2f} requests/s "
          "counting cancelled and bad ones)")
    print(f"TTFT: {_percentiles([o.ttft_s for o in done if o.ttft_s is not None])}")
    print(f"TPOT: {_percentiles([o.tpot_s for o in done if o.tpot_s is not None])}")
    drafts, draft_tokens, accepted = (_gauge(metrics, name) or 0 for name in _SPEC)
    print(f"speculative decoding (server totals): {drafts:.0f} verify-and-draft steps, {draft_tokens:.0f} draft "
          f"tokens, {accepted:.0f} accepted (DAR {accepted / draft_tokens if draft_tokens else 0:.3f})")
    for p in problems[:20]:
        print(f"PROBLEM {p}")
    print("load check: " + ("PASSED (no request lost or corrupted, server healthy, KV blocks back to full)"
                            if not problems else f"FAILED ({len(problems)} problems)"))
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
