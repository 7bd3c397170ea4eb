"""Tiny random checkpoints of each dense family nextn builds, made by `transformers` at test time (nothing
downloaded), with weights scaled so greedy decoding has no near-ties; and their GGUFs made by llama.cpp's converter.

The tokenizer is SmolLM2-135M's (written from the GGUF in ../shared/data/models: a GPT-2 BPE of 49,152 tokens the
converter recognises), so a checkpoint here converts like a released one and builds an engine with a tokenizer.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import torch

#: The shape every tiny family shares; the per-family settings exercise its layer options (Gemma 3: 7 layers, so
#: a full-attention layer sits between sliding ones; a window of 16 that 40-token prompts cross;
#: `query_pre_attn_scalar` = head_dim as in every Gemma 3 but the 27B, since a GGUF does not store it).
_BASE = dict(vocab_size=49152, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
             max_position_embeddings=512, bos_token_id=1, eos_token_id=2, pad_token_id=None)
FAMILIES: dict[str, dict[str, Any]] = {
    "qwen3": dict(num_key_value_heads=2, head_dim=16, rope_parameters={"rope_type": "default", "rope_theta": 1e6}),
    "mistral": dict(num_key_value_heads=2, head_dim=16, sliding_window=16),
    "smollm3": dict(num_hidden_layers=4, num_key_value_heads=2, head_dim=16),  # layer 3: NoPE
    "olmo2": dict(num_key_value_heads=2, head_dim=16),
    "granite": dict(num_key_value_heads=2, embedding_multiplier=3.0, attention_multiplier=0.2,
                    residual_multiplier=0.5, logits_scaling=2.5),
    # Phi-4-mini's layout: fused qkv / gate_up, partial rotary, LongRoPE, tied embeddings; an original context of 8
    # that every prompt of the tests exceeds, so transformers uses the long factors as the engine's table does
    "phi3": dict(num_key_value_heads=2, tie_word_embeddings=True, original_max_position_embeddings=8,
                 rope_parameters={"rope_type": "longrope", "rope_theta": 10000.0, "partial_rotary_factor": 0.5,
                                  "original_max_position_embeddings": 8, "short_factor": [1.0, 1.3, 1.7, 2.9],
                                  "long_factor": [1.5, 2.5, 6.0, 11.0]}),
    "olmo3": dict(num_hidden_layers=4, num_key_value_heads=2, head_dim=16, sliding_window=16),  # 3 sliding : 1 full
    "seed_oss": dict(num_key_value_heads=2, head_dim=16),  # q/k/v biases, o without
    # GLM-4 (0414): sandwich norms under its own names, fused gate_up, q/k/v biases, half of each head rotated in
    # interleaved pairs
    "glm4": dict(num_key_value_heads=2, head_dim=16, vocab_size=49160),  # room for <|user|>
    # EXAONE 4: q/k norms, post-norms, 3 sliding layers with RoPE then a full one without (a window that prompts cross)
    "exaone4": dict(num_hidden_layers=4, num_key_value_heads=2, head_dim=16, sliding_window=16,
                    sliding_window_pattern=4),
    # Gemma 2: caps far below the released 50 / 30, so soft-capping changes every logit the tests compare
    "gemma2": dict(num_hidden_layers=3, num_key_value_heads=1, head_dim=32, sliding_window=16,
                   query_pre_attn_scalar=32, attn_logit_softcapping=5.0, final_logit_softcapping=3.0),
    "gemma3_text": dict(num_hidden_layers=7, num_key_value_heads=1, head_dim=32, sliding_window=16,
                        query_pre_attn_scalar=32),
}
#: The mixture-of-experts families (issue 61): 8 experts, top-2 (Qwen3-MoE top-3), widths the int4 kernel takes;
#: Qwen2-MoE's shared expert. Qwen3-MoE renormalises its top-k (as released, and as llama.cpp's qwen3moe always
#: does), OLMoE and Qwen2-MoE do not. (llama.cpp's converter refuses Qwen3-MoE's dense `mlp_only_layers`: a test
#: sets them on an HF checkpoint only.)
MOE_FAMILIES: dict[str, dict[str, Any]] = {
    "qwen3_moe": dict(num_hidden_layers=3, num_key_value_heads=2, head_dim=16, num_experts=8, num_experts_per_tok=3,
                      moe_intermediate_size=64, norm_topk_prob=True),
    "mixtral": dict(num_key_value_heads=2, num_local_experts=8, num_experts_per_tok=2),
    "olmoe": dict(num_key_value_heads=2, num_experts=8, num_experts_per_tok=2),
    "qwen2_moe": dict(num_key_value_heads=2, num_experts=8, num_experts_per_tok=2, moe_intermediate_size=64,
                      shared_expert_intermediate_size=128),
    # GLM-4.5: a dense first layer, sigmoid routing with a correction bias and a scaling factor, a shared expert,
    # q/k norms, q/k/v biases, half of each head rotated (no MTP layer: issue 62; one expert group, as llama.cpp's
    # converter writes none: a test sets groups on an HF checkpoint only)
    "glm4_moe": dict(num_hidden_layers=3, num_key_value_heads=2, head_dim=16, n_routed_experts=8,
                     num_experts_per_tok=2, moe_intermediate_size=64, n_shared_experts=1, first_k_dense_replace=1,
                     routed_scaling_factor=2.5, use_qk_norm=True, attention_bias=True, num_nextn_predict_layers=0,
                     vocab_size=49160),
}
#: Families nextn builds as DeepSeek-V3 (not the Llama layer the families above share)
DEEPSEEK_FAMILIES: dict[str, dict[str, Any]] = {
    # GLM-4.7-Flash: DeepSeek-V3's layer (MLA, sigmoid-routed experts, a shared expert) under GLM's config — nextn
    # builds it as the DeepSeek-V3 family; `mlp_layer_types` marks the first layer dense
    "glm4_moe_lite": dict(num_hidden_layers=3, num_key_value_heads=4, n_routed_experts=8, num_experts_per_tok=2,
                          moe_intermediate_size=64, n_shared_experts=1, routed_scaling_factor=1.8, kv_lora_rank=32,
                          q_lora_rank=48, qk_rope_head_dim=16, qk_nope_head_dim=16, v_head_dim=16, vocab_size=49160),
}
#: Hybrid families: Gated DeltaNet layers (recurrent state) between gated attention ones (issue 62). Qwen3.5's
#: pattern, three linear-attention layers then a full one, then one more linear layer after it
HYBRID_FAMILIES: dict[str, dict[str, Any]] = {
    "qwen3_5_text": dict(num_hidden_layers=5, num_key_value_heads=2, head_dim=16, linear_num_key_heads=2,
                         linear_num_value_heads=4, linear_key_head_dim=16, linear_value_head_dim=16,
                         linear_conv_kernel_dim=4),
    # Qwen3-Next: the same layers with Qwen2-MoE's MLP (8 experts, top-2 renormalised, a gated shared expert) and its
    # linear-attention projections fused per key head
    "qwen3_next": dict(num_hidden_layers=5, num_key_value_heads=2, head_dim=16, linear_num_key_heads=2,
                       linear_num_value_heads=4, linear_key_head_dim=16, linear_value_head_dim=16,
                       linear_conv_kernel_dim=4, num_experts=8, num_experts_per_tok=2, moe_intermediate_size=64,
                       shared_expert_intermediate_size=64, norm_topk_prob=True),
    # Qwen3.5-MoE: Qwen3.5's projections with Qwen3-Next's MLP (no dense MLP: every layer's experts)
    "qwen3_5_moe_text": dict(num_hidden_layers=5, num_key_value_heads=2, head_dim=16, linear_num_key_heads=2,
                             linear_num_value_heads=4, linear_key_head_dim=16, linear_value_head_dim=16,
                             linear_conv_kernel_dim=4, num_experts=8, num_experts_per_tok=2, moe_intermediate_size=64,
                             shared_expert_intermediate_size=64),
}
#: gpt-oss (issue 61): attention sinks, a sliding layer (window 16, crossed by the tests' prompts) then a full one,
#: YaRN rope (HF's defaults: factor 32 over 4,096, untruncated), biased router and experts, the clamped SwiGLU at a
#: limit of 1 (HF's 7 would clamp nothing at these activations); head_dim 32, which nextn's fused layer op takes
GPT_OSS: dict[str, dict[str, Any]] = {
    "gpt_oss": dict(num_key_value_heads=2, head_dim=32, sliding_window=16, num_local_experts=8, num_experts_per_tok=2,
                    intermediate_size=64, swiglu_limit=1.0),
}
#: Gemma 4 text (issue 62): sliding layers of 1 KV head of 16 (cache rows half as wide as the full layers'), full
#: ones of 1 KV head of 32 whose V is K's projection (k_eq_v) with proportional rope, per-layer inputs of width 64 (the
#: int4 kernel's K), the last two layers reading layers 3's and 2's KV with double-wide MLPs, soft-capped logits; window
#: 16 (crossed by the tests' prompts); an untied lm_head (tied, a tiny model's greedy output repeats its last input
#: token: the embedding dominates the residual)
GEMMA4: dict[str, dict[str, Any]] = {
    "gemma4_text": dict(num_hidden_layers=6, num_key_value_heads=1, head_dim=16, global_head_dim=32,
                        num_global_key_value_heads=1, sliding_window=16,
                        layer_types=["sliding_attention", "sliding_attention", "full_attention"] * 2,
                        hidden_size_per_layer_input=64, vocab_size_per_layer_input=49152, num_kv_shared_layers=2,
                        use_double_wide_mlp=True, attention_k_eq_v=True, final_logit_softcapping=30.0,
                        tie_word_embeddings=False),
}
#: Families whose tokenizer_config names GPT2Tokenizer (Phi-4's; the converter's phi3 vocab reads it)
_GPT2_CLASS = ("phi3",)
#: Families whose llama.cpp conversion looks up GLM's special tokens (`Glm4Model.set_vocab`, `_set_vocab_glm`)
_GLM_TOKENS = {"glm4": ["<|user|>"], "glm4_moe": ["[gMASK]", "<|user|>", "<|observation|>"],
               "glm4_moe_lite": ["[gMASK]", "<|user|>", "<|observation|>"]}
#: A norm weight's centre: Gemma's RMSNorm scales by (1 + w), so its weights are zero-centred.
_NORM_CENTRE = {"gemma3_text": 0.0, "gemma2": 0.0, "qwen3_5_text": 0.0, "qwen3_next": 0.0,
                "qwen3_5_moe_text": 0.0}
#: Norm weights centred on 1 in a family whose other norms are zero-centred (Qwen3.5's gated norm of each value head)
_UNIT_NORMS = ("linear_attn.norm.weight",)
#: Families whose llama.cpp conversion reads a SentencePiece `tokenizer.model` (Gemma 2's `set_vocab`): one is
#: trained at test time (`sentencepiece_model`); the converter pads its vocabulary to the model's with [PAD] tokens.
_SPM_VOCAB = ("gemma2",)


def tiny_hf_model(model_type: str, seed: int = 0, **overrides: Any):
    """A float32 `transformers` causal LM of `model_type` (a `FAMILIES`, `MOE_FAMILIES`, `DEEPSEEK_FAMILIES`,
    `HYBRID_FAMILIES`, `GPT_OSS` or `GEMMA4` key)
    in eval mode: linear weights N(0, 1/fan_in), embeddings N(0, 1), norm weights centre ± 0.1, so activations stay
    O(1) and the top logits are apart by far more than float32 rounding."""
    from transformers import AutoConfig, AutoModelForCausalLM

    family = {**FAMILIES, **MOE_FAMILIES, **DEEPSEEK_FAMILIES, **HYBRID_FAMILIES, **GPT_OSS, **GEMMA4}[model_type]
    cfg = AutoConfig.for_model(model_type, **{**_BASE, **family, **overrides})
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32).eval()
    _draw(model, _NORM_CENTRE.get(model_type, 1.0))
    return model


def _draw(model: torch.nn.Module, centre: float) -> None:
    """`tiny_hf_model`'s weights: linear weights N(0, 1/fan_in), embeddings N(0, 1), norm weights `centre` ± 0.1."""
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() == 1:
                p.copy_((1.0 if name.endswith(_UNIT_NORMS) else centre) + 0.1 * torch.randn_like(p))
            elif p.dim() == 3:  # a depthwise conv [channels, 1, taps]
                p.normal_(0.0, p.shape[-1] ** -0.5)
            elif "embed_tokens" in name:
                p.normal_(0.0, 1.0)
            else:
                p.normal_(0.0, p.shape[1] ** -0.5)
        for name, b in model.named_buffers():  # GLM-4.5's router: HF initialises it to 0, which would test nothing
            if name.endswith("e_score_correction_bias"):
                b.normal_(0.0, 0.1)
            if name.endswith("layer_scalar"):  # Gemma 4's: 1 in HF's init, which would test nothing
                b.uniform_(0.5, 1.5)


