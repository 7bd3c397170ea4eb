"""`resolve_engine_dir`: a checkpoint is built once into the cache, keyed by its content and the build options."""

from __future__ import annotations

import shutil

import pytest

from nextn.build.engine_cache import checkpoint_files, resolve_engine_dir
from nextn.build.manifest import EngineError, EngineManifest


@pytest.fixture()
def ckpt(checkpoints, tmp_path):
    out = tmp_path / "ckpt"
    shutil.copytree(checkpoints.checkpoint(num_mtp_modules=1), out)
    return out


def test_engine_dir_is_returned_as_is(checkpoints):
    engine = checkpoints.engine(num_mtp_modules=1)
    assert resolve_engine_dir(engine, cache_dir="/nonexistent-never-created") == engine


def test_checkpoint_is_built_once_and_reused(ckpt, tmp_path):
    cache = tmp_path / "cache"
    first = resolve_engine_dir(ckpt, cache_dir=cache, progress=False, dtype="float32")
    manifest = EngineManifest.load(first)
    assert first.parent == cache and manifest.dtype == "float32"
    mtime = (first / "manifest.json").stat().st_mtime_ns
    again = resolve_engine_dir(ckpt, cache_dir=cache, progress=False, dtype="float32")
    assert again == first and (first / "manifest.json").stat().st_mtime_ns == mtime  # not rebuilt


def test_options_and_content_change_the_key(ckpt, tmp_path):
    cache = tmp_path / "cache"
    a = resolve_engine_dir(ckpt, cache_dir=cache, progress=False, dtype="float32")
    b = resolve_engine_dir(ckpt, cache_dir=cache, progress=False, dtype="bfloat16")
    assert a != b and EngineManifest.load(b).dtype == "bfloat16"
    (ckpt / "config.json").write_text((ckpt / "config.json").read_text().replace("\n", "\n ", 1))
    c = resolve_engine_dir(ckpt, cache_dir=cache, progress=False, dtype="float32")
    assert c not in (a, b)


def test_not_a_checkpoint_is_a_clear_error(tmp_path):
    (tmp_path / "notes.txt").write_text("hello")
    with pytest.raises(EngineError, match="not an nextn engine directory"):
        resolve_engine_dir(tmp_path, cache_dir=tmp_path / "cache")
    with pytest.raises(EngineError, match="does not exist"):
        resolve_engine_dir(tmp_path / "missing", cache_dir=tmp_path / "cache")
    assert not (tmp_path / "cache").exists()  # nothing written for bad input


def test_two_gguf_files_must_be_chosen(tmp_path):
    (tmp_path / "a.gguf").write_bytes(b"x")
    (tmp_path / "b.gguf").write_bytes(b"y")
    with pytest.raises(EngineError, match="2 .gguf files"):
        checkpoint_files(tmp_path)


def test_llm_accepts_a_checkpoint(ckpt, tmp_path):
    from nextn import LLM, SamplingParams

    engine = resolve_engine_dir(ckpt, cache_dir=tmp_path / "cache", progress=False, dtype="float32")
    prompt = [1, 17, 42, 5]
    params = SamplingParams(max_tokens=8, ignore_eos=True)
    direct = LLM(ckpt, engine_cache_dir=tmp_path / "cache", dtype="float32").generate(prompt, params)
    built = LLM(engine).generate(prompt, params)
    assert direct.outputs[0].token_ids == built.outputs[0].token_ids
    assert len(direct.outputs[0].token_ids) == 8


def test_a_broken_cache_entry_is_rebuilt(ckpt, tmp_path):
    cache = tmp_path / "cache"
    engine = resolve_engine_dir(ckpt, cache_dir=cache, progress=False, dtype="float32")
    (engine / "manifest.json").write_text("{not json")
    again = resolve_engine_dir(ckpt, cache_dir=cache, progress=False, dtype="float32")
    assert again == engine and EngineManifest.load(engine).dtype == "float32"
