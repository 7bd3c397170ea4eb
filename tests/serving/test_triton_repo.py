"""`nextn triton-repo` never overwrites a model it did not write and never follows a link out of the repository
(issue 32, class 7); `--output_dir FILE` is a named error."""

from __future__ import annotations

from pathlib import Path

import pytest

from nextn.build.output_files import OutputPathError
from nextn.cli.main import main
from nextn.serving.triton_repo import write_model_repository


@pytest.fixture(scope="module")
def engine(checkpoints) -> Path:
    return checkpoints.engine()


def test_a_model_it_wrote_is_rewritten(engine, tmp_path):
    model = write_model_repository(engine, tmp_path / "repo", python_env=None)
    (model / "1" / "__pycache__").mkdir()
    (model / "1" / "__pycache__" / "model.cpython-311.pyc").write_bytes(b"x")
    again = write_model_repository(engine, tmp_path / "repo", decoupled=True, python_env=None)
    assert "decoupled: true" in (again / "config.pbtxt").read_text()


def test_a_users_model_is_refused_and_left_as_it_was(engine, tmp_path, capsys):
    model = tmp_path / "repo" / "nextn"
    (model / "1").mkdir(parents=True)
    (model / "2").mkdir()
    files = {"config.pbtxt": 'name: "mine"\nbackend: "onnxruntime"\n', "1/model.py": "mine", "1/weights.bin": "w",
             "2/model.py": "mine too"}
    for name, text in files.items():
        (model / name).write_text(text)
    assert main(["triton-repo", "--engine_dir", str(engine), "--output_dir", str(tmp_path / "repo")]) == 2
    assert "did not write" in capsys.readouterr().err
    assert {n: (model / n).read_text() for n in files} == files


def test_an_old_style_model_of_ours_with_a_users_file_beside_it_is_refused(engine, tmp_path):
    model = write_model_repository(engine, tmp_path / "repo", python_env=None)
    (model / ".nextn-output.json").unlink()  # as written before the marker existed: config.pbtxt is recognised
    write_model_repository(engine, tmp_path / "repo", python_env=None)
    (model / "1" / "weights.bin").write_text("user")
    with pytest.raises(OutputPathError, match="1/weights.bin"):
        write_model_repository(engine, tmp_path / "repo", python_env=None)


def test_a_symlinked_model_py_is_not_followed(engine, tmp_path):
    model = write_model_repository(engine, tmp_path / "repo", python_env=None)
    outside = tmp_path / "outside.py"
    outside.write_text("user code")
    (model / "1" / "model.py").unlink()
    (model / "1" / "model.py").symlink_to(outside)
    with pytest.raises(OutputPathError, match="symbolic links"):
        write_model_repository(engine, tmp_path / "repo", python_env=None)
    assert outside.read_text() == "user code"


def test_output_dir_a_file_is_a_named_error(engine, tmp_path, capsys):
    f = tmp_path / "file"
    f.write_text("x")
    assert main(["triton-repo", "--engine_dir", str(engine), "--output_dir", str(f)]) == 2
    assert "is not a directory" in capsys.readouterr().err and f.read_text() == "x"
