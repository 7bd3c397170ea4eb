"""The training loop shared by the draft-head trainers: Adam with a linear decay, a progress bar with the loss and
per-head held-out top-1 accuracy, deterministic batches under a seed."""

from __future__ import annotations

from collections.abc import Callable, Iterable

import torch
from nextn.progress import progress_bar


def fit(params: Iterable[torch.nn.Parameter], loss_fn: Callable[..., torch.Tensor],
        top1_fn: Callable[[], list[float]], train: tuple[torch.Tensor, ...], steps: int, *, batch: int,
        lr: float, seed: int, progress: bool, eval_every: int, desc: str, warmup: int = 0,
        max_grad_norm: float | None = None, top1_start: list[float] | None = None) -> tuple[float, list[float]]:
    """Run `steps` Adam steps of `loss_fn(*(t[pick] for t in train))` over random batches of the rows of `train`.

    Args:
        train: row-aligned tensors, e.g. (tokens [N, T] int64, hidden [N, T, H]): self-distillation sequences and
            the base's hidden states.
        top1_fn: held-out per-head top-1 accuracy (shown in the bar every `eval_every` steps).
        warmup: steps of linear warm-up before the linear decay (0: decay only).
        max_grad_norm: clip the gradient norm to this (None: no clipping).
        top1_start: top-1 before training when the caller has it (else measured).
    Returns:
        (the last loss, the final held-out top-1 per head).
    """
    gen = torch.Generator().manual_seed(seed)
    params = list(params)
    num_rows = train[0].shape[0]
    optimizer = torch.optim.Adam(params, lr=lr)
    decay = (lambda s: 1 - s / max(steps, 1)) if not warmup else \
        (lambda s: min((s + 1) / warmup, 1 - s / max(steps, 1)))
    schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, decay)
    top1 = top1_start if top1_start is not None else top1_fn()
    loss_value = float("nan")
    bar = progress_bar(range(steps), enabled=progress, desc=desc)
    for step in bar:
        pick = torch.randint(0, num_rows, (min(batch, num_rows),), generator=gen)
        loss = loss_fn(*(t[pick] for t in train))
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        if max_grad_norm is not None:
            torch.nn.utils.clip_grad_norm_(params, max_grad_norm)
        optimizer.step()
        schedule.step()
        loss_value = loss.item()
        if progress and ((step + 1) % eval_every == 0 or step + 1 == steps):
            top1 = top1_fn()
        bar.set_postfix(loss=f"{loss_value:.3f}", top1="/".join(f"{a:.2f}" for a in top1))
    return loss_value, top1_fn()
