"""Reader of a llama.cpp GGUF file (Llama architecture) as an HF-named checkpoint, tokenizer included.

A GGUF holds the config as metadata under llama.cpp key names (`llama.embedding_length`, ...), the tensors under
llama.cpp names (`blk.N.attn_q.weight`, ...) and the tokenizer as arrays (`tokenizer.ggml.tokens/scores/token_type`).
`GGUFCheckpoint` reads it through the PyPI `gguf` library (`gguf.GGUFReader`, memory-mapped) and presents what
`CheckpointReader` presents for safetensors: `hf_config` (a `LlamaForCausalLM` config.json dict), `names`, `has`,
`get` (fp32 tensors by HF name), so `nextn.models.llama.weights.to_runtime` builds an engine from either.

llama.cpp's `convert_hf_to_gguf.py` (`LlamaModel.permute`) reorders the rows of q_proj and k_proj within each head
from HF's rotate-half RoPE layout (pairs (i, i + d/2)) to ggml's interleaved one (pairs (2i, 2i + 1)):
`w.reshape(heads, 2, d // 2, H).swapaxes(1, 2)`. `get` applies the inverse, `reshape(heads, d // 2, 2, H)
.swapaxes(1, 2)`, as `transformers` does when it loads a GGUF (checked against it in tests/build/test_gguf_reader.py).
"""

from __future__ import annotations

import re
from functools import cached_property
from pathlib import Path
from typing import Any

import numpy as np
import torch

from nextn.build.checkpoint import CheckpointError
from nextn.models.llama.config import LlamaModelConfig

SUPPORTED_ARCHITECTURES = ("llama",)
#: ggml tensor types read (converted to fp32); quantized types are refused.
SUPPORTED_TYPES = ("F32", "F16", "BF16")
#: llama.cpp writes 0xFFFFFFFF (-1 as uint32) for "no such token".
NO_TOKEN = 2**32 - 1
_GLOBAL_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_BLOCK_NAMES = {
    "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj", "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj", "attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm",
}  # fmt: skip
_BLOCK_RE = re.compile(r"blk\.(\d+)\.(\w+)\.(weight|bias)")


def hf_name(gguf_name: str) -> str | None:
    """The HF name of a llama.cpp tensor name (`blk.3.attn_q.weight` → `model.layers.3.self_attn.q_proj.weight`)."""
    if gguf_name in _GLOBAL_NAMES:
        return _GLOBAL_NAMES[gguf_name]
    m = _BLOCK_RE.fullmatch(gguf_name)
    if m and m[2] in _BLOCK_NAMES:
        return f"model.layers.{m[1]}.{_BLOCK_NAMES[m[2]]}.{m[3]}"
    return None


