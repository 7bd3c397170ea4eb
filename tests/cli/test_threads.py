"""`-t / --num_threads` and its default: the cores idle at start (issue 33: on 2 cores under load, two spinning torch
threads made every figure 4-8x slower and passes 10x apart)."""

from __future__ import annotations

import pytest
import torch

import nextn.cli.threads as threads


@pytest.fixture()
def restore_threads():
    old = torch.get_num_threads()
    yield
    torch.set_num_threads(old)


def test_a_busy_machine_gets_the_idle_cores_and_says_so(monkeypatch, capsys, restore_threads):
    monkeypatch.setattr(threads, "available_cores", lambda: 2)
    monkeypatch.setattr(threads.os, "cpu_count", lambda: 2)
    monkeypatch.setattr(threads, "idle_cores", lambda sample_s=0.2: 0.9)  # another process holds a core
    assert threads.apply_threads(None, "nextn")[0] == 1 and torch.get_num_threads() == 1
    assert "the machine is busy (0.9 of 2 cores idle): 1 thread instead of 2" in capsys.readouterr().err
    monkeypatch.setattr(threads, "idle_cores", lambda sample_s=0.2: 1.9)  # quiet: every core
    assert threads.apply_threads(None, "nextn") == (2, None) and capsys.readouterr().err == ""
    monkeypatch.setattr(threads, "idle_cores", lambda sample_s=0.2: 0.0)  # fully busy: still one
    assert threads.apply_threads(None, "nextn")[0] == 1
    monkeypatch.setattr(threads, "idle_cores", lambda sample_s=0.2: None)  # no /proc/stat: all cores
    assert threads.apply_threads(None, "nextn") == (2, None)


def test_an_explicit_count_is_kept_and_bounded_by_the_cores(monkeypatch, restore_threads):
    monkeypatch.setattr(threads, "available_cores", lambda: 2)
    monkeypatch.setattr(threads, "idle_cores", lambda sample_s=0.2: 0.0)
    assert threads.apply_threads(2, "nextn") == (2, None) and torch.get_num_threads() == 2  # asked for: kept when busy
    for bad in (0, -1, 3, 10**6):
        with pytest.raises(ValueError, match=r"--num_threads must be in 1\.\.2"):
            threads.apply_threads(bad, "nextn")


def test_idle_cores_reads_the_machine():
    idle = threads.idle_cores(0.05)
    assert idle is None or 0.0 <= idle <= (threads.os.cpu_count() or 1) + 1e-6
