"""The tokenizer of a llama.cpp GGUF file, rebuilt from its metadata as an HF `tokenizers` tokenizer.

A GGUF carries no tokenizer.json: the vocabulary (`tokenizer.ggml.tokens`), its kind (`tokenizer.ggml.model`:
`llama` = SentencePiece-style BPE with byte fallback, `gpt2` = byte-level BPE), the merges (`tokenizer.ggml.merges`;
absent from SentencePiece files, whose merges follow from `tokenizer.ggml.scores`), the pre-tokenizer's name
(`tokenizer.ggml.pre`: the split regex the merges were learned with), token types, special token ids and the chat
template (`tokenizer.chat_template`) are metadata under llama.cpp's key names.

The conversion is `transformers`' own (`transformers.integrations.gguf.gguf_tokenizer_mapping`:
`convert_gguf_tokenizer` picks the builder from the tokenizer kind, adds control tokens as special tokens and sets the
split regex of the named pre-tokenizer), so the result equals `AutoTokenizer.from_pretrained(dir, gguf_file=name)`
(tested on SmolLM2 and Qwen2.5 over ../shared/data/prompts). nextn only fills two gaps:
- the metadata is read from the `gguf.GGUFReader` the checkpoint already holds, and llama.cpp's "no such token"
  (0xFFFFFFFF, e.g. stories260K's padding id) is dropped — `transformers.get_gguf_tokenizer` raises IndexError on it;
- the end-of-generation ids (`eos_token_ids`) are recorded as generation_config.json `eos_token_id`, following
  llama.cpp's rule (`llama_vocab::impl::load`, `special_eog_ids`): the EOS/EOT/EOM ids plus the control tokens
  spelled as an end of turn or of text (`<|im_end|>`, `<|endoftext|>`, ...). For Qwen2.5 this gives [151645, 151643],
  HF's generation_config.json; for SmolLM2 [2, 0] (`<|im_end|>`, `<|endoftext|>`).

(transformers 5 replaced 4.x's `GGUFTokenizerSkeleton` / `GGUF_TO_FAST_CONVERTERS` with this module.) A known
difference that nextn keeps, so that encodings equal transformers': for pre-tokenizer `smollm` transformers has no
split regex and keeps GPT-2's, whereas llama.cpp and SmolLM2's own tokenizer.json isolate digits first; the two differ
where several spaces precede a digit ("a  1" → `a Ġ Ġ 1` here, `a ĠĠ 1` there; 52 of the 2,206 prompts of
../shared/data/prompts, mostly GSM8K's double spaces after a full stop).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from nextn.build.checkpoint import CheckpointError

#: llama.cpp writes 0xFFFFFFFF (-1 as uint32) for "no such token".
NO_TOKEN = 2**32 - 1
#: llama.cpp token type of a control token (`gguf.TokenType.CONTROL`).
CONTROL = 3
#: Token texts llama.cpp treats as an end of generation (`special_eog_ids`), FIM separators left out (infill only).
END_OF_GENERATION_TEXTS = frozenset({
    "<|eot_id|>", "<|im_end|>", "<|end|>", "<|return|>", "<|call|>", "<end_of_turn>", "<|endoftext|>", "<|eom_id|>",
    "<EOT>", "_<EOT>", "<|end_of_text|>", "<end_of_utterance>", "<｜end▁of▁sentence｜>",
})  # fmt: skip
GENERATION_CONFIG_NAME = "generation_config.json"
_SPECIAL_TOKENS = {"bos_token": "bos_token_id", "eos_token": "eos_token_id", "unk_token": "unknown_token_id",
                   "pad_token": "padding_token_id"}


def check_vocabulary(fields: Any, path: Path) -> None:
    """Refuse tokenizer metadata that `transformers`' converter would fail on or turn into a wrong tokenizer.

    Checked (each GGUF value's own type, as `gguf.GGUFReader` reports it): `tokenizer.ggml.tokens` is a non-empty
    array of strings with no string twice (two ids for one string: one of them could never be encoded or decoded);
    `scores` (floats) and `token_type` (integers), where present, have one entry per token; `merges` is an array of
    strings; a `gpt2` (byte-level BPE) vocabulary has merges, as llama.cpp requires, and a SentencePiece one without
    merges has scores (its merges are derived from them).

    Args:
        fields: `gguf.GGUFReader.fields`; path: the file (for messages).
    Raises:
        CheckpointError: naming the key and what is wrong (the first repeated token with both ids).
    """
    def array(key: str, kinds: tuple[str, ...], what: str) -> Any:
        f = fields.get(f"tokenizer.ggml.{key}")
        if f is None:
            return None
        types = [t.name for t in f.types]
        if len(types) != 2 or types[0] != "ARRAY" or types[1] not in kinds:
            raise CheckpointError(f"{path}: GGUF metadata 'tokenizer.ggml.{key}' is {'/'.join(types) or 'empty'}, "
                                  f"not an array of {what}; the tokenizer metadata is corrupt")
        return f

    tokens_field = array("tokens", ("STRING",), "strings")
    if tokens_field is None or not tokens_field.data:
        raise CheckpointError(f"{path}: tokenizer.ggml.tokens is missing or empty")
    tokens = tokens_field.contents()
    first: dict[str, int] = {}
    for i, token in enumerate(tokens):
        j = first.setdefault(token, i)
        if j != i:
            raise CheckpointError(f"{path}: tokenizer.ggml.tokens lists {token!r} twice (ids {j} and {i}); a "
                                  "vocabulary names each token once: the tokenizer metadata is corrupt")
    for key, kinds, what in (("scores", ("FLOAT32", "FLOAT64"), "floats"),
                             ("token_type", ("INT32", "UINT32", "INT8", "UINT8", "INT16", "UINT16", "INT64", "UINT64"),
                              "integers")):
        f = array(key, kinds, what)
        if f is not None and len(f.data) != len(tokens):
            raise CheckpointError(f"{path}: tokenizer.ggml.{key} has {len(f.data)} entries for {len(tokens)} tokens; "
                                  "it needs one per token")
    merges = array("merges", ("STRING",), "strings")
    model = fields.get("tokenizer.ggml.model")
    kind = model.contents() if model is not None and [t.name for t in model.types] == ["STRING"] else None
    if kind == "gpt2" and merges is None:
        raise CheckpointError(f"{path}: a gpt2 (byte-level BPE) tokenizer needs tokenizer.ggml.merges, which the file "
                              "lacks (llama.cpp refuses it too); re-convert the model")
    if kind == "llama" and merges is None and "tokenizer.ggml.scores" not in fields:
        raise CheckpointError(f"{path}: a llama (SentencePiece) tokenizer without tokenizer.ggml.merges needs "
                              "tokenizer.ggml.scores to derive them, and the file has neither")


class GGUFTokenizerMetadata:
    """The tokenizer metadata of one GGUF, in `transformers.get_gguf_tokenizer`'s three parts.

    Args:
        reader: an open `gguf.GGUFReader`.
        path: the file (for messages).
    Attributes:
        architecture: `general.architecture` (picks SentencePiece variants, e.g. Gemma's).
        tokenizer_dict: the builder's input (`tokens`, `merges`, `scores`, `token_type`, `tokenizer_type`,
            `pre_tokenizer_type`, ids), keyed as `GGUF_TOKENIZER_MAPPING["tokenizer"]` renames them.
        tokenizer_config: tokenizer constructor kwargs (`chat_template`, `add_bos_token`, `add_eos_token`, special
            token strings; a missing or "no such token" id is left out).
    Raises:
        CheckpointError: the file has no `tokenizer.ggml.tokens`.
    """

    def __init__(self, reader: Any, path: Path) -> None:
        from transformers.integrations.gguf.gguf_tokenizer_mapping import GGUF_TOKENIZER_MAPPING

        self.path = path
        self._fields = reader.fields
        if "tokenizer.ggml.tokens" not in self._fields:
            raise CheckpointError(f"{path} has no tokenizer (no tokenizer.ggml.tokens metadata): "
                                  "pass token-id prompts, or build from a GGUF that carries one")
        check_vocabulary(self._fields, path)
        self.architecture = str(self._get("general.architecture"))
        parts: dict[str, dict[str, Any]] = {}
        for group, renames in GGUF_TOKENIZER_MAPPING.items():
            parts[group] = {name: self._get(f"tokenizer.{key}") for key, name in renames.items()
                            if f"tokenizer.{key}" in self._fields}
        self.tokenizer_dict, self.tokenizer_config = parts["tokenizer"], parts["tokenizer_config"]
        self.tokens: list[str] = self.tokenizer_dict["tokens"]
        for key in ("bos_token_id", "eos_token_id", "unk_token_id", "pad_token_id"):
            if key in self.tokenizer_dict and self.token_id(self.tokenizer_dict[key]) is None:
                del self.tokenizer_dict[key]
        if self.tokenizer_dict.get("tokenizer_type") == "llama":
            # llama.cpp adds BOS to a SentencePiece vocabulary that does not say otherwise (as transformers does).
            self.tokenizer_config.setdefault("add_bos_token", True)
        for name, key in _SPECIAL_TOKENS.items():
            token_id = self.token_id(self._get(f"tokenizer.ggml.{key}", None))
            if token_id is not None:
                self.tokenizer_config[name] = self.tokens[token_id]

    def _get(self, key: str, default: Any = ...) -> Any:
        field = self._fields.get(key)
        if field is None:
            if default is ...:
                raise CheckpointError(f"{self.path} lacks GGUF metadata key {key!r}")
            return default
        return field.contents()

    def token_id(self, value: Any) -> int | None:
        """`value` as a token id, or None for a missing id, llama.cpp's 0xFFFFFFFF or an id outside the vocabulary."""
        if value is None or int(value) == NO_TOKEN or not 0 <= int(value) < len(self.tokens):
            return None
        return int(value)

    def eos_token_ids(self) -> list[int]:
        """The ids that end generation: EOS first, then EOT / EOM and the end-of-turn control tokens, ascending."""
        ids = [self.token_id(self._get(f"tokenizer.ggml.{k}_token_id", None)) for k in ("eos", "eot", "eom")]
        types = self.tokenizer_dict.get("token_type") or [CONTROL] * len(self.tokens)
        ids += [i for i, (t, ty) in enumerate(zip(self.tokens, types))
                if ty == CONTROL and t in END_OF_GENERATION_TEXTS]
        return list(dict.fromkeys(i for i in ids if i is not None))

    def bos_token_id(self) -> int | None:
        return self.token_id(self._get("tokenizer.ggml.bos_token_id", None))


def build_tokenizer(reader: Any, path: Path):
    """A `transformers` fast tokenizer (`TokenizersBackend`) equal to its GGUF loader's, chat template included.

    Args:
        reader: an open `gguf.GGUFReader`; path: the file (for messages).
    Returns:
        a `PreTrainedTokenizerFast`: `encode` adds BOS where the file says (`tokenizer.ggml.add_bos_token`;
        SentencePiece files default to yes), `chat_template` is `tokenizer.chat_template` (None when absent).
    Raises:
        CheckpointError: no tokenizer in the file, or a tokenizer kind `transformers` cannot build (names the kinds it
            can).
    """
    return _build(GGUFTokenizerMetadata(reader, path))


def _build(meta: GGUFTokenizerMetadata):
    from transformers import PreTrainedTokenizerFast
    from transformers.integrations.gguf.gguf_tokenizer_mapping import convert_gguf_tokenizer

    try:
        backend, extra = convert_gguf_tokenizer(meta.architecture, meta.tokenizer_dict)
    except ValueError as e:  # "Cannot build a tokenizer from a GGUF file stating tokenizer ...; Supported: [...]"
        raise CheckpointError(f"{meta.path}: {e}") from None
    return PreTrainedTokenizerFast(tokenizer_object=backend, **meta.tokenizer_config, **extra)


def check_gguf_chat_template(reader: Any, path: Path) -> None:
    """Render the GGUF's `tokenizer.chat_template` (code from the file) with sample conversations under the runtime's
    render budget, from its metadata alone (no tokenizer is built): what a build does before any work.

    Raises:
        ChatTemplateLimitError: the template passes the render budget (time, size or memory) on a sample.
        CheckpointError: as `GGUFTokenizerMetadata` (only where the file has a template).
    """
    from nextn.runtime.tokenizer import check_template_source

    if "tokenizer.chat_template" not in reader.fields:
        return
    config = GGUFTokenizerMetadata(reader, path).tokenizer_config
    specials = {k: v for k, v in config.items() if k in _SPECIAL_TOKENS and isinstance(v, str)}
    check_template_source(config.get("chat_template"), specials, f"{path} (tokenizer.chat_template)")


def write_tokenizer_files(reader: Any, path: Path, out_dir: str | Path) -> list[str]:
    """Save the GGUF's tokenizer into `out_dir` (tokenizer.json, tokenizer_config.json, chat_template.jinja when the
    file has a template) and its generation ids as generation_config.json (`eos_token_id`: a list, `bos_token_id`).

    The chat template is code from the file: it is rendered once with sample conversations under the runtime's
    render budget (`nextn.runtime.tokenizer.check_chat_template`) before anything is written.
    Returns:
        the tokenizer file names written (sorted; generation_config.json, an auxiliary file, is not listed).
    Raises:
        CheckpointError: as `build_tokenizer`.
        ChatTemplateLimitError: the chat template passes the render budget (time, size or memory) on a sample.
    """
    from nextn.runtime.tokenizer import check_chat_template

    out = Path(out_dir)
    before = {p.name for p in out.iterdir()} if out.is_dir() else set()
    meta = GGUFTokenizerMetadata(reader, path)
    tok = _build(meta)
    check_chat_template(tok, f"{path} (tokenizer.chat_template)")
    tok.save_pretrained(str(out))
    written = sorted(p.name for p in out.iterdir() if p.name not in before)
    generation = {"bos_token_id": meta.bos_token_id(), "eos_token_id": meta.eos_token_ids()}
    (out / GENERATION_CONFIG_NAME).write_text(json.dumps(generation, indent=2) + "\n")
    return written
