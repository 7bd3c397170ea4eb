"""A pool of child processes that run untrusted-cost work (chat-template renders, grammar compiles) under a budget.

Work that cannot be stopped inside a Python thread (a Jinja loop, xgrammar expanding `[a-z]{2000,10000}`) runs in a
child process that the parent kills when the work passes its wall-clock budget or its caller cancels it, and
replaces at once. Each worker is a script (`python -P SCRIPT ARGS`) that speaks length-prefixed JSON frames
(`runtime/worker_frames.py`; no pickle both ways) and sends `{"ready": true}` once its imports are done.

`WorkerPool` holds at most `num_workers` processes; `acquire` hands one out (waiting while all are busy, up to a
bound when the caller gives one), `release` takes it back — kept, or killed and replaced when its work failed.
The chat-template renderer (`runtime/template_render.py`) and the grammar compiler (`runtime/grammar_pool.py`) are
its two users.
"""

from __future__ import annotations

import json
import math
import os
import select
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path

from nextn.runtime.worker_frames import HEADER

STARTUP_TIMEOUT_S = 60.0  # a worker's imports (about 1–2 s; longer on a machine under load)
POLL_S = 0.05  # how often a waiting caller checks its cancel event


class WorkerGone(Exception):
    """The worker exited or sent something that is not a frame."""


class WorkCancelled(Exception):
    """The caller cancelled the work (its client left); the worker was stopped."""


class PoolClosed(Exception):
    """The pool was closed (the process is shutting down); work in flight or waiting ends with this at once."""


class PoolBusy(Exception):
    """Every worker stayed busy for the caller's whole wait."""


def check_timeout_s(value: object) -> None:
    """Raises ValueError unless `value` is a finite number of seconds > 0 (a bool is not a number here)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value <= 0:
        raise ValueError(f"timeout_s must be a finite number of seconds > 0, got {value!r}")


def interpreter() -> str:
    """This Python's interpreter: `sys.executable`, or where an embedding host (e.g. Triton's Python-backend stub)
    sets it to itself or nothing, the python of `sys.prefix`."""
    if sys.executable and Path(sys.executable).name.startswith("python"):
        return sys.executable
    version = f"python{sys.version_info.major}.{sys.version_info.minor}"
    for candidate in (Path(sys.prefix) / "bin" / version, Path(sys.prefix) / "bin" / "python3",
                      Path(sys.exec_prefix) / "bin" / version):
        if candidate.is_file():
            return str(candidate)
    return sys.executable or "python3"


class Worker:
    """One worker process and its frame reader (os.read on the pipe: select() sees what is buffered).

    Attributes:
        proc: the child process. ready: its `{"ready": true}` was read. state: what the pool's user keeps per
            worker (e.g. the tokenizers it has loaded).
    """

    def __init__(self, argv: Sequence[str]) -> None:
        """Raises OSError when the interpreter cannot be started."""
        self.proc = subprocess.Popen(list(argv), stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     stderr=subprocess.DEVNULL)
        assert self.proc.stdin is not None and self.proc.stdout is not None  # (both piped)
        self.stdin, self.stdout = self.proc.stdin, self.proc.stdout
        self.ready = False
        self.state: dict = {}
        self._buf = bytearray()

    def send(self, obj: object) -> None:
        """Send `obj` as one frame.

        Raises:
            ValueError: `obj` is not JSON data (a cycle, nesting past the recursion limit).
            WorkerGone: the worker exited.
        """
        try:
            # like transformers' _plain_template_data, an object that is not JSON data becomes a "<Type>" placeholder
            text = json.dumps(obj, ensure_ascii=False, default=lambda o: f"<{type(o).__name__}>")
        except (ValueError, RecursionError) as e:
            raise ValueError(f"not JSON data ({e})") from None
        data = text.encode("utf-8", "surrogatepass")
        try:
            self.stdin.write(HEADER.pack(len(data)) + data)
            self.stdin.flush()
        except (BrokenPipeError, OSError) as e:
            raise WorkerGone(f"the worker exited ({e})") from None

    def receive(self, deadline: float, cancel: threading.Event | None, max_bytes: int) -> dict | None:
        """The next frame, or None when `deadline` (time.monotonic) passes first.

        Raises:
            WorkCancelled: `cancel` was set.
            WorkerGone: the worker exited, or sent an oversized or malformed frame.
        """
        fd = self.stdout.fileno()
        while True:
            if len(self._buf) >= HEADER.size:
                (size,) = HEADER.unpack_from(self._buf)
                if size > max_bytes:
                    raise WorkerGone(f"the worker sent a frame of {size} bytes (at most {max_bytes})")
                if len(self._buf) >= HEADER.size + size:
                    data = bytes(self._buf[HEADER.size:HEADER.size + size])
                    del self._buf[:HEADER.size + size]
                    try:
                        frame = json.loads(data.decode("utf-8", "surrogatepass"))
                    except ValueError as e:
                        raise WorkerGone(f"the worker sent a malformed frame ({e})") from None
                    if not isinstance(frame, dict):
                        raise WorkerGone("the worker sent a frame that is not an object")
                    return frame
            if cancel is not None and cancel.is_set():
                raise WorkCancelled("the work was cancelled")
            left = deadline - time.monotonic()
            if left <= 0:
                return None
            if select.select([fd], [], [], min(POLL_S, left))[0]:
                chunk = os.read(fd, 1 << 20)
                if not chunk:
                    raise WorkerGone(f"the worker exited (code {self.proc.wait()})")
                self._buf += chunk

    def wait_ready(self, cancel: threading.Event | None = None) -> None:
        """Read the worker's `{"ready": true}` (once). Raises WorkerGone without it within STARTUP_TIMEOUT_S."""
        if self.ready:
            return
        frame = self.receive(time.monotonic() + STARTUP_TIMEOUT_S, cancel, 1024)
        if frame != {"ready": True}:
            raise WorkerGone(f"no ready signal within {STARTUP_TIMEOUT_S:g} s" if frame is None else
                             f"an unexpected first frame {str(frame)[:80]}")
        self.ready = True

    def kill(self) -> None:
        self.proc.kill()
        self.proc.wait()
        for pipe in (self.stdin, self.stdout):
            try:
                pipe.close()
            except OSError:
                pass


