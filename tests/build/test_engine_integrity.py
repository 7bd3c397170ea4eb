"""Engine integrity (issue 12, items 5 and 8): checksums written at build and verified at load, manifest paths
inside the engine, and a named error for every malformed manifest, corrupt or missing file."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import pytest

from nextn.build.engine_builder import build_engine
from nextn.build.manifest import MANIFEST_NAME, EngineError, EngineManifest, verify_engine_files
from nextn.config.llm_args import LlmArgsError


@pytest.fixture
def engine(make_ckpt, tmp_path: Path) -> Path:
    ck = make_ckpt(tokenizer=True)
    out = tmp_path / "engine"
    build_engine(ck.path, out, progress=False)
    return out


def _edit_manifest(engine: Path, **changes) -> None:
    data = json.loads((engine / MANIFEST_NAME).read_text())
    data.update(changes)
    (engine / MANIFEST_NAME).write_text(json.dumps(data))


def _flip_bit(path: Path, offset_from_end: int = 1000) -> None:
    data = bytearray(path.read_bytes())
    data[-offset_from_end] ^= 0x01
    path.write_bytes(bytes(data))


def test_every_file_has_its_size_and_sha256(engine: Path) -> None:
    m = EngineManifest.load(engine)
    assert set(m.checksums) == {"model.safetensors", *m.tokenizer_files, *m.aux_files}
    for name, c in m.checksums.items():
        data = (engine / name).read_bytes()
        assert (c.num_bytes, c.sha256) == (len(data), hashlib.sha256(data).hexdigest())
    verify_engine_files(engine, m, "full")


def test_a_flipped_bit_is_a_named_error(engine: Path) -> None:
    _flip_bit(engine / "model.safetensors")
    m = EngineManifest.load(engine)
    with pytest.raises(EngineError, match=r"model.safetensors is corrupt: bytes 0–\d+ have SHA-256 .* rebuild"):
        verify_engine_files(engine, m, "full")
    verify_engine_files(engine, m, "size")  # the documented limit of the fast mode


def test_a_truncated_or_extended_file_is_a_named_error(engine: Path) -> None:
    m = EngineManifest.load(engine)
    w = engine / "model.safetensors"
    data = w.read_bytes()
    w.write_bytes(data[:-4096])
    with pytest.raises(EngineError, match=r"model.safetensors is \d+ bytes, the manifest records \d+"):
        verify_engine_files(engine, m, "size")
    w.write_bytes(data + b"\0" * 8)
    with pytest.raises(EngineError, match="truncated or replaced"):
        verify_engine_files(engine, m, "size")


def test_a_corrupt_tokenizer_file_is_a_named_error(engine: Path) -> None:
    (engine / "tokenizer.json").write_text('{"version": "1.0", "model": {"type": "WordLevel", "vocab": {"<unk>": 1}}}\n')
    with pytest.raises(EngineError, match="tokenizer.json"):
        verify_engine_files(engine, EngineManifest.load(engine), "full")


def test_a_missing_listed_file_is_a_named_error(engine: Path) -> None:
    (engine / "tokenizer_config.json").unlink()
    with pytest.raises(EngineError, match=r"tokenizer_config.json listed in manifest.json is missing"):
        verify_engine_files(engine, EngineManifest.load(engine), "off" if False else "size")


def test_llm_refuses_a_corrupt_engine_and_loads_a_good_one(make_ckpt, tmp_path: Path) -> None:
    from nextn.runtime.llm import LLM

    engine = tmp_path / "plain_engine"
    build_engine(make_ckpt("plain").path, engine, progress=False)  # no tokenizer: token-id prompts

    out = LLM(str(engine), device="cpu").generate([[1, 2, 3]])
    assert out[0].outputs[0].token_ids
    _flip_bit(engine / "model.safetensors", 5000)
    with pytest.raises(EngineError, match="is corrupt"):
        LLM(str(engine), device="cpu")
    assert LLM(str(engine), device="cpu", verify_weights="size").generate([[1, 2, 3]])  # size: a flipped bit loads
    with pytest.raises(LlmArgsError, match="verify_weights"):
        LLM(str(engine), device="cpu", verify_weights="sometimes")


def test_an_engine_built_before_checksums_loads_with_a_warning_and_a_bad_tokenizer_is_named(
        engine: Path, caplog: pytest.LogCaptureFixture) -> None:
    from nextn.runtime.llm import LLM

    _edit_manifest(engine, checksums={})
    (engine / "tokenizer.json").write_text("{ this is not json")
    with pytest.raises(EngineError, match=r"tokenizer files .* cannot be loaded"):
        LLM(str(engine), device="cpu")
    assert "built before engine checksums existed" in caplog.text


# Manifest paths ------------------------------------------------------------------------------------------
@pytest.mark.parametrize("field,value", [
    ("weight_files", ["../../etc/passwd"]),
    ("weight_files", ["/etc/passwd"]),
    ("tokenizer_files", ["sub/../../x.json"]),
    ("weight_files", []),
])
def test_manifest_paths_stay_inside_the_engine(engine: Path, field: str, value: list[str]) -> None:
    _edit_manifest(engine, **{field: value, "checksums": {}})
    with pytest.raises(EngineError, match=r"manifest.json is malformed: .*(relative path inside|at least 1 item)"):
        EngineManifest.load(engine)


# Malformed manifests --------------------------------------------------------------------------------------
@pytest.mark.parametrize("text,message", [
    ("[]", "holds a JSON list, not an object"),
    ('"engine"', "holds a JSON str, not an object"),
    ("{}", "has no schema_version: it was not written by build-engine"),
    ('{"schema_version": "1"}', "schema_version '1' of type str; build-engine writes the integer 1"),
    ('{"schema_version": true}', "schema_version True of type bool"),
    ('{"schema_version": 1.0}', "schema_version 1.0 of type float"),
    ('{"schema_version": 7}', "has schema_version 7, this nextn reads only 1"),
    ('{"schema_version": NaN}', "NaN is not a JSON number"),
    ("[" * 100000 + "]" * 100000, "not valid JSON"),
])
def test_malformed_manifests_are_named_errors(tmp_path: Path, text: str, message: str) -> None:
    (tmp_path / MANIFEST_NAME).write_text(text)
    with pytest.raises(EngineError) as e:
        EngineManifest.load(tmp_path)
    assert message in str(e.value)
    assert "reads 1" not in str(e.value) or "schema_version 7" in str(e.value)  # never "has 1, reads 1"


def test_non_utf8_and_non_file_manifests(tmp_path: Path) -> None:
    (tmp_path / MANIFEST_NAME).write_bytes(b'{"schema_version": 1, "x": "\xff\xfe"}')
    with pytest.raises(EngineError, match="is not UTF-8 text"):
        EngineManifest.load(tmp_path)
    d = tmp_path / "d"
    (d / MANIFEST_NAME).mkdir(parents=True)
    with pytest.raises(EngineError, match="is not a regular file"):
        EngineManifest.load(d)


@pytest.mark.parametrize("speculative,message", [
    ({"method": "mtp", "num_mtp_modules": 0, "max_draft_len": 1}, "MTP needs at least one module"),
    ({"method": "mtp", "num_mtp_modules": 3, "max_draft_len": 3, "use_mtp_vanilla": True},
     "num_mtp_modules=3 but the model stores num_nextn_predict_layers=1"),
    ({"method": "mtp", "num_mtp_modules": 1, "max_draft_len": 2, "use_mtp_vanilla": True},
     "max_draft_len=2 exceeds num_mtp_modules=1"),
    ({"method": "medusa", "num_medusa_heads": 0, "max_draft_len": 2}, "is not in [1, num_medusa_heads=0]"),
])
def test_speculative_sections_that_contradict_the_weights(engine: Path, speculative: dict, message: str) -> None:
    _edit_manifest(engine, speculative=speculative)
    with pytest.raises(EngineError, match="malformed") as e:
        EngineManifest.load(engine)
    assert message in str(e.value)


def test_non_finite_config_values_in_a_manifest_are_refused(engine: Path) -> None:
    data = json.loads((engine / MANIFEST_NAME).read_text())
    data["model"]["rms_norm_eps"] = float("nan")
    (engine / MANIFEST_NAME).write_text(json.dumps(data))  # json.dumps writes NaN: invalid JSON
    with pytest.raises(EngineError, match="NaN is not a JSON number"):
        EngineManifest.load(engine)
    data["model"]["rms_norm_eps"] = 1e999
    (engine / MANIFEST_NAME).write_text(json.dumps(data).replace("Infinity", "1e999"))
    with pytest.raises(EngineError, match="malformed: .*rms_norm_eps"):
        EngineManifest.load(engine)


def test_chunk_digests_match_slices_and_name_the_corrupt_range(tmp_path: Path) -> None:
    import os

    from nextn.build.manifest import StreamHasher, _verify_digest

    data = os.urandom(10_000)
    hasher = StreamHasher(chunk_bytes=4096)
    for piece in (data[:1], data[1:5000], data[5000:8192], data[8192:]):  # boundaries anywhere
        hasher.update(piece)
    c = hasher.checksum()
    assert c.sha256 == hashlib.sha256(data).hexdigest() and c.num_bytes == 10_000
    assert c.chunk_sha256 == [hashlib.sha256(data[i:i + 4096]).hexdigest() for i in range(0, 10_000, 4096)]
    f = tmp_path / "w.bin"
    f.write_bytes(data)
    _verify_digest(f, c, "fix")
    flipped = bytearray(data)
    flipped[9000] ^= 0x80
    f.write_bytes(bytes(flipped))
    with pytest.raises(EngineError, match="bytes 8192–10000 have SHA-256"):
        _verify_digest(f, c, "fix")


def test_a_max_seq_len_beyond_the_model_is_a_malformed_manifest(engine: Path) -> None:
    data = json.loads((engine / MANIFEST_NAME).read_text())
    data["build_options"]["max_seq_len"] = 10**9  # would make the runtime allocate a giant KV cache
    (engine / MANIFEST_NAME).write_text(json.dumps(data))
    with pytest.raises(EngineError, match="build_options.max_seq_len=1000000000 exceeds the model's "
                                          "max_position_embeddings=4096"):
        EngineManifest.load(engine)
