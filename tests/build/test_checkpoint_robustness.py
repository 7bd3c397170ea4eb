"""Real-world checkpoint layouts and bad checkpoints (issue 12, items 6, 7 and the build part of 4).

Hugging Face cache snapshots (symlinks into blobs/), symlinked weight files and absolute weight_map paths build;
a weight_map entry that leaves the checkpoint, a non-float or non-finite tensor, a non-finite config value and a
config size the weights contradict are refused naming the entry, tensor or field; without --max_seq_len the engine
takes the model's max_position_embeddings, capped to memory.
"""

from __future__ import annotations

import hashlib
import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from nextn.build.checkpoint import CheckpointError, CheckpointReader
from nextn.build.engine_builder import build_engine
from nextn.build.fingerprint import fingerprint
from nextn.build.manifest import EngineError, EngineManifest
from nextn.build.weight_checks import check_engine_size, default_max_seq_len
from nextn.models.config import ConfigError, DeepseekV3ModelConfig
from nextn.models.deepseek_v3.weights import WeightError, runtime_weight_specs

INDEX = "model.safetensors.index.json"


def _hf_cache_snapshot(src: Path, hub: Path) -> Path:
    """Lay `src` out as huggingface_hub does: blobs/<sha256> and snapshots/<rev>/<name> → ../../blobs/<sha256>."""
    repo = hub / "models--tiny--deepseek"
    (repo / "blobs").mkdir(parents=True)
    snap = repo / "snapshots" / "0123abcd"
    snap.mkdir(parents=True)
    for f in sorted(src.iterdir()):
        digest = hashlib.sha256(f.read_bytes()).hexdigest()
        shutil.copyfile(f, repo / "blobs" / digest)
        (snap / f.name).symlink_to(Path("..") / ".." / "blobs" / digest)
    return snap


@pytest.mark.parametrize("sharded", [False, True])
def test_a_hugging_face_cache_snapshot_builds(make_ckpt, tmp_path: Path, sharded: bool) -> None:
    ck = make_ckpt(sharded=sharded, tokenizer=True)
    snap = _hf_cache_snapshot(ck.path, tmp_path / "hub")
    m = build_engine(snap, tmp_path / "engine", progress=False)
    build_engine(ck.path, tmp_path / "plain", progress=False)
    assert m.source.fingerprint == EngineManifest.load(tmp_path / "plain").source.fingerprint  # names, not blobs
    assert m.source.path == str(snap)
    a, b = load_file(str(tmp_path / "engine" / "model.safetensors")), load_file(str(tmp_path / "plain" / "model.safetensors"))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert not (tmp_path / "engine" / "tokenizer.json").is_symlink()  # copied, not linked into the cache


def test_a_symlinked_weight_file_builds(make_ckpt, tmp_path: Path) -> None:
    ck = make_ckpt()
    store = tmp_path / "disk2"
    store.mkdir()
    shutil.move(ck.path / "model.safetensors", store / "weights.bin")
    (ck.path / "model.safetensors").symlink_to(store / "weights.bin")
    build_engine(ck.path, tmp_path / "engine", progress=False)
    assert fingerprint([ck.path / "config.json", ck.path / "model.safetensors"], root=ck.path)


def test_absolute_weight_map_paths_inside_the_checkpoint_build(make_ckpt, tmp_path: Path) -> None:
    ck = make_ckpt(sharded=True)
    index = json.loads((ck.path / INDEX).read_text())
    index["weight_map"] = {n: str((ck.path / f).absolute()) for n, f in index["weight_map"].items()}
    (ck.path / INDEX).write_text(json.dumps(index))
    build_engine(ck.path, tmp_path / "engine", progress=False)


@pytest.mark.parametrize("entry", ["../../etc/passwd", "/etc/passwd", "sub/../../outside.safetensors", 7, ""])
def test_a_weight_map_entry_leaving_the_checkpoint_is_refused_by_name(make_ckpt, tmp_path: Path, entry) -> None:
    ck = make_ckpt(sharded=True)
    index = json.loads((ck.path / INDEX).read_text())
    index["weight_map"]["model.norm.weight"] = entry
    (ck.path / INDEX).write_text(json.dumps(index))
    with pytest.raises(CheckpointError, match=r"weight_map entry for tensor 'model.norm.weight' is "):
        build_engine(ck.path, tmp_path / "engine", progress=False)
    assert not (tmp_path / "engine").exists()


