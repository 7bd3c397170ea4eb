"""A Llama-family checkpoint saved by `transformers` (GQA, llama3 rope scaling) builds into an engine whose greedy
output equals `transformers` `generate`, and Medusa on it stays lossless."""

from __future__ import annotations

import json

import torch
from safetensors.torch import save_file
from transformers import LlamaConfig
from transformers import LlamaForCausalLM as HFLlama

from nextn import LLM, SamplingParams
from nextn.build.engine_builder import build_engine
from nextn.models.medusa import MedusaHeads


def test_hf_llama_checkpoint_builds_and_matches_transformers(tmp_path):
    cfg = LlamaConfig(vocab_size=300, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, max_position_embeddings=256, tie_word_embeddings=False,
                      rope_parameters={"rope_type": "llama3", "rope_theta": 10000.0, "factor": 4.0,
                                       "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                       "original_max_position_embeddings": 32})
    torch.manual_seed(0)
    hf = HFLlama(cfg).eval()
    with torch.no_grad():
        hf.lm_head.weight.mul_(20)  # peaked logits: greedy ties impossible
    hf.save_pretrained(tmp_path / "ckpt")
    torch.manual_seed(1)
    heads = MedusaHeads(3, 1, 64, 300)
    (tmp_path / "heads").mkdir()
    save_file({k: v.contiguous() for k, v in heads.state_dict().items()}, str(tmp_path / "heads" / "medusa_lm_head.safetensors"))
    build_engine(tmp_path / "ckpt", tmp_path / "engine", progress=False, max_seq_len=128,
                 medusa_model_dir=tmp_path / "heads")
    manifest = json.loads((tmp_path / "engine" / "manifest.json").read_text())
    assert manifest["architecture"] == "LlamaForCausalLM" and manifest["speculative"]["method"] == "medusa"
    prompts = [[5, 6, 7, 8], [9], list(range(20, 60))]
    sp = SamplingParams(max_tokens=50, ignore_eos=True)
    plain = LLM(tmp_path / "engine", speculative_config=None).generate(prompts, sp)
    for p, out in zip(prompts, plain):
        ref = hf.generate(torch.tensor([p]), max_new_tokens=50, min_new_tokens=50, do_sample=False, pad_token_id=0)
        assert out.outputs[0].token_ids == ref[0, len(p):].tolist()  # crosses the llama3 original context (32)
    medusa = LLM(tmp_path / "engine", speculative_config={"decoding_type": "Medusa",
                                                        "medusa_choices": [[0], [1], [0, 0], [0, 0, 0]]})
    assert [o.outputs[0].token_ids for o in medusa.generate(prompts, sp)] == [o.outputs[0].token_ids for o in plain]
