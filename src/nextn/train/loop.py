"""The training loop shared by the draft-head trainers: Adam with a linear decay, a progress bar with the loss and
per-head held-out top-1 accuracy, deterministic batches under a seed."""

from __future__ import annotations

from collections.abc import Callable, Iterable

import torch
from tqdm.auto import tqdm


def fit(params: Iterable[torch.nn.Parameter], loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
        top1_fn: Callable[[], list[float]], train: tuple[torch.Tensor, torch.Tensor], steps: int, *, batch: int,
        lr: float, seed: int, progress: bool, eval_every: int, desc: str) -> tuple[float, list[float]]:
    """Run `steps` Adam steps of `loss_fn(tokens[pick], hidden[pick])` over random batches of `train`.

    Args:
        train: (tokens [N, T] int64, hidden [N, T, H]) self-distillation sequences and the base's hidden states.
        top1_fn: held-out per-head top-1 accuracy (shown in the bar every `eval_every` steps).
    Returns:
        (the last loss, the final held-out top-1 per head).
    """
    gen = torch.Generator().manual_seed(seed)
    tokens, hidden = train
    optimizer = torch.optim.Adam(params, lr=lr)
    schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: 1 - s / max(steps, 1))
    top1 = top1_fn()
    loss_value = float("nan")
    bar = tqdm(range(steps), desc=desc, disable=not progress)
    for step in bar:
        pick = torch.randint(0, tokens.shape[0], (min(batch, tokens.shape[0]),), generator=gen)
        loss = loss_fn(tokens[pick], hidden[pick])
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
        schedule.step()
        loss_value = loss.item()
        if progress and ((step + 1) % eval_every == 0 or step + 1 == steps):
            top1 = top1_fn()
        bar.set_postfix(loss=f"{loss_value:.3f}", top1="/".join(f"{a:.2f}" for a in top1))
    return loss_value, top1_fn()
