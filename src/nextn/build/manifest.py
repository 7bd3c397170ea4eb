"""The engine manifest: the typed, self-describing header of an engine directory (`manifest.json`).

The runtime reads this file and never guesses from file names (STYLE.md §9). Layout of an engine directory:

    engine_dir/
      manifest.json        this model, serialised
      model.safetensors    weights in the runtime layout (nextn.models.deepseek_v3.weights)
      tokenizer files      tokenizer.json, tokenizer_config.json, ... when the checkpoint has them
      aux files            generation_config.json when the checkpoint has it
      compiled/            torch.compile artifacts of the decode step (`build-engine --compile_step`), described
                           by `compiled_step`; optional, and ignored by a loader with another torch or device

Integrity. `checksums` records, for the weights, tokenizer and aux files, the size in bytes, the SHA-256 of the
whole file (what `sha256sum` prints) and the SHA-256 of each 256 MiB slice (weights computed while they are
written, streamed; compiled artifacts carry their own digest in `compiled_step`). `verify_engine_files` checks them
when an engine loads, in the mode `LlmArgs.verify_weights` names (the CLIs also take `NEXTN_VERIFY_WEIGHTS`):
- "full" (the default): presence, sizes, safetensors headers, then the SHA-256 of every slice, the slices hashed
  on all cores at once (hashlib releases the GIL). It catches a single flipped bit anywhere and names the byte
  range. Cost: SHA-256 runs at about 1.35 GB/s per core with SHA-NI (measured), so about 2.3 s for a 3.2 GB
  engine in the page cache on one core, divided by the cores up to one per slice (13 for 3.2 GB), bounded below
  by the disk's read speed on a cold cache — reads the first forward would make anyway, since loading is a lazy
  memory map. Chosen as the default because a silently corrupt engine prints wrong text with no error.
- "size": presence, sizes and safetensors headers (every tensor's byte range consistent with its dtype, shape and
  the file size): a truncated, extended or replaced file is caught in milliseconds, a flipped bit inside the data
  is not. For very large engines on slow disks.
- "off": nothing.
Engines built before checksums existed (`checksums` empty) load with a warning. Every path in the manifest is
relative and stays inside the engine directory (no absolute paths, no `..`), and the sections agree with each
other (MTP needs modules the model stores, max_seq_len ≤ max_position_embeddings); `EngineManifest.load` refuses
anything else with a message naming the field.
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
import os
import struct
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path, PurePosixPath
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from nextn.models.model_config import ModelConfig
from nextn.quantization.quant_config import QuantConfig

logger = logging.getLogger(__name__)

SCHEMA_VERSION = 1
MANIFEST_NAME = "manifest.json"
#: A manifest larger than this is not one build-engine wrote (a device file, a mistaken path): refused unread.
MAX_MANIFEST_BYTES = 16 << 20
CHUNK_BYTES = 1 << 22  # read size
#: Slice of a weights file whose SHA-256 is recorded on its own (verified in parallel at load time).
VERIFY_CHUNK_BYTES = 256 << 20
VERIFY_MODES = ("full", "size", "off")


class EngineError(ValueError):
    """An engine directory is missing, unreadable, corrupt, or of an unsupported schema version."""


class EngineFileError(EngineError):
    """A file the manifest lists is damaged: missing, not a regular file, or of another size, safetensors header or
    SHA-256 than recorded (`verify_engine_files`). The manifest itself loaded. `path` is the file; the engine cache
    rebuilds an entry of its own that raises this (`build/engine_cache.py`)."""

    def __init__(self, message: str, path: Path) -> None:
        super().__init__(message)
        self.path = Path(path)


def check_relative_path(path: str, what: str) -> str:
    """`path` when it is a relative POSIX path inside its directory (no absolute path, no `..`, not empty).

    Raises:
        ValueError: naming `what` and the path.
    """
    p = PurePosixPath(path)
    if not path or "\\" in path or "\0" in path or p.is_absolute() or ".." in p.parts or str(p) in (".", ""):
        raise ValueError(f"{what} {path!r} must be a relative path inside the engine directory (no absolute path, "
                         "no '..')")
    return path


class FileChecksum(BaseModel):
    """Size and SHA-256 of one engine file, recorded at build time and checked at load time.

    Besides the SHA-256 of the whole file (what `sha256sum` prints), the SHA-256 of each `chunk_bytes` slice, so that
    a loader verifies the slices on all its cores at once.
    """

    model_config = ConfigDict(frozen=True, extra="forbid")

    num_bytes: int = Field(ge=0)
    sha256: str = Field(pattern=r"^[0-9a-f]{64}$")
    chunk_bytes: int = Field(default=0, ge=0)  # 0: no per-chunk digests (verify the whole file in one stream)
    chunk_sha256: list[str] = []  # SHA-256 of bytes [i·chunk_bytes, (i+1)·chunk_bytes), the last chunk shorter

    @model_validator(mode="after")
    def _chunks(self) -> "FileChecksum":
        expected = -(-self.num_bytes // self.chunk_bytes) if self.chunk_bytes else 0
        if len(self.chunk_sha256) != expected:
            raise ValueError(f"{len(self.chunk_sha256)} chunk digests for {self.num_bytes} bytes in chunks of "
                             f"{self.chunk_bytes}; expected {expected}")
        return self


class StreamHasher:
    """SHA-256 of a byte stream, whole and per `chunk_bytes` slice, fed in pieces of any size."""

    def __init__(self, chunk_bytes: int = VERIFY_CHUNK_BYTES) -> None:
        self.chunk_bytes = chunk_bytes
        self.whole = hashlib.sha256()
        self.chunk = hashlib.sha256()
        self.in_chunk = 0
        self.num_bytes = 0
        self.chunks: list[str] = []

    def update(self, data: bytes | memoryview) -> None:
        view = memoryview(data).cast("B")
        self.whole.update(view)
        self.num_bytes += len(view)
        while len(view):
            take = min(len(view), self.chunk_bytes - self.in_chunk)
            self.chunk.update(view[:take])
            self.in_chunk += take
            view = view[take:]
            if self.in_chunk == self.chunk_bytes:
                self.chunks.append(self.chunk.hexdigest())
                self.chunk, self.in_chunk = hashlib.sha256(), 0

    def checksum(self) -> FileChecksum:
        chunks = self.chunks + ([self.chunk.hexdigest()] if self.in_chunk else [])
        return FileChecksum(num_bytes=self.num_bytes, sha256=self.whole.hexdigest(), chunk_bytes=self.chunk_bytes,
                            chunk_sha256=chunks)


class SpeculativeInfo(BaseModel):
    """What drafting the engine can do: `method` none, mtp or medusa, module/head counts, the default draft length."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    method: Literal["none", "mtp", "medusa"] = "none"
    num_mtp_modules: int = Field(default=0, ge=0)  # MTP layers stored in the engine
    max_draft_len: int = Field(default=0, ge=0)  # K the engine was built for (speculative_config's num_nextn_predict_layers)
    use_mtp_vanilla: bool = False  # default drafter: Vanilla (K distinct modules) or Eagle (one module K times)
    num_medusa_heads: int = Field(default=0, ge=0)  # Medusa heads stored under `medusa_heads.` in the weights
    medusa_num_layers: int = Field(default=0, ge=0)  # ResBlocks per head

    @model_validator(mode="after")
    def _consistent(self) -> "SpeculativeInfo":
        if self.method == "mtp":
            if self.num_mtp_modules == 0 or self.max_draft_len == 0:
                raise ValueError(f"speculative.method is 'mtp' but num_mtp_modules={self.num_mtp_modules} and "
                                 f"max_draft_len={self.max_draft_len}: MTP needs at least one module and one draft")
            if self.use_mtp_vanilla and self.max_draft_len > self.num_mtp_modules:
                raise ValueError(f"MTP Vanilla drafts one token per module: max_draft_len={self.max_draft_len} "
                                 f"exceeds num_mtp_modules={self.num_mtp_modules}")
        if self.method == "medusa" and not 1 <= self.max_draft_len <= self.num_medusa_heads:
            raise ValueError(f"speculative.method is 'medusa' but max_draft_len={self.max_draft_len} is not in "
                             f"[1, num_medusa_heads={self.num_medusa_heads}]")
        return self


