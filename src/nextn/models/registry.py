"""The model families nextn builds, by HF architecture name: config, weight layout and runtime module."""

from __future__ import annotations

from types import ModuleType
from typing import Any

from nextn.models.config import GLM_LITE, ConfigError, DeepseekV3ModelConfig
from nextn.models.deepseek_v3 import weights as deepseek_weights
from nextn.models.deepseek_v3.model import DeepseekV3ForCausalLM
from nextn.models.llama import weights as llama_weights
from nextn.models.llama.config import LLAMA_ARCHITECTURES, LlamaModelConfig
from nextn.models.llama.model import LlamaForCausalLM
from nextn.models.model_config import ModelConfig  # noqa: F401 (re-exported: the registry's config type)

#: Qwen2 is the Llama family with q/k/v biases: same module and weight layout, options in `LlamaModelConfig`.
MODEL_CLASSES = {"DeepseekV3ForCausalLM": DeepseekV3ForCausalLM,
                 **{arch: LlamaForCausalLM for arch in LLAMA_ARCHITECTURES}}
WEIGHT_LAYOUTS: dict[str, ModuleType] = {"DeepseekV3ForCausalLM": deepseek_weights,
                                         **{arch: llama_weights for arch in LLAMA_ARCHITECTURES}}


#: Vision-language architectures whose text model nextn builds (its weights under `model.language_model.`, the
#: vision tower's under `model.visual.` left out: `llama.stored_layout`) → that text architecture
MULTIMODAL_TEXT = {"Qwen3_5ForConditionalGeneration": "Qwen3_5ForCausalLM",
                   "Qwen3_5MoeForConditionalGeneration": "Qwen3_5MoeForCausalLM",
                   "Gemma4ForConditionalGeneration": "Gemma4ForCausalLM"}  # its towers: `model.vision_tower.` etc.
#: Checkpoints that draft for another model rather than decode on their own → the `decoding_type` that reads them
DRAFTERS = {"Gemma4AssistantForCausalLM": "Gemma4Assistant"}


def model_config_from_hf(hf: dict[str, Any]) -> DeepseekV3ModelConfig | LlamaModelConfig:
    """The normalised config of an HF `config.json` dict, for any supported family.

    Raises:
        ConfigError: an unsupported architecture (the message lists the supported ones) or an invalid field.
    """
    archs = hf.get("architectures") or []
    if archs and archs[0] in DRAFTERS:
        raise ConfigError(f"{archs[0]} is a drafter, not a model to build: give it to a Gemma 4 engine as "
                          f"speculative_config {{decoding_type: {DRAFTERS[archs[0]]}, max_draft_len: 3, "
                          "speculative_model_dir: <this checkpoint>}")
    if archs and archs[0] in MULTIMODAL_TEXT:  # the text model of a released vision-language checkpoint
        tied = {"tie_word_embeddings": hf["tie_word_embeddings"]} if "tie_word_embeddings" in hf else {}
        hf = {**{k: v for k, v in hf.items() if not k.endswith("_config")}, **(hf.get("text_config") or {}),
              **tied, "architectures": [MULTIMODAL_TEXT[archs[0]]]}  # the whole model's tying is what HF applies
        archs = hf["architectures"]
    if (archs and archs[0] in LLAMA_ARCHITECTURES) or hf.get("model_type") in LLAMA_ARCHITECTURES.values():
        return LlamaModelConfig.from_hf(hf)
    if (archs and archs[0] in ("DeepseekV3ForCausalLM", *GLM_LITE)) or hf.get("model_type") in ("deepseek_v3",
                                                                                             "glm4_moe_lite"):
        return DeepseekV3ModelConfig.from_hf(hf)
    raise ConfigError(f"unsupported architecture {(archs or [hf.get('model_type')])[0]!r}: nextn builds "
                      f"{', '.join(MODEL_CLASSES)}")
