"""A speculative method's record (`Method`) and what its `build` and `prepare_model` may read (`LoadContext`): the
registry's entries."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from pydantic import BaseModel
from torch import nn

from nextn.build.manifest import EngineManifest
from nextn.config.llm_args import parse_llm_args
from nextn.models.medusa import MedusaHeads
from nextn.speculative.protocol import AcceptanceRule, Drafter


@dataclass(frozen=True)
class LoadContext:
    """What a method may read when it builds its drafter: the target engine as loaded.

    Attributes:
        manifest: the target engine's manifest; engine_dir: its directory (a Draft_Target compares tokenizers there).
        device: where the target runs; max_seq_len: the engine's longest request (sizes per-request histories).
        medusa_heads: the engine's Medusa heads (None when it has none).
        tensor_parallel: whether this process holds one rank's share of a tensor-parallel model.
        build_method, prepare_method: the registry's `build` / `prepare_model` for another config (a method that
            combines drafters builds the one it wraps through them; set by the registry).
        open_checkpoint: path → a reader of an HF checkpoint or a GGUF (`hf_config`, `names()`, `get(name)` in HF's
            names, `close()`: the build layer's `engine_settings.open_checkpoint`), for a method that reads weights
            of its own as they are (Gemma4Assistant); None where the caller offers none.
    """

    manifest: EngineManifest
    engine_dir: Path
    device: torch.device
    max_seq_len: int
    medusa_heads: MedusaHeads | None = None
    tensor_parallel: bool = False
    build_method: Callable[[Any], tuple[Drafter, AcceptanceRule]] | None = None
    prepare_method: Callable[[nn.Module, Any], None] | None = None
    open_checkpoint: Callable[[Path], Any] | None = None


Build = Callable[[Any, LoadContext], tuple[Drafter, AcceptanceRule]]
PrepareModel = Callable[[nn.Module, Any, LoadContext], None]


@dataclass(frozen=True)
class Method:
    """One speculative method.

    Attributes:
        decoding_type: the `speculative_config.decoding_type` that selects it.
        config: its pydantic config class (a `decoding_type: Literal[...]` field, strict keys).
        build: (config, LoadContext) → (drafter, acceptance rule); raises LlmArgsError for a config this engine
            cannot run.
        built_for: the config an engine built for this method decodes with by default (None: not built for it).
        prepare_model: (target model, config, LoadContext) → None, called once on the loaded target model before
            the first step, for what the method changes in it (MTP: its draft head cut to the hot tokens); raises
            LlmArgsError for a config the loaded model cannot run. None: the model is used as loaded.
    """

    decoding_type: str
    config: type[BaseModel]
    build: Build
    built_for: Callable[[EngineManifest], BaseModel | None] | None = None
    prepare_model: PrepareModel | None = None


def from_build_yaml(decoding_type: str) -> Callable[[EngineManifest], BaseModel | None]:
    """`built_for` for a method without weights of its own: the build YAML's speculative_config when it names
    `decoding_type` (kept in the manifest's build_options) and the engine holds no MTP or Medusa weights."""

    def built_for(manifest: EngineManifest) -> BaseModel | None:
        built = (manifest.build_options.extra_llm_api_options or {}).get("speculative_config")
        if manifest.speculative.method != "none" or not isinstance(built, dict):
            return None
        if built.get("decoding_type") != decoding_type:
            return None
        return parse_llm_args({"speculative_config": built}).speculative_config

    return built_for
