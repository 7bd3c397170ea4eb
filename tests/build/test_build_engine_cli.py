"""The `build-engine` CLI: success summary, the --config alias, --help, and exit status 2 with a one-line error."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from nextn.build.manifest import EngineManifest
from nextn.cli.build_engine import main
from nextn.models.deepseek_v3.weights import runtime_weight_specs


def _fails(argv: list[str], capsys: pytest.CaptureFixture[str]) -> str:
    with pytest.raises(SystemExit) as exc:
        main(argv)
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err
    return err


def test_success_prints_a_summary(make_ckpt, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    ck = make_ckpt(num_mtp=1, tokenizer=True)
    capsys.readouterr()  # drop transformers' save_pretrained progress output
    out = tmp_path / "engine"
    assert main(["--model_dir", str(ck.path), "--output_dir", str(out), "--dtype", "bfloat16",
                 "--max_batch_size", "2", "--max_seq_len", "512", "--no-progress"]) == 0
    captured = capsys.readouterr()
    assert captured.err == ""  # --no-progress: no bar
    text = captured.out
    assert f"engine:     {out}" in text
    assert "dtype:      bfloat16" in text
    assert "MTP, 1 module(s), K=1, eagle" in text
    m = EngineManifest.load(out)
    assert f"tensors:    {len(runtime_weight_specs(m.model))}" in text  # 133: each routed expert's three
    assert "KiB" in text and "tokenizer.json" in text and " s\n" in text + "\n"
    assert (m.dtype, m.build_options.max_batch_size, m.build_options.max_seq_len) == ("bfloat16", 2, 512)


def test_the_source_path_is_recorded_normalised(make_ckpt, tmp_path: Path, capsys) -> None:
    """`nextn cache list` shows where an engine came from: the checkpoint's path with `..` folded."""
    ck = make_ckpt(num_mtp=1, tokenizer=True)
    roundabout = ck.path.parent / ".." / ck.path.parent.name / ck.path.name
    assert main(["--model_dir", str(roundabout), "--output_dir", str(tmp_path / "e"), "--no-progress"]) == 0
    assert EngineManifest.load(tmp_path / "e").source.path == str(ck.path.absolute())


def test_config_alias_reads_the_yaml(make_ckpt, tmp_path: Path, write_yaml, capsys: pytest.CaptureFixture[str]) -> None:
    ck = make_ckpt(num_mtp=1)
    yaml = write_yaml("speculative_config:\n  decoding_type: MTP\n  num_nextn_predict_layers: 3\n")
    assert main(["--model_dir", str(ck.path), "--output_dir", str(tmp_path / "e"), "--config", str(yaml),
                 "--no-progress"]) == 0
    assert "K=3" in capsys.readouterr().out
    assert EngineManifest.load(tmp_path / "e").speculative.max_draft_len == 3


