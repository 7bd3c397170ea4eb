"""nextn: engines with a fused verify-and-draft step for self-drafting LLM checkpoints (DeepSeek MTP, Medusa).

    from nextn import LLM, SamplingParams
    llm = LLM("engine_dir", speculative_config={"decoding_type": "MTP", "num_nextn_predict_layers": 3})
    out = llm.generate(["Hello"], SamplingParams(max_tokens=32))

The public names are imported on first use (module `__getattr__`, PEP 562), so that `import nextn.cli.main` and
every `--help` stay free of torch (a second or more to import).
"""

from __future__ import annotations

import importlib
from typing import Any

__version__ = "0.1.0"

#: public name -> the module defining it
_LAZY = {"LLM": "nextn.runtime.llm", "SamplingParams": "nextn.runtime.sampling_params",
         "QuantConfig": "nextn.quantization.weight_only", "RequestOutput": "nextn.runtime.outputs",
         "CompletionOutput": "nextn.runtime.outputs"}

__all__ = ["LLM", "SamplingParams", "QuantConfig", "RequestOutput", "CompletionOutput", "__version__"]


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        value = getattr(importlib.import_module(_LAZY[name]), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'nextn' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_LAZY))
