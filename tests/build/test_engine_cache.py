"""`resolve_engine_dir`: a checkpoint is built once into the cache, keyed by its content and the build options."""

from __future__ import annotations

import os
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


def write_q4_gguf(path, quantized: bool = True, file_type: int | None = None):
    """A tiny Llama GGUF (hidden 64, 2 heads, ffn 128, vocab 32) whose decoder matrices are Q4_0 (or float32), with
    `general.file_type` = `file_type` when given."""
    import gguf
    import numpy as np
    from gguf import quants

    h, ffn, vocab = 64, 128, 32
    w = gguf.GGUFWriter(str(path), "llama")
    for key, value in {"block_count": 1, "context_length": 64, "embedding_length": h, "feed_forward_length": ffn,
                       "attention.head_count": 2, "attention.head_count_kv": 2}.items():
        w.add_uint32(f"llama.{key}", value)
    w.add_float32("llama.attention.layer_norm_rms_epsilon", 1e-5)
    if file_type is not None:
        w.add_file_type(file_type)
    w.add_tokenizer_model("llama")
    w.add_token_list(["<unk>", "<s>", "</s>"] + [f"t{i}" for i in range(vocab - 3)])
    w.add_token_scores([0.0] * vocab)
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    rng = np.random.default_rng(0)
    shapes = {"token_embd.weight": (vocab, h), "output_norm.weight": (h,), "output.weight": (vocab, h),
              "blk.0.attn_norm.weight": (h,), "blk.0.ffn_norm.weight": (h,), "blk.0.attn_q.weight": (h, h),
              "blk.0.attn_k.weight": (h, h), "blk.0.attn_v.weight": (h, h), "blk.0.attn_output.weight": (h, h),
              "blk.0.ffn_gate.weight": (ffn, h), "blk.0.ffn_up.weight": (ffn, h), "blk.0.ffn_down.weight": (h, ffn)}
    for name, shape in shapes.items():
        a = (rng.standard_normal(shape) * 0.1).astype(np.float32)
        if quantized and name.startswith("blk.") and len(shape) == 2:
            q4 = gguf.GGMLQuantizationType.Q4_0
            w.add_tensor(name, quants.quantize(a, q4), raw_dtype=q4)
        else:
            w.add_tensor(name, a)
    for step in (w.write_header_to_file, w.write_kv_data_to_file, w.write_tensors_to_file, w.close):
        step()
    return path


@pytest.mark.parametrize("variant,algo", [("avx512_bf16", "W4A16"), ("avx2", "W4A8")])
def test_a_4bit_gguf_builds_int4_by_default_and_every_path_shares_one_engine(tmp_path, variant, algo):
    """quant_algo "auto" (the default): a mostly 4-bit GGUF on a CPU with nextn's int4 kernels builds the fastest
    int4 format of its kernel variant in bf16 — W4A16 with AVX512-BF16, W4A8 elsewhere: fast and batch-invariant —
    and the options are resolved before the cache key, so the default, the same format asked explicitly (the
    demo's) and `nextn generate --model`'s "auto" reach one engine; float32 asks for an exact engine and gets no
    quantization."""
    from nextn.plugins import cpu_kernels, woq_linear

    if not woq_linear.available():
        pytest.skip(f"nextn's int4 CPU kernels are unavailable here: {woq_linear.unavailable_reason()}")
    if variant not in cpu_kernels.runnable():
        pytest.skip(f"this CPU does not run the {variant} kernels")
    with cpu_kernels.use(variant):
        _default_engine_is_shared(tmp_path, algo)


