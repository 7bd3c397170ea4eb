"""nextn's Llama over the paged KV cache matches `transformers`: on the real stories260K GGUF and on tiny random
HF checkpoints (GQA, Llama-3 rope scaling, tied and untied embeddings)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM, LlamaConfig
from transformers import LlamaForCausalLM as HFLlama

from nextn.build.checkpoint import CheckpointReader
from nextn.build.gguf_reader import GGUFCheckpoint
from nextn.models.config import ConfigError
from nextn.models.llama import LlamaForCausalLM, LlamaModelConfig, to_runtime
from nextn.speculative.acceptance_rules import StandardAcceptance, greedy_sampling
from nextn.models.attention_metadata import AttentionMetadata, slots_for_positions
from nextn.speculative.chain_step import NoDrafter
from nextn.models.kv_cache import allocate_kv_cache
from nextn.speculative.chain_step import prefill_step, verify_and_draft_step

STORIES = Path(__file__).resolve().parents[2].parent / "shared" / "data" / "models" / "stories260K"
GGUF_FILE = STORIES / "stories260K.gguf"
BLOCK = 8


@pytest.fixture(scope="module")
def stories() -> GGUFCheckpoint:
    if not GGUF_FILE.is_file():
        pytest.skip(f"stories260K GGUF is absent ({GGUF_FILE}): ../shared/data is not checked out")
    return GGUFCheckpoint(GGUF_FILE)


def _load(cfg: LlamaModelConfig, get, has) -> LlamaForCausalLM:
    """Engine-style load: modules on the meta device, runtime tensors assigned, rope table rebuilt."""
    with torch.device("meta"):
        model = LlamaForCausalLM(cfg, max_positions=1)
    model.load_state_dict(dict(to_runtime(get, has, cfg, torch.float32)), strict=True, assign=True)
    model.rope_table = model.rope_table_for(256)
    return model.eval().requires_grad_(False)


def _batched_logits(model: LlamaForCausalLM, ids: torch.Tensor, lens: list[int]) -> torch.Tensor:
    """Prefill right-padded prompts over a paged cache (scattered blocks, null block for pads) → [B, T, V]."""
    b, t = ids.shape
    per_seq = -(-t // BLOCK)
    tables = torch.tensor([[1 + r + b * j for j in range(per_seq)] for r in range(b)])  # interleaved blocks
    kv = allocate_kv_cache(model.num_cache_layers, 1 + b * per_seq, BLOCK, model.cfg.kv_cache_dim, torch.float32)
    pos = torch.arange(t).expand(b, -1)
    valid = pos < torch.tensor(lens)[:, None]
    meta = AttentionMetadata.create(pos, slots_for_positions(tables, pos, BLOCK, valid), tables, BLOCK)
    with torch.inference_mode():
        return model.logits(model(ids, kv, meta))


def _assert_matches_hf(model: LlamaForCausalLM, hf, vocab: int, lens: list[int]) -> float:
    ids = torch.randint(0, vocab, (len(lens), max(lens)), generator=torch.Generator().manual_seed(0))
    ids[:, 0] = 1
    logits = _batched_logits(model, ids, lens)
    worst = 0.0
    with torch.inference_mode():
        for b, n in enumerate(lens):
            ref = hf(ids[b : b + 1, :n]).logits[0].float()
            torch.testing.assert_close(logits[b, :n], ref, atol=1e-4, rtol=1e-4)
            worst = max(worst, (logits[b, :n] - ref).abs().max().item())
    return worst


def _greedy(model: LlamaForCausalLM, prompt: list[int], num_tokens: int) -> list[int]:
    """Greedy decoding through the runtime's prefill and verify steps (K = 0) over the paged cache."""
    blocks = -(-(len(prompt) + num_tokens + 1) // BLOCK)
    tables = torch.arange(1, blocks + 1)[None]
    kv = allocate_kv_cache(model.num_cache_layers, blocks + 1, BLOCK, model.cfg.kv_cache_dim, torch.float32)
    drafter, acceptance, sampling = NoDrafter(), StandardAcceptance(), greedy_sampling(1)
    with torch.inference_mode():
        out = prefill_step(model, drafter, acceptance, kv, torch.tensor([prompt]), torch.tensor([len(prompt)]),
                           tables, sampling, (), BLOCK)
        tokens = [int(out.tokens[0, 0])]
        while len(tokens) < num_tokens:
            kv_len = torch.tensor([len(prompt) + len(tokens) - 1])
            out = verify_and_draft_step(model, drafter, acceptance, kv, torch.tensor([[tokens[-1]]]), kv_len, tables,
                                        sampling, out.drafter_state, out.accept_state, BLOCK)
            tokens.append(int(out.tokens[0, 0]))
    return tokens


# stories260K (real pretrained weights) -------------------------------------------------------------------
def test_stories260k_logits_match_transformers_gguf(stories):
    cfg = stories.model_config
    model = _load(cfg, stories.get, stories.has)
    hf_cfg = AutoConfig.from_pretrained(STORIES, gguf_file=GGUF_FILE.name)
    hf_cfg.pad_token_id = None  # the GGUF's padding id is 0xFFFFFFFF (data README quirk)
    hf = AutoModelForCausalLM.from_pretrained(STORIES, gguf_file=GGUF_FILE.name, config=hf_cfg).eval()
    worst = _assert_matches_hf(model, hf, cfg.vocab_size, [41, 7, 23])
    assert worst < 1e-4


def test_stories260k_greedy_reproduces_model_card(stories, tmp_path):
    card = (STORIES / "MODEL_CARD.md").read_text()
    sample = card.split("-t 0.0\n", 1)[1].split("\n```", 1)[0]
    assert sample.startswith("Once upon a time, there was a little girl named Lily.")
    model = _load(stories.model_config, stories.get, stories.has)
    stories.write_tokenizer_files(tmp_path)
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tmp_path)
    tokens = _greedy(model, [stories.model_config.bos_token_id], 120)
    text = tok.decode(tokens, skip_special_tokens=True)
    assert len(text) > 300 and "\n" in text  # past the first line: byte tokens (<0x0A>) decode too
    assert sample.startswith(text), f"greedy text diverges from the model card:\n{text!r}\nvs\n{sample[:len(text)]!r}"


