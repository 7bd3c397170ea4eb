"""A random `transformers` model as a quantized GGUF, made the way the benchmark models are (`moe_model.py`,
`gemma4_model.py`): weights N(0, 1/fan_in), embeddings N(0, 1), 1-D parameters (norms) 1 ± 0.1 — activations stay
O(1), so a router spreads tokens the way a trained one's load balancing does; the figures are speeds, not text —
saved, converted to bf16 by llama.cpp's own `convert_hf_to_gguf.py`, then quantized by its `llama-quantize`.
"""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import torch


def write(model: torch.nn.Module, hf_dir: Path, out: Path, name: str, qtype: str, llama_cpp: Path) -> Path:
    """Draw `model`'s weights (seed 0), save it into `hf_dir` (holding its tokenizer already), convert and quantize
    it to `out`/`name`-`qtype`.gguf; the checkpoint and the bf16 GGUF are removed after. Returns the GGUF's path.

    Raises:
        SystemExit: llama-quantize is not built under `llama_cpp`.
    """
    from nextn.testing.llama_cpp_converter import convert

    quantize = llama_cpp / "build" / "bin" / "llama-quantize"
    if not quantize.is_file():
        raise SystemExit(f"{quantize} is absent: cmake --build {llama_cpp / 'build'} --target llama-quantize")
    torch.manual_seed(0)
    with torch.no_grad():
        for pname, p in model.named_parameters():
            if p.dim() == 1:
                p.copy_(1.0 + 0.1 * torch.randn_like(p))
            elif "embed_tokens" in pname:
                p.normal_(0.0, 1.0)
            else:
                p.normal_(0.0, p.shape[-1] ** -0.5)
    model.save_pretrained(hf_dir)
    bf16 = out / f"{name}-bf16.gguf"
    convert(hf_dir, bf16, "bf16", llama_cpp)
    q = out / f"{name}-{qtype}.gguf"
    subprocess.run([str(quantize), str(bf16), str(q), qtype], check=True, stdout=subprocess.DEVNULL)
    shutil.rmtree(hf_dir)
    bf16.unlink()
    return q