def unpermute_rope_rows(w: torch.Tensor, num_heads: int) -> torch.Tensor:
    """Undo llama.cpp's q/k row permutation: [heads · d, ...] interleaved-pair rows → HF rotate-half rows."""
    d = w.shape[0] // num_heads
    return w.reshape(num_heads, d // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _resolve_file(path: Path) -> Path:
    if path.is_dir():
        found = sorted(path.glob("*.gguf"))
        if len(found) != 1:
            raise CheckpointError(f"{path} must hold exactly one .gguf file, found {len(found)}"
                                  + (f": {[f.name for f in found]}" if found else ""))
        return found[0]
    if not path.is_file():
        raise CheckpointError(f"GGUF checkpoint {path} does not exist")
    return path


class GGUFCheckpoint:
    """Reads a Llama GGUF by HF tensor name.

    Args:
        path: a `.gguf` file, or a directory holding exactly one.
    Raises:
        CheckpointError: the path is missing or holds no (or several) `.gguf` files, the file is not a GGUF, its
            architecture is not Llama, it lacks a required metadata key, or it holds a tensor nextn cannot place
            (each message names the file, key or tensor).
    """

    def __init__(self, path: str | Path) -> None:
        import gguf  # deferred: only GGUF builds need it

        self.path = _resolve_file(Path(path))
        self.model_dir = self.path.parent
        try:
            self._reader = gguf.GGUFReader(str(self.path))
        except Exception as e:  # gguf raises ValueError for a bad magic, OSError/ValueError for empty files
            raise CheckpointError(f"{self.path} is not a readable GGUF file: {e}") from e
        arch = self._field("general.architecture")
        if arch not in SUPPORTED_ARCHITECTURES:
            raise CheckpointError(f"{self.path}: unsupported GGUF architecture {arch!r}; nextn reads "
                                  f"{', '.join(SUPPORTED_ARCHITECTURES)}")
        self._tensors: dict[str, Any] = {}
        for t in self._reader.tensors:
            name = hf_name(t.name)
            if name is None:
                hint = (" (Llama-3 rope scaling stored as a rope_freqs tensor is not supported)"
                        if t.name.startswith("rope_freqs") else "")
                raise CheckpointError(f"{self.path}: unexpected tensor {t.name!r} for a Llama GGUF{hint}")
            self._tensors[name] = t
        self.hf_config: dict[str, Any] = self._hf_config()

    # Metadata ----------------------------------------------------------------------------------------
    def _field(self, key: str, default: Any = ..., *, array: bool = False) -> Any:
        f = self._reader.fields.get(key)
        if f is None:
            if default is ...:
                raise CheckpointError(f"{self.path} lacks GGUF metadata key {key!r}")
            return default
        value = f.contents()
        return list(value) if array else value

    def _token_id(self, key: str) -> int | None:
        value = self._field(f"tokenizer.ggml.{key}", None)
        return None if value is None or int(value) == NO_TOKEN else int(value)

    def _hf_config(self) -> dict[str, Any]:
        """A `LlamaForCausalLM` config.json dict from the `llama.*` and `tokenizer.ggml.*` metadata."""
        k = lambda key, default=...: self._field(f"llama.{key}", default)  # noqa: E731
        heads = int(k("attention.head_count"))
        hidden = int(k("embedding_length"))
        tokens = self._field("tokenizer.ggml.tokens", None, array=True)
        embed = self._tensors.get("model.embed_tokens.weight")
        vocab = len(tokens) if tokens is not None else (int(embed.shape[1]) if embed is not None else None)
        if vocab is None:
            raise CheckpointError(f"{self.path} has neither tokenizer.ggml.tokens nor token_embd.weight: "
                                  "cannot tell the vocabulary size")
        first = embed.tensor_type.name if embed is not None else "F32"
        return {
            "architectures": ["LlamaForCausalLM"],
            "model_type": "llama",
            "vocab_size": vocab,
            "hidden_size": hidden,
            "intermediate_size": int(k("feed_forward_length")),
            "num_hidden_layers": int(k("block_count")),
            "num_attention_heads": heads,
            "num_key_value_heads": int(k("attention.head_count_kv", heads)),
            "head_dim": int(k("attention.key_length", hidden // heads)),
            "rms_norm_eps": float(k("attention.layer_norm_rms_epsilon", 1e-5)),
            "rope_theta": float(k("rope.freq_base", 10000.0)),
            "rope_scaling": None,
            "max_position_embeddings": int(k("context_length", 2048)),
            "tie_word_embeddings": "lm_head.weight" not in self._tensors,
            "attention_bias": "model.layers.0.self_attn.q_proj.bias" in self._tensors,
            "bos_token_id": self._token_id("bos_token_id"),
            "eos_token_id": self._token_id("eos_token_id"),
            "torch_dtype": {"F16": "float16", "BF16": "bfloat16"}.get(first, "float32"),
        }

    @cached_property
    def model_config(self) -> LlamaModelConfig:
        return LlamaModelConfig.from_hf(self.hf_config)

    # CheckpointReader's surface ------------------------------------------------------------------------
    is_fp8 = False
    index_file = None

    @property
    def files(self) -> list[Path]:
        return [self.path]

    def names(self) -> list[str]:
        return list(self._tensors)

    def has(self, name: str) -> bool:
        return name in self._tensors

    def get(self, name: str) -> torch.Tensor:
        """Tensor `name` (HF name) as fp32, in HF's layout (q/k rows un-permuted).

        Raises:
            KeyError: no such tensor. CheckpointError: its ggml type is quantized (the message names tensor and type).
        """
        t = self._tensors.get(name)
        if t is None:
            raise KeyError(f"{name!r} not in {self.path}")
        kind = t.tensor_type.name
        if kind not in SUPPORTED_TYPES:
            raise CheckpointError(f"{self.path}: tensor {t.name!r} ({name}) is {kind}-quantized; nextn reads "
                                  f"{', '.join(SUPPORTED_TYPES)} GGUFs (convert with --outtype f16 or f32)")
        if kind == "BF16":
            import gguf

            data = gguf.dequantize(t.data, t.tensor_type)
        else:
            data = np.asarray(t.data, dtype=np.float32)
        w = torch.from_numpy(np.array(data, dtype=np.float32).reshape([int(n) for n in reversed(t.shape)]))
        if ".self_attn.q_proj." in name:
            w = unpermute_rope_rows(w, self.hf_config["num_attention_heads"])
        elif ".self_attn.k_proj." in name:
            w = unpermute_rope_rows(w, self.hf_config["num_key_value_heads"])
        return w

    def close(self) -> None:
        self._reader = None  # drops the memory map with the tensors' views
        self._tensors = {}

    def __enter__(self) -> "GGUFCheckpoint":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"GGUFCheckpoint({str(self.path)!r}, tensors={len(self._tensors)})"

    # Tokenizer (nextn.build.gguf_tokenizer) -------------------------------------------------------------------
    def tokenizer(self):
        """The GGUF's tokenizer as a `transformers` fast tokenizer (`gguf_tokenizer.build_tokenizer`)."""
        from nextn.build.gguf_tokenizer import build_tokenizer

        return build_tokenizer(self._reader, self.path)

    def write_tokenizer_files(self, out_dir: str | Path) -> list[str]:
        """Save tokenizer files and generation_config.json into `out_dir` (`gguf_tokenizer.write_tokenizer_files`);
        returns the tokenizer file names written (sorted)."""
        from nextn.build.gguf_tokenizer import write_tokenizer_files

        return write_tokenizer_files(self._reader, self.path, out_dir)
