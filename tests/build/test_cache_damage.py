"""A damaged engine-cache entry is rebuilt, and what the cache did not make is refused by name (issue 57).

The cache owns its entries (build/engine_cache.py): a truncated weights file is found by the size check of every use
(`resolve_engine_dir`), a flipped bit by the SHA-256 check of the load (`load_through_cache`, which `LLM` loads
through); either way the entry is rebuilt with a warning naming its key, and the engine generates as before. A
symbolic link, a file or a foreign directory where an entry belongs is never removed: loading and `nextn cache`
name it and say what to do.
"""

from __future__ import annotations

import logging
import shutil

import pytest

from nextn.build import engine_cache
from nextn.build.engine_cache import load_through_cache, resolve_engine_dir
from nextn.build.manifest import EngineError, EngineFileError, EngineManifest, verify_engine_files

PROMPT = [1, 17, 42, 5]


@pytest.fixture()
def ckpt(checkpoints, tmp_path):
    out = tmp_path / "ckpt"
    shutil.copytree(checkpoints.checkpoint(num_mtp_modules=1), out)
    return out


def _build(ckpt, cache):
    return resolve_engine_dir(ckpt, cache_dir=cache, progress=False, dtype="float32")


def _flip_a_bit(path, offset=-4096):
    data = bytearray(path.read_bytes())
    data[offset] ^= 0x10
    path.write_bytes(bytes(data))


def _generate(ckpt, cache):
    from nextn import LLM, SamplingParams

    llm = LLM(ckpt, engine_cache_dir=cache, dtype="float32", speculative_config=None)
    return llm.generate(PROMPT, SamplingParams(max_tokens=8, ignore_eos=True)).outputs[0].token_ids


def _linked_broken_entry(ckpt, cache, tmp_path):
    """A built entry moved elsewhere with a broken manifest, a symbolic link to it in its place: (link, target)."""
    entry = _build(ckpt, cache)
    elsewhere = tmp_path / "elsewhere"
    shutil.move(entry, elsewhere)
    (elsewhere / "manifest.json").write_text("{broken")
    entry.symlink_to(elsewhere)
    return entry, elsewhere


def _warnings(caplog, *words):
    return [r.getMessage() for r in caplog.records
            if r.levelno == logging.WARNING and all(w in r.getMessage() for w in words)]


def test_a_bit_flipped_cached_engine_is_rebuilt_and_generates_as_before(ckpt, tmp_path, caplog):
    cache = tmp_path / "cache"
    before = _generate(ckpt, cache)
    (entry,) = [p for p in cache.iterdir() if p.is_dir()]
    _flip_a_bit(entry / "model.safetensors")  # same size, same header: only the load's SHA-256 finds it
    with caplog.at_level(logging.WARNING, logger="nextn.build.engine_cache"):
        after = _generate(ckpt, cache)
    assert after == before
    (line,) = _warnings(caplog, "is damaged (")
    assert entry.name in line and "corrupt" in line and "model.safetensors" in line
    verify_engine_files(entry, EngineManifest.load(entry), "full")  # the entry was rebuilt whole
    assert [p.name for p in cache.iterdir() if p.name.startswith(".") and not p.name.startswith(".alias-")] == []