def _default_engine_is_shared(tmp_path, algo):
    gguf_file, cache = write_q4_gguf(tmp_path / "m.gguf"), tmp_path / "cache"
    default = resolve_engine_dir(gguf_file, cache_dir=cache, progress=False)
    manifest = EngineManifest.load(default)
    assert manifest.quant_config is not None and manifest.quant_config.quant_algo == algo
    assert manifest.dtype == "bfloat16"
    explicit = resolve_engine_dir(gguf_file, cache_dir=cache, progress=False, dtype="bfloat16", quant_algo=algo)
    auto = resolve_engine_dir(gguf_file, cache_dir=cache, progress=False, dtype="auto", quant_algo="auto")
    assert explicit == default == auto
    exact = resolve_engine_dir(gguf_file, cache_dir=cache, progress=False, dtype="float32")
    assert exact != default and EngineManifest.load(exact).quant_config is None
    assert len([p for p in cache.iterdir() if p.is_dir()]) == 2


def test_auto_options_are_resolved_once_per_machine_and_the_checkpoint_stays_closed(tmp_path, monkeypatch):
    """Resolving "auto" opens the checkpoint (a GGUF's metadata: seconds for a 49k-token vocabulary); the entry it
    resolved to is remembered (`.alias-*`, keyed by the checkpoint, the options as given and what "auto" depends on
    here), so later loads go straight to it — and to a fresh resolution when that entry is gone. An alias file that
    is not one of ours is neither trusted nor overwritten."""
    import shutil

    from nextn.build import engine_settings

    gguf_file, cache = write_q4_gguf(tmp_path / "m.gguf"), tmp_path / "cache"
    first = resolve_engine_dir(gguf_file, cache_dir=cache, progress=False)

    def no_open(*args, **kwargs):
        raise AssertionError("the checkpoint was opened to resolve options resolved before")
    with monkeypatch.context() as m:
        m.setattr(engine_settings, "open_checkpoint", no_open)
        assert resolve_engine_dir(gguf_file, cache_dir=cache, progress=False) == first
    shutil.rmtree(first)
    assert resolve_engine_dir(gguf_file, cache_dir=cache, progress=False) == first
    assert (first / "manifest.json").is_file()
    (alias,) = [p for p in cache.iterdir() if p.name.startswith(".alias-")]
    alias.write_text("not a key")
    assert resolve_engine_dir(gguf_file, cache_dir=cache, progress=False) == first
    assert alias.read_text() == "not a key"


def test_a_float_gguf_stays_unquantized_by_default(tmp_path):
    engine = resolve_engine_dir(write_q4_gguf(tmp_path / "m.gguf", quantized=False), cache_dir=tmp_path / "cache",
                                progress=False)
    assert EngineManifest.load(engine).quant_config is None


# The cache's entries: last use, listing, clearing, the size cap (build/cache_entries.py, `nextn cache`) ------------

def _two_entries(ckpt, cache):
    """Two engines of `ckpt` in `cache` (float32 used first, then bfloat16)."""
    old = resolve_engine_dir(ckpt, cache_dir=cache, progress=False, dtype="float32", max_cache_bytes=2**62)
    new = resolve_engine_dir(ckpt, cache_dir=cache, progress=False, dtype="bfloat16", max_cache_bytes=2**62)
    os.utime(cache / f"{old.name}.lock", (1_000_000, 1_000_000))  # used long ago
    return old, new


def test_entries_list_source_format_and_last_use(ckpt, tmp_path, capsys):
    from nextn.build.cache_entries import list_entries
    from nextn.cli.main import main

    cache = tmp_path / "cache"
    old, new = _two_entries(ckpt, cache)
    entries = list_entries(cache)
    assert [e.key for e in entries] == [old.name, new.name]  # least recently used first
    assert all(e.removable and e.num_bytes > 0 for e in entries)
    assert entries[0].manifest.source.path.endswith("ckpt") and entries[1].manifest.dtype == "bfloat16"
    resolve_engine_dir(ckpt, cache_dir=cache, progress=False, dtype="float32")  # a use moves it to the end
    assert [e.key for e in list_entries(cache)] == [new.name, old.name]
    assert main(["cache", "list", "--cache_dir", str(cache)]) == 0
    out = capsys.readouterr().out
    assert "2 engine(s)" in out and old.name in out and "float32" in out and "bfloat16" in out
    assert f"from {ckpt}" in out and "fingerprint" in out and "last used" in out


