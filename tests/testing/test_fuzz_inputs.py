"""Issue 32's fuzz test of its input classes (`nextn.testing.fuzz_inputs`): seeded (NEXTN_FUZZ_SEED, default 32) and
time-bounded (NEXTN_FUZZ_SECONDS, default 25 s), random variants of hostile chat templates, counts in LLM arguments
and GGUF headers, user-named files that are not small regular files, rank trees, and user files where a command
writes. Every input must end in a named error or be accepted within its bounds, with nothing of the user's changed;
every class must be exercised. The figures are printed (docs/RELIABILITY.md quotes them); longer runs:
`python -m nextn.testing.fuzz_inputs --seconds N --seed S`.

Below it, the fuzzer's findings, each pinned by a direct test."""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path

import pytest

from nextn.testing.fuzz_inputs import CLASSES, fuzz_inputs

SEED = int(os.environ.get("NEXTN_FUZZ_SEED", "32"))
FUZZ_SECONDS = float(os.environ.get("NEXTN_FUZZ_SECONDS", "25"))


@pytest.mark.slow
def test_fuzz_issue_32_input_classes(tmp_path, capsys):
    logging.disable(logging.WARNING)  # refusals and build notes log by design
    try:
        # at least 80 inputs of the classes whose valid variants must run too (~13 % of counts' are accepted): a
        # slow machine's 25 s gave counts 30, all refused
        report = fuzz_inputs(FUZZ_SECONDS, SEED, workdir=tmp_path, min_tries={"counts": 80, "trees": 80})
    finally:
        logging.disable(logging.NOTSET)
    with capsys.disabled():
        print("\n" + report.summary())
    assert not report.failures, "\n".join(report.failures[:10])
    for name in CLASSES:
        figures = report.classes[name]
        assert figures.tried > 0 and figures.clean_errors > 0, (name, figures)
        assert figures.clean_errors + figures.accepted == figures.tried, (name, figures)
    assert report.classes["trees"].accepted > 0 and report.classes["counts"].accepted > 0  # valid variants ran too


# Findings ---------------------------------------------------------------------------------------------------------
def test_a_refused_build_leaves_no_parent_directory_it_made(tmp_path, capsys):
    from nextn.cli.build_engine import main
    from nextn.testing.fuzz_inputs_gen import write_tiny_gguf

    model = write_tiny_gguf(tmp_path / "m.gguf", {"llama.block_count": (1000, "UINT32")})
    with pytest.raises(SystemExit) as e:
        main(["--model_dir", str(model), "--output_dir", str(tmp_path / "new" / "deeper" / "engine"), "--no-progress"])
    assert e.value.code == 2 and "block_count is 1000" in capsys.readouterr().err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["m.gguf"]


def test_a_nextn_medusa_choices_file_that_is_not_a_regular_file_is_refused_not_skipped(tmp_path, monkeypatch):
    from nextn.speculative.medusa_tree import TreeError, published_tree

    fifo = tmp_path / "trees.json"
    os.mkfifo(fifo)
    for named in (fifo, "/dev/zero", tmp_path, tmp_path / "missing.json"):
        monkeypatch.setenv("NEXTN_MEDUSA_CHOICES", str(named))
        with pytest.raises(TreeError, match=str(named)):
            published_tree("mc_sim_7b_63")


@pytest.mark.parametrize("line", ["[" * 100_000 + "]" * 100_000, '{"prompt": ' + "9" * 5000 + "}"])
def test_a_prompt_file_line_past_the_json_parser_is_a_dataset_error(tmp_path, line):
    from nextn.bench.dataset import DatasetError, load_dataset, read_prompt_file

    path = tmp_path / "prompts.jsonl"
    path.write_text(line + "\n")
    for read in (load_dataset, read_prompt_file):
        with pytest.raises(DatasetError, match="prompts.jsonl:1: not valid JSON"):
            read(path)


def test_a_users_file_named_like_the_marker_does_not_make_a_model_dir_triton_repos(tmp_path):
    from nextn.build.engine_builder import build_engine
    from nextn.build.output_files import OutputPathError
    from nextn.serving.triton_repo import write_model_repository
    from nextn.testing.fuzz_inputs_gen import write_tiny_gguf

    engine = tmp_path / "engine"
    build_engine(write_tiny_gguf(tmp_path / "m.gguf"), engine, progress=False)
    model_dir = tmp_path / "repo" / "nextn"
    model_dir.mkdir(parents=True)
    (model_dir / ".nextn-output.json").write_text(json.dumps({"written_by": "someone else"}))
    with pytest.raises(OutputPathError, match="did not write"):
        write_model_repository(engine, tmp_path / "repo", "nextn")
    assert sorted(p.name for p in model_dir.iterdir()) == [".nextn-output.json"]
    (model_dir / ".nextn-output.json").unlink()
    write_model_repository(engine, tmp_path / "repo", "nextn")  # its own output is rewritten, marker and all
    write_model_repository(engine, tmp_path / "repo", "nextn")
    assert Path(model_dir / "config.pbtxt").is_file()
