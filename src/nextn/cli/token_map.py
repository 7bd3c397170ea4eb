"""`nextn token-map`: rank a model's tokens by their frequency in a corpus, for a draft head cut to its hot tokens.

Usage:
    nextn token-map --model_dir MODEL --corpus FILE [FILE ...] --out hot_tokens.json

MODEL: a `.gguf` file, an engine directory or an HF checkpoint (only its tokenizer is read). FILE: text corpora
(read whole) and prompt files (MT-bench, Spec-Bench, HumanEval, GSM8K JSON lines, optionally gzipped: their
prompt texts). Output: a JSON list of the token ids seen, the most frequent first (ties: the lower id first) —
what `speculative_config: {decoding_type: Draft_Target, draft_vocab_size: N, draft_token_map: FILE}` reads
(speculative/draft_vocab.py; FR-Spec, Zhao et al. 2025, ranks by corpus frequency the same way). Count text like the
requests the engine will serve: a code corpus for a code model. Ids the corpus never shows rank after it, lowest id
first.

Exit status: 0 written; 2 an unreadable model, tokenizer or corpus (a corpus file must be a regular file of at most
1 GiB), or an --out that is a directory or a file other than a token map (without --force).
"""

from __future__ import annotations

import argparse
import collections
import json
import sys
from pathlib import Path

from nextn.config.user_files import check_user_file, read_user_text
from nextn.progress import progress_bar

CHUNK_CHARS = 100_000  # text tokenized per call (a long file in pieces: the counts differ only at the seams)
MAX_CORPUS_BYTES = 1 << 30  # one corpus file (regular files only: /dev/zero or a FIFO is refused unread)


class TokenMapError(ValueError):
    """A model without a tokenizer or a corpus that cannot be read."""


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model_dir", required=True, type=Path,
                   help="the model whose tokenizer counts: a .gguf file, an engine directory or an HF checkpoint")
    p.add_argument("--corpus", required=True, nargs="+", type=Path,
                   help="text files (read whole) and prompt files (.jsonl[.gz]: their prompt texts)")
    p.add_argument("--out", required=True, type=Path,
                   help="the token map to write (JSON list of ids); an existing file is replaced only when it is a "
                   "token map")
    p.add_argument("--force", action="store_true", help="replace --out even when it is not a token map")


def load_tokenizer(model: Path):
    """The `transformers` tokenizer of a .gguf file, an engine directory or an HF checkpoint.

    Raises:
        TokenMapError: `model` is none of those or carries no tokenizer.
    """
    if model.is_file() and model.suffix == ".gguf":
        from nextn.build.gguf_reader import GGUFCheckpoint

        with GGUFCheckpoint(model) as ckpt:
            return ckpt.tokenizer()
    if (model / "manifest.json").is_file():
        from nextn.build.manifest import EngineManifest
        from nextn.runtime.tokenizer import EngineTokenizer

        tok = EngineTokenizer.load(model, EngineManifest.load(model).tokenizer_files)
        if tok is None:
            raise TokenMapError(f"the engine {model} carries no tokenizer; pass the checkpoint it was built from")
        return tok.tok
    if model.is_dir() and any((model / f).is_file() for f in ("tokenizer.json", "tokenizer_config.json")):
        from transformers import AutoTokenizer

        return AutoTokenizer.from_pretrained(str(model), trust_remote_code=False)
    raise TokenMapError(f"{model} is not a .gguf file, an engine or a checkpoint with a tokenizer")


def corpus_texts(files: list[Path]) -> list[str]:
    """The texts of `files`: a prompt file's prompts, a text file whole, cut into pieces of ≤ 100,000 characters.

    Raises:
        TokenMapError: a file is missing, not a regular file, larger than 1 GiB or unreadable.
    """
    from nextn.train.prompts import read_prompts

    for f in files:  # all of them before any is read
        check_user_file(f, "the corpus file", TokenMapError, MAX_CORPUS_BYTES)
    texts: list[str] = []
    for f in files:
        try:
            if f.name.removesuffix(".gz").endswith((".jsonl", ".json")):
                texts.extend(p.text for p in read_prompts([f], chat=False))
            else:
                text = read_user_text(f, "the corpus file", TokenMapError, MAX_CORPUS_BYTES, errors="replace")
                texts.extend(text[i:i + CHUNK_CHARS] for i in range(0, len(text), CHUNK_CHARS))
        except (OSError, ValueError) as e:
            raise TokenMapError(f"cannot read the corpus file {f}: {e}") from e
    return texts


def rank_tokens(tokenizer, texts: list[str]) -> tuple[list[int], list[int]]:
    """Token ids by count over `texts` (no special tokens added), most frequent first, ties by id; and their
    counts, in the same order."""
    counts: collections.Counter[int] = collections.Counter()
    for text in progress_bar(texts, desc="counting tokens", unit="text"):
        counts.update(tokenizer.encode(text, add_special_tokens=False))
    ids = sorted(counts, key=lambda i: (-counts[i], i))
    return ids, [counts[i] for i in ids]


def write_token_map(ids: list[int], out: Path, force: bool = False) -> None:
    """Write atomically (a temporary file renamed), so a failure leaves no half-written map.

    Raises:
        OutputPathError: `out` is a directory, a link, or an existing file that is not a token map (without `force`).
    """
    from nextn.build.output_files import is_token_map, write_output_file

    write_output_file(out, json.dumps(ids), "--out", is_token_map, force, "--force")


def run(args: argparse.Namespace) -> int:
    from nextn.build.output_files import check_output_file, is_token_map

    check_output_file(args.out, "--out", is_token_map, args.force, "--force")  # before the work
    try:
        texts = corpus_texts(args.corpus)
        tokenizer = load_tokenizer(args.model_dir)
        ids, counts = rank_tokens(tokenizer, texts)
    except TokenMapError as e:
        print(f"nextn token-map: error: {e}", file=sys.stderr)
        return 2
    write_token_map(ids, args.out, args.force)
    total = sum(counts)
    cover = ", ".join(f"the top {n}: {sum(counts[:n]) / max(total, 1):.2%}" for n in (8192, 16384, 32768))
    print(f"{args.out}: {len(ids)} distinct token ids of {len(tokenizer)} over {total} corpus tokens; share of the "
          f"corpus tokens covered by {cover}")
    return 0