def test_clear_removes_only_engines_of_the_cache(ckpt, tmp_path, capsys):
    from nextn.cli.main import main

    cache = tmp_path / "cache"
    old, new = _two_entries(ckpt, cache)
    (cache / "notes.txt").write_text("mine")
    (cache / ("a" * 20)).mkdir()  # named like a key, not an engine
    (cache / ("a" * 20) / "data.bin").write_bytes(b"x")
    outside = tmp_path / "outside_engine"
    shutil.copytree(new, outside)
    (cache / ("b" * 20)).symlink_to(outside)  # a link to an engine elsewhere
    extra = cache / ("c" * 20)
    shutil.copytree(new, extra)
    (extra / "my_results.txt").write_text("keep")  # an engine holding a file its manifest does not list
    assert main(["cache", "clear", "--all", "--cache_dir", str(cache)]) == 0
    captured = capsys.readouterr()
    assert "removed 2 engine(s)" in captured.out and captured.err.count("left alone") == 3
    assert not old.exists() and not new.exists()
    assert not (cache / f"{old.name}.lock").exists() and not (cache / f"{new.name}.lock").exists()
    assert (cache / "notes.txt").read_text() == "mine" and (cache / ("a" * 20) / "data.bin").exists()
    assert (outside / "manifest.json").exists() and (cache / ("b" * 20)).is_symlink()
    assert (extra / "my_results.txt").exists() and (extra / "manifest.json").exists()


def test_clear_by_key_and_by_age(ckpt, tmp_path, capsys):
    from nextn.cli.main import main

    cache = tmp_path / "cache"
    old, new = _two_entries(ckpt, cache)
    assert main(["cache", "clear", "--older_than", "30", "--cache_dir", str(cache)]) == 0
    assert not old.exists() and new.exists()
    assert main(["cache", "clear", "0123456789", "--cache_dir", str(cache)]) == 2
    assert "names no entry" in capsys.readouterr().err and new.exists()
    assert main(["cache", "clear", new.name[:8], "--cache_dir", str(cache)]) == 0
    assert not new.exists() and f"removed {new.name}" in capsys.readouterr().out


def test_the_size_cap_evicts_the_least_recently_used(ckpt, tmp_path, caplog):
    from nextn.build.cache_entries import list_entries

    cache = tmp_path / "cache"
    old, new = _two_entries(ckpt, cache)
    sizes = {e.key: e.num_bytes for e in list_entries(cache)}
    cap = sizes[new.name] + sizes[old.name] // 2  # room for one engine and a half
    with caplog.at_level("WARNING", logger="nextn.build.cache_entries"):
        third = resolve_engine_dir(ckpt, cache_dir=cache, progress=False, dtype="float32", max_seq_len=64,
                                   max_cache_bytes=cap)
    assert third.exists() and not old.exists() and not new.exists()  # both older ones went, the new one stays
    evictions = [r.getMessage() for r in caplog.records if "evicted" in r.getMessage()]
    assert len(evictions) == 1 and "evicted 2 least-recently-used" in evictions[0] and old.name in evictions[0]


def test_the_size_cap_keeps_the_new_engine_and_locked_ones(ckpt, tmp_path):
    import fcntl

    from nextn.build.cache_entries import lock_path

    cache = tmp_path / "cache"
    old, new = _two_entries(ckpt, cache)
    with open(lock_path(cache, old.name), "a") as held:  # another holder of the old entry's lock
        fcntl.flock(held, fcntl.LOCK_EX)
        third = resolve_engine_dir(ckpt, cache_dir=cache, progress=False, dtype="float32", max_seq_len=64,
                                   max_cache_bytes=1)
    assert third.exists() and old.exists()  # the entry built now and the locked one are never evicted
    assert not new.exists()


def test_a_bad_cache_cap_is_a_named_error(ckpt, tmp_path, monkeypatch):
    for bad in ("lots", "0", "-3", "nan"):
        monkeypatch.setenv("NEXTN_CACHE_MAX_GB", bad)
        with pytest.raises(EngineError, match="NEXTN_CACHE_MAX_GB must be a positive number"):
            resolve_engine_dir(ckpt, cache_dir=tmp_path / "cache", progress=False, dtype="float32")
    assert not (tmp_path / "cache").exists()


