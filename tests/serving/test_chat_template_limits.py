"""`nextn serve` (the CLI, in a subprocess) over an engine whose chat template renders forever (as an engine built
before build-engine checked templates can be): each chat request's render is stopped at --chat_template_timeout
(400 `chat_template_limit`); clients that leave stop their renders; meanwhile /health answers in under 100 ms, a
completion takes at most about twice its time on the idle server, and SIGTERM stops the server within 10 s, its
render workers included.

Issue 32's full case is 50 chat requests each abandoned after 3 s, on a quiet machine:
    NEXTN_ABANDONED_CHATS=50 NEXTN_ABANDON_AFTER_S=3 NEXTN_TIMING_SLACK_S=0 \
        pytest tests/serving/test_chat_template_limits.py
CI runs fewer, abandoned sooner, against a shorter budget: the same mechanism.
"""

from __future__ import annotations

import http.client
import json
import os
import signal
import socket
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from nextn.build.engine_builder import build_engine
from nextn.build.manifest import EngineManifest, file_checksum

STORIES = Path(__file__).resolve().parents[2].parent / "shared" / "data" / "models" / "stories260K" / "stories260K.gguf"
FOREVER = "{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}{{ messages[0].content }}"
ABANDONED = int(os.environ.get("NEXTN_ABANDONED_CHATS", "12"))
ABANDON_AFTER_S = float(os.environ.get("NEXTN_ABANDON_AFTER_S", "1.5"))
# A 2-core CI machine shared with other jobs times a completion with ±0.5 s of noise (the full run can set 0).
SLACK_S = float(os.environ.get("NEXTN_TIMING_SLACK_S", "0.5"))
TEMPLATE_TIMEOUT_S = 2.0
COMPLETION = {"prompt": "Once upon a time", "max_tokens": 8, "ignore_eos": True}
CHAT = {"messages": [{"role": "user", "content": "Tell me a story."}], "max_tokens": 8}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def engine(tmp_path_factory) -> Path:
    """stories260K with FOREVER as its chat template (listed and checksummed in the manifest, as a build writes)."""
    if not STORIES.is_file():
        pytest.skip(f"{STORIES} is absent (../shared/data): the real stories260K model is not available")
    out = tmp_path_factory.mktemp("forever") / "engine"
    build_engine(STORIES, out, max_seq_len=256, progress=False)
    (out / "chat_template.jinja").write_text(FOREVER)
    manifest = EngineManifest.load(out)
    manifest.tokenizer_files.append("chat_template.jinja")
    manifest.checksums["chat_template.jinja"] = file_checksum(out / "chat_template.jinja")
    manifest.save(out)
    return out


