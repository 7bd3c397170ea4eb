"""build-engine never destroys a user's files (issue 12, item 1): only a directory that is provably an nextn engine
is replaced, and then only the files its manifest lists; a failed build leaves nothing behind."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from nextn.build.engine_builder import build_engine
from nextn.build.manifest import MANIFEST_NAME, EngineError, EngineManifest
from nextn.cli.build_engine import main
from nextn.models.deepseek_v3.weights import WeightError


def _tree(d: Path) -> dict[str, bytes | None]:
    """Every path under `d` (directories → None), with file contents: a deep snapshot."""
    return {p.relative_to(d).as_posix(): (None if p.is_dir() else p.read_bytes()) for p in sorted(d.rglob("*"))}


def test_a_project_with_its_own_manifest_is_never_touched(make_ckpt, tmp_path: Path) -> None:
    """The issue's reproduction: manifest.json of another program, a thesis and a src/ tree."""
    ck = make_ckpt()
    p = tmp_path / "p"
    (p / "src").mkdir(parents=True)
    (p / "src" / "main.py").write_text("print('hi')\n")
    (p / MANIFEST_NAME).write_text('{"name": "app"}')
    (p / "thesis.tex").write_text("x\n")
    before = _tree(p)
    for force in (False, True):  # --force never applies to a directory that is not an engine
        with pytest.raises(EngineError, match=r"is not empty and is not an nextn engine .*nothing was changed"):
            build_engine(ck.path, p, progress=False, force=force)
        assert _tree(p) == before
    assert sorted(x.name for x in tmp_path.iterdir()) == ["ckpt", "p"]  # no staging left


@pytest.mark.parametrize("manifest", [
    "[1, 2]",  # not an object
    '{"schema_version": 1}',  # schema only
    "not json at all",
])
def test_directories_with_foreign_manifests_are_refused(make_ckpt, tmp_path: Path, manifest: str) -> None:
    ck = make_ckpt()
    p = tmp_path / "p"
    p.mkdir()
    (p / MANIFEST_NAME).write_text(manifest)
    before = _tree(p)
    with pytest.raises(EngineError, match="is not an nextn engine"):
        build_engine(ck.path, p, progress=False, force=True)
    assert _tree(p) == before


def test_a_manifest_listing_paths_outside_is_not_an_engine(make_ckpt, tmp_path: Path) -> None:
    ck = make_ckpt()
    out = tmp_path / "engine"
    build_engine(ck.path, out, progress=False)
    data = json.loads((out / MANIFEST_NAME).read_text())
    data["weight_files"] = ["../precious.txt"]
    data["checksums"] = {}
    (out / MANIFEST_NAME).write_text(json.dumps(data))
    (tmp_path / "precious.txt").write_text("keep")
    before = _tree(tmp_path)
    with pytest.raises(EngineError, match=r"'\.\./precious\.txt' must be a relative path inside"):
        build_engine(ck.path, out, progress=False, force=True)
    assert _tree(tmp_path) == before


def test_an_engine_with_other_files_is_refused_naming_them_unless_force(make_ckpt, tmp_path: Path) -> None:
    ck = make_ckpt(tokenizer=True)
    out = tmp_path / "engine"
    m = build_engine(ck.path, out, progress=False)
    (out / "notes.txt").write_text("mine")
    (out / "results").mkdir()
    (out / "results" / "run1.json").write_text("{}")
    (out / "empty").mkdir()
    before = _tree(out)
    with pytest.raises(EngineError, match=r"also holds 3 file\(s\) its manifest does not list: empty/, notes.txt, "
                                          r"results/run1.json\. .*--force"):
        build_engine(ck.path, out, progress=False)
    assert _tree(out) == before
    build_engine(ck.path, out, progress=False, force=True)
    assert sorted(os.listdir(out)) == sorted([MANIFEST_NAME, *m.data_files()])
    assert sorted(os.listdir(tmp_path)) == ["ckpt", "engine"]


def test_rebuild_removes_exactly_the_listed_files(make_ckpt, tmp_path: Path) -> None:
    ck = make_ckpt(tokenizer=True)
    out = tmp_path / "engine"
    m1 = build_engine(ck.path, out, dtype="float32", progress=False)
    m2 = build_engine(ck.path, out, dtype="bfloat16", progress=False)
    assert m1.checksums["model.safetensors"] != m2.checksums["model.safetensors"]
    assert sorted(os.listdir(out)) == sorted([MANIFEST_NAME, *m2.data_files()])
    assert "generation_config.json" in m2.aux_files and "tokenizer.json" in m2.tokenizer_files
    assert sorted(os.listdir(tmp_path)) == ["ckpt", "engine"]


def test_a_failed_build_creates_nothing(make_ckpt, tmp_path: Path) -> None:
    bad = make_ckpt("bad", drop=("model.norm.weight",))
    out = tmp_path / "new" / "deeper" / "engine"
    with pytest.raises(WeightError, match="model.norm.weight"):
        build_engine(bad.path, out, progress=False)
    assert sorted(os.listdir(tmp_path)) == ["bad"]  # not even the parent directories


def test_an_output_path_that_is_a_file_or_link_is_refused(make_ckpt, tmp_path: Path) -> None:
    ck = make_ckpt()
    f = tmp_path / "file"
    f.write_text("data")
    with pytest.raises(EngineError, match="is not a directory"):
        build_engine(ck.path, f, progress=False)
    assert f.read_text() == "data"
    (tmp_path / "link").symlink_to(tmp_path / "ckpt")
    with pytest.raises(EngineError, match="symbolic link|contains the checkpoint"):
        build_engine(ck.path, tmp_path / "link", progress=False)


def test_cli_force_and_refusal(make_ckpt, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    ck = make_ckpt()
    out = tmp_path / "engine"
    assert main(["--model_dir", str(ck.path), "--output_dir", str(out), "--no-progress"]) == 0
    (out / "keep.txt").write_text("k")
    capsys.readouterr()
    with pytest.raises(SystemExit) as exc:
        main(["--model_dir", str(ck.path), "--output_dir", str(out), "--no-progress"])
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert "keep.txt" in err and "--force" in err and "Traceback" not in err
    assert (out / "keep.txt").read_text() == "k"
    assert main(["--model_dir", str(ck.path), "--output_dir", str(out), "--no-progress", "--force"]) == 0
    assert not (out / "keep.txt").exists()
    EngineManifest.load(out)
