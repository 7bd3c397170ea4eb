"""Self-distillation data: prompts from text files, continued greedily by the frozen base model itself.

Medusa-2 (Cai et al. 2024, §2.3.2) and EAGLE train draft heads on the base model's own generations, so the
heads learn the base's distribution rather than the corpus's. Here: every non-empty line of the data files is a
prompt source; its first `prompt_len` tokens (BOS included) form a prompt; prompts are split deterministically
(under `seed`) into train and held-out sets; each prompt is continued by `num_tokens` greedy tokens of the base
(EOS does not stop it, as `SamplingParams(ignore_eos=True)`); the base's final hidden states (after the final
norm) over the whole sequence are computed once, since the base is frozen.

The base runs in `transformers` (a `LlamaForCausalLM` from a GGUF or an HF directory) with its KV cache: on the
2-core CPU 512 sequences × 96 tokens take ~2 s (Python overhead per step dominates a 260K-parameter model).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch


@dataclass(frozen=True)
class SelfDistillData:
    """Greedy sequences of the base and its hidden states, train and held-out.

    tokens: [S, prompt_len + num_tokens] int64 (prompt, then the base's greedy continuation).
    hidden: [S, prompt_len + num_tokens, H] fp32, the base's final-normed hidden states over `tokens`.
    prompt_len: tokens of each sequence that are prompt (text), not generated.
    num_train: the first `num_train` sequences are for training, the rest held out.
    """

    tokens: torch.Tensor
    hidden: torch.Tensor
    prompt_len: int
    num_train: int

    @property
    def train(self) -> tuple[torch.Tensor, torch.Tensor]:
        return self.tokens[: self.num_train], self.hidden[: self.num_train]

    @property
    def held_out(self) -> tuple[torch.Tensor, torch.Tensor]:
        return self.tokens[self.num_train :], self.hidden[self.num_train :]

    @property
    def held_out_prompts(self) -> list[list[int]]:
        """Token ids of the held-out prompts (for measuring acceptance on prompts the heads never saw)."""
        return self.tokens[self.num_train :, : self.prompt_len].tolist()


def _gguf_file(path: Path) -> Path | None:
    if path.is_file() and path.suffix == ".gguf":
        return path
    found = sorted(path.glob("*.gguf")) if path.is_dir() else []
    return found[0] if len(found) == 1 else None


def load_base(model_dir: str | Path):
    """The frozen base as a `transformers` causal LM (eval mode, no grads) and its tokenizer.

    `model_dir`: a `.gguf` file, a directory holding one (Llama family), or an HF checkpoint directory.
    For a GGUF the config's pad token is dropped: stories260K's GGUF says padding id 2**32 − 1, which
    `transformers` refuses (shared/data/README.md); the tokenizer is nextn's GGUF reader's (transformers' GGUF
    tokenizer conversion fails on that id too).
    Raises:
        ValueError: `model_dir` is none of those.
    """
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()
    path = Path(model_dir)
    gguf = _gguf_file(path)
    if gguf is None and not (path / "config.json").is_file():
        raise ValueError(f"base model {path} is neither a .gguf file, a directory holding one, nor an HF checkpoint "
                         "directory (config.json)")
    if gguf is not None:
        from nextn.build.gguf_reader import GGUFCheckpoint

        cfg = AutoConfig.from_pretrained(gguf.parent, gguf_file=gguf.name)
        cfg.pad_token_id = None
        model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, config=cfg,
                                                     dtype=torch.float32)
        tokenizer = GGUFCheckpoint(gguf).tokenizer()
    else:
        model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
        tokenizer = AutoTokenizer.from_pretrained(path)
    model.eval().requires_grad_(False)
    return model, tokenizer


def read_prompts(files: list[str | Path], tokenizer, prompt_len: int) -> list[list[int]]:
    """The first `prompt_len` token ids (BOS first) of every distinct non-empty line long enough, in file order.

    Raises:
        ValueError: no line of the files has `prompt_len` tokens.
    """
    seen: set[tuple[int, ...]] = set()
    prompts = []
    bos = tokenizer.bos_token_id
    for f in files:
        for line in Path(f).read_text(encoding="utf-8", errors="replace").splitlines():
            line = line.strip()
            if not line:
                continue
            ids = tokenizer(line, add_special_tokens=False).input_ids
            ids = ([bos] if bos is not None else []) + ids
            key = tuple(ids[:prompt_len])
            if len(ids) >= prompt_len and key not in seen:
                seen.add(key)
                prompts.append(list(key))
    if not prompts:
        raise ValueError(f"no line of {[str(f) for f in files]} has {prompt_len} tokens")
    return prompts


@torch.no_grad()
def greedy_continue(model, prompts: torch.Tensor, num_tokens: int, batch_size: int = 512) -> torch.Tensor:
    """prompts [S, P] int64 → [S, P + num_tokens]: the base's greedy continuations (EOS does not stop them)."""
    out = []
    for chunk in prompts.split(batch_size):
        res = model(chunk, use_cache=True)
        seq = [chunk]
        nxt = res.logits[:, -1].argmax(-1, keepdim=True)  # [b, 1]
        for _ in range(num_tokens - 1):
            seq.append(nxt)
            res = model(nxt, past_key_values=res.past_key_values, use_cache=True)
            nxt = res.logits[:, -1].argmax(-1, keepdim=True)
        seq.append(nxt)
        out.append(torch.cat(seq, dim=1))
    return torch.cat(out)


@torch.no_grad()
def final_hidden(model, tokens: torch.Tensor, batch_size: int = 256) -> torch.Tensor:
    """tokens [S, L] → the base's final hidden states [S, L, H] fp32, after the final norm."""
    return torch.cat([model.model(chunk).last_hidden_state.float() for chunk in tokens.split(batch_size)])


def make_self_distill_data(model, tokenizer, files: list[str | Path], *, prompt_len: int = 16,
                           num_tokens: int = 96, held_out_fraction: float = 0.1, max_prompts: int | None = None,
                           seed: int = 0) -> SelfDistillData:
    """Prompts from `files`, shuffled under `seed`, at most `max_prompts`, split train / held out, continued greedily.

    Raises:
        ValueError: no usable prompt, or too few for a held-out set.
    """
    prompts = read_prompts(files, tokenizer, prompt_len)
    order = torch.randperm(len(prompts), generator=torch.Generator().manual_seed(seed)).tolist()
    if max_prompts is not None:
        order = order[:max_prompts]
    num_held_out = max(1, round(len(order) * held_out_fraction))
    if len(order) - num_held_out < 1:
        raise ValueError(f"{len(order)} prompt(s) are too few to keep {num_held_out} held out")
    ids = torch.tensor([prompts[i] for i in order], dtype=torch.int64)  # [S, P]; train first, then held out
    tokens = greedy_continue(model, ids, num_tokens)
    return SelfDistillData(tokens, final_hidden(model, tokens), prompt_len, len(order) - num_held_out)
