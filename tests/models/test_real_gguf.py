"""Real quantized GGUFs: nextn in float32 is token-identical to `transformers` loading the same file in float32.

SmolLM2-135M-Instruct (llama architecture, Q4_1 + a Q8_0 embedding, tied) from ../shared/data,
Qwen2.5-Coder-0.5B-Instruct (qwen2 architecture: q/k/v biases, Q4_K_M = Q5_0/Q8_0/Q4_K/Q6_K, untied) and Gemma-3-270M
(gemma3: sandwich norms stored as 1 + w, q/k norms, sliding-window layers, a 262k vocabulary, tied) from
`runs/models` (fetched by ../shared/models/fetch_models.py; skipped when absent). Per model, `transformers` is loaded
and the engine built once (module fixtures): the engine's tensors equal transformers' bit for bit (q/k rows
un-permuted for llama, untouched for qwen2; a tied embedding stored once), and greedy outputs on chat-templated
MT-bench and HumanEval prompts are equal token for token (the full 16 + 16 prompts × 64 tokens:
`python -m nextn.bench.real_models agreement`).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from nextn.bench.real_models import (
    SHARED_DATA, chat_prompt_ids, fitting_max_seq_len, load_llm, load_prompt_texts, load_transformers, nextn_greedy, transformers_greedy,
    up_to_first_eos,
)  # fmt: skip
from nextn.build.engine_builder import build_engine

ROOT = Path(__file__).resolve().parents[2]
#: name → (folder holding the .gguf, how to get it, MT-bench and as many HumanEval prompts, new tokens each).
MODELS = {
    "smollm2-135m": (SHARED_DATA / "models" / "smollm2-135m-instruct", "../shared/data is not checked out", 2, 24),
    "qwen2.5-coder-0.5b": (ROOT / "runs" / "models" / "qwen2.5-coder-0.5b",
                           "fetch it: python ../shared/models/fetch_models.py qwen2.5-coder-0.5b --dest runs/models",
                           1, 16),
    "gemma-3-270m": (ROOT / "runs" / "models" / "gemma-3-270m",
                     "fetch it: python ../shared/models/fetch_models.py gemma-3-270m --dest runs/models", 2, 24),
}

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module", params=list(MODELS))
def real(request, tmp_path_factory):
    """(gguf file, transformers model fp32, its tokenizer, nextn fp32 engine dir, prompts, max tokens) for one model,
    built once."""
    folder, how, num_prompts, max_tokens = MODELS[request.param]
    found = sorted(folder.glob("*.gguf"))
    if not found or not (SHARED_DATA / "prompts" / "mt_bench.jsonl").is_file():
        pytest.skip(f"{request.param} GGUF or the prompt sets are absent ({folder}): {how}")
    gguf_file = found[0]
    torch.manual_seed(0)
    hf, tok = load_transformers(gguf_file, torch.float32)
    engine = tmp_path_factory.mktemp(request.param) / "engine"
    build_engine(gguf_file, engine, dtype="float32", max_batch_size=4, max_seq_len=1024, progress=False)
    prompts = chat_prompt_ids(tok, load_prompt_texts(num_prompts, num_prompts))
    yield gguf_file, hf, tok, engine, prompts, max_tokens
    del hf


def test_engine_tensors_equal_transformers(real):
    gguf_file, hf, _, engine, _, _ = real
    ours = load_file(str(engine / "model.safetensors"))
    ref = hf.state_dict()
    tied = hf.config.tie_word_embeddings
    assert ("lm_head.weight" in ours) is not tied  # a tied embedding is stored once
    assert sorted(ours) == sorted(n for n in ref if not (tied and n == "lm_head.weight"))
    for name, t in ours.items():
        assert t.dtype == torch.float32 and torch.equal(t, ref[name]), name
    if "qwen" in gguf_file.name:
        assert "model.layers.0.self_attn.q_proj.bias" in ours and "model.layers.0.self_attn.o_proj.bias" not in ours


def test_greedy_float32_is_token_identical_to_transformers(real):
    _, hf, tok, engine, prompts, max_tokens = real
    llm = load_llm(engine, max_batch_size=4, max_seq_len=fitting_max_seq_len(prompts, max_tokens))
    ours = nextn_greedy(llm, prompts, max_tokens)
    eos = set(llm.engine.eos_ids) | {hf.generation_config.eos_token_id}
    for prompt, got in zip(prompts, ours):
        want = transformers_greedy(hf, [prompt], max_tokens)[0]  # batch 1: no padding in the oracle
        assert up_to_first_eos(got, eos) == up_to_first_eos(want, eos), tok.decode(prompt)[-80:]
        assert len(up_to_first_eos(got, eos)) >= 8  # a real comparison, not an immediate EOS
