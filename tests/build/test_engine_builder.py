"""build_engine: engine contents and layout, dtypes, FP8, manifest (speculative info, fingerprint), output-dir safety,
and errors that name the tensor or file."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file

from nextn.build.checkpoint import CheckpointError
from nextn.build.engine_builder import build_engine
from nextn.build.manifest import EngineError, EngineManifest
from nextn.config.llm_args import LlmArgsError
from nextn.models.config import ConfigError
from nextn.models.deepseek_v3.weights import WeightError, runtime_weight_specs

MTP_YAML_K3 = """\
max_num_tokens: 4096
speculative_config:
  decoding_type: MTP
  num_nextn_predict_layers: 3
"""


def _engine(engine_dir: Path) -> dict[str, torch.Tensor]:
    return load_file(str(engine_dir / "model.safetensors"))


def _snapshot(d: Path) -> dict[str, tuple[bytes, int]]:
    return {p.name: (p.read_bytes(), p.stat().st_mtime_ns) for p in d.iterdir()}


def test_fp32_engine_matches_hf_layout(make_ckpt, tmp_path: Path) -> None:
    ck = make_ckpt(num_mtp=1)
    m = build_engine(ck.path, tmp_path / "engine", dtype="float32", progress=False)
    engine = _engine(tmp_path / "engine")
    specs = runtime_weight_specs(m.model)
    assert set(engine) == set(specs)
    assert {n: tuple(t.shape) for n, t in engine.items()} == specs
    assert all(t.dtype == torch.float32 for t in engine.values())
    # Main model: equal to transformers' in-memory state dict, whose experts are fused ([E, 2I, H] gate rows then up
    # rows; [E, H, I]) where the engine holds them one by one.
    assert "model.layers.1.mlp.experts.gate_up_proj" in ck.in_memory
    for name, ref in ck.in_memory.items():
        if name.endswith("mlp.experts.gate_up_proj"):
            stem = name.removesuffix("gate_up_proj")
            for e in range(ref.shape[0]):
                assert torch.equal(engine[f"{stem}{e}.gate_proj.weight"], ref[e, :32]), (name, e)
                assert torch.equal(engine[f"{stem}{e}.up_proj.weight"], ref[e, 32:]), (name, e)
        elif name.endswith("mlp.experts.down_proj"):
            for e in range(ref.shape[0]):
                assert torch.equal(engine[f"{name.removesuffix('down_proj')}{e}.down_proj.weight"], ref[e]), (name, e)
        else:
            assert torch.equal(engine[name], ref), name
    # MTP layer 3: per-expert tensors as stored; embed/head copies dropped.
    p = "model.layers.3."
    for e in range(8):
        for proj in ("gate_proj", "up_proj", "down_proj"):
            name = f"{p}mlp.experts.{e}.{proj}.weight"
            assert torch.equal(engine[name], ck.tensors[name])
    for name in ("enorm.weight", "hnorm.weight", "eh_proj.weight", "shared_head.norm.weight"):
        assert torch.equal(engine[p + name], ck.tensors[p + name])
    assert p + "embed_tokens.weight" not in engine and p + "shared_head.head.weight" not in engine
    with safe_open(str(tmp_path / "engine" / "model.safetensors"), "pt") as f:
        assert f.metadata() == {"format": "pt"}


def test_bf16_engine_keeps_router_bias_fp32(make_ckpt, tmp_path: Path) -> None:
    ck = make_ckpt(num_mtp=1)
    m = build_engine(ck.path, tmp_path / "engine", dtype="bfloat16", progress=False)
    assert m.dtype == "bfloat16"
    engine = _engine(tmp_path / "engine")
    for name, t in engine.items():
        if name.endswith("e_score_correction_bias"):
            assert t.dtype == torch.float32 and torch.equal(t, ck.tensors[name])
        else:
            assert t.dtype == torch.bfloat16, name
    assert torch.equal(engine["lm_head.weight"], ck.tensors["lm_head.weight"].to(torch.bfloat16))


def test_manifest_contents_and_round_trip(make_ckpt, tmp_path: Path) -> None:
    ck = make_ckpt(num_mtp=1)
    m = build_engine(ck.path, tmp_path / "engine", max_batch_size=4, max_seq_len=1024, progress=False)
    assert EngineManifest.load(tmp_path / "engine") == m
    assert m.architecture == "DeepseekV3ForCausalLM"
    assert m.dtype == "float32"  # auto: the checkpoint's dtype
    assert m.model.num_nextn_predict_layers == 1 and m.model.hidden_size == 64
    assert m.speculative.model_dump() == {"method": "mtp", "num_mtp_modules": 1, "max_draft_len": 1,
                                          "use_mtp_vanilla": False, "num_medusa_heads": 0, "medusa_num_layers": 0}
    assert m.build_options.model_dump() == {"max_batch_size": 4, "max_seq_len": 1024, "extra_llm_api_options": None}
    assert m.source.path == str(ck.path.resolve()) and m.source.format == "safetensors"
    assert len(m.source.fingerprint) == 64
    assert m.weight_files == ["model.safetensors"]
    # No tokenizer in the checkpoint: none listed; generation_config.json is still carried over.
    assert m.tokenizer_files == []
    generation_config = (tmp_path / "engine" / "generation_config.json").read_bytes()
    assert generation_config == (ck.path / "generation_config.json").read_bytes()
    assert sorted(p.name for p in (tmp_path / "engine").iterdir()) == ["generation_config.json", "manifest.json",
                                                                      "model.safetensors"]


def test_tokenizer_files_are_copied_and_listed(make_ckpt, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    ck = make_ckpt(tokenizer=True)
    capsys.readouterr()
    m = build_engine(ck.path, tmp_path / "engine", progress=True)
    bar = capsys.readouterr().err  # the tqdm bar over tensors
    n = len(runtime_weight_specs(m.model))  # every engine tensor once (133 here: each expert's three)
    assert "build-engine: 100%" in bar and f"{n}/{n}" in bar
    assert m.tokenizer_files == ["tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"]
    for name in m.tokenizer_files:
        assert (tmp_path / "engine" / name).read_bytes() == (ck.path / name).read_bytes()


def test_fingerprint_is_stable_and_tracks_content(make_ckpt, tmp_path: Path) -> None:
    ck = make_ckpt(sharded=True)
    a = build_engine(ck.path, tmp_path / "e1", progress=False).source.fingerprint
    b = build_engine(ck.path, tmp_path / "e2", progress=False).source.fingerprint
    moved = shutil.copytree(ck.path, tmp_path / "elsewhere" / "copy")
    c = build_engine(moved, tmp_path / "e3", progress=False).source.fingerprint
    assert a == b == c
    config = json.loads((moved / "config.json").read_text())
    config["rms_norm_eps"] = 1e-5
    (moved / "config.json").write_text(json.dumps(config))
    assert build_engine(moved, tmp_path / "e4", progress=False).source.fingerprint != a


def test_sharded_and_single_file_build_the_same_engine(make_ckpt, tmp_path: Path) -> None:
    single, sharded = make_ckpt("single", num_mtp=1), make_ckpt("sharded", num_mtp=1, sharded=True)
    build_engine(single.path, tmp_path / "e1", progress=False)
    build_engine(sharded.path, tmp_path / "e2", progress=False)
    e1, e2 = _engine(tmp_path / "e1"), _engine(tmp_path / "e2")
    assert e1.keys() == e2.keys() and all(torch.equal(e1[n], e2[n]) for n in e1)


def test_both_config_spellings_build_the_same_weights(make_ckpt, tmp_path: Path) -> None:
    hf5, release = make_ckpt("hf5"), make_ckpt("release", spelling="deepseek")
    m1 = build_engine(hf5.path, tmp_path / "e1", progress=False)
    m2 = build_engine(release.path, tmp_path / "e2", progress=False)
    assert (m1.dtype, m2.dtype) == ("float32", "bfloat16")  # auto follows dtype / torch_dtype
    assert m1.model.rope.rope_type == "default"
    assert m2.model.rope.rope_type == "yarn" and m2.model.rope.factor == 4.0
    e1, e2 = _engine(tmp_path / "e1"), _engine(tmp_path / "e2")
    assert all(torch.equal(e1[n].to(e2[n].dtype), e2[n]) for n in e1)


def test_q_lora_rank_none(make_ckpt, tmp_path: Path) -> None:
    ck = make_ckpt(q_lora_rank=None, num_mtp=1)
    m = build_engine(ck.path, tmp_path / "engine", progress=False)
    assert m.model.q_lora_rank is None
    engine = _engine(tmp_path / "engine")
    assert engine["model.layers.3.self_attn.q_proj.weight"].shape == (96, 64)
    assert "model.layers.0.self_attn.q_a_proj.weight" not in engine


def test_fp8_round_trip(make_ckpt, tmp_path: Path) -> None:
    ck = make_ckpt(num_mtp=1, fp8=True, sharded=True)
    m32 = build_engine(ck.path, tmp_path / "e32", dtype="float32", progress=False)
    auto = build_engine(ck.path, tmp_path / "auto", progress=False)
    assert m32.source.format == auto.source.format == "safetensors-fp8"
    assert auto.dtype == "bfloat16"
    e32, ebf = _engine(tmp_path / "e32"), _engine(tmp_path / "auto")
    checked = 0
    for name, ref in ck.dequantized.items():  # HF name → exact dequantized value
        if "embed_tokens" in name or "shared_head.head" in name:
            continue  # dropped in the engine
        assert torch.equal(e32[name], ref), name
        assert torch.equal(ebf[name], ref.to(torch.bfloat16)), name
        orig = ck.tensors[name]
        scale = ref.abs().max() / 448  # one 128x128 block covers each tiny weight
        assert ((ref - orig).abs() <= orig.abs() * 2**-4 + scale * 2**-9).all(), name
        checked += 1
    assert checked > 20
    assert any(".mlp.experts." in name for name in ck.dequantized)  # the experts among them
    # Unquantized tensors pass through.
    for name in ("model.layers.3.eh_proj.weight", "model.layers.1.mlp.gate.weight", "lm_head.weight"):
        assert torch.equal(e32[name], ck.tensors[name])


# Speculative info ---------------------------------------------------------------------------------------
def test_yaml_mtp_k3_on_a_one_module_checkpoint(make_ckpt, write_yaml, tmp_path: Path) -> None:
    ck = make_ckpt(num_mtp=1)
    m = build_engine(ck.path, tmp_path / "engine", extra_llm_api_options=write_yaml(MTP_YAML_K3), progress=False)
    assert m.speculative.model_dump() == {"method": "mtp", "num_mtp_modules": 1, "max_draft_len": 3,
                                          "use_mtp_vanilla": False, "num_medusa_heads": 0, "medusa_num_layers": 0}
    assert m.build_options.extra_llm_api_options == {
        "max_num_tokens": 4096,
        "speculative_config": {"decoding_type": "MTP", "num_nextn_predict_layers": 3},
    }


def test_two_module_checkpoint_defaults_to_vanilla(make_ckpt, tmp_path: Path) -> None:
    ck = make_ckpt(num_mtp=2, sharded=True)
    m = build_engine(ck.path, tmp_path / "engine", progress=False)
    assert m.speculative.model_dump() == {"method": "mtp", "num_mtp_modules": 2, "max_draft_len": 2,
                                          "use_mtp_vanilla": True, "num_medusa_heads": 0, "medusa_num_layers": 0}
    assert "model.layers.4.eh_proj.weight" in _engine(tmp_path / "engine")


def test_vanilla_needs_k_modules(make_ckpt, write_yaml, tmp_path: Path) -> None:
    ck = make_ckpt(num_mtp=1)
    yaml = write_yaml(MTP_YAML_K3 + "  use_mtp_vanilla: true\n")
    with pytest.raises(EngineError, match="num_nextn_predict_layers=3 needs 3 MTP modules but checkpoint .* has 1"):
        build_engine(ck.path, tmp_path / "engine", extra_llm_api_options=yaml, progress=False)
    assert not (tmp_path / "engine").exists()


def test_speculative_config_null_means_none(make_ckpt, write_yaml, tmp_path: Path) -> None:
    ck = make_ckpt(num_mtp=1)
    m = build_engine(ck.path, tmp_path / "engine", extra_llm_api_options=write_yaml("speculative_config: null\n"),
                     progress=False)
    assert m.speculative.model_dump() == {"method": "none", "num_mtp_modules": 1, "max_draft_len": 0,
                                          "use_mtp_vanilla": False, "num_medusa_heads": 0, "medusa_num_layers": 0}


def test_checkpoint_without_mtp(make_ckpt, write_yaml, tmp_path: Path) -> None:
    ck = make_ckpt(num_mtp=0)
    m = build_engine(ck.path, tmp_path / "engine", progress=False)
    assert m.speculative.method == "none" and m.speculative.num_mtp_modules == 0
    assert not any(n.startswith("model.layers.3.") for n in _engine(tmp_path / "engine"))
    with pytest.raises(EngineError, match="asks for decoding_type MTP but checkpoint .* has no MTP layers"):
        build_engine(ck.path, tmp_path / "other", extra_llm_api_options=write_yaml(MTP_YAML_K3), progress=False)


def test_declared_but_absent_mtp_layers(make_ckpt, write_yaml, tmp_path: Path) -> None:
    # What save_pretrained writes: num_nextn_predict_layers 1 in config.json, no layer-3 tensors.
    ck = make_ckpt(num_mtp=0, config_update={"num_nextn_predict_layers": 1})
    with pytest.raises(EngineError, match=r"declares num_nextn_predict_layers=1 but .* no tensors for MTP layer"):
        build_engine(ck.path, tmp_path / "engine", progress=False)
    m = build_engine(ck.path, tmp_path / "engine", extra_llm_api_options=write_yaml("speculative_config: null\n"),
                     progress=False)
    assert m.model.num_nextn_predict_layers == 0 and m.speculative.method == "none"


def test_invalid_yaml_names_the_key(make_ckpt, write_yaml, tmp_path: Path) -> None:
    ck = make_ckpt()
    with pytest.raises(LlmArgsError, match=r"unknown key 'speculative_config\..*num_draft'"):
        build_engine(ck.path, tmp_path / "engine", progress=False,
                     extra_llm_api_options=write_yaml("speculative_config: {decoding_type: MTP, num_draft: 2}\n"))
    with pytest.raises(LlmArgsError, match="does not exist"):
        build_engine(ck.path, tmp_path / "engine", extra_llm_api_options=tmp_path / "nope.yaml", progress=False)


# Errors naming the tensor / file ------------------------------------------------------------------------
def test_missing_tensor_is_named(make_ckpt, tmp_path: Path) -> None:
    ck = make_ckpt(drop=("model.layers.1.mlp.experts.3.up_proj.weight",))
    with pytest.raises(WeightError, match=r"missing tensor 'model.layers.1.mlp.experts.3.up_proj.weight' "
                                          r"\(expected shape \[32, 64\]\)"):
        build_engine(ck.path, tmp_path / "engine", progress=False)
    assert not (tmp_path / "engine").exists()
    assert [p.name for p in tmp_path.iterdir()] == ["ckpt"]  # no staging directory left behind


def test_wrong_shape_is_named(make_ckpt, tmp_path: Path) -> None:
    ck = make_ckpt(replace={"model.layers.2.self_attn.kv_b_proj.weight": torch.zeros(128, 31)})
    with pytest.raises(WeightError, match=r"'model.layers.2.self_attn.kv_b_proj.weight' has shape \[128, 31\], "
                                          r"expected \[128, 32\]"):
        build_engine(ck.path, tmp_path / "engine", progress=False)


def test_truncated_shard_is_named(make_ckpt, tmp_path: Path) -> None:
    ck = make_ckpt(sharded=True)
    shard = ck.path / "model-00001-of-00002.safetensors"
    with shard.open("r+b") as f:
        f.truncate(shard.stat().st_size - 100)
    with pytest.raises(CheckpointError, match="model-00001-of-00002.safetensors"):
        build_engine(ck.path, tmp_path / "engine", progress=False)


def test_unsupported_architecture(make_ckpt, tmp_path: Path) -> None:
    ck = make_ckpt(config_update={"architectures": ["FalconForCausalLM"], "model_type": "falcon"})
    with pytest.raises(ConfigError, match="unsupported architecture 'FalconForCausalLM'"):
        build_engine(ck.path, tmp_path / "engine", progress=False)


def test_max_seq_len_above_max_position_embeddings(make_ckpt, tmp_path: Path) -> None:
    ck = make_ckpt()
    with pytest.raises(EngineError, match="max_seq_len 8192 exceeds the model's max_position_embeddings 4096"):
        build_engine(ck.path, tmp_path / "engine", max_seq_len=8192, progress=False)


def test_bad_options(make_ckpt, tmp_path: Path) -> None:
    ck = make_ckpt()
    with pytest.raises(EngineError, match="unknown dtype 'int8'"):
        build_engine(ck.path, tmp_path / "engine", dtype="int8", progress=False)
    with pytest.raises(EngineError, match="must be positive"):
        build_engine(ck.path, tmp_path / "engine", max_batch_size=0, progress=False)


# Output directory safety --------------------------------------------------------------------------------
def test_refuses_a_non_engine_output_dir(make_ckpt, tmp_path: Path) -> None:
    ck = make_ckpt()
    out = tmp_path / "important"
    out.mkdir()
    (out / "notes.txt").write_text("do not delete")
    (out / "model.safetensors").write_bytes(b"precious")
    before = _snapshot(out)
    with pytest.raises(EngineError, match="is not empty and is not an nextn engine"):
        build_engine(ck.path, out, progress=False)
    assert _snapshot(out) == before
    with pytest.raises(EngineError, match="contains the checkpoint"):
        build_engine(ck.path, ck.path, progress=False)
    with pytest.raises(EngineError, match="contains the checkpoint"):
        build_engine(ck.path, tmp_path, progress=False)


def test_empty_existing_dir_is_used(make_ckpt, tmp_path: Path) -> None:
    ck = make_ckpt()
    (tmp_path / "engine").mkdir()
    build_engine(ck.path, tmp_path / "engine", progress=False)
    assert (tmp_path / "engine" / "manifest.json").is_file()


def test_rebuild_replaces_an_engine(make_ckpt, tmp_path: Path) -> None:
    ck = make_ckpt()
    out = tmp_path / "nested" / "engine"
    build_engine(ck.path, out, dtype="float32", progress=False)
    m = build_engine(ck.path, out, dtype="bfloat16", progress=False)
    assert EngineManifest.load(out).dtype == m.dtype == "bfloat16"
    assert _engine(out)["lm_head.weight"].dtype == torch.bfloat16
    assert sorted(os.listdir(out.parent)) == ["engine"]  # no staging or backup left


def test_failed_rebuild_keeps_the_old_engine(make_ckpt, tmp_path: Path) -> None:
    good = make_ckpt("good")
    bad = make_ckpt("bad", drop=("model.norm.weight",))
    out = tmp_path / "engine"
    build_engine(good.path, out, progress=False)
    before = _snapshot(out)
    with pytest.raises(WeightError, match="model.norm.weight"):
        build_engine(bad.path, out, progress=False)
    assert _snapshot(out) == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["bad", "engine", "good"]
