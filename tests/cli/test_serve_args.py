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


@pytest.mark.parametrize("extra, dtype, quant", [([], "auto", "auto"), (["--dtype", "float32"], "float32", "auto"),
                                                 (["--quant_algo", "none"], "auto", None),
                                                 (["--quant_algo", "W4A8"], "auto", "W4A8")])
def test_serve_model_takes_a_checkpoint(tmp_path, monkeypatch, extra, dtype, quant):
    """`serve --model CHECKPOINT` reaches LLM with generate's --dtype / --quant_algo and the engine cache."""
    import nextn

    seen = {}

    class Stop(Exception):
        pass

    def fake_llm(source, **kwargs):
        seen.update(source=source, **kwargs)
        raise Stop

    monkeypatch.setattr(nextn, "LLM", fake_llm)
    monkeypatch.setenv("NEXTN_CACHE_DIR", str(tmp_path / "cache"))
    gguf = tmp_path / "model-Q4_K_M.gguf"
    with pytest.raises(Stop):
        main(["serve", "--model", str(gguf), *extra])
    assert seen["source"] == str(gguf) and seen["dtype"] == dtype
    assert seen["quant_config"] == {"quant_algo": quant} and seen["engine_cache_dir"] == str(tmp_path / "cache")


def test_serve_takes_an_engine_or_a_model_not_both(tmp_path, capsys):
    for argv in ([], ["--engine_dir", str(tmp_path), "--model", str(tmp_path)]):
        with pytest.raises(SystemExit) as e:
            main(["serve", *argv])
        assert e.value.code == 2
    assert "not allowed with argument" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["serve", "--model", "x.gguf", "--quant_algo", "W3"])
    assert "invalid choice: 'W3'" in capsys.readouterr().err


def test_the_served_name_of_a_checkpoint_is_its_name():
    import argparse

    from nextn.cli.serve import served_model_name

    def ns(**kw):
        return argparse.Namespace(**{"served_model_name": None, "model": None, **kw})

    assert served_model_name(ns(model="/m/qwen2.5-0.5b-q4_k_m.gguf")) == "qwen2.5-0.5b-q4_k_m"
    assert served_model_name(ns(model="/m/SmolLM2/")) == "SmolLM2"
    assert served_model_name(ns(model="/m/x.gguf", served_model_name="mine")) == "mine"
    assert served_model_name(ns(engine_dir="/e")) is None


def test_a_taken_port_is_refused_before_anything_loads(tmp_path):
    """The port is checked first: with an engine directory that does not exist, the error is still the port's."""
    import socket

    with socket.socket() as taken:
        taken.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        run = [sys.executable, "-m", "nextn.cli.main", "serve", "--engine_dir", str(tmp_path / "none"), "--port",
               str(port)]
        out = subprocess.run(run, capture_output=True, text=True, timeout=120)
    assert out.returncode == 2 and "Traceback" not in out.stderr
    assert out.stderr.strip().splitlines() == [f"nextn serve: error: cannot listen on 127.0.0.1:{port}: Address "
                                               "already in use (another server there?): stop it or give another "
                                               "--port"]
