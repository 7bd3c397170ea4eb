"""A tiny seeded `transformers` Llama for tests: the same small shape everywhere, logits peaked for greedy tests."""

from __future__ import annotations

import torch


def tiny_hf_llama(num_layers: int = 2, vocab_size: int = 300, seed: int = 0, lm_head_scale: float = 20.0,
                  tied: bool = False, hidden_size: int = 64, intermediate_size: int = 96):
    """A `transformers` `LlamaForCausalLM` (hidden 64, FFN 96 unless given, 4 heads / 2 KV heads, 256 positions,
    untied unless `tied`: then the lm_head is the embedding), eval mode.

    `lm_head_scale` multiplies the lm_head weights: peaked logits, so greedy near-ties (and tokens that flip on
    rounding) do not occur.
    """
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(vocab_size=vocab_size, hidden_size=hidden_size, intermediate_size=intermediate_size,
                      num_hidden_layers=num_layers,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                      tie_word_embeddings=tied)
    torch.manual_seed(seed)
    hf = LlamaForCausalLM(cfg).eval()
    with torch.no_grad():
        hf.lm_head.weight.mul_(lm_head_scale)
    return hf
