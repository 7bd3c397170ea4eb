"""Training Medusa heads on a frozen base by self-distillation (Cai et al. 2024, Medusa-1 §2.2.1 + §2.3.2).

Head i at position t reads the base's final-normed hidden state h_t and predicts token t + i + 2 of the base's own
greedy sequence (the base lm_head predicts t + 1); the loss is Σ_i λ_i · CE(head_i(h_t), x_{t+i+2}) with Medusa's
λ_i = 0.8^i, full vocabulary. Only positions whose draft chain is the base's own continuation count: t ≥ P − 1
for a prompt of P tokens (at decode time the root t + 1 and everything after it are the base's greedy tokens).
As in Medusa, each head's projection starts as a copy of the base lm_head and each ResBlock's linear at zero, so
an untrained head predicts what the base predicts for the next token; Adam, linearly decayed learning rate.
Heads are written as `medusa_lm_head.safetensors` + `config.json` (REFERENCE.md §5), which `build-engine
--medusa_model_dir` reads.
"""

from __future__ import annotations

import json
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
import torch.nn.functional as F
from safetensors.torch import save_file

from nextn.models.medusa import MedusaHeads
from nextn.train.data import SelfDistillData, load_base, make_self_distill_data
from nextn.train.loop import fit

#: Medusa paper, Vicuna-7B, per-head top-1 accuracy of heads 1..5 (REFERENCE.md §5).
VICUNA_7B_TOP1 = (0.56, 0.32, 0.20, 0.15, 0.12)
#: Medusa's per-head loss weight λ_i = DECAY^i.
DECAY = 0.8


@dataclass
class MedusaTrainResult:
    """What `train_medusa` did; `top1_*` are per head, full-vocabulary argmax on held-out sequences."""

    num_heads: int
    num_layers: int
    steps: int
    final_loss: float
    top1_before: list[float]  # after initialisation (= the base's next-token head), before training
    top1_after: list[float]
    num_train: int  # training sequences
    num_held_out: int
    data_seconds: float  # greedy generation + hidden states
    train_seconds: float
    held_out_prompts: list[list[int]] = field(repr=False, default_factory=list)


def init_heads(num_heads: int, num_layers: int, lm_head: torch.Tensor) -> MedusaHeads:
    """Heads whose projections copy `lm_head` [V, H] and whose ResBlocks start as the identity (linear = 0)."""
    vocab, hidden = lm_head.shape
    heads = MedusaHeads(num_heads, num_layers, hidden, vocab)
    with torch.no_grad():
        for head in heads:
            for block in head[:num_layers]:
                block.linear.weight.zero_()
                block.linear.bias.zero_()
            head[num_layers].weight.copy_(lm_head)
    return heads


def _head_logits(heads: MedusaHeads, i: int, x: torch.Tensor) -> torch.Tensor:
    """Head i over hidden x [..., H] → logits [..., V] (differentiable; MedusaHeads.forward runs all heads)."""
    head = heads[i]
    for block in head[: heads.num_layers]:
        x = block(x)
    return head[heads.num_layers](x)


def head_loss(heads: MedusaHeads, tokens: torch.Tensor, hidden: torch.Tensor, prompt_len: int) -> torch.Tensor:
    """Σ_i 0.8^i · CE of head i at positions t ∈ [P − 1, L − i − 2) against tokens[t + i + 2]; tokens [B, L]."""
    length = tokens.shape[1]
    loss = hidden.new_zeros(())
    for i in range(len(heads)):
        h = hidden[:, prompt_len - 1 : length - i - 2]  # [B, T_i, H]
        labels = tokens[:, prompt_len + 1 + i :]  # [B, T_i]
        loss = loss + DECAY**i * F.cross_entropy(_head_logits(heads, i, h).flatten(0, 1), labels.flatten())
    return loss


@torch.no_grad()
def head_top1(heads: MedusaHeads, tokens: torch.Tensor, hidden: torch.Tensor, prompt_len: int) -> list[float]:
    """Per-head top-1 accuracy over the same positions as `head_loss`."""
    length = tokens.shape[1]
    accs = []
    for i in range(len(heads)):
        pred = _head_logits(heads, i, hidden[:, prompt_len - 1 : length - i - 2]).argmax(-1)
        accs.append((pred == tokens[:, prompt_len + 1 + i :]).float().mean().item())
    return accs


def fit_heads(heads: MedusaHeads, data: SelfDistillData, steps: int, *, batch: int = 64, lr: float = 1e-3,
              seed: int = 0, progress: bool = True, eval_every: int = 100) -> tuple[float, list[float]]:
    """Train `heads` in place on `data.train` for `steps` Adam steps; returns (last loss, held-out top-1)."""
    return fit(heads.parameters(), lambda tokens, hidden: head_loss(heads, tokens, hidden, data.prompt_len),
               lambda: head_top1(heads, *data.held_out, data.prompt_len), data.train, steps, batch=batch, lr=lr,
               seed=seed, progress=progress, eval_every=eval_every, desc="train Medusa heads")


