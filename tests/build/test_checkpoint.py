"""CheckpointReader (single-file and sharded safetensors, FP8 dequantization, errors naming the file/tensor) and the
checkpoint fingerprint."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from nextn.build.checkpoint import CheckpointError, CheckpointReader
from nextn.build.fingerprint import fingerprint
from nextn.models.config import ConfigError

EXPERT = "model.layers.1.mlp.experts.3.up_proj.weight"


def test_single_file_reads_every_tensor(make_ckpt) -> None:
    ck = make_ckpt(num_mtp=1)
    with CheckpointReader(ck.path) as r:
        assert sorted(r.names()) == sorted(ck.tensors)
        assert r.files == [ck.path / "model.safetensors"]
        assert r.index_file is None and not r.is_fp8
        for name in (EXPERT, "model.layers.3.eh_proj.weight", "model.layers.1.mlp.gate.e_score_correction_bias"):
            assert r.has(name)
            assert torch.equal(r.get(name), ck.tensors[name])
        assert not r.has("model.layers.9.input_layernorm.weight")
        with pytest.raises(KeyError):
            r.get("model.layers.9.input_layernorm.weight")
        assert r.hf_config["num_nextn_predict_layers"] == 1
        assert r.model_config.num_nextn_predict_layers == 1
        assert r.model_config.num_hidden_layers == 3


def test_sharded_matches_single_file(make_ckpt) -> None:
    single = make_ckpt("single", num_mtp=1)
    sharded = make_ckpt("sharded", num_mtp=1, sharded=True)
    a, b = CheckpointReader(single.path), CheckpointReader(sharded.path)
    assert [f.name for f in b.files] == ["model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"]
    assert b.index_file == sharded.path / "model.safetensors.index.json"
    assert sorted(a.names()) == sorted(b.names())
    for name in a.names():
        assert torch.equal(a.get(name), b.get(name)), name


def test_handles_reopen_after_close(make_ckpt) -> None:
    ck = make_ckpt(num_mtp=0, sharded=True)
    r = CheckpointReader(ck.path)
    r.close()
    assert torch.equal(r.get("lm_head.weight"), ck.tensors["lm_head.weight"])


def test_fp8_is_dequantized_and_scales_are_hidden(make_ckpt) -> None:
    ck = make_ckpt(num_mtp=1, fp8=True, fp8_block=(16, 24), sharded=True)
    r = CheckpointReader(ck.path)
    assert r.is_fp8
    assert not any(n.endswith("_scale_inv") for n in r.names())
    assert sorted(r.names()) == sorted(ck.tensors)
    assert not r.has(EXPERT + "_scale_inv")
    assert len(ck.dequantized) > 50
    for name, ref in ck.dequantized.items():
        got = r.get(name)
        assert got.dtype == torch.float32 and torch.equal(got, ref), name
    # Left unquantized, as in DeepSeek's FP8 release: norms, router, its bias, embedding, lm_head, eh_proj.
    for name in ("model.layers.1.mlp.gate.weight", "model.layers.1.mlp.gate.e_score_correction_bias",
                 "model.norm.weight", "model.embed_tokens.weight", "lm_head.weight", "model.layers.3.eh_proj.weight"):
        assert name not in ck.dequantized
        assert torch.equal(r.get(name), ck.tensors[name])


def test_fp8_tensor_without_scale_names_it(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text(json.dumps({"quantization_config": {"quant_method": "fp8"}}))
    save_file({"w.weight": torch.zeros(4, 4).to(torch.float8_e4m3fn)}, str(tmp_path / "model.safetensors"))
    with pytest.raises(CheckpointError, match=r"FP8 tensor 'w.weight' .* has no 'w.weight_scale_inv'"):
        CheckpointReader(tmp_path).get("w.weight")


def test_fp8_scale_of_wrong_shape_names_the_tensor(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text(json.dumps({"quantization_config": {"quant_method": "fp8"}}))
    save_file({"w.weight": torch.zeros(200, 4).to(torch.float8_e4m3fn), "w.weight_scale_inv": torch.ones(1, 1)},
              str(tmp_path / "model.safetensors"))
    with pytest.raises(CheckpointError, match=r"cannot dequantize FP8 tensor 'w.weight'.*expected \[2, 1\]"):
        CheckpointReader(tmp_path).get("w.weight")


def test_unsupported_quantization_is_refused(make_ckpt) -> None:
    ck = make_ckpt(config_update={"quantization_config": {"quant_method": "awq", "bits": 4}})
    with pytest.raises(CheckpointError, match=r"config.json: unsupported quantization_config.quant_method 'awq'"):
        CheckpointReader(ck.path)


@pytest.mark.parametrize("spelling", ["transformers", "deepseek"])
def test_both_config_spellings(make_ckpt, spelling: str) -> None:
    ck = make_ckpt(spelling=spelling)
    cfg = CheckpointReader(ck.path).model_config
    if spelling == "deepseek":
        assert "rope_scaling" in ck.config and "rope_parameters" not in ck.config
        assert cfg.rope.rope_type == "yarn" and cfg.rope.factor == 4.0
        assert cfg.rope.original_max_position_embeddings == 1024
        assert cfg.torch_dtype == "bfloat16"
    else:
        assert "rope_parameters" in ck.config and "rope_scaling" not in ck.config
        assert cfg.rope.rope_type == "default"
        assert cfg.torch_dtype == "float32"
    assert cfg.rope.rope_theta == 10000.0


def test_missing_directory_and_config(tmp_path: Path) -> None:
    with pytest.raises(CheckpointError, match="does not exist"):
        CheckpointReader(tmp_path / "nope")
    with pytest.raises(CheckpointError, match=r"config.json not found"):
        CheckpointReader(tmp_path)
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(CheckpointError, match=r"config.json is not valid JSON"):
        CheckpointReader(tmp_path)
    (tmp_path / "config.json").write_text("[1, 2]")
    with pytest.raises(CheckpointError, match=r"config.json must hold a JSON object"):
        CheckpointReader(tmp_path)


def test_no_weights(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text("{}")
    (tmp_path / "pytorch_model.bin").write_bytes(b"")
    with pytest.raises(CheckpointError, match=r"neither model.safetensors nor model.safetensors.index.json.*\.bin"):
        CheckpointReader(tmp_path)


def test_missing_shard_is_named(make_ckpt) -> None:
    ck = make_ckpt(sharded=True)
    (ck.path / "model-00002-of-00002.safetensors").unlink()
    with pytest.raises(CheckpointError, match=r"shard .*model-00002-of-00002.safetensors listed in "
                                              r"model.safetensors.index.json is missing"):
        CheckpointReader(ck.path)


def test_truncated_shard_is_named(make_ckpt) -> None:
    ck = make_ckpt(sharded=True)
    shard = ck.path / "model-00002-of-00002.safetensors"
    shard.write_bytes(shard.read_bytes()[: shard.stat().st_size // 2])
    with pytest.raises(CheckpointError, match=r"cannot read .*model-00002-of-00002.safetensors: .*truncated"):
        CheckpointReader(ck.path)


def test_index_mapping_a_tensor_to_the_wrong_shard(make_ckpt) -> None:
    ck = make_ckpt(sharded=True)
    index_path = ck.path / "model.safetensors.index.json"
    index = json.loads(index_path.read_text())
    index["weight_map"]["lm_head.weight"] = "model-00002-of-00002.safetensors"
    index_path.write_text(json.dumps(index))
    with pytest.raises(CheckpointError, match=r"model-00002-of-00002.safetensors lacks 1 tensor.*'lm_head.weight'"):
        CheckpointReader(ck.path)


def test_index_without_weight_map(make_ckpt) -> None:
    ck = make_ckpt(sharded=True)
    (ck.path / "model.safetensors.index.json").write_text('{"metadata": {}}')
    with pytest.raises(CheckpointError, match="has no 'weight_map'"):
        CheckpointReader(ck.path)


def test_unsupported_architecture_names_it(make_ckpt) -> None:
    ck = make_ckpt(config_update={"architectures": ["FalconForCausalLM"], "model_type": "falcon"})
    r = CheckpointReader(ck.path)  # reading tensors is architecture-agnostic
    with pytest.raises(ConfigError, match="unsupported architecture 'FalconForCausalLM'"):
        r.model_config


# Fingerprint of the checkpoint files ---------------------------------------------------------------------
def test_fingerprint_covers_names_sizes_and_contents(tmp_path: Path) -> None:
    a, b = tmp_path / "a" / "config.json", tmp_path / "a" / "model.safetensors"
    a.parent.mkdir()
    a.write_text("{}")
    b.write_bytes(b"x" * 3_000_000)  # several 1 MiB chunks
    digest = fingerprint([a, b])
    assert len(digest) == 64 and digest == fingerprint([b, a, b])  # order and duplicates do not matter
    moved = tmp_path / "elsewhere" / "copy"
    moved.mkdir(parents=True)
    (moved / "config.json").write_text("{}")
    (moved / "model.safetensors").write_bytes(b"x" * 3_000_000)
    assert fingerprint([moved / "config.json", moved / "model.safetensors"]) == digest  # location-independent
    b.write_bytes(b"x" * 2_999_999 + b"y")
    assert fingerprint([a, b]) != digest  # content
    b.write_bytes(b"x" * 3_000_000)
    b.rename(tmp_path / "a" / "renamed.safetensors")
    assert fingerprint([a, tmp_path / "a" / "renamed.safetensors"]) != digest  # names
    assert fingerprint([a], root=tmp_path) != fingerprint([a])  # names are relative to the root
    with pytest.raises(ValueError, match="at least one file"):
        fingerprint([])
