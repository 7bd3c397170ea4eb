"""Lazy, validated reader of an HF safetensors checkpoint directory (single file or sharded; BF16/FP32, block FP8 or
MXFP4).

Layout read (deepseek-ai/DeepSeek-V3's config.json):

    model_dir/
      config.json                      HF config (either spelling; see nextn.models.config)
      model.safetensors                one file, or
      model.safetensors.index.json     {"weight_map": {tensor name: shard file}} plus the shard files

Tensors are read on demand through `safetensors.safe_open` (memory-mapped), so a checkpoint far larger than RAM
can be converted one tensor at a time. FP8 checkpoints (`quantization_config.quant_method == "fp8"`) store each
quantized weight `W` in float8_e4m3fn with a sibling `W_scale_inv`; `get` returns it dequantized to fp32 and the
`_scale_inv` tensors are hidden from `names()`. MXFP4 checkpoints (`quant_method == "mxfp4"`, gpt-oss's release)
store a weight `W` as `W_blocks` + `W_scales` (build/mxfp4.py); `names()` lists it as `W` and `get` returns it
dequantized to fp32 in the unquantized checkpoints' layout (the last two dimensions swapped: [E, in, out]).
"""

from __future__ import annotations

import json
import math
import os
from functools import cached_property
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open

from nextn.build.fp8 import DEFAULT_BLOCK, dequantize_block_fp8
from nextn.build.mxfp4 import dequantize_mxfp4
from nextn.models.config import DeepseekV3ModelConfig

CONFIG_NAME = "config.json"
SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
SCALE_SUFFIX = "_scale_inv"
MXFP4_BLOCKS, MXFP4_SCALES = "_blocks", "_scales"
FP8_DTYPES = (torch.float8_e4m3fn,)
#: A JSON side file (config, index, tokenizer) larger than this is refused unread (tokenizer.json of a 256k
#: vocabulary is ~20 MB).
MAX_JSON_BYTES = 256 << 20


class CheckpointError(ValueError):
    """A checkpoint directory or one of its files is missing, unreadable or inconsistent; the message names it."""


def read_json(path: Path, what: str) -> dict[str, Any]:
    """A JSON object from `path`, every number finite.

    Raises:
        CheckpointError: the file is missing, not UTF-8 JSON, not an object, too deeply nested, or holds a NaN or
            ±Infinity (including a number too large for a float, `1e999`); the message names the file and field.
    """
    if not path.is_file():
        raise CheckpointError(f"{path} not found (or not a regular file): a checkpoint directory needs {what}")
    if path.stat().st_size > MAX_JSON_BYTES:
        raise CheckpointError(f"{path} is {path.stat().st_size} bytes, more than the {MAX_JSON_BYTES} a config or "
                              "index file can need; is it the right file?")
    try:
        data = json.loads(path.read_bytes().decode("utf-8"))
        bad = _non_finite(data, "")
    except (json.JSONDecodeError, UnicodeDecodeError, RecursionError) as e:
        raise CheckpointError(f"{path} is not valid JSON: {e}") from e
    if not isinstance(data, dict):
        raise CheckpointError(f"{path} must hold a JSON object, got {type(data).__name__}")
    if bad is not None:
        raise CheckpointError(f"{path}: field {bad[0]!r} is {bad[1]}, not a finite number; fix the value")
    return data


def tokenizer_num_ids(model_dir: Path) -> int | None:
    """How many token ids `model_dir/tokenizer.json` can produce (1 + its largest id: model vocabulary and added
    tokens), or None without a tokenizer.json.

    Raises:
        CheckpointError: the file is not a JSON object (`read_json`), or its vocabulary holds a non-integer id.
    """
    path = model_dir / "tokenizer.json"
    if not path.is_file():
        return None
    data = read_json(path, "a valid tokenizer.json")
    model = data.get("model") if isinstance(data.get("model"), dict) else {}
    vocab = model.get("vocab")
    ids = list(vocab.values()) if isinstance(vocab, dict) else list(range(len(vocab) if isinstance(vocab, list) else 0))
    added = data.get("added_tokens")
    ids += [t.get("id") for t in added if isinstance(t, dict)] if isinstance(added, list) else []
    bad = next((i for i in ids if type(i) is not int or i < 0), None)
    if bad is not None:
        raise CheckpointError(f"{path} maps a token to id {bad!r}, not a non-negative integer")
    return max(ids) + 1 if ids else None