def save_tiny_qwen3_5_vl(out_dir: Path, tokenizer_dir: Path, seed: int = 0):
    """A tiny `Qwen3_5ForConditionalGeneration` (the released Qwen3.5 checkpoints' architecture: the text model under
    `model.language_model.`, a one-block vision tower under `model.visual.`) saved in `out_dir` with the tokenizer
    files of `tokenizer_dir`, its text model `HYBRID_FAMILIES["qwen3_5_text"]`, weights drawn as `tiny_hf_model`'s;
    returns the model (float32, eval)."""
    from transformers import Qwen3_5Config, Qwen3_5ForConditionalGeneration

    cfg = Qwen3_5Config(text_config={**_BASE, **HYBRID_FAMILIES["qwen3_5_text"]},
                        vision_config=dict(depth=1, hidden_size=32, intermediate_size=64, num_heads=2,
                                           out_hidden_size=64))
    torch.manual_seed(seed)
    model = Qwen3_5ForConditionalGeneration(cfg).eval()
    _draw(model, 0.0)
    model.save_pretrained(out_dir)
    for f in tokenizer_dir.iterdir():
        shutil.copy(f, out_dir / f.name)
    return model


def save_tiny_gemma4_vl(out_dir: Path, tokenizer_dir: Path, seed: int = 0):
    """A tiny `Gemma4ForConditionalGeneration` (Gemma 4's released architecture: the text model under
    `model.language_model.`, a one-layer vision tower under `model.vision_tower.` and its `model.embed_vision`) saved
    in `out_dir` with the tokenizer files of `tokenizer_dir`, its text model `GEMMA4["gemma4_text"]`, weights drawn
    as `tiny_hf_model`'s; returns the model (float32, eval)."""
    from transformers import Gemma4Config, Gemma4ForConditionalGeneration

    cfg = Gemma4Config(text_config={**_BASE, **GEMMA4["gemma4_text"], "pad_token_id": 0}, audio_config=None,
                       tie_word_embeddings=False,
                       vision_config=dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                          num_attention_heads=2, num_key_value_heads=2, head_dim=16))
    torch.manual_seed(seed)
    model = Gemma4ForConditionalGeneration(cfg).eval()
    _draw(model, 1.0)
    model.save_pretrained(out_dir)
    for f in tokenizer_dir.iterdir():
        shutil.copy(f, out_dir / f.name)
    return model


