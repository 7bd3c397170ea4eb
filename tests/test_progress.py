"""`progress_bar`: few redraws in a log, tqdm's live bar on a terminal."""

from __future__ import annotations

import io
import sys
import time

from nextn.progress import LOG_INTERVAL_S, progress_bar


class _Tty(io.StringIO):
    def isatty(self) -> bool:
        return True


def _redraws(stream: io.StringIO, monkeypatch, steps: int = 40) -> int:
    """Lines/redraws written by a 0.8 s loop (plain tqdm redraws it ~8 times, every 0.1 s)."""
    monkeypatch.setattr(sys, "stderr", stream)
    for _ in progress_bar(range(steps), desc="work", file=stream):
        time.sleep(0.02)
    return stream.getvalue().count("\r") + stream.getvalue().count("\n")


def test_log_gets_a_few_lines_not_one_per_update(monkeypatch):
    log = io.StringIO()
    assert _redraws(log, monkeypatch) <= 4  # first draw, final state, newline: nothing in between within 30 s
    assert "40/40" in log.getvalue() and LOG_INTERVAL_S >= 10


def test_disabled_writes_nothing(monkeypatch):
    log = io.StringIO()
    monkeypatch.setattr(sys, "stderr", log)
    for _ in progress_bar(range(10), enabled=False, file=log):
        pass
    assert log.getvalue() == ""


def test_terminal_keeps_tqdm_defaults(monkeypatch):
    tty = _Tty()
    monkeypatch.setattr(sys, "stderr", tty)
    bar = progress_bar(total=5, file=tty)
    assert bar.mininterval < 1
    bar.close()
    assert _redraws(_Tty(), monkeypatch) > 4  # live redraws on a terminal
