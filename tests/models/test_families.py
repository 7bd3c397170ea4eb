"""Every dense family beyond Llama (Qwen3, Gemma 2 / 3, Mistral's window, Phi-3, SmolLM3, Granite, OLMo 2 / 3,
EXAONE 4, Seed-OSS, GLM-4) decodes as
`transformers` in float32: tiny random checkpoints made at test time, read from HF safetensors and from the GGUF that
llama.cpp's own converter writes of them; logits over the paged cache (prompts crossing sliding windows) and greedy
tokens through the engine — plain and with the NGram and Suffix drafters — and MTP modules trained on them."""

from __future__ import annotations

import json
from contextlib import contextmanager
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from nextn.build.checkpoint import CheckpointReader
from nextn.build.gguf_reader import GGUFCheckpoint
from nextn.models.attention_metadata import AttentionMetadata
from nextn.models.config import ConfigError
from nextn.models.llama import LlamaModelConfig
from nextn.models.llama.weights import stored_view
from nextn.testing.tiny_families import FAMILIES, save_tiny

from family_sources import assert_engine_greedy, tiny_source
from test_llama import _assert_matches_hf, _load

SHARED = Path(__file__).resolve().parents[2].parent / "shared"
PROMPT = [1] + [100 + (7 * i) % 23 for i in range(45)]  # 46 tokens, repetitive: drafts get accepted


@pytest.fixture(scope="module", params=list(FAMILIES))
def family(request, tmp_path_factory, tokenizer_dir):
    """(model_type, transformers model fp32, HF checkpoint dir) of one family."""
    out = tmp_path_factory.mktemp(request.param)
    hf = save_tiny(request.param, out, tokenizer_dir)
    return request.param, hf, out


def _source(family, kind: str, tmp_path: Path) -> Path:
    """The checkpoint to read: the HF directory, or the GGUF llama.cpp's converter makes of it (skips without one)."""
    return tiny_source(family[2], kind)


@contextmanager
def _oracle(family, kind: str):
    """The `transformers` model to compare with. llama.cpp's converter writes Mistral as a `llama` GGUF without its
    `sliding_window` (llama.cpp then attends to every key, and so does nextn reading that file): the oracle of a
    Mistral GGUF is Mistral without the window."""
    model_type, hf, _ = family
    window = hf.config.sliding_window if model_type == "mistral" and kind == "gguf" else None
    if window is not None:
        hf.config.sliding_window = None
    try:
        yield hf
    finally:
        if window is not None:
            hf.config.sliding_window = window


def _reader(path: Path):
    return GGUFCheckpoint(path) if path.suffix == ".gguf" else CheckpointReader(path)


@pytest.mark.parametrize("kind", ["hf", "gguf"])
def test_logits_match_transformers(family, kind, tmp_path):
    path = _source(family, kind, tmp_path)
    reader = _reader(path)
    cfg = (reader.model_config if kind == "gguf"
           else LlamaModelConfig.from_hf(json.loads((path / "config.json").read_text())))
    stored = stored_view(reader, cfg)  # Phi-3's fused projections split, partial rotary's q/k rows reordered
    model = _load(cfg, stored.get, stored.has)
    # 70 positions cross a 16-token window several times; batched with shorter right-padded prompts
    with _oracle(family, kind) as oracle:
        assert _assert_matches_hf(model, oracle, 4000, [70, 9, 33]) < 1e-4


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["hf", "gguf"])
def test_engine_greedy_is_transformers_plain_and_speculative(family, kind, tmp_path):
    """build-engine (float32) → LLM: greedy tokens equal `transformers.generate`, without drafts and with NGram and
    Suffix drafts (lossless: the drafts change speed, never the tokens)."""
    with torch.no_grad(), _oracle(family, kind) as hf:
        want = hf.generate(torch.tensor([PROMPT]), max_new_tokens=32, do_sample=False, pad_token_id=0,
                           eos_token_id=None)[0, len(PROMPT):].tolist()
    assert_engine_greedy(_source(family, kind, tmp_path), tmp_path / "engine", PROMPT, want)