def smollm2_tokenizer(shared: Path, out_dir: Path) -> list[str]:
    """Write SmolLM2-135M's tokenizer files (from the GGUF under `shared`/data/models) into `out_dir`.

    Raises:
        FileNotFoundError: the GGUF is absent.
    """
    from nextn.build.gguf_reader import GGUFCheckpoint

    gguf = shared / "data" / "models" / "smollm2-135m-instruct" / "SmolLM2-135M-Instruct.Q4_1.gguf"
    if not gguf.is_file():
        raise FileNotFoundError(gguf)
    with GGUFCheckpoint(gguf) as ckpt:
        return ckpt.write_tokenizer_files(out_dir)


def save_tiny(model_type: str, out_dir: Path, tokenizer_dir: Path, seed: int = 0, **overrides: Any):
    """`tiny_hf_model` saved as an HF checkpoint in `out_dir` with the tokenizer files of `tokenizer_dir`; returns
    the model."""
    model = tiny_hf_model(model_type, seed, **overrides)
    model.save_pretrained(out_dir)
    for f in tokenizer_dir.iterdir():
        shutil.copy(f, out_dir / f.name)
    if model_type in _SPM_VOCAB:
        sentencepiece_model(out_dir / "tokenizer.model")
    add_special_tokens(out_dir, model_type)  # GLM's, which the converter's glm4 vocabulary names
    if model_type in _GPT2_CLASS:  # llama.cpp's converter reads a SentencePiece model unless the class says GPT-2
        config = out_dir / "tokenizer_config.json"
        config.write_text(json.dumps({**json.loads(config.read_text()), "tokenizer_class": "GPT2Tokenizer"}))
    return model


