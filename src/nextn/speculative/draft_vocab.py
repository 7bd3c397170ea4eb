"""The draft model's vocabulary cut to its most frequent ("hot") tokens, so that its lm_head reads fewer bytes.

A small draft model's lm_head is a large share of what a draft step reads: Qwen2.5-0.5B's [151936, 896] head is
68 MB at 4 bits against ~206 MB for its 24 layers, and it is read once per draft token. FR-Spec (Zhao et al. 2025,
"FR-Spec: Accelerating Large-Vocabulary Language Models via Frequency-Ranked Speculative Sampling") keeps only the
rows of the most frequent tokens in the *draft* head; SGLang takes such a set as `speculative_token_map`, and
EAGLE-3 heads in vLLM and TensorRT-LLM carry a `draft_vocab_size` with a draft → target id map. nextn's name is
`draft_vocab_size` (`DraftTargetDecodingConfig`).

Lossless by construction: the target verifies every draft with its full vocabulary. Greedy drafts are the argmax
over the hot rows (a token outside them is never proposed, which can only lower acceptance); sampled drafts come
from q, the draft model's distribution restricted to the hot set and renormalized (zero elsewhere), and rejection
sampling with any proposal q yields the target's distribution (Leviathan et al. 2023, §2.3): the residual
normalize(max(0, p − q)) covers the tokens q cannot propose.

Which tokens are hot, without data: a byte-level BPE vocabulary (GPT-2, Llama-3, Qwen2, SmolLM2) numbers its tokens
in merge order — the bytes, then each merge as training made it, the most frequent pair first — and SentencePiece
orders its pieces by score, so a lower id is a more frequent token of the tokenizer's training corpus. The hot set
is the `draft_vocab_size` lowest ids plus every added / special token and the end-of-sequence ids (the chat
template's end of turn must stay proposable), rounded up to a multiple of 16 rows (the int4 kernel's block).
"""

from __future__ import annotations

from pathlib import Path

from collections.abc import Sequence

import torch

from nextn.config.user_files import read_user_json

#: Rows of a hot set are a multiple of this (nextn's int4 kernel takes output channels in blocks of 16).
ROW_MULTIPLE = 16
#: Cap of an engine's tokenizer.json / generation_config.json read here (a 256k-token tokenizer.json is ~20 MB).
MAX_ENGINE_JSON_BYTES = 256 << 20


def always_kept_ids(engine_dir: Path, vocab_size: int) -> list[int]:
    """The ids a hot set keeps whatever their rank: the tokenizer's added tokens (`tokenizer.json`) and the
    end-of-sequence ids (`generation_config.json`), those below `vocab_size`; [] when the engine has neither file.

    Raises:
        ValueError: a file is present but not valid JSON (names the file).
    """
    ids: set[int] = set()
    for name in ("tokenizer.json", "generation_config.json"):
        path = engine_dir / name
        if not path.exists():
            continue
        data = read_user_json(path, "the engine file", max_bytes=MAX_ENGINE_JSON_BYTES)
        if not isinstance(data, dict):
            raise ValueError(f"{path} is not a JSON object; rebuild the draft engine")
        if name == "tokenizer.json":
            ids.update(int(t["id"]) for t in data.get("added_tokens", []))
        else:
            eos = data.get("eos_token_id")
            ids.update(eos if isinstance(eos, list) else [] if eos is None else [eos])
    return sorted(i for i in ids if 0 <= i < vocab_size)