def test_a_draft_checkpoint_build_says_so(checkpoints, ckpt, tmp_path, monkeypatch, caplog):
    """A Draft_Target draft given as a checkpoint is built on load with a line naming the draft model."""
    import nextn.build.engine_cache as engine_cache
    from nextn import LLM

    monkeypatch.setattr(engine_cache, "DEFAULT_CACHE_DIR", tmp_path / "cache")
    target = checkpoints.engine(num_mtp_modules=1)
    with caplog.at_level("WARNING", logger="nextn.build.engine_cache"):
        LLM(target, speculative_config={"decoding_type": "Draft_Target", "max_draft_len": 2,
                                        "speculative_model_dir": str(ckpt)})
    lines = [r.getMessage() for r in caplog.records if "building an engine" in r.getMessage()]
    assert len(lines) == 1 and lines[0].startswith("Draft_Target: the draft model: building an engine for")


def test_auto_keeps_a_4bit_gguf_dense_where_the_int4_kernel_cannot_take_its_shapes(tmp_path, monkeypatch):
    """W4A16 is chosen only where nextn's int4 kernel takes every decoder linear (in % 64, out % 16): otherwise the
    build would be slow and not batch-invariant, or fail for want of a group size."""
    from nextn.build.engine_settings import auto_quant_algo, open_checkpoint
    from nextn.plugins import woq_linear

    monkeypatch.setattr(woq_linear, "available", lambda: True)
    path = write_q4_gguf(tmp_path / "m.gguf")
    with open_checkpoint(path) as reader:
        assert auto_quant_algo(reader, "cpu") == woq_linear.fastest_int4_algo()  # W4A16 on AVX512-BF16, else W4A8
        monkeypatch.setattr(woq_linear, "takes", lambda algo, n, k: k % 128 == 0)  # 64-wide inputs not taken
        assert auto_quant_algo(reader, "cpu") is None
        assert auto_quant_algo(reader, "cuda") is None


def test_auto_takes_a_q4_k_m_file_as_4_bit_even_where_most_tensors_are_5_bit(tmp_path, monkeypatch):
    """llama.cpp's Q4_K_M stores rows that are not multiples of 256 as Q5_0 (Gemma-3-270M: 81 of 127 matrices): the
    file type the user chose, not the per-tensor share, makes `auto` build W4A16 (float tensors here: share 0)."""
    from nextn.build.engine_settings import auto_quant_algo, open_checkpoint
    from nextn.plugins import woq_linear

    monkeypatch.setattr(woq_linear, "available", lambda: True)
    for file_type, want in ((15, woq_linear.fastest_int4_algo()), (7, None), (None, None)):  # Q4_K_M, Q8_0, none
        path = write_q4_gguf(tmp_path / f"m{file_type}.gguf", quantized=False, file_type=file_type)
        with open_checkpoint(path) as reader:
            assert reader.four_bit_share == 0.0
            assert auto_quant_algo(reader, "cpu") == want, file_type


def test_cache_list_reads_manifests_without_importing_torch(ckpt, tmp_path):
    """`nextn cache list` stays well under a second: manifests (their model and quantization configs) load without
    torch, which alone takes about a second to import."""
    import subprocess
    import sys

    cache = tmp_path / "cache"
    entry = resolve_engine_dir(ckpt, cache_dir=cache, progress=False, dtype="float32")
    code = ("import sys; from nextn.cli.main import main; rc = main(['cache', 'list', '--cache_dir', sys.argv[1]]); "
            "print('torch imported' if 'torch' in sys.modules else 'no torch'); sys.exit(rc)")
    out = subprocess.run([sys.executable, "-c", code, str(cache)], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and entry.name in out.stdout, out
    assert out.stdout.strip().endswith("no torch"), out.stdout