def sentencepiece_model(path: Path, vocab_size: int = 200) -> Path:
    """Train a small SentencePiece BPE model (`vocab_size` pieces) on generated English-like text and write it to
    `path` (what llama.cpp's converter reads as a SentencePiece vocabulary); returns `path`."""
    import io
    import random

    import sentencepiece as spm

    rng = random.Random(0)
    words = ["the", "model", "token", "draft", "verify", "cache", "block", "layer", "attention", "window", "soft",
             "cap", "gemma", "step", "accept", "reject", "speculative", "decode", "prefill", "batch"]
    lines = [" ".join(rng.choice(words) for _ in range(12)) for _ in range(400)]
    model = io.BytesIO()
    spm.SentencePieceTrainer.train(sentence_iterator=iter(lines), model_writer=model, vocab_size=vocab_size,
                                   model_type="bpe", character_coverage=1.0, minloglevel=2)
    path.write_bytes(model.getvalue())
    return path


def gemma_tokenizer(out_dir: Path) -> int:
    """Write a Gemma-style tokenizer (SentencePiece BPE with byte fallback, `sentencepiece_model`'s pieces, as HF's
    `GemmaTokenizer` saves it: what llama.cpp's converter reads for Gemma 4, `gguf.LlamaHfVocab`) into `out_dir`;
    returns its size (the tiny model's vocab_size, so that the GGUF's token list and embedding agree)."""
    from transformers import GemmaTokenizer

    out_dir.mkdir(parents=True, exist_ok=True)
    sentencepiece_model(out_dir / "tokenizer.model")
    tokenizer = GemmaTokenizer.from_pretrained(out_dir)
    tokenizer.save_pretrained(out_dir)
    return len(tokenizer)


