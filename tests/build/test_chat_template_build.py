"""build-engine renders an HF checkpoint's chat template once, with sample conversations, under the runtime's render
budget before any work (`runtime.tokenizer.check_saved_chat_template`): a template past it is a named error and
nothing is written. (A GGUF's template: tests/build/test_gguf_tokenizer.py.)"""

from __future__ import annotations

import shutil

import pytest

from nextn.build.engine_builder import build_engine
from nextn.cli.build_engine import main
from nextn.runtime.tokenizer import ChatTemplateLimitError


def test_an_hf_template_past_the_budget_is_refused_before_building(checkpoints, tmp_path, capsys):
    ckpt = tmp_path / "ckpt"
    shutil.copytree(checkpoints.checkpoint(), ckpt)
    (ckpt / "chat_template.jinja").write_text("{{ 'x' * (2*10**9) }}")
    out = tmp_path / "engine"
    with pytest.raises(ChatTemplateLimitError, match=r"chat_template.jinja: the chat template cannot be used.*cap"):
        build_engine(ckpt, out, progress=False)
    assert not out.exists() and sorted(p.name for p in tmp_path.iterdir()) == ["ckpt"]
    with pytest.raises(SystemExit) as e:
        main(["--model_dir", str(ckpt), "--output_dir", str(out)])
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert "chat_template.jinja: the chat template cannot be used" in err and "Traceback" not in err
    assert not out.exists()