def save_heads(heads: MedusaHeads, output_dir: str | Path, base_model: str) -> Path:
    """Write `medusa_lm_head.safetensors` (keys `{i}.{l}.linear.weight/bias`, `{i}.{L}.weight`) and `config.json`."""
    out = Path(output_dir)
    out.mkdir(parents=True, exist_ok=True)
    save_file({k: v.detach().contiguous() for k, v in heads.state_dict().items()},
              str(out / "medusa_lm_head.safetensors"))
    config = {"medusa_num_heads": len(heads), "medusa_num_layers": heads.num_layers,
              "base_model_name_or_path": base_model}
    (out / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    return out


def train_medusa(model_dir: str | Path, data_files: list[str | Path], output_dir: str | Path, *, num_heads: int = 4,
                 num_layers: int = 1, steps: int = 1000, seed: int = 0, batch: int = 64, lr: float = 1e-3,
                 prompt_len: int = 16, num_tokens: int = 96, max_prompts: int | None = None,
                 held_out_fraction: float = 0.1, progress: bool = True) -> MedusaTrainResult:
    """Self-distil `num_heads` Medusa heads onto the frozen base `model_dir` and write them to `output_dir`.

    Also writes `train_draft.json` there: the result's metrics and the held-out prompts' token ids (so
    acceptance can be measured on prompts the heads never saw). Deterministic under `seed` (same thread count).
    Raises:
        ValueError: no usable prompt in `data_files`, or `num_heads` / `num_layers` / `steps` out of range.
    """
    if num_heads < 1 or num_layers < 0 or steps < 0:
        raise ValueError(f"need num_heads ≥ 1, num_layers ≥ 0, steps ≥ 0 (got {num_heads}, {num_layers}, {steps})")
    start = time.perf_counter()
    torch.manual_seed(seed)
    model, tokenizer = load_base(model_dir)
    data = make_self_distill_data(model, tokenizer, data_files, prompt_len=prompt_len, num_tokens=num_tokens,
                                  held_out_fraction=held_out_fraction, max_prompts=max_prompts, seed=seed)
    data_seconds = time.perf_counter() - start
    heads = init_heads(num_heads, num_layers, model.lm_head.weight.detach().float())
    top1_before = head_top1(heads, *data.held_out, data.prompt_len)
    loss, top1_after = fit_heads(heads, data, steps, batch=batch, lr=lr, seed=seed, progress=progress)
    result = MedusaTrainResult(num_heads, num_layers, steps, loss, top1_before, top1_after, data.num_train,
                               data.tokens.shape[0] - data.num_train, data_seconds,
                               time.perf_counter() - start - data_seconds, data.held_out_prompts)
    save_heads(heads, output_dir, str(model_dir))
    (Path(output_dir) / "train_draft.json").write_text(json.dumps({"method": "medusa", **asdict(result)}) + "\n")
    return result


def measure_acceptance(model_dir: str | Path, heads_dir: str | Path, medusa_choices: list[list[int]],
                       prompts: list[list[int]], max_tokens: int = 96, engine_dir: str | Path | None = None) -> dict:
    """Greedy acceptance length of the heads through the public `LLM` API, and losslessness against plain decoding.

    Builds an engine of `model_dir` with the heads in `heads_dir` (into `engine_dir`, else a temporary directory)
    and decodes `prompts` (token ids) with `ignore_eos`. Returns {"acceptance_length": Σ tokens / Σ (decode steps
    + 1), "lossless": bool, "num_prompts", "tokens", "seconds"} (seconds of Medusa decoding).
    """
    import tempfile

    from nextn import LLM, SamplingParams
    from nextn.build.engine_builder import build_engine

    with tempfile.TemporaryDirectory() as tmp:
        engine = Path(engine_dir) if engine_dir is not None else Path(tmp) / "engine"
        build_engine(model_dir, engine, max_seq_len=max(len(p) for p in prompts) + max_tokens + 64, progress=False,
                     medusa_model_dir=heads_dir)
        sp = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
        start = time.perf_counter()
        outs = LLM(engine, speculative_config={"decoding_type": "Medusa", "medusa_choices": medusa_choices}).generate(
            prompts, sp)
        seconds = time.perf_counter() - start
        plain = LLM(engine, speculative_config=None).generate(prompts, sp)
    tokens = sum(len(o.outputs[0].token_ids) for o in outs)
    steps = sum(o.outputs[0].num_decode_steps + 1 for o in outs)
    return {"acceptance_length": tokens / steps, "num_prompts": len(prompts), "tokens": tokens, "seconds": seconds,
            "lossless": [o.outputs[0].token_ids for o in outs] == [o.outputs[0].token_ids for o in plain]}
