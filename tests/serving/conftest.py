"""A real Triton Inference Server (2.51, from the nvidia-pytriton wheel) for the serving tests.

As ../shared/TRITON_SERVER.md describes: an assembled Python-backend directory of symlinks (with the stub for this
Python), `PATH` starting with this venv's `bin/`, `LD_LIBRARY_PATH` = libpython's directory, loopback ports picked
free, the server in its own session (its whole process group is killed on a hang or at the end), a hard ready
timeout, and the Python backend's /dev/shm regions under a per-server prefix that is removed afterwards.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import sysconfig
import time
import urllib.request
from pathlib import Path

import pytest

READY_TIMEOUT_S = 240  # torch import + engine load per model, on a contended 2-core machine


def _pytriton_dir() -> Path | None:
    try:
        import pytriton
    except ImportError:
        return None
    return Path(pytriton.__file__).parent / "tritonserver"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class TritonServer:
    """One `tritonserver` process over a model repository; `stop()` ends its process group and cleans /dev/shm."""

    def __init__(self, repo: Path, workdir: Path) -> None:
        root = _pytriton_dir()
        binary = root / "bin" / "tritonserver" if root else None
        if binary is None or not binary.is_file():
            pytest.skip("tritonserver not found: install nvidia-pytriton==0.7.0 (bundles Triton 2.51)")
        stub = root / "python_backend_stubs" / f"{sys.version_info.major}.{sys.version_info.minor}" / \
            "triton_python_backend_stub"
        if not stub.is_file():
            pytest.skip(f"the wheel has no Python backend stub for Python {sys.version_info[:2]}")
        backends = workdir / "backends" / "python"
        backends.mkdir(parents=True, exist_ok=True)
        for src in (root / "backends" / "python" / "libtriton_python.so",
                    root / "backends" / "python" / "triton_python_backend_utils.py", stub):
            link = backends / src.name
            if not link.exists():
                link.symlink_to(src)  # symlinks keep the $ORIGIN RPATH working
        self.shm_prefix = f"nextn_test_{os.getpid()}_{time.monotonic_ns() % 10**9}_"
        self.http_port, self.grpc_port, metrics_port = _free_port(), _free_port(), _free_port()
        env = dict(os.environ, PATH=f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}",
                   LD_LIBRARY_PATH=sysconfig.get_config_var("LIBDIR") or "")
        self.log_path = workdir / "tritonserver.log"
        cmd = [str(binary), f"--model-repository={repo}", f"--backend-directory={backends.parent}",
               "--http-address=127.0.0.1", f"--http-port={self.http_port}", "--grpc-address=127.0.0.1",
               f"--grpc-port={self.grpc_port}", "--metrics-address=127.0.0.1", f"--metrics-port={metrics_port}",
               "--allow-gpu-metrics=false", "--pinned-memory-pool-byte-size=0", "--cuda-memory-pool-byte-size=0:0",
               "--disable-auto-complete-config", "--exit-timeout-secs=15",
               f"--backend-config=python,shm-region-prefix-name={self.shm_prefix}"]
        self._log = open(self.log_path, "wb")
        self.proc = subprocess.Popen(cmd, env=env, stdout=self._log, stderr=subprocess.STDOUT, start_new_session=True)
        try:
            self._wait_ready()
        except BaseException:
            self.stop()
            raise

    @property
    def http_url(self) -> str:
        return f"127.0.0.1:{self.http_port}"

    @property
    def grpc_url(self) -> str:
        return f"127.0.0.1:{self.grpc_port}"

    def log_tail(self, chars: int = 4000) -> str:
        return self.log_path.read_text(errors="replace")[-chars:]

    def _wait_ready(self) -> None:
        deadline = time.monotonic() + READY_TIMEOUT_S
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"tritonserver exited with {self.proc.returncode}:\n{self.log_tail()}")
            try:
                with urllib.request.urlopen(f"http://{self.http_url}/v2/health/ready", timeout=2) as r:
                    if r.status == 200:
                        return
            except OSError:
                pass
            time.sleep(0.5)
        raise RuntimeError(f"tritonserver not ready after {READY_TIMEOUT_S} s (killed):\n{self.log_tail()}")

    def stop(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(10)
        try:  # stubs that outlived the server
            os.killpg(self.proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        self._log.close()
        for leftover in Path("/dev/shm").glob(f"{self.shm_prefix}*"):
            leftover.unlink(missing_ok=True)


@pytest.fixture(scope="session")
def triton_server_cls() -> type[TritonServer]:
    """`TritonServer(repo, workdir)` starts a server (skips the test when the binary is absent); call `.stop()`."""
    return TritonServer


# nextn serve in this process: the real stories260K model, uvicorn on a loopback port in a thread -----------------
STORIES = Path(__file__).resolve().parents[2].parent / "shared" / "data" / "models" / "stories260K" / "stories260K.gguf"


@pytest.fixture(scope="session")
def stories_llm(tmp_path_factory):
    """`LLM` over an engine built from the real stories260K GGUF (vocabulary 512, max_seq_len 256), on CPU."""
    if not STORIES.is_file():
        pytest.skip(f"{STORIES} is absent (../shared/data): the real stories260K model is not available")
    from nextn import LLM
    from nextn.build.engine_builder import build_engine

    engine = tmp_path_factory.mktemp("stories") / "engine"
    build_engine(STORIES, engine, max_seq_len=256, progress=False)
    llm = LLM(engine, device="cpu")
    yield llm
    llm.shutdown()


class LocalServer:
    """uvicorn serving `app` on a free 127.0.0.1 port in a daemon thread; `stop()` ends it."""

    def __init__(self, app) -> None:
        import threading

        import uvicorn

        self.port = _free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=self.port, log_level="critical"))
        self.thread = threading.Thread(target=self.server.run, daemon=True)
        self.thread.start()
        deadline = time.monotonic() + 60
        while not self.server.started:
            if not self.thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError("uvicorn did not start")
            time.sleep(0.05)

    def request(self, method: str, path: str, body: bytes | None = None, headers: dict | None = None,
                chunked: bool = False, timeout: float = 120) -> tuple[int, bytes]:
        """One raw HTTP request (any bytes, any headers); returns (status, body)."""
        import http.client

        conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=timeout)
        try:
            payload = iter([body[i:i + 65536] for i in range(0, len(body), 65536)]) if chunked and body else body
            conn.request(method, path, body=payload, headers=headers or {}, encode_chunked=chunked)
            response = conn.getresponse()
            return response.status, response.read()
        finally:
            conn.close()

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(30)


@pytest.fixture(scope="session")
def local_server_cls() -> type[LocalServer]:
    """`LocalServer(app)` serves a FastAPI app on loopback (`.url`, `.request(...)`, `.stop()`)."""
    return LocalServer
