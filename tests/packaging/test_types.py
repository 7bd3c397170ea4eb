"""speculative/ and runtime/ type-check against their contracts (mypy, configured in pyproject.toml's [tool.mypy]):
every drafter and acceptance rule a method returns satisfies the protocol (speculative/protocol.py), and the
scheduler and runner use the setup they are given as typed."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).parents[2]


def _mypy(tmp_path: Path, *targets: str) -> tuple[int, str]:
    """mypy in a subprocess (in-process it would raise this interpreter's recursion limit for the tests after it)."""
    pytest.importorskip("mypy", reason="mypy is a test dependency (pip install -e '.[test]')")
    done = subprocess.run([sys.executable, "-m", "mypy", "--config-file", str(ROOT / "pyproject.toml"),
                           "--cache-dir", str(tmp_path / "cache"), "--no-error-summary", *targets],
                          cwd=ROOT, capture_output=True, text=True, timeout=600)
    return done.returncode, done.stdout + done.stderr


def test_speculative_and_runtime_type_check(tmp_path):
    rc, out = _mypy(tmp_path, "src/nextn/speculative", "src/nextn/runtime")
    assert rc == 0, out


def test_a_drafter_without_a_hook_is_refused(tmp_path):
    """The control: the configuration does check the protocol (a drafter missing `after_verify` is an error)."""
    bad = tmp_path / "bad_drafter.py"
    bad.write_text(
        "from nextn.speculative.chain_step import NoDrafter\n"
        "from nextn.speculative.protocol import Drafter\n"
        "class Broken(NoDrafter):\n"
        "    after_verify = None\n"
        "drafter: Drafter = Broken()\n")
    rc, out = _mypy(tmp_path, str(bad))
    assert rc == 1 and "bad_drafter.py:5" in out and "Drafter" in out, out
