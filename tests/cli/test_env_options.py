"""The command lines still honour `NEXTN_VERIFY_WEIGHTS` (now `LlmArgs.verify_weights`), read in the CLI layer only."""

from __future__ import annotations

import shutil

import pytest

from nextn.cli.env_options import env_llm_overrides
from nextn.cli.main import main
from nextn.config.llm_args import LlmArgsError
from nextn.testing import SMALL_VOCAB as SMALL


@pytest.mark.parametrize("value,expected", [(None, {}), ("  ", {}), ("full", {"verify_weights": "full"}),
                                            (" Size ", {"verify_weights": "size"}), ("OFF", {"verify_weights": "off"})])
def test_env_llm_overrides(monkeypatch, value, expected):
    if value is None:
        monkeypatch.delenv("NEXTN_VERIFY_WEIGHTS", raising=False)
    else:
        monkeypatch.setenv("NEXTN_VERIFY_WEIGHTS", value)
    assert env_llm_overrides() == expected


def test_env_llm_overrides_refuses_another_mode(monkeypatch):
    monkeypatch.setenv("NEXTN_VERIFY_WEIGHTS", "sometimes")
    with pytest.raises(LlmArgsError, match="NEXTN_VERIFY_WEIGHTS='sometimes'; choose one of full, size, off"):
        env_llm_overrides()


def test_generate_takes_the_verify_mode_from_the_environment(checkpoints, tmp_path, monkeypatch, capsys):
    engine = tmp_path / "engine"
    shutil.copytree(checkpoints.engine(num_mtp_modules=1, **SMALL), engine)  # a copy: its weights get a flipped bit
    weights = engine / "model.safetensors"
    data = bytearray(weights.read_bytes())
    data[-1000] ^= 0x01
    weights.write_bytes(bytes(data))
    argv = ["generate", "--engine_dir", str(engine), "--token_ids", "--prompt", "5,6,7", "--max_tokens", "2"]
    monkeypatch.delenv("NEXTN_VERIFY_WEIGHTS", raising=False)
    assert main(argv) == 2
    assert "is corrupt" in capsys.readouterr().err
    monkeypatch.setenv("NEXTN_VERIFY_WEIGHTS", "size")  # sizes and headers only: the flipped bit goes unseen
    assert main(argv) == 0
    monkeypatch.setenv("NEXTN_VERIFY_WEIGHTS", "sometimes")
    assert main(argv) == 2
    assert "NEXTN_VERIFY_WEIGHTS='sometimes'" in capsys.readouterr().err
