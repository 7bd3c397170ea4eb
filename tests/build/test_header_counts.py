"""Counts in a checkpoint's header or config checked against its stored tensors before a build starts (issue 32).

Class 3: a count the file states (`block_count`, `num_nextn_predict_layers`) is bounded by the stored layers before
anything is sized from it. Class 8: every stored tensor is placed in the engine, or the build names the ones it would
drop (`allow_unused_tensors` builds without them). Plus named errors for malformed GGUF metadata, tokenizers that
disagree with the embedding, overlapping tensor data, and tokenizers that would run repository code.
"""

from __future__ import annotations

import ast
import json
import logging
import subprocess
import sys
from pathlib import Path

import gguf
import numpy as np
import pytest

from nextn.build.checkpoint import CheckpointError, CheckpointReader
from nextn.build.engine_builder import build_engine
from nextn.build.gguf_reader import GGUFCheckpoint
from nextn.build.tensor_inventory import check_layer_counts, spans
from nextn.models.config import ConfigError, DeepseekV3ModelConfig
from nextn.models.deepseek_v3.weights import WeightError

GT = gguf.GGUFValueType
H, HEADS, KV_HEADS, FFN, VOCAB = 16, 2, 1, 32, 24
SRC = Path(__file__).resolve().parents[2] / "src" / "nextn"


def tokens(n: int) -> list[str]:
    return ["<unk>", "<s>", "</s>"] + [f"t{i}" for i in range(n - 3)]


