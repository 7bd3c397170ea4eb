"""LLM arguments the command lines take from environment variables, for backward compatibility.

Environment variables are read here, in the CLI layer only (STYLE.md §5); the library takes the typed `LlmArgs`
field (`LLM(..., verify_weights="size")` or `verify_weights: size` in the `--extra_llm_api_options` YAML).
"""

from __future__ import annotations

import os

from nextn.build.manifest import VERIFY_MODES
from nextn.config.llm_args import LlmArgsError

#: Older spelling of `LlmArgs.verify_weights`: full, size or off.
VERIFY_WEIGHTS_ENV = "NEXTN_VERIFY_WEIGHTS"


def env_llm_overrides() -> dict[str, str]:
    """`LLM(...)` keyword overrides from the environment: {"verify_weights": mode} when `NEXTN_VERIFY_WEIGHTS` is
    set and not blank (case and surrounding spaces ignored), else {}. As an override it beats the YAML's value.

    Raises:
        LlmArgsError: the variable holds another value than full, size or off.
    """
    mode = os.environ.get(VERIFY_WEIGHTS_ENV, "").strip().lower()
    if not mode:
        return {}
    if mode not in VERIFY_MODES:
        raise LlmArgsError(f"{VERIFY_WEIGHTS_ENV}={mode!r}; choose one of {', '.join(VERIFY_MODES)}")
    return {"verify_weights": mode}