def test_help_lists_the_options(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        main(["--help"])
    assert exc.value.code == 0
    text = capsys.readouterr().out
    for option in ("--model_dir", "--output_dir", "--dtype", "--max_batch_size", "--max_seq_len",
                   "--extra_llm_api_options", "--config", "--no-progress"):
        assert option in text


def test_refused_output_dir_exits_2(make_ckpt, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    ck = make_ckpt()
    out = tmp_path / "mine"
    out.mkdir()
    (out / "keep.txt").write_text("x")
    err = _fails(["--model_dir", str(ck.path), "--output_dir", str(out), "--no-progress"], capsys)
    assert err.startswith("build-engine: error: ") and "is not an nextn engine" in err
    assert (out / "keep.txt").read_text() == "x"


@pytest.mark.parametrize("case", ["missing_dir", "llama", "missing_tensor", "bad_yaml", "seq_len"])
def test_user_errors_exit_2(
    case: str, make_ckpt, write_yaml, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    extra: list[str] = []
    if case == "missing_dir":
        model_dir, expected = tmp_path / "absent", "absent does not exist"
    elif case == "llama":
        model_dir = make_ckpt(config_update={"architectures": ["FalconForCausalLM"], "model_type": "falcon"}).path
        expected = "unsupported architecture 'FalconForCausalLM'"
    elif case == "missing_tensor":
        model_dir, expected = make_ckpt(drop=("lm_head.weight",)).path, "missing tensor 'lm_head.weight'"
    elif case == "bad_yaml":
        model_dir, expected = make_ckpt().path, "unknown key 'max_batch'"
        extra = ["--extra_llm_api_options", str(write_yaml("max_batch: 3\n"))]
    else:
        model_dir, expected = make_ckpt().path, "max_seq_len 100000 exceeds"
        extra = ["--max_seq_len", "100000"]
    err = _fails(["--model_dir", str(model_dir), "--output_dir", str(tmp_path / "e"), "--no-progress", *extra], capsys)
    assert err.startswith("build-engine: error: ") and expected in err and err.count("\n") == 1
    assert not (tmp_path / "e").exists()


def test_argparse_errors_exit_2(capsys: pytest.CaptureFixture[str]) -> None:
    err = _fails(["--model_dir", "x", "--output_dir", "y", "--dtype", "int4"], capsys)
    assert "build-engine: error: argument --dtype: invalid choice" in err


def test_module_entry_point_exit_status(tmp_path: Path) -> None:
    proc = subprocess.run([sys.executable, "-m", "nextn.cli.build_engine", "--model_dir", str(tmp_path / "absent"),
                           "--output_dir", str(tmp_path / "e")], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2
    assert proc.stderr.startswith("build-engine: error: ") and "Traceback" not in proc.stderr


def test_gguf_with_medusa_heads_builds_from_the_cli(tmp_path, capsys):
    from pathlib import Path

    import torch
    from safetensors.torch import save_file

    from nextn.models.medusa import MedusaHeads

    gguf = Path(__file__).resolve().parents[2].parent / "shared" / "data" / "models" / "stories260K" / "stories260K.gguf"
    if not gguf.is_file():
        pytest.skip(f"{gguf} is absent: ../shared/data is not checked out")
    (tmp_path / "heads").mkdir()
    torch.manual_seed(0)
    save_file({k: v.contiguous() for k, v in MedusaHeads(2, 1, 64, 512).state_dict().items()},
              str(tmp_path / "heads" / "medusa_lm_head.safetensors"))
    assert main(["--model_dir", str(gguf), "--output_dir", str(tmp_path / "engine"), "--medusa_model_dir",
                 str(tmp_path / "heads"), "--no-progress", "--max_seq_len", "256"]) == 0
    out = capsys.readouterr().out
    assert "Medusa, 2 head(s)" in out and "tokenizer.json" in out


def test_max_seq_len_defaults_to_the_model_and_is_printed(make_ckpt, tmp_path: Path,
                                                          capsys: pytest.CaptureFixture[str]) -> None:
    ck = make_ckpt(config_update={"max_position_embeddings": 256})
    capsys.readouterr()
    assert main(["--model_dir", str(ck.path), "--output_dir", str(tmp_path / "e"), "--no-progress"]) == 0
    assert "max_seq_len: 256 (model: 256)" in capsys.readouterr().out
    assert EngineManifest.load(tmp_path / "e").build_options.max_seq_len == 256


@pytest.mark.parametrize("flag,value", [("--max_batch_size", str(10**12)), ("--max_batch_size", "0"),
                                        ("--max_seq_len", "1"), ("--max_seq_len", str(2**40))])
def test_sizes_no_load_accepts_are_refused_before_writing(make_ckpt, tmp_path: Path, capsys, flag, value) -> None:
    # issue 32: --max_batch_size 10**12 built an engine that could never load
    out = tmp_path / "engine"
    err = _fails(["--model_dir", str(make_ckpt().path), "--output_dir", str(out), flag, value], capsys)
    assert flag in err and "must be in" in err
    assert not out.exists() and not list(tmp_path.glob(".engine*"))


@pytest.mark.parametrize("signame", ["SIGTERM", "SIGHUP"])
def test_sigterm_and_sighup_clean_up_like_ctrl_c(make_ckpt, tmp_path: Path, monkeypatch, capsys, signame) -> None:
    # issue 32: SIGTERM/SIGHUP left .eng.building-* staging directories
    import os
    import signal
    import time

    import nextn.build.engine_builder as builder

    real = builder.write_safetensors_streaming

    def killed(path, *a, **kw):
        real(path, *a, **kw)
        os.kill(os.getpid(), getattr(signal, signame))
        time.sleep(5)  # the handler raises here

    monkeypatch.setattr(builder, "write_safetensors_streaming", killed)
    out = tmp_path / "eng"
    with pytest.raises(SystemExit) as e:
        main(["--model_dir", str(make_ckpt().path), "--output_dir", str(out), "--no-progress"])
    assert e.value.code == 128 + getattr(signal, signame)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt"]  # no engine, no staging dir, no lock file
    assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL or signame != "SIGTERM"


def test_a_second_build_into_the_same_dir_is_refused_while_one_runs(make_ckpt, tmp_path: Path, capsys) -> None:
    # issue 32: two concurrent builds into one folder both "succeeded"
    from nextn.build.output_dir import output_lock

    out = tmp_path / "eng"
    with output_lock(out):
        err = _fails(["--model_dir", str(make_ckpt().path), "--output_dir", str(out)], capsys)
    assert "another build-engine is writing" in err and not out.exists()
    assert main(["--model_dir", str(make_ckpt().path), "--output_dir", str(out), "--no-progress"]) == 0
    assert not list(tmp_path.glob(".eng.lock"))


def test_a_float16_engine_builds_and_generates(tmp_path, capsys):
    """`--dtype float16`, as README and --quant_algo's help name it: built, loaded and decoded (the paged attention
    kernel takes bf16 / f32 only, so a float16 engine keeps PyTorch's attention instead of failing its first step)."""
    from pathlib import Path

    from nextn import LLM, SamplingParams

    stories = Path(__file__).resolve().parents[2].parent / "shared/data/models/stories260K/stories260K.gguf"
    if not stories.is_file():
        pytest.skip(f"{stories} is absent (../shared/data)")
    assert main(["--model_dir", str(stories), "--output_dir", str(tmp_path / "e"), "--dtype", "float16",
                 "--no-progress"]) == 0
    assert "dtype:      float16" in capsys.readouterr().out
    llm = LLM(tmp_path / "e", device="cpu")
    out = llm.generate([1, 100, 200], SamplingParams(max_tokens=12, ignore_eos=True)).outputs[0]
    llm.shutdown()
    assert out.finish_reason == "length" and len(out.token_ids) == 12 and out.error is None
