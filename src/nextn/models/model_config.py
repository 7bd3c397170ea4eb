"""`ModelConfig`: the normalised config of any model family nextn builds, as the manifest records it (the
`architecture` field tells which). Free of torch: reading a manifest does not import the models."""

from __future__ import annotations

from typing import Annotated, Union

from pydantic import Field

from nextn.models.config import DeepseekV3ModelConfig
from nextn.models.llama.config import LlamaModelConfig

#: A normalised model config; `architecture` tells which family.
ModelConfig = Annotated[Union[DeepseekV3ModelConfig, LlamaModelConfig], Field(discriminator="architecture")]

__all__ = ["ModelConfig"]