def test_a_truncated_cached_engine_is_rebuilt_on_its_next_use(ckpt, tmp_path, caplog):
    cache = tmp_path / "cache"
    entry = _build(ckpt, cache)
    weights = entry / "model.safetensors"
    size = weights.stat().st_size
    weights.write_bytes(weights.read_bytes()[: size // 2])
    with caplog.at_level(logging.WARNING, logger="nextn.build.engine_cache"):
        again = _build(ckpt, cache)
    assert again == entry and weights.stat().st_size == size
    verify_engine_files(entry, EngineManifest.load(entry), "full")
    (line,) = _warnings(caplog, "is damaged (")
    assert entry.name in line and "truncated" in line


def test_an_entry_damaged_again_after_its_rebuild_names_nextn_cache_clear(ckpt, tmp_path, monkeypatch):
    """A rebuild that is damaged again (a failing disk) is not rebuilt in a loop: the error names the key."""
    from nextn.build import engine_builder

    cache = tmp_path / "cache"
    entry = _build(ckpt, cache)
    _flip_a_bit(entry / "model.safetensors")
    real = engine_builder.build_engine

    def build_on_a_bad_disk(path, out, **kwargs):
        real(path, out, **kwargs)
        _flip_a_bit(out / "model.safetensors")

    monkeypatch.setattr(engine_builder, "build_engine", build_on_a_bad_disk)
    with pytest.raises(EngineError, match=f"damaged again.*nextn cache clear {entry.name} --cache_dir {cache}"):
        _generate(ckpt, cache)


def test_an_entry_that_cannot_be_removed_names_nextn_cache_clear(ckpt, tmp_path, monkeypatch):
    cache = tmp_path / "cache"
    entry = _build(ckpt, cache)
    _flip_a_bit(entry / "model.safetensors")

    def read_only(src, dst):
        raise PermissionError(13, "Permission denied")

    monkeypatch.setattr(engine_cache.os, "rename", read_only)
    with pytest.raises(EngineError, match=f"cannot be removed.*Permission denied.*nextn cache clear {entry.name} "):
        _generate(ckpt, cache)
    assert (entry / "manifest.json").is_file()  # left whole


def test_an_entry_rebuilt_by_another_process_meanwhile_is_used_as_it_is(ckpt, tmp_path):
    cache = tmp_path / "cache"
    calls = []

    def load(resolve):
        engine = resolve(ckpt, cache_dir=cache, progress=False, dtype="float32")
        calls.append((engine / "manifest.json").stat().st_ino)
        if len(calls) == 1:  # another process found it damaged and rebuilt it after our resolve
            shutil.rmtree(engine)
            _build(ckpt, cache)
            calls.append((engine / "manifest.json").stat().st_ino)
            raise EngineFileError("engine file damaged", engine / "model.safetensors")
        return engine

    assert load_through_cache(load) == cache / _build(ckpt, cache).name
    assert len(calls) == 3 and calls[2] == calls[1]  # the other process's rebuild was kept, not removed again


def test_an_engine_directory_given_by_the_user_is_never_rebuilt(ckpt, tmp_path):
    engine = tmp_path / "my_engine"
    shutil.copytree(_build(ckpt, tmp_path / "cache"), engine)

    def load(resolve):
        resolve(engine, cache_dir=tmp_path / "cache")
        raise EngineFileError("engine file damaged", engine / "model.safetensors")

    with pytest.raises(EngineFileError, match="engine file damaged"):
        load_through_cache(load)
    assert (engine / "model.safetensors").is_file()


@pytest.mark.parametrize("damage", ["truncated", "corrupt"])
def test_a_damaged_draft_model_entry_is_rebuilt_too(checkpoints, ckpt, tmp_path, monkeypatch, caplog, damage):
    """A Draft_Target draft given as a checkpoint is a cache entry like the target's: rebuilt when damaged — cut
    short (the size check) or a flipped bit (the draft's load verifies its SHA-256 as the target's does)."""
    from nextn import LLM

    cache = tmp_path / "cache"
    monkeypatch.setattr(engine_cache, "DEFAULT_CACHE_DIR", cache)
    target = checkpoints.engine(num_mtp_modules=1)
    spec = {"decoding_type": "Draft_Target", "max_draft_len": 2, "speculative_model_dir": str(ckpt)}
    LLM(target, speculative_config=spec)
    (entry,) = [p for p in cache.iterdir() if p.is_dir()]
    weights = entry / "model.safetensors"
    if damage == "truncated":
        weights.write_bytes(weights.read_bytes()[:-4096])
    else:
        _flip_a_bit(weights)
    with caplog.at_level(logging.WARNING, logger="nextn.build.engine_cache"):
        llm = LLM(target, speculative_config=spec)
    assert llm.engine_dir == target
    (line,) = _warnings(caplog, "is damaged (")
    assert entry.name in line and damage in line
    verify_engine_files(entry, EngineManifest.load(entry), "full")


# What the cache did not make: refused by name, never removed ------------------------------------------------------

def test_a_symlinked_entry_with_a_broken_manifest_is_refused_by_name(ckpt, tmp_path):
    cache = tmp_path / "cache"
    entry, elsewhere = _linked_broken_entry(ckpt, cache, tmp_path)
    with pytest.raises(EngineError, match=f"{entry} is a symbolic link \\(to {elsewhere}\\).*left alone"):
        _build(ckpt, cache)
    assert entry.is_symlink() and (elsewhere / "manifest.json").read_text() == "{broken"
    assert (elsewhere / "model.safetensors").is_file()


def test_a_symlinked_entry_with_damaged_weights_is_refused_by_name(ckpt, tmp_path):
    cache = tmp_path / "cache"
    entry = _build(ckpt, cache)
    elsewhere = tmp_path / "elsewhere"
    shutil.move(entry, elsewhere)
    entry.symlink_to(elsewhere)
    _flip_a_bit(elsewhere / "model.safetensors")
    with pytest.raises(EngineError, match="is a symbolic link.*left alone"):
        _generate(ckpt, cache)
    assert entry.is_symlink() and (elsewhere / "model.safetensors").is_file()


def test_a_file_in_place_of_an_entry_is_refused_by_name(ckpt, tmp_path):
    cache = tmp_path / "cache"
    entry = _build(ckpt, cache)
    shutil.rmtree(entry)
    entry.write_text("mine")
    with pytest.raises(EngineError, match=f"{entry} is a file, not an engine directory.*left alone: move or remove"):
        _build(ckpt, cache)
    assert entry.read_text() == "mine"


def test_a_directory_without_a_manifest_in_place_of_an_entry_is_kept(ckpt, tmp_path):
    cache = tmp_path / "cache"
    entry = _build(ckpt, cache)
    shutil.rmtree(entry)
    entry.mkdir()
    (entry / "results.csv").write_text("mine")
    with pytest.raises(EngineError, match=f"{entry} is a directory without manifest.json.*left alone"):
        _build(ckpt, cache)
    assert (entry / "results.csv").read_text() == "mine"


def test_a_damaged_entry_holding_a_users_file_is_kept(ckpt, tmp_path):
    cache = tmp_path / "cache"
    _generate(ckpt, cache)
    (entry,) = [p for p in cache.iterdir() if p.is_dir()]
    (entry / "notes.txt").write_text("mine")
    _flip_a_bit(entry / "model.safetensors")
    with pytest.raises(EngineError, match=f"{entry} is damaged.*notes.txt.*nextn cache clear {entry.name}"):
        _generate(ckpt, cache)
    assert (entry / "notes.txt").read_text() == "mine"


def test_a_cache_folder_that_is_a_file_is_a_named_error(ckpt, tmp_path):
    (tmp_path / "cache").write_text("mine")
    with pytest.raises(EngineError, match="engine cache .* is not a directory"):
        _build(ckpt, tmp_path / "cache")


# `nextn cache list` / `clear` -------------------------------------------------------------------------------------

def test_cache_list_and_clear_name_a_link_and_a_file_where_entries_belong(ckpt, tmp_path, capsys):
    from nextn.cli.main import main

    cache = tmp_path / "cache"
    entry, elsewhere = _linked_broken_entry(ckpt, cache, tmp_path)
    a_file = cache / ("d" * 20)
    a_file.write_text("mine")
    assert main(["cache", "list", "--cache_dir", str(cache)]) == 0
    out = capsys.readouterr().out
    assert f"a symbolic link (to {elsewhere})" in out and f"rm {entry}" in out
    assert a_file.name in out and "a file, not an engine directory" in out and f"rm {a_file}" in out
    assert main(["cache", "clear", a_file.name, "--cache_dir", str(cache)]) == 0  # named, not "no entry"
    assert f"left alone: {a_file} (a file" in capsys.readouterr().err
    assert main(["cache", "clear", "--all", "--cache_dir", str(cache)]) == 0
    err = capsys.readouterr().err
    assert err.count("left alone") == 2 and "symbolic link" in err
    assert entry.is_symlink() and a_file.read_text() == "mine" and (elsewhere / "model.safetensors").is_file()


def test_cache_list_of_a_file_is_a_named_error(tmp_path, capsys):
    from nextn.cli.main import main

    (tmp_path / "cache").write_text("mine")
    assert main(["cache", "list", "--cache_dir", str(tmp_path / "cache")]) == 2
    assert "is not a directory" in capsys.readouterr().err
