"""`verify_engine_files` refuses a listed file that is not regular in every mode, "off" included (issue 32: a FIFO
as the weights file with `verify_weights: off` hung the load)."""

from __future__ import annotations

import os
import threading
from pathlib import Path

import pytest

from nextn.build.engine_builder import build_engine
from nextn.build.manifest import EngineError, EngineManifest, verify_engine_files


@pytest.mark.parametrize("mode", ["off", "size"])
def test_a_fifo_as_the_weights_file_is_refused_without_hanging(make_ckpt, tmp_path: Path, mode: str) -> None:
    out = tmp_path / "engine"
    build_engine(make_ckpt().path, out, progress=False)
    (out / "model.safetensors").unlink()
    os.mkfifo(out / "model.safetensors")
    manifest = EngineManifest.load(out)
    with pytest.raises(EngineError, match="model.safetensors listed in manifest.json is not a regular file"):
        verify_engine_files(out, manifest, mode)


def test_the_llm_refuses_it_with_verify_weights_off(make_ckpt, tmp_path: Path) -> None:
    from nextn.runtime.llm import LLM

    out = tmp_path / "engine"
    build_engine(make_ckpt().path, out, progress=False)
    (out / "model.safetensors").unlink()
    os.mkfifo(out / "model.safetensors")
    errors: list[BaseException] = []

    def load() -> None:
        try:
            LLM(str(out), verify_weights="off")
        except BaseException as e:  # noqa: BLE001 - the test reads it
            errors.append(e)

    t = threading.Thread(target=load, daemon=True)
    t.start()
    t.join(60)
    assert not t.is_alive(), "the load hung on a FIFO"
    assert errors and isinstance(errors[0], EngineError) and "not a regular file" in str(errors[0])
