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