# Bad tensors ---------------------------------------------------------------------------------------------
def test_int32_embeddings_are_refused_naming_the_tensor(make_ckpt, tmp_path: Path) -> None:
    ck = make_ckpt(replace={"model.embed_tokens.weight": torch.zeros(256, 64, dtype=torch.int32)})
    with pytest.raises(WeightError, match=r"'model.embed_tokens.weight' has dtype I32; nextn builds from floating"):
        build_engine(ck.path, tmp_path / "engine", progress=False)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt"]


@pytest.mark.parametrize("name,value", [
    ("model.layers.0.mlp.down_proj.weight", float("nan")),
    ("model.layers.1.mlp.experts.5.up_proj.weight", float("inf")),  # an expert, stacked into the engine tensor
    ("model.norm.weight", float("-inf")),
])
def test_non_finite_weights_are_refused_naming_the_tensor(make_ckpt, tmp_path: Path, name: str, value: float) -> None:
    base = make_ckpt("base")
    t = base.tensors[name].clone()
    t.view(-1)[3] = value
    ck = make_ckpt(replace={name: t})
    with pytest.raises(WeightError, match=rf"checkpoint tensor '{name}' holds 1 NaN/Inf value\(s\)"):
        build_engine(ck.path, tmp_path / "engine", progress=False)


def test_values_beyond_float16_are_refused(make_ckpt, tmp_path: Path) -> None:
    base = make_ckpt("base")
    t = base.tensors["model.norm.weight"].clone()
    t[0] = 1e6
    ck = make_ckpt(replace={"model.norm.weight": t})
    with pytest.raises(WeightError, match=r"'model.norm.weight' has values up to 1e\+06, beyond torch.float16"):
        build_engine(ck.path, tmp_path / "engine", dtype="float16", progress=False)
    build_engine(ck.path, tmp_path / "engine", dtype="bfloat16", progress=False)


# Bad config values ---------------------------------------------------------------------------------------
@pytest.mark.parametrize("update,field", [
    ({"rms_norm_eps": float("nan")}, "rms_norm_eps"),
    ({"rope_parameters": {"rope_type": "default", "rope_theta": float("inf")}}, "rope_parameters.rope_theta"),
    ({"routed_scaling_factor": float("-inf")}, "routed_scaling_factor"),
])
def test_non_finite_config_values_are_refused_naming_the_field(make_ckpt, tmp_path: Path, update, field) -> None:
    ck = make_ckpt(config_update=update)
    with pytest.raises(CheckpointError, match=rf"field '{field}' is -?(nan|inf), not a finite number"):
        build_engine(ck.path, tmp_path / "engine", progress=False)
    assert not (tmp_path / "engine").exists()


def test_invalid_config_values_from_any_source_are_refused() -> None:
    """GGUF metadata reaches the config without JSON: the config model itself refuses non-finite and bad values."""
    hf = {"architectures": ["DeepseekV3ForCausalLM"], "vocab_size": 8, "hidden_size": 8, "intermediate_size": 8,
          "num_hidden_layers": 1, "num_attention_heads": 1, "kv_lora_rank": 4, "qk_nope_head_dim": 4,
          "qk_rope_head_dim": 4, "v_head_dim": 4}
    DeepseekV3ModelConfig.from_hf(hf)
    for field, value in (("rms_norm_eps", float("nan")), ("rms_norm_eps", -1.0), ("routed_scaling_factor", float("inf"))):
        with pytest.raises(ConfigError, match=field):
            DeepseekV3ModelConfig.from_hf({**hf, field: value})


def test_an_absurd_vocab_size_is_refused_naming_tensor_and_field(make_ckpt, tmp_path: Path) -> None:
    ck = make_ckpt(config_update={"vocab_size": 10**12})
    with pytest.raises(WeightError, match=r"'model.embed_tokens.weight' has shape \[256, 64\], expected "
                                          r"\[1000000000000, 64\] \(from the config's vocab_size=1000000000000\)"):
        build_engine(ck.path, tmp_path / "engine", progress=False)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt"]


def test_an_engine_far_larger_than_its_checkpoint_is_refused(make_ckpt, tmp_path: Path) -> None:
    """Readers without headers to check (GGUF) are caught by the size check before anything is written."""
    ck = make_ckpt()
    cfg = CheckpointReader(ck.path).model_config.model_copy(update={"hidden_size": 10**6})
    specs = {n: (s, torch.float32) for n, s in runtime_weight_specs(cfg).items()}
    engine_bytes = sum(torch.Size(s).numel() * 4 for s, _ in specs.values())
    with pytest.raises(EngineError, match=r"largest tensor .* \(hidden_size=1000000\): a size in the config is wrong"):
        check_engine_size(engine_bytes, [ck.path / "model.safetensors"], specs, cfg, tmp_path / "engine")


