"""The benchmark modules' result files (bench/outputs.py) and nextn-bench's sibling reports and charts: a user's
file is refused before any model loads and left as it was; a report of the same benchmark is replaced (issue 32,
class 6)."""

from __future__ import annotations

import importlib
import json

import pytest

from nextn.bench.outputs import check_report, write_report
from nextn.bench.plot import check_plot_dir
from nextn.build.output_files import OutputPathError

USERS = '[{"my": "figures"}]\n'  # a bare JSON list: what real_models / compile_step / quant_quality wrote before
# each module's arguments, `{out}` the output path; the model paths do not exist: the check must come first
MODULES = {
    "drafters": ["--target", "{missing}.gguf", "--json", "{out}"],
    "gpu_step": ["--tiny", "--device", "cpu", "--json", "{out}"],
    "mtp_tree_al": ["--heads", "{missing}", "--out", "{out}"],
    "prefix_reuse": ["--model", "{missing}.gguf", "--json", "{out}"],
    "vs_llama_cpp": ["--model", "{missing}.gguf", "--json", "{out}"],
    "real_models": ["speed", "--model", "{missing}.gguf", "--json", "{out}"],
    "compile_step": ["--engine", "{missing}", "--json", "{out}"],
    "quant_quality": ["--model", "{missing}.gguf", "--json", "{out}"],
}
#: the product's benchmarks (src/nextn/bench/); the others are studies (benchmarks/, outside the package)
PACKAGE = {"vs_llama_cpp": "nextn.bench", "real_models": "nextn.bench"}


def _argv(module: str, out, tmp_path) -> list[str]:
    return [a.format(out=out, missing=tmp_path / "missing") for a in MODULES[module]]


@pytest.mark.parametrize("module", sorted(MODULES))
def test_a_users_file_or_a_directory_is_refused_before_the_run(module, tmp_path, capsys, monkeypatch):
    main = importlib.import_module(f"{PACKAGE.get(module, 'benchmarks')}.{module}").main
    import nextn

    def no_model(*args, **kwargs):
        raise AssertionError("a model was loaded before the output was checked")

    monkeypatch.setattr(nextn, "LLM", no_model)
    mine = tmp_path / "figures.json"
    mine.write_text(USERS)
    for out, message in ((mine, "was not written by this command"), (tmp_path, "is a directory")):
        with pytest.raises(SystemExit) as e:
            main(_argv(module, out, tmp_path))
        err = capsys.readouterr().err
        assert e.value.code == 2 and message in err and "Traceback" not in err, err
    assert mine.read_text() == USERS
    assert sorted(p.name for p in tmp_path.iterdir()) == ["figures.json"]  # nothing else written


@pytest.mark.parametrize("module", sorted(MODULES))
def test_a_report_of_the_same_benchmark_is_replaced_and_another_ones_refused(module, tmp_path):
    import argparse

    parser = argparse.ArgumentParser(prog=module)
    out = tmp_path / "r.json"
    write_report(out, module, {"results": [1, 2]})
    assert json.loads(out.read_text()) == {"written_by": f"nextn bench.{module}", "results": [1, 2]}
    assert check_report(parser, out, module) == out
    write_report(out, module, {"results": [3]})  # a rerun, or the next config of an incremental writer
    assert json.loads(out.read_text())["results"] == [3]
    other = "gpu_step" if module != "gpu_step" else "drafters"
    with pytest.raises(OutputPathError, match="not written by this command"):
        write_report(out, other, {"results": []})
    assert json.loads(out.read_text())["results"] == [3]


def test_gpu_step_writes_its_report_and_replaces_it_on_a_rerun(tmp_path, capsys):
    from benchmarks.gpu_step import main

    out = tmp_path / "g.json"
    argv = ["--tiny", "--device", "cpu", "--batch_sizes", "1", "--gen_tokens", "2", "--warmup", "0", "--json", str(out)]
    for _ in range(2):
        assert main(argv) == 0
        result = json.loads(out.read_text())
        assert result["written_by"] == "nextn bench.gpu_step" and [r["batch"] for r in result["rows"]] == [1]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["g.json"]  # no temporary file left


def test_a_bad_train_record_is_a_usage_error_before_any_model(tmp_path, capsys, monkeypatch):
    import nextn
    from benchmarks.mtp_tree_al import main

    monkeypatch.setattr(nextn, "LLM", None)
    heads = tmp_path / "heads"
    heads.mkdir()
    for content, message in ((None, "does not exist"), ("[1, 2]", "not a train-draft record"),
                             ('{"eval_prompt_ids": NaN}', "not valid JSON")):
        if content is not None:
            (heads / "train_draft.json").write_text(content)
        with pytest.raises(SystemExit) as e:
            main(["--heads", str(heads)])
        assert e.value.code == 2 and message in capsys.readouterr().err


def test_the_plot_dir_is_checked_before_the_run(tmp_path):
    plots = tmp_path / "plots"
    assert check_plot_dir(plots) == plots and not plots.exists()  # created only when the charts are written
    plots.mkdir()
    (plots / "notes.txt").write_text("mine")  # not a chart name: left alone
    (plots / "throughput_vs_k.png").write_bytes(b"\x89PNG\r\n\x1a\n...")  # an earlier chart: replaced later
    assert check_plot_dir(plots) == plots
    (plots / "acceptance_per_position_k3.png").write_text("my own notes")
    with pytest.raises(OutputPathError, match="acceptance_per_position_k3.png exists and was not written"):
        check_plot_dir(plots)
    (tmp_path / "file").write_text("x")
    with pytest.raises(OutputPathError, match="not a directory"):
        check_plot_dir(tmp_path / "file")
    (tmp_path / "link").symlink_to(plots)
    with pytest.raises(OutputPathError, match="symbolic link"):
        check_plot_dir(tmp_path / "link")
