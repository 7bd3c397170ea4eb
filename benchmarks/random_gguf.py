"""A random `transformers` model as a quantized GGUF, made the way the benchmark models are (`moe_model.py`,
`gemma4_model.py`): weights N(0, 1/fan_in), embeddings N(0, 1), 1-D parameters (norms) 1 ± 0.1 — activations stay
O(1), so a router spreads tokens the way a trained one's load balancing does; the figures are speeds, not text —
saved, converted to bf16 by llama.cpp's own `convert_hf_to_gguf.py`, then quantized by its `llama-quantize`.
"""

from __future__ import annotations

import json
import shutil
import subprocess
from pathlib import Path

import torch


def write(model: torch.nn.Module, hf_dir: Path, out: Path, name: str, qtype: str, llama_cpp: Path,
          converter_model_type: str | None = None, options: tuple[str, ...] = ()) -> Path:
    """Draw `model`'s weights (seed 0), save it into `hf_dir` (holding its tokenizer already), convert and quantize
    it to `out`/`name`-`qtype`.gguf; the checkpoint and the bf16 GGUF are removed after. Returns the GGUF's path.
    `converter_model_type`: the model_type config.json shows the converter (which reads the vocabulary through
    `transformers`' AutoTokenizer: for Qwen3.5-MoE that would rebuild Qwen3.5's own pre-tokenizer over SmolLM2's
    vocabulary, which the converter does not know; it dispatches on `architectures`, unchanged); `options`: more of
    the converter's flags.

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
    if converter_model_type is not None:
        config = json.loads((hf_dir / "config.json").read_text())
        (hf_dir / "config.json").write_text(json.dumps({**config, "model_type": converter_model_type}, indent=2))
    bf16 = out / f"{name}-bf16.gguf"
    convert(hf_dir, bf16, "bf16", llama_cpp, options)
    q = out / f"{name}-{qtype}.gguf"
    subprocess.run([str(quantize), str(bf16), str(q), qtype], check=True, stdout=subprocess.DEVNULL)
    shutil.rmtree(hf_dir)
    bf16.unlink()
    return q