# Tiny random HF checkpoints ------------------------------------------------------------------------------
LLAMA3_ROPE = {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
               "high_freq_factor": 4.0, "original_max_position_embeddings": 32}


@pytest.mark.parametrize("tied", [False, True], ids=["untied", "tied"])
def test_tiny_hf_checkpoint_matches_transformers(tmp_path, tied):
    torch.manual_seed(0)
    hf_cfg = LlamaConfig(vocab_size=300, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                         rms_norm_eps=1e-5, rope_parameters=dict(LLAMA3_ROPE), tie_word_embeddings=tied)
    hf = HFLlama(hf_cfg).eval()
    with torch.no_grad():
        for p in hf.parameters():
            if p.dim() == 1:
                p.copy_(1.0 + 0.1 * torch.randn_like(p))  # norms not all 1, so a mix-up shows
    hf.save_pretrained(tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    cfg = LlamaModelConfig.from_hf(config)
    assert cfg.rope_scaling is not None and cfg.rope_scaling.factor == 8.0 and cfg.head_dim == 16
    assert cfg.tie_word_embeddings is tied and cfg.kv_cache_dim == 2 * 2 * 16
    reader = CheckpointReader(tmp_path)
    assert reader.has("lm_head.weight") is not tied
    model = _load(cfg, reader.get, reader.has)
    # Positions up to 100 cross the llama3 scaling's original context (32): all three frequency bands are used.
    _assert_matches_hf(model, hf, cfg.vocab_size, [100, 9, 40])


def test_config_spellings_and_errors():
    base = dict(architectures=["LlamaForCausalLM"], vocab_size=32, hidden_size=64, intermediate_size=96,
                num_hidden_layers=1, num_attention_heads=4)
    legacy = LlamaModelConfig.from_hf({**base, "rope_theta": 500000.0,
                                       "rope_scaling": {k: v for k, v in LLAMA3_ROPE.items() if k != "rope_theta"}})
    modern = LlamaModelConfig.from_hf({**base, "rope_parameters": dict(LLAMA3_ROPE)})
    assert legacy == modern and legacy.rope_theta == 500000.0
    plain = LlamaModelConfig.from_hf({**base, "rope_scaling": None})
    assert plain.rope_scaling is None and plain.num_key_value_heads == 4 and plain.head_dim == 16
    with pytest.raises(ConfigError, match="unsupported rope type 'dynamic'"):  # YaRN: tests/models/test_rope_yarn.py
        LlamaModelConfig.from_hf({**base, "rope_scaling": {"rope_type": "dynamic", "factor": 2.0}})
    with pytest.raises(ConfigError, match="num_key_value_heads"):
        LlamaModelConfig.from_hf({**base, "num_key_value_heads": 3})
    with pytest.raises(ConfigError, match="intermediate_size"):
        LlamaModelConfig.from_hf({k: v for k, v in base.items() if k != "intermediate_size"})
    with pytest.raises(ConfigError, match="DeepseekV3ForCausalLM"):
        LlamaModelConfig.from_hf({**base, "architectures": ["DeepseekV3ForCausalLM"]})


def test_tiny_qwen2_checkpoint_matches_transformers(tmp_path):
    """Qwen2 = the Llama family with q/k/v (not o) biases and its own rope theta: one module, `qkv_bias` set."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(0)
    hf_cfg = Qwen2Config(vocab_size=300, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512, rms_norm_eps=1e-6,
                         rope_parameters={"rope_type": "default", "rope_theta": 1e6}, tie_word_embeddings=True)
    hf = Qwen2ForCausalLM(hf_cfg).eval()
    with torch.no_grad():
        for name, p in hf.named_parameters():
            if p.dim() == 1:  # norms not all 1 and biases not all 0, so a mix-up shows
                p.copy_((1.0 if "norm" in name else 0.0) + 0.5 * torch.randn_like(p))
    hf.save_pretrained(tmp_path)
    cfg = LlamaModelConfig.from_hf(json.loads((tmp_path / "config.json").read_text()))
    assert (cfg.architecture, cfg.qkv_bias, cfg.attention_bias, cfg.rope_theta) == ("Qwen2ForCausalLM", True, False, 1e6)
    reader = CheckpointReader(tmp_path)
    model = _load(cfg, reader.get, reader.has)
    assert model.model.layers[0].self_attn.o_proj.bias is None and "lm_head.weight" not in model.state_dict()
    _assert_matches_hf(model, hf, cfg.vocab_size, [60, 9])
    saved = {k: v for k, v in json.loads((tmp_path / "config.json").read_text()).items() if k != "layer_types"}
    windowed = LlamaModelConfig.from_hf({**saved, "use_sliding_window": True, "sliding_window": 32,
                                         "max_window_layers": 1})  # layer_types, when given, win (as in transformers)
    assert (windowed.sliding_window, windowed.layer_types) == (32, ("full_attention", "sliding_attention"))