class BuildOptions(BaseModel):
    """The options `build-engine` was run with (defaults for the runtime, overridable by `LLM(...)`)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    max_batch_size: int = Field(default=8, gt=0, le=1 << 16)  # LlmArgs' MAX_BATCH_SIZE: loadable engines only
    max_seq_len: int = Field(default=2048, gt=0, le=2**31 - 1)
    extra_llm_api_options: dict[str, Any] | None = None  # the YAML given at build time, as loaded


class SourceInfo(BaseModel):
    """Where the weights came from: the checkpoint path, its format and a SHA-256 fingerprint of its files."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    path: str
    format: Literal["safetensors", "safetensors-fp8", "gguf"] = "safetensors"
    fingerprint: str  # sha256 over config.json and the weight files (names, sizes, contents)


class CompiledStepInfo(BaseModel):
    """Stored `torch.compile` artifacts of the decode step (runtime/compiled_step.py), and what they fit.

    A loader uses them only with the same torch version and device type; otherwise it logs why and compiles
    from scratch (or runs eagerly).
    """

    model_config = ConfigDict(frozen=True, extra="forbid")

    file: str  # path relative to the engine directory
    sha256: str  # of the file, checked before loading
    num_bytes: int = Field(ge=0)
    artifacts: dict[str, int] = {}  # cache kind (inductor, aot_autograd, ...) → entries
    kernels_file: str | None = None  # tar of the built CPU kernel libraries (inductor's cache layout), if any
    kernels_sha256: str = ""
    num_kernels: int = Field(default=0, ge=0)
    torch_version: str  # torch.__version__ of the build; must equal the loader's
    device_type: str  # "cpu" or "cuda"; must equal the loader's
    cpu_threads: int = Field(default=0, ge=0)  # torch threads of the build (CPU kernels depend on it); 0: any
    draft_len: int = Field(default=0, ge=0)  # K the warm-up steps ran with (another K compiles at load time)
    batch_sizes: list[int] = []  # batch sizes the warm-up steps ran
    enable_fullgraph: bool = True  # torch_compile_config the artifacts were compiled with
    enable_inductor: bool = True

    @field_validator("file", "kernels_file")
    @classmethod
    def _inside(cls, v: str | None) -> str | None:
        return v if v is None else check_relative_path(v, "compiled_step file")


