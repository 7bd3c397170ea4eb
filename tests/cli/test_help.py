"""The command lines' help: no torch imported to print it (every `--help` was 8-10 s), and texts that say what the
commands do."""

from __future__ import annotations

import subprocess
import sys

import pytest

HEAVY = ("torch", "transformers", "nextn.runtime", "nextn.build.engine_builder")


def _imported_after(code: str) -> list[str]:
    """The heavy modules imported by running `code` in a fresh interpreter."""
    probe = f"import sys\n{code}\nprint('heavy:' + ','.join(m for m in {HEAVY!r} if m in sys.modules))"
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    return [m for m in out.stdout.strip().splitlines()[-1].removeprefix("heavy:").split(",") if m]


def test_importing_the_command_lines_imports_no_torch():
    assert _imported_after("import nextn, nextn.cli.main, nextn.cli.build_engine, nextn.cli.cache") == []


@pytest.mark.parametrize("argv", [["--help"], ["generate", "--help"], ["serve", "--help"], ["cache", "--help"],
                                  ["cache", "clear", "--help"], ["make-checkpoint", "--help"], ["demo", "--help"],
                                  ["token-map", "--help"], ["triton-repo", "--help"], ["train-draft", "--help"],
                                  ["bench", "--help"]])
def test_nextn_help_imports_no_torch(argv):
    code = (f"from nextn.cli.main import main\ntry:\n    main({argv!r})\nexcept SystemExit as e:\n"
            "    assert e.code == 0, e.code")
    assert _imported_after(code) == []


def test_build_engine_help_imports_no_torch():
    code = "from nextn.cli.build_engine import main\ntry:\n    main(['--help'])\nexcept SystemExit as e:\n    assert not e.code"
    assert _imported_after(code) == []


def test_nextn_still_exposes_its_api():
    import nextn
    from nextn.quantization.weight_only import QUANT_ALGOS
    from nextn.runtime.llm import LLM

    from nextn.cli.checkpoint_options import QUANT_ALGOS as CLI_QUANT_ALGOS

    assert nextn.LLM is LLM and set(nextn.__all__) <= set(dir(nextn))
    assert tuple(CLI_QUANT_ALGOS) == tuple(QUANT_ALGOS)  # the CLI's copy (no torch import) agrees
    with pytest.raises(AttributeError):
        nextn.NoSuchThing  # noqa: B018


def test_help_texts_say_what_the_commands_do(capsys):
    from nextn.cli.main import build_parser

    top = build_parser("").format_help()
    assert "(DeepSeek MTP)" not in top and "(Medusa)" not in top and "cache" in top
    assert "MTP" in top.split("\n    train-draft", 1)[1].split("\n    token-map", 1)[0]  # train-draft trains MTP too
    generate = build_parser("generate")._subparsers._group_actions[0].choices["generate"].format_help()
    assert "greedily" not in generate and "sampled" in generate
    make = build_parser("make-checkpoint")._subparsers._group_actions[0].choices["make-checkpoint"].format_help()
    assert "without a download" in " ".join(make.split())
    from nextn.cli.build_engine import _parser

    model_dir = _parser().format_help().split("\n  --model_dir DIR", 1)[1].split("\n  --medusa_model_dir", 1)[0]
    assert ".gguf" in model_dir
