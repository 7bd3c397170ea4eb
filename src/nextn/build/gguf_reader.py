"""Reader of a llama.cpp GGUF file of a dense or MoE family (`gguf_families.py`: llama, qwen2, qwen3, gemma3, ...,
qwen3moe, qwen2moe, olmoe, glm4moe, Mixtral as llama with experts), float or quantized, as an HF-named checkpoint.
An MoE layer's experts are one 3-D tensor each (`blk.N.ffn_{gate,up,down}_exps`, [E, out, in]): each expert reads as
its own HF-named slice (`model.layers.N.mlp.experts.{e}.gate_proj.weight`), its 4-bit blocks included.

A GGUF holds the config as metadata under llama.cpp key names (`llama.embedding_length`, `qwen2.rope.freq_base`, ...),
the tensors under llama.cpp names (`blk.N.attn_q.weight`, ...) in ggml types (F32/F16/BF16 or block-quantized: Q4_1,
Q8_0, Q4_K, Q6_K, ...) and the tokenizer as arrays (`tokenizer.ggml.*`, rebuilt by `nextn.build.gguf_tokenizer`).
`GGUFCheckpoint` reads it through the PyPI `gguf` library (`gguf.GGUFReader`, memory-mapped) and presents what
`CheckpointReader` presents for safetensors: `hf_config` (an HF config.json dict of the family),
`names`, `has`, `get` (fp32 tensors by HF name), so `nextn.models.llama.weights.to_runtime` builds an engine from
either. Every ggml type is dequantized by `gguf.quants.dequantize` (llama.cpp's own Python reference, the function
`transformers` uses for GGUFs), never by nextn code; `supported_ggml_types()` lists the types it implements.

Qwen2 is the Llama family plus q/k/v biases (`qkv_bias`), its own rope theta and vocabulary. Row order of q and k:
llama.cpp's `convert_hf_to_gguf.py` (`LlamaModel.modify_tensors` → `LlamaModel.permute`) reorders the rows of
q_proj and k_proj (weights and biases) within each head from HF's rotate-half RoPE layout (pairs (i, i + d/2)) to
ggml's interleaved one (pairs (2i, 2i + 1)): `w.reshape(heads, 2, d // 2, ...).swapaxes(1, 2)`. `get` applies the
inverse, `reshape(heads, d // 2, 2, ...).swapaxes(1, 2)`, as `transformers` does (`LlamaTensorProcessor`). Its
`Qwen2Model` does not permute (llama.cpp runs qwen2 with NEOX-style rotate-half RoPE) and `transformers` reads qwen2
tensors unchanged, so neither does `get` (nor for Qwen3 and Gemma 3). Gemma's norm weights are stored as 1 + w
(`gguf_families.norm_shift`). Checked against `transformers` in tests/build/test_gguf_reader.py and
tests/models/test_families.py.
"""

from __future__ import annotations

from functools import cache, cached_property
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from nextn.build import gguf_deepseek2, gguf_gemma4, gguf_qwen35
from nextn.build.checkpoint import CheckpointError
from nextn.build.ggml_blocks import q4_k_two_level, unpermute_rope_rows
from nextn.build.gguf_header import open_gguf, peek_architecture
from nextn.build.gguf_tokenizer import check_vocabulary
from nextn.build.tensor_inventory import check_layer_counts
from nextn.models.config import MAX_SIZE
from nextn.models.model_config import ModelConfig

if TYPE_CHECKING:
    from nextn.quantization.weight_only import QuantConfig

from nextn.build.gguf_families import (
    BLOCK_NAMES, FACTOR_TENSORS, LINEAR_ATTENTION_ARCHITECTURES, PARTIAL_ROTARY_ARCHITECTURES,
    PERMUTED_ARCHITECTURES, SUPPORTED_ARCHITECTURES, TENSOR_NAMES, V_REORDERED_ARCHITECTURES, expert_names,
    factor_values, family_config, global_names, hf_name, moe_config, norm_shift, rope_scaling_config, unsupported,
    BLOCK_RE, hf_shape,
)  # fmt: skip