def test_family_configs_and_refusals():
    """Both spellings of a Gemma 3 config read the same; what nextn does not build is refused by name."""
    base = dict(architectures=["Gemma3ForCausalLM"], vocab_size=32, hidden_size=64, intermediate_size=96,
                num_hidden_layers=6, num_attention_heads=4, num_key_value_heads=1, head_dim=16, sliding_window=8)
    modern = LlamaModelConfig.from_hf({**base, "rope_parameters": {
        "full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 1e6},
        "sliding_attention": {"rope_type": "default", "rope_theta": 1e4}}})
    legacy = LlamaModelConfig.from_hf({**base, "rope_theta": 1e6, "rope_local_base_freq": 1e4,
                                       "rope_scaling": {"rope_type": "linear", "factor": 8.0},
                                       "sliding_window_pattern": 6})
    assert modern == legacy
    assert modern.layer_types == ("sliding_attention",) * 5 + ("full_attention",)
    assert (modern.rope_local_theta, modern.rope_scaling.factor, modern.softmax_scale) == (1e4, 8.0, 256**-0.5)
    assert modern.embedding_multiplier == 8.0 and modern.hidden_act == "gelu_pytorch_tanh"
    assert modern.tie_word_embeddings
    with pytest.raises(ConfigError, match="use_bidirectional_attention"):
        LlamaModelConfig.from_hf({**base, "use_bidirectional_attention": True})
    assert modern.final_logit_softcapping is None  # Gemma 3 releases leave it null; one that sets it is read
    assert LlamaModelConfig.from_hf({**base, "final_logit_softcapping": 30.0}).final_logit_softcapping == 30.0
    qwen3 = dict(base, architectures=["Qwen3ForCausalLM"])
    assert LlamaModelConfig.from_hf(qwen3).qk_norm and LlamaModelConfig.from_hf(qwen3).norm_placement == "pre"
    windowed = LlamaModelConfig.from_hf({**qwen3, "use_sliding_window": True, "max_window_layers": 4})
    assert windowed.layer_types == ("full_attention",) * 4 + ("sliding_attention",) * 2
    mistral = LlamaModelConfig.from_hf(dict(base, architectures=["MistralForCausalLM"], sliding_window=None))
    assert mistral.layer_types is None and not mistral.qk_norm
    assert LlamaModelConfig.from_hf(dict(base, architectures=["MistralForCausalLM"])).layer_types == (
        "sliding_attention",) * 6
    with pytest.raises(ConfigError, match="layer_types lists 2 layers"):
        LlamaModelConfig.from_hf({**base, "layer_types": ["full_attention"] * 2})


def test_phi3_short_factors_within_the_original_context(tokenizer_dir, tmp_path):
    """LongRoPE: a rope table no longer than the original context uses the short factors, as transformers does for
    a sequence that short (the family fixture's prompts all exceed it: the long factors)."""
    hf = save_tiny("phi3", tmp_path, tokenizer_dir)
    reader = CheckpointReader(tmp_path)
    cfg = LlamaModelConfig.from_hf(json.loads((tmp_path / "config.json").read_text()))
    stored = stored_view(reader, cfg)
    model = _load(cfg, stored.get, stored.has)
    model.rope_table = model.rope_table_for(8)
    assert _assert_matches_hf(model, hf, 4000, [8, 5]) < 1e-4
    model.rope_table = model.rope_table_for(9)  # the long factors: no longer transformers' logits at 8 positions
    with pytest.raises(AssertionError):
        _assert_matches_hf(model, hf, 4000, [8])