def add_special_tokens(tokenizer_dir: Path, model_type: str) -> None:
    """Add the special tokens llama.cpp's converter looks up for `model_type` (GLM's: `_GLM_TOKENS`) to the tokenizer
    files in `tokenizer_dir`; nothing for another family."""
    if model_type in _GLM_TOKENS:
        _add_special_tokens(tokenizer_dir, _GLM_TOKENS[model_type])


def _add_special_tokens(tokenizer_dir: Path, tokens: list[str]) -> None:
    """Add special tokens to the tokenizer files in `tokenizer_dir` (ids past SmolLM2's 49,152: the tiny models'
    embeddings have a few spare rows for them)."""
    from tokenizers import AddedToken, Tokenizer

    tok = Tokenizer.from_file(str(tokenizer_dir / "tokenizer.json"))
    tok.add_special_tokens([AddedToken(t, special=True) for t in tokens])
    tok.save(str(tokenizer_dir / "tokenizer.json"))


def add_mtp_layer(hf_dir: Path, seed: int = 1) -> None:
    """Give the checkpoint in `hf_dir` one MTP module as released GLM-4.5 / DeepSeek-V3 checkpoints store it
    (`model.layers.{N}`: `enorm`, `hnorm`, `eh_proj`, `shared_head.norm` and a decoder block shaped as layer N − 1),
    random as `tiny_hf_model` draws weights, and set `num_nextn_predict_layers` to 1 (`transformers` builds none of it;
    its `MtpModel.from_pretrained` reads it back)."""
    from safetensors.torch import load_file, save_file

    path = hf_dir / "model.safetensors"
    tensors = load_file(path)
    config = json.loads((hf_dir / "config.json").read_text())
    n, hidden = config["num_hidden_layers"], config["hidden_size"]
    gen = torch.Generator().manual_seed(seed)
    last = f"model.layers.{n - 1}."
    new = {f"model.layers.{n}.{k}": torch.empty(s) for k, s in (("enorm.weight", (hidden,)), ("hnorm.weight", (hidden,)),
                                                               ("eh_proj.weight", (hidden, 2 * hidden)),
                                                               ("shared_head.norm.weight", (hidden,)))}
    new.update({f"model.layers.{n}.{k[len(last):]}": torch.empty_like(v) for k, v in tensors.items()
                if k.startswith(last)})
    for name, t in new.items():
        if name.endswith("e_score_correction_bias"):
            t.copy_(0.1 * torch.randn(t.shape, generator=gen))
        elif t.dim() == 1:
            t.copy_(1.0 + 0.1 * torch.randn(t.shape, generator=gen))
        else:
            t.copy_(torch.randn(t.shape, generator=gen) * t.shape[1] ** -0.5)
    save_file({**tensors, **new}, path, metadata={"format": "pt"})
    (hf_dir / "config.json").write_text(json.dumps({**config, "num_nextn_predict_layers": 1}, indent=2))


