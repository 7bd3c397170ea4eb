"""release_thread_pool frees the calling thread's OpenMP workers, and the engine loop calls it."""

import os
import sys
import threading
import time

import pytest
import torch

from nextn.runtime import engine_loop
from nextn.runtime.openmp_pool import release_thread_pool

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="counts threads through /proc")


def _num_threads() -> int:
    return len(os.listdir("/proc/self/task"))


def _parallel_work() -> None:
    a = torch.randn(256, 512)
    for _ in range(3):
        a @ a.T  # an OpenMP parallel region on the calling thread


@pytest.fixture(params=["sentencepiece's libgomp loaded too", "torch's runtime"])
def runtimes(request):
    """Also with a second libgomp in the process: sentencepiece's wheel bundles its own, which a tokenizer loads
    beside torch's (and which /proc/self/maps may list first); the release must reach the pool torch's kernels
    run on."""
    if request.param != "torch's runtime":
        pytest.importorskip("sentencepiece", reason="sentencepiece (a test dependency) brings the second libgomp")
    return request.param


def _settled(timeout_s: float = 5.0) -> None:
    """Wait (at most timeout_s) until no thread of the process starts or exits for 0.2 s: an earlier test's threads
    still winding down (an engine loop, a server's) would otherwise move the counts below."""
    deadline = time.monotonic() + timeout_s
    last = _num_threads()
    while time.monotonic() < deadline:
        time.sleep(0.2)
        now = _num_threads()
        if now == last:
            return
        last = now


def _measure() -> dict[str, int | bool]:
    out: dict[str, int | bool] = {}

    def run():  # a fresh thread: its pool is its own, whatever the test process did before
        out["before"] = _num_threads()
        _parallel_work()
        out["with_pool"] = _num_threads()
        out["released"] = release_thread_pool()
        out["after"] = _num_threads()
        _parallel_work()
        out["again"] = _num_threads()
        release_thread_pool()

    _settled()
    t = threading.Thread(target=run)
    t.start()
    t.join()
    return out


def test_release_frees_the_calling_threads_openmp_workers_and_the_next_region_starts_them_again(runtimes):
    torch.set_num_threads(max(2, torch.get_num_threads()))  # workers to free even on one core (conftest restores)
    for _ in range(3):  # another thread of the process exiting mid-measurement shows as a missing worker: measure again
        out = _measure()
        if out["with_pool"] > out["before"] and out["after"] == out["before"] and out["again"] == out["with_pool"]:
            break
    assert out["with_pool"] > out["before"], out
    assert out["released"] is True
    assert out["after"] == out["before"], out  # the workers have exited
    assert out["again"] == out["with_pool"], out  # and come back on demand


def test_the_engine_loop_releases_its_creators_pool_before_it_starts(monkeypatch):
    calls = []
    monkeypatch.setattr(engine_loop, "release_thread_pool", lambda: calls.append(threading.get_ident()))

    class _Idle:
        has_work = False

    loop = engine_loop.EngineLoop(_Idle())  # type: ignore[arg-type]
    loop.shutdown()
    assert calls == [threading.get_ident()]
