"""Training Medusa heads on a frozen base by self-distillation (Cai et al. 2024, Medusa-1 §2.2.1 + §2.3.2).

Head i at position t reads the base's final-normed hidden state h_t and predicts token t + i + 2 of the base's own
greedy sequence (the base lm_head predicts t + 1); the loss is Σ_i λ_i · CE(head_i(h_t), x_{t+i+2}) with Medusa's
λ_i = 0.8^i. Only positions whose draft chain is the base's own continuation count: t ≥ P − 1 for a prompt of P
tokens (at decode time the root t + 1 and everything after it are the base's greedy tokens), and t + i + 2 inside
the sequence. As in Medusa, each head's projection starts as a copy of the base lm_head and each ResBlock's linear
at zero, so an untrained head predicts what the base predicts for the next token; Adam, linearly decayed learning
rate. Two CPU-budget choices (both optional): the softmax runs over the tokens of the training data
(`LossVocab`; accuracy is measured over the full vocabulary), and the projection stays the base lm_head's copy
unless `train_projection` (Medusa-1 trains it: V·H more parameters per head). Heads are written as
`medusa_lm_head.safetensors` + `config.json` (FasterDecoding/Medusa), which `build-engine --medusa_model_dir` reads.
"""
from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import save_file

from nextn.models.medusa import MedusaHeads
from nextn.train.data import DataConfig, Rows
from nextn.train.loop import fit
from nextn.train.mtp import LossVocab, argmax_logits, class_loss, generated
from nextn.train.session import TrainResult, TrainSettings, claim_train_output, finish, prepare

#: Medusa paper, Vicuna-7B, per-head top-1 accuracy of heads 1..5 (FasterDecoding/Medusa).
VICUNA_7B_TOP1 = (0.56, 0.32, 0.20, 0.15, 0.12)
#: Medusa's per-head loss weight λ_i = DECAY^i.
DECAY = 0.8


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


def _head_hidden(heads: MedusaHeads, i: int, x: torch.Tensor) -> torch.Tensor:
    """Head i's ResBlocks over hidden x [..., H] → [..., H] (before its vocabulary projection)."""
    for block in heads[i][: heads.num_layers]:
        x = block(x)
    return x


def head_loss(heads: MedusaHeads, rows: Rows, vocab: LossVocab | None = None) -> torch.Tensor:
    """Σ_i 0.8^i · CE of head i at positions t ≥ prompt_len − 1 with t + i + 2 < length against the base's greedy
    token at t + i + 2 (`rows.targets`); the softmax over `vocab` (None: the full vocabulary)."""
    length = rows.tokens.shape[1]
    loss = rows.hidden.new_zeros(())
    for i in range(len(heads)):
        t = length - i - 2
        keep = generated(rows.prompt_lens, rows.lengths, t, 0, i + 2)
        x = _head_hidden(heads, i, rows.hidden[:, :t][keep])  # [N, H]
        w = heads[i][heads.num_layers].weight
        classes = None if vocab is None else vocab.classes(x, w)
        loss = loss + DECAY**i * class_loss(x, rows.targets[:, i + 2 :][keep], w, classes)
    return loss


@torch.no_grad()
def head_top1(heads: MedusaHeads, rows: Rows) -> list[float]:
    """Per-head top-1 accuracy (full vocabulary) over the same positions as `head_loss`."""
    length = rows.tokens.shape[1]
    accs = []
    for i in range(len(heads)):
        t = length - i - 2
        keep = generated(rows.prompt_lens, rows.lengths, t, 0, i + 2)
        pred = argmax_logits(_head_hidden(heads, i, rows.hidden[:, :t][keep]), heads[i][heads.num_layers].weight)
        accs.append((pred == rows.targets[:, i + 2 :][keep]).float().mean().item())
    return accs


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


def train_medusa(model_dir: str | Path, data_cfg: DataConfig, output_dir: str | Path, settings: TrainSettings, *,
                 num_heads: int = 4, num_layers: int = 1, train_projection: bool = False,
                 cache_dir: str | Path | None = None) -> TrainResult:
    """Self-distil `num_heads` Medusa heads onto the frozen base `model_dir` and write them to `output_dir`.

    train_projection: also train each head's own vocabulary projection (Medusa-1); default: it stays the base
        lm_head (copied into the file) and only the ResBlocks train — V·H fewer parameters per head to update.
    Also writes `train_draft.json` there (metrics, the split). `cache_dir` (default `output_dir/train_cache`)
    keeps the data and the resumable training state. Deterministic under the seeds (same thread count).
    Raises:
        ValueError: no usable prompt, or `num_heads` / `num_layers` / `steps` out of range.
    """
    if num_heads < 1 or num_layers < 0 or settings.steps < 0:
        raise ValueError(f"need num_heads ≥ 1, num_layers ≥ 0, steps ≥ 0 (got {num_heads}, {num_layers}, "
                         f"{settings.steps})")
    cache = claim_train_output(model_dir, data_cfg.files, output_dir, cache_dir)
    prep = prepare(model_dir, data_cfg, settings, cache)
    data = prep.data
    heads = init_heads(num_heads, num_layers, prep.lm_head.float())
    params = [p for name, p in heads.named_parameters() if train_projection or name.endswith(("linear.weight",
                                                                                             "linear.bias"))]
    vocab = LossVocab.of(data.train_token_ids()) if settings.loss_vocab == "data" else None
    top1_before = head_top1(heads, data.rows(data.held_out_rows))
    fitted = fit(params, lambda rows: head_loss(heads, data.rows(rows, settings.train_on_prompts), vocab),
                 lambda: head_top1(heads, data.rows(data.held_out_rows)), data.num_train, settings.steps,
                 batch=settings.batch, lr=settings.lr, seed=settings.seed, progress=settings.progress,
                 eval_every=settings.eval_every, desc="train Medusa heads", top1_start=top1_before,
                 state_path=cache / "train_state_medusa.pt",
                 run_key=settings.run_key(prep.data_key, num_heads=num_heads, num_layers=num_layers,
                                          train_projection=train_projection),
                 deadline=prep.deadline, checkpoint_every_s=settings.checkpoint_every_s, bf16=settings.bf16,
                 warmup=settings.warmup)
    save_heads(heads, output_dir, str(model_dir))
    vocab_size = len(vocab.ids) if vocab is not None else prep.model.config.vocab_size
    return finish(prep, "medusa", "medusa", num_heads, num_heads, settings, fitted, top1_before, vocab_size,
                  output_dir, data_cfg, num_layers=num_layers, train_projection=train_projection)
