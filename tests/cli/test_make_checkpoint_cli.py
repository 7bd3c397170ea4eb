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


def test_a_new_directory_gets_a_checkpoint_and_a_second_run_may_rewrite_it(tmp_path, capsys):
    out = tmp_path / "ckpt"
    for _ in range(2):  # the second run finds its own marker and files, and rewrites them
        assert main(["make-checkpoint", "--distill_steps", "0", "--output_dir", str(out)]) == 0
        assert f"wrote {out}" in capsys.readouterr().out
        assert (out / "config.json").is_file() and any(out.glob("*.safetensors"))
