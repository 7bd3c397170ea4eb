"""The engine's tokenizer: the checkpoint's own files, loaded with `transformers` (a well-kept library)."""

from __future__ import annotations

from pathlib import Path

from transformers import AutoTokenizer, PreTrainedTokenizerBase


class EngineTokenizer:
    """encode (with the tokenizer's BOS convention) and decode (special tokens skipped)."""

    def __init__(self, tok: PreTrainedTokenizerBase) -> None:
        self.tok = tok

    @classmethod
    def load(cls, engine_dir: Path, files: list[str]) -> "EngineTokenizer | None":
        """The tokenizer saved in `engine_dir`, or None when the engine has none (token-id prompts only)."""
        if not files:
            return None
        return cls(AutoTokenizer.from_pretrained(str(engine_dir)))

    def encode(self, text: str) -> list[int]:
        return list(self.tok.encode(text))

    def decode(self, ids: list[int]) -> str:
        return self.tok.decode(ids, skip_special_tokens=True)