def check_tokenizer_fits(model_dir: Path, vocab_size: int) -> None:
    """Refuse a tokenizer.json that can produce ids past the embedding (`vocab_size` rows).

    Fewer token ids than rows is normal (vocabularies padded to a multiple of 64 or 128, e.g. Qwen2.5: 151,665 ids
    for 151,936 rows) and builds.

    Raises:
        CheckpointError: naming both counts.
    """
    num_ids = tokenizer_num_ids(model_dir)
    if num_ids is not None and num_ids > vocab_size:
        raise CheckpointError(f"{model_dir / 'tokenizer.json'} has token ids up to {num_ids - 1} but the model's "
                              f"embedding has {vocab_size} rows (config.json vocab_size): those ids would index past "
                              "it. The tokenizer and the weights are from different models")


def _non_finite(value: Any, where: str) -> tuple[str, float] | None:
    """The first (dotted field path, value) holding a NaN or ±Inf float in a JSON value, else None."""
    if isinstance(value, float) and not math.isfinite(value):
        return where, value
    items = value.items() if isinstance(value, dict) else enumerate(value) if isinstance(value, list) else ()
    for k, v in items:
        found = _non_finite(v, f"{where}.{k}" if where else str(k))
        if found is not None:
            return found
    return None


def shard_path(model_dir: Path, shard: object, name: str, index: Path) -> Path:
    """The file a `weight_map` entry names: relative to `model_dir`, or absolute inside it (lexically).

    Symbolic links are not followed for the check (a Hugging Face cache snapshot links every file into blobs/).

    Raises:
        CheckpointError: the entry is not a string, or leaves the checkpoint directory (`../../etc/passwd`, an
            absolute path elsewhere); the message names the tensor and the entry.
    """
    if not isinstance(shard, str) or not shard or "\0" in shard:
        raise CheckpointError(f"{index.name}: weight_map entry for tensor {name!r} is {shard!r}, not a file name")
    root = Path(os.path.abspath(model_dir))
    path = Path(os.path.normpath(root / shard))  # an absolute `shard` replaces root
    inside = root in path.parents or (model_dir.resolve() in path.parents)
    if not inside:
        raise CheckpointError(f"{index.name}: weight_map entry for tensor {name!r} is {shard!r}, which leaves the "
                              f"checkpoint directory {model_dir}; shard files must lie inside it")
    return path