def write_gguf(path: Path, *, blocks: object = 2, stored: int = 2, meta: dict | None = None,
               token_list: list | None = None, tokenizer: str = "llama", merges: list[str] | None = None,
               extra: dict[str, tuple[int, ...]] | None = None) -> Path:
    """A tiny float32 Llama GGUF (hidden 16, 2 heads / 1 KV head, ffn 32, vocab 24) storing `stored` blocks.

    blocks: the `llama.block_count` value (UINT32); meta: `key: (value, GGUFValueType)` overrides (value None drops
    the key); token_list: `tokenizer.ggml.tokens` (default 24 strings); extra: more tensors (name: ggml-order-reversed
    numpy shape), replacing same-named ones.
    """
    w = gguf.GGUFWriter(str(path), "llama")
    keys = {"llama.block_count": (blocks, GT.UINT32), "llama.context_length": (64, GT.UINT32),
            "llama.embedding_length": (H, GT.UINT32), "llama.feed_forward_length": (FFN, GT.UINT32),
            "llama.attention.head_count": (HEADS, GT.UINT32), "llama.attention.head_count_kv": (KV_HEADS, GT.UINT32),
            "llama.attention.layer_norm_rms_epsilon": (1e-5, GT.FLOAT32)}
    keys.update(meta or {})
    for key, (value, vtype) in keys.items():
        if value is not None:
            w.add_array(key, value) if vtype == GT.ARRAY else w.add_key_value(key, value, vtype)
    toks = tokens(VOCAB) if token_list is None else token_list
    w.add_tokenizer_model(tokenizer)
    w.add_token_list(toks)
    if tokenizer == "llama":
        w.add_token_scores([0.0] * len(toks))
    if merges is not None:
        w.add_token_merges(merges)
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    d = H // HEADS
    shapes: dict[str, tuple[int, ...]] = {"token_embd.weight": (VOCAB, H), "output_norm.weight": (H,),
                                          "output.weight": (VOCAB, H)}
    for b in range(stored):
        shapes.update({f"blk.{b}.attn_q.weight": (HEADS * d, H), f"blk.{b}.attn_k.weight": (KV_HEADS * d, H),
                       f"blk.{b}.attn_v.weight": (KV_HEADS * d, H), f"blk.{b}.attn_output.weight": (H, HEADS * d),
                       f"blk.{b}.ffn_gate.weight": (FFN, H), f"blk.{b}.ffn_up.weight": (FFN, H),
                       f"blk.{b}.ffn_down.weight": (H, FFN), f"blk.{b}.attn_norm.weight": (H,),
                       f"blk.{b}.ffn_norm.weight": (H,)})
    shapes.update(extra or {})
    rng = np.random.default_rng(0)
    for name, shape in shapes.items():
        w.add_tensor(name, rng.standard_normal(shape).astype(np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def untouched(tmp_path: Path, *keep: str) -> None:
    """Nothing but the inputs under tmp_path: no engine, no staging directory."""
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(keep)


def test_the_tiny_gguf_builds(tmp_path: Path) -> None:
    manifest = build_engine(write_gguf(tmp_path / "m.gguf"), tmp_path / "engine", progress=False)
    assert manifest.model.num_hidden_layers == 2 and manifest.model.vocab_size == VOCAB


# Class 3: counts bounded by the stored tensors before anything is sized from them -------------------------------
@pytest.mark.parametrize("blocks, match", [
    (2**32 - 1, r"'llama.block_count' is 4294967295; a count or size must lie in \[1, 2147483647\]"),
    (1000, r"llama.block_count is 1000 but the checkpoint stores layers 0-1 \(2 in all\)"),
])
def test_a_gguf_block_count_beyond_the_stored_blocks_is_refused_on_opening(tmp_path: Path, blocks, match) -> None:
    path = write_gguf(tmp_path / "m.gguf", blocks=blocks)
    with pytest.raises((CheckpointError, ConfigError), match=match):
        GGUFCheckpoint(path).model_config
    with pytest.raises((CheckpointError, ConfigError), match=match):
        build_engine(path, tmp_path / "engine", progress=False)
    untouched(tmp_path, "m.gguf")


def test_an_hf_mtp_count_of_a_billion_is_refused_before_any_list_is_made(make_ckpt, tmp_path: Path) -> None:
    ck = make_ckpt(num_mtp=1, config_update={"num_nextn_predict_layers": 10**9})
    with pytest.raises(ConfigError, match=r"num_nextn_predict_layers\n.*less than or equal to 1024"):
        CheckpointReader(ck.path).model_config
    with pytest.raises(ConfigError, match="num_nextn_predict_layers"):
        build_engine(ck.path, tmp_path / "engine", progress=False)
    untouched(tmp_path, "ckpt")


def test_more_mtp_layers_than_stored_are_refused_naming_the_missing_ones(make_ckpt) -> None:
    ck = make_ckpt(num_mtp=1, config_update={"num_nextn_predict_layers": 3})
    with pytest.raises(ConfigError, match=r"num_nextn_predict_layers is 3 .* MTP layer\(s\) 4-5 after the 3 main"):
        CheckpointReader(ck.path).model_config


def test_more_main_layers_than_stored_are_refused(make_ckpt) -> None:
    ck = make_ckpt(num_mtp=0, config_update={"num_hidden_layers": 40})
    with pytest.raises(ConfigError, match=r"num_hidden_layers is 40 but the checkpoint stores layers 0-2 \(3 in all\)"):
        CheckpointReader(ck.path).model_config


def test_a_missing_middle_layer_is_named() -> None:
    names = [f"model.layers.{i}.input_layernorm.weight" for i in (0, 1, 3)]
    with pytest.raises(ConfigError, match=r"layer\(s\) 2 have no tensors \(the checkpoint stores layers 0-1, 3\)"):
        check_layer_counts(3, 0, names, "num_hidden_layers")
    assert spans([0, 1, 2, 5, 7, 8, 999999999]) == "0-2, 5, 7-8, 999999999"


# Class 8: every stored tensor placed, or named ------------------------------------------------------------------
def test_a_gguf_declaring_3_of_5_stored_blocks_is_refused_naming_the_dropped_layers(tmp_path: Path) -> None:
    path = write_gguf(tmp_path / "m.gguf", blocks=3, stored=5)
    with pytest.raises(WeightError, match=r"stores 18 tensor\(s\) the engine would not read \(layer\(s\) 3-4 lie "
                                          r"beyond num_hidden_layers=3 .*'model.layers.3.self_attn.q_proj.weight'"):
        build_engine(path, tmp_path / "engine", progress=False)
    untouched(tmp_path, "m.gguf")


def test_allow_unused_tensors_builds_without_them_and_says_so(tmp_path: Path, caplog) -> None:
    path = write_gguf(tmp_path / "m.gguf", blocks=3, stored=5)
    with caplog.at_level(logging.WARNING):
        manifest = build_engine(path, tmp_path / "engine", progress=False, allow_unused_tensors=True)
    assert manifest.model.num_hidden_layers == 3
    assert "18 tensor(s) the engine would not read" in caplog.text


def test_a_stray_block_far_beyond_the_count_is_named(tmp_path: Path) -> None:
    path = write_gguf(tmp_path / "m.gguf", extra={"blk.999999999.attn_q.weight": (H, H)})
    with pytest.raises(WeightError, match=r"layer\(s\) 999999999 lie beyond .*'model.layers.999999999.self_attn"):
        build_engine(path, tmp_path / "engine", progress=False)
    untouched(tmp_path, "m.gguf")


def test_a_boolean_block_count_is_refused(tmp_path: Path) -> None:
    path = write_gguf(tmp_path / "m.gguf", meta={"llama.block_count": (True, GT.BOOL)})
    with pytest.raises(CheckpointError, match=r"'llama.block_count' is BOOL \(True\), not an integer"):
        GGUFCheckpoint(path)


def test_an_hf_config_of_fewer_layers_than_stored_is_refused(make_ckpt, tmp_path: Path) -> None:
    ck = make_ckpt(num_mtp=0, config_update={"num_hidden_layers": 2})
    with pytest.raises(WeightError, match=r"layer\(s\) 2 lie beyond num_hidden_layers=2"):
        build_engine(ck.path, tmp_path / "engine", progress=False)
    untouched(tmp_path, "ckpt")


def test_mtp_layers_a_config_leaves_out_need_the_explicit_option(make_ckpt, tmp_path: Path) -> None:
    """DeepSeek MTP weights under `num_nextn_predict_layers: 0` (a config edited to skip MTP)."""
    ck = make_ckpt(num_mtp=1, config_update={"num_nextn_predict_layers": 0})
    with pytest.raises(WeightError, match=r"layer\(s\) 3 lie beyond .*--allow_unused_tensors"):
        build_engine(ck.path, tmp_path / "engine", progress=False)
    manifest = build_engine(ck.path, tmp_path / "engine", progress=False, allow_unused_tensors=True)
    assert manifest.model.num_nextn_predict_layers == 0 and manifest.speculative.method == "none"


def test_mtp_builds_read_every_tensor_but_the_embedding_and_head_copies(make_ckpt, tmp_path: Path) -> None:
    """The legitimate drops stay silent: an MTP layer's embed_tokens / shared_head.head copies."""
    ck = make_ckpt(num_mtp=1)
    assert {"model.layers.3.embed_tokens.weight", "model.layers.3.shared_head.head.weight"} <= set(ck.tensors)
    manifest = build_engine(ck.path, tmp_path / "engine", progress=False)
    assert manifest.speculative.method == "mtp" and manifest.model.num_nextn_predict_layers == 1


# Named errors for malformed GGUF metadata and tensors -----------------------------------------------------------
@pytest.mark.parametrize("meta, match", [
    ({"llama.context_length": ("abc", GT.STRING)}, r"'llama.context_length' is STRING \('abc'\), not an integer"),
    ({"llama.block_count": ([2, 2], GT.ARRAY)}, r"'llama.block_count' is an array \(\[2, 2\]\), not an integer"),
    ({"llama.attention.head_count": (0, GT.UINT32)}, r"'llama.attention.head_count' is 0; a count or size must"),
    ({"llama.attention.layer_norm_rms_epsilon": ("x", GT.STRING)}, r"layer_norm_rms_epsilon' is STRING .* a number"),
    ({"general.architecture": ([1], GT.ARRAY)}, r"'general.architecture' is an array"),
])
def test_malformed_gguf_metadata_is_a_named_error(tmp_path: Path, meta, match) -> None:
    path = write_gguf(tmp_path / "m.gguf", meta=meta)
    with pytest.raises(CheckpointError, match=match):
        GGUFCheckpoint(path)


def test_a_one_dimensional_embedding_is_a_named_error(tmp_path: Path) -> None:
    path = write_gguf(tmp_path / "m.gguf", extra={"token_embd.weight": (VOCAB * H,)})
    with pytest.raises(CheckpointError, match=r"'token_embd.weight' has shape \[384\] .* an embedding is 2-D"):
        GGUFCheckpoint(path)


def test_gguf_shapes_are_checked_from_the_header_before_any_data(tmp_path: Path) -> None:
    path = write_gguf(tmp_path / "m.gguf", extra={"blk.1.ffn_up.weight": (FFN + 1, H)})
    with pytest.raises(WeightError, match=r"'model.layers.1.mlp.up_proj.weight' has shape \[33, 16\], expected "
                                          r"\[32, 16\] \(from the config's intermediate_size=32\)"):
        build_engine(path, tmp_path / "engine", progress=False)
    untouched(tmp_path, "m.gguf")


def test_overlapping_tensor_data_is_refused(tmp_path: Path) -> None:
    path = write_gguf(tmp_path / "m.gguf")
    data = bytearray(path.read_bytes())
    name = b"output_norm.weight"  # tensor info: u64 length, name, u32 n_dims, u64 dims, u32 type, u64 offset
    at = data.index(len(name).to_bytes(8, "little") + name) + 8 + len(name)
    n_dims = int.from_bytes(data[at:at + 4], "little")
    offset_at = at + 4 + 8 * n_dims + 4
    data[offset_at:offset_at + 8] = (0).to_bytes(8, "little")  # token_embd.weight's bytes
    path.write_bytes(bytes(data))
    with pytest.raises(CheckpointError, match=r"tensors .* overlap in the file"):
        GGUFCheckpoint(path)


def test_n_group_zero_is_a_named_config_error() -> None:
    hf = {"architectures": ["DeepseekV3ForCausalLM"], "vocab_size": 64, "hidden_size": 16, "intermediate_size": 32,
          "num_hidden_layers": 1, "num_attention_heads": 2, "kv_lora_rank": 8, "qk_nope_head_dim": 4,
          "qk_rope_head_dim": 4, "v_head_dim": 4, "n_routed_experts": 4}
    for field, value in (("n_group", 0), ("moe_layer_freq", 0), ("num_hidden_layers", True), ("n_group", "2"),
                         ("num_nextn_predict_layers", "abc"), ("num_nextn_predict_layers", 1.5)):
        with pytest.raises(ConfigError, match=field):
            DeepseekV3ModelConfig.from_hf({**hf, field: value})


# Tokenizer metadata ----------------------------------------------------------------------------------------------
@pytest.mark.parametrize("kwargs, match", [
    ({"token_list": tokens(100)}, r"lists 100 tokens but token_embd.weight has 24 rows; .*ids past the embedding"),
    ({"token_list": tokens(10)}, r"lists 10 tokens but token_embd.weight has 24 rows; .*rows no token can reach"),
    ({"token_list": list(range(VOCAB))}, r"'tokenizer.ggml.tokens' is ARRAY/INT32, not an array of strings"),
    ({"token_list": ["a"] * VOCAB}, r"lists 'a' twice \(ids 0 and 1\)"),
    ({"tokenizer": "gpt2"}, r"a gpt2 \(byte-level BPE\) tokenizer needs tokenizer.ggml.merges"),
])
def test_a_tokenizer_that_disagrees_with_the_model_is_refused_before_the_build(tmp_path: Path, kwargs, match) -> None:
    path = write_gguf(tmp_path / "m.gguf", **kwargs)
    with pytest.raises(CheckpointError, match=match):
        build_engine(path, tmp_path / "engine", progress=False)
    untouched(tmp_path, "m.gguf")


def test_an_hf_tokenizer_with_ids_past_the_embedding_is_refused(make_ckpt, tmp_path: Path) -> None:
    ck = make_ckpt(num_mtp=0, tokenizer=True)
    vocab = {f"t{i}": i for i in range(300)}  # the model has 256 rows
    (ck.path / "tokenizer.json").write_text(json.dumps({"version": "1.0", "model": {"type": "WordLevel",
                                                                                     "vocab": vocab}}))
    with pytest.raises(CheckpointError, match=r"token ids up to 299 but the model's embedding has 256 rows"):
        build_engine(ck.path, tmp_path / "engine", progress=False)
    untouched(tmp_path, "ckpt")


def test_a_padded_hf_vocabulary_builds(make_ckpt, tmp_path: Path) -> None:
    """Fewer token ids than embedding rows is how released models pad their vocabularies (Qwen2.5)."""
    ck = make_ckpt(num_mtp=0, tokenizer=True)  # 1 token for 256 rows
    assert build_engine(ck.path, tmp_path / "engine", progress=False).tokenizer_files


# Remote code: never asked, never run -------------------------------------------------------------------------------
def test_a_tokenizer_asking_for_remote_code_is_refused_without_reading_stdin(tmp_path: Path) -> None:
    """`auto_map` in tokenizer_config.json: transformers' default asks "Do you wish to run the custom code? [y/N]" on
    stdin. Here stdin answers "y" and the load must neither ask nor run the file's code: a named error instead."""
    d = tmp_path / "tok"
    d.mkdir()
    (d / "tokenizer.json").write_text(json.dumps({"version": "1.0", "model": {"type": "WordLevel",
                                                                              "vocab": {"<unk>": 0}}}))
    (d / "tokenizer_config.json").write_text(json.dumps({"tokenizer_class": "EvilTokenizer",
                                                         "auto_map": {"AutoTokenizer": ["evil.EvilTokenizer", None]}}))
    ran = tmp_path / "ran"
    (d / "evil.py").write_text(f"open({str(ran)!r}, 'w').close()\n"
                               "from transformers import PreTrainedTokenizerFast as EvilTokenizer\n")
    code = ("import sys; from pathlib import Path; from nextn.runtime.tokenizer import EngineTokenizer\n"
            "try:\n    EngineTokenizer.load(Path(sys.argv[1]), ['tokenizer.json'])\n"
            "except ValueError as e:\n    print('REFUSED', e)\n")
    out = subprocess.run([sys.executable, "-c", code, str(d)], input="y\ny\n", capture_output=True, text=True,
                         timeout=120)
    assert "Do you wish" not in out.stdout + out.stderr
    assert "REFUSED" in out.stdout and "trust_remote_code" in out.stdout, out.stdout + out.stderr
    assert not ran.exists()


AUTO_CLASSES = ("AutoTokenizer", "AutoConfig", "AutoModel", "AutoModelForCausalLM")


def test_every_auto_class_load_refuses_remote_code() -> None:
    """Every `Auto*.from_pretrained` in nextn passes `trust_remote_code=False` (None would prompt on stdin)."""
    missing = []
    for path in sorted(SRC.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
                    and node.func.attr == "from_pretrained" and isinstance(node.func.value, ast.Name)
                    and node.func.value.id in AUTO_CLASSES):
                flag = {k.arg: k.value for k in node.keywords}.get("trust_remote_code")
                if not (isinstance(flag, ast.Constant) and flag.value is False):
                    missing.append(f"{path.relative_to(SRC)}:{node.lineno}")
    assert not missing, f"from_pretrained without trust_remote_code=False: {missing}"


def test_build_engine_cli_names_unread_tensors_and_takes_the_option(tmp_path: Path, capsys) -> None:
    from nextn.cli.build_engine import main

    path = write_gguf(tmp_path / "m.gguf", blocks=3, stored=5)
    argv = ["--model_dir", str(path), "--output_dir", str(tmp_path / "engine"), "--no-progress"]
    with pytest.raises(SystemExit) as e:
        main(argv)
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert "error: the checkpoint stores 18 tensor(s) the engine would not read" in err and "Traceback" not in err
    assert main([*argv, "--allow_unused_tensors"]) == 0


def test_a_gguf_chat_template_past_the_budget_is_refused_before_any_weight_is_read(tmp_path: Path, monkeypatch) -> None:
    """build-engine renders a GGUF's template (code from the file) under the render budget before any tensor is read
    or anything is written: the weights are never dequantized for a model whose template cannot be used."""
    from nextn.runtime.template_render import ChatTemplateLimitError

    path = write_gguf(tmp_path / "m.gguf", meta={"tokenizer.chat_template": ("{{ 'x' * (2*10**9) }}", GT.STRING)})
    reads = []
    monkeypatch.setattr(GGUFCheckpoint, "get", lambda self, name: reads.append(name))
    with pytest.raises(ChatTemplateLimitError, match=r"m\.gguf \(tokenizer\.chat_template\)"):
        build_engine(path, tmp_path / "engine", progress=False)
    assert reads == []
    untouched(tmp_path, "m.gguf")
