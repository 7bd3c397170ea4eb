"""`nextn train-draft` refuses, before any work, an output directory it did not write, the base model as output,
and head counts out of range (issue 32, class 6 and the named errors)."""

from __future__ import annotations

from pathlib import Path

import pytest

from nextn.cli.train_draft import main


@pytest.fixture
def base(tmp_path: Path) -> Path:
    model = tmp_path / "base"
    model.mkdir()
    (model / "config.json").write_text('{"model_type": "llama"}')
    (model / "model.safetensors").write_bytes(b"base weights")
    return model


@pytest.fixture
def data(tmp_path: Path) -> Path:
    f = tmp_path / "corpus.txt"
    f.write_text("one two three\n\nfour five six\n")
    return f


def _argv(base, data, out, *extra):
    return ["--model_dir", str(base), "--method", "medusa", "--data", str(data), "--output_dir", str(out),
            "--steps", "1", *extra]


def test_a_folder_of_the_users_files_is_refused_and_left_as_it_was(base, data, tmp_path, capsys):
    out = tmp_path / "mine"
    out.mkdir()
    files = {"config.json": "{}", "model.safetensors": "user weights", "train_draft.json": '{"notes": 1}'}
    for name, text in files.items():
        (out / name).write_text(text)
    assert main(_argv(base, data, out)) == 2
    assert "not written by nextn train-draft" in capsys.readouterr().err
    assert {p.name: p.read_text() for p in out.iterdir()} == files


def test_the_base_model_as_output_is_refused(base, data, capsys):
    assert main(_argv(base, data, base)) == 2
    assert "is or holds the input" in capsys.readouterr().err
    assert (base / "model.safetensors").read_bytes() == b"base weights"


def test_a_cache_dir_of_the_users_is_refused(base, data, tmp_path, capsys):
    cache = tmp_path / "cache"
    cache.mkdir()
    (cache / "state.pt").write_text("user")
    assert main(_argv(base, data, tmp_path / "out", "--cache_dir", str(cache))) == 2
    assert "--cache_dir" in capsys.readouterr().err and (cache / "state.pt").read_text() == "user"


def test_a_refused_cache_dir_leaves_the_output_dir_unclaimed(base, data, tmp_path, capsys):
    """Both directories are checked before either is created or marked: a refused --cache_dir leaves no claimed
    --output_dir behind."""
    cache = tmp_path / "cache"
    cache.mkdir()
    (cache / "state.pt").write_text("user")
    assert main(_argv(base, data, tmp_path / "out", "--cache_dir", str(cache))) == 2
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("flag,value", [("--num_heads", "1000"), ("--num_heads", "0"), ("--num_layers", "-1"),
                                        ("--tree_nodes", "100000"), ("--num_draft_steps", "0")])
def test_counts_out_of_range_are_named(base, data, tmp_path, capsys, flag, value):
    # issue 32: --num_heads 1000 was a traceback, --num_heads 0 trained 4 heads
    assert main(_argv(base, data, tmp_path / "out", flag, value)) == 2
    assert f"{flag} must be in" in capsys.readouterr().err and not (tmp_path / "out").exists()


def test_a_data_file_that_is_a_device_is_refused(base, tmp_path, capsys):
    assert main(_argv(base, "/dev/zero", tmp_path / "out")) == 2
    assert "not a regular file" in capsys.readouterr().err
