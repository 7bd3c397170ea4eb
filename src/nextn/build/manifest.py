"""The engine manifest: the typed, self-describing header of an engine directory (`manifest.json`).

The runtime reads this file and never guesses from file names (STYLE.md §9). Layout of an engine directory:

    engine_dir/
      manifest.json        this model, serialised
      model.safetensors    weights in the runtime layout (nextn.models.deepseek_v3.weights)
      tokenizer files      tokenizer.json, tokenizer_config.json, ... when the checkpoint has them
      compiled/            torch.compile artifacts of the decode step (`build-engine --compile_step`), described
                           by `compiled_step`; optional, and ignored by a loader with another torch or device
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from nextn.models.registry import ModelConfig

SCHEMA_VERSION = 1
MANIFEST_NAME = "manifest.json"


class EngineError(ValueError):
    """An engine directory is missing, unreadable, or of an unsupported schema version."""


class SpeculativeInfo(BaseModel):
    """What drafting the engine can do: `method` none, mtp or medusa, module/head counts, the default draft length."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    method: Literal["none", "mtp", "medusa"] = "none"
    num_mtp_modules: int = Field(default=0, ge=0)  # MTP layers stored in the engine
    max_draft_len: int = Field(default=0, ge=0)  # K the engine was built for (speculative_config's num_nextn_predict_layers)
    use_mtp_vanilla: bool = False  # default drafter: Vanilla (K distinct modules) or Eagle (one module K times)
    num_medusa_heads: int = Field(default=0, ge=0)  # Medusa heads stored under `medusa_heads.` in the weights
    medusa_num_layers: int = Field(default=0, ge=0)  # ResBlocks per head


class BuildOptions(BaseModel):
    """The options `build-engine` was run with (defaults for the runtime, overridable by `LLM(...)`)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    max_batch_size: int = Field(default=8, gt=0)
    max_seq_len: int = Field(default=2048, gt=0)
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


class EngineManifest(BaseModel):
    """Everything the runtime needs to know about an engine directory."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    schema_version: int = SCHEMA_VERSION
    nextn_version: str
    architecture: str
    dtype: Literal["float32", "bfloat16", "float16"]
    model: ModelConfig
    speculative: SpeculativeInfo
    build_options: BuildOptions
    source: SourceInfo
    weight_files: list[str] = ["model.safetensors"]
    tokenizer_files: list[str] = []  # empty: the engine takes token-id prompts only
    compiled_step: CompiledStepInfo | None = None  # absent in engines built without --compile_step

    def save(self, engine_dir: str | Path) -> Path:
        path = Path(engine_dir) / MANIFEST_NAME
        path.write_text(json.dumps(self.model_dump(mode="json"), indent=2) + "\n")
        return path

    @classmethod
    def load(cls, engine_dir: str | Path) -> "EngineManifest":
        """Read `engine_dir/manifest.json`.

        Raises:
            EngineError: no manifest (not an engine directory), unreadable JSON, or a schema version this
                nextn cannot read; the message says which and how to fix it (rebuild with `build-engine`).
        """
        path = Path(engine_dir) / MANIFEST_NAME
        if not path.is_file():
            raise EngineError(f"{engine_dir} is not an nextn engine directory (no {MANIFEST_NAME}); build one with "
                              "`build-engine --model_dir CHECKPOINT --output_dir DIR`")
        try:
            data = json.loads(path.read_text())
        except json.JSONDecodeError as e:
            raise EngineError(f"{path} is not valid JSON ({e}); rebuild the engine") from e
        version = data.get("schema_version")
        if version != SCHEMA_VERSION:
            raise EngineError(f"{path} has schema_version {version}, this nextn reads {SCHEMA_VERSION}; "
                              "rebuild the engine with this version's `build-engine`")
        try:
            return cls.model_validate(data)
        except ValueError as e:
            raise EngineError(f"{path} is malformed: {e}") from e