class CheckpointReader:
    """Reads tensors by HF name from a checkpoint directory.

    Args:
        model_dir: the checkpoint directory.
    Raises:
        CheckpointError: the directory, `config.json` or the weights are missing; a JSON file is invalid; a
            shard listed in the index is missing, truncated or unreadable, or lacks a tensor the index maps to it;
            the quantization method is neither block FP8 nor MXFP4.
    """

    def __init__(self, model_dir: str | Path) -> None:
        self.model_dir = Path(model_dir)
        if not self.model_dir.is_dir():
            raise CheckpointError(f"checkpoint directory {self.model_dir} does not exist")
        self.hf_config: dict[str, Any] = read_json(self.model_dir / CONFIG_NAME, "an HF config.json")
        self.index_file: Path | None = None
        self._handles: dict[Path, Any] = {}  # open safe_open handles, reopened on demand after close()
        self._files: list[Path] = []
        self._where: dict[str, Path] = {}  # every stored tensor (scales included) → its file
        self._mxfp4 = False  # quant_method mxfp4: `W_blocks` + `W_scales` read as `W`
        self._block = self._quantization_block()
        if (self.model_dir / INDEX_FILE).is_file():
            self.index_file = self.model_dir / INDEX_FILE
            self._open_sharded(self.index_file)
        elif (self.model_dir / SINGLE_FILE).is_file():
            self._open(self.model_dir / SINGLE_FILE, expected=None)
        else:
            hint = " (PyTorch .bin checkpoints are not supported; convert them to safetensors)" if any(
                self.model_dir.glob("pytorch_model*.bin")) else ""
            raise CheckpointError(f"{self.model_dir} has neither {SINGLE_FILE} nor {INDEX_FILE}{hint}")
        #: an MXFP4 weight's name → its `_blocks` tensor's
        self._packed = {n.removesuffix(MXFP4_BLOCKS): n for n in self._where if self._mxfp4
                        and n.endswith(MXFP4_BLOCKS) and n.removesuffix(MXFP4_BLOCKS) + MXFP4_SCALES in self._where}
        self._names = [n.removesuffix(MXFP4_BLOCKS) if n.removesuffix(MXFP4_BLOCKS) in self._packed else n
                       for n in self._where if not self._is_hidden_scale(n)]

    # Opening -----------------------------------------------------------------------------------------
    def _quantization_block(self) -> tuple[int, int] | None:
        q = self.hf_config.get("quantization_config")
        if not q:
            return None
        method = q.get("quant_method")
        if method == "mxfp4":
            self._mxfp4 = True
            return None
        if method != "fp8":
            raise CheckpointError(f"{self.model_dir / CONFIG_NAME}: unsupported quantization_config.quant_method "
                                  f"{method!r}; nextn reads unquantized, block-FP8 ('fp8') and 'mxfp4' checkpoints")
        if q.get("fmt", "e4m3") != "e4m3":
            raise CheckpointError(f"{self.model_dir / CONFIG_NAME}: unsupported FP8 format {q.get('fmt')!r} "
                                  "(only e4m3)")
        block = q.get("weight_block_size") or list(DEFAULT_BLOCK)
        if not (isinstance(block, list) and len(block) == 2 and all(isinstance(b, int) and b > 0 for b in block)):
            raise CheckpointError(f"{self.model_dir / CONFIG_NAME}: quantization_config.weight_block_size must be two "
                                  f"positive integers, got {block!r}")
        return block[0], block[1]

    def _open_sharded(self, index: Path) -> None:
        weight_map = read_json(index, "a valid index").get("weight_map")
        if not isinstance(weight_map, dict) or not weight_map:
            raise CheckpointError(f"{index} has no 'weight_map' (tensor name → shard file)")
        by_shard: dict[Path, set[str]] = {}
        for name, shard in weight_map.items():
            by_shard.setdefault(shard_path(self.model_dir, shard, name, index), set()).add(name)
        for path, names in sorted(by_shard.items()):
            if not path.is_file():
                raise CheckpointError(f"shard {path} listed in {index.name} is missing")
            self._open(path, expected=names)

    def _open(self, path: Path, expected: set[str] | None) -> None:
        try:
            handle = safe_open(str(path), framework="pt")
            keys = list(handle.keys())
        except Exception as e:  # safetensors raises its own SafetensorError for truncated/corrupt files
            raise CheckpointError(f"cannot read {path}: {e} (truncated or corrupt? re-download it)") from e
        if expected is not None:
            absent = sorted(expected - set(keys))
            if absent:
                raise CheckpointError(f"shard {path} lacks {len(absent)} tensor(s) that {INDEX_FILE} maps to it, "
                                      f"e.g. {absent[0]!r}")
            keys = [k for k in keys if k in expected]
        self._handles[path] = handle
        self._files.append(path)
        for k in keys:
            self._where.setdefault(k, path)

    def _is_hidden_scale(self, name: str) -> bool:
        if self._mxfp4 and name.endswith(MXFP4_SCALES):
            return name.removesuffix(MXFP4_SCALES) + MXFP4_BLOCKS in self._where
        return name.endswith(SCALE_SUFFIX) and name.removesuffix(SCALE_SUFFIX) in self._where

    # Public API --------------------------------------------------------------------------------------
    @cached_property
    def model_config(self) -> DeepseekV3ModelConfig:
        """The normalised config of any supported family, its layer counts checked against the stored layers.

        Raises:
            ConfigError: another architecture, a bad field, or `num_hidden_layers` / `num_nextn_predict_layers`
                above the layers the weights store (`tensor_inventory.check_layer_counts`).
        """
        from nextn.build.tensor_inventory import check_layer_counts
        from nextn.models.registry import model_config_from_hf

        cfg = model_config_from_hf(self.hf_config)
        check_layer_counts(cfg.num_hidden_layers, cfg.num_nextn_predict_layers, self._names,
                           f"{self.model_dir / CONFIG_NAME} num_hidden_layers")
        return cfg

    @property
    def is_fp8(self) -> bool:
        """Whether `config.json` declares block-FP8 quantization (`quant_method: fp8`)."""
        return self._block is not None

    @property
    def is_quantized(self) -> bool:
        """Whether weights are stored in MXFP4 (the engine dtype is then chosen as for a block-quantized GGUF)."""
        return bool(self._packed)

    @cached_property
    def four_bit_share(self) -> float:
        """The share of the decoder's matrix weights (2-D and 3-D `.layers.` tensors, by element count) stored in
        MXFP4, from headers: ~0.9 for gpt-oss's release (its experts), 0 for a float or FP8 checkpoint."""
        if not self._packed:
            return 0.0
        sizes = [(math.prod(shape), name in self._packed) for name in self._names if ".layers." in name
                 for _, shape in [self.tensor_info(name)] if len(shape) in (2, 3)]
        total = sum(n for n, _ in sizes)
        return sum(n for n, packed in sizes if packed) / total if total else 0.0

    declares_four_bit = False

    @property
    def files(self) -> list[Path]:
        """The weight files (one, or every shard), sorted by name."""
        return sorted(self._files)

    def names(self) -> list[str]:
        """Every tensor name, in file order, without the FP8 `_scale_inv` companions (MXFP4's pairs as one name)."""
        return list(self._names)

    def has(self, name: str) -> bool:
        return name in self._packed or (name in self._where and not self._is_hidden_scale(name))

    def tensor_info(self, name: str) -> tuple[str, list[int]]:
        """(safetensors dtype such as "BF16" or "I32", shape) of a stored tensor, from its file's header only.

        Raises:
            KeyError: the checkpoint has no tensor `name`.
            CheckpointError: the header cannot be read.
        """
        if not self.has(name):
            raise KeyError(name)
        if name in self._packed:  # [..., rows, groups, 16] codes: F32 [..., groups · 32, rows] values
            dtype, shape = self._header(self._packed[name])
            if dtype != "U8" or len(shape) < 3 or shape[-1] != 16:
                raise CheckpointError(f"MXFP4 tensor {self._packed[name]!r} is {dtype} {shape}; MXFP4 blocks are U8 "
                                      "[..., rows, groups, 16]: the checkpoint is corrupt")
            return "F32", [*shape[:-3], shape[-2] * 2 * shape[-1], shape[-3]]
        return self._header(name)

    def _header(self, name: str) -> tuple[str, list[int]]:
        path = self._where[name]
        try:
            if path not in self._handles:
                self._handles[path] = safe_open(str(path), framework="pt")
            sl = self._handles[path].get_slice(name)
            return str(sl.get_dtype()), list(sl.get_shape())
        except Exception as e:
            raise CheckpointError(f"cannot read the header of tensor {name!r} in {path}: {e}") from e

    def get(self, name: str, index: int | None = None) -> torch.Tensor:
        """One tensor by HF name; FP8 weights come back dequantized as float32 [M, N], MXFP4 ones as float32 with
        the last two dimensions of their blocks' rows and columns swapped ([E, in, out]), others in their stored
        dtype.

        Args:
            index: an entry of the first dimension (one expert of a stacked [E, ...] tensor), read alone; None:
                the whole tensor.
        Raises:
            KeyError: the checkpoint has no tensor `name`.
            CheckpointError: the tensor cannot be read, an FP8 tensor lacks or mismatches its `_scale_inv`, or an
                MXFP4 tensor's blocks and scales disagree.
        """
        if not self.has(name):
            raise KeyError(name)
        if name in self._packed:
            blocks = self._packed[name]
            scales = blocks.removesuffix(MXFP4_BLOCKS) + MXFP4_SCALES
            try:
                return dequantize_mxfp4(self._read(blocks, index), self._read(scales, index)).transpose(-1, -2)
            except ValueError as e:
                raise CheckpointError(f"cannot dequantize MXFP4 tensor {name!r} in {self._where[blocks]}: {e}") from e
        t = self._read(name, index)
        if t.dtype not in FP8_DTYPES:
            return t
        if index is not None:  # a block-scaled FP8 weight is dequantized whole
            return self.get(name)[index]
        scale_name = name + SCALE_SUFFIX
        if scale_name not in self._where:
            raise CheckpointError(f"FP8 tensor {name!r} in {self._where[name]} has no {scale_name!r}")
        try:
            return dequantize_block_fp8(t, self._read(scale_name), self._block or DEFAULT_BLOCK)
        except ValueError as e:
            raise CheckpointError(f"cannot dequantize FP8 tensor {name!r} in {self._where[name]}: {e}") from e

    def _read(self, name: str, index: int | None = None) -> torch.Tensor:
        path = self._where[name]
        try:
            if path not in self._handles:
                self._handles[path] = safe_open(str(path), framework="pt")
            if index is not None:
                return self._handles[path].get_slice(name)[index]
            return self._handles[path].get_tensor(name)
        except Exception as e:
            raise CheckpointError(f"cannot read tensor {name!r} from {path}: {e}") from e

    def close(self) -> None:
        """Drop the memory-mapped file handles."""
        self._handles.clear()

    def __enter__(self) -> "CheckpointReader":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"CheckpointReader({str(self.model_dir)!r}, files={len(self._files)}, fp8={self.is_fp8})"