# max_seq_len (item 4, issue 13) ----------------------------------------------------------------------------
def test_without_max_seq_len_the_engine_takes_max_position_embeddings(make_ckpt, tmp_path: Path) -> None:
    ck = make_ckpt(config_update={"max_position_embeddings": 256})
    m = build_engine(ck.path, tmp_path / "engine", progress=False)  # was refused: default 2048 > 256
    assert m.build_options.max_seq_len == 256
    with pytest.raises(EngineError, match="--max_seq_len 512 exceeds the model's max_position_embeddings 256"):
        build_engine(ck.path, tmp_path / "engine2", max_seq_len=512, progress=False)
    assert build_engine(ck.path, tmp_path / "engine3", max_seq_len=100, progress=False).build_options.max_seq_len == 100


def test_the_yaml_max_seq_len_is_explicit(make_ckpt, write_yaml, tmp_path: Path) -> None:
    ck = make_ckpt()
    m = build_engine(ck.path, tmp_path / "e", extra_llm_api_options=write_yaml("max_seq_len: 300\n"), progress=False)
    assert m.build_options.max_seq_len == 300
    with pytest.raises(EngineError, match="max_seq_len in .* 9000 exceeds the model's max_position_embeddings 4096"):
        build_engine(ck.path, tmp_path / "f", extra_llm_api_options=write_yaml("max_seq_len: 9000\n"), progress=False)


def test_the_default_is_capped_where_the_kv_cache_would_not_fit() -> None:
    hf = {"architectures": ["DeepseekV3ForCausalLM"], "vocab_size": 8, "hidden_size": 8, "intermediate_size": 8,
          "num_hidden_layers": 4, "num_attention_heads": 1, "kv_lora_rank": 500, "qk_nope_head_dim": 4,
          "qk_rope_head_dim": 12, "v_head_dim": 4, "max_position_embeddings": 163840}
    cfg = DeepseekV3ModelConfig.from_hf(hf)  # 4 layers × 512 values × 2 bytes = 4 KiB per token
    assert default_max_seq_len(cfg, 8, 2, 0, memory_bytes=1 << 40) == (163840, None)
    n, note = default_max_seq_len(cfg, 8, 2, 1 << 30, memory_bytes=4 << 30)  # (0.5·4 − 1) GiB / (8 × 4 KiB)
    assert n == int((0.5 * (4 << 30) - (1 << 30)) // (8 * 4096)) // 256 * 256 == 32768
    assert note.startswith("max_seq_len 32768: the model's max_position_embeddings 163840 would need a 5.0 GiB KV "
                           "cache at max_batch_size 8") and "--max_seq_len" in note


@pytest.mark.parametrize("bad", ["nan", "int", "config"])
def test_medusa_heads_are_checked_like_weights(tmp_path: Path, bad: str) -> None:
    from safetensors.torch import save_file

    from nextn.build.medusa_heads import MedusaHeadsError, read_medusa_heads

    heads = {"0.0.linear.weight": torch.zeros(8, 8), "0.0.linear.bias": torch.zeros(8), "0.1.weight": torch.zeros(16, 8)}
    if bad == "nan":
        heads["0.0.linear.bias"][2] = float("nan")
    if bad == "int":
        heads["0.1.weight"] = heads["0.1.weight"].to(torch.int32)
    save_file(heads, str(tmp_path / "medusa_lm_head.safetensors"))
    (tmp_path / "config.json").write_text("{ not json" if bad == "config" else "{}")
    if bad == "config":  # a broken side config.json does not matter: the tensors decide
        assert read_medusa_heads(tmp_path).num_heads == 1
        return
    with pytest.raises(MedusaHeadsError, match="NaN/Inf" if bad == "nan" else "dtype torch.int32"):
        read_medusa_heads(tmp_path)


def test_a_capped_default_is_noted_in_one_line(make_ckpt, tmp_path: Path, monkeypatch,
                                               caplog: pytest.LogCaptureFixture) -> None:
    monkeypatch.setattr("nextn.build.weight_checks.available_memory", lambda: 20 << 20)  # 20 MiB of memory
    m = build_engine(make_ckpt().path, tmp_path / "engine", progress=False)
    assert 256 <= m.build_options.max_seq_len < 4096 and m.build_options.max_seq_len % 256 == 0
    notes = [r.getMessage() for r in caplog.records if "max_position_embeddings 4096 would need" in r.getMessage()]
    assert len(notes) == 1 and "\n" not in notes[0] and f"max_seq_len {m.build_options.max_seq_len}:" in notes[0]