class EngineManifest(BaseModel):
    """Everything the runtime needs to know about an engine directory."""

    model_config = ConfigDict(frozen=True, extra="forbid", allow_inf_nan=False)

    schema_version: int = SCHEMA_VERSION
    nextn_version: str
    architecture: str
    dtype: Literal["float32", "bfloat16", "float16"]
    model: ModelConfig
    speculative: SpeculativeInfo
    build_options: BuildOptions
    source: SourceInfo
    weight_files: list[str] = Field(default=["model.safetensors"], min_length=1)
    tokenizer_files: list[str] = []  # empty: the engine takes token-id prompts only
    aux_files: list[str] = []  # other copied files (generation_config.json)
    checksums: dict[str, FileChecksum] = {}  # weight, tokenizer, aux files → size, SHA-256; empty: built before
    # (compiled_step's files carry their own SHA-256)
    compiled_step: CompiledStepInfo | None = None  # absent in engines built without --compile_step
    quant_config: QuantConfig | None = None  # weight-only quantization (W8A16 / W4A16); None: weights in `dtype`

    @field_validator("weight_files", "tokenizer_files", "aux_files")
    @classmethod
    def _files_inside(cls, v: list[str]) -> list[str]:
        for f in v:
            check_relative_path(f, "file")
            if f == MANIFEST_NAME:
                raise ValueError(f"{MANIFEST_NAME} cannot be listed as an engine data file")
        return v

    @field_validator("checksums")
    @classmethod
    def _checksums_inside(cls, v: dict[str, FileChecksum]) -> dict[str, FileChecksum]:
        for f in v:
            check_relative_path(f, "checksums entry")
        return v

    @model_validator(mode="after")
    def _consistent(self) -> "EngineManifest":
        if self.model.architecture != self.architecture:
            raise ValueError(f"architecture {self.architecture!r} differs from model.architecture "
                             f"{self.model.architecture!r}")
        if self.build_options.max_seq_len > self.model.max_position_embeddings:
            raise ValueError(f"build_options.max_seq_len={self.build_options.max_seq_len} exceeds the model's "
                             f"max_position_embeddings={self.model.max_position_embeddings}")
        s = self.speculative
        if s.method == "mtp" and s.num_mtp_modules > self.model.num_nextn_predict_layers:
            raise ValueError(f"speculative.num_mtp_modules={s.num_mtp_modules} but the model stores "
                             f"num_nextn_predict_layers={self.model.num_nextn_predict_layers} MTP layers")
        if self.checksums:
            unchecked = sorted({*self.weight_files, *self.tokenizer_files, *self.aux_files} - set(self.checksums))
            if unchecked:
                raise ValueError(f"files {unchecked} are listed without a checksum")
        return self

    def data_files(self) -> list[str]:
        """Every file of the engine the manifest lists, but manifest.json itself (relative paths)."""
        files = [*self.weight_files, *self.tokenizer_files, *self.aux_files, *self.checksums]
        c = self.compiled_step
        if c is not None:
            files += [c.file] + ([c.kernels_file] if c.kernels_file else [])
        return list(dict.fromkeys(files))

    def save(self, engine_dir: str | Path) -> Path:
        path = Path(engine_dir) / MANIFEST_NAME
        path.write_text(json.dumps(self.model_dump(mode="json"), indent=2, allow_nan=False) + "\n")
        return path

    @classmethod
    def load(cls, engine_dir: str | Path) -> "EngineManifest":
        """Read and validate `engine_dir/manifest.json`.

        Raises:
            EngineError: no manifest (not an engine directory), not a regular file, unreadable, not UTF-8 JSON,
                not a JSON object, no or another schema version, or a field that fails validation (a path outside
                the engine, MTP without modules, a non-finite number, ...); the message says which and how to fix
                it (rebuild with `build-engine`).
        """
        path = Path(engine_dir) / MANIFEST_NAME
        rebuild = "rebuild the engine with `build-engine --model_dir CHECKPOINT --output_dir DIR`"
        if not path.exists():
            raise EngineError(f"{engine_dir} is not an nextn engine directory (no {MANIFEST_NAME}); build one with "
                              "`build-engine --model_dir CHECKPOINT --output_dir DIR`")
        if not path.is_file():
            raise EngineError(f"{path} is not a regular file; {rebuild}")
        try:
            size = path.stat().st_size
            if size > MAX_MANIFEST_BYTES:
                raise EngineError(f"{path} is {size} bytes, more than any manifest build-engine writes "
                                  f"({MAX_MANIFEST_BYTES} at most); {rebuild}")
            data = json.loads(path.read_bytes().decode("utf-8"), parse_constant=_refuse_constant)
        except OSError as e:
            raise EngineError(f"cannot read {path}: {e}") from e
        except UnicodeDecodeError as e:
            raise EngineError(f"{path} is not UTF-8 text ({e}); {rebuild}") from e
        except (json.JSONDecodeError, RecursionError) as e:
            raise EngineError(f"{path} is not valid JSON ({e}); {rebuild}") from e
        except ValueError as e:  # a NaN / Infinity constant
            raise EngineError(f"{path} is not valid JSON: {e}; {rebuild}") from e
        if not isinstance(data, dict):
            raise EngineError(f"{path} holds a JSON {type(data).__name__}, not an object; {rebuild}")
        if "schema_version" not in data:
            raise EngineError(f"{path} has no schema_version: it was not written by build-engine; {rebuild}")
        version = data["schema_version"]
        if type(version) is not int:
            raise EngineError(f"{path} has schema_version {version!r} of type {type(version).__name__}; build-engine "
                              f"writes the integer {SCHEMA_VERSION}; {rebuild}")
        if version != SCHEMA_VERSION:
            raise EngineError(f"{path} has schema_version {version}, this nextn reads only {SCHEMA_VERSION}; "
                              "rebuild the engine with this version's `build-engine`")
        try:
            return cls.model_validate(data)
        except ValidationError as e:
            problems = "; ".join(f"{'.'.join(map(str, err['loc'])) or 'manifest'}: {err['msg']}"
                                 for err in e.errors(include_url=False)[:5])
            raise EngineError(f"{path} is malformed: {problems}; {rebuild}") from None
        except (ValueError, RecursionError) as e:
            raise EngineError(f"{path} is malformed: {e}; {rebuild}") from e


