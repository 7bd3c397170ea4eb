"""The install resolves on the public package index, with a CUDA torch and with a CPU torch.

torch 2.13.0's CUDA wheels require an exact triton (3.7.1); a `[test]` pin that excludes it made
`pip install -e '.[test]'` fail with ResolutionImpossible on every machine that sees only the public index. This test
asks pip (dry run, no download of wheels where the index serves metadata) to resolve torch with the `[test]` triton
requirement twice: against the public index alone (a CUDA torch), and as configured here (a CPU torch where a local
wheel is found first). It skips where the public index cannot be reached.
"""

from __future__ import annotations

import os
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
NO_NETWORK = ("Could not fetch URL", "Max retries exceeded", "Temporary failure in name resolution",
              "Network is unreachable", "No matching distribution found for torch")


def _requirements() -> tuple[str, str]:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    torch_req = next(r for r in project["dependencies"] if r.replace(" ", "").startswith("torch=="))
    triton_req = next(r for r in project["optional-dependencies"]["test"] if r.startswith("triton"))
    return torch_req, triton_req


def _dry_run(env: dict[str, str], *reqs: str) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "pip", "install", "--dry-run", "--ignore-installed", "--quiet", *reqs]
    return subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)


@pytest.mark.slow
@pytest.mark.parametrize("index", ["public", "configured"])
def test_torch_and_test_extra_triton_resolve(index: str) -> None:
    torch_req, triton_req = _requirements()
    env = dict(os.environ)
    if index == "public":  # only the public index: no local wheels, no pip configuration of this machine
        env.update(PIP_CONFIG_FILE=os.devnull, PIP_FIND_LINKS="", PIP_EXTRA_INDEX_URL="", PIP_CONSTRAINT="")
    proc = _dry_run(env, torch_req, triton_req)
    out = proc.stdout + proc.stderr
    if proc.returncode and any(s in out for s in NO_NETWORK):
        pytest.skip(f"the {index} package index cannot be reached: {out.strip().splitlines()[-1]}")
    assert "ResolutionImpossible" not in out, f"{torch_req} with the [test] extra's {triton_req}:\n{out[-2000:]}"
    assert proc.returncode == 0, out[-2000:]