#: ggml float types (read as they are, widened to fp32).
FLOAT_TYPES = ("F32", "F16", "BF16")
#: ggml types of about 4 bits a weight: a file mostly in them builds W4A16 by default (`engine_settings.auto_quant_algo`)
FOUR_BIT_TYPES = frozenset({"Q4_0", "Q4_1", "Q4_K", "IQ4_NL", "IQ4_XS", "MXFP4"})
#: llama.cpp writes 0xFFFFFFFF (-1 as uint32) for "no such token".
NO_TOKEN = 2**32 - 1
#: GGUF value types read as integers (a BOOL is not a count) and as numbers.
_INT_TYPES = frozenset({"UINT8", "INT8", "UINT16", "INT16", "UINT32", "INT32", "UINT64", "INT64"})
_NUMBER_TYPES = _INT_TYPES | {"FLOAT32", "FLOAT64"}


@cache
def supported_ggml_types() -> tuple[str, ...]:
    """The ggml tensor types nextn reads: those `gguf.quants.dequantize` implements (floats included), by name.

    Probed once on one all-zero block per type (a few ms), so the list follows the installed `gguf` library
    (0.19: F32, F16, BF16, Q4_0 … Q8_0, Q2_K … Q6_K, the IQ types, TQ1_0/TQ2_0, MXFP4, NVFP4; not Q8_1, Q8_K, I8 …).
    """
    import gguf

    names = []
    for qtype in gguf.GGMLQuantizationType:
        _, type_size = gguf.GGML_QUANT_SIZES[qtype]
        try:
            gguf.quants.dequantize(np.zeros((1, type_size), np.uint8), qtype)
        except NotImplementedError:
            continue
        names.append(qtype.name)
    return tuple(names)


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


def _gguf_version() -> str:
    from importlib.metadata import version

    return version("gguf")


def _open_reader(path: Path):
    """`gguf.GGUFReader` over `path`, its failures as CheckpointError: not a GGUF, or a GGUF cut short."""
    try:
        return open_gguf(path)
    except Exception as e:  # gguf raises ValueError/IndexError (numpy reshapes) on short or foreign files
        size = path.stat().st_size
        with path.open("rb") as f:
            magic = f.read(4)
        if magic != b"GGUF":
            raise CheckpointError(f"{path} is not a readable GGUF file (no GGUF magic; {size} bytes): {e}") from e
        raise CheckpointError(f"{path} is a truncated or corrupt GGUF file ({size} bytes: its header or tensor data "
                              f"ends early; re-download or re-convert it) [gguf: {type(e).__name__}: {e}]") from e


