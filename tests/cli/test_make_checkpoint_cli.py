"""`nextn make-checkpoint` writes only into a new or empty directory, or one it wrote (issue 32, class 6)."""

from __future__ import annotations

from nextn.cli.main import main


def test_a_users_directory_is_refused_and_left_as_it_was(tmp_path, capsys):
    out = tmp_path / "mine"
    out.mkdir()
    (out / "config.json").write_text("user")
    (out / "model.safetensors").write_text("user weights")
    assert main(["make-checkpoint", "--output_dir", str(out)]) == 2
    assert "not written by nextn make-checkpoint" in capsys.readouterr().err
    assert (out / "config.json").read_text() == "user" and sorted(p.name for p in out.iterdir()) == [
        "config.json", "model.safetensors"]


def test_a_file_as_output_dir_is_refused(tmp_path, capsys):
    f = tmp_path / "f"
    f.write_text("x")
    assert main(["make-checkpoint", "--output_dir", str(f)]) == 2
    assert "not a directory" in capsys.readouterr().err and f.read_text() == "x"
