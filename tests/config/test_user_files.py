"""Bounded reads of user-named files (config/user_files.py): devices, FIFOs, directories and oversized files are
refused without being read (issue 32, class 4)."""

from __future__ import annotations

import os
import threading

import pytest

from nextn.config.user_files import read_user_bytes, read_user_json, read_user_text


class Named(ValueError):
    pass


def test_a_regular_file_is_read_whole(tmp_path):
    f = tmp_path / "a.json"
    f.write_text('{"a": [1, 2]}')
    assert read_user_bytes(f, "x") == b'{"a": [1, 2]}'
    assert read_user_json(f, "x") == {"a": [1, 2]}


@pytest.mark.parametrize("path", ["/dev/zero", "/dev/urandom"])
def test_a_device_is_refused_with_the_callers_error(path):
    with pytest.raises(Named, match="the thing /dev/.* is not a regular file"):
        read_user_bytes(path, "the thing", Named)


def test_a_fifo_without_a_writer_is_refused_without_hanging(tmp_path):
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    result = []
    t = threading.Thread(target=lambda: result.append(_raises(fifo)), daemon=True)
    t.start()
    t.join(5)
    assert result == ["not a regular file"], "the read hung on a FIFO"


def _raises(path) -> str:
    try:
        read_user_bytes(path, "x")
    except ValueError as e:
        return "not a regular file" if "not a regular file" in str(e) else str(e)
    return "read"


def test_a_directory_and_a_missing_file_are_named(tmp_path):
    with pytest.raises(ValueError, match="not a regular file"):
        read_user_bytes(tmp_path, "x")
    with pytest.raises(ValueError, match="does not exist"):
        read_user_bytes(tmp_path / "nope", "x")


def test_a_file_over_the_cap_is_refused_by_its_size(tmp_path):
    f = tmp_path / "big"
    f.write_bytes(b"x" * 101)
    with pytest.raises(ValueError, match="larger than 100 bytes"):
        read_user_bytes(f, "x", max_bytes=100)
    assert read_user_bytes(f, "x", max_bytes=101) == b"x" * 101


def test_bad_text_and_json_are_named(tmp_path):
    f = tmp_path / "f"
    f.write_bytes(b"\xff[]")
    with pytest.raises(ValueError, match="not UTF-8.*0xff"):
        read_user_text(f, "x")
    for text in ("[NaN]", "[" + "1" * 5000 + "]", "[1,", "[" * 100_000):
        f.write_text(text)
        with pytest.raises(ValueError, match="not valid JSON"):
            read_user_json(f, "x")