class GGUFCheckpoint:
    """Reads a Llama or Qwen2 GGUF (float or quantized tensors) by HF tensor name.

    Args:
        path: a `.gguf` file, or a directory holding exactly one.
    Raises:
        CheckpointError: the path is missing or holds no (or several) `.gguf` files; the file is not a GGUF or is
            truncated; its architecture is not one of `SUPPORTED_ARCHITECTURES`; it lacks a required metadata key,
            uses RoPE scaling or partial RoPE; or it holds a tensor nextn cannot place or a ggml type
            `gguf.quants` cannot dequantize (each message names the file, key, tensor or type, and what is supported);
            a metadata value of the wrong type (a string, bool or array where a count belongs) or a count outside
            [1, 2**31 - 1]; tensors whose bytes overlap; an embedding that is not 2-D, or a token list whose length
            differs from its rows; malformed tokenizer metadata (`gguf_tokenizer.check_vocabulary`).
    Layer counts are checked against the stored blocks by `model_config` (ConfigError).
    """

    def __init__(self, path: str | Path) -> None:
        import gguf  # deferred: only GGUF builds need it

        self.path = _resolve_file(Path(path))
        self.model_dir = self.path.parent
        early = peek_architecture(self.path)
        if early is not None and early not in SUPPORTED_ARCHITECTURES:  # refused before the whole header is parsed
            raise CheckpointError(unsupported(self.path, early))
        self._reader = _open_reader(self.path)
        self.architecture: str = self._scalar("general.architecture", {"STRING"}, "a string")  # e.g. "llama"
        if self.architecture not in SUPPORTED_ARCHITECTURES:
            raise CheckpointError(unsupported(self.path, self.architecture))
        self._tensors: dict[str, Any] = {}
        self._expert: dict[str, int] = {}  # an expert's HF name → its index in its 3-D tensor (`_tensors` holds that)
        self._value_half: dict[str, Any] = {}  # deepseek2's `kv_b_proj` → its `attn_v_b` (`_tensors`: its `attn_k_b`)
        # rope frequency factors as llama.cpp's converter stores them: Llama 3's `rope_freqs`, LongRoPE's two
        self._factors: dict[str, Any] = {}
        supported = supported_ggml_types()
        for t in self._reader.tensors:
            if t.name in FACTOR_TENSORS.get(self.architecture, ()):
                self._factors[t.name] = t
                continue
            if t.tensor_type.name not in supported:
                raise CheckpointError(f"{self.path}: tensor {t.name!r} has ggml type {t.tensor_type.name}, which "
                                      f"gguf {_gguf_version()} cannot dequantize; nextn reads {', '.join(supported)}")
            m = BLOCK_RE.fullmatch(t.name)
            # an MoE layer's [E, out, in] (gpt-oss's biases: [E, out]): one HF name per expert, each a slice of it
            dims = 3 if m and m[3] == "weight" else 2
            experts = expert_names(m[1], m[2], int(t.shape[-1]) if len(t.shape) == dims else 0, m[3]) if m else None
            if experts:
                self._expert.update((e, i) for i, e in enumerate(experts))
                self._tensors.update((e, t) for e in experts)
                continue
            if m and (whole := gguf_deepseek2.value_half(m[1], m[2])):  # MLA's kv_b_proj stored in two halves
                self._value_half[whole] = t
                continue
            name = hf_name(t.name, self.architecture)
            if name is None:
                raise CheckpointError(f"{self.path}: unexpected tensor {t.name!r} for a {self.architecture} GGUF")
            self._tensors[name] = t
        self._check_tensor_spans()
        if "tokenizer.ggml.tokens" in self._reader.fields:  # before the build writes anything
            check_vocabulary(self._reader.fields, self.path)
        self.hf_config: dict[str, Any] = self._hf_config()

    def _check_tensor_spans(self) -> None:
        """Refuse two tensors whose bytes overlap in the file (a crafted header: one tensor read as another)."""
        spans = sorted((int(t.data_offset), int(t.n_bytes), t.name) for t in self._reader.tensors)
        for (start, size, name), (other_start, _, other) in zip(spans, spans[1:]):
            if start + size > other_start:
                raise CheckpointError(f"{self.path}: tensors {name!r} (bytes {start}-{start + size}) and {other!r} "
                                      f"(from byte {other_start}) overlap in the file: its header is corrupt or "
                                      "crafted; re-convert the model")

    # Metadata ----------------------------------------------------------------------------------------
    def _field(self, key: str, default: Any = ..., *, array: bool = False) -> Any:
        f = self._reader.fields.get(key)
        if f is None:
            if default is ...:
                raise CheckpointError(f"{self.path} lacks GGUF metadata key {key!r}")
            return default
        value = f.contents()
        return list(value) if array else value

    def _scalar(self, key: str, kinds: set[str] | frozenset[str], what: str, default: Any = ...) -> Any:
        """Metadata `key` as one value of a GGUF type in `kinds` (e.g. {"UINT32", ...}); `default` when absent.

        Raises:
            CheckpointError: the key is absent (and has no default), an array, or of another type (e.g. the string
                "abc" or a BOOL where a count belongs); the message names the key, its type and value.
        """
        f = self._reader.fields.get(key)
        if f is None:
            return self._field(key, default)
        kind = f.types[0].name if f.types else "empty"
        if len(f.types) != 1 or kind not in kinds:
            shown = repr(f.contents()) if f.types else "nothing"
            shown = shown if len(shown) <= 60 else shown[:57] + "..."
            raise CheckpointError(f"{self.path}: GGUF metadata {key!r} is {'an array' if kind == 'ARRAY' else kind} "
                                  f"({shown}), not {what}; the file is corrupt or was not written by llama.cpp's "
                                  "converter")
        return f.contents()

    def _count(self, key: str, default: int | None = None) -> int:
        """Metadata `key` as a count or size in [1, MAX_SIZE] (`default` when absent; required when None).

        Raises:
            CheckpointError: absent without a default, not an integer (a string, float, bool or array), or out of
                range (0 heads, 2**32 - 1 blocks); the message names the key and value.
        """
        value = int(self._scalar(key, _INT_TYPES, "an integer", ... if default is None else default))
        if not 1 <= value <= MAX_SIZE:
            raise CheckpointError(f"{self.path}: GGUF metadata {key!r} is {value}; a count or size must lie in "
                                  f"[1, {MAX_SIZE}]")
        return value

    def _number(self, key: str, default: float) -> float:
        """Metadata `key` as a float (an integer or float type); NaN and ±Inf are refused by the model config."""
        return float(self._scalar(key, _NUMBER_TYPES, "a number", default))

    def _token_id(self, key: str) -> int | None:
        value = self._scalar(f"tokenizer.ggml.{key}", _INT_TYPES, "an integer token id", None)
        return None if value is None or int(value) == NO_TOKEN else int(value)

    @property
    def four_bit_share(self) -> float:
        """The share of the decoder's matrix weights (2-D `blk.*` tensors, by element count) stored in a 4-bit ggml
        type (`FOUR_BIT_TYPES`): 1.0 for a Q4_0 / Q4_1 file, ~0.7-0.9 for a Q4_K_M one (its Q6_K tensors are the
        rest), 0 for a Q8_0 or float file."""
        sizes = [(int(t.n_elements), t.tensor_type.name) for t in self._reader.tensors
                 if t.name.startswith("blk.") and len(t.shape) in (2, 3)]  # 3-D: an MoE layer's experts
        total = sum(n for n, _ in sizes)
        return sum(n for n, kind in sizes if kind in FOUR_BIT_TYPES) / total if total else 0.0

    @property
    def declares_four_bit(self) -> bool:
        """Whether `general.file_type` names a 4-bit llama.cpp file type (Q4_0, Q4_1, Q4_K_S, Q4_K_M, IQ4_NL,
        IQ4_XS, MXFP4_MOE: gpt-oss's): what the user chose, even where llama.cpp's quantizer stored many tensors in 5 bits because their
        rows are not multiples of 256 (Gemma-3-270M's Q4_K_M: hidden 640, 81 of 127 matrices Q5_0)."""
        import gguf

        names = {"MOSTLY_Q4_0", "MOSTLY_Q4_1", "MOSTLY_Q4_K_S", "MOSTLY_Q4_K_M", "MOSTLY_IQ4_NL", "MOSTLY_IQ4_XS",
                 "MOSTLY_MXFP4_MOE"}
        value = self._scalar("general.file_type", _INT_TYPES, "an integer file type", None)
        return value is not None and int(value) in {gguf.LlamaFileType[n].value for n in names}

    @property
    def is_quantized(self) -> bool:
        """Whether any tensor is block-quantized (not F32/F16/BF16): the file then has no float dtype to keep."""
        return any(t.tensor_type.name not in FLOAT_TYPES for t in self._tensors.values())

    def _hf_config(self) -> dict[str, Any]:
        """An HF config.json dict (`LlamaForCausalLM` or `Qwen2ForCausalLM`) from the `{arch}.*` and
        `tokenizer.ggml.*` metadata, with biases and tying read off the tensors present."""
        arch = self.architecture
        count = lambda key, default=None: self._count(f"{arch}.{key}", default)  # noqa: E731
        heads = count("attention.head_count")
        hidden = count("embedding_length")
        head_dim = count("attention.key_length", max(hidden // heads, 1))
        rope_dim = count("rope.dimension_count", head_dim)
        if rope_dim != head_dim and arch not in PARTIAL_ROTARY_ARCHITECTURES:
            raise CheckpointError(f"{self.path}: {arch}.rope.dimension_count {rope_dim} differs from the head size "
                                  f"{head_dim}; partial RoPE is not supported for {arch}")
        vocab = self._vocab_size()
        embed = self._tensors.get("model.embed_tokens.weight")
        first = embed.tensor_type.name if embed is not None else "F32"
        o_bias = "model.layers.0.self_attn.o_proj.bias" in self._tensors
        layers = count("block_count")
        kinds = {"count": lambda k, d: self._count(f"{arch}.{k}", d) if d else self._count(f"{arch}.{k}"),
                 "number": lambda k, d: self._number(f"{arch}.{k}", d),
                 "raw": lambda k, d: self._field(f"{arch}.{k}", d)}
        options = family_config(arch, lambda k, kind, d: kinds[kind](k, d), layers, hidden, heads, head_dim,
                                lambda name, n: factor_values(self._factors.get(name), n, self.path),
                                lambda name: name in self._tensors)
        options.update(moe_config(arch, lambda k, kind, d: kinds[kind](k, d)))
        scaling = self._scalar(f"{arch}.rope.scaling.type", {"STRING"}, "a string", "none")
        try:
            rope_scaling = options.pop("rope_scaling", None) or rope_scaling_config(
                arch, scaling, lambda k, kind, d: kinds[kind](k, d))
        except ValueError as e:
            raise CheckpointError(f"{self.path}: {e}") from None
        config = {
            "architectures": [SUPPORTED_ARCHITECTURES[arch]],
            "model_type": {"gemma3": "gemma3_text", "gemma4": "gemma4_text", "qwen35": "qwen3_5_text",
                           "qwen3next": "qwen3_next",
                           "qwen35moe": "qwen3_5_moe_text", "gpt-oss": "gpt_oss"}.get(arch, arch),  # HF's model_type
            "vocab_size": vocab,
            "hidden_size": hidden,
            "intermediate_size": options.get("intermediate_size") or count("feed_forward_length"),  # gemma4: a list
            "num_hidden_layers": layers,
            "num_attention_heads": heads,
            "num_key_value_heads": options.get("num_key_value_heads") or count("attention.head_count_kv", heads),
            "head_dim": head_dim,
            "rms_norm_eps": self._number(f"{arch}.attention.layer_norm_rms_epsilon", 1e-5),
            "rope_theta": self._number(f"{arch}.rope.freq_base", 10000.0),
            "rope_scaling": rope_scaling,
            "rope_freq_factors": factor_values(self._factors.get("rope_freqs.weight"), head_dim // 2, self.path,
                                               "head_dim // 2"),
            "max_position_embeddings": count("context_length", 2048),
            "tie_word_embeddings": "lm_head.weight" not in self._tensors,
            "attention_bias": o_bias,  # HF Llama's flag: q/k/v/o biased
            "qkv_bias": "model.layers.0.self_attn.q_proj.bias" in self._tensors and not o_bias,  # Qwen2
            "bos_token_id": self._token_id("bos_token_id"),
            "eos_token_id": self._token_id("eos_token_id"),
            # Dequantized values are exact in fp32; `build-engine --dtype auto` picks for quantized files.
            "torch_dtype": {"F16": "float16", "BF16": "bfloat16"}.get(first, "float32"),
            **options,
        }
        if arch == "gemma4-assistant":  # a drafter's layers (speculative/gemma4_assistant.py reads it)
            return gguf_gemma4.assistant_config(config, count("embedding_length_out"))
        return config

    def _vocab_size(self) -> int:
        """The embedding's rows (a 2-D `token_embd.weight`, [hidden, vocab] in ggml order); without one, llama.cpp's
        `vocab_size` key, else the token list's length.

        Raises:
            CheckpointError: the embedding is not 2-D; the token list's length differs from the embedding's rows
                (llama.cpp's loader refuses it too: ids past the embedding, or rows no token reaches); no way to tell.
        """
        tokens = self._reader.fields.get("tokenizer.ggml.tokens")
        num_tokens = len(tokens.data) if tokens is not None and tokens.types[:1] == [tokens.types[0].ARRAY] else None
        embed = self._tensors.get("model.embed_tokens.weight")
        if embed is None:  # the build then stops at the missing tensor, naming it
            key = f"{self.architecture}.vocab_size"
            if key not in self._reader.fields and num_tokens:
                return num_tokens
            return self._count(key)
        if len(embed.shape) != 2:
            raise CheckpointError(f"{self.path}: tensor 'token_embd.weight' has shape {[int(n) for n in embed.shape]} "
                                  "(ggml order); an embedding is 2-D, [hidden, vocab]")
        rows = int(embed.shape[1])
        if num_tokens is not None and num_tokens != rows:
            raise CheckpointError(f"{self.path}: tokenizer.ggml.tokens lists {num_tokens} tokens but "
                                  f"token_embd.weight has {rows} rows; they must be equal (as llama.cpp requires): "
                                  f"{'ids past the embedding' if num_tokens > rows else 'rows no token can reach'}. "
                                  "The tokenizer and the weights are from different models")
        return rows

    @cached_property
    def model_config(self) -> ModelConfig:
        """The normalised config, its layer count checked against the blocks the file stores.

        Raises:
            ConfigError: a value the config refuses, or `{arch}.block_count` above the blocks stored
                (`tensor_inventory.check_layer_counts`).
        """
        from nextn.models.registry import model_config_from_hf

        if "text_config" in self.hf_config:  # a drafter's (gemma4-assistant): refused by name
            return model_config_from_hf(self.hf_config)
        check_layer_counts(self.hf_config["num_hidden_layers"], 0, self.names(),
                           f"{self.path}: {self.architecture}.block_count")

        return model_config_from_hf(self.hf_config)

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

    def tensor_info(self, name: str) -> tuple[str, list[int]]:
        """("F32", HF-order shape) of tensor `name` from the file's header: the dtype `get` returns (every ggml type
        is dequantized to float32), so `weight_checks.check_source_tensors` checks GGUF shapes before any data.

        Raises:
            KeyError: no such tensor.
        """
        t = self._tensors.get(name)
        if t is None:
            raise KeyError(name)
        shape = hf_shape(name, [int(n) for n in reversed(t.shape)])
        if name in self._value_half:
            shape = gguf_deepseek2.merged_shape(shape, [int(n) for n in reversed(self._value_half[name].shape)])
        if self.architecture in LINEAR_ATTENTION_ARCHITECTURES:
            shape = gguf_qwen35.shape(name, shape)
        return "F32", shape[1:] if name in self._expert else shape

    def get(self, name: str) -> torch.Tensor:
        """Tensor `name` (HF name) as fp32 [out, in] (or [n]), dequantized by `gguf.quants.dequantize`, in HF's
        layout (q/k rows un-permuted for llama-architecture files).

        Raises:
            KeyError: no such tensor.
        """
        t = self._tensors.get(name)
        if t is None:
            raise KeyError(f"{name!r} not in {self.path}")
        w = self._dequantized(t, self._expert.get(name))
        w = w.reshape(hf_shape(name, list(w.shape)))
        if name in self._value_half:
            w = gguf_deepseek2.merge_kv_b(w, self._dequantized(self._value_half[name]))
        if shift := norm_shift(self.architecture, name):
            w -= shift  # exact: 1 + (s − 1) rounds back to the stored s in fp32 for any s in [0.5, 2]
        if self.architecture in LINEAR_ATTENTION_ARCHITECTURES:  # qwen35 also reordered its value heads
            w = gguf_qwen35.restore(name, w, self.hf_config, self.architecture in V_REORDERED_ARCHITECTURES)
        if self.architecture in PERMUTED_ARCHITECTURES:
            if ".self_attn.q_proj." in name:
                w = unpermute_rope_rows(w, self.hf_config["num_attention_heads"])
            elif ".self_attn.k_proj." in name:
                w = unpermute_rope_rows(w, self.hf_config["num_key_value_heads"])
        return w

    @staticmethod
    def _dequantized(t: Any, expert: int | None = None) -> torch.Tensor:
        """Tensor `t` (or one expert's rows of an MoE layer's [E, out, in] `t`) as fp32 in HF's shape order."""
        import gguf

        # A plain-ndarray view of the memory map: gguf slices it per row group, and memmap slices are slow to make.
        raw, shape = np.asarray(t.data), [int(n) for n in reversed(t.shape)]
        if expert is not None:
            raw, shape = raw[expert], shape[1:]
        data = np.asarray(gguf.quants.dequantize(raw, t.tensor_type), dtype=np.float32)
        if not data.flags.writeable:  # F32 tensors come back as views of the read-only memory map
            data = data.copy()
        return torch.from_numpy(data.reshape(shape))

    def native_w4a16(self, name: str, cfg: "QuantConfig") -> dict[str, torch.Tensor] | None:
        """Tensor `name` as `cfg`'s W4A16 tensors read from the file's own 4-bit blocks where they are the same
        format — a Q4_K tensor under two-level scales with group 32 and super-block 256 (`q4_k_two_level`): the
        engine then holds llama.cpp's values, where re-quantizing their dequantization would add error (measured on
        Qwen2.5-Coder-1.5B's Q4_K gate_proj: 4.3 % relative) — else None (the caller quantizes `get(name)`)."""
        import gguf

        from nextn.quantization.weight_only import INT4_ALGOS, super_block

        t = self._tensors.get(name)
        if (t is None or t.tensor_type != gguf.GGMLQuantizationType.Q4_K
                or (self.architecture in V_REORDERED_ARCHITECTURES and not gguf_qwen35.blocks_readable(name))
                or cfg.quant_algo not in INT4_ALGOS
                or cfg.group_size != 32 or not cfg.super_block_size or len(t.shape) != 2 + (name in self._expert)):
            return None
        k, n = (int(x) for x in t.shape[:2])
        if k % 256 or super_block(k, 32, cfg.super_block_size) != 256:
            return None
        raw = np.asarray(t.data)
        out = q4_k_two_level(raw[self._expert[name]] if name in self._expert else raw, n, k)
        if self.architecture in V_REORDERED_ARCHITECTURES:  # q/k/v, z: the value heads' rows back in HF's order
            out = {s: gguf_qwen35.restore(name, v, self.hf_config).contiguous() for s, v in out.items()}
        if self.architecture in PERMUTED_ARCHITECTURES:
            heads = {"q_proj": "num_attention_heads", "k_proj": "num_key_value_heads"}
            for proj, key in heads.items():
                if f".self_attn.{proj}." in name:
                    out = {s: unpermute_rope_rows(v, self.hf_config[key]).contiguous() for s, v in out.items()}
        return out

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

    def check_chat_template(self) -> None:
        """Render the file's chat template under the render budget before a build does any work
        (`gguf_tokenizer.check_gguf_chat_template`; ChatTemplateLimitError past it)."""
        from nextn.build.gguf_tokenizer import check_gguf_chat_template

        check_gguf_chat_template(self._reader, self.path)

    def write_tokenizer_files(self, out_dir: str | Path) -> list[str]:
        """Save tokenizer files and generation_config.json into `out_dir` (`gguf_tokenizer.write_tokenizer_files`);
        returns the tokenizer file names written (sorted)."""
        from nextn.build.gguf_tokenizer import write_tokenizer_files

        return write_tokenizer_files(self._reader, self.path, out_dir)
