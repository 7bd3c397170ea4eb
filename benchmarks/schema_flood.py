"""A server's memory under a flood of distinct JSON schemas, and /health while a tools request with a slow schema
compiles: `nextn serve` started on `--model` (a GGUF, checkpoint or engine), then, with its RSS (server plus its
worker processes) printed every 60 schemas,

    python -m benchmarks.schema_flood --model ../shared/data/models/smollm2-135m-instruct/SmolLM2-135M-Instruct.Q4_1.gguf \
        [--schemas 240] [--slow_pattern "[a-z]{3000,20000}"]

Each schema request generates one token; the slow request is `tool_choice: "required"` with a function whose
parameter has `--slow_pattern` (served within `--grammar_timeout`, or a 400 `grammar_limit`). Prints figures; writes
nothing. docs/RELIABILITY.md quotes them.
"""

from __future__ import annotations

import argparse
import http.client
import json
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

USER = [{"role": "user", "content": "Answer in JSON."}]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _request(port: int, method: str, path: str, body: dict | None = None, timeout: float = 120) -> tuple[int, dict]:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout)
    try:
        conn.request(method, path, json.dumps(body) if body else None, {"Content-Type": "application/json"})
        r = conn.getresponse()
        data = r.read()
        return r.status, (json.loads(data) if data else {})
    except OSError:
        return 0, {}
    finally:
        conn.close()


def _parent(proc: Path) -> int:
    try:
        return int((proc / "stat").read_text().rsplit(")", 1)[1].split()[1])
    except (OSError, ValueError, IndexError):
        return -1


def rss_mib(pid: int) -> float:
    """Resident MiB of `pid` and its children (the grammar and chat-template workers)."""
    pids = [pid] + [int(p.name) for p in Path("/proc").iterdir() if p.name.isdigit() and _parent(p) == pid]
    total = 0
    for p in pids:
        try:
            with open(f"/proc/{p}/status") as f:
                total += next(int(line.split()[1]) for line in f if line.startswith("VmRSS"))
        except (OSError, StopIteration):
            pass
    return total / 1024


def schema(i: int) -> dict:
    """A distinct 12-property object schema (~630 bytes of JSON)."""
    props = {f"field_{i}_{j}": {"type": ["string", "integer", "boolean"][j % 3], **({"maxLength": 20} if j % 3 == 0
                                                                                    else {})} for j in range(12)}
    return {"type": "object", "properties": props, "required": sorted(props)[:6], "additionalProperties": False}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", required=True, help="what `nextn serve --model` takes")
    ap.add_argument("--schemas", type=int, default=240, help="distinct schemas to send (default 240)")
    ap.add_argument("--slow_pattern", default="[a-z]{2000,10000}", help="the slow tool parameter's pattern")
    ap.add_argument("--serve_args", nargs=argparse.REMAINDER, default=[], help="more `nextn serve` arguments")
    args = ap.parse_args(argv)
    port = _free_port()
    log = tempfile.NamedTemporaryFile("w", suffix=".log", delete=False)
    proc = subprocess.Popen([sys.executable, "-m", "nextn.cli.main", "serve", "--model", args.model, "--port",
                             str(port), "--device", "cpu", *args.serve_args], stdout=log, stderr=subprocess.STDOUT,
                            start_new_session=True)
    try:
        start = time.monotonic()
        while _request(port, "GET", "/health", timeout=2)[0] != 200:
            if proc.poll() is not None:
                print(f"nextn serve exited; its log: {log.name}", file=sys.stderr)
                return 1
            time.sleep(0.5)
        print(f"server up in {time.monotonic() - start:.0f} s; schema bytes {len(json.dumps(schema(0)))}")

        def one(i: int) -> None:
            status, body = _request(port, "POST", "/v1/chat/completions", {
                "messages": USER, "max_tokens": 1,
                "response_format": {"type": "json_schema", "json_schema": {"name": "s", "schema": schema(i)}}})
            if status != 200:
                raise SystemExit(f"schema {i}: HTTP {status} {body}")
        one(-1)
        print(f"after the first schema: {rss_mib(proc.pid):.0f} MiB (server + workers)")
        for i in range(args.schemas):
            one(i)
            if (i + 1) % 60 == 0 or i + 1 == args.schemas:
                print(f"after {i + 1} distinct schemas: {rss_mib(proc.pid):.0f} MiB", flush=True)
        slow = {"type": "object", "properties": {"code": {"type": "string", "pattern": args.slow_pattern}},
                "required": ["code"]}
        result: dict = {}

        def tools() -> None:
            t = time.monotonic()
            result["reply"] = _request(port, "POST", "/v1/chat/completions", {
                "messages": USER, "max_tokens": 8, "tool_choice": "required",
                "tools": [{"type": "function", "function": {"name": "run", "parameters": slow}}]})
            result["s"] = time.monotonic() - t
        thread = threading.Thread(target=tools)
        thread.start()
        health = []
        while thread.is_alive():
            t = time.monotonic()
            _request(port, "GET", "/health", timeout=10)
            health.append(time.monotonic() - t)
            time.sleep(0.05)
        status, body = result["reply"]
        print(f"tools request with pattern {args.slow_pattern}: HTTP {status} {body.get('error', {}).get('code') or ''}"
              f" in {result['s']:.2f} s; /health at most {max(health) * 1000:.0f} ms over {len(health)} polls")
    finally:
        proc.terminate()
        proc.wait(30)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
