"""nextn's layers point one way: import-linter's contracts in pyproject.toml (`[tool.importlinter]`) hold, and bite.

The contracts: a layers contract (testing → cli → serving | bench | train → the LLM API → builder | launcher →
engine → model split → speculative → engine format → models → quantization → plugins → config) and no import cycle
between the modules of any package. Lazy imports inside functions count. `lint-imports` runs in a subprocess with
its cache off (nothing is written into the checkout).
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path

import grimp

ROOT = Path(__file__).resolve().parents[2]
LINT_IMPORTS = Path(sys.executable).with_name("lint-imports")


def _lint(config: Path, src: Path, cwd: Path) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(src)}
    return subprocess.run([str(LINT_IMPORTS), "--config", str(config), "--no-cache"], cwd=cwd, env=env,
                          capture_output=True, text=True, timeout=120)


def _layer_modules() -> list[str]:
    """Every module named in the layers contract (independent `|` and non-independent `:` siblings split)."""
    contract = next(c for c in tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["importlinter"]
                    ["contracts"] if c["type"] == "layers")
    names = []
    for layer in contract["layers"]:
        for part in layer.replace("|", ":").split(":"):
            names.append(part.strip().strip("()"))
    return names


def test_contracts_pass():
    result = _lint(ROOT / "pyproject.toml", ROOT / "src", ROOT)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "Contracts: 2 kept, 0 broken." in result.stdout


def test_every_module_has_a_layer():
    """A package split across layers (runtime, build, distributed) lists its modules one by one: a new module there
    must be placed too, or the contract would not see it."""
    layers = _layer_modules()
    graph = grimp.build_graph("nextn", cache_dir=None)
    unplaced = sorted(m for m in graph.modules
                      if not any(m == name or m.startswith(name + ".") for name in layers)
                      and not any(name.startswith(m + ".") for name in layers))  # a split package's __init__
    assert not unplaced, f"modules in no layer of pyproject.toml's [tool.importlinter]: {unplaced}"


def test_an_upward_import_breaks_the_contract(tmp_path):
    """A copy of the package where a model module imports the runtime's LLM fails, naming the import."""
    src = tmp_path / "src"
    shutil.copytree(ROOT / "src" / "nextn", src / "nextn", ignore=shutil.ignore_patterns("__pycache__"))
    medusa = src / "nextn" / "models" / "medusa.py"
    medusa.write_text(medusa.read_text() + "\n\ndef _upward():\n    from nextn.runtime.llm import LLM\n\n    return LLM\n")
    shutil.copy(ROOT / "pyproject.toml", tmp_path / "pyproject.toml")
    result = _lint(tmp_path / "pyproject.toml", src, tmp_path)
    assert result.returncode == 1, result.stdout + result.stderr
    assert "nextn.models is not allowed to import nextn.runtime.llm" in result.stdout
    assert "nextn.models.medusa -> nextn.runtime.llm" in result.stdout
    assert "Contracts: 1 kept, 1 broken." in result.stdout
