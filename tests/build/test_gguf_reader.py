"""`GGUFCheckpoint`: config, HF-named tensors (llama.cpp's q/k permutation undone), tokenizer, and clear errors."""

from __future__ import annotations

from pathlib import Path

import gguf
import numpy as np
import pytest
import torch

from nextn.build.checkpoint import CheckpointError
from nextn.build.gguf_reader import GGUFCheckpoint, hf_name
from nextn.models.llama import LlamaModelConfig, to_runtime
from nextn.models.llama.weights import WeightError

STORIES = Path(__file__).resolve().parents[2].parent / "shared" / "data" / "models" / "stories260K"
GGUF_FILE = STORIES / "stories260K.gguf"


@pytest.fixture(scope="module")
def stories() -> GGUFCheckpoint:
    if not GGUF_FILE.is_file():
        pytest.skip(f"stories260K GGUF is absent ({GGUF_FILE}): ../shared/data is not checked out")
    return GGUFCheckpoint(GGUF_FILE)


def permute(w: np.ndarray, heads: int) -> np.ndarray:
    """llama.cpp convert_hf_to_gguf.py `LlamaModel.permute`: HF rotate-half rows → ggml interleaved rows."""
    return w.reshape(heads, 2, w.shape[0] // heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


TOKENS = ["<unk>", "<s>", "</s>", "<0x0A>", "▁a", "▁b", "a", "b", "▁"]
TYPES = [2, 3, 3, 6, 1, 1, 1, 1, 1]


def write_tiny_gguf(path: Path, arch: str = "llama", drop: tuple[str, ...] = (), q8: tuple[str, ...] = (),
                    extra: tuple[str, ...] = (), seed: int = 0) -> dict[str, np.ndarray]:
    """A 1-layer GQA Llama GGUF (hidden 64, 4 heads / 2 KV heads, vocab 9) written as llama.cpp would, q/k permuted.

    Returns the HF-layout fp32 tensors by HF name (what `GGUFCheckpoint.get` must give back).
    """
    rng = np.random.default_rng(seed)
    h, heads, kv_heads, d, ffn, v = 64, 4, 2, 16, 96, len(TOKENS)
    hf = {
        "model.embed_tokens.weight": (v, h), "model.norm.weight": (h,), "lm_head.weight": (v, h),
        "model.layers.0.self_attn.q_proj.weight": (heads * d, h), "model.layers.0.self_attn.k_proj.weight": (kv_heads * d, h),
        "model.layers.0.self_attn.v_proj.weight": (kv_heads * d, h), "model.layers.0.self_attn.o_proj.weight": (h, heads * d),
        "model.layers.0.mlp.gate_proj.weight": (ffn, h), "model.layers.0.mlp.up_proj.weight": (ffn, h),
        "model.layers.0.mlp.down_proj.weight": (h, ffn), "model.layers.0.input_layernorm.weight": (h,),
        "model.layers.0.post_attention_layernorm.weight": (h,),
    }  # fmt: skip
    hf = {k: rng.standard_normal(s).astype(np.float32) for k, s in hf.items()}
    w = gguf.GGUFWriter(str(path), arch)
    w.add_block_count(1)
    w.add_context_length(256)
    w.add_embedding_length(h)
    w.add_feed_forward_length(ffn)
    w.add_head_count(heads)
    w.add_head_count_kv(kv_heads)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_rope_freq_base(10000.0)
    w.add_tokenizer_model("llama")
    w.add_token_list(TOKENS)
    w.add_token_scores([0.0] * 4 + [-1.0, -2.0, -3.0, -4.0, -5.0])
    w.add_token_types(TYPES)
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    w.add_pad_token_id(2**32 - 1)
    names = {"token_embd.weight", "output_norm.weight", "output.weight"} | {
        f"blk.0.{n}.weight" for n in ("attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate", "ffn_up", "ffn_down",
                                      "attn_norm", "ffn_norm")}
    for name in sorted(names - set(drop)) + list(extra):
        t = hf.get(hf_name(name), np.zeros((4,), np.float32))
        if name == "blk.0.attn_q.weight":
            t = permute(t, heads)
        elif name == "blk.0.attn_k.weight":
            t = permute(t, kv_heads)
        if name in q8:
            qt = gguf.quantize(t, gguf.GGMLQuantizationType.Q8_0)
            w.add_tensor(name, qt, raw_shape=qt.shape, raw_dtype=gguf.GGMLQuantizationType.Q8_0)
        else:
            w.add_tensor(name, t)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return hf


def test_stories260k_config_and_tensors(stories):
    cfg = stories.hf_config
    assert (cfg["vocab_size"], cfg["hidden_size"], cfg["num_hidden_layers"], cfg["intermediate_size"]) == (512, 64, 5, 172)
    assert (cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg["head_dim"]) == (8, 4, 8)
    assert (cfg["bos_token_id"], cfg["eos_token_id"], cfg["rope_theta"]) == (1, 2, 10000.0)
    assert cfg["max_position_embeddings"] == 2048 and not cfg["tie_word_embeddings"]
    assert abs(cfg["rms_norm_eps"] - 1e-5) < 1e-9
    assert "pad_token_id" not in cfg  # 0xFFFFFFFF means none
    assert len(stories.names()) == 48 and stories.has("model.layers.4.mlp.down_proj.weight")
    t = stories.get("model.layers.0.self_attn.k_proj.weight")
    assert t.dtype == torch.float32 and t.shape == (32, 64)
    with pytest.raises(KeyError):
        stories.get("model.layers.5.mlp.up_proj.weight")


def test_stories260k_tensors_equal_transformers_gguf_loading(stories):
    """The same tensors, bit for bit, as `transformers` loads from the GGUF (q/k un-permuted alike)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    hf_cfg = AutoConfig.from_pretrained(STORIES, gguf_file=GGUF_FILE.name)
    hf_cfg.pad_token_id = None
    ref = AutoModelForCausalLM.from_pretrained(STORIES, gguf_file=GGUF_FILE.name, config=hf_cfg).state_dict()
    assert sorted(ref) == sorted(stories.names())
    for name, t in ref.items():
        assert torch.equal(stories.get(name), t), name


def test_stories260k_tokenizer(stories, tmp_path):
    from transformers import AutoTokenizer

    written = stories.write_tokenizer_files(tmp_path)
    assert "tokenizer.json" in written and "tokenizer_config.json" in written
    tok = AutoTokenizer.from_pretrained(tmp_path)
    text = "Once upon a time, there was a little girl named Lily.\nShe said, \"Hi!\""
    ids = tok.encode(text)
    assert ids[0] == 1 and 13 in ids  # BOS first; the newline is byte token <0x0A> (id 13)
    assert ids[1:4] == [403, 407, 261]  # "Once", " upon", " a": the merges the model itself emits
    assert tok.decode(ids, skip_special_tokens=True) == text


def test_synthetic_gguf_round_trips_hf_tensors(tmp_path):
    hf = write_tiny_gguf(tmp_path / "m.gguf")
    ckpt = GGUFCheckpoint(tmp_path)  # a directory holding one .gguf
    assert ckpt.path == tmp_path / "m.gguf"
    assert sorted(ckpt.names()) == sorted(hf)
    for name, t in hf.items():
        assert torch.equal(ckpt.get(name), torch.from_numpy(t)), name
    cfg = LlamaModelConfig.from_hf(ckpt.hf_config)
    assert (cfg.num_key_value_heads, cfg.head_dim, cfg.vocab_size, cfg.bos_token_id) == (2, 16, len(TOKENS), 1)
    names = [n for n, _ in to_runtime(ckpt.get, ckpt.has, cfg, torch.bfloat16)]
    assert names[0] == "model.embed_tokens.weight" and names[-1] == "lm_head.weight"


def test_tied_gguf_gets_explicit_lm_head(tmp_path):
    hf = write_tiny_gguf(tmp_path / "m.gguf", drop=("output.weight",))
    ckpt = GGUFCheckpoint(tmp_path / "m.gguf")
    cfg = LlamaModelConfig.from_hf(ckpt.hf_config)
    assert cfg.tie_word_embeddings
    out = dict(to_runtime(ckpt.get, ckpt.has, cfg, torch.float32))
    assert torch.equal(out["lm_head.weight"], torch.from_numpy(hf["model.embed_tokens.weight"]))


def test_errors_name_the_file_or_tensor(tmp_path):
    with pytest.raises(CheckpointError, match="does not exist"):
        GGUFCheckpoint(tmp_path / "absent.gguf")
    with pytest.raises(CheckpointError, match="exactly one .gguf file, found 0"):
        GGUFCheckpoint(tmp_path)
    bad = tmp_path / "junk" / "bad.gguf"
    bad.parent.mkdir()
    bad.write_bytes(b"definitely not a gguf file" * 8)
    with pytest.raises(CheckpointError, match=r"bad\.gguf is not a readable GGUF"):
        GGUFCheckpoint(bad)

    two = tmp_path / "two"
    two.mkdir()
    write_tiny_gguf(two / "a.gguf")
    write_tiny_gguf(two / "b.gguf")
    with pytest.raises(CheckpointError, match=r"found 2: \['a.gguf', 'b.gguf'\]"):
        GGUFCheckpoint(two)

    write_tiny_gguf(tmp_path / "gpt2.gguf", arch="gpt2")
    with pytest.raises(CheckpointError, match=r"gpt2\.gguf: unsupported GGUF architecture 'gpt2'"):
        GGUFCheckpoint(tmp_path / "gpt2.gguf")

    write_tiny_gguf(tmp_path / "rf.gguf", extra=("rope_freqs.weight",))
    with pytest.raises(CheckpointError, match="unexpected tensor 'rope_freqs.weight'.*rope_freqs"):
        GGUFCheckpoint(tmp_path / "rf.gguf")

    write_tiny_gguf(tmp_path / "q8.gguf", q8=("blk.0.ffn_up.weight",))
    q8 = GGUFCheckpoint(tmp_path / "q8.gguf")
    with pytest.raises(CheckpointError, match=r"tensor 'blk\.0\.ffn_up\.weight' .* Q8_0-quantized"):
        q8.get("model.layers.0.mlp.up_proj.weight")

    write_tiny_gguf(tmp_path / "miss.gguf", drop=("blk.0.ffn_down.weight",))
    miss = GGUFCheckpoint(tmp_path / "miss.gguf")
    with pytest.raises(WeightError, match=r"missing tensor 'model\.layers\.0\.mlp\.down_proj\.weight'"):
        list(to_runtime(miss.get, miss.has, LlamaModelConfig.from_hf(miss.hf_config), torch.float32))