def _refuse_constant(name: str) -> Any:
    raise ValueError(f"{name} is not a JSON number")


# Integrity --------------------------------------------------------------------------------------------
def sha256_file(path: str | Path) -> str:
    """SHA-256 hex digest of a file, streamed in 4 MiB chunks."""
    return _sha256_range(Path(path), 0, None)


def file_checksum(path: str | Path) -> FileChecksum:
    """Size, SHA-256 and per-chunk SHA-256 of a file (read once, streamed)."""
    hasher = StreamHasher()
    with Path(path).open("rb") as f:
        while chunk := f.read(CHUNK_BYTES):
            hasher.update(chunk)
    return hasher.checksum()


def _sha256_range(path: Path, start: int, length: int | None) -> str:
    h = hashlib.sha256()
    left = length
    with path.open("rb") as f:
        f.seek(start)
        while left is None or left > 0:
            chunk = f.read(CHUNK_BYTES if left is None else min(CHUNK_BYTES, left))
            if not chunk:
                break
            h.update(chunk)
            if left is not None:
                left -= len(chunk)
    return h.hexdigest()


def _verify_digest(path: Path, expected: FileChecksum, fix: str) -> None:
    """Compare a file's SHA-256 with the record: per chunk on every core when recorded, else in one stream."""
    if not expected.chunk_sha256:
        digest = sha256_file(path)
        if digest != expected.sha256:
            raise EngineFileError(f"engine file {path} is corrupt: its SHA-256 is {digest[:16]}…, the manifest "
                                  f"records {expected.sha256[:16]}… (a changed byte); {fix}", path)
        return
    n, size = len(expected.chunk_sha256), expected.chunk_bytes
    # hashlib releases the GIL on large updates: threads hash on every core
    with ThreadPoolExecutor(max_workers=max(1, min(n, os.cpu_count() or 1))) as pool:
        digests = list(pool.map(lambda i: _sha256_range(path, i * size, size), range(n)))
    for i, (got, want) in enumerate(zip(digests, expected.chunk_sha256)):
        if got != want:
            end = min((i + 1) * size, expected.num_bytes)
            raise EngineFileError(f"engine file {path} is corrupt: bytes {i * size}–{end} have SHA-256 {got[:16]}…, "
                                  f"the manifest records {want[:16]}… (a changed byte); {fix}", path)