def add_qwen3_5_mtp(hf_dir: Path, seed: int = 1) -> None:
    """Give the Qwen3.5 checkpoint in `hf_dir` the MTP layer as released Qwen3.5 checkpoints store it (`mtp.fc`
    [hidden, 2 · hidden] over [embedding; hidden], `mtp.pre_fc_norm_embedding`, `mtp.pre_fc_norm_hidden`,
    `mtp.layers.0.*` — a full-attention decoder layer — and `mtp.norm`; zero-centred norms) and set
    `mtp_num_hidden_layers` to 1; `transformers` ignores `mtp.*` when it loads the model."""
    from safetensors.torch import load_file, save_file

    path = hf_dir / "model.safetensors"
    tensors = load_file(path)
    config = json.loads((hf_dir / "config.json").read_text())
    hidden = config["hidden_size"]
    full = config["layer_types"].index("full_attention")
    gen = torch.Generator().manual_seed(seed)
    block = f"model.layers.{full}."
    new = {f"mtp.{k}": torch.empty(s) for k, s in (("pre_fc_norm_embedding.weight", (hidden,)),
                                                  ("pre_fc_norm_hidden.weight", (hidden,)),
                                                  ("fc.weight", (hidden, 2 * hidden)), ("norm.weight", (hidden,)))}
    new.update({f"mtp.layers.0.{k[len(block):]}": torch.empty_like(v) for k, v in tensors.items()
                if k.startswith(block)})
    for t in new.values():
        if t.dim() == 1:
            t.copy_(0.1 * torch.randn(t.shape, generator=gen))
        else:
            t.copy_(torch.randn(t.shape, generator=gen) * t.shape[1] ** -0.5)
    save_file({**tensors, **new}, path, metadata={"format": "pt"})
    (hf_dir / "config.json").write_text(json.dumps({**config, "mtp_num_hidden_layers": 1}, indent=2))
