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


def write_q4_gguf(path, quantized: bool = True):
    """A tiny Llama GGUF (hidden 64, 2 heads, ffn 128, vocab 32) whose decoder matrices are Q4_0 (or float32)."""
    import gguf
    import numpy as np
    from gguf import quants

    h, ffn, vocab = 64, 128, 32
    w = gguf.GGUFWriter(str(path), "llama")
    for key, value in {"block_count": 1, "context_length": 64, "embedding_length": h, "feed_forward_length": ffn,
                       "attention.head_count": 2, "attention.head_count_kv": 2}.items():
        w.add_uint32(f"llama.{key}", value)
    w.add_float32("llama.attention.layer_norm_rms_epsilon", 1e-5)
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


def test_a_4bit_gguf_builds_w4a16_by_default_and_every_path_shares_one_engine(tmp_path):
    """quant_algo "auto" (the default): a mostly 4-bit GGUF on a CPU with nextn's int4 kernels builds W4A16 in bf16
    — the fast, batch-invariant format — and the options are resolved before the cache key, so the default, an
    explicit W4A16 / bfloat16 (the demo's) and `nextn generate --model`'s "auto" reach one engine; float32 asks for
    an exact engine and gets no quantization."""
    from nextn.plugins import woq_linear

    if not woq_linear.available():
        pytest.skip(f"nextn's int4 CPU kernels are unavailable here: {woq_linear.unavailable_reason()}")
    gguf_file, cache = write_q4_gguf(tmp_path / "m.gguf"), tmp_path / "cache"
    default = resolve_engine_dir(gguf_file, cache_dir=cache, progress=False)
    manifest = EngineManifest.load(default)
    assert manifest.quant_config is not None and manifest.quant_config.quant_algo == "W4A16"
    assert manifest.dtype == "bfloat16"
    explicit = resolve_engine_dir(gguf_file, cache_dir=cache, progress=False, dtype="bfloat16", quant_algo="W4A16")
    auto = resolve_engine_dir(gguf_file, cache_dir=cache, progress=False, dtype="auto", quant_algo="auto")
    assert explicit == default == auto
    exact = resolve_engine_dir(gguf_file, cache_dir=cache, progress=False, dtype="float32")
    assert exact != default and EngineManifest.load(exact).quant_config is None
    assert len([p for p in cache.iterdir() if p.is_dir()]) == 2


def test_a_float_gguf_stays_unquantized_by_default(tmp_path):
    engine = resolve_engine_dir(write_q4_gguf(tmp_path / "m.gguf", quantized=False), cache_dir=tmp_path / "cache",
                                progress=False)
    assert EngineManifest.load(engine).quant_config is None