def verify_engine_files(engine_dir: str | Path, manifest: EngineManifest, mode: str = "full") -> None:
    """Check that the files the manifest lists are present, regular, inside the engine and intact.

    Args:
        engine_dir: the engine directory.
        manifest: its manifest (`EngineManifest.load`).
        mode: "full" (sizes, safetensors headers and SHA-256 of every file), "size" (sizes and headers), "off"
            (`LlmArgs.verify_weights`); every mode checks that the listed files are present and regular.
    Raises:
        EngineFileError: a listed file is missing, not a regular file, of another size or SHA-256 than recorded
            (corrupt, truncated, edited), or a weights file whose safetensors header is inconsistent; the message
            names the file and says to rebuild.
    """
    root = Path(engine_dir)
    fix = "rebuild the engine with `build-engine` (or restore it from a good copy)"
    for name in [*manifest.weight_files, *manifest.tokenizer_files, *manifest.aux_files, *manifest.checksums]:
        p = root / name  # checked even with "off": a FIFO or device there would hang or exhaust the load
        if not p.is_file():
            what = "missing" if not p.exists() else "not a regular file"
            raise EngineFileError(f"engine file {p} listed in {MANIFEST_NAME} is {what}; {fix}", p)
    if mode == "off":
        return
    if not manifest.checksums:
        logger.warning("%s was built before engine checksums existed: its files cannot be verified; rebuild it to "
                       "have them checked", root)
    for name, expected in manifest.checksums.items():
        size = (root / name).stat().st_size
        if size != expected.num_bytes:
            raise EngineFileError(f"engine file {root / name} is {size} bytes, the manifest records "
                                  f"{expected.num_bytes} (truncated or replaced); {fix}", root / name)
    for name in manifest.weight_files:
        check_safetensors_header(root / name)
    if mode == "full":
        for name, expected in manifest.checksums.items():
            _verify_digest(root / name, expected, fix)


