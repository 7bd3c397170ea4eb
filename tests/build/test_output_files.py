"""Output paths of the commands other than build-engine (build/output_files.py): a user's file or directory is never
overwritten (issue 32, classes 6 and 7)."""

from __future__ import annotations

import json
import os

import pytest

from nextn.build.output_files import (MARKER_NAME, OutputPathError, check_output_file, claim_output_dir, is_png,
                                      is_report_of, is_token_map, write_output_file, written_by)


def test_a_file_output_is_written_atomically_and_its_own_format_replaced(tmp_path):
    out = tmp_path / "sub" / "r.json"
    ours = is_report_of("bench")
    write_output_file(out, json.dumps({**written_by("bench"), "x": 1}), "--json", ours)
    write_output_file(out, json.dumps({**written_by("bench"), "x": 2}), "--json", ours)
    assert json.loads(out.read_text())["x"] == 2 and sorted(os.listdir(out.parent)) == ["r.json"]


@pytest.mark.parametrize("content", ['{"vocab_size": 5}', "[1, 2]", json.dumps(written_by("other"))])
def test_a_file_in_another_format_is_refused_unless_forced(tmp_path, content):
    out = tmp_path / "config.json"
    out.write_text(content)
    with pytest.raises(OutputPathError, match="not written by this command.*--force"):
        write_output_file(out, "{}", "--json", is_report_of("bench"), force_flag="--force")
    assert out.read_text() == content
    write_output_file(out, "{}", "--json", is_report_of("bench"), force=True)
    assert out.read_text() == "{}"


def test_a_directory_a_link_and_a_device_are_refused(tmp_path):
    with pytest.raises(OutputPathError, match="is a directory"):
        check_output_file(tmp_path, "--out")
    target = tmp_path / "t.json"
    target.write_text("[1]")
    (tmp_path / "l.json").symlink_to(target)
    with pytest.raises(OutputPathError, match="symbolic link"):
        check_output_file(tmp_path / "l.json", "--out", is_token_map, force=True)
    with pytest.raises(OutputPathError, match="not a regular file"):
        check_output_file("/dev/null", "--out", force=True)
    (tmp_path / "f").write_text("x")
    with pytest.raises(OutputPathError, match="not a directory"):
        check_output_file(tmp_path / "f" / "out.json", "--out")


def test_format_sniffers():
    assert is_token_map(b"[1, 2, 3]") and is_token_map(b"[]") and not is_token_map(b'{"a": 1}')
    assert is_png(b"\x89PNG\r\n\x1a\nxx") and not is_png(b"GIF89a")


def test_an_output_dir_is_claimed_when_new_or_empty_and_reused_when_marked(tmp_path):
    out = tmp_path / "heads"
    claim_output_dir(out, "train-draft")
    assert (out / MARKER_NAME).is_file()
    (out / "config.json").write_text("{}")
    claim_output_dir(out, "train-draft")  # ours: reused
    with pytest.raises(OutputPathError, match="not written by nextn make-checkpoint"):
        claim_output_dir(out, "make-checkpoint")


def test_a_users_directory_and_the_inputs_are_refused(tmp_path):
    user = tmp_path / "mine"
    user.mkdir()
    for name in ("config.json", "model.safetensors", "train_draft.json"):
        (user / name).write_text("user data")
    with pytest.raises(OutputPathError, match="not empty and was not written.*config.json, model.safetensors"):
        claim_output_dir(user, "train-draft")
    assert not (user / MARKER_NAME).exists()
    model = tmp_path / "base"
    model.mkdir()
    with pytest.raises(OutputPathError, match="is or holds the input"):
        claim_output_dir(model, "train-draft", inputs=[model])
    with pytest.raises(OutputPathError, match="is or holds the input"):
        claim_output_dir(tmp_path, "train-draft", inputs=[model])
    assert claim_output_dir(user, "train-draft", is_legacy=lambda p: True) == user
