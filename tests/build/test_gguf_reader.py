"""`GGUFCheckpoint`: config, HF-named tensors (llama.cpp's q/k permutation undone for llama, not for qwen2),
quantized types dequantized by `gguf.quants`, tokenizer, and clear errors (architecture, ggml type, truncation)."""

from __future__ import annotations

import math

from pathlib import Path

import gguf
import numpy as np
import pytest
import torch

from nextn.build.checkpoint import CheckpointError
from nextn.build.engine_builder import build_engine
from nextn.build.gguf_reader import GGUFCheckpoint, hf_name, supported_ggml_types, unpermute_rope_rows
from nextn.models.llama import LlamaModelConfig, to_runtime
from nextn.models.llama.weights import WeightError
from nextn.plugins.cpu_features import fast_bf16

Q = gguf.GGMLQuantizationType

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


def write_tiny_gguf(path: Path, arch: str = "llama", drop: tuple[str, ...] = (), quant: dict[str, Q] | None = None,
                    extra: tuple[str, ...] = (), seed: int = 0, biases: bool = False,
                    raw: dict[str, tuple[np.ndarray, Q]] | None = None, hidden: int = 64,
                    rope_freqs: np.ndarray | None = None, experts: int = 0) -> dict[str, np.ndarray]:
    """A 1-layer GQA Llama-family GGUF (hidden 64 (or `hidden`), 4 heads / 2 KV heads, ffn 256, vocab 9) written as llama.cpp's
    convert_hf_to_gguf.py would: q/k rows (and biases) permuted for arch "llama" (`LlamaModel`), not for "qwen2".

    Args:
        quant: GGUF tensor name → a type `gguf.quants.quantize` writes (Q4_0 … Q8_0).
        biases: add q/k/v biases (Qwen2's).
        raw: GGUF tensor name → (raw block bytes [rows, bytes], type), written as they are (K-quants, which gguf
            cannot quantize, and types it cannot dequantize).
        rope_freqs: Llama-3 rope scaling as llama.cpp's converter stores it (`rope_freqs.weight`, F32).
        experts: an MoE layer of that many experts (Mixtral as llama.cpp writes it: `expert_count`, top-2, a router
            `ffn_gate_inp`, 3-D `ffn_{gate,up,down}_exps`, the gate experts in random Q4_K blocks) instead of the MLP.
    Returns:
        The HF-layout fp32 tensors by HF name that `GGUFCheckpoint.get` must give back (quantized ones as
        `gguf.quants.dequantize` reads them back).
    """
    rng = np.random.default_rng(seed)
    quant, raw = quant or {}, raw or {}
    h, heads, kv_heads, d, ffn, v = hidden, 4, 2, hidden // 4, 256, len(TOKENS)
    hf = {
        "model.embed_tokens.weight": (v, h), "model.norm.weight": (h,), "lm_head.weight": (v, h),
        "model.layers.0.self_attn.q_proj.weight": (heads * d, h), "model.layers.0.self_attn.k_proj.weight": (kv_heads * d, h),
        "model.layers.0.self_attn.v_proj.weight": (kv_heads * d, h), "model.layers.0.self_attn.o_proj.weight": (h, heads * d),
        "model.layers.0.mlp.gate_proj.weight": (ffn, h), "model.layers.0.mlp.up_proj.weight": (ffn, h),
        "model.layers.0.mlp.down_proj.weight": (h, ffn), "model.layers.0.input_layernorm.weight": (h,),
        "model.layers.0.post_attention_layernorm.weight": (h,),
    }  # fmt: skip
    if biases:
        hf.update({"model.layers.0.self_attn.q_proj.bias": (heads * d,), "model.layers.0.self_attn.k_proj.bias": (kv_heads * d,),
                   "model.layers.0.self_attn.v_proj.bias": (kv_heads * d,)})  # fmt: skip
    hf = {k: rng.standard_normal(s).astype(np.float32) for k, s in hf.items()}
    w = gguf.GGUFWriter(str(path), arch)
    if experts:
        _write_experts(w, hf, experts, h, ffn, rng)
        drop = (*drop, "blk.0.ffn_gate.weight", "blk.0.ffn_up.weight", "blk.0.ffn_down.weight")
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
    if biases:
        names |= {"blk.0.attn_q.bias", "blk.0.attn_k.bias", "blk.0.attn_v.bias"}
    for name in sorted(names - set(drop)) + list(extra):
        t = hf.get(hf_name(name), np.zeros((4,), np.float32))
        if arch == "llama" and name.startswith("blk.0.attn_q."):
            t = permute(t, heads)
        elif arch == "llama" and name.startswith("blk.0.attn_k."):
            t = permute(t, kv_heads)
        if name in raw:
            blocks, qtype = raw[name]
            w.add_tensor(name, blocks, raw_shape=blocks.shape, raw_dtype=qtype)
            if qtype.name not in supported_ggml_types():
                continue  # a file nextn must refuse
            t = gguf.quants.dequantize(blocks, qtype)
        elif name in quant:
            qt = gguf.quants.quantize(t, quant[name])
            w.add_tensor(name, qt, raw_shape=qt.shape, raw_dtype=quant[name])
            t = gguf.quants.dequantize(qt, quant[name])
        else:
            w.add_tensor(name, t)
        if name in raw or name in quant:  # what the file holds, back in HF's row order
            if arch == "llama" and name.startswith(("blk.0.attn_q.", "blk.0.attn_k.")):
                n = heads if ".attn_q." in name else kv_heads
                t = unpermute_rope_rows(torch.from_numpy(t.copy()), n).numpy()
            hf[hf_name(name)] = t
    if rope_freqs is not None:
        w.add_tensor("rope_freqs.weight", rope_freqs.astype(np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return hf


def _write_experts(w, hf: dict[str, np.ndarray], count: int, h: int, ffn: int, rng) -> None:
    """`write_tiny_gguf`'s MoE layer: metadata, router and expert tensors into `w`, their HF-named values (one per
    expert) into `hf` in place of the dense MLP's."""
    for proj in ("gate_proj", "up_proj", "down_proj"):
        del hf[f"model.layers.0.mlp.{proj}.weight"]
    w.add_expert_count(count)
    w.add_expert_used_count(2)
    router = rng.standard_normal((count, h)).astype(np.float32)
    w.add_tensor("blk.0.ffn_gate_inp.weight", router)
    hf["model.layers.0.mlp.gate.weight"] = router
    gate = _k_quant_blocks(Q.Q4_K, count * ffn, h).reshape(count, ffn, -1)  # [E, out, bytes]
    w.add_tensor("blk.0.ffn_gate_exps.weight", gate, raw_shape=gate.shape, raw_dtype=Q.Q4_K)
    values = {"gate_proj": gguf.quants.dequantize(gate, Q.Q4_K),
              "up_proj": rng.standard_normal((count, ffn, h)).astype(np.float32),
              "down_proj": rng.standard_normal((count, h, ffn)).astype(np.float32)}
    w.add_tensor("blk.0.ffn_up_exps.weight", values["up_proj"])
    w.add_tensor("blk.0.ffn_down_exps.weight", values["down_proj"])
    for proj, v in values.items():
        hf.update({f"model.layers.0.mlp.experts.{e}.{proj}.weight": v[e] for e in range(count)})


def test_moe_experts_read_as_one_slice_each(tmp_path):
    """An MoE GGUF (Mixtral, written as llama with `expert_count`): each expert of the 3-D tensors reads as its own
    HF-named tensor — F32 values as written, Q4_K blocks as gguf dequantizes that expert's slice, and for W4A16 as
    the slice's own two-level scales (`native_w4a16`), which dequantize to the same values."""
    from nextn.quantization import weight_only
    from nextn.quantization.quant_config import QuantConfig

    hf = write_tiny_gguf(tmp_path / "moe.gguf", hidden=256, experts=3)
    ckpt = GGUFCheckpoint(tmp_path / "moe.gguf")
    cfg = ckpt.model_config
    assert (cfg.architecture, cfg.num_experts, cfg.num_experts_per_tok, cfg.moe_intermediate_size,
            cfg.norm_topk_prob) == ("MixtralForCausalLM", 3, 2, 256, True)
    assert sorted(ckpt.names()) == sorted(hf)
    for name, t in hf.items():
        assert ckpt.tensor_info(name) == ("F32", list(t.shape)), name
        assert torch.equal(ckpt.get(name), torch.from_numpy(np.ascontiguousarray(t))), name
    quant = QuantConfig(quant_algo="W4A16", group_size=32, super_block_size=256)
    for e in range(3):
        name = f"model.layers.0.mlp.experts.{e}.gate_proj.weight"
        native = ckpt.native_w4a16(name, quant)
        assert torch.equal(weight_only.dequantize(native, quant).float(), ckpt.get(name)), e
    assert ckpt.native_w4a16("model.layers.0.mlp.experts.1.up_proj.weight", quant) is None  # F32: quantized later
    out = dict(to_runtime(ckpt.get, ckpt.has, cfg, torch.float32))
    assert out["model.layers.0.mlp.experts.2.down_proj.weight"].shape == (256, 256)


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


def test_tied_gguf_stores_the_embedding_once(tmp_path):
    hf = write_tiny_gguf(tmp_path / "m.gguf", drop=("output.weight",))
    ckpt = GGUFCheckpoint(tmp_path / "m.gguf")
    cfg = LlamaModelConfig.from_hf(ckpt.hf_config)
    assert cfg.tie_word_embeddings
    out = dict(to_runtime(ckpt.get, ckpt.has, cfg, torch.float32))
    assert "lm_head.weight" not in out
    assert torch.equal(out["model.embed_tokens.weight"], torch.from_numpy(hf["model.embed_tokens.weight"]))


def _k_quant_blocks(qtype: Q, rows: int, cols: int, seed: int = 0) -> np.ndarray:
    """Random Q4_K / Q6_K blocks [rows, bytes] with small finite fp16 scales (gguf cannot quantize K types)."""
    block, type_size = gguf.GGML_QUANT_SIZES[qtype]
    blocks = np.random.default_rng(seed).integers(0, 256, (rows, cols // block, type_size), dtype=np.uint8)
    scale = np.frombuffer(np.float16(0.01).tobytes(), np.uint8)
    if qtype == Q.Q4_K:  # d, dmin (fp16) first
        blocks[..., 0:2], blocks[..., 2:4] = scale, scale
    else:  # Q6_K: d (fp16) last
        blocks[..., -2:] = scale
    return blocks.reshape(rows, -1)


@pytest.mark.parametrize("k_type", [Q.Q4_K, Q.Q6_K], ids=["q4_k", "q6_k"])
def test_quantized_tensors_are_dequantized_by_gguf(tmp_path, k_type):
    """Q4_1/Q5_0/Q8_0 (SmolLM2's and Qwen2.5's types) and K-quants come back as `gguf.quants.dequantize` reads them,
    in HF's row order (the permuted q/k rows of a llama file un-permuted after dequantization)."""
    quant = {"token_embd.weight": Q.Q8_0, "blk.0.attn_q.weight": Q.Q4_1, "blk.0.attn_k.weight": Q.Q5_0,
             "blk.0.ffn_gate.weight": Q.Q4_1}
    raw = {"blk.0.ffn_down.weight": (_k_quant_blocks(k_type, 64, 256), k_type)}  # the one 256-wide input
    hf = write_tiny_gguf(tmp_path / "q.gguf", quant=quant, raw=raw)
    ckpt = GGUFCheckpoint(tmp_path / "q.gguf")
    assert ckpt.is_quantized and ckpt.hf_config["torch_dtype"] == "float32"
    for name, t in hf.items():
        got = ckpt.get(name)
        assert got.dtype == torch.float32 and torch.equal(got, torch.from_numpy(t)), name


def test_qwen2_gguf_keeps_row_order_and_biases(tmp_path):
    """qwen2 files are not permuted (convert_hf_to_gguf's Qwen2Model): q/k weights and biases read as written, as
    `transformers` loads them; the config is a Qwen2ForCausalLM with q/k/v biases only."""
    from transformers import AutoConfig, AutoModelForCausalLM

    hf = write_tiny_gguf(tmp_path / "qwen.gguf", arch="qwen2", biases=True, quant={"blk.0.attn_q.weight": Q.Q8_0})
    ckpt = GGUFCheckpoint(tmp_path / "qwen.gguf")
    cfg = ckpt.model_config
    assert (cfg.architecture, cfg.qkv_bias, cfg.attention_bias, cfg.has_qkv_bias) == ("Qwen2ForCausalLM", True, False, True)
    for name, t in hf.items():
        assert torch.equal(ckpt.get(name), torch.from_numpy(t)), name
    hf_cfg = AutoConfig.from_pretrained(tmp_path, gguf_file="qwen.gguf")
    hf_cfg.pad_token_id = None  # the tiny file's padding id is 0xFFFFFFFF ("none")
    model = AutoModelForCausalLM.from_pretrained(tmp_path, gguf_file="qwen.gguf", config=hf_cfg, dtype=torch.float32)
    assert type(model).__name__ == "Qwen2ForCausalLM"
    for name, t in model.state_dict().items():
        if name != "lm_head.weight" or ckpt.has(name):
            assert torch.equal(ckpt.get(name), t), name
    out = dict(to_runtime(ckpt.get, ckpt.has, cfg, torch.float32))
    assert "model.layers.0.self_attn.k_proj.bias" in out and "model.layers.0.self_attn.o_proj.bias" not in out


def test_llama_biases_are_unpermuted_like_weights(tmp_path):
    hf = write_tiny_gguf(tmp_path / "b.gguf", biases=True)
    ckpt = GGUFCheckpoint(tmp_path / "b.gguf")
    assert ckpt.model_config.qkv_bias and not ckpt.model_config.attention_bias
    for name in ("model.layers.0.self_attn.q_proj.bias", "model.layers.0.self_attn.k_proj.bias"):
        assert torch.equal(ckpt.get(name), torch.from_numpy(hf[name])), name


def test_auto_dtype_of_a_quantized_gguf(tmp_path):
    """`--dtype auto`: bfloat16 where bf16 matmuls are fast here, float32 elsewhere; a float GGUF keeps its dtype."""
    write_tiny_gguf(tmp_path / "q.gguf", quant={"blk.0.ffn_up.weight": Q.Q4_1})
    m = build_engine(tmp_path / "q.gguf", tmp_path / "engine", progress=False)
    assert m.dtype == ("bfloat16" if fast_bf16(torch.device("cpu")) else "float32")
    write_tiny_gguf(tmp_path / "f.gguf")
    assert build_engine(tmp_path / "f.gguf", tmp_path / "engine_f", progress=False).dtype == "float32"


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
    with pytest.raises(CheckpointError, match=r"gpt2\.gguf: unsupported GGUF architecture 'gpt2'; nextn reads llama, qwen2"):
        GGUFCheckpoint(tmp_path / "gpt2.gguf")

    write_tiny_gguf(tmp_path / "rf.gguf", rope_freqs=np.zeros(4, np.float32))
    with pytest.raises(CheckpointError, match=r"rope_freqs\.weight must be 8 positive F32 values \(head_dim // 2\), "
                       "got 4"):
        GGUFCheckpoint(tmp_path / "rf.gguf").model_config

    q81 = np.zeros((256, 64 // 32 * gguf.GGML_QUANT_SIZES[Q.Q8_1][1]), np.uint8)  # gguf cannot dequantize Q8_1
    write_tiny_gguf(tmp_path / "q81.gguf", raw={"blk.0.ffn_up.weight": (q81, Q.Q8_1)})
    with pytest.raises(CheckpointError, match=r"'blk\.0\.ffn_up\.weight' has ggml type Q8_1, which gguf .* cannot "
                       r"dequantize; nextn reads F32, F16, .*Q4_1, .*Q8_0, .*Q4_K, .*Q6_K"):
        GGUFCheckpoint(tmp_path / "q81.gguf")
    assert {"Q4_1", "Q5_0", "Q8_0", "Q4_K", "Q6_K"} <= set(supported_ggml_types()) and "Q8_1" not in supported_ggml_types()

    write_tiny_gguf(tmp_path / "miss.gguf", drop=("blk.0.ffn_down.weight",))
    miss = GGUFCheckpoint(tmp_path / "miss.gguf")
    with pytest.raises(WeightError, match=r"missing tensor 'model\.layers\.0\.mlp\.down_proj\.weight'"):
        list(to_runtime(miss.get, miss.has, LlamaModelConfig.from_hf(miss.hf_config), torch.float32))


@pytest.mark.parametrize("keep", [0.5, 0.02])
def test_truncated_gguf_is_a_clear_error_and_leaves_no_engine(tmp_path, keep):
    write_tiny_gguf(tmp_path / "full.gguf")
    data = (tmp_path / "full.gguf").read_bytes()
    cut = tmp_path / "cut" / "cut.gguf"
    cut.parent.mkdir()
    cut.write_bytes(data[: int(len(data) * keep)])
    with pytest.raises(CheckpointError, match=r"cut\.gguf is a truncated or corrupt GGUF file \(\d+ bytes"):
        GGUFCheckpoint(cut)
    out = tmp_path / "out" / "engine"
    with pytest.raises(CheckpointError, match="truncated"):
        build_engine(cut, out, progress=False)
    assert not out.exists() and list((tmp_path / "out").glob("*")) == []  # no staging directory left either


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_q4_k_tensors_are_read_as_they_are(tmp_path, arch):
    """Under W4A16 with two-level scales (group 32, super-block 256) a Q4_K tensor's values are taken from its blocks
    (q/k rows of a llama file un-permuted like `get`'s), equal to `gguf`'s dequantization bit for bit; other types and
    other formats are quantized as before; a built engine stores them and runs."""
    from nextn.build.engine_builder import build_engine
    from nextn.quantization.weight_only import QuantConfig, dequantize
    from safetensors.torch import load_file

    names = ("blk.0.attn_q.weight", "blk.0.attn_k.weight", "blk.0.ffn_gate.weight", "blk.0.ffn_down.weight")
    raw = {n: (_k_quant_blocks(Q.Q4_K, r, 256, seed=i), Q.Q4_K)
           for i, (n, r) in enumerate(zip(names, (256, 128, 256, 256)))}
    write_tiny_gguf(tmp_path / "q.gguf", arch=arch, raw=raw, hidden=256)
    ckpt = GGUFCheckpoint(tmp_path / "q.gguf")
    cfg = QuantConfig(quant_algo="W4A16", group_size=32, super_block_size=256)
    for name in map(hf_name, names):
        t = ckpt.native_w4a16(name, cfg)
        assert t is not None and torch.equal(dequantize(t, cfg), ckpt.get(name)), name
    assert ckpt.native_w4a16("model.layers.0.self_attn.v_proj.weight", cfg) is None  # F32 in the file
    assert ckpt.native_w4a16(hf_name(names[2]), QuantConfig(quant_algo="W4A16", group_size=32)) is None
    assert ckpt.native_w4a16(hf_name(names[2]), QuantConfig(quant_algo="W4A16", group_size=32,
                                                            super_block_size=128)) is None
    build_engine(tmp_path / "q.gguf", tmp_path / "e", progress=False, max_seq_len=64, dtype="bfloat16",
                 quant_algo="W4A16", group_size=32, super_block_size=256)
    stored = load_file(str(tmp_path / "e" / "model.safetensors"))
    for name in map(hf_name, names):
        prefix = name.removesuffix(".weight")
        got = {s: stored[f"{prefix}.{s}"] for s in ("weight", "weight_scale", "weight_zero", "weight_scale_2")}
        assert torch.equal(dequantize(got, cfg), ckpt.get(name)), name
    from nextn import LLM, SamplingParams

    out = LLM(tmp_path / "e").generate([[3, 4, 5]], SamplingParams(max_tokens=4, ignore_eos=True))
    assert len(out[0].outputs[0].token_ids) == 4


LLAMA3_ROPE = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 32}


def llama3_rope_freqs(head_dim: int, theta: float, rope: dict) -> np.ndarray:
    """`rope_freqs` as llama.cpp's converter computes it from `rope_scaling` (conversion/llama.py,
    `LlamaModel.generate_extra_tensors`): per frequency 1 (short wavelengths), the factor (long ones), else
    1 / ((1 - smooth) / factor + smooth)."""
    freqs = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim))
    old = rope["original_max_position_embeddings"]
    low, high, factor = rope["low_freq_factor"], rope["high_freq_factor"], rope["factor"]
    out = []
    for f in freqs.tolist():
        wavelen = 2 * math.pi / f
        if wavelen < old / high:
            out.append(1.0)
        elif wavelen > old / low:
            out.append(factor)
        else:
            smooth = (old / wavelen - low) / (high - low)
            out.append(1 / ((1 - smooth) / factor + smooth))
    return np.array(out, np.float32)


def test_a_llama3_gguf_with_rope_freqs_decodes_as_transformers(tmp_path):
    """Llama 3.1 / 3.2 GGUFs carry their rope scaling as a `rope_freqs` tensor: read as per-frequency divisors,
    the engine decodes token for token as `transformers` does with the checkpoint's `rope_scaling: llama3`
    (float32; positions past `original_max_position_embeddings`, where the scaling matters)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from nextn import LLM, SamplingParams
    from nextn.build.engine_builder import build_engine

    factors = llama3_rope_freqs(16, 10000.0, LLAMA3_ROPE)
    assert 1.0 < factors.max() and factors.min() == 1.0 and len(set(factors.tolist())) > 2  # all three bands
    hf = write_tiny_gguf(tmp_path / "l3.gguf", rope_freqs=factors)
    cfg = GGUFCheckpoint(tmp_path / "l3.gguf").model_config
    assert cfg.rope_freq_factors == tuple(factors.tolist()) and cfg.rope_scaling is None
    model = LlamaForCausalLM(LlamaConfig(
        vocab_size=len(TOKENS), hidden_size=64, intermediate_size=256, num_hidden_layers=1, num_attention_heads=4,
        num_key_value_heads=2, rms_norm_eps=1e-5, max_position_embeddings=256, rope_theta=10000.0,
        rope_scaling=dict(LLAMA3_ROPE), tie_word_embeddings=False)).eval()
    model.load_state_dict({k: torch.from_numpy(v) for k, v in hf.items()}, strict=False)
    prompt = [1] + [4 + (7 * i) % 5 for i in range(47)]
    with torch.no_grad():
        want = model.generate(torch.tensor([prompt]), max_new_tokens=24, do_sample=False, pad_token_id=0,
                              eos_token_id=None)[0, len(prompt):].tolist()
    build_engine(tmp_path / "l3.gguf", tmp_path / "engine", dtype="float32", quant_algo=None, progress=False)
    llm = LLM(tmp_path / "engine", device="cpu")
    got = llm.generate(prompt, SamplingParams(max_tokens=24, ignore_eos=True)).outputs[0].token_ids
    llm.shutdown()
    assert got == want


def test_an_unsupported_architecture_is_refused_from_the_header_alone(tmp_path, monkeypatch):
    """The architecture is read from the header's first keys before `gguf.GGUFReader` parses the whole file (~20 s
    for a 262k-token vocabulary): a refused file is refused at once, naming what nextn reads."""
    write_tiny_gguf(tmp_path / "f.gguf", arch="falcon")
    write_tiny_gguf(tmp_path / "m.gguf", arch="dbrx")

    def no_full_parse(*args, **kwargs):
        raise AssertionError("the whole header was parsed for a refused architecture")
    monkeypatch.setattr(gguf, "GGUFReader", no_full_parse)
    with pytest.raises(CheckpointError, match=r"unsupported GGUF architecture 'falcon'; nextn reads llama, qwen2, "
                                              r"qwen3, gemma3"):
        GGUFCheckpoint(tmp_path / "f.gguf")
    with pytest.raises(CheckpointError, match=r"'dbrx' is a mixture-of-experts model, which nextn does not build yet"):
        GGUFCheckpoint(tmp_path / "m.gguf")