_ST_ITEMSIZE = {"F64": 8, "F32": 4, "F16": 2, "BF16": 2, "I64": 8, "I32": 4, "I16": 2, "I8": 1, "U8": 1, "BOOL": 1,
                "F8_E4M3": 1, "F8_E5M2": 1}


def check_safetensors_header(path: Path) -> int:
    """Validate a safetensors file's header against its size; return the number of tensors.

    Every tensor must have a known dtype, a non-negative shape whose byte size equals its `data_offsets` range,
    and the ranges must tile the data section exactly up to the end of the file.

    Raises:
        EngineFileError: naming the file and the first inconsistency.
    """
    fix = "rebuild the engine"
    size = path.stat().st_size
    try:
        with path.open("rb") as f:
            head = f.read(8)
            if len(head) < 8:
                raise EngineFileError(f"{path} is {size} bytes: too short for a safetensors file; {fix}", path)
            (n,) = struct.unpack("<Q", head)
            if n > min(size - 8, 100 << 20):
                raise EngineFileError(f"{path}: safetensors header length {n} exceeds the file ({size} bytes); "
                                      f"{fix}", path)
            header = json.loads(f.read(n).decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise EngineFileError(f"{path}: unreadable safetensors header ({e}); {fix}", path) from e
    if not isinstance(header, dict):
        raise EngineFileError(f"{path}: safetensors header is not an object; {fix}", path)
    ranges = []
    for name, info in header.items():
        if name == "__metadata__":
            continue
        try:
            dtype, shape, (start, end) = info["dtype"], info["shape"], info["data_offsets"]
            nbytes = math.prod(shape) * _ST_ITEMSIZE[dtype]
            ok = all(isinstance(d, int) and d >= 0 for d in shape) and 0 <= start <= end and end - start == nbytes
        except (KeyError, TypeError, ValueError):
            ok = False
        if not ok:
            raise EngineFileError(f"{path}: tensor {name!r} has an inconsistent header entry {info!r}; {fix}",
                                  path)
        ranges.append((start, end, name))
    pos = 0
    for start, end, name in sorted(ranges):
        if start != pos:
            raise EngineFileError(f"{path}: tensor {name!r} starts at byte {start} of the data, expected {pos}; "
                                  f"{fix}", path)
        pos = end
    if 8 + n + pos != size:
        raise EngineFileError(f"{path} is {size} bytes but its header describes {8 + n + pos} (truncated or "
                              f"extended); {fix}", path)
    return len(ranges)