def load_token_map(path: Path, vocab_size: int) -> list[int]:
    """A token map: a JSON list of token ids, the most frequent first (`nextn token-map` writes one; SGLang's
    `speculative_token_map` holds the same set).

    Raises:
        ValueError: the file is missing, not a regular file of at most 64 MiB (`config/user_files.py`), not a JSON
            list of integers, or holds an id outside [0, vocab_size).
    """
    try:
        ids = read_user_json(path, "the token map (draft_token_map)")
    except ValueError as e:
        raise ValueError(f"{e}; write one with `nextn token-map`") from None
    if not isinstance(ids, list) or not all(isinstance(i, int) and not isinstance(i, bool) for i in ids):
        raise ValueError(f"the token map {path} must be a JSON list of token ids (most frequent first)")
    bad = [i for i in ids if not 0 <= i < vocab_size]
    if bad:
        raise ValueError(f"the token map {path} holds ids outside the draft model's vocabulary [0, {vocab_size}): "
                         f"{bad[:5]}; was it made with another tokenizer?")
    return ids


def hot_token_ids(vocab_size: int, draft_vocab_size: int | None, kept: Sequence[int] = (),
                  ranking: list[int] | None = None) -> torch.Tensor | None:
    """The draft head's rows: sorted token ids [V'] int64, V' ≥ `draft_vocab_size` a multiple of 16 — `kept`,
    then the best-ranked ids: `ranking` (a token map, most frequent first) and after it the lowest ids (most
    frequent in a BPE / SentencePiece vocabulary: module docstring). With a ranking and no `draft_vocab_size`, the
    whole ranking is kept. None when no cut is asked for or it would keep the whole vocabulary.

    Raises:
        ValueError: `draft_vocab_size` < 1.
    """
    if draft_vocab_size is None and ranking is not None:
        draft_vocab_size = len(set(ranking))
    if draft_vocab_size is None:
        return None
    if draft_vocab_size < 1:
        raise ValueError(f"draft_vocab_size must be ≥ 1, got {draft_vocab_size}")
    chosen = set(kept)
    size = -(-max(draft_vocab_size, len(chosen)) // ROW_MULTIPLE) * ROW_MULTIPLE
    for i in [*(ranking or ()), *range(vocab_size)]:
        if len(chosen) >= size:
            break
        chosen.add(i)
    if len(chosen) >= vocab_size:
        return None
    return torch.tensor(sorted(chosen), dtype=torch.int64)


def resolve_hot_tokens(engine_dir: Path, vocab_size: int, draft_vocab_size: int | None,
                       token_map: str | Path | None) -> torch.Tensor | None:
    """A drafter's hot tokens from its config keys (`draft_vocab_size`, `draft_token_map`): `hot_token_ids` with the
    engine's always-kept ids and the token map's ranking; None for the whole vocabulary.

    Raises:
        ValueError: an unreadable or mismatched token map, invalid engine JSON, or `draft_vocab_size` < 1.
    """
    ranking = None if token_map is None else load_token_map(Path(token_map), vocab_size)
    return hot_token_ids(vocab_size, draft_vocab_size, always_kept_ids(engine_dir, vocab_size), ranking)


def restrict_quantized_head(weights: dict[str, torch.Tensor], hot: torch.Tensor, prefix: str = "lm_head") -> bool:
    """Keep only the hot rows of a weight-only quantized lm_head in an engine's tensors (in place, before
    `install_weight_only_linears`): every `{prefix}.*` tensor is indexed by output channel in its first dimension.

    Returns:
        Whether the head was stored quantized (False: nothing changed; `restrict_dense_head` applies).
    """
    if f"{prefix}.weight_scale" not in weights:
        return False
    for key in [k for k in weights if k.startswith(prefix + ".")]:
        weights[key] = weights[key].index_select(0, hot.to(weights[key].device)).contiguous()
    return True


def restrict_dense_head(model: torch.nn.Module, hot: torch.Tensor) -> None:
    """Replace `model.lm_head` (a dense, possibly embedding-tied head) by a bias-free linear over its hot rows (a
    copy: a tied embedding keeps all its rows)."""
    weight = model.lm_head.weight.detach().index_select(0, hot.to(model.lm_head.weight.device)).contiguous()
    head = torch.nn.Linear(weight.shape[1], weight.shape[0], bias=False, device=weight.device, dtype=weight.dtype)
    head.weight = torch.nn.Parameter(weight, requires_grad=False)
    model.lm_head = head