class Serve:
    """`nextn serve` in a subprocess (its own process group), with raw HTTP helpers."""

    def __init__(self, engine: Path, log: Path) -> None:
        self.port = _free_port()
        self.log = log
        with open(log, "w") as out:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "nextn.cli.main", "serve", "--engine_dir", str(engine), "--port",
                 str(self.port), "--chat_template_timeout", str(TEMPLATE_TIMEOUT_S), "--device", "cpu"],
                stdout=out, stderr=subprocess.STDOUT, env={**os.environ, "TOKENIZERS_PARALLELISM": "false"},
                start_new_session=True)
        deadline = time.monotonic() + 180
        while self.request("GET", "/health", timeout=2)[0] != 200:
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self.kill()
                pytest.fail(f"nextn serve did not start:\n{log.read_text()[-3000:]}")
            time.sleep(0.3)

    def request(self, method: str, path: str, body: dict | None = None, timeout: float = 60) -> tuple[int, dict]:
        conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=timeout)
        try:
            conn.request(method, path, json.dumps(body) if body else None, {"Content-Type": "application/json"})
            r = conn.getresponse()
            data = r.read()
            return r.status, json.loads(data) if data else {}
        except OSError:
            return 0, {}
        finally:
            conn.close()

    def abandon(self, body: dict, after_s: float) -> None:
        """Send a chat request and hang up after `after_s` without reading the answer."""
        with socket.create_connection(("127.0.0.1", self.port), timeout=10) as s:
            data = json.dumps(body).encode()
            s.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                      b"Content-Length: %d\r\n\r\n%s" % (len(data), data))
            time.sleep(after_s)

    def timed_completion(self) -> float:
        start = time.monotonic()
        status, body = self.request("POST", "/v1/completions", COMPLETION)
        assert status == 200, body
        return time.monotonic() - start

    def workers(self) -> set[int]:
        """Pids of the server's chat-template workers (its children running template_worker.py)."""
        found = set()
        for proc in Path("/proc").iterdir():
            try:
                stat = (proc / "stat").read_text()
                cmd = (proc / "cmdline").read_bytes()
            except OSError:
                continue
            if proc.name.isdigit() and int(stat.rsplit(")", 1)[1].split()[1]) == self.proc.pid \
                    and b"template_worker.py" in cmd:
                found.add(int(proc.name))
        return found

    def workers_idle_within(self, seconds: float) -> bool:
        """Whether the workers stop using CPU (same pids, no CPU tick for 0.5 s) within `seconds`."""
        deadline, last = time.monotonic() + seconds, None
        while time.monotonic() < deadline:
            ticks = {}
            for pid in self.workers():
                try:
                    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
                    ticks[pid] = int(fields[11]) + int(fields[12])  # utime + stime
                except OSError:
                    pass
            if ticks and ticks == last:
                return True
            last = ticks
            time.sleep(0.5)
        return False

    def kill(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(10)


def test_forever_template_under_abandoned_chats(engine, tmp_path):
    server = Serve(engine, tmp_path / "serve.log")
    try:
        for _ in range(3):  # warm-up: the first steps of a fresh engine are slower
            server.timed_completion()
        baseline = statistics.median(server.timed_completion() for _ in range(3))

        start = time.monotonic()  # one chat waits for its answer: the budget's 400, naming the limit
        status, body = server.request("POST", "/v1/chat/completions", CHAT)
        assert status == 400 and body["error"]["code"] == "chat_template_limit", body
        assert "within 2 s" in body["error"]["message"] and time.monotonic() - start < TEMPLATE_TIMEOUT_S + 3

        clients = [threading.Thread(target=server.abandon, args=(CHAT, ABANDON_AFTER_S), daemon=True)
                   for _ in range(ABANDONED)]
        for c in clients:
            c.start()
        time.sleep(0.5)
        health = []
        for _ in range(10):
            t = time.monotonic()
            assert server.request("GET", "/health", timeout=5)[0] == 200
            health.append(time.monotonic() - t)
            time.sleep(0.05)
        loaded = statistics.median(server.timed_completion() for _ in range(3))
        for c in clients:
            c.join(ABANDON_AFTER_S + 20)
        # the event loop answers while renders run: a render on it would block a probe for its 2 s budget; a probe's
        # single spike of ~0.2 s is this 2-core machine's scheduling (CI: another test's kernels on the other core)
        assert statistics.median(health) < 0.1 and max(health) < 1.0, health
        assert loaded < 2 * baseline + SLACK_S, (loaded, baseline)
        # abandoned renders were stopped and the queued ones dropped, not rendered to their 2 s budget one by one
        assert server.workers_idle_within(5.0)

        for c in [threading.Thread(target=server.abandon, args=(CHAT, 30), daemon=True) for _ in range(4)]:
            c.start()  # renders in flight (and waiting) when the signal comes
        time.sleep(1.0)
        workers = server.workers()
        assert workers
        start = time.monotonic()
        server.proc.send_signal(signal.SIGTERM)
        server.proc.wait(10)
        assert time.monotonic() - start < 10
        time.sleep(0.5)
        assert not [pid for pid in workers if Path(f"/proc/{pid}").exists()], "render workers outlived the server"
    finally:
        server.kill()
