"""`nextn serve`'s arguments: bad values are one-line argparse errors (exit 2), not tracebacks at startup."""

from __future__ import annotations

import subprocess
import sys

import pytest

from nextn.cli.main import main


@pytest.mark.parametrize("argv, fragment", [
    (["--api_key", ""], "argument --api_key: the API key is empty"),
    (["--api_key", "   "], "argument --api_key: the API key is empty"),
    (["--api_key", "two words"], "printable ASCII without spaces"),
    (["--port", "99999"], "argument --port: must be a TCP port number (1-65535), got 99999"),
    (["--port", "0"], "must be a TCP port number"),
    (["--port", "http"], "must be a TCP port number (1-65535), got 'http'"),
    (["--chat_template_timeout", "0"], "argument --chat_template_timeout: must be seconds in (0, 3600]"),
    (["--chat_template_timeout", "nan"], "must be seconds"),
    (["--max_request_bytes", "lots"], "must be a positive byte count, got 'lots'"),
])
def test_bad_serve_arguments_are_named_errors(tmp_path, capsys, argv, fragment):
    with pytest.raises(SystemExit) as e:
        main(["serve", "--engine_dir", str(tmp_path), *argv])
    err = capsys.readouterr().err
    assert e.value.code == 2 and fragment in err and "Traceback" not in err


def test_a_blank_api_key_in_the_environment_is_refused(tmp_path):
    """A whitespace-only NEXTN_API_KEY is refused like the flag (an empty one still means no key)."""
    run = [sys.executable, "-m", "nextn.cli.main", "serve", "--engine_dir", str(tmp_path / "none"), "--port", "1"]
    out = subprocess.run(run, env={"NEXTN_API_KEY": " ", "PATH": ""}, capture_output=True, text=True, timeout=120)
    assert out.returncode == 2 and "the API key is empty" in out.stderr and "Traceback" not in out.stderr