def test_phi3_configs_and_stored_layout():
    """Phi-3's partial rotary and LongRoPE read from its config (attention factor as transformers defaults it);
    a wrong factor count is refused; the fused tensors are split by rows, 4-bit blocks included, and partial
    rotary's q/k rows reordered head by head."""
    from nextn.models.llama.rope import partial_rotary_order
    from nextn.models.llama.stored_layout import StoredLayout

    hf = dict(architectures=["Phi3ForCausalLM"], vocab_size=32, hidden_size=64, intermediate_size=96,
              num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=4096,
              rope_parameters={"rope_type": "longrope", "rope_theta": 1e4, "partial_rotary_factor": 0.75,
                               "original_max_position_embeddings": 1024, "short_factor": [1.0] * 6,
                               "long_factor": [2.0] * 6})
    cfg = LlamaModelConfig.from_hf(hf)
    assert cfg.rotary_dim == 12 and cfg.rope_scaling.attention_factor == pytest.approx((1 + 2 / 10) ** 0.5)
    with pytest.raises(ConfigError, match="short_factor and long_factor of one length"):
        LlamaModelConfig.from_hf({**hf, "rope_parameters": {**hf["rope_parameters"], "long_factor": [2.0] * 5}})
    with pytest.raises(ConfigError, match="lists 5 factors; rotary_dim // 2 is 6"):
        LlamaModelConfig.from_hf({**hf, "rope_parameters": {**hf["rope_parameters"], "long_factor": [2.0] * 5,
                                                            "short_factor": [1.0] * 5}})
    order = partial_rotary_order(16, 12)
    assert sorted(order.tolist()) == list(range(16)) and order[:6].tolist() == list(range(6))
    assert order[8:14].tolist() == list(range(6, 12))  # HF's pairs (j, j + 6) become the engine's (i, i + 8)

    class Reader:  # one layer's fused tensors, each row holding its own index
        rows = {"model.layers.0.self_attn.qkv_proj.weight": 128, "model.layers.0.mlp.gate_up_proj.weight": 192}

        def names(self):
            return list(self.rows)

        def has(self, name):
            return name in self.rows

        def get(self, name):
            return torch.arange(self.rows[name], dtype=torch.float32)[:, None].repeat(1, 4)

        def native_w4a16(self, name, _):
            return {"qweight": self.get(name).to(torch.int32), "scales": self.get(name)}

    view = StoredLayout(Reader(), cfg)
    assert sorted(view.names()) == sorted(f"model.layers.0.{n}.weight" for n in (
        "self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "mlp.gate_proj", "mlp.up_proj"))
    assert not view.has("model.layers.0.self_attn.qkv_proj.weight")
    k = view.get("model.layers.0.self_attn.k_proj.weight")[:, 0]  # rows 64..95, each head reordered
    assert k.tolist() == [64 + h * 16 + j for h in range(2) for j in order.tolist()]
    assert view.get("model.layers.0.self_attn.v_proj.weight")[:, 0].tolist() == list(range(96, 128))
    assert view.get("model.layers.0.mlp.up_proj.weight")[:, 0].tolist() == list(range(96, 192))
    native = view.native_w4a16("model.layers.0.self_attn.q_proj.weight", None)
    assert native["qweight"][:, 0].tolist() == [h * 16 + j for h in range(4) for j in order.tolist()]


def test_windowed_metadata_keeps_the_last_window_keys():
    """A sliding layer's query at position p sees keys p − W + 1 .. p (and nothing past p), pads included."""
    tables = torch.tensor([[1, 2, 3, 4], [5, 6, 7, 8]])
    pos = torch.tensor([[20, 21, 22], [3, 4, 0]])
    meta = AttentionMetadata.create(pos, torch.zeros_like(pos), tables, 8)
    win = meta.windowed(5).visible[:, 0]  # [B, T, S]
    keys = torch.arange(32)
    for b in range(2):
        for t in range(3):
            p = int(pos[b, t])
            assert torch.equal(win[b, t], (keys <= p) & (keys > p - 5)), (b, t)


@pytest.mark.slow
@pytest.mark.parametrize("model_type", ["qwen3", "mistral"])
def test_a_trained_mtp_module_is_lossless(model_type, tokenizer_dir, tmp_path):
    """`nextn train-draft --method mtp` trains a module whose block is the family's own decoder layer (Qwen3's q/k
    norms included); its engine decodes token-identically to plain decoding (`train_draft.json`'s lossless check)."""
    from nextn.cli.train_draft import main

    corpus = SHARED / "data" / "corpora" / "tinystories_train_head.txt"
    base, out = tmp_path / "base", tmp_path / "mtp"
    save_tiny(model_type, base, tokenizer_dir)
    assert main(["--model_dir", str(base), "--method", "mtp", "--num_heads", "1", "--num_draft_steps", "2",
                 "--data", str(corpus), "--output_dir", str(out), "--steps", "8", "--eval_mtp", "2",
                 "--max_prompts", "24", "--num_tokens", "16", "--prompt_len", "8", "--batch_size", "8", "--lr", "3e-3",
                 "--num_top1_prompts", "4", "--eval_prompts", "3", "--no-progress", "--seed", "0"]) == 0
    config = json.loads((out / "config.json").read_text())
    assert config["num_nextn_predict_layers"] == 1
    tensors = load_file(str(out / "model.safetensors"))
    n = config["num_hidden_layers"]
    assert tensors[f"model.layers.{n}.self_attn.o_proj.weight"].abs().sum() > 0
    assert (f"model.layers.{n}.self_attn.q_norm.weight" in tensors) is (model_type == "qwen3")
    meta = json.loads((out / "train_draft.json").read_text())
    assert meta["acceptance"]["lossless"] and meta["acceptance"]["num_prompts"] == 3