class WorkerPool:
    """At most `num_workers` worker processes of one script; thread-safe.

    Args:
        argv: the worker's command line (`[interpreter(), "-P", script, ...]`), or a callable returning it at each
            start (so that a test may point it elsewhere).
        num_workers: the most processes at once (≥ 1); callers beyond wait for a free one.
        what: the workers' name in messages ("chat-template", "grammar").
    """

    def __init__(self, argv: Sequence[str] | Callable[[], Sequence[str]], num_workers: int, what: str) -> None:
        if num_workers < 1:
            raise ValueError(f"num_workers must be ≥ 1, got {num_workers}")
        self._argv, self.num_workers, self.what = argv, num_workers, what
        self._idle: list[Worker] = []
        self._busy: set[Worker] = set()
        self._cond = threading.Condition()
        self._closed = False

    @property
    def closed(self) -> bool:
        return self._closed

    def _spawn(self) -> Worker:
        argv = self._argv() if callable(self._argv) else self._argv
        try:
            return Worker(argv)
        except OSError as e:
            raise WorkerGone(f"cannot start a {self.what} worker ({argv[0]}): {e}") from None

    def start(self) -> None:
        """Start the workers now (non-blocking: their imports run in the background), so that the first use does
        not wait for them. Raises WorkerGone when one cannot be started."""
        with self._cond:
            while not self._closed and len(self._idle) + len(self._busy) < self.num_workers:
                self._idle.append(self._spawn())

    def acquire(self, cancel: threading.Event | None = None, wait_s: float | None = None) -> Worker:
        """A worker for one piece of work (a ready one first; started here when the pool has room).

        Args:
            cancel: set it to stop waiting (`WorkCancelled`). wait_s: the most seconds to wait for a free worker
                (None: as long as it takes).
        Raises:
            PoolClosed, WorkCancelled, PoolBusy (all workers busy for `wait_s`), WorkerGone (cannot start one).
        """
        deadline = None if wait_s is None else time.monotonic() + wait_s
        with self._cond:
            while True:
                if self._closed:
                    raise PoolClosed(f"the {self.what} workers are closed (the process is shutting down)")
                if cancel is not None and cancel.is_set():
                    raise WorkCancelled("the work was cancelled before it started")
                ready = [w for w in self._idle if w.ready]
                if ready or self._idle:
                    worker = (ready or self._idle)[0]
                    self._idle.remove(worker)
                    break
                if len(self._busy) < self.num_workers:
                    worker = self._spawn()
                    break
                if deadline is not None and time.monotonic() >= deadline:
                    raise PoolBusy(f"all {self.num_workers} {self.what} workers stayed busy for {wait_s:g} s")
                self._cond.wait(POLL_S)
            self._busy.add(worker)
            return worker

    def release(self, worker: Worker, keep: bool) -> None:
        """Take `worker` back: kept for the next caller, or (`keep` False: its work failed or passed its budget)
        killed, and a fresh one started in its place."""
        with self._cond:
            self._busy.discard(worker)
            retire: Worker | None = worker
            if keep and not self._closed:
                self._idle.append(worker)
                retire = None
            elif not self._closed:  # a fresh one in its place, starting now (else at the next use)
                try:
                    self._idle.append(self._spawn())
                except WorkerGone:
                    pass
            self._cond.notify()
        if retire is not None:
            retire.kill()

    def close(self) -> None:
        """Stop every worker now; work in flight or waiting raises `PoolClosed`. Safe from a signal handler of a
        thread that uses no worker (e.g. a server's event loop)."""
        with self._cond:
            self._closed = True
            idle, busy, self._idle = self._idle, list(self._busy), []
            self._cond.notify_all()
        for worker in busy:
            worker.proc.kill()  # its caller sees the end of its output and ends; that thread reaps it
        for worker in idle:
            worker.kill()
